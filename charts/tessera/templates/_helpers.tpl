{{/*
Chart name, truncated to 63 characters (a label value's limit).
*/}}
{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every object: the release name, plus the chart name unless the
release name already contains it. Kept to 45 characters so that suffixes such as
"-controller-metrics" still fit the 63-character limit of Service names.
*/}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
chart label value: name-version.
*/}}
{{- define "tessera.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels shared by every object.
*/}}
{{- define "tessera.labels" -}}
helm.sh/chart: {{ include "tessera.chart" . }}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tessera
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component; call with (dict "root" $ "component" "agent").
*/}}
{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
All labels of one component's objects; call like tessera.selectorLabels.
*/}}
{{- define "tessera.componentLabels" -}}
{{ include "tessera.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
The image reference: repository, then @digest if set, else :tag (default appVersion).
*/}}
{{- define "tessera.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "tessera.agent.fullname" -}}
{{- printf "%s-agent" (include "tessera.fullname" .) }}
{{- end }}

{{- define "tessera.controller.fullname" -}}
{{- printf "%s-controller" (include "tessera.fullname" .) }}
{{- end }}

{{- define "tessera.fakeConfigMapName" -}}
{{- printf "%s-fake-gpus" (include "tessera.fullname" .) }}
{{- end }}

{{- define "tessera.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "tessera.agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tessera.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create }}
{{- default (include "tessera.controller.fullname" .) .Values.controller.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controller.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
True ("true") when fake GPUs are configured for at least one node.
*/}}
{{- define "tessera.fake.enabled" -}}
{{- if or (not (kindIs "invalid" .Values.agent.fake.default)) .Values.agent.fake.nodes }}true{{- end }}
{{- end }}

{{/*
One fake GPU description as the agent's YAML file format. A spec string
("4xH100-80GiB,2xMI300X-192GiB"; the count defaults to 1) is expanded into the file
format; a map is written as it is.
*/}}
{{- define "tessera.fake.file" -}}
{{- if kindIs "string" . }}
{{- $groups := list }}
{{- range $part := splitList "," . }}
{{- $p := trim $part }}
{{- if $p }}
{{- $count := 1 }}
{{- $profile := $p }}
{{- if regexMatch "^[0-9]+[xX]" $p }}
{{- $count = regexFind "^[0-9]+" $p | atoi }}
{{- $profile = regexReplaceAll "^[0-9]+[xX]" $p "" }}
{{- end }}
{{- $groups = append $groups (dict "profile" $profile "count" $count) }}
{{- end }}
{{- end }}
{{- toYaml (dict "gpus" $groups) }}
{{- else }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
Rules of the controller's role over namespaced objects (a ClusterRole, or a Role in
controller.watchNamespace).
*/}}
{{- define "tessera.controller.namespacedRules" -}}
# ModelInstances: watched and reconciled (no finalizers: owner references clean up).
- apiGroups: ["tessera.dev"]
  resources: ["modelinstances"]
  verbs: ["list", "watch"]
# Status (phase, conditions, plan) is written with server-side apply on the status subresource.
- apiGroups: ["tessera.dev"]
  resources: ["modelinstances/status"]
  verbs: ["patch"]
# Shard pods: created from the instance's template, deleted when lost or re-placed,
# patched to put back hand-edited device annotations.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete", "patch"]
# Shard pods use schedulerName tessera: the controller binds them to the planned node.
- apiGroups: [""]
  resources: ["pods/binding"]
  verbs: ["create"]
# The serving readiness gate of shard pods: True while a pod is wanted, False while
# a replica scaled away drains out of its Services.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# A moved replica's old pods go through the Eviction API once its new copy is Ready,
# so that PodDisruptionBudgets count.
- apiGroups: [""]
  resources: ["pods/eviction"]
  verbs: ["create"]
# The headless Service of each instance (stable DNS names of its shards); owner
# references delete it with the instance.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "patch"]
# Events on ModelInstances (placement decisions, lost shards, errors).
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if ne .Values.allocation "device-plugin" }}
# DRA: a ResourceClaim per shard on a DRA node (created with its pod, deleted when it
# is replaced or no longer wanted); others' claims are watched for the devices they hold.
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["list", "watch", "create", "delete"]
# The controller allocates its shards' claims itself, as a scheduler does.
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims/status"]
  verbs: ["update"]
{{- end }}
{{- end }}

{{- define "tessera.controller.leaseName" -}}
{{- default (include "tessera.controller.fullname" .) .Values.controller.leaseName }}
{{- end }}
