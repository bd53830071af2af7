#!/usr/bin/env bash
# Builds the runtime image without Docker: the release binary (built as the
# Dockerfile builds it) in an OCI image archive that `ctr images import` takes,
# assembled by e2e/oci_image.py from the Dockerfile's runtime stage (same user,
# entrypoint, command, ports, labels and binary path).
#   e2e/image.sh [TAG] [OUTPUT]   defaults: localhost/tessera:e2e, target/e2e/tessera-image.tar
# TESSERA_E2E_BINARY set: that binary (a stripped copy) instead of a release build. CI
# packs the one its test build made (`cargo test` builds the binary for the tests that
# run it), which spares a release build of every dependency: 8 minutes on 2 cores.
# Needs cargo, python3 and ldd (the libraries come from this machine, which
# should be Debian 12 like the distroless base the Dockerfile names).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly TAG="${1:-localhost/tessera:e2e}"
readonly OUTPUT="${2:-target/e2e/tessera-image.tar}"

python3 e2e/oci_image.py check
mkdir -p "$(dirname "$OUTPUT")"
if [[ -n "${TESSERA_E2E_BINARY:-}" ]]; then
  [[ -x "$TESSERA_E2E_BINARY" ]] || { echo "TESSERA_E2E_BINARY=$TESSERA_E2E_BINARY is not an executable" >&2; exit 1; }
  binary="$(dirname "$OUTPUT")/tessera"
  # Each e2e script asks for the image: packed again only when something went into it.
  if [[ -f "$OUTPUT" && "$(cat "$OUTPUT.tag" 2>/dev/null)" == "$TAG" && "$OUTPUT" -nt "$TESSERA_E2E_BINARY" \
    && "$OUTPUT" -nt Dockerfile && "$OUTPUT" -nt e2e/oci_image.py ]]; then
    echo "$OUTPUT: $TAG, packed from $TESSERA_E2E_BINARY already"
    exit 0
  fi
  strip -o "$binary" "$TESSERA_E2E_BINARY"
else
  CARGO_PROFILE_RELEASE_STRIP=symbols cargo build --release --locked -p tessera --bin tessera
  binary=target/release/tessera
fi
rm -f "$OUTPUT.tag"
python3 e2e/oci_image.py build --binary "$binary" --tag "$TAG" -o "$OUTPUT"
echo "$TAG" >"$OUTPUT.tag"
