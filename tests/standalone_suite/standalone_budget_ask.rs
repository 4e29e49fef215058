//! `onExceed: ask` in `agents run` (issue 31): the session stops at its
//! token limit and asks; `agents session approve TOKEN --raise tokens=N`
//! lets it go on to its answer, and a denial fails it with the reason.
//! The model is an OpenAI-compatible fake that reports usage.

use crate::support;

use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::budgets::{asking_session_yaml, echo_twice_model};
use support::http::Server;
use support::scratch::*;

fn shown(s: &Scratch) -> Value {
    let out = s.run(&["session", "show", "spend", "-o", "json"]);
    let last = out.ok().lines().last().unwrap_or_default().to_string();
    serde_json::from_str(&last).unwrap_or_else(|_| panic!("{}", out.stdout))
}

/// Runs the session to its question: turn 2 ends at 1400 of 1000 tokens,
/// so its tool run does not start, and a person is asked.
fn asked(name: &str) -> (Scratch, Server, Arc<AtomicUsize>) {
    let (model, calls) = echo_twice_model();
    let s = Scratch::new(name);
    let file = s.write("spend.yaml", &asking_session_yaml("spend", &model));
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let all = format!("{}{}", run.stdout, run.stderr);
    assert!(
        all.contains("agents session approve spend-budget-0 --raise tokens=N"),
        "{all}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{all}");
    let pending = s.run(&["session", "pending", "spend"]);
    assert!(
        pending.ok().contains("spend-budget-0") && pending.stdout.contains("spent 1400 of 1000"),
        "{}",
        pending.stdout
    );
    let text = s.run(&["session", "show", "spend"]);
    assert!(
        text.ok().contains("asks (spend-budget-0): the session reached its tokens limit: spent 1400 of 1000 (onExceed: ask)"),
        "{}",
        text.stdout
    );
    (s, model, calls)
}

#[test]
fn ask_then_approve_with_a_raise_finishes() {
    let (s, _model, calls) = asked("budget-ask-approve");
    // Approving without a raise, or with one that lifts nothing, is refused.
    s.run(&["session", "approve", "spend-budget-0"])
        .fails_with("--raise tokens=");
    s.run(&[
        "session",
        "approve",
        "spend-budget-0",
        "--raise",
        "tokens=1400",
    ])
    .fails_with("does not lift the limit: 1400 is already spent");
    s.run(&[
        "session",
        "approve",
        "spend-budget-0",
        "--raise",
        "tokens=5000",
    ])
    .ok();
    let resumed = s.run(&["session", "resume", "spend"]);
    assert!(resumed.ok().contains("done"), "{}", resumed.stdout);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let shown = shown(&s);
    assert_eq!(shown["session"]["phase"], "Succeeded", "{shown}");
    assert!(
        shown
            .to_string()
            .contains(r#""budgetRaise":{"tokens":5000}"#),
        "{shown}"
    );
}

#[test]
fn ask_then_deny_fails_with_the_reason() {
    let (s, _model, calls) = asked("budget-ask-deny");
    s.run(&[
        "session",
        "deny",
        "spend-budget-0",
        "--reason",
        "over the team's budget",
    ])
    .ok();
    s.run(&["session", "resume", "spend"]);
    assert_eq!(calls.load(Ordering::SeqCst), 2, "nothing more started");
    let shown = shown(&s);
    assert_eq!(shown["session"]["phase"], "Failed", "{shown}");
    let failure = shown["session"]["failure"].as_str().unwrap_or_default();
    assert!(
        failure.contains("denied going past the limit: over the team's budget"),
        "{shown}"
    );
}
