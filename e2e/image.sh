#!/usr/bin/env bash
# Builds the runtime image without Docker: the release binary (built as the
# Dockerfile builds it) in an OCI image archive that `ctr images import` takes,
# assembled by e2e/oci_image.py from the Dockerfile's runtime stage (same user,
# entrypoint, command, ports, labels and binary path).
#   e2e/image.sh [TAG] [OUTPUT]   defaults: localhost/tessera:e2e, target/e2e/tessera-image.tar
# Needs cargo, python3 and ldd (the libraries come from this machine, which
# should be Debian 12 like the distroless base the Dockerfile names).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly TAG="${1:-localhost/tessera:e2e}"
readonly OUTPUT="${2:-target/e2e/tessera-image.tar}"

python3 e2e/oci_image.py check
CARGO_PROFILE_RELEASE_STRIP=symbols cargo build --release --locked -p tessera --bin tessera
mkdir -p "$(dirname "$OUTPUT")"
python3 e2e/oci_image.py build --binary target/release/tessera --tag "$TAG" -o "$OUTPUT"
