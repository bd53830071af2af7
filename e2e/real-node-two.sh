#!/usr/bin/env bash
# End-to-end on two real nodes: the kit's node-1 with 2 fake H100s and node-2 (the
# kit's node2.sh: its own kubelet, containerd, kubelet root, node IP and pod bridge)
# with 2 fake A100s, an agent on each (the chart's DaemonSet), the controller once (on
# node-1), a node grace period of 20 s. ALLOCATION picks how kubelet hands the GPUs
# out: device-plugin (default) or dra (the agents are DRA drivers, the controller
# allocates every shard's claim).
#   1. pipeline: a two-stage pipeline of two GPUs a stage (four GPUs: more than either
#      node has) runs with a stage on each node, each shard on its planned devices;
#      each stage's pod reaches the other at the address in its environment
#      (TESSERA_NEXT_PEER, TESSERA_PREVIOUS_PEER), resolved as cluster DNS would, from
#      the headless Service's EndpointSlice (the kit runs no DNS);
#   2. drained: `small` (one GPU, serving HTTP behind the Service small-api, with a
#      PodDisruptionBudget of minAvailable 1) runs on node-1; `kubectl drain node-1`
#      waits on the budget until small's new copy on node-2 is Ready (the controller
#      moves it make before break off the cordoned node), then goes through; a client
#      polling small-api sees no request fail;
#   3. dead_node: small set to `placement.moves: Never` (re-placing a replica off a
#      lost node is not a move), node-2's kubelet killed: once the node is NotReady
#      past the grace period, small is re-placed on node-1 and serves again, its pod on
#      node-2 deleted at once (Event PodReleased) rather than left Terminating;
#   4. node_back: node-2's kubelet started again: it stops the old pod's container,
#      its record of allocated devices (device plugin checkpoint or prepared claims)
#      and the agent's allocation record hold no pod that is gone, and an instance
#      pinned to node-2 gets both its GPUs, each given once;
#   5. vllm_drained: a real runtime moved under load: `tiny` (vLLM's CPU build,
#      examples/cpu-vllm-tiny.yaml, with a PodDisruptionBudget; made while node-2 is
#      down, so that it starts during the checks between) serves on node-1 while
#      2 clients send it 2 OpenAI completions a second (e2e/load.py: light enough
#      that the new copy starts beside it); `kubectl drain node-1`
#      goes through once its new copy on node-2 serves, the old copy having left the
#      Service before its eviction, and no request fails (skipped without
#      TESSERA_TEST_VLLM_PYTHON).
# Needs what e2e/real-node.sh needs, the kit's node2.sh, and curl.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE=node-1 NODE2=node-2
readonly NAMESPACE=tessera-e2e-two
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
readonly TIMEOUT="${TIMEOUT:-240}"
readonly GRACE=20
readonly ALLOCATION="${ALLOCATION:-device-plugin}"
readonly FAKE_CONFIGMAP=tessera-fake-gpus RESOURCE_NAME=tessera.dev/gpu DRIVER=gpu.tessera.dev
readonly KUBELET_CHECKPOINT="" KUBELET_PIDFILE=""
# node-2's kubelet root and state, as seen from this host (the kit's node2.sh).
readonly NODE2_KUBELET_ROOT="${NODE2_KUBELET_ROOT:-/var/lib/kubelet-node2}"
readonly NODE2_STATE="${NODE2_STATE_DIR:-/var/tmp/local-k8s136-node2}"
readonly NODE2_RUN="${NODE2_RUN_DIR:-/run/local-k8s136-node2}"
kubectl_bin="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"
work=$(mktemp -d)

current_test=setup
log() { printf '[real-node-two %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
die() {
  echo "real-node two-node check FAILED in $current_test: $*" >&2
  {
    declare -F dump_state >/dev/null && dump_state
    echo "real-node two-node check FAILED in $current_test: $*"
  } >&2
  exit 1
}
case "$ALLOCATION" in
  device-plugin | dra) ;;
  *) die "ALLOCATION is '$ALLOCATION'; use device-plugin or dra" ;;
esac
[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/node2.sh" ] || die "TESSERA_K8S_KIT does not name a kit with node2.sh"
export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl_bin")"):$PATH"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh
CRI="$(dirname "$TESSERA_TEST_KUBECONFIG")/bin/cri"
readonly CRI

poller=""
cleanup() {
  [[ -n "$poller" ]] && kill "$poller" 2>/dev/null
  rm -rf "$API_USE" "$work"
  kubectl uncordon "$NODE" "$NODE2" >/dev/null 2>&1 || true
  [ "${KEEP:-0}" = 1 ] && return 0
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
  "$helm" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
  "$TESSERA_K8S_KIT/node2.sh" down >/dev/null 2>&1 || true
  kubectl delete node "$NODE2" --ignore-not-found >/dev/null 2>&1 || true
}
trap cleanup EXIT

"$TESSERA_K8S_KIT/node2.sh" up >/dev/null || die "node2.sh up failed"
fresh_start
K8S_RUN_DIR="$NODE2_RUN" "$TESSERA_K8S_KIT/import-image.sh" "$ARCHIVE" >/dev/null
kubectl label node "$NODE2" tessera.dev/gpu-node=true --overwrite >/dev/null
# Both nodes share this host's network: each agent listens on its own node's address.
"$helm" install "$RELEASE" charts/tessera -n "$TESSERA_NAMESPACE" --create-namespace \
  -f e2e/values-real-node.yaml --set allocation="$ALLOCATION" \
  --set agent.fake.nodes.node-1=2xH100-80GiB --set agent.fake.nodes.node-2=2xA100-80GiB \
  --set agent.listenOnPodIP=true --set agent.publishInterval=5 \
  --set controller.nodeGracePeriod="$GRACE" --set-string 'controller.nodeSelector.kubernetes\.io/hostname'="$NODE" \
  --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready: $(kubectl -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"

# offered NODE: the GPUs NODE offers (allocatable, or its ResourceSlices' devices).
offered() {
  if [[ "$ALLOCATION" == dra ]]; then
    NODE="$1" slice_devices
  else
    kubectl get node "$1" -o jsonpath='{.status.allocatable.tessera\.dev/gpu}'
  fi
}
offers() { [[ "$(offered "$1")" == "$2" ]]; }
wait_until "$TIMEOUT" "2 GPUs offered on $NODE" offers "$NODE" 2
wait_until "$TIMEOUT" "2 GPUs offered on $NODE2" offers "$NODE2" 2
kubectl create namespace "$NAMESPACE" >/dev/null
log "an agent on each node ($ALLOCATION): 2 H100s on $NODE, 2 A100s on $NODE2"

# pod_node POD: the node POD runs on (empty when it does not exist).
pod_node() { kubectl get pod "$1" -n "$NAMESPACE" -o jsonpath='{.spec.nodeName}' 2>/dev/null || true; }

current_test=pipeline
served_instance pipe '{name: e2e/pipe, parametersBillions: 70, layers: 80, kvCacheGiB: 1}' 2 2
wait_until "$TIMEOUT" "pipe's shards running on their planned devices" shards_match_plan pipe
[[ "$(pod_node pipe-shard-0)" != "$(pod_node pipe-shard-1)" ]] \
  || die "both of pipe's stages run on $(pod_node pipe-shard-0)"
print_plan pipe
# kubelet_root NODE: NODE's kubelet root as seen from this host.
kubelet_root() { if [[ "$1" == "$NODE2" ]]; then echo "$NODE2_KUBELET_ROOT"; else echo /var/lib/kubelet; fi; }
if [[ "$ALLOCATION" == dra ]]; then
  for pod in pipe-shard-0 pipe-shard-1; do
    jq -e --arg c "$pod-gpus" '[.Data | fromjson | .ClaimInfoStateList[]? | .ClaimName] | index($c)' \
      "$(kubelet_root "$(pod_node "$pod")")/dra_manager_state" >/dev/null \
      || die "$(pod_node "$pod")'s kubelet did not prepare $pod's claim"
  done
  log "each node's kubelet prepared its stage's claim"
fi
# peer_address POD VARIABLE: the address cluster DNS would give the name in POD's
# VARIABLE (<pod hostname>.<service>.<namespace>.svc): the headless Service's
# EndpointSlice entry of that hostname.
peer_address() {
  local name host service
  name=$(kubectl get pod "$1" -n "$NAMESPACE" -o json \
    | jq -r --arg v "$2" '.spec.containers[0].env[] | select(.name == $v) | .value')
  [[ "$name" == *.*.$NAMESPACE.svc ]] || {
    echo "$1's $2 is '$name', not a name in $NAMESPACE"
    return 1
  }
  host=${name%%.*}
  service=${name#*.}
  service=${service%%.*}
  kubectl get endpointslices -n "$NAMESPACE" -l "kubernetes.io/service-name=$service" -o json \
    | jq -er --arg h "$host" '[.items[].endpoints[]? | select(.hostname == $h) | .addresses[0]] | first'
}
# reaches POD VARIABLE PEER: POD fetches the page of the address in its VARIABLE, and
# PEER's name answers. (busybox 1.37's wget crashes with its own -T: timeout bounds it.)
reaches() {
  local address answer
  address=$(peer_address "$1" "$2") || return 1
  answer=$(kubectl exec -n "$NAMESPACE" "$1" -- timeout 5 wget -qO- "http://$address:8080/" 2>&1) || {
    echo "$1 could not reach $address ($2): $answer"
    return 1
  }
  [[ "$answer" == "$3" ]] || {
    echo "$1 reached $address ($2) and $answer answered, not $3"
    return 1
  }
}
wait_until 60 "pipe-shard-0 reaching its next stage" reaches pipe-shard-0 TESSERA_NEXT_PEER pipe-shard-1
wait_until 60 "pipe-shard-1 reaching its previous stage" reaches pipe-shard-1 TESSERA_PREVIOUS_PEER pipe-shard-0
log "ok: a stage on each node ($(pod_node pipe-shard-0), $(pod_node pipe-shard-1)); each reaches the other at the address in its environment"
kubectl delete mi pipe -n "$NAMESPACE" --wait=true >/dev/null
pipe_gone() { [[ -z "$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=pipe -o name)" ]]; }
wait_until 120 "pipe's pods gone" pipe_gone

current_test=drained
# small starts on node-1: node-2 is cordoned while it is placed.
kubectl cordon "$NODE2" >/dev/null
served_instance small '{name: e2e/small, parametersBillions: 8, layers: 32, kvCacheGiB: 1}'
small_field() { kubectl get mi small -n "$NAMESPACE" -o json | jq -r "$1"; }
small_ready_on() {
  [[ "$(small_field '.status.readyReplicas // 0')" == 1 && "$(small_field '.status.plan[0].node')" == "$1" \
    && "$(small_field '.status.moves // [] | length')" == 0 ]] && shards_match_plan small
}
wait_until "$TIMEOUT" "small serving on $NODE" small_ready_on "$NODE"
kubectl uncordon "$NODE2" >/dev/null
log "small serves on $NODE ($(small_field '.status.plan[0].devices[0]'))"

poll_service small-api small "$work" &
poller=$!
wait_until 60 "the poller's first answer" bash -c "[ -s $work/counts ] && [ \"\$(cut -d' ' -f1 $work/counts)\" -gt 0 ]"
started=$SECONDS
kubectl drain "$NODE" --pod-selector=tessera.dev/instance=small --ignore-daemonsets \
  --timeout=180s >"$work/drain" 2>&1 || die "kubectl drain $NODE failed: $(tail -5 "$work/drain")"
drain_took=$((SECONDS - started))
grep -q "disruption budget" "$work/drain" \
  || log "note: the drain never waited on small's budget (the move had evicted the old pod first)"
wait_until 60 "small serving on $NODE2" small_ready_on "$NODE2"
[[ "$(small_field '.status.plan[0].copy // 0')" == 1 ]] || die "small's shard on $NODE2 is not a move's new copy"
event_reason small Moved || die "no Moved event on small"
kill "$poller"
poller=""
read -r ok failed fewest <"$work/counts"
((failed == 0)) || die "$failed of $((ok + failed)) requests to small failed during the drain: $(head -5 "$work/failures")"
((fewest >= 1)) || die "small had $fewest ready replicas during the drain"
((ok > 20)) || die "only $ok requests answered; the poller did not run through the drain"
kubectl uncordon "$NODE" >/dev/null
log "ok: kubectl drain $NODE went through in ${drain_took}s, small moved make before break to $NODE2; $ok requests, none failed, never fewer than 1 ready replica"

# start_tiny: tiny (vLLM's CPU build, examples/cpu-vllm-tiny.yaml) and a budget that
# keeps kubectl drain from taking its only copy, for the last step; made while node-2
# is down (and cordoned), so it starts on node-1 while the checks between wait.
start_tiny() {
  [ -n "${TESSERA_TEST_VLLM_PYTHON:-}" ] || return 0
  vllm_example | kubectl apply -n "$NAMESPACE" -f - >/dev/null
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<'YAML'
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: tiny}
spec:
  minAvailable: 1
  selector: {matchLabels: {tessera.dev/instance: tiny}}
YAML
}

current_test=dead_node
kubectl patch mi small -n "$NAMESPACE" --type merge -p '{"spec":{"placement":{"moves":"Never"}}}' >/dev/null
old_pod=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=small -o json \
  | jq -r '.items[] | select(.spec.nodeName == "'"$NODE2"'") | "\(.metadata.name) \(.metadata.uid)"')
read -r old_name old_uid <<<"$old_pod"
[[ -n "$old_uid" ]] || die "small has no pod on $NODE2"
pid=$(cat "$NODE2_STATE/run/kubelet.pid")
[[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/cmdline" ]] || die "no kubelet of $NODE2 runs as PID '$pid'"
mapfile -d '' -t kubelet_command <"/proc/$pid/cmdline"
mapfile -d '' -t kubelet_environment <"/proc/$pid/environ"
kubelet_log=$(readlink "/proc/$pid/fd/1")
kill -KILL "$pid"
killed=$SECONDS
log "$NODE2's kubelet killed (PID $pid); small's pod there: $old_name"
node2_not_ready() {
  [[ "$(kubectl get node "$NODE2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" != True ]]
}
wait_until 120 "$NODE2 NotReady" node2_not_ready
not_ready_after=$((SECONDS - killed))
log "$NODE2 NotReady ${not_ready_after}s after its kubelet died"
kubectl cordon "$NODE2" >/dev/null
start_tiny
wait_until $((GRACE + 120)) "small serving again on $NODE" small_ready_on "$NODE"
served_after=$((SECONDS - killed))
address=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=small -o json \
  | jq -r '.items[] | select(.spec.nodeName == "'"$NODE"'" and .metadata.deletionTimestamp == null) | .status.podIP')
curl -fsS -m 3 "http://$address:8080/" >/dev/null || die "small's new pod at $address does not answer"
event_reason small PodReleased || die "no PodReleased event on small"
kubectl get pod "$old_name" -n "$NAMESPACE" -o json 2>/dev/null | jq -e --arg uid "$old_uid" '.metadata.uid == $uid' >/dev/null \
  && die "the pod $old_name on the dead node is still there"
if [[ "$ALLOCATION" == dra ]]; then
  # The claims of the pods deleted are deallocated in the API (the devices free for the
  # allocator) though no kubelet on the node unprepared them.
  no_claim_on_dead_node() {
    local names
    names=$(kubectl get resourceclaims -n "$NAMESPACE" -o json | jq -r --arg n "$NODE2" \
      '[.items[] | select(.status.allocation != null and (.status.allocation.nodeSelector | tostring | contains($n)))
        | .metadata.name] | join(",")')
    [[ -z "$names" ]] || {
      echo "claims still allocated on $NODE2: $names"
      return 1
    }
  }
  wait_until 60 "no claim allocated on $NODE2" no_claim_on_dead_node
fi
log "ok: small serves again on $NODE ${served_after}s after $NODE2's kubelet died (NotReady after ${not_ready_after}s, grace ${GRACE}s); $old_name was deleted at once"

current_test=node_back
setsid nohup "$TESSERA_K8S_KIT/node2.sh" exec env -i "${kubelet_environment[@]}" "${kubelet_command[@]}" \
  >>"$kubelet_log" 2>&1 </dev/null &
echo $! >"$NODE2_STATE/run/kubelet.pid"
node2_ready() {
  [[ "$(kubectl get node "$NODE2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}
wait_until 120 "$NODE2 Ready again" node2_ready
kubectl uncordon "$NODE2" >/dev/null
# The kubelet finds the pod gone and stops its container.
old_sandbox_gone() {
  ! "$CRI" -r "unix://$NODE2_RUN/containerd/containerd.sock" pods 2>/dev/null | grep -q "$old_name"
}
wait_until 120 "$old_name's sandbox removed from $NODE2" old_sandbox_gone
live_uids() { kubectl get pods -A -o json | jq -c '[.items[].metadata.uid]'; }
# gone_in NAME RECORD: RECORD (a JSON array of pod UIDs) names no pod that is gone.
gone_in() {
  jq -en --argjson live "$(live_uids)" --argjson r "$2" '$r - $live == []' >/dev/null \
    || {
      echo "$1 records pods that are gone: $2"
      return 1
    }
}
agent_clean() {
  gone_in "$NODE2's agent" "$(kubectl get node "$NODE2" -o json \
    | jq -c '[.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .allocated // {} | .[]]')"
}
wait_until 120 "$NODE2's agent recording no pod that is gone" agent_clean
wait_until 60 "2 GPUs offered on $NODE2 again" offers "$NODE2" 2
kubectl apply -n "$NAMESPACE" -f - >/dev/null <<YAML
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: back}
spec:
  model: {name: e2e/back, parametersBillions: 8, layers: 32, kvCacheGiB: 1}
  parallelism: {tensor: 2, pipeline: 1}
  placement:
    nodeSelector: {kubernetes.io/hostname: $NODE2}
  template:
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          command: [sh, -c, "echo \"shard on \$(hostname) sees devices: \${TESSERA_VISIBLE_DEVICES:-<unset>}\"; trap 'exit 0' TERM; while true; do sleep 1; done"]
YAML
wait_until "$TIMEOUT" "back running on both of $NODE2's GPUs" shards_match_plan back
[[ "$(pod_node back-shard-0)" == "$NODE2" ]] || die "back runs on $(pod_node back-shard-0), not $NODE2"
given_once() {
  if [[ "$ALLOCATION" == dra ]]; then
    jq -e '[.Data | fromjson | .ClaimInfoStateList[]? | .DriverState[]?.Devices[]?.DeviceName] | length == (unique | length)' \
      "$NODE2_KUBELET_ROOT/dra_manager_state" >/dev/null
  else
    jq -e '[.Data.PodDeviceEntries[]? | .DeviceIDs | to_entries[] | .value[]] | length == (unique | length)' \
      "$NODE2_KUBELET_ROOT/device-plugins/kubelet_internal_checkpoint" >/dev/null
  fi
}
given_once || die "a device of $NODE2 is recorded for two pods"
# Kubelet forgets the devices of pods that are gone when it next allocates (the device
# plugin checkpoint) or when it cleans the pod up (prepared claims): by now.
if [[ "$ALLOCATION" == dra ]]; then
  recorded=$(jq -c '[.Data | fromjson | .ClaimInfoStateList[]? | .PodUIDs // {} | if type == "object" then keys[] else .[] end]' \
    "$NODE2_KUBELET_ROOT/dra_manager_state")
else
  recorded=$(jq -c '[.Data.PodDeviceEntries[]? | .PodUID]' "$NODE2_KUBELET_ROOT/device-plugins/kubelet_internal_checkpoint")
fi
gone_in "$NODE2's kubelet" "$recorded" || die "$(gone_in "$NODE2's kubelet" "$recorded")"
agent_clean || die "$(agent_clean)"
log "ok: $NODE2 back: its kubelet stopped $old_name, nothing is recorded for a pod that is gone, and back runs on both of its GPUs, each given once"

current_test=vllm_drained
if [ -z "${TESSERA_TEST_VLLM_PYTHON:-}" ]; then
  log "skipped: TESSERA_TEST_VLLM_PYTHON is not set (.ci/install-vllm prints it)"
  exit 0
fi
kubectl delete mi back small -n "$NAMESPACE" --wait=true >/dev/null
tiny_ready_on() {
  kubectl get mi tiny -n "$NAMESPACE" -o json | jq -e --arg n "$1" '.status.readyReplicas == 1
    and .status.plan[0].node == $n and ((.status.moves // []) | length == 0)' >/dev/null
}
wait_until 300 "tiny serving on $NODE" tiny_ready_on "$NODE"
python3 e2e/load.py --namespace "$NAMESPACE" --service tiny-api --model tiny --prompt-tokens 32 \
  --max-tokens 32 --concurrency 2 --rate 2 --duration 600 --stop-file "$work/load.stop" --out "$work/load" \
  >"$work/load.log" 2>&1 &
loader=$!
sleep 10
started=$SECONDS
kubectl drain "$NODE" --pod-selector=tessera.dev/instance=tiny --ignore-daemonsets --delete-emptydir-data \
  --timeout=300s >"$work/drain" 2>&1 || die "kubectl drain $NODE failed: $(tail -5 "$work/drain")"
drain_took=$((SECONDS - started))
wait_until 120 "tiny serving on $NODE2" tiny_ready_on "$NODE2"
tiny_gone_from_node1() {
  [[ -z "$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=tiny -o json \
    | jq -r --arg n "$NODE" '.items[] | select(.spec.nodeName == $n) | .metadata.name')" ]]
}
wait_until 60 "tiny's old pod gone" tiny_gone_from_node1
sleep 10
touch "$work/load.stop"
wait "$loader" || die "the load generator failed: $(tail -5 "$work/load.log")"
result=$(cat "$work/load/summary.json")
jq -e '.failed == 0 and .ok > 50' <<<"$result" >/dev/null \
  || die "requests to tiny failed while it moved: $result $(head -5 "$work/load/failures")"
kubectl uncordon "$NODE" >/dev/null
log "ok: kubectl drain $NODE went through in ${drain_took}s and vLLM moved make before break to $NODE2 under load: $result"
