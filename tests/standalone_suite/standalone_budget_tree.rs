//! Budgets across a tree of sub-agents under `agents run` (issue 31,
//! trees): a child is started with what its parent has left of its limits
//! and stops there; its usage counts against the parent's limits, so the
//! parent starts nothing past them either. The model is an
//! OpenAI-compatible fake that reports 700 tokens a turn.

use crate::support;

use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::budgets::{boss_and_worker_manifests, boss_and_worker_model};
use support::scratch::*;

fn shown(s: &Scratch, name: &str) -> Value {
    let out = s.run(&["session", "show", name, "-o", "json"]);
    let last = out.ok().lines().last().unwrap_or_default().to_string();
    serde_json::from_str(&last).unwrap_or_else(|_| panic!("{}", out.stdout))
}

#[test]
fn a_child_spends_at_most_what_its_parent_has_left_and_counts_against_it() {
    let calls = Arc::new(AtomicUsize::new(0));
    let model = boss_and_worker_model(calls.clone());
    let s = Scratch::new("budget-tree");
    let file = s.write("tree.yaml", &boss_and_worker_manifests(&model));
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let all = format!("{}{}", run.stdout, run.stderr);
    // The boss's turn (700 of 1000) starts the worker with 300 left; the
    // worker's first turn spends 700, so its echo does not run.
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{all}");
    let worker = shown(&s, "boss-t1-c0");
    let failure = worker["session"]["failure"].as_str().unwrap_or_default();
    assert!(
        failure.contains("tokens limit: spent 700 of 300"),
        "the worker stops at what the boss had left: {worker}"
    );
    // Its 700 count against the boss: 1400 of 1000, no further model call.
    let boss = shown(&s, "boss");
    assert_eq!(boss["session"]["usage"]["promptTokens"], 1200, "{boss}");
    let failure = boss["session"]["failure"].as_str().unwrap_or_default();
    assert!(
        failure.contains("tokens limit: spent 1400 of 1000"),
        "{boss}"
    );
}
