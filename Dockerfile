# The agents image: one static `agents` binary (the operator, the CLI and the
# tool wrapper `agents tool-exec`), non-root, nothing else.
#
# Two ways to build it, one final layout:
#
# 1. Where a registry is reachable, the whole build (the default target):
#      buildah bud -t agents:dev .            # or: docker build -t agents:dev .
#
# 2. From a binary built on the host (no registry needed: what the test
#    scripts do, see tests/cluster/agents-image):
#      RUSTFLAGS="-C target-feature=+crt-static" \
#        cargo build --release --locked --target x86_64-unknown-linux-gnu
#      buildah bud --target from-host -t agents:dev .
#    AGENTS_BINARY names the binary inside the build context.
#
# The binary is linked statically on the gnu target (crt-static): it runs in
# any image, which is what the Job runner's wrapper needs (busybox, alpine,
# distroless, scratch).

ARG RUST_IMAGE=docker.io/library/rust:1-bookworm

# A stage listed before the builder: `--target from-host` stops here and
# never needs the Rust image.
FROM scratch AS from-host
ARG AGENTS_BINARY=target/x86_64-unknown-linux-gnu/release/agents
COPY ${AGENTS_BINARY} /agents
USER 65532:65532
ENTRYPOINT ["/agents"]

FROM ${RUST_IMAGE} AS build
# .git is not in the build context: pass the commit for `agents version`,
# e.g. --build-arg AGENTS_GIT_COMMIT=$(git rev-parse --short=12 HEAD).
ARG AGENTS_GIT_COMMIT=
ARG SOURCE_DATE_EPOCH=
WORKDIR /src
COPY . .
RUN AGENTS_GIT_COMMIT="${AGENTS_GIT_COMMIT}" SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH}" \
    RUSTFLAGS="-C target-feature=+crt-static" \
      cargo build --release --locked --target x86_64-unknown-linux-gnu \
 && cp target/x86_64-unknown-linux-gnu/release/agents /agents

FROM scratch AS image
COPY --from=build /agents /agents
USER 65532:65532
ENTRYPOINT ["/agents"]
