#!/usr/bin/env bash
# End-to-end on a real node with DRA (Kubernetes 1.34+, containerd with CDI): the chart
# installed with allocation=auto runs the agent as the node's DRA driver (the API server
# serves resource.k8s.io/v1 and kubelet registers the driver) and the controller
# allocating each shard's ResourceClaim.
#   1. builds the image (as e2e/real-node.sh does; nothing to compile after it) and installs the
#      chart (e2e/values-real-node.yaml, allocation auto) over a slice of the node's pool
#      left by an earlier driver: the agent counts the pool's generation on from it and
#      deletes it; waits for the node's ResourceSlice with its 8 fake GPUs and the
#      DeviceClass;
#   2. eight_stages: a ModelInstance of eight one-GPU stages applied at once, timed
#      from `kubectl apply` to every shard Running (by a watch started before); every
#      shard's claim is allocated exactly its planned device, kubelet prepared exactly
#      that device (dra_manager_state), and the container sees it
#      (TESSERA_VISIBLE_DEVICES from the claim's CDI spec);
#   3. users_claim: with every GPU in a shard, a user's pod claiming one through the
#      DeviceClass stays unschedulable: kube-scheduler counts the controller's
#      allocations;
#   4. agent_restart: the agent pod deleted: running shards keep their pods and devices,
#      the CDI specs stay, and the new agent reports the 8 devices in use again;
#   5. bad_claims: claims allocated by hand (as a custom scheduler would) to a device of
#      another node and to a device this node does not have, each for a pod on the node:
#      each pod's event carries the agent's reason and nothing is prepared for it (an
#      unhealthy device and an unallocated claim: the driver's unit tests; kubelet does
#      not call a driver for an allocation without its devices);
#   6. deleted: the instance deleted: pods, claims and CDI specs go, kubelet holds no
#      prepared claim, and every device is free for the next instance;
#   7. device_fault: a fault injected into the device of one shard of two and into the
#      device of a user's pod (claimed through the DeviceClass): the shard's device is
#      tainted NoSchedule in the slice, only that shard's claim moves to another device,
#      the other shard's pod stays; kubelet shows the user's pod its device Unhealthy
#      (allocatedResourcesStatus, from the driver's DRAResourceHealth stream) and Healthy
#      again once it recovers, when the taint goes too;
#   8. kubelet_restart: kubelet restarted while a shard runs and an instance is created:
#      the driver registers again, the running shard keeps its pod and prepared device,
#      the new instance runs on its planned devices (skipped without KUBELET_PIDFILE);
#   9. recreate_replica: one shard pod of a two-shard instance (restart policy
#      RecreateReplica, the default) deleted by hand: both pods are recreated and run on
#      the devices they had;
#  10. crash_loop: a two-shard instance whose containers exit 1 (pod restartPolicy Never):
#      its replica is recreated with a backoff: status.restarts counts the recreations,
#      the ReplicaFailure condition and a BackOff event name the failed rank and its exit
#      code, and the third recreation comes 20 s after the second (no sooner, and
#      within 30 s: a late one once waited on unrelated claim writes);
#  11. cluster_map: the controller's map loaded in headless Chromium (Debian's package)
#      through a port-forward: every node listed, every planned device's cell naming its
#      instance and shard, an unhealthy device marked, a condition message holding a
#      script element shown as text (screenshot: target/e2e/cluster-map.png); the agent's
#      device series name the shard holding the device;
#  12. least_privilege: what the agent and the controller requested of the API server
#      over the run is exactly what the chart's roles grant them in DRA mode, and
#      neither was refused anything ("forbidden" in their logs).
# Needs what e2e/real-node.sh needs; DRA_MANAGER_STATE (kubelet's record,
# /var/lib/kubelet/dra_manager_state) and CDI_DIR (/var/run/cdi) must be on this host;
# KUBELET_PIDFILE as for e2e/real-node-checks.sh (the kit's run/kubelet.pid by default).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e-dra
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
readonly DRIVER=gpu.tessera.dev
readonly TIMEOUT="${TIMEOUT:-180}"
export DRA_MANAGER_STATE="${DRA_MANAGER_STATE:-/var/lib/kubelet/dra_manager_state}"
readonly CDI_DIR="${CDI_DIR:-/var/run/cdi}"
KUBELET_PIDFILE="${KUBELET_PIDFILE:-$(dirname "${TESSERA_TEST_KUBECONFIG:-.}")/run/kubelet.pid}"
[[ -e "$KUBELET_PIDFILE" ]] || KUBELET_PIDFILE=""
readonly KUBELET_PIDFILE
# lib.sh's names; the device plugin's checkpoint plays no part here.
readonly KUBELET_CHECKPOINT="" RESOURCE_NAME=tessera.dev/gpu FAKE_CONFIGMAP=tessera-fake-gpus
fault_key=""
kubectl_bin="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"

current_test=setup
log() { printf '[real-node-dra %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
die() {
  echo "real-node DRA check FAILED in $current_test: $*" >&2
  {
    echo "--- pods"
    kubectl get pods -A -o wide || true
    echo "--- claims"
    kubectl get resourceclaims -A -o wide || true
    echo "--- controller log"
    kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=controller --tail=40 || true
    echo "--- agent log"
    kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=agent --tail=40 || true
    echo "real-node DRA check FAILED in $current_test: $*"
  } >&2
  exit 1
}
[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/import-image.sh" ] || die "TESSERA_K8S_KIT does not name a kit with import-image.sh"
export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl_bin")"):$PATH"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh

# The test namespace goes first, while the agent still runs: kubelet needs the DRA
# driver to unprepare the claims of the pods it stops (without it they stay Terminating).
watcher="" events=""
cleanup() {
  rm -f "$API_USE" "$events"
  [ -z "$watcher" ] || kill "$watcher" 2>/dev/null || true
  restore_fault 2>/dev/null || true
  [ "${KEEP:-0}" = 1 ] && return 0
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
  "$helm" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# After e2e/real-node.sh the build is up to date and only the packing runs again.
fresh_start
kubectl delete resourceslices --field-selector "spec.driver=$DRIVER" >/dev/null
# A slice of the node's pool as an earlier driver left it (generation 7, a device that
# is gone): the agent must count on from its generation and delete it.
kubectl apply -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: e2e-left-over}
spec:
  driver: $DRIVER
  nodeName: $NODE
  pool: {name: $NODE, generation: 7, resourceSliceCount: 1}
  devices: [{name: gone}]
YAML
"$helm" install "$RELEASE" charts/tessera -n "$TESSERA_NAMESPACE" --create-namespace \
  -f e2e/values-real-node.yaml --set allocation=auto --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready: $(kubectl -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"
kubectl create namespace "$NAMESPACE" >/dev/null

eight_devices() { [[ "$(slice_devices)" == 8 ]]; }
wait_until "$TIMEOUT" "the node's ResourceSlice with 8 devices, the left-over slice gone" eight_devices
generation=$(kubectl get resourceslices -o json | jq --arg node "$NODE" --arg d "$DRIVER" \
  '[.items[] | select(.spec.nodeName == $node and .spec.driver == $d) | .spec.pool.generation] | max')
[[ "$generation" == 8 ]] || die "the agent's pool generation is $generation, not 8 (one past the left-over slice's)"
kubectl get deviceclass "$DRIVER" >/dev/null || die "no DeviceClass $DRIVER"
log "the agent publishes 8 devices in $NODE's ResourceSlice (generation 8, the left-over slice deleted); the DeviceClass is there"

running_pods() {
  kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$1" -o json \
    | jq '[.items[] | select(.status.phase == "Running" and .metadata.deletionTimestamp == null)] | length'
}
cdi_specs() { find "$CDI_DIR" -maxdepth 1 -name "$DRIVER-claim_*.json" 2>/dev/null | wc -l; }
prepared_claims() { jq '.Data | fromjson | [.ClaimInfoStateList[]?] | length' "$DRA_MANAGER_STATE"; }

current_test=eight_stages
# Timed by one watch started before `kubectl apply`, each event stamped as it arrives
# (EPOCHREALTIME: no process started): on a two-core node the eight pods' start keeps
# both cores busy, and a kubectl started meanwhile to look would take CPU from them
# and count its own start-up.
events=$(mktemp)
kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=eight --watch --no-headers \
  --request-timeout="${TIMEOUT}s" \
  -o custom-columns=NAME:.metadata.name,NODE:.spec.nodeName,PHASE:.status.phase 2>/dev/null \
  > >(while read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done >"$events") &
watcher=$!
sleep 1
start=$EPOCHREALTIME
instance eight 8
# last_first bound|running: when the last of the eight pods was first seen bound (a node
# in its spec) or Running; empty until all eight have been.
last_first() {
  awk -v what="$1" '(what == "bound" ? $3 != "<none>" : $4 == "Running") && !seen[$2]++ {
    if (++n == 8) { print $1; exit } }' "$events"
}
deadline=$((SECONDS + TIMEOUT))
until running_at=$(last_first running) && [[ -n "$running_at" ]]; do
  ((SECONDS < deadline)) || die "8 stages not Running after ${TIMEOUT}s: $(tail -n 8 "$events")"
  kill -0 "$watcher" 2>/dev/null || die "the watch of the stage pods ended: $(tail -n 8 "$events")"
  sleep 0.1
done
bound_at=$(last_first bound)
kill "$watcher" 2>/dev/null || true
seconds_since() { awk -v a="$start" -v b="$1" 'BEGIN { printf "%.1f", b - a }'; }
elapsed=$(seconds_since "$running_at")
[[ "$(running_pods eight)" == 8 ]] || die "$(running_pods eight) of 8 stages Running"
log "kubectl apply -> 8 shards Running in ${elapsed} s (the controller had bound all 8 after $(seconds_since "$bound_at") s)"
wait_until 60 "every shard on its planned device, prepared by kubelet and seen by the container" \
  shards_match_plan eight
[[ "$(cdi_specs)" == 8 ]] || die "$(cdi_specs) CDI specs for 8 prepared claims"
log "every shard's claim holds exactly its planned device; kubelet prepared it; the container sees it"

# claim_and_pod NAME [NODE]: a claim NAME for one GPU of the DeviceClass and a pod NAME
# using it; with NODE the pod is put on it directly (no scheduler allocates its claim).
claim_and_pod() {
  local placement=""
  [[ -z "${2:-}" ]] || placement="nodeName: $2
  schedulerName: nobody"
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: $1}
spec:
  devices:
    requests:
      - name: gpus
        exactly: {deviceClassName: $DRIVER, count: 1}
---
apiVersion: v1
kind: Pod
metadata: {name: $1}
spec:
  $placement
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: busybox:1.37
      imagePullPolicy: IfNotPresent
      command: [sleep, "3600"]
      resources: {claims: [{name: gpus}]}
  resourceClaims:
    - {name: gpus, resourceClaimName: $1}
YAML
}

current_test=users_claim
# Every GPU is in a shard: kube-scheduler must not allocate a user's claim one of them.
claim_and_pod users
unschedulable() {
  local reason
  reason=$(kubectl get pod -n "$NAMESPACE" users -o jsonpath='{.status.conditions[?(@.type=="PodScheduled")].reason}')
  [[ "$reason" == Unschedulable ]] || { echo "pod users: PodScheduled reason '$reason'"; return 1; }
}
wait_until "$TIMEOUT" "kube-scheduler to find no device for a user's claim" unschedulable
[[ -z "$(kubectl get resourceclaim -n "$NAMESPACE" users -o jsonpath='{.status.allocation}')" ]] \
  || die "kube-scheduler allocated a user's claim a device a shard holds"
kubectl delete pod -n "$NAMESPACE" users --wait=true >/dev/null
kubectl delete resourceclaim -n "$NAMESPACE" users --wait=true >/dev/null
log "kube-scheduler counts the shards' allocations: a user's claim finds no device"

current_test=agent_restart
before=$(kubectl get pods -n "$NAMESPACE" -o jsonpath='{range .items[*]}{.metadata.uid}{"\n"}{end}' | sort)
# shellcheck disable=SC2046 # pod names are words
record_api_use agent $(component_pods agent)
kubectl -n "$TESSERA_NAMESPACE" delete pod -l app.kubernetes.io/component=agent --wait=true >/dev/null
kubectl -n "$TESSERA_NAMESPACE" rollout status daemonset -l app.kubernetes.io/component=agent --timeout="${TIMEOUT}s" >/dev/null 2>&1 \
  || kubectl -n "$TESSERA_NAMESPACE" wait pod -l app.kubernetes.io/component=agent --for=condition=Ready --timeout="${TIMEOUT}s" >/dev/null
eight_in_use() {
  local state
  state=$(kubectl get node "$NODE" -o json | jq '.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .allocated | length')
  [[ "$state" == 8 ]] || { echo "the agent reports $state devices in use"; return 1; }
}
wait_until "$TIMEOUT" "the new agent to report the 8 prepared devices in use" eight_in_use
after=$(kubectl get pods -n "$NAMESPACE" -o jsonpath='{range .items[*]}{.metadata.uid}{"\n"}{end}' | sort)
[[ "$before" == "$after" ]] || die "shard pods changed across the agent restart"
shards_match_plan eight >/dev/null || die "after the agent restart: $(shards_match_plan eight)"
[[ "$(cdi_specs)" == 8 ]] || die "$(cdi_specs) CDI specs after the agent restart"
log "the new agent kept every prepared claim; no shard moved"

current_test=bad_claims
# claim_for NAME POOL DEVICE: a claim allocated by hand (as a custom scheduler would)
# and a pod on the node that uses it.
claim_for() {
  local name="$1" pool="$2" device="$3" uid results
  claim_and_pod "$name" "$NODE"
  uid=$(kubectl get pod -n "$NAMESPACE" "$name" -o jsonpath='{.metadata.uid}')
  results="[{\"request\": \"gpus\", \"driver\": \"$DRIVER\", \"pool\": \"$pool\", \"device\": \"$device\"}]"
  kubectl get resourceclaim -n "$NAMESPACE" "$name" -o json \
    | jq --arg node "$NODE" --arg pod "$name" --arg uid "$uid" --argjson results "$results" \
      '.status = {allocation: {devices: {results: $results}, nodeSelector: {nodeSelectorTerms: [{matchFields: [{key: "metadata.name", operator: "In", values: [$node]}]}]}}, reservedFor: [{resource: "pods", name: $pod, uid: $uid}]}' \
    | kubectl replace --subresource=status -f - >/dev/null
}
a_device=$(kubectl get resourceslices -o json | jq -r --arg node "$NODE" '[.items[] | select(.spec.nodeName == $node) | .spec.devices[0].name][0]')
claim_for elsewhere node-elsewhere "$a_device"
claim_for unknown "$NODE" gpu-that-is-not-here
refused_with() {
  local pod="$1" want="$2" events
  events=$(kubectl get events -n "$NAMESPACE" --field-selector "involvedObject.name=$pod" -o jsonpath='{range .items[*]}{.message}{"\n"}{end}')
  grep -qF "$want" <<<"$events" || { echo "pod $pod's events do not say '$want': $events"; return 1; }
}
wait_until "$TIMEOUT" "the claim on another node refused" refused_with elsewhere "is not on this node"
wait_until "$TIMEOUT" "the unknown device refused" refused_with unknown "is not one of this node's GPUs"
for pod in elsewhere unknown; do
  uid=$(kubectl get resourceclaim -n "$NAMESPACE" "$pod" -o jsonpath='{.metadata.uid}')
  [[ ! -e "$CDI_DIR/$DRIVER-claim_$uid.json" ]] || die "a CDI spec was written for the refused claim $pod"
  [[ "$(kubectl get pod -n "$NAMESPACE" "$pod" -o jsonpath='{.status.phase}')" == Pending ]] \
    || die "pod $pod with a refused claim is not Pending"
done
[[ "$(cdi_specs)" == 8 ]] || die "refused claims changed the CDI specs: $(cdi_specs)"
kubectl delete pod -n "$NAMESPACE" elsewhere unknown --wait=true >/dev/null
kubectl delete resourceclaim -n "$NAMESPACE" elsewhere unknown --wait=false >/dev/null
log "each bad claim was refused with its reason; nothing was prepared"

current_test=deleted
kubectl delete mi -n "$NAMESPACE" eight --wait=true >/dev/null
all_gone() { all_gone_of eight; }
all_gone_of() {
  local pods claims
  pods=$(kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$1" -o name | wc -l)
  claims=$(kubectl get resourceclaims -n "$NAMESPACE" -o name | wc -l)
  [[ "$pods" == 0 && "$claims" == 0 && "$(cdi_specs)" == 0 && "$(prepared_claims)" == 0 ]] \
    || { echo "$pods pods, $claims claims, $(cdi_specs) CDI specs, $(prepared_claims) prepared claims left"; return 1; }
}
wait_until "$TIMEOUT" "pods, claims, CDI specs and prepared claims to go" all_gone
instance again 8
eight_again() { [[ "$(running_pods again)" == 8 ]]; }
wait_until "$TIMEOUT" "a new instance to use all 8 devices" eight_again
shards_match_plan again >/dev/null || die "the next instance: $(shards_match_plan again)"
log "deleting the instance freed every device: the next one runs on all 8"

current_test=device_fault
# A fault on the device of one shard of two: only that shard's claim moves.
kubectl delete mi -n "$NAMESPACE" again --wait=true >/dev/null
wait_until "$TIMEOUT" "again's pods and claims to go" all_gone_of again
# RecreatePod: the fault check below shows that only the faulted shard moves.
instance pair 2 RecreatePod
pair_running() { [[ "$(running_pods pair)" == 2 ]] && shards_match_plan pair >/dev/null; }
wait_until "$TIMEOUT" "pair to run" pair_running
before=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=pair -o json \
  | jq -r '.items[] | "\(.metadata.name) \(.metadata.uid)"' | sort)
faulty=$(mi pair | jq -r '.status.plan[1].devices[0]')
index=$(kubectl get node "$NODE" -o json | jq -r --arg id "$faulty" \
  '.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .devices[] | select(.id == $id) | .index')
# A user's pod whose claim kube-scheduler allocates: nothing moves it, so kubelet's
# report of its device's health can be watched.
claim_and_pod watched
watched_running() { [[ "$(kubectl get pod -n "$NAMESPACE" watched -o jsonpath='{.status.phase}')" == Running ]]; }
wait_until "$TIMEOUT" "a user's pod with a claim of its own to run" watched_running
watched=$(kubectl get resourceclaim -n "$NAMESPACE" watched -o jsonpath='{.status.allocation.devices.results[0].device}')
watched_uid=$(kubectl get resourceclaim -n "$NAMESPACE" watched -o jsonpath='{.metadata.uid}')
watched_index=$(kubectl get resourceslices -o json | jq -r --arg node "$NODE" --arg name "$watched" \
  '.items[] | select(.spec.nodeName == $node) | .spec.devices[]? | select(.name == $name) | .attributes.index.int')
# watched_health_is HEALTH: kubelet reports the user's pod's device so (by the CDI
# device the driver prepared for the claim's request).
watched_health_is() {
  local health
  health=$(kubectl get pod -n "$NAMESPACE" watched -o json | jq -r --arg id "$DRIVER/claim=$watched_uid-gpus" \
    '[.status.containerStatuses[]?.allocatedResourcesStatus[]? | select(.name == "claim:gpus")
      | .resources[]? | select(.resourceID == $id) | .health] | first // "none"')
  [[ "$health" == "$1" ]] || { echo "kubelet reports $watched of pod watched as $health, not $1"; return 1; }
}
wait_until 60 "kubelet to report the user's device Healthy" watched_health_is Healthy
inject_fault "$NODE" "$index" "$watched_index"
tainted() {
  kubectl get resourceslices -o json | jq -e --arg id "$faulty" --arg d "$DRIVER" \
    '[.items[] | select(.spec.driver == $d) | .spec.devices[]? | select(.attributes.id.string == $id)
      | .taints[]? | select(.key == ($d + "/unhealthy") and .effect == "NoSchedule")] | length == 1' >/dev/null \
    || { echo "$faulty carries no NoSchedule taint in the slice yet"; return 1; }
}
wait_until "$TIMEOUT" "$faulty to be tainted in the node's slice (kubelet refreshes the ConfigMap)" tainted
moved() {
  local now
  now=$(mi pair | jq -r '.status.plan[1].devices[0]')
  [[ "$now" != "$faulty" ]] || { echo "shard 1 still planned on $faulty"; return 1; }
  pair_running || { echo "pair not running on its plan: $(shards_match_plan pair)"; return 1; }
}
wait_until "$TIMEOUT" "pair's shard 1 to move off $faulty and run" moved
wait_until 60 "kubelet to report the user's device Unhealthy" watched_health_is Unhealthy
[[ "$(grep '^pair-shard-0 ' <<<"$before")" == "$(kubectl get pods -n "$NAMESPACE" pair-shard-0 -o json \
  | jq -r '"\(.metadata.name) \(.metadata.uid)"')" ]] || die "pair's shard 0 was recreated though its device is healthy"
restore_fault
untainted() { ! tainted >/dev/null; }
wait_until "$TIMEOUT" "$faulty to lose its taint once healthy" untainted
wait_until 60 "kubelet to report the user's device Healthy again" watched_health_is Healthy
kubectl delete pod -n "$NAMESPACE" watched --wait=true >/dev/null
kubectl delete resourceclaim -n "$NAMESPACE" watched --wait=true >/dev/null
log "only the faulted shard's claim moved ($faulty -> $(mi pair | jq -r '.status.plan[1].devices[0]')); the taint came and went with the fault; kubelet showed the user's pod its device Unhealthy, then Healthy"

current_test=kubelet_restart
if [[ -z "$KUBELET_PIDFILE" ]]; then
  log "skipped: KUBELET_PIDFILE is not set"
  instance meanwhile 2
  wait_until "$TIMEOUT" "meanwhile to run" shards_match_plan meanwhile
else
  kept=$(kubectl get pod -n "$NAMESPACE" pair-shard-0 -o jsonpath='{.metadata.uid}')
  restart_kubelet
  # Created while kubelet starts again: its claims are prepared once the driver has
  # registered with the new kubelet.
  instance meanwhile 2
  wait_until "$TIMEOUT" "$NODE to be Ready" node_ready
  both_running() {
    pair_running || { echo "pair: $(shards_match_plan pair)"; return 1; }
    [[ "$(running_pods meanwhile)" == 2 ]] || { echo "meanwhile: $(running_pods meanwhile) of 2 shards Running"; return 1; }
    shards_match_plan meanwhile >/dev/null || { echo "meanwhile: $(shards_match_plan meanwhile)"; return 1; }
  }
  wait_until "$TIMEOUT" "pair and the instance created meanwhile to run on their prepared devices" both_running
  [[ "$(kubectl get pod -n "$NAMESPACE" pair-shard-0 -o jsonpath='{.metadata.uid}')" == "$kept" ]] \
    || die "pair's shard 0 was recreated across the kubelet restart"
  [[ "$(prepared_claims)" == 4 && "$(cdi_specs)" == 4 ]] \
    || die "after the kubelet restart kubelet holds $(prepared_claims) prepared claims and there are $(cdi_specs) CDI specs, not 4"
  wait_until 60 "the node's ResourceSlice with 8 devices" eight_devices
  # Kubelet deletes the node's slices as it starts; the agent wrote them again.
  agent=$(component_pods agent | head -n 1)
  text=$(scrape "$TESSERA_NAMESPACE" "$agent" "$(pod_port "$agent")") || die "$text"
  restores=$(awk '$1 == "tessera_agent_resource_slice_restores" { print $2; exit }' <<<"$text")
  [[ "${restores:-0}" -ge 1 ]] || die "the agent reports ${restores:-no} slice restores after the kubelet restart"
  log "kubelet restarted: the driver registered again, its slices were written again ($restores restore), pair's shards kept their devices, an instance created meanwhile runs"
fi

current_test=recreate_replica
# meanwhile has two shards and the default restart policy, RecreateReplica: one rank
# deleted by hand takes the other with it, and both come back on the plan they had.
plan=$(mi meanwhile | jq -c '[.status.plan[] | {node, devices}]')
old_uids=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=meanwhile -o jsonpath='{.items[*].metadata.uid}')
kubectl delete pod -n "$NAMESPACE" meanwhile-shard-1 --wait=false >/dev/null
recreated() {
  local uids uid
  uids=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=meanwhile -o jsonpath='{.items[*].metadata.uid}')
  for uid in $old_uids; do
    [[ " $uids " != *" $uid "* ]] || { echo "pod $uid of the old replica is still there"; return 1; }
  done
  shards_match_plan meanwhile
}
wait_until "$TIMEOUT" "the whole replica of meanwhile to be recreated and run" recreated
[[ "$(mi meanwhile | jq -c '[.status.plan[] | {node, devices}]')" == "$plan" ]] \
  || die "meanwhile's plan changed: $plan -> $(mi meanwhile | jq -c '[.status.plan[] | {node, devices}]')"
log "one rank deleted: both of meanwhile's pods were recreated, on the devices they had"

current_test=crash_loop
kubectl apply -n "$NAMESPACE" -f - >/dev/null <<EOF
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata:
  name: crasher
spec:
  model:
    name: e2e/crasher
    parametersBillions: 8
    layers: 32
    dtype: bf16
  parallelism:
    tensor: 1
    pipeline: 2
  template:
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: 1
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          # The termination message carries markup: the map must show it as text.
          command: [sh, -c, 'echo "rank \$TESSERA_SHARD_INDEX cannot start <script>alert(1)</script>" | tee /dev/termination-log; exit 1']
EOF
# restarts COUNT: crasher's replica has been recreated COUNT times or more, and waits.
restarts() {
  local status
  status=$(mi crasher)
  jq -e --argjson n "$1" '(.status.restarts[0].count // 0) >= $n
    and any(.status.conditions[]?; .type == "ReplicaFailure" and .status == "True" and .reason == "BackOff")' \
    <<<"$status" >/dev/null || { jq -c '{restarts: .status.restarts, conditions: [.status.conditions[]? | select(.type == "ReplicaFailure")]}' <<<"$status"; return 1; }
}
last_time() { date -d "$(mi crasher | jq -r '.status.restarts[0].lastTime')" +%s; }
wait_until 90 "crasher to be recreated twice and back off" restarts 2
second=$(last_time)
message=$(mi crasher | jq -r '.status.conditions[] | select(.type == "ReplicaFailure") | .message')
[[ "$message" == *"crasher-shard-"*"container shard exited with code 1, Error"* ]] \
  || die "the ReplicaFailure condition does not name the rank and its exit: $message"
events=$(kubectl get events -n "$NAMESPACE" --field-selector involvedObject.name=crasher,reason=BackOff -o json | jq '.items | length')
[[ "$events" -ge 1 ]] || die "no BackOff event for crasher"
wait_until 120 "crasher's third recreation" restarts 3
third=$(last_time)
[[ $((third - second)) -ge 19 && $((third - second)) -le 30 ]] \
  || die "the third recreation came $((third - second)) s after the second, not 20"
log "a replica that cannot start backs off: recreated at once, then after 10 s, then $((third - second)) s later; ReplicaFailure and a BackOff event name the rank: $message"

current_test=cluster_map
# The map as headless Chromium builds it through a port-forward to the controller, with
# pair, meanwhile and crasher planned and a free device made unhealthy: every node has
# its row, every planned device's cell names its instance and shard, the unhealthy
# device is marked, and crasher's ReplicaFailure message (its container's termination
# message holds a script element) shows as text. The screenshot is kept in target/e2e/.
gpu_state() {
  kubectl get node "$NODE" -o json | jq -c '.metadata.annotations["tessera.dev/gpu-state"] | fromjson'
}
# Every planned device by node and index (the map's cells), with the shard holding it.
planned=$(kubectl get mi -n "$NAMESPACE" -o json | jq -c --argjson state "$(gpu_state)" --arg node "$NODE" \
  '[.items[] | .metadata.name as $n | .status.plan[]? | .replica as $r | .shard as $s | .devices[]
  | . as $id | {node: $node, index: ($state.devices[] | select(.id == $id) | .index), device: $id,
    instance: ("'"$NAMESPACE"'/" + $n), replica: ($r // 0), shard: $s}]')
free_device=$(gpu_state | jq -r --argjson planned "$planned" \
  '[.devices[] | select(.id as $id | $planned | map(.device) | index($id) | not)][0] | "\(.index) \(.id)"')
[[ "$free_device" != "null null" ]] || die "no free device to make unhealthy: $planned"
read -r free_index free_id <<<"$free_device"
inject_fault "$NODE" "$free_index"
unhealthy_in_state() {
  gpu_state | jq -e --arg id "$free_id" '.devices[] | select(.id == $id) | .health == "Unhealthy"' >/dev/null \
    || { echo "$free_id is not Unhealthy in the node's GPU state yet"; return 1; }
}
wait_until "$TIMEOUT" "$free_id to be Unhealthy in the node's GPU state" unhealthy_in_state
controller=$(component_pods controller | head -n 1)
map_port=$(kubectl -n "$TESSERA_NAMESPACE" get pod "$controller" \
  -o jsonpath='{.spec.containers[0].ports[?(@.name=="map")].containerPort}')
[[ -n "$map_port" ]] || die "the controller pod has no map port"
mkdir -p target/e2e
browse "$TESSERA_NAMESPACE" "$controller" "$map_port" / target/e2e/map-dom.html target/e2e/cluster-map.png \
  || die "the map did not load"
expect=$(jq -nc --arg node "$NODE" --argjson cells "$planned" --argjson sick "$free_index" \
  '{nodes: [$node], cells: $cells, unhealthy: [{node: $node, index: $sick}]}')
summary=$(python3 e2e/map_check.py cluster target/e2e/map-dom.html "$expect") || die "the map: $summary"
browse "$TESSERA_NAMESPACE" "$controller" "$map_port" "/instances/$NAMESPACE/crasher" target/e2e/map-crasher-dom.html \
  || die "crasher's page did not load"
shown=$(python3 e2e/map_check.py instance target/e2e/map-crasher-dom.html "<script>alert(1)</script>") \
  || die "crasher's page: $shown"
# The agent's device series name the shard holding each device (through DRA).
agent=$(component_pods agent | head -n 1)
text=$(scrape "$TESSERA_NAMESPACE" "$agent" "$(pod_port "$agent")") || die "$text"
pair_device=$(mi pair | jq -r '.status.plan[0].devices[0]')
grep -q "^tessera_gpu_memory_used_bytes{.*device=\"$pair_device\".*namespace=\"$NAMESPACE\",pod=\"pair-shard-0\",modelinstance=\"pair\",replica=\"0\",shard=\"0\"}" <<<"$text" \
  || die "the agent's series of $pair_device do not name pair's shard 0: $(grep "device=\"$pair_device\"" <<<"$text" | head -2)"
restore_fault
kubectl delete mi -n "$NAMESPACE" crasher --wait=false >/dev/null
log "the map in Chromium: $summary; crasher's page: $shown; screenshot target/e2e/cluster-map.png ($(stat -c %s target/e2e/cluster-map.png) bytes); the agent labels $pair_device with pair's shard 0"

current_test=least_privilege
# Grants a run may not use, with why they are needed all the same.
readonly MAY_GO_UNUSED=(
  # Evictions are a move's (e2e/real-node-moves.sh makes one); nothing here moves.
  "controller create core/pods/eviction"
  # With allocation auto a node whose kubelet does not register the driver falls back
  # to the device plugin, which watches the node's pods; this node registered it.
  "agent list core/pods"
  "agent watch core/pods"
  # The agent writes its slices by server-side apply (a patch); the API server asks
  # for create as well when the patch creates the slice.
  "agent create resource.k8s.io/resourceslices"
  # Checked when the controller writes a claim's allocation and reservation through
  # resourceclaims/status; no request names it.
  "controller update resource.k8s.io/resourceclaims/binding"
  # kube-runtime's event recorder patches an event that repeats for the same object
  # version into a series; whether a run repeats one depends on timing.
  "controller patch events.k8s.io/events"
  # The controller patches back a shard pod's hand-edited devices annotation and an
  # instance's hand-edited Service; e2e/real-node-checks.sh edits them, this run does not.
  "controller patch core/pods"
  "controller patch core/services"
)
# shellcheck disable=SC2046 # pod names are words
record_api_use agent $(component_pods agent)
# shellcheck disable=SC2046
record_api_use controller $(component_pods controller)
least_privilege "${MAY_GO_UNUSED[@]}"
for component in agent controller; do
  logs=$(kubectl -n "$TESSERA_NAMESPACE" logs -l "app.kubernetes.io/component=$component" --tail=-1 2>&1)
  if grep -qi forbidden <<<"$logs"; then
    die "the API server refused the $component something: $(grep -i forbidden <<<"$logs" | head -3)"
  fi
done
current_test=finished
log "all passed (apply -> 8 shards Running: ${elapsed} s)"
