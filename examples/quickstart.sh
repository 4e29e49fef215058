#!/bin/sh
# The requested flow end to end, each step a new process on a fresh
# embedded store: 3 calls, the yield, the completions, the final answer.
#
#   sh examples/quickstart.sh
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
cargo build --quiet --manifest-path "$repo/Cargo.toml"
agents="$repo/target/debug/agents"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" # the default store is ./agents.db

step() {
    printf '\n$ agents %s\n' "$*"
    "$agents" "$@"
}

step run -f "$repo/examples/quickstart.yaml"
step session pending quickstart
step session complete quickstart-t1-c1 --text "Sent to ops@example.org"
step session run-isolated quickstart
step session resume quickstart
