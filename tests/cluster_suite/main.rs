//! The cluster tests, one binary (issue 28, item 7): each module is one
//! former `tests/cluster_*.rs` file, and its tests run side by side with the
//! other modules' tests, as tests in one file always did. They use a real
//! API server, etcd and kubelet (tests/cluster/up) and print "skipped"
//! without one unless AGENTS_REQUIRE_CLUSTER=1.
//!
//! One module: `cargo test --test cluster_suite cluster_jobs::`.
//! Tests that need the cluster to themselves live in `cluster_exclusive`.

#[path = "../support/mod.rs"]
mod support;

mod cluster_approvals;
mod cluster_budget_ask;
mod cluster_budget_namespace;
mod cluster_budget_tree;
mod cluster_budgets;
mod cluster_crds;
mod cluster_fairness;
mod cluster_fields;
mod cluster_fork;
mod cluster_isolated;
mod cluster_jobs;
mod cluster_lease;
mod cluster_long;
mod cluster_mcp;
mod cluster_moves;
mod cluster_notify;
mod cluster_operator;
mod cluster_outcome;
mod cluster_prometheus;
mod cluster_quota;
mod cluster_secrets;
mod cluster_smoke;
mod cluster_storage;
mod cluster_subagent_cascade;
mod cluster_subagent_waits;
mod cluster_subagents;
mod cluster_tenant;
mod cluster_tracing;
mod cluster_ui;
mod cluster_wake_requests;
