#!/usr/bin/env bash
# End-to-end sharing on a real node with DRA (Kubernetes 1.36 with partitionable devices and
# consumable capacity on, kube-scheduler running for users' claims). The chart is installed
# with allocation=dra and agent.memoryShares=true over fake GPUs (e2e/values-sharing.yaml):
# two whole H100s and one in MIG mode (3g.40gb, 2g.20gb, 1g.10gb).
#   1. slices: the pool lists the two whole GPUs (shareable by memory) and the three
#      partitions, and a counter slice holds the split GPU's counter set; the MIG GPU is
#      not offered whole;
#   2. partition_first: a Shared 8B instance (24.4 GiB) takes the 3g.40gb partition (a
#      GPU already split) and its container is given the partition's MIG ID;
#   3. memory_shares: two more Shared 8B instances share one whole GPU by memory: two
#      claims with distinct share IDs, 25 GiB consumed each (at most the GPU's 80 GiB),
#      both prepared by kubelet, which records each claim's share ID and names it in its
#      PodResources API for each pod, and each container sees TESSERA_GPU_MEMORY_GIB=25
#      and its fraction;
#   4. isolated_and_users: an Isolated 1.5B instance (whose smallest piece is the 1g.10gb)
#      and a user's claim for that same 1g.10gb (allocated by kube-scheduler) applied at
#      the same moment: whichever allocator comes first keeps it; the instance runs on the
#      1g.10gb or, having lost it, on the 2g.20gb, the user's pod runs on the 1g.10gb or
#      stays unschedulable; no device is given twice and no claim holds the split GPU
#      whole;
#   5. layout_change: the GPU holding the memory shares is switched into MIG mode (two
#      3g.40gb): the agent publishes its partitions without a restart, and both instances on
#      it are re-planned onto them.
# Needs what e2e/real-node-dra.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e-sharing
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
readonly DRIVER=gpu.tessera.dev
readonly TIMEOUT="${TIMEOUT:-180}"
export DRA_MANAGER_STATE="${DRA_MANAGER_STATE:-/var/lib/kubelet/dra_manager_state}"
readonly KUBELET_CHECKPOINT="" RESOURCE_NAME=tessera.dev/gpu FAKE_CONFIGMAP=tessera-fake-gpus
readonly KUBELET_PIDFILE=""
kubectl_bin="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"

current_test=setup
log() { printf '[real-node-sharing %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
die() {
  echo "real-node sharing check FAILED in $current_test: $*" >&2
  {
    echo "--- pods"
    kubectl get pods -A -o wide || true
    echo "--- claims"
    kubectl get resourceclaims -A -o wide || true
    echo "--- instances"
    kubectl get mi -n "$NAMESPACE" -o wide || true
    echo "--- controller log"
    kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=controller --tail=40 || true
    echo "--- agent log"
    kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=agent --tail=40 || true
    echo "real-node sharing check FAILED in $current_test: $*"
  } >&2
  exit 1
}
[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/import-image.sh" ] || die "TESSERA_K8S_KIT does not name a kit with import-image.sh"
export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl_bin")"):$PATH"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh

cleanup() {
  rm -f "$API_USE"
  [ "${KEEP:-0}" = 1 ] && return 0
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
  "$helm" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

fresh_start
kubectl delete resourceslices --field-selector "spec.driver=$DRIVER" >/dev/null
"$helm" install "$RELEASE" charts/tessera -n "$TESSERA_NAMESPACE" --create-namespace \
  -f e2e/values-real-node.yaml -f e2e/values-sharing.yaml --set allocation=dra \
  --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready: $(kubectl -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"
kubectl create namespace "$NAMESPACE" >/dev/null

# What kubelet's PodResources API says each container holds, a JSON object a line.
readonly POD_RESOURCES_SOCKET="${POD_RESOURCES_SOCKET:-/var/lib/kubelet/pod-resources/kubelet.sock}"
# The test build's profile: `cargo test` builds the examples too, so CI has it already.
cargo build --locked --example pod-resources >/dev/null 2>&1 \
  || die "cannot build the PodResources reader (cargo build --example pod-resources)"
pod_resources() { target/debug/examples/pod-resources "$POD_RESOURCES_SOCKET"; }

# The node's slices of the driver as one JSON list.
node_slices() {
  kubectl get resourceslices -o json | jq --arg node "$NODE" --arg d "$DRIVER" \
    '[.items[] | select(.spec.nodeName == $node and .spec.driver == $d)]'
}
# pool_shows WHOLE PARTITIONS SETS: the pool lists that many shareable whole GPUs,
# partitions and counter sets.
pool_shows() {
  local seen
  seen=$(node_slices | jq -r '[
      ([.[].spec.devices[]? | select(.allowMultipleAllocations == true)] | length),
      ([.[].spec.devices[]? | select(.consumesCounters != null)] | length),
      ([.[].spec.sharedCounters[]?] | length)] | @tsv')
  [[ "$seen" == "$1"$'\t'"$2"$'\t'"$3" ]] || { echo "whole, partitions, counter sets: $seen"; return 1; }
}

current_test=slices
wait_until "$TIMEOUT" "2 shareable GPUs, 3 partitions and 1 counter set in $NODE's pool" pool_shows 2 3 1
kubectl get node "$NODE" -o jsonpath='{.metadata.annotations.tessera\.dev/gpu-state}' \
  | jq -e '.shares == {partitions: true, memory: true}' >/dev/null \
  || die "the node's GPU state does not offer partitions and memory shares"
log "the pool: two whole GPUs with memory shares, three partitions consuming one counter set"

# shared NAME SHARING PARAMETERS LAYERS KV: a one-GPU instance that may share GPUs; its
# container prints what it was given.
shared() {
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<YAML
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: $1}
spec:
  model: {name: e2e/$1, parametersBillions: $3, layers: $4, hiddenSize: 4096, kvCacheGiB: $5}
  parallelism: {tensor: 1, pipeline: 1}
  placement: {sharing: $2}
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
              echo "share gib=\${TESSERA_GPU_MEMORY_GIB:-} fraction=\${TESSERA_GPU_MEMORY_FRACTION:-}"
              trap 'exit 0' TERM INT
              while true; do sleep 3600 & wait \$!; done
YAML
}
running() {
  local phase
  phase=$(mi "$1" | jq -r '.status.phase // ""')
  [[ "$phase" == Running ]] || { echo "$1 is ${phase:-new}"; return 1; }
  shards_match_plan "$1"
}
share_of() { mi "$1" | jq -c '.status.plan[0].share'; }
# said NAME: what NAME's container says of its memory share.
said() { kubectl logs -n "$NAMESPACE" "$1-shard-0" 2>/dev/null | grep '^share ' | tail -n 1; }
claim_results() {
  kubectl get resourceclaim -n "$NAMESPACE" "$1-shard-0-gpus" -o json | jq -c '.status.allocation.devices.results'
}

current_test=partition_first
shared chat-a Shared 8 32 8
wait_until "$TIMEOUT" "chat-a Running on its plan" running chat-a
[[ "$(share_of chat-a | jq -r '.kind + " " + .profile')" == "Partition 3g.40gb" ]] \
  || die "chat-a was given $(share_of chat-a), not the 3g.40gb partition"
partition=$(mi chat-a | jq -r '.status.plan[0].devices[0]')
[[ "$(said chat-a)" == "share gib= fraction=" ]] || die "chat-a's container said: $(said chat-a)"
log "a Shared 8B instance takes the 3g.40gb partition of the split GPU; its container gets $partition (no memory share)"

current_test=memory_shares
shared chat-b Shared 8 32 8
wait_until "$TIMEOUT" "chat-b Running on its plan" running chat-b
shared chat-c Shared 8 32 8
wait_until "$TIMEOUT" "chat-c Running on its plan" running chat-c
for name in chat-b chat-c; do
  [[ "$(share_of "$name" | jq -r '.kind + " " + (.memoryGiB | tostring)')" == "Memory 25" ]] \
    || die "$name was given $(share_of "$name"), not a 25 GiB memory share"
done
gpu_b=$(share_of chat-b | jq -r .gpu)
[[ "$(share_of chat-c | jq -r .gpu)" == "$gpu_b" ]] || die "chat-b and chat-c are on different GPUs"
[[ "$(share_of chat-c | jq -r .tenants)" == 1 ]] || die "chat-c was not planned beside chat-b"
b=$(claim_results chat-b) c=$(claim_results chat-c)
[[ "$(jq -r '.[0].device' <<<"$b")" == "$(jq -r '.[0].device' <<<"$c")" ]] \
  || die "the claims name different devices: $b / $c"
[[ -n "$(jq -r '.[0].shareID // ""' <<<"$b")" && "$(jq -r '.[0].shareID' <<<"$b")" != "$(jq -r '.[0].shareID' <<<"$c")" ]] \
  || die "the claims' share IDs are not distinct: $b / $c"
[[ "$(jq -r '.[0].consumedCapacity.memory' <<<"$b") $(jq -r '.[0].consumedCapacity.memory' <<<"$c")" == "25Gi 25Gi" ]] \
  || die "consumed memory: $b / $c"
for name in chat-b chat-c; do
  [[ "$(said "$name")" == "share gib=25 fraction=0.312" ]] || die "$name's container said: $(said "$name")"
done
prepared=$(jq --arg b "$(kubectl get resourceclaim -n "$NAMESPACE" chat-b-shard-0-gpus -o jsonpath='{.metadata.uid}')" \
  --arg c "$(kubectl get resourceclaim -n "$NAMESPACE" chat-c-shard-0-gpus -o jsonpath='{.metadata.uid}')" \
  '.Data | fromjson | [.ClaimInfoStateList[]? | select(.ClaimUID == $b or .ClaimUID == $c)] | length' "$DRA_MANAGER_STATE")
[[ "$prepared" == 2 ]] || die "kubelet prepared $prepared of the two shared claims"
# kubelet was told each claim's share ID (NodePrepareResources), so it records it, and
# its PodResources API (what monitoring agents such as DCGM-exporter read) tells each
# pod its own share of the one GPU.
for name in chat-b chat-c; do
  uid=$(kubectl get resourceclaim -n "$NAMESPACE" "$name-shard-0-gpus" -o jsonpath='{.metadata.uid}')
  want=$(claim_results "$name" | jq -r '.[0].shareID')
  recorded=$(jq -r --arg uid "$uid" --arg d "$DRIVER" \
    '.Data | fromjson | [.ClaimInfoStateList[]? | select(.ClaimUID == $uid) | .DriverState[$d].Devices[]?.ShareID] | .[0] // "null"' \
    "$DRA_MANAGER_STATE")
  [[ "$recorded" == "$want" ]] || die "kubelet recorded share ID $recorded for $name's claim, not $want"
  listed=$(pod_resources | jq -r --arg ns "$NAMESPACE" --arg pod "$name-shard-0" --arg d "$DRIVER" \
    'select(.namespace == $ns and .pod == $pod and .source == $d) | .shareId // "none"' | sort -u)
  [[ "$listed" == "$want" ]] || die "PodResources lists $name-shard-0 with share ID ${listed:-nothing}, not $want"
done
log "two Shared 8B instances share $gpu_b: distinct share IDs (kubelet's record and PodResources name each pod's own), 25 + 25 of 80 GiB consumed, both prepared, each sees 25 GiB (0.312)"

current_test=isolated_and_users
kubectl apply -n "$NAMESPACE" -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: users}
spec:
  devices:
    requests:
      - name: gpus
        exactly:
          deviceClassName: $DRIVER
          selectors:
            - cel: {expression: '"profile" in device.attributes["$DRIVER"] && device.attributes["$DRIVER"].profile == "1g.10gb"'}
---
apiVersion: v1
kind: Pod
metadata: {name: users}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: busybox:1.37
      imagePullPolicy: IfNotPresent
      command: [sleep, "3600"]
      resources: {claims: [{name: gpus}]}
  resourceClaims:
    - {name: gpus, resourceClaimName: users}
YAML
shared guard Isolated 1.5 16 2
wait_until "$TIMEOUT" "guard Running on its plan" running guard
users_settled() {
  local phase reason
  phase=$(kubectl get pod -n "$NAMESPACE" users -o jsonpath='{.status.phase}')
  reason=$(kubectl get pod -n "$NAMESPACE" users -o jsonpath='{.status.conditions[?(@.type=="PodScheduled")].reason}')
  [[ "$phase" == Running || "$reason" == Unschedulable ]] || { echo "pod users is $phase ($reason)"; return 1; }
}
wait_until "$TIMEOUT" "the user's pod Running or unschedulable" users_settled
guard_profile=$(share_of guard | jq -r .profile)
users_phase=$(kubectl get pod -n "$NAMESPACE" users -o jsonpath='{.status.phase}')
case "$guard_profile/$users_phase" in
  1g.10gb/Pending) winner="the controller; the user's claim waits" ;;
  2g.20gb/Running) winner="kube-scheduler; the instance took the 2g.20gb" ;;
  *) die "guard on $guard_profile while the user's pod is $users_phase" ;;
esac
# Every allocated device of the driver, once each; none is the split GPU itself.
allocated=$(kubectl get resourceclaims -A -o json | jq -r --arg d "$DRIVER" \
  '[.items[].status.allocation.devices.results[]? | select(.driver == $d and .shareID == null) | .device] | sort | .[]')
[[ -z "$(uniq -d <<<"$allocated")" ]] || die "a device is allocated twice: $allocated"
split_gpu=$(node_slices | jq -r '[.[].spec.sharedCounters[]?.name][0]')
! grep -qx "$split_gpu" <<<"$allocated" || die "the split GPU $split_gpu is allocated whole"
log "an Isolated instance and a user's claim raced for the 1g.10gb: $winner; nothing is allocated twice, the split GPU never whole"

current_test=layout_change
cm_key="$NODE.yaml"
index=$(kubectl get node "$NODE" -o jsonpath='{.metadata.annotations.tessera\.dev/gpu-state}' \
  | jq -r --arg id "$gpu_b" '.devices[] | select(.id == $id) | .index')
[[ "$index" == 0 || "$index" == 1 ]] || die "the shared GPU $gpu_b has index $index, not one of the two whole GPUs"
other=$((1 - index))
# The whole GPU with the shares into MIG mode with two 3g.40gb; the other stays whole.
if [[ "$index" == 0 ]]; then first="mig: {partitions: [3g.40gb, 3g.40gb]}" second=""; else first="" second="mig: {partitions: [3g.40gb, 3g.40gb]}"; fi
new_layout="gpus:
  - {profile: H100-80GiB${first:+, $first}}
  - {profile: H100-80GiB${second:+, $second}}
  - {profile: H100-80GiB, mig: {partitions: [3g.40gb, 2g.20gb, 1g.10gb]}}"
patch_fake_gpus "$(jq -n --arg k "$cm_key" --arg v "$new_layout" '{data: {($k): $v}}')"
wait_until "$TIMEOUT" "the switched GPU's two partitions published (1 whole, 5 partitions, 2 counter sets)" \
  pool_shows 1 5 2
moved() {
  local name kind
  for name in chat-b chat-c; do
    kind=$(share_of "$name" | jq -r .kind)
    [[ "$kind" == Partition ]] || { echo "$name still has a $kind share"; return 1; }
    running "$name" || return 1
  done
}
wait_until "$TIMEOUT" "chat-b and chat-c re-planned onto partitions and Running" moved
log "GPU $other stayed whole; $gpu_b switched into MIG mode was published again and its two tenants moved onto its partitions"
log "all sharing checks passed"
