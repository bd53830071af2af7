#!/usr/bin/env bash
# End-to-end on a real node with a real serving runtime: vLLM's CPU build (the
# install .ci/install-vllm makes, mounted from the host into the shard pod, which runs
# the project's own image) serves a tiny random-weight Llama planned onto a fake H100,
# and the controller (the chart, reading every 5 s over a 30 s window) measures it.
#   1. tiny (4 layers, hidden 256, vocabulary 1,024; `--load-format dummy`) runs and
#      answers OpenAI completions with token-ID prompts behind the Service tiny-api;
#   2. under load (e2e/load.py: concurrent clients through the Service's ready
#      addresses) the status shows what vLLM reports (requests/s, output tokens/s,
#      time per output token and to the first token) beside the prediction for an
#      H100, the Measured condition True, and no request fails; the correction of the
#      prediction is learned (status.corrections: far slower than an H100) and
#      applied to the replica's capacity without restarting its pod; the figures go
#      to target/e2e/vllm-measured.json;
#   3. vLLM's API server stopped (SIGSTOP): the Measured condition turns False naming
#      the replica and the read that timed out, the controller keeps running; resumed
#      (SIGCONT), measured again;
#   4. vLLM's API server killed: the container restarts with its counters at zero; the
#      replica is measured again (the counters' reset is no negative rate), the
#      controller never restarted;
#   5. the instance turned to `serving.demand: Measured` (at most 2 replicas, its pod
#      kept; the chart plans for twice the measured demand, so a step the two CPU cores
#      still serve needs a second replica): one client, then a step of 0.5 x a
#      replica's corrected capacity at the target adds a replica, DemandMet True once
#      both serve; the step ends: after the scale-down window (30 s here) the second
#      replica leaves the Service, drains and goes, and no request of either load
#      failed; the figures go to target/e2e/vllm-demand.json.
# Needs what e2e/real-node.sh needs, TESSERA_TEST_VLLM_PYTHON (the Python of that
# install; unset: skipped, saying so), python3 and pgrep.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e-vllm
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
readonly TIMEOUT="${TIMEOUT:-300}"
readonly FIGURES=target/e2e/vllm-measured.json
readonly DEMAND_FIGURES=target/e2e/vllm-demand.json
# lib.sh's names; the device plugin's checkpoint plays no part here.
readonly KUBELET_CHECKPOINT="" KUBELET_PIDFILE="" RESOURCE_NAME=tessera.dev/gpu FAKE_CONFIGMAP=tessera-fake-gpus
kubectl_bin="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"
work_dir=$(mktemp -d)

current_test=setup
log() { printf '[real-node-vllm %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
die() {
  echo "real-node vLLM check FAILED in $current_test: $*" >&2
  {
    echo "--- pods"
    kubectl get pods -n "$NAMESPACE" -o wide || true
    echo "--- instance status"
    kubectl get mi tiny -n "$NAMESPACE" -o json | jq .status || true
    echo "--- the shard's log"
    kubectl logs -n "$NAMESPACE" tiny-shard-0 --tail=30 || true
    echo "--- controller log"
    kubectl -n "$TESSERA_NAMESPACE" logs -l app.kubernetes.io/component=controller --tail=30 || true
    echo "real-node vLLM check FAILED in $current_test: $*"
  } >&2
  exit 1
}
if [ -z "${TESSERA_TEST_VLLM_PYTHON:-}" ]; then
  echo "real-node vLLM check skipped: TESSERA_TEST_VLLM_PYTHON is not set (.ci/install-vllm prints it)"
  exit 0
fi
[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/import-image.sh" ] || die "TESSERA_K8S_KIT does not name a kit with import-image.sh"
export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl_bin")"):$PATH"
export KUBECTL="$kubectl_bin"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh

# The install the shard pod mounts (lib.sh's vllm_example), whose server process the
# checks below stop and kill.
python_bin=$(readlink -f "$TESSERA_TEST_VLLM_PYTHON")
venv=$(cd "$(dirname "$TESSERA_TEST_VLLM_PYTHON")/.." && pwd)
"$TESSERA_TEST_VLLM_PYTHON" -c 'import vllm' 2>/dev/null || die "$TESSERA_TEST_VLLM_PYTHON has no vllm"

cleanup() {
  # A stopped server must not outlive the test.
  pkill -CONT -f "vllm.entrypoints.openai.api_server" 2>/dev/null || true
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
      $NODE: "2xH100-80GiB"
controller:
  measure: {intervalSeconds: 5, windowSeconds: 30, timeoutSeconds: 2}
  scaling: {demandHeadroom: 1, scaleDownWindowSeconds: 30, drainTimeoutSeconds: 60}
YAML
"$helm" install "$RELEASE" charts/tessera -n "$TESSERA_NAMESPACE" --create-namespace \
  -f e2e/values-real-node.yaml -f "$work_dir/values.yaml" --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready: $(kubectl -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"
kubectl create namespace "$NAMESPACE" >/dev/null

current_test=serving
vllm_example | kubectl apply -n "$NAMESPACE" -f - >/dev/null
status() { kubectl get mi tiny -n "$NAMESPACE" -o json | jq -r "$1"; }
wait_until "$TIMEOUT" "tiny Running (vLLM up and answering /health)" mi_running tiny
log "tiny runs on $(status '.status.plan[0].node + " " + (.status.plan[0].devices | join(","))'); vLLM answers"
# Before any measurement: the model's prediction alone.
predicted=$(kubectl get mi tiny -n "$NAMESPACE" -o json | jq -c '.status.replicaPredictions[0].capacity')
[[ "$(jq -r '.correction // "none"' <<<"$predicted")" == none ]] || die "corrected before measured: $predicted"

current_test=measured
load() {
  python3 e2e/load.py --namespace "$NAMESPACE" --service tiny-api --model tiny \
    --prompt-tokens 32 --max-tokens 32 "$@"
}
load --concurrency 8 --duration 45 --out "$work_dir/load" >"$work_dir/load.log" 2>&1 &
loader=$!
# measured_under_load [SECONDS]: Measured, with requests running and served, over a
# window of SECONDS at least.
measured_under_load() {
  local s
  s=$(kubectl get mi tiny -n "$NAMESPACE" -o json)
  jq -e --argjson window "${1:-0}" '(.status.conditions[] | select(.type == "Measured") | .status == "True")
    and (.status.measured.windowSeconds >= $window)
    and (.status.measured.requestsPerSecond > 0)
    and (.status.measured.running > 0)
    and (.status.replicaPredictions[0].measured.tpotMs.p50 > 0)' <<<"$s" >/dev/null \
    || { jq -c '[.status.measured, (.status.conditions[] | select(.type == "Measured"))]' <<<"$s"; return 1; }
}
wait_until 90 "tiny measured under load over 25 s" measured_under_load 25
# The CPU build is far slower than an H100: what the prediction is off by is
# learned and applied to the replica's capacity (its pod is not restarted for it).
uid=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=tiny -o jsonpath='{.items[0].metadata.uid}')
corrected() {
  # Learned once a read (every 5 s), not once a reconcile.
  kubectl get mi tiny -n "$NAMESPACE" -o json | jq -e '(.status.corrections[0].factor > 2)
    and (.status.corrections[0].observations < 40)
    and (.status.corrections[0].product | test("H100"))
    and (.status.replicaPredictions[0].capacity.correction == .status.corrections[0].factor)' >/dev/null \
    || { kubectl get mi tiny -n "$NAMESPACE" -o json | jq -c '[.status.corrections, .status.replicaPredictions[0].capacity]'; return 1; }
}
wait_until 60 "a correction learned and applied to the capacity" corrected
mkdir -p "$(dirname "$FIGURES")"
kubectl get mi tiny -n "$NAMESPACE" -o json | jq --argjson predicted "$predicted" '{predicted: $predicted,
  corrected: .status.replicaPredictions[0].capacity,
  measured: .status.replicaPredictions[0].measured, correction: .status.corrections[0],
  product: "fake H100 (vLLM CPU build)"}' >"$FIGURES"
[[ "$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=tiny -o jsonpath='{.items[0].metadata.uid}')" == "$uid" ]] \
  || die "the shard pod was replaced when the correction was learned"
wait "$loader" || die "the load generator failed: $(cat "$work_dir/load.log")"
summary=$(cat "$work_dir/load/summary.json")
[[ $(jq .failed <<<"$summary") == 0 ]] || die "requests failed under load: $(head -5 "$work_dir/load/failures")"
(($(jq .ok <<<"$summary") > 20)) || die "too few requests answered: $summary"
log "load: $summary"
log "predicted on an H100 at the target: $(jq -c .predicted "$FIGURES")"
log "measured: $(jq -c .measured "$FIGURES")"
log "learned: $(jq -c .correction "$FIGURES"); corrected capacity at the target: $(jq -c .corrected "$FIGURES")"

current_test=unanswered
controller=$(component_pods controller)
restarts() { kubectl -n "$TESSERA_NAMESPACE" get pod "$controller" -o jsonpath='{.status.containerStatuses[0].restartCount}'; }
server=$(pgrep -f "$python_bin -m vllm.entrypoints.openai.api_server|$venv/bin/python -m vllm.entrypoints.openai.api_server" | head -1)
[[ -n "$server" ]] || die "no vLLM API server process on the host"
kill -STOP "$server"
condition() {
  kubectl get mi tiny -n "$NAMESPACE" -o json \
    | jq -r '.status.conditions[] | select(.type == "Measured") | "\(.status) \(.reason): \(.message)"'
}
not_measured() { [[ "$(condition)" == "False NotMeasured: replica 0: GET http://"*"no answer within 2 s"* ]] || { condition; return 1; }; }
wait_until 60 "Measured False naming the read that timed out" not_measured
log "stopped: $(condition)"
kill -CONT "$server"
measured() { [[ "$(condition)" == "True Measured: "* ]] || { condition; return 1; }; }
wait_until 60 "measured again once resumed" measured

current_test=restarted
kill -KILL "$server"
restarted() {
  [[ "$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=tiny \
    -o jsonpath='{.items[0].status.containerStatuses[0].restartCount}')" -ge 1 ]]
}
wait_until 60 "the shard's container restarted" restarted
wait_until "$TIMEOUT" "tiny Running again" mi_running tiny
load --concurrency 2 --duration 30 --out "$work_dir/after" >"$work_dir/after.log" 2>&1 &
loader=$!
wait_until 90 "the restarted replica measured" measured_under_load
wait "$loader" || die "the load generator failed: $(cat "$work_dir/after.log")"
rate=$(status '.status.measured.requestsPerSecond')
[[ "$(restarts)" == 0 ]] || die "the controller restarted $(restarts) times"
log "ok: vLLM measured at ${rate} requests/s after its restart; the controller never restarted"

current_test=demand
# Following the measured demand keeps the plan (and the running pod).
uid=$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/instance=tiny -o jsonpath='{.items[0].metadata.uid}')
kubectl patch mi tiny -n "$NAMESPACE" --type merge \
  -p '{"spec": {"serving": {"demand": "Measured", "maxReplicas": 2}}}' >/dev/null
followed() {
  kubectl get mi tiny -n "$NAMESPACE" -o json \
    | jq -r '.status.conditions[] | select(.type == "DemandFollowed") | "\(.status) \(.reason): \(.message)"'
}
load --concurrency 1 --duration 900 --stop-file "$work_dir/base.stop" --out "$work_dir/base" >"$work_dir/base.log" 2>&1 &
base_loader=$!
following() { [[ "$(followed)" == "True Following: "* ]] || { followed; return 1; }; }
wait_until 90 "the measured demand followed" following
[[ "$(kubectl get pod tiny-shard-0 -n "$NAMESPACE" -o jsonpath='{.metadata.uid}')" == "$uid" ]] \
  || die "turning to a measured demand replaced the pod"
# What the earlier steps' load left in the window may have asked for a second
# replica: the step starts from one client served by one.
one_replica() {
  if kubectl get mi tiny -n "$NAMESPACE" -o json | jq -e '.status.replicas == 1' >/dev/null \
    && [[ -z "$(kubectl get pods -n "$NAMESPACE" -l tessera.dev/replica=1 -o name)" ]]; then
    return 0
  fi
  kubectl get mi tiny -n "$NAMESPACE" -o json | jq -c '[.status.replicas, .status.demand]'
  return 1
}
wait_until 240 "one replica for one client" one_replica
log "one client: $(followed)"
capacity=$(status '.status.replicaPredictions[0].capacity.requestsPerSecond')
rate=$(jq -n --argjson c "$capacity" '$c * 0.5 * 100 | round / 100')
log "a replica serves $capacity requests/s at the target (corrected): a step of $rate"
load --concurrency 8 --rate "$rate" --duration 600 --stop-file "$work_dir/step.stop" --out "$work_dir/step" \
  >"$work_dir/step.log" 2>&1 &
step_loader=$!
demand_met() {
  kubectl get mi tiny -n "$NAMESPACE" -o json | jq -e '(.status.readyReplicas == 2)
    and ([.status.conditions[] | select(.type == "DemandMet" and .status == "True")] | length == 1)' >/dev/null \
    || { kubectl get mi tiny -n "$NAMESPACE" -o json | jq -c '[.status.readyReplicas, .status.demand,
      (.status.conditions[] | select(.type == "DemandMet") | .message)]'; return 1; }
}
wait_until 420 "a second replica added for the step, DemandMet True once both serve" demand_met
kubectl get mi tiny -n "$NAMESPACE" -o json | jq '{up: {demand: .status.demand, capacity: .status.capacity,
  measured: .status.measured, replicas: .status.readyReplicas,
  demandMet: (.status.conditions[] | select(.type == "DemandMet") | .message)}}' >"$work_dir/up.json"
log "the step: $(jq -c .up.demand "$work_dir/up.json"), $(jq -r .up.demandMet "$work_dir/up.json")"
touch "$work_dir/step.stop"
wait "$step_loader" || die "the step's load generator failed: $(cat "$work_dir/step.log")"
wait_until 240 "the second replica drained and gone once the step ended" one_replica
drained=$(kubectl get events -n "$NAMESPACE" --field-selector reason=Drained -o json | jq -r '.items | last | .message')
[[ -n "$drained" && "$drained" != null ]] || die "no Drained event"
log "$drained"
touch "$work_dir/base.stop"
wait "$base_loader" || die "the base load generator failed: $(cat "$work_dir/base.log")"
for part in base step; do
  summary=$(cat "$work_dir/$part/summary.json")
  [[ $(jq .failed <<<"$summary") == 0 ]] || die "requests of the $part load failed: $(head -5 "$work_dir/$part/failures")"
  log "$part load: $summary"
done
jq --slurpfile base "$work_dir/base/summary.json" --slurpfile step "$work_dir/step/summary.json" \
  '. + {base: $base[0], step: $step[0]}' "$work_dir/up.json" >"$DEMAND_FIGURES"
log "ok: a replica added for the step and drained after it, no request failed"
