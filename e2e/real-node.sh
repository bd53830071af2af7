#!/usr/bin/env bash
# End-to-end on a real node: the runtime image built without Docker
# (e2e/image.sh) runs under a real kubelet and containerd.
#   1. builds the image and imports it into the node's containerd,
#   2. runs `tessera place` (the built-in sample) in a pod on the node, as the
#      image's non-root user, and checks that it exits 0 and prints every plan.
# Needs TESSERA_TEST_KUBECONFIG (a cluster whose node runs the pods: its name in
# NODE, default node-1), TESSERA_K8S_KIT (the single-node Kubernetes kit: its
# import-image.sh loads the image), kubectl (KUBECTL, else on PATH), cargo, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly IMAGE=localhost/tessera:e2e
readonly ARCHIVE=target/e2e/tessera-image.tar
readonly NODE="${NODE:-node-1}"
readonly NAMESPACE=tessera-e2e
readonly POD=tessera-place
kubectl="${KUBECTL:-kubectl}"

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

cleanup() { k delete namespace "$NAMESPACE" --ignore-not-found --wait=false >/dev/null 2>&1 || true; }
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
