# Shared settings for tests/cluster/* scripts. Source it; do not run it.
# shellcheck shell=bash
CLUSTER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$CLUSTER_DIR/../.." && pwd)

# Cached binaries, keyed by component and version.
CACHE=${AGENTS_CLUSTER_CACHE:-/var/cache/agents-cluster}
# Cluster state (PKI, etcd data, kubelet/containerd roots, pidfiles) and logs.
STATE=${AGENTS_CLUSTER_STATE:-/var/lib/agents-test-cluster}
LOGS=${AGENTS_CLUSTER_LOGS:-/var/log/agents-test-cluster}
RUN=${AGENTS_CLUSTER_RUN:-/run/agents-test-cluster}
KUBECONFIG_OUT=$STATE/admin.kubeconfig

gomod_version() { # gomod_version <go.mod> <module>
	awk -v m="$2" '($1==m || $1=="require" && $2==m) {v=($1==m)?$2:$3} END {print v}' "$1"
}
K8S_VERSION=$(gomod_version "$REPO_ROOT/tools/k8s/go.mod" k8s.io/kubernetes)
ETCD_VERSION=$(gomod_version "$REPO_ROOT/tools/etcd/go.mod" go.etcd.io/etcd/server/v3)
HELM_VERSION=$(gomod_version "$REPO_ROOT/tools/helm/go.mod" helm.sh/helm/v3 2>/dev/null || true)
# OpenTelemetry Collector for trace tests (tests/otel): keyed by the core otelcol release.
OTELCOL_VERSION=$(gomod_version "$REPO_ROOT/tools/otelcol/go.mod" go.opentelemetry.io/collector/otelcol 2>/dev/null || true)
K8S_BIN=$CACHE/kubernetes-$K8S_VERSION
ETCD_BIN=$CACHE/etcd-$ETCD_VERSION
HELM_BIN=$CACHE/helm-$HELM_VERSION
OTELCOL_BIN=$CACHE/otelcol-$OTELCOL_VERSION

# Network: everything lives on interfaces these scripts create.
BRIDGE=agents0              # pod bridge (CNI bridge plugin reuses it)
BRIDGE_IP=10.244.0.1        # gateway + API server advertise address (for pods)
API_PORT=6443
API_URL=https://127.0.0.1:$API_PORT   # host clients: loopback only (kubeconfigs, readiness, tests)
POD_CIDR=10.244.0.0/24
SVC_CIDR=10.96.0.0/16
NODE_NAME=agents-node
PAUSE_IMAGE=agents.local/pause:3.10
BUSYBOX_IMAGE=agents.local/busybox:ci

# The tests and the agents image share one build: cargo builds for the gnu
# target with the C runtime linked in (crt-static), so the `agents` binary
# the tests run is also the one the image ships, static as the Job runner's
# wrapper needs (it runs in any tool image). --target keeps build scripts
# and proc-macros dynamic (host flags). test-run and .ci/run call this.
AGENTS_TRIPLE=x86_64-unknown-linux-gnu
static_cargo_env() {
	export CARGO_BUILD_TARGET=$AGENTS_TRIPLE
	export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static"
}

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# detached <cmd...>: execs cmd in a session of its own, holding no file
# descriptor of its caller above 2: a lock the caller holds (flock) must
# not live on in a daemon that outlives it.
detached() {
	local fd
	for fd in /proc/self/fd/*; do
		fd=${fd##*/}
		if [ "$fd" -gt 2 ] 2>/dev/null; then eval "exec $fd>&-" 2>/dev/null || true; fi
	done
	exec setsid "$@"
}
