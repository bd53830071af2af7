#!/usr/bin/env bash
# End-to-end assertions against a cluster that runs tessera with fake GPUs (the chart
# with agent.backend=fake, as e2e/run.sh installs it on kind). Works against any such
# cluster through KUBECONFIG:
#
#   KUBECONFIG=/path/to/kubeconfig e2e/check.sh
#
# It applies examples/llama-7b.yaml and examples/llama-70b.yaml and asserts that
#   1. every instance reaches phase Running, each shard pod <instance>-shard-<i> runs on
#      .status.plan[i].node and sees exactly .status.plan[i].devices, and the headless
#      Service <instance> belongs to the instance;
#   2. an instance too large for the cluster stays Pending with condition Placed=False
#      and a message saying why;
#   3. a fault injected into the fake device of a shard (by editing the fake GPU
#      ConfigMap) gets that shard re-placed onto other devices;
#   4. deleting the instances removes their pods and Services.
# The ConfigMap is restored and the test namespace deleted on exit (KEEP=1 keeps the
# namespace for a look around).
#
# Environment: E2E_NAMESPACE (tessera-e2e) where the instances go; TESSERA_NAMESPACE
# (tessera-system) and FAKE_CONFIGMAP (tessera-fake-gpus) where the chart is; TIMEOUT
# (300) seconds for each wait; RESOURCE_NAME (tessera.dev/gpu); KUBELET_CHECKPOINT, when
# it names kubelet's device plugin checkpoint file (readable on a node the shards run on,
# .../device-plugins/kubelet_internal_checkpoint), also compares what kubelet allocated
# to each shard's container with the plan.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly NAMESPACE="${E2E_NAMESPACE:-tessera-e2e}"
readonly TESSERA_NAMESPACE="${TESSERA_NAMESPACE:-tessera-system}"
readonly FAKE_CONFIGMAP="${FAKE_CONFIGMAP:-tessera-fake-gpus}"
readonly TIMEOUT="${TIMEOUT:-300}"
readonly RESOURCE_NAME="${RESOURCE_NAME:-tessera.dev/gpu}"
readonly KEEP="${KEEP:-0}"
readonly KUBELET_CHECKPOINT="${KUBELET_CHECKPOINT:-}"
readonly INSTANCES=(llama-7b llama-70b)
readonly TOO_BIG=tessera-e2e-too-big
# The instance whose shard 0 gets a fault injected.
readonly FAULTED=llama-7b

log() { printf '[check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

die() {
  echo "check FAILED: $*" >&2
  {
    echo "--- ModelInstances"
    kubectl get mi -n "$NAMESPACE" -o wide || true
    echo "--- pods"
    kubectl get pods -n "$NAMESPACE" -o wide || true
    echo "--- instance status"
    kubectl get mi -n "$NAMESPACE" -o json | jq '.items[] | {name: .metadata.name, status}' || true
  } >&2
  exit 1
}

for tool in kubectl jq; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is required but not on PATH"
done

# shellcheck source=e2e/lib.sh
source e2e/lib.sh

# --- preflight -------------------------------------------------------------------
kubectl get crd modelinstances.tessera.dev >/dev/null 2>&1 \
  || die "the ModelInstance CRD is not installed (helm install tessera charts/tessera first)"
gpu_nodes=$(kubectl get nodes -o json \
  | jq -r --arg r "$RESOURCE_NAME" '.items[] | select((.status.allocatable[$r] // "0") != "0") | "\(.metadata.name)=\(.status.allocatable[$r])"')
[[ -n "$gpu_nodes" ]] || die "no node has allocatable $RESOURCE_NAME: are the agents running and registered?"
log "nodes with $RESOURCE_NAME: $(paste -sd' ' <<<"$gpu_nodes")"
kubectl get configmap "$FAKE_CONFIGMAP" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 \
  || die "ConfigMap $TESSERA_NAMESPACE/$FAKE_CONFIGMAP not found: this check needs the fake backend"

created_namespace=0

cleanup() {
  local rc=$?
  if [[ -n "$fault_key" ]]; then
    log "restoring ConfigMap $FAKE_CONFIGMAP"
    restore_fault || echo "warning: could not restore ConfigMap $FAKE_CONFIGMAP key $fault_key" >&2
  fi
  if [[ "$created_namespace" -eq 1 && "$KEEP" != 1 ]]; then
    kubectl delete namespace "$NAMESPACE" --wait=false >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT

if ! kubectl get namespace "$NAMESPACE" >/dev/null 2>&1; then
  kubectl create namespace "$NAMESPACE" >/dev/null
  created_namespace=1
fi

# --- 1. the examples run where they were planned --------------------------------
for instance in "${INSTANCES[@]}"; do
  log "applying examples/$instance.yaml"
  kubectl apply -n "$NAMESPACE" -f "examples/$instance.yaml" >/dev/null
done
for instance in "${INSTANCES[@]}"; do
  log "waiting for $instance to reach Running"
  kubectl wait -n "$NAMESPACE" "mi/$instance" --for=jsonpath='{.status.phase}'=Running \
    --timeout="${TIMEOUT}s" >/dev/null || die "$instance did not reach phase Running"
  wait_until "$TIMEOUT" "$instance shard pods to match the plan" shards_match_plan "$instance"
  status=$(mi "$instance")
  shards=$(jq -r '.status.shards' <<<"$status")
  ready=$(jq -r '.status.readyShards' <<<"$status")
  [[ "$shards" == "$ready" ]] || die "$instance is Running with $ready of $shards shards ready"
  svc=$(kubectl get service "$instance" -n "$NAMESPACE" -o json 2>/dev/null) \
    || die "headless Service $instance does not exist"
  [[ "$(jq -r '.spec.clusterIP' <<<"$svc")" == None ]] || die "Service $instance is not headless"
  owner=$(jq -r '.metadata.ownerReferences[]? | select(.kind == "ModelInstance") | .name' <<<"$svc")
  [[ "$owner" == "$instance" ]] || die "Service $instance is not owned by ModelInstance $instance (owner: '${owner}')"
  log "$instance Running, $ready/$shards shards on their planned devices:"
  print_plan "$instance"
done

# --- 2. an unsatisfiable instance says why ---------------------------------------
log "applying $TOO_BIG (a 1000B-parameter model: more memory than the whole cluster)"
kubectl apply -n "$NAMESPACE" -f - >/dev/null <<EOF
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata:
  name: ${TOO_BIG}
spec:
  model:
    name: e2e/too-big
    parametersBillions: 1000
    layers: 120
    dtype: bf16
  parallelism:
    tensor: 1
    pipeline: auto
  template:
    spec:
      containers:
        - name: shard
          image: busybox:1.37
          command: ["sleep", "3600"]
EOF
kubectl wait -n "$NAMESPACE" "mi/$TOO_BIG" \
  --for=jsonpath='{.status.conditions[?(@.type=="Placed")].status}'=False \
  --timeout="${TIMEOUT}s" >/dev/null || die "$TOO_BIG has no condition Placed=False"
status=$(mi "$TOO_BIG")
phase=$(jq -r '.status.phase' <<<"$status")
[[ "$phase" == Pending ]] || die "$TOO_BIG is $phase, expected Pending"
message=$(jq -r '.status.conditions[] | select(.type == "Placed") | .message // ""' <<<"$status")
[[ -n "$message" ]] || die "$TOO_BIG: condition Placed=False has no message"
pods=$(kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$TOO_BIG" -o name)
[[ -z "$pods" ]] || die "$TOO_BIG is unsatisfiable but has pods: $pods"
log "$TOO_BIG Pending, Placed=False: $message"

# --- 3. a faulty device gets its shard re-placed ---------------------------------
plan0=$(mi "$FAULTED" | jq -c '.status.plan[0]')
node=$(jq -r '.node' <<<"$plan0")
device=$(jq -r '.devices[0]' <<<"$plan0")
index=$(kubectl get node "$node" -o json \
  | jq -r --arg id "$device" '.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .devices[] | select(.id == $id) | .index')
[[ "$index" =~ ^[0-9]+$ ]] || die "device $device is not in node $node's published GPU state"

log "injecting a fault into $node device $index ($device), shard 0 of $FAULTED"
inject_fault "$node" "$index"

device_unhealthy() {
  kubectl get node "$node" -o json \
    | jq -e --arg id "$device" '.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .devices[] | select(.id == $id) | .health == "Unhealthy"' >/dev/null \
    || { echo "$device on $node is not reported Unhealthy yet"; return 1; }
}
# kubelet syncs ConfigMap volumes periodically (about a minute by default).
wait_until "$TIMEOUT" "$node to publish $device as Unhealthy" device_unhealthy
log "$node publishes $device as Unhealthy"

shard0_moved() {
  local now
  now=$(mi "$FAULTED" | jq -c '.status.plan[0] // empty')
  if [[ -z "$now" ]]; then
    echo "$FAULTED has no shard 0 in its plan"
    return 1
  fi
  if jq -e --arg node "$node" --arg id "$device" '.node == $node and (.devices | index($id) != null)' <<<"$now" >/dev/null; then
    echo "shard 0 of $FAULTED is still planned on $node/$device"
    return 1
  fi
}
wait_until "$TIMEOUT" "shard 0 of $FAULTED to be re-placed off $node/$device" shard0_moved
kubectl wait -n "$NAMESPACE" "mi/$FAULTED" --for=jsonpath='{.status.phase}'=Running \
  --timeout="${TIMEOUT}s" >/dev/null || die "$FAULTED did not return to Running after the fault"
wait_until "$TIMEOUT" "$FAULTED shard pods to match the new plan" shards_match_plan "$FAULTED"
log "$FAULTED re-placed:"
print_plan "$FAULTED"
restore_fault
log "fault cleared"

# --- 4. deleting the instances cleans up -----------------------------------------
log "deleting the instances"
kubectl delete mi -n "$NAMESPACE" "${INSTANCES[@]}" "$TOO_BIG" --wait=true --timeout="${TIMEOUT}s" >/dev/null \
  || die "deleting the ModelInstances did not finish"
gone() {
  local left
  left=$(
    for instance in "${INSTANCES[@]}" "$TOO_BIG"; do
      kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$instance" -o name
      kubectl get service "$instance" -n "$NAMESPACE" -o name --ignore-not-found
    done
  )
  if [[ -n "$left" ]]; then
    echo "still there: $(paste -sd' ' <<<"$left")"
    return 1
  fi
}
wait_until "$TIMEOUT" "the instances' pods and Services to be deleted" gone
log "pods and Services deleted"

log "all checks passed"
