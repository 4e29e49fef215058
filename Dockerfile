# The operator image: one static binary, non-root. Build the binary outside
# Docker (no engine is needed to make the image; tests/cluster/mkimage
# assembles the same layout from files):
#   cargo build --release --target x86_64-unknown-linux-musl
FROM scratch
COPY target/x86_64-unknown-linux-musl/release/agents /agents
USER 65532:65532
ENTRYPOINT ["/agents"]
