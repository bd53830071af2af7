# shellcheck shell=bash
# Helpers shared by the end-to-end scripts (sourced, not run). The caller sets
# NAMESPACE (where the instances are), RESOURCE_NAME, KUBELET_CHECKPOINT (may be empty),
# DRA_MANAGER_STATE (kubelet's record of prepared claims, with DRA; may be unset),
# TESSERA_NAMESPACE and FAKE_CONFIGMAP (the fake GPU ConfigMap), NODE (the node with the
# fake GPUs), DRIVER (the DRA driver, for slice_devices), KUBELET_PIDFILE (for
# restart_kubelet) and defines die MESSAGE and log MESSAGE; it removes "$API_USE" when
# it exits.

mi() { kubectl get mi "$1" -n "$NAMESPACE" -o json; }

# dump_state: what a failed check shows of the cluster: the nodes, NAMESPACE's pods,
# claims, instances' status and last events, and the controller's last log lines.
dump_state() {
  echo "--- nodes"
  kubectl get nodes -o wide || true
  echo "--- pods"
  kubectl get pods -n "$NAMESPACE" -o wide || true
  echo "--- claims"
  kubectl get resourceclaims -n "$NAMESPACE" -o wide 2>/dev/null || true
  echo "--- instances"
  kubectl get mi -n "$NAMESPACE" -o yaml | grep -A40 '^  status:' || true
  echo "--- events"
  kubectl get events -n "$NAMESPACE" --sort-by=.lastTimestamp | tail -20 || true
  echo "--- controller log"
  kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=controller --tail=40 || true
}

# fresh_start: the image (IMAGE) built and imported into the node from ARCHIVE, nothing
# left of an earlier run (NAMESPACE, the Helm release RELEASE, run by $helm, and its
# namespace TESSERA_NAMESPACE), NODE labelled for the agent.
fresh_start() {
  e2e/image.sh "${IMAGE:?}" "${ARCHIVE:?}"
  "$TESSERA_K8S_KIT/import-image.sh" "$ARCHIVE"
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=180s >/dev/null
  "${helm:?}" uninstall "${RELEASE:?}" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
  kubectl delete namespace "$TESSERA_NAMESPACE" --ignore-not-found --wait=true --timeout=180s >/dev/null
  kubectl label node "${NODE:?}" tessera.dev/gpu-node=true --overwrite >/dev/null
}

# mi_running INSTANCE: whether the instance's phase is Running.
mi_running() { [ "$(kubectl get mi "$1" -n "$NAMESPACE" -o jsonpath='{.status.phase}')" = Running ]; }

# event_reason OBJECT REASON: whether an Event of REASON names OBJECT in NAMESPACE.
event_reason() {
  kubectl get events -n "$NAMESPACE" --field-selector "involvedObject.name=$1" -o json \
    | jq -e --arg r "$2" '[.items[] | select(.reason == $r)] | length > 0' >/dev/null
}

# slice_devices: the devices of NODE's ResourceSlices of the DRA driver DRIVER.
slice_devices() {
  kubectl get resourceslices -o json | jq --arg node "${NODE:?}" --arg d "${DRIVER:?}" \
    '[.items[] | select(.spec.nodeName == $node and .spec.driver == $d) | .spec.devices[]?] | length'
}

# wait_until SECONDS DESCRIPTION COMMAND...: runs COMMAND every 3 s until it succeeds;
# on timeout fails with DESCRIPTION and the command's last output.
wait_until() {
  local seconds="$1" what="$2"
  shift 2
  local deadline=$((SECONDS + seconds)) out=""
  while true; do
    if out=$("$@" 2>&1); then
      return 0
    fi
    if ((SECONDS >= deadline)); then
      die "timed out after ${seconds}s waiting for: ${what}. Last check: ${out}"
    fi
    sleep 3
  done
}

sorted_csv() { tr ',' '\n' | sed '/^$/d' | sort | paste -sd, -; }

# shards_match_plan INSTANCE: every planned shard (of every replica) has its pod Running on the planned
# node, with the planned devices in its annotation and in what the container sees, and
# no other pods belong to the instance. Prints the first mismatch.
shards_match_plan() {
  local instance="$1" status plan count pods
  status=$(mi "$instance")
  plan=$(jq -c '.status.plan // []' <<<"$status")
  count=$(jq 'length' <<<"$plan")
  if [[ "$count" -eq 0 ]]; then
    echo "$instance has no plan yet (phase $(jq -r '.status.phase // "-"' <<<"$status"))"
    return 1
  fi
  pods=$(kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$instance" -o json)
  local npods
  npods=$(jq '[.items[] | select(.metadata.deletionTimestamp == null)] | length' <<<"$pods")
  if [[ "$npods" -ne "$count" ]]; then
    echo "$instance: $npods live pods for $count planned shards"
    return 1
  fi
  local i
  for ((i = 0; i < count; i++)); do
    local shard node devices pod name
    shard=$(jq -c ".[$i]" <<<"$plan")
    node=$(jq -r '.node' <<<"$shard")
    devices=$(jq -r '.devices | join(",")' <<<"$shard")
    name=$(jq -r --arg instance "$instance" --arg i "$i" \
      '(if (.replica // 0) == 0 then "" else "-r\(.replica)" end) as $r | (if (.copy // 0) == 1 then "-m" else "" end) as $m
       | "\($instance)\($r)\($m)-shard-\(.shard // ($i | tonumber))"' <<<"$shard")
    pod=$(jq -c --arg name "$name" '.items[] | select(.metadata.name == $name)' <<<"$pods")
    if [[ -z "$pod" ]]; then
      echo "pod $name does not exist"
      return 1
    fi
    local phase pod_node pod_devices
    phase=$(jq -r '.status.phase' <<<"$pod")
    pod_node=$(jq -r '.spec.nodeName // ""' <<<"$pod")
    pod_devices=$(jq -r '.metadata.annotations["tessera.dev/devices"] // ""' <<<"$pod")
    if [[ "$phase" != Running ]]; then
      echo "pod $name is $phase, not Running"
      return 1
    fi
    if [[ "$pod_node" != "$node" ]]; then
      echo "pod $name runs on $pod_node; the plan says $node"
      return 1
    fi
    if [[ "$(sorted_csv <<<"$pod_devices")" != "$(sorted_csv <<<"$devices")" ]]; then
      echo "pod $name is annotated with devices $pod_devices; the plan says $devices"
      return 1
    fi
    local seen
    seen=$(kubectl logs -n "$NAMESPACE" "$name" 2>/dev/null | sed -n 's/.*sees devices: //p' | tail -n 1)
    if [[ "$(sorted_csv <<<"$seen")" != "$(sorted_csv <<<"$devices")" ]]; then
      echo "pod $name sees TESSERA_VISIBLE_DEVICES='$seen'; the plan says $devices"
      return 1
    fi
    if [[ -n "${DRA_MANAGER_STATE:-}" ]]; then
      # kubelet's record of the claims it prepared, by device name; the agent's
      # ResourceSlice maps the names back to device IDs.
      local claim prepared ids
      claim=$(jq -r '.spec.resourceClaims[]? | select(.name == "gpus") | .resourceClaimName // ""' <<<"$pod")
      prepared=$(jq -r --arg claim "$claim" --arg ns "$NAMESPACE" '.Data | fromjson | [.ClaimInfoStateList[]?
          | select(.ClaimName == $claim and .Namespace == $ns) | .DriverState[]?.Devices[]?.DeviceName] | join(",")' \
        "$DRA_MANAGER_STATE")
      ids=$(kubectl get resourceslices -o json | jq -r --arg node "$node" --arg names "$prepared" '
          ($names | split(",")) as $want | [.items[] | select(.spec.nodeName == $node) | .spec.devices[]?
          | select(.name as $n | $want | index($n)) | .attributes.id.string] | join(",")')
      if [[ -z "$claim" || "$(sorted_csv <<<"$ids")" != "$(sorted_csv <<<"$devices")" ]]; then
        echo "kubelet prepared '$prepared' (devices '$ids') for claim '$claim' of pod $name; the plan says $devices"
        return 1
      fi
    fi
    if [[ -n "$KUBELET_CHECKPOINT" ]]; then
      local uid allocated
      uid=$(jq -r '.metadata.uid' <<<"$pod")
      allocated=$(jq -r --arg uid "$uid" --arg res "$RESOURCE_NAME" \
        '[.Data.PodDeviceEntries[]? | select(.PodUID == $uid and .ResourceName == $res)
          | .DeviceIDs | to_entries[] | .value[]] | join(",")' "$KUBELET_CHECKPOINT")
      if [[ "$(sorted_csv <<<"$allocated")" != "$(sorted_csv <<<"$devices")" ]]; then
        echo "kubelet allocated '$allocated' to pod $name; the plan says $devices"
        return 1
      fi
    fi
  done
  return 0
}

print_plan() {
  mi "$1" | jq -r '.status.plan[] | "  shard \(.shard): \(.node) [\(.devices | join(","))] layers \(.layerStart)-\(.layerEnd - 1)"'
}

# inject_fault NODE INDEX...: marks NODE's fake devices INDEX unhealthy in the fake GPU
# ConfigMap, in NODE's own file (a copy of default.yaml when it has none), or gives them
# the fault FAULT names instead (e.g. FAULT='memoryUsedGiB: 50'); restore_fault undoes
# it (a no-op when nothing is injected).
fault_key=""
fault_original=""
fault_had_key=0
inject_fault() {
  local node="$1" cm key original faulty index
  shift
  cm=$(kubectl get configmap "$FAKE_CONFIGMAP" -n "$TESSERA_NAMESPACE" -o json)
  if jq -e --arg k "$node.yaml" '.data[$k] != null' <<<"$cm" >/dev/null; then
    key="$node.yaml"
    fault_had_key=1
  else
    key=default.yaml
    fault_had_key=0
  fi
  original=$(jq -r --arg k "$key" '.data[$k] // ""' <<<"$cm")
  [[ -n "$original" ]] || die "ConfigMap $FAKE_CONFIGMAP has neither $node.yaml nor default.yaml"
  if grep -q '^faults:' <<<"$original"; then
    die "$FAKE_CONFIGMAP/$key already has faults; clear them before running this check"
  fi
  # Fault only this node: it gets its own copy of the default file.
  key="$node.yaml"
  faulty=$(printf '%s\nfaults:' "${original%$'\n'}")
  for index in "$@"; do
    faulty+=$(printf '\n  - {device: %s, %s}' "$index" "${FAULT:-unhealthy: \"e2e: injected fault\"}")
  done
  fault_key="$key"
  fault_original="$original"
  patch_fake_gpus "$(jq -n --arg k "$key" --arg v "$faulty" '{data: {($k): $v}}')"
}
restore_fault() {
  [[ -n "$fault_key" ]] || return 0
  local patch
  if [[ "$fault_had_key" -eq 1 ]]; then
    patch=$(jq -n --arg k "$fault_key" --arg v "$fault_original" '{data: {($k): $v}}')
  else
    patch=$(jq -n --arg k "$fault_key" '{data: {($k): null}}')
  fi
  patch_fake_gpus "$patch"
  fault_key=""
}
# patch_fake_gpus PATCH: the fake GPUs' ConfigMap merge-patched, and the agents told.
# kubelet brings a changed ConfigMap into the pods that mount it at its next sync of
# each pod (up to a minute or so); a change of a pod's annotations syncs that pod now
# (Kubernetes' ConfigMap documentation). The agents' pods get one; with none
# (uninstalled, or being replaced) there is nothing to hurry: a pod that starts mounts
# the ConfigMap as it is.
patch_fake_gpus() {
  kubectl patch configmap "$FAKE_CONFIGMAP" -n "$TESSERA_NAMESPACE" --type merge -p "$1" >/dev/null
  kubectl -n "$TESSERA_NAMESPACE" annotate pods -l app.kubernetes.io/component=agent --overwrite \
    "e2e.tessera.dev/fake-gpus-changed=$(date +%s%N)" >/dev/null 2>&1 || true
}

# instance NAME STAGES [RESTART_POLICY]: a ModelInstance of STAGES one-GPU pipeline
# stages whose shards print the devices they see and wait; RESTART_POLICY is its
# spec.restartPolicy (default RecreateReplica).
instance() {
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<EOF
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata:
  name: $1
spec:
  restartPolicy: ${3:-RecreateReplica}
  model:
    name: e2e/small
    parametersBillions: 8
    layers: 32
    dtype: bf16
  parallelism:
    tensor: 1
    pipeline: $2
  template:
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          command:
            - sh
            - -c
            - |
              echo "shard on \$(hostname) sees devices: \${TESSERA_VISIBLE_DEVICES:-<unset>}"
              trap 'exit 0' TERM INT
              while true; do sleep 3600 & wait \$!; done
EOF
}

# served_instance NAME MODEL [TENSOR] [PIPELINE]: a ModelInstance of MODEL (a YAML flow
# map) whose shards print the devices they see and serve their pod name over HTTP on
# 8080 (Ready once listening; an evicted pod keeps serving while the endpoints learn it
# is going), the Service NAME-api in front of it and a PodDisruptionBudget of
# minAvailable 1.
served_instance() {
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<EOF
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: $1}
spec:
  model: $2
  parallelism: {tensor: ${3:-1}, pipeline: ${4:-1}}
  template:
    spec:
      terminationGracePeriodSeconds: 10
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          command:
            - sh
            - -c
            - |
              echo "shard on \$(hostname) sees devices: \${TESSERA_VISIBLE_DEVICES:-<unset>}"
              mkdir -p /www && hostname > /www/index.html
              exec httpd -f -p 8080 -h /www
          ports: [{containerPort: 8080, name: http}]
          readinessProbe:
            tcpSocket: {port: http}
            initialDelaySeconds: 3
            periodSeconds: 2
          lifecycle:
            preStop: {exec: {command: [sleep, "4"]}}
---
apiVersion: v1
kind: Service
metadata: {name: $1-api}
spec:
  selector: {tessera.dev/instance: $1}
  ports: [{port: 8080, targetPort: http}]
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: $1}
spec:
  minAvailable: 1
  selector: {matchLabels: {tessera.dev/instance: $1}}
EOF
}

# vllm_example: examples/cpu-vllm-tiny.yaml as the e2e applies it: the host's vLLM
# install (the venv of TESSERA_TEST_VLLM_PYTHON and the Python it was made from)
# mounted, the image IMAGE.
vllm_example() {
  local venv base
  venv=$(cd "$(dirname "$TESSERA_TEST_VLLM_PYTHON")/.." && pwd)
  base=$("$TESSERA_TEST_VLLM_PYTHON" -c 'import sys; print(sys.base_prefix)')
  sed -e "s#/opt/vllm-cpu#$venv#g" -e "s#/opt/python#$base#g" -e "s#image: tessera:0.1.0#image: ${IMAGE:?}#" \
    -e "s#imagePullPolicy: IfNotPresent#imagePullPolicy: Never#" examples/cpu-vllm-tiny.yaml
}

# --- the components' /metrics ----------------------------------------------------

# scrape NAMESPACE POD PORT: the pod's /metrics, through a port-forward. A forward
# can fail to open (a local port taken, the kubelet's stream not ready yet), so up to
# three are tried, each on a fresh local port.
scrape() {
  local port out="" pf i attempt errors
  errors=$(mktemp)
  for attempt in 1 2 3; do
    port=$((20000 + RANDOM % 20000))
    kubectl -n "$1" port-forward "pod/$2" "$port:$3" >/dev/null 2>>"$errors" &
    pf=$!
    for i in $(seq 1 50); do
      out=$(curl -sf --max-time 3 "http://127.0.0.1:$port/metrics") && break
      sleep 0.2
    done
    kill "$pf" 2>/dev/null || true
    wait "$pf" 2>/dev/null || true
    [[ -z "$out" ]] || break
  done
  [[ -n "$out" ]] || {
    echo "no /metrics from $1/$2 port $3 in $attempt port-forwards: $(tail -3 "$errors")"
    rm -f "$errors"
    return 1
  }
  rm -f "$errors"
  printf '%s\n' "$out"
}

# browse NAMESPACE POD PORT PATH DOM [SCREENSHOT]: the page PATH of the pod's PORT
# loaded in headless Chromium through a port-forward (tried up to three times, as
# scrape): the DOM the browser built goes to DOM, a picture of it to SCREENSHOT.
browse() {
  local port pf i attempt errors ok=0 url
  errors=$(mktemp)
  for attempt in 1 2 3; do
    port=$((20000 + RANDOM % 20000))
    url="http://127.0.0.1:$port$4"
    kubectl -n "$1" port-forward "pod/$2" "$port:$3" >/dev/null 2>>"$errors" &
    pf=$!
    for i in $(seq 1 50); do
      curl -sf --max-time 3 -o /dev/null "$url" && { ok=1; break; }
      sleep 0.2
    done
    if [[ "$ok" == 1 ]]; then
      # Root in CI: Chromium's sandbox needs user namespaces it may not have.
      timeout 60 chromium --headless --no-sandbox --disable-gpu --dump-dom "$url" >"$5" 2>>"$errors" || ok=0
      if [[ "$ok" == 1 && -n "${6:-}" ]]; then
        timeout 60 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
          --window-size=1280,1400 --screenshot="$6" "$url" >/dev/null 2>>"$errors" || ok=0
      fi
    fi
    kill "$pf" 2>/dev/null || true
    wait "$pf" 2>/dev/null || true
    [[ "$ok" == 0 ]] || break
  done
  [[ "$ok" == 1 ]] || {
    echo "no page $4 from $1/$2 port $3 in $attempt port-forwards: $(tail -3 "$errors")"
    rm -f "$errors"
    return 1
  }
  rm -f "$errors"
}

component_pods() {
  kubectl -n "$TESSERA_NAMESPACE" get pods -l "app.kubernetes.io/component=$1" -o json \
    | jq -r '.items[] | select(.metadata.deletionTimestamp == null) | .metadata.name'
}

pod_port() {
  kubectl -n "$TESSERA_NAMESPACE" get pod "$1" -o jsonpath='{.spec.containers[0].ports[?(@.name=="metrics")].containerPort}'
}

# --- what the components use of what they are granted ---------------------------

API_USE=$(mktemp)
# record_api_use COMPONENT POD...: adds the API requests the pods made ("COMPONENT verb
# resource" lines); called before a test deletes a pod, and at the end.
record_api_use() {
  local component="$1" pod text
  shift
  for pod in "$@"; do
    text=$(scrape "$TESSERA_NAMESPACE" "$pod" "$(pod_port "$pod")") || die "$text"
    sed -nE "s/^tessera_${component}_api_requests_total\{verb=\"([a-z]+)\",resource=\"([^\"]*)\"\}.*/${component} \1 \2/p" <<<"$text" >>"$API_USE"
  done
}
# Discovery documents are not resources: every authenticated user may read them.
used() { awk -v c="$1" '$1 == c && $3 !~ /^discovery:/ { print $2, $3 }' "$API_USE" | sort -u; }

# granted COMPONENT: "verb group/resource" for every rule bound to its ServiceAccount.
granted() {
  local sa bindings kind ns name role
  sa=$(kubectl -n "$TESSERA_NAMESPACE" get pods -l "app.kubernetes.io/component=$1" -o jsonpath='{.items[0].spec.serviceAccountName}')
  bindings=$(kubectl get clusterrolebindings,rolebindings -A -o json \
    | jq -r --arg sa "$sa" --arg ns "$TESSERA_NAMESPACE" '.items[]
        | select(any(.subjects[]?; .kind == "ServiceAccount" and .name == $sa and .namespace == $ns))
        | "\(.roleRef.kind) \(.metadata.namespace // "-") \(.roleRef.name)"')
  while read -r kind ns name; do
    if [[ "$kind" == ClusterRole ]]; then
      role=$(kubectl get clusterrole "$name" -o json)
    else
      role=$(kubectl -n "$ns" get role "$name" -o json)
    fi
    jq -r '.rules[] | .verbs[] as $v | .apiGroups[] as $g | .resources[] as $r
      | "\($v) \(if $g == "" then "core" else $g end)/\($r)"' <<<"$role"
  done <<<"$bindings" | sort -u
}

# least_privilege [COMPONENT VERB RESOURCE]...: what the agent and the controller
# requested (record_api_use, for every pod they ran as) is exactly what their roles
# grant: nothing missing, nothing unused except the grants listed.
least_privilege() {
  local component unused missing
  for component in agent controller; do
    unused=$(comm -23 <(granted "$component") <(used "$component") \
      | grep -vxF -f <(printf '%s\n' "$@" | sed -n "s/^$component //p") || true)
    missing=$(comm -13 <(granted "$component") <(used "$component"))
    [[ -z "$missing" ]] || die "the $component used what its roles do not grant: $(paste -sd';' <<<"$missing")"
    [[ -z "$unused" ]] || die "the $component is granted what it never used here: $(paste -sd';' <<<"$unused")
(used: $(used "$component" | paste -sd';'))"
    log "the $component used every permission it is granted, and no other: $(used "$component" | paste -sd';')"
  done
}

# --- kubelet ---------------------------------------------------------------------

# restart_kubelet: stops the node's kubelet and starts it again as it was started.
restart_kubelet() {
  local pid log_file i
  pid=$(cat "$KUBELET_PIDFILE")
  [[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/cmdline" ]] || die "no kubelet runs as PID '$pid' ($KUBELET_PIDFILE)"
  local -a command environment
  mapfile -d '' -t command <"/proc/$pid/cmdline"
  mapfile -d '' -t environment <"/proc/$pid/environ"
  log_file=$(readlink "/proc/$pid/fd/1")
  kill -TERM "$pid"
  for i in $(seq 1 120); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.25
  done
  kill -0 "$pid" 2>/dev/null && die "kubelet (PID $pid) did not stop"
  setsid nohup env -i "${environment[@]}" "${command[@]}" >>"$log_file" 2>&1 </dev/null &
  echo $! >"$KUBELET_PIDFILE"
  log "kubelet restarted (PID $pid -> $!)"
}

node_ready() {
  [[ "$(kubectl get node "${NODE:?}" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]] \
    || {
      echo "$NODE is not Ready"
      return 1
    }
}

# --- a client of an instance's Service -----------------------------------------------

# poll_service SERVICE INSTANCE DIR: every 0.3 s, every ready address of SERVICE's
# EndpointSlices answers on port 8080 (as kube-proxy would pick one; the kits run no
# kube-proxy), or the round counts a failure (in DIR/failures). DIR/counts holds "ok
# failed fewest", fewest being the least INSTANCE's status ever said were ready. Runs
# until killed (start it with &).
poll_service() {
  local service="$1" instance="$2" dir="$3"
  local ok=0 failed=0 fewest=9 slices addresses address ready
  while true; do
    slices=$(kubectl get endpointslices -n "$NAMESPACE" -l "kubernetes.io/service-name=$service" -o json 2>/dev/null) || continue
    addresses=$(jq -r '.items[].endpoints[]? | select(.conditions.ready == true) | .addresses[0]' <<<"$slices")
    if [[ -z "$addresses" ]]; then
      failed=$((failed + 1))
      echo "$(date +%T) no ready address" >>"$dir/failures"
    fi
    for address in $addresses; do
      if curl -fsS -m 2 "http://$address:8080/" >/dev/null 2>>"$dir/failures"; then
        ok=$((ok + 1))
      else
        failed=$((failed + 1))
        echo "$(date +%T) $address failed" >>"$dir/failures"
      fi
    done
    ready=$(kubectl get mi "$instance" -n "$NAMESPACE" -o jsonpath='{.status.readyReplicas}' 2>/dev/null || echo "")
    [[ "$ready" =~ ^[0-9]+$ ]] && ((ready < fewest)) && fewest=$ready
    echo "$ok $failed $fewest" >"$dir/counts"
    sleep 0.3
  done
}
