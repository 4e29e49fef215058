//! Budgets across a tree under the operator (issue 31, trees): the child
//! Session of a sub-agent call is made with what its parent had left
//! (`spec.parent.budget`) and stops there; its usage counts against the
//! parent, which then starts nothing past its own limit. The model is an
//! OpenAI-compatible fake reporting 700 tokens a turn. Skipped without a
//! cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::budgets::{boss_and_worker_manifests, boss_and_worker_model};
use support::{apply, kubectl, kubectl_ok};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn get(ns: &str, what: &str, jsonpath: &str) -> String {
    let path = format!("jsonpath={jsonpath}");
    let out = kubectl(["get", what, "-n", ns, "-o", &path]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_spends_at_most_what_its_parent_has_left_and_counts_against_it() {
    let Some((client, ns)) = support::cluster_namespace("budget-tree").await else {
        return;
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let model = boss_and_worker_model(calls.clone());
    apply(&ns.name, &boss_and_worker_manifests(&model));
    let _operator = support::launcher::Operator::watching(BIN, &ns.name, "budget-tree");
    kubectl_ok([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Failed",
        "session/boss",
        "--timeout=90s",
    ]);
    let child = "session/boss-t1-c0";
    assert_eq!(get(&ns.name, child, "{.spec.parent.budget.tokens}"), "300");
    let failure = get(&ns.name, child, "{.status.failure}");
    assert!(
        failure.contains("tokens limit: spent 700 of 300"),
        "{failure}"
    );
    let failure = get(&ns.name, "session/boss", "{.status.failure}");
    assert!(
        failure.contains("tokens limit: spent 1400 of 1000"),
        "{failure}"
    );
    assert_eq!(get(&ns.name, "session/boss", "{.status.tokens}"), "1400");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "no model call past a limit"
    );
    ns.delete(&client).await;
}
