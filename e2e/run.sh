#!/usr/bin/env bash
# End-to-end test on kind with fake GPUs:
#   1. builds the image (Dockerfile) as tessera:e2e,
#   2. creates the kind cluster tessera-e2e (e2e/kind.yaml: 1 control plane, 3 workers),
#   3. loads the image (and the shards' busybox image) into it,
#   4. helm-installs the chart with e2e/values-kind.yaml (fake backend; 4×H100-80GiB,
#      2×MI300X-192GiB and 4×RTX4090-24GiB on the three workers),
#   5. waits until every worker's agent has registered its GPUs with kubelet,
#   6. runs e2e/check.sh,
#   7. deletes the cluster, unless KEEP=1.
# Needs docker, kind, helm, kubectl and jq. SKIP_BUILD=1 uses an existing tessera:e2e
# image. The kubeconfig is written to target/e2e/kubeconfig (your own is not touched).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly CLUSTER=tessera-e2e
readonly IMAGE=tessera:e2e
readonly SHARD_IMAGE=busybox:1.37
readonly RELEASE=tessera
readonly NAMESPACE=tessera-system
readonly KEEP="${KEEP:-0}"
readonly SKIP_BUILD="${SKIP_BUILD:-0}"
# Devices each worker registers (e2e/values-kind.yaml).
readonly EXPECTED_GPUS=(
  tessera-e2e-worker=4
  tessera-e2e-worker2=2
  tessera-e2e-worker3=4
)

log() { printf '[e2e %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
  echo "e2e FAILED: $*" >&2
  exit 1
}

for tool in docker kind helm kubectl jq; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is required but not on PATH"
done
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  die "a kind cluster named $CLUSTER already exists: delete it (kind delete cluster --name $CLUSTER) or run e2e/check.sh against it"
fi

mkdir -p target/e2e
export KUBECONFIG="$PWD/target/e2e/kubeconfig"
created=0

diagnostics() {
  echo "--- nodes" >&2
  kubectl get nodes -o wide >&2 || true
  echo "--- pods" >&2
  kubectl get pods -A -o wide >&2 || true
  echo "--- ModelInstances" >&2
  kubectl get mi -A -o yaml >&2 || true
  for component in agent controller; do
    echo "--- $component logs" >&2
    kubectl logs -n "$NAMESPACE" -l "app.kubernetes.io/component=$component" \
      --prefix --tail=200 --all-containers >&2 || true
  done
}

cleanup() {
  local rc=$?
  if [[ $rc -ne 0 && $created -eq 1 ]]; then
    diagnostics
  fi
  if [[ $created -eq 1 ]]; then
    if [[ "$KEEP" == 1 ]]; then
      log "KEEP=1: cluster $CLUSTER kept; KUBECONFIG=$KUBECONFIG; delete it with: kind delete cluster --name $CLUSTER"
    else
      log "deleting cluster $CLUSTER"
      kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT

if [[ "$SKIP_BUILD" == 1 ]]; then
  docker image inspect "$IMAGE" >/dev/null 2>&1 || die "SKIP_BUILD=1 but there is no image $IMAGE"
else
  log "building $IMAGE"
  docker build -t "$IMAGE" .
fi
docker image inspect "$SHARD_IMAGE" >/dev/null 2>&1 || docker pull "$SHARD_IMAGE"

log "creating kind cluster $CLUSTER"
created=1
kind create cluster --name "$CLUSTER" --config e2e/kind.yaml --kubeconfig "$KUBECONFIG" --wait 180s

log "loading images"
kind load docker-image "$IMAGE" --name "$CLUSTER"
kind load docker-image "$SHARD_IMAGE" --name "$CLUSTER"

log "installing the chart"
helm install "$RELEASE" charts/tessera --namespace "$NAMESPACE" --create-namespace \
  -f e2e/values-kind.yaml --wait --timeout 5m

for entry in "${EXPECTED_GPUS[@]}"; do
  node="${entry%%=*}"
  want="${entry#*=}"
  log "waiting for $node to register $want tessera.dev/gpu"
  deadline=$((SECONDS + 180))
  until [[ "$(kubectl get node "$node" -o jsonpath='{.status.allocatable.tessera\.dev/gpu}')" == "$want" ]]; do
    ((SECONDS < deadline)) || die "$node does not show $want allocatable tessera.dev/gpu"
    sleep 3
  done
done
kubectl get nodes -o custom-columns='NODE:.metadata.name,GPUS:.status.allocatable.tessera\.dev/gpu,PRODUCT:.metadata.labels.tessera\.dev/gpu\.product'

log "running e2e/check.sh"
e2e/check.sh
log "e2e passed"
