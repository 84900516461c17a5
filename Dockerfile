# kvgate container image: `docker build -t kvgate .` at the repo root.
#
# Stage 1 builds the release binary with the toolchain of the official Rust image (the
# workspace needs Rust >= 1.89; no system libraries: ZeroMQ is pure Rust, the tokenizer's
# oniguruma, ring's and mimalloc's C parts build with the image's gcc). Stage 2 is a slim Debian with
# only the binary, CA certificates (kube's TLS to the API server when a kubeconfig names no
# CA) and a non-root user.
#
#   docker build -t kvgate:dev .
#   docker run --rm kvgate:dev --help
#   docker run --rm -p 9002:9002 -p 9090:9090 -v $PWD/kvgate.yaml:/etc/kvgate/kvgate.yaml \
#       kvgate:dev epp --listen 0.0.0.0:9002 --config /etc/kvgate/kvgate.yaml

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
# Extra cargo features of the kvgate crate, e.g. --build-arg KVGATE_FEATURES=k8s,ext-proc
# if those integrations are optional there.
ARG KVGATE_FEATURES=""
WORKDIR /src
# Manifests and sources of the whole workspace (cargo reads every member's manifest, and
# their bench/test targets must exist). .dockerignore keeps target/, .git and fuzz/ out.
COPY Cargo.toml Cargo.lock clippy.toml ./
COPY crates ./crates
# BuildKit cache mounts keep the registry and target dir between builds; the binary is
# copied out of the cached target dir.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvgate ${KVGATE_FEATURES:+--features "$KVGATE_FEATURES"} \
    && install -D -m 0755 target/release/kvgate /out/kvgate

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 65532 kvgate \
    && useradd --system --uid 65532 --gid kvgate --no-create-home --shell /usr/sbin/nologin kvgate \
    && mkdir -p /etc/kvgate
COPY --from=build /out/kvgate /usr/local/bin/kvgate
USER 65532:65532
# ext_proc gRPC (kvgate epp), HTTP proxy (kvgate serve), admin (/health, /ready, /metrics).
EXPOSE 9002 8080 9090
ENTRYPOINT ["/usr/local/bin/kvgate"]
CMD ["--help"]
