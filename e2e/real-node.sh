#!/usr/bin/env bash
# End-to-end on a real node: the runtime image built without Docker
# (e2e/image.sh) runs under a real kubelet and containerd, and the Helm chart runs
# tessera there.
#   1. builds the image and imports it into the node's containerd,
#   2. runs `tessera place` (the built-in sample) in a pod on the node, as the
#      image's non-root user, and checks that it exits 0 and prints every plan,
#   3. `helm install`s the chart (e2e/values-real-node.yaml: 8 fake H100s on the node,
#      host networking to reach an API server on the node's loopback), waits until the
#      agent has registered the GPUs with kubelet and the controller is ready,
#   4. runs e2e/check.sh (placement, pods Running on their planned devices as kubelet's
#      own checkpoint records them, an unsatisfiable instance, a fault re-placed, clean
#      deletion),
#   5. runs e2e/real-node-checks.sh (what users see, hand edits, agent and leader pods
#      deleted, a device fault, kubelet restarted, deletion, least privilege), and
#   6. fails if the API server refused the agent or the controller anything
#      ("forbidden" in their logs: the chart's RBAC misses a permission).
# Needs TESSERA_TEST_KUBECONFIG (a cluster whose node runs the pods: its name in
# NODE, default node-1; a scheduler must run for the chart's pods), TESSERA_K8S_KIT
# (the single-node Kubernetes kit: its import-image.sh loads the image), kubectl
# (KUBECTL, else on PATH), helm (HELM, else on PATH), jq, cargo, python3.
# KUBELET_CHECKPOINT: kubelet's device plugin checkpoint on the node; KUBELET_PIDFILE:
# the file with the PID of the node's kubelet (default: the kit's, next to the
# kubeconfig), for the kubelet restart.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e
readonly POD=tessera-place
kubectl="${KUBECTL:-kubectl}"
helm="${HELM:-helm}"
readonly RELEASE=tessera
readonly TESSERA_NAMESPACE=tessera-system
export KUBELET_CHECKPOINT="${KUBELET_CHECKPOINT:-/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint}"
# The kit keeps its PID files next to the kubeconfig it writes.
KUBELET_PIDFILE="${KUBELET_PIDFILE:-$(dirname "${TESSERA_TEST_KUBECONFIG:-.}")/run/kubelet.pid}"

log() { printf '[real-node %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
  echo "real-node e2e FAILED: $*" >&2
  exit 1
}

[ -n "${TESSERA_TEST_KUBECONFIG:-}" ] || die "TESSERA_TEST_KUBECONFIG is not set"
[ -x "${TESSERA_K8S_KIT:-}/import-image.sh" ] || die "TESSERA_K8S_KIT does not name a kit with import-image.sh"
k() { "$kubectl" --kubeconfig "$TESSERA_TEST_KUBECONFIG" "$@"; }

log "building the image"
e2e/image.sh "$IMAGE" "$ARCHIVE"
log "importing it into the node's containerd"
"$TESSERA_K8S_KIT/import-image.sh" "$ARCHIVE"

cleanup() {
  [ "${KEEP:-0}" = 1 ] && return 0
  k delete namespace "$NAMESPACE" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  "$helm" --kubeconfig "$TESSERA_TEST_KUBECONFIG" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
}
trap cleanup EXIT
k create namespace "$NAMESPACE" --dry-run=client -o yaml | k apply -f - >/dev/null
k -n "$NAMESPACE" delete pod "$POD" --ignore-not-found >/dev/null
k -n "$NAMESPACE" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $POD
spec:
  nodeName: $NODE
  restartPolicy: Never
  securityContext:
    # Kubelet refuses to start the container if the image's user were root.
    runAsNonRoot: true
  containers:
    - name: tessera
      image: $IMAGE
      imagePullPolicy: Never
      args: [place]
YAML

log "waiting for the pod to finish"
phase=""
for _ in $(seq 1 120); do
  phase=$(k -n "$NAMESPACE" get pod "$POD" -o jsonpath='{.status.phase}')
  case "$phase" in
    Succeeded | Failed) break ;;
  esac
  sleep 1
done
output=$(k -n "$NAMESPACE" logs "$POD" 2>&1 || true)
[ "$phase" = Succeeded ] || die "the pod ended $phase (exit $(k -n "$NAMESPACE" get pod "$POD" -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}')):
$output
$(k -n "$NAMESPACE" describe pod "$POD" | tail -20)"
for instance in llama-7b llama-70b llama-405b; do
  grep -q "^$instance " <<<"$output" || die "no plan for $instance in the pod's output:
$output"
done
log "ok: the image runs \`tessera place\` under the real kubelet as user 65532 and plans all three samples"

log "installing the chart"
"$helm" --kubeconfig "$TESSERA_TEST_KUBECONFIG" uninstall "$RELEASE" -n "$TESSERA_NAMESPACE" >/dev/null 2>&1 || true
# From scratch: an earlier run's namespace keeps the leader Lease, whose creation the
# least-privilege check expects to see.
k delete namespace "$TESSERA_NAMESPACE" --ignore-not-found --wait=true --timeout=180s >/dev/null
k label node "$NODE" tessera.dev/gpu-node=true --overwrite >/dev/null
"$helm" --kubeconfig "$TESSERA_TEST_KUBECONFIG" install "$RELEASE" charts/tessera \
  -n "$TESSERA_NAMESPACE" --create-namespace -f e2e/values-real-node.yaml --wait --timeout 180s >/dev/null \
  || die "helm install did not become ready:
$(k -n "$TESSERA_NAMESPACE" get pods -o wide 2>&1)"
gpus=""
for _ in $(seq 1 60); do
  gpus=$(k get node "$NODE" -o jsonpath='{.status.allocatable.tessera\.dev/gpu}')
  [ "$gpus" = 8 ] && break
  sleep 1
done
[ "$gpus" = 8 ] || die "node $NODE offers '$gpus' tessera.dev/gpu, not the 8 fake GPUs"
log "the agent registered 8 GPUs with kubelet; running e2e/check.sh"

no_forbidden() {
  local component logs
  for component in agent controller; do
    logs=$(k -n "$TESSERA_NAMESPACE" logs -l "app.kubernetes.io/component=$component" --tail=-1 2>&1)
    if grep -qi forbidden <<<"$logs"; then
      die "the API server refused the $component something its RBAC should allow:
$(grep -i forbidden <<<"$logs" | head -5)"
    fi
  done
}

export KUBECONFIG="$TESSERA_TEST_KUBECONFIG"
PATH="$(dirname "$(command -v "$kubectl")"):$PATH"
E2E_NAMESPACE=tessera-e2e-chart e2e/check.sh
# The components' logs before the checks below delete their pods.
no_forbidden
log "running e2e/real-node-checks.sh"
export NODE KUBELET_PIDFILE
e2e/real-node-checks.sh
no_forbidden

for component in agent controller; do
  ready=$(k -n "$TESSERA_NAMESPACE" get pods -l "app.kubernetes.io/component=$component" \
    -o jsonpath='{.items[*].status.conditions[?(@.type=="Ready")].status}')
  if [ -z "$ready" ] || grep -qv True <<<"${ready// /$'\n'}"; then
    die "the $component is not Ready after the checks ($ready):
$(k -n "$TESSERA_NAMESPACE" logs -l "app.kubernetes.io/component=$component" --tail=20 2>&1)"
  fi
done
log "ok: the chart runs tessera on the real node; agent and controller Ready; nothing was forbidden"
