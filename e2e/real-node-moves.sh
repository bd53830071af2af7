#!/usr/bin/env bash
# End-to-end moves on a real node: a replica moved make before break, under a real
# kubelet and containerd, so that a blocked 4-GPU instance gets room. The chart runs
# with 8 fake H100s (e2e/values-real-node.yaml), the device plugin, free memory
# published every 5 s, a move timeout of 60 s and no backoff.
#   1. `small` (an 8B replica serving HTTP behind the Service small-api, with a
#      PodDisruptionBudget of minAvailable 1) runs on one GPU; four other GPUs are then
#      given 50 GiB of memory in use, so only `small`'s GPU and three more hold a shard
#      of `big` (a 70B replica over 4 GPUs), which is refused for room;
#   2. never_ready: the first surge copy of `small` never becomes Ready (its pods read
#      a ConfigMap that says so when they start): the move is abandoned after 60 s, the
#      copy removed, `small` untouched on its GPU (Event MoveAbandoned);
#   3. moved: surge copies become Ready again; the next move starts, the controller pod
#      is killed while its new copy readies, the new controller carries the recorded
#      move on: the new copy serves, the old pod is evicted through the Eviction API,
#      `small` runs on a GPU with less memory free and `big` on the four that have it
#      (Events Moved, MakingRoom);
#   4. cordoned: the node is cordoned; small has nowhere else to go and says so
#      (condition OnCordonedNode, reason CannotLeave; Event CannotLeave), and a
#      `kubectl drain` of its pods is refused by its PodDisruptionBudget while it keeps
#      serving; uncordoned, the condition goes;
#   5. throughout, a client polls `small` as a Service would route it (every ready
#      address of small-api's EndpointSlices, as kube-proxy would pick one; this kit
#      runs no kube-proxy) and no request fails, and `small` never has fewer ready
#      replicas than the one it started with.
# Needs what e2e/real-node.sh needs, and curl.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e-moves
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
readonly TIMEOUT="${TIMEOUT:-240}"
readonly FAKE_CONFIGMAP=tessera-fake-gpus RESOURCE_NAME=tessera.dev/gpu
readonly KUBELET_CHECKPOINT="" KUBELET_PIDFILE=""
kubectl_bin="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"
poll_dir=$(mktemp -d)

current_test=setup
log() { printf '[real-node-moves %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
die() {
  echo "real-node moves check FAILED in $current_test: $*" >&2
  {
    declare -F dump_state >/dev/null && dump_state
    echo "real-node moves check FAILED in $current_test: $*"
  } >&2
  exit 1
}
[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/import-image.sh" ] || die "TESSERA_K8S_KIT does not name a kit with import-image.sh"
export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl_bin")"):$PATH"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh

poller=""
cleanup() {
  [[ -n "$poller" ]] && kill "$poller" 2>/dev/null
  rm -rf "$API_USE" "$poll_dir"
  restore_fault || true
  kubectl uncordon "$NODE" >/dev/null 2>&1 || true
  [ "${KEEP:-0}" = 1 ] && return 0
  kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
  "$helm" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

fresh_start
"$helm" install "$RELEASE" charts/tessera -n "$TESSERA_NAMESPACE" --create-namespace \
  -f e2e/values-real-node.yaml --set agent.publishInterval=5 --set controller.moves.timeoutSeconds=60 \
  --set controller.moves.backoffSeconds=0 --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready: $(kubectl -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"
wait_until "$TIMEOUT" "8 GPUs registered" \
  bash -c "[ \"\$(kubectl get node $NODE -o jsonpath='{.status.allocatable.tessera\.dev/gpu}')\" = 8 ]"
kubectl create namespace "$NAMESPACE" >/dev/null

# Whether a new surge copy may become Ready: its pods read this when they start.
surge_ready() {
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<YAML
apiVersion: v1
kind: ConfigMap
metadata: {name: surge}
data: {ready: "$1"}
YAML
}
surge_ready false

# small: an 8B replica on one GPU serving its pod name over HTTP. A pod of a move's new
# copy (named *-m-*) is Ready only when the ConfigMap said so as it started. preStop
# keeps an evicted pod serving while the endpoints learn it is going.
kubectl apply -n "$NAMESPACE" -f - >/dev/null <<'YAML'
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: small}
spec:
  model: {name: e2e/small, parametersBillions: 8, layers: 32, kvCacheGiB: 1}
  parallelism: {tensor: 1, pipeline: 1}
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
              mkdir -p /www && hostname > /www/index.html
              case "$(hostname)" in
                *-m-*) [ "$(cat /surge/ready)" = true ] && touch /tmp/ready ;;
                *) touch /tmp/ready ;;
              esac
              exec httpd -f -p 8080 -h /www
          ports: [{containerPort: 8080, name: http}]
          readinessProbe:
            exec: {command: [test, -e, /tmp/ready]}
            initialDelaySeconds: 15
            periodSeconds: 2
          lifecycle:
            preStop: {exec: {command: [sleep, "4"]}}
          volumeMounts: [{name: surge, mountPath: /surge}]
      volumes: [{name: surge, configMap: {name: surge}}]
---
apiVersion: v1
kind: Service
metadata: {name: small-api}
spec:
  selector: {tessera.dev/instance: small}
  ports: [{port: 8080, targetPort: http}]
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: small}
spec:
  minAvailable: 1
  selector: {matchLabels: {tessera.dev/instance: small}}
YAML

small_field() { kubectl get mi small -n "$NAMESPACE" -o json | jq -r "$1"; }
wait_until "$TIMEOUT" "small Running" mi_running small
first=$(small_field '.status.plan[0].devices[0]')
first_index=$(kubectl get node "$NODE" -o json \
  | jq -r --arg id "$first" '.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .devices[] | select(.id == $id) | .index')
[[ "$first_index" =~ ^[0-7]$ ]] || die "small's device $first has no index on $NODE"
log "small runs on $first (index $first_index)"

# The poller: small-api's ready addresses answer, and small's ready replicas.
poll_service small-api small "$poll_dir" &
poller=$!
wait_until 60 "the poller's first answer" bash -c "[ -s $poll_dir/counts ] && [ \"\$(cut -d' ' -f1 $poll_dir/counts)\" -gt 0 ]"

# Four GPUs other than small's get 50 GiB in use: big (35 GiB a GPU) fits only on
# small's GPU and the three others.
crowded=()
for index in 0 1 2 3 4 5 6 7; do
  [[ "$index" = "$first_index" ]] && continue
  ((${#crowded[@]} < 4)) && crowded+=("$index")
done
FAULT='memoryUsedGiB: 50' inject_fault "$NODE" "${crowded[@]}"
crowded_seen() {
  kubectl get node "$NODE" -o json | jq -e --argjson want "${#crowded[@]}" \
    '[.metadata.annotations["tessera.dev/gpu-state"] | fromjson | .devices[] | select(.memoryFreeBytes < 34359738368)] | length == $want' >/dev/null
}
# The agent publishes free memory (telemetry) every 5 s here, once kubelet has brought
# the changed ConfigMap in (inject_fault has it sync the agent's pod).
wait_until "$TIMEOUT" "devices ${crowded[*]} with 50 GiB in use" crowded_seen
log "devices ${crowded[*]} have 30 GiB free"

kubectl apply -n "$NAMESPACE" -f - >/dev/null <<'YAML'
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: big}
spec:
  model: {name: e2e/big, parametersBillions: 70, layers: 80, kvCacheGiB: 1}
  parallelism: {tensor: 4, pipeline: 1}
  template:
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          command: [sh, -c, "trap 'exit 0' TERM; while true; do sleep 1; done"]
YAML

current_test=never_ready
wait_until "$TIMEOUT" "big making room" event_reason big MakingRoom
wait_until 60 "small's move recorded" bash -c "[ \"\$(kubectl get mi small -n $NAMESPACE -o jsonpath='{.status.moves[0].phase}')\" = Surging ]"
first_started=$(small_field '.status.moves[0].started')
log "the move is recorded: $(small_field '.status.moves[0] | "\(.from[0].devices[0]) -> \(.to[0].devices[0])"')"
# Its new copy has read the ConfigMap once its container runs; later copies may ready.
wait_until 60 "the new copy's container running" bash -c \
  "[ \"\$(kubectl get pod small-m-shard-0 -n $NAMESPACE -o jsonpath='{.status.containerStatuses[0].state.running.startedAt}')\" != '' ]"
surge_ready true
wait_until 120 "the never-Ready surge abandoned" event_reason small MoveAbandoned
[[ "$(small_field '.status.plan[0].devices[0]')" = "$first" ]] || die "small left $first though its surge copy was never Ready"
log "abandoned after the 60 s bound; small still on $first"

current_test=moved
next_move() {
  local started
  started=$(small_field '.status.moves[0] | select(.phase == "Surging") | .started // empty')
  [[ -n "$started" && "$started" != "$first_started" ]] || { echo "move in flight started: ${started:-none}"; return 1; }
}
wait_until 60 "the next move in flight" next_move
controller=$(kubectl -n "$TESSERA_NAMESPACE" get pods -l app.kubernetes.io/component=controller -o jsonpath='{.items[0].metadata.name}')
kubectl -n "$TESSERA_NAMESPACE" delete pod "$controller" --wait=false >/dev/null
log "killed the controller ($controller) while small's new copy readies"
moved() {
  [ "$(small_field '.status.moves | length')" = 0 ] \
    && [ "$(small_field '.status.plan[0].devices[0]')" != "$first" ] \
    && [ "$(small_field '.status.plan[0].copy // 0')" = 1 ]
}
wait_until "$TIMEOUT" "small moved off $first" moved
# The move over, the instance it made room for is woken (not left to its 5-minute retry).
wait_until 60 "big Running" mi_running big
event_reason small Moved || die "no Moved event on small"
kubectl get pod small-shard-0 -n "$NAMESPACE" >/dev/null 2>&1 && die "the old pod small-shard-0 is still there"
moves_told=$(kubectl get events -n "$NAMESPACE" --field-selector involvedObject.name=small -o json \
  | jq -r '[.items | sort_by(.eventTime // .lastTimestamp) | .[] | select(.reason | test("Move")) | "\(.eventTime // .lastTimestamp | .[11:19]) \(.reason)"] | join(", ")')
log "small's moves: $moves_told"
log "small moved to $(small_field '.status.plan[0].devices[0]'); big runs on $(kubectl get mi big -n "$NAMESPACE" -o json | jq -r '.status.plan[0].devices | join(",")')"

logs=$(kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=controller --tail=-1 2>&1)
if grep -qi forbidden <<<"$logs"; then
  die "the API server refused the controller something (its eviction?): $(grep -i forbidden <<<"$logs" | head -3)"
fi

current_test=cordoned
# The only node cordoned: small cannot leave it, and says so; its PDB keeps a drain of
# its pods from taking its one copy.
kubectl cordon "$NODE" >/dev/null
cordon_condition() {
  small_field '.status.conditions[]? | select(.type == "OnCordonedNode") | "\(.status) \(.reason): \(.message)"'
}
cannot_leave() { [[ "$(cordon_condition)" == "True CannotLeave: "*"stays on a cordoned node: no devices off the leaving nodes hold it"* ]]; }
wait_until 60 "small's OnCordonedNode condition says it cannot leave" cannot_leave
event_reason small CannotLeave || die "no CannotLeave event on small"
log "$(cordon_condition)"
if kubectl drain "$NODE" --pod-selector=tessera.dev/instance=small --ignore-daemonsets \
  --timeout=20s >"$poll_dir/drain" 2>&1; then
  die "kubectl drain evicted small's only copy: $(cat "$poll_dir/drain")"
fi
grep -q "disruption budget" "$poll_dir/drain" \
  || die "the drain failed, but not for small's PodDisruptionBudget: $(tail -3 "$poll_dir/drain")"
[ "$(small_field '.status.readyReplicas')" = 1 ] || die "small lost its ready replica to the drain"
log "kubectl drain refused by small's PodDisruptionBudget; small still serves"
kubectl uncordon "$NODE" >/dev/null
no_condition() { [[ -z "$(cordon_condition)" ]]; }
wait_until 60 "small's OnCordonedNode condition gone" no_condition

current_test=served
kill "$poller"
poller=""
read -r ok failed fewest <"$poll_dir/counts"
((failed == 0)) || die "$failed of $((ok + failed)) requests to small failed during the moves: $(head -5 "$poll_dir/failures")"
((fewest >= 1)) || die "small had $fewest ready replicas at some point during the moves"
((ok > 100)) || die "only $ok requests answered; the poller did not run through the moves"
log "ok: $ok requests to small answered, none failed; small never had fewer than 1 ready replica (moves, cordon and drain)"
