# syntax=docker/dockerfile:1
#
# One image for both components: `tessera agent` (the node agent DaemonSet) and
# `tessera controller` (the Deployment); the chart picks the subcommand.
#
#   docker build -t tessera:dev .
#   docker build --build-arg FEATURES=rocm-smi -t tessera:dev-rocm-smi .
#
# FEATURES is empty or `rocm-smi` (ROCm SMI telemetry for AMD nodes). rocm-smi links
# the ROCm SMI library, so that image runs on debian:bookworm-slim with the library
# installed instead of on distroless. Both run as the non-root user 65532 by default
# (the chart runs the agent as uid 0, see charts/tessera/templates/agent-daemonset.yaml).

ARG RUST_VERSION=1.95
ARG FEATURES=""

FROM rust:${RUST_VERSION}-bookworm AS builder
ARG FEATURES
# protoc is not needed: the build uses the vendored protoc of the protoc-bin-vendored crate.
# hadolint ignore=DL3008
RUN if [ "$FEATURES" = "rocm-smi" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends librocm-smi-dev libclang-dev \
      && rm -rf /var/lib/apt/lists/*; \
    elif [ -n "$FEATURES" ]; then \
      echo "FEATURES must be empty or rocm-smi, not '$FEATURES'" >&2; exit 1; \
    fi
WORKDIR /src
COPY . .
# The registry and target directories are build caches (BuildKit), kept between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked -p tessera --bin tessera ${FEATURES:+--features "$FEATURES"} \
    && install -D -m 0755 target/release/tessera /out/tessera

# Default runtime: glibc, libgcc, CA certificates and user 65532, no shell.
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime-default

# rocm-smi runtime: the ROCm SMI shared library from Debian.
FROM debian:bookworm-slim AS runtime-rocm-smi
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates librocm-smi64-1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 65532 nonroot \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin nonroot

# hadolint ignore=DL3006
FROM runtime-${FEATURES:-default}
LABEL org.opencontainers.image.title="tessera" \
      org.opencontainers.image.description="Places large models across the heterogeneous GPUs of a Kubernetes cluster: node agent and controller" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/tessera /usr/local/bin/tessera
USER 65532:65532
# 8080: agent /healthz, /readyz, /metrics; 8081: controller; 8082: the controller's cluster map.
EXPOSE 8080 8081 8082
ENTRYPOINT ["/usr/local/bin/tessera"]
CMD ["--help"]
