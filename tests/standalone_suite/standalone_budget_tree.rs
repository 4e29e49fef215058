//! Budgets across a tree of sub-agents under `agents run` (issue 31,
//! trees): a child is started with what its parent has left of its limits
//! and stops there; its usage counts against the parent's limits, so the
//! parent starts nothing past them either. The model is an
//! OpenAI-compatible fake that reports 700 tokens a turn.

use crate::support;

use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::http::{Response, Server};
use support::scratch::*;

/// The boss asks the worker once; the worker asks for `echo` for ever.
fn model(calls: Arc<AtomicUsize>) -> Server {
    Server::start(move |req| {
        calls.fetch_add(1, Ordering::SeqCst);
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let system = messages
            .iter()
            .find(|m| m["role"] == "system")
            .and_then(|m| m["content"].as_str())
            .unwrap_or("?")
            .to_string();
        let (tool, args) = match system.as_str() {
            "boss" => ("worker", json!({"prompt": "dig"})),
            _ => ("echo", json!({"n": 1})),
        };
        let message = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c0", "type": "function",
             "function": {"name": tool, "arguments": args.to_string()}}]});
        Response::json(
            200,
            json!({"choices": [{"index": 0, "message": message}],
                "usage": {"prompt_tokens": 600, "completion_tokens": 100}})
            .to_string(),
        )
    })
}

fn manifests(model: u16) -> String {
    let agent = |name: &str, tools: &str| {
        format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n  description: the {name}\n  systemPrompt: {name}\n  model: {{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{model}/v1\", model: m}}}}\n  tools:\n{tools}"
        )
    };
    [
        agent("boss", "  - name: worker\n    agent: {ref: worker}\n"),
        agent("worker", "  - {name: echo, builtin: {function: echo}}\n"),
        "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: boss}\nspec: {agentRef: {name: boss}, messages: [go], limits: {tokens: 1000}}\n".to_string(),
    ]
    .concat()
}

fn shown(s: &Scratch, name: &str) -> Value {
    let out = s.run(&["session", "show", name, "-o", "json"]);
    let last = out.ok().lines().last().unwrap_or_default().to_string();
    serde_json::from_str(&last).unwrap_or_else(|_| panic!("{}", out.stdout))
}

#[test]
fn a_child_spends_at_most_what_its_parent_has_left_and_counts_against_it() {
    let calls = Arc::new(AtomicUsize::new(0));
    let model = model(calls.clone());
    let s = Scratch::new("budget-tree");
    let file = s.write("tree.yaml", &manifests(model.port));
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
