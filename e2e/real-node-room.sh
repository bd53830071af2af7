#!/usr/bin/env bash
# End-to-end on a real node: room made by default, by the cluster objective, through
# DRA. The chart runs the agent as the node's DRA driver over 4 fake H100s and 4 fake
# A100s (80 GiB each), moves on as they are by default.
#   1. small (a 1.2B replica serving HTTP behind the Service small-api, with a
#      PodDisruptionBudget of minAvailable 1) is placed where it serves the most: an
#      H100;
#   2. big (a 34B over 4 GPUs that may only use H100s) is applied: three H100s are free,
#      so it is blocked; small still meets its latency target on an A100 (serving less
#      there), so small moves to an A100 make before break (its new copy Ready before
#      the old pod is evicted through the Eviction API) and big runs on the four H100s
#      (Events MakingRoom on big, Moved on small); every shard pod runs on exactly its
#      planned devices;
#   3. throughout, a client polls small as a Service would route it and no request
#      fails, small never has fewer ready replicas than one, and no device is ever
#      allocated in two ResourceClaims at once.
# Needs what e2e/real-node.sh needs, and curl.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e-room
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
readonly DRIVER=gpu.tessera.dev
readonly TIMEOUT="${TIMEOUT:-240}"
# lib.sh's names; the device plugin's checkpoint plays no part here.
readonly KUBELET_CHECKPOINT="" KUBELET_PIDFILE="" RESOURCE_NAME=tessera.dev/gpu FAKE_CONFIGMAP=tessera-fake-gpus
kubectl_bin="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"
work_dir=$(mktemp -d)

current_test=setup
log() { printf '[real-node-room %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
die() {
  echo "real-node room check FAILED in $current_test: $*" >&2
  {
    declare -F dump_state >/dev/null && dump_state
    echo "real-node room check FAILED in $current_test: $*"
  } >&2
  exit 1
}
[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/import-image.sh" ] || die "TESSERA_K8S_KIT does not name a kit with import-image.sh"
export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl_bin")"):$PATH"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh

poller="" claims_watch=""
# The test namespace goes first, while the agent still runs: kubelet needs the DRA
# driver to unprepare the claims of the pods it stops.
cleanup() {
  [[ -n "$poller" ]] && kill "$poller" 2>/dev/null
  [[ -n "$claims_watch" ]] && kill "$claims_watch" 2>/dev/null
  rm -rf "$API_USE" "$work_dir"
  [ "${KEEP:-0}" = 1 ] && return 0
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
  "$helm" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

fresh_start
cat >"$work_dir/values.yaml" <<YAML
agent:
  fake:
    nodes:
      $NODE: "4xH100-80GiB,4xA100-80GiB"
YAML
"$helm" install "$RELEASE" charts/tessera -n "$TESSERA_NAMESPACE" --create-namespace \
  -f e2e/values-real-node.yaml -f "$work_dir/values.yaml" --set allocation=dra --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready: $(kubectl -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"
eight_devices() { [[ "$(slice_devices)" == 8 ]]; }
wait_until "$TIMEOUT" "the node's ResourceSlice with 8 devices" eight_devices
kubectl create namespace "$NAMESPACE" >/dev/null

# product ID: the product of device ID as the node's GPU state publishes it.
product() {
  kubectl get node "$NODE" -o json \
    | jq -r --arg id "$1" '.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .devices[] | select(.id == $id) | .product'
}

# The claims watch: every 0.5 s, no device allocated in two of the namespace's
# ResourceClaims (both copies of a move hold claims at once, on different devices).
watch_claims() {
  local claims twice
  while true; do
    if claims=$(kubectl get resourceclaims -n "$NAMESPACE" -o json 2>/dev/null); then
      twice=$(jq -r '[.items[] | select(.metadata.deletionTimestamp == null) | .metadata.name as $claim
        | .status.allocation.devices.results[]? | {device: "\(.pool)/\(.device)", $claim}]
        | group_by(.device) | map(select(length > 1)) | .[] | "\(.[0].device) in \(map(.claim) | join(", "))"' <<<"$claims")
      [[ -z "$twice" ]] || echo "$(date +%T) $twice" >>"$work_dir/twice"
      echo checked >"$work_dir/claims-checked"
    fi
    sleep 0.5
  done
}
watch_claims &
claims_watch=$!

current_test=small_on_h100
# small: a 1.2B replica on one GPU serving its pod name over HTTP; it prints the
# devices it sees first (shards_match_plan reads that). preStop keeps an evicted pod
# serving while the endpoints learn it is going.
served_instance small '{name: e2e/small-1.2b, parametersBillions: 1.2, layers: 16}'
field() { kubectl get mi "$1" -n "$NAMESPACE" -o json | jq -r "$2"; }
wait_until "$TIMEOUT" "small Running" mi_running small
first=$(field small '.status.plan[0].devices[0]')
[[ "$(product "$first")" == *H100* ]] || die "small runs on $first, a $(product "$first"), not on an H100 where it serves the most"
log "small runs on $first ($(product "$first"))"

poll_service small-api small "$work_dir" &
poller=$!
wait_until 60 "the poller's first answer" bash -c "[ -s $work_dir/counts ] && [ \"\$(cut -d' ' -f1 $work_dir/counts)\" -gt 0 ]"

current_test=room_made
kubectl apply -n "$NAMESPACE" -f - >/dev/null <<'YAML'
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: big}
spec:
  model: {name: e2e/big-34b, parametersBillions: 34, layers: 48}
  parallelism: {tensor: 4, pipeline: 1}
  placement: {products: [H100]}
  template:
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          command: [sh, -c, "echo \"shard on $(hostname) sees devices: $TESSERA_VISIBLE_DEVICES\"; trap 'exit 0' TERM; while true; do sleep 1; done"]
YAML
wait_until "$TIMEOUT" "big making room" event_reason big MakingRoom
log "big: $(kubectl get events -n "$NAMESPACE" --field-selector involvedObject.name=big,reason=MakingRoom -o jsonpath='{.items[0].message}')"
wait_until "$TIMEOUT" "big Running" mi_running big
event_reason small Moved || die "no Moved event on small"
moved_to=$(field small '.status.plan[0].devices[0]')
[[ "$(product "$moved_to")" == *A100* ]] || die "small moved to $moved_to, a $(product "$moved_to"), not an A100"
for device in $(field big '.status.plan[0].devices[]'); do
  [[ "$(product "$device")" == *H100* ]] || die "big runs on $device, a $(product "$device")"
done
wait_until 60 "small's shard on its planned device" shards_match_plan small
wait_until 60 "big's shards on their planned devices" shards_match_plan big
log "small moved $first -> $moved_to ($(product "$moved_to")); big runs on $(field big '.status.plan[0].devices | join(",")')"

current_test=served
kill "$poller"
poller=""
kill "$claims_watch"
claims_watch=""
read -r ok failed fewest <"$work_dir/counts"
((failed == 0)) || die "$failed of $((ok + failed)) requests to small failed while it moved: $(head -5 "$work_dir/failures")"
((fewest >= 1)) || die "small had $fewest ready replicas at some point while it moved"
((ok > 20)) || die "only $ok requests answered; the poller did not run through the move"
[[ -s "$work_dir/claims-checked" ]] || die "the claims watch never read the claims"
[[ ! -s "$work_dir/twice" ]] || die "a device was allocated in two claims: $(head -3 "$work_dir/twice")"
log "ok: $ok requests to small answered, none failed; small never had fewer than 1 ready replica; no device in two claims"
