#!/usr/bin/env bash
# End-to-end on a machine with a real NVIDIA GPU: does a shard container get CUDA
# through tessera's DRA driver alone, with no NVIDIA runtime hook?
#
#   e2e/real-gpu.sh            build what is missing, then run what the machine allows
#
# The GPU machines lent to this project cannot run the Kubernetes kit (no network for
# its packages; docs/agent.md#tests-on-real-gpus says what each lacked), so this runs
# what a node would do between kubelet and the container, as a container runtime would:
#   1. the agent's DRA driver prepares a claim for the first GPU from the real NVML
#      snapshot and writes its CDI spec (the ignored unit test
#      real_gpu_claim_is_prepared_into_a_cdi_spec);
#   2. a root file system holding only the tessera binary and the C libraries it links
#      (no driver) gets exactly that spec's edits: its device nodes, its read-only
#      mounts, its environment (plus /proc and /sys, as every runtime mounts them);
#   3. `tessera discover --backend nvidia --probe` runs in it (chroot, a private mount
#      namespace) and must verify the GPU; the same root without the spec's mounts must
#      not find the driver, so the spec is what brings it.
#
# Inputs (all optional): TESSERA_BIN and TESSERA_LIB_TESTS (a release `tessera` and the
# library's test binary, e.g. carried to a machine without a Rust toolchain),
# TESSERA_REAL_GPU_DRIVER_ROOT (the driver root the agent is given, default /),
# OUT (where the CDI spec and logs go, default target/real-gpu). Needs root (mounts,
# chroot), unshare, jq and ldd.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-target/real-gpu}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
log() { printf '[real-gpu %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/log.txt"; }
die() {
  log "FAILED: $*"
  exit 1
}

if command -v nvidia-smi >/dev/null; then nvidia-smi -L | tee -a "$OUT/log.txt" || true; fi
[ -e /dev/nvidiactl ] || die "no NVIDIA driver on this machine (/dev/nvidiactl is missing)"
for tool in jq ldd unshare chroot; do
  command -v "$tool" >/dev/null || die "$tool is missing"
done

bin="${TESSERA_BIN:-}"
tests="${TESSERA_LIB_TESTS:-}"
if [ -z "$bin" ]; then
  cargo build --release --locked --bin tessera
  bin=target/release/tessera
fi
if [ -z "$tests" ]; then
  tests=$(cargo test --release --locked --lib --no-run --message-format=json 2>/dev/null \
    | jq -r 'select(.profile.test == true and .target.name == "tessera") | .executable' | tail -n 1)
fi
if [ ! -x "$bin" ] || [ ! -x "$tests" ]; then
  die "no tessera binary ($bin) or library tests ($tests)"
fi

# 1. The agent's prepare, on the real GPU.
cdi="$OUT/cdi"
rm -rf "$cdi"
mkdir -p "$cdi"
TESSERA_REAL_GPU_CDI_DIR="$cdi" "$tests" --ignored --exact --nocapture \
  agent::dra::driver::tests::real_gpu_claim_is_prepared_into_a_cdi_spec >"$OUT/prepare.txt" 2>&1 \
  || die "the claim was not prepared: $(tail -n 20 "$OUT/prepare.txt")"
spec=$(find "$cdi" -name '*.json' | head -n 1)
[ -n "$spec" ] || die "the prepare wrote no CDI spec"
log "claim prepared: $(grep -m1 '^prepared' "$OUT/prepare.txt")"
log "its spec: $(jq -c '.devices[0].containerEdits | {env, deviceNodes: [.deviceNodes[]?.path], mounts: [.mounts[]?.containerPath]}' "$spec")"

# 2. A root file system with no driver: the binary and the C libraries it links.
rootfs="$OUT/rootfs"
rm -rf "$rootfs"
mkdir -p "$rootfs"/{proc,sys,dev,tmp}
cp "$bin" "$rootfs/tessera"
for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done
# The rest of the C library, as every base image has it: the driver's libraries link
# libpthread, libdl, librt and libm, which the binary itself does not.
libc_dir=$(dirname "$(ldd "$bin" | grep -o '/[^ ]*/libc\.so\.6')")
for lib in libpthread.so.0 libdl.so.2 librt.so.1 libm.so.6; do
  if [ -e "$libc_dir/$lib" ]; then cp -L "$libc_dir/$lib" "$rootfs$libc_dir/$lib"; fi
done

# run_in_rootfs WITH_MOUNTS: the probe in a private mount namespace, the spec's edits
# applied (its mounts only when WITH_MOUNTS is 1); prints what it printed.
run_in_rootfs() {
  local with_mounts="$1" env=()
  mapfile -t env < <(jq -r '.devices[0].containerEdits.env[]?' "$spec")
  local edits
  edits=$(jq -r --arg root "$rootfs" --argjson mounts "$with_mounts" '
    .devices[0].containerEdits as $e
    | ($e.deviceNodes[]? | "node \(.hostPath // .path) \($root)\(.path)"),
      (if $mounts == 1 then ($e.mounts[]? | "mount \(.hostPath) \($root)\(.containerPath)") else empty end)
  ' "$spec")
  # shellcheck disable=SC2016 # expanded by the inner shell
  unshare --mount --propagation private bash -euo pipefail -c '
    rootfs="$1"; edits="$2"; chroot=$(command -v chroot); shift 2
    mount -t proc proc "$rootfs/proc"
    mount --rbind /sys "$rootfs/sys"
    while read -r kind from to; do
      [ -n "$kind" ] || continue
      mkdir -p "$(dirname "$to")"
      if [ -d "$from" ]; then mkdir -p "$to"; else touch "$to"; fi
      mount --bind "$from" "$to"
      if [ "$kind" = mount ]; then mount -o remount,bind,ro "$to"; fi
    done <<<"$edits"
    exec env -i "$@" "$chroot" "$rootfs" /tessera discover --backend nvidia --probe
  ' run-in-rootfs "$rootfs" "$edits" "${env[@]}"
}

# 3. Without the spec's mounts there is no driver (first, while the root is as built:
#    a mount leaves its empty mount point behind); with all of its edits CUDA runs.
if run_in_rootfs 0 >"$OUT/probe-without-mounts.txt" 2>&1 \
  && grep -q ' yes ' "$OUT/probe-without-mounts.txt"; then
  die "the probe verified the GPU without the spec's mounts: the driver came from elsewhere"
fi
log "without the spec's mounts the container finds no driver: $(grep -m1 -iE 'nvml|cuda|not' "$OUT/probe-without-mounts.txt" || head -n 1 "$OUT/probe-without-mounts.txt")"
if ! run_in_rootfs 1 >"$OUT/probe.txt" 2>&1; then
  die "the probe failed under the spec's edits: $(tail -n 20 "$OUT/probe.txt")"
fi
cat "$OUT/probe.txt" >>"$OUT/log.txt"
verified=$(awk '/^probe \(CUDA\):/ { p = 1; next } p && $2 == "yes" { n++ } END { print n + 0 }' "$OUT/probe.txt")
seen=$(awk '/^probe \(CUDA\):/ { p = 1; next } p && $1 != "ID" && NF { n++ } END { print n + 0 }' "$OUT/probe.txt")
if [ "$verified" != 1 ] || [ "$seen" != 1 ]; then
  die "the container verified $verified and saw $seen GPUs, not exactly its one: $(cat "$OUT/probe.txt")"
fi
log "under the spec's edits alone, the probe verified its GPU with CUDA and saw no other"

log "all passed"
