//! Cluster tests that need the test cluster to themselves: they kill or
//! pause its components (chaos), load it with a thousand sessions (burst,
//! scale), read the API server's and etcd's own counters (killloop, scale,
//! writes: every request in the cluster counts), list 10,000 sessions
//! (console_scale),
//! or run an operator that watches every namespace (helm installs the
//! chart's; slots shares one reconcile pool among all namespaces): such an
//! operator steps every other test's sessions too, with its own flags. Each module is one former `tests/cluster_*.rs` file; before the
//! files were merged, cargo ran one test binary at a time, so no two of
//! these ever overlapped, nor did they overlap with `cluster_suite`.
//!
//! Keep it so: run one module at a time, as tests/cluster/test-run does:
//! `cargo test --test cluster_exclusive cluster_chaos::`. Without a
//! cluster (and without AGENTS_REQUIRE_CLUSTER=1) every test prints
//! "skipped", so a plain `cargo test` stays harmless.

#[path = "../support/mod.rs"]
mod support;

mod cluster_approval_restarts;
mod cluster_burst;
mod cluster_chaos;
mod cluster_console_scale;
mod cluster_helm;
mod cluster_killloop;
mod cluster_scale;
mod cluster_slots;
mod cluster_subagent_bench;
mod cluster_write_cost;
mod cluster_writes;
