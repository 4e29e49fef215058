//! The budget tests' fixtures, for `agents run` and the operator alike: a
//! session that asks at its token limit, a boss/worker tree under one
//! limit, and the OpenAI-compatible fakes behind them, each reporting 700
//! tokens a turn (600 prompt, 100 completion).

use super::http::{Request, Response, Server};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The usage every fake turn reports.
fn reply(message: serde_json::Value) -> Response {
    let body = json!({
        "choices": [{"index": 0, "message": message}],
        "usage": {"prompt_tokens": 600, "completion_tokens": 100}
    });
    Response::json(200, body.to_string())
}

/// Each session's turns 1 and 2 ask for one `echo` call, turn 3 answers
/// "done" (counted by the session's own replies, so sessions may share
/// it). Counts all requests.
pub fn echo_twice_model() -> (Server, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let server = Server::start(move |req: &Request| {
        seen.fetch_add(1, Ordering::SeqCst);
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let replies = body["messages"]
            .as_array()
            .map(|m| m.iter().filter(|m| m["role"] == "assistant").count())
            .unwrap_or_default();
        reply(if replies < 2 {
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": format!("c{replies}"), "type": "function",
                 "function": {"name": "echo", "arguments": "{\"n\":1}"}}]})
        } else {
            json!({"role": "assistant", "content": "done"})
        })
    });
    (server, calls)
}

/// Session `name`: "echo twice" with a 1,000-token limit that asks, its
/// model at `model`.
pub fn asking_session_yaml(name: &str, model: &Server) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["echo twice"]
  limits: {{tokens: 1000, onExceed: ask}}
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "{model}", model: test}}
    tools:
      - {{name: echo, builtin: {{function: echo}}}}
"#,
        model = model.url("/v1"),
    )
}

/// The boss asks the worker once; the worker asks for `echo` for ever.
/// Counts requests in `calls`.
pub fn boss_and_worker_model(calls: Arc<AtomicUsize>) -> Server {
    Server::start(move |req| {
        calls.fetch_add(1, Ordering::SeqCst);
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let boss = messages
            .iter()
            .any(|m| m["role"] == "system" && m["content"] == "boss");
        let (tool, args) = match boss {
            true => ("worker", json!({"prompt": "dig"})),
            false => ("echo", json!({"n": 1})),
        };
        reply(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c0", "type": "function",
             "function": {"name": tool, "arguments": args.to_string()}}]}))
    })
}

/// Agents `boss` (whose tool is the `worker` Agent) and `worker` (whose
/// tool is `echo`), and Session `boss` with a 1,000-token limit.
pub fn boss_and_worker_manifests(model: &Server) -> String {
    let url = model.url("/v1");
    let agent = |name: &str, tools: &str| {
        format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n  description: the {name}\n  systemPrompt: {name}\n  model: {{provider: openai, openai: {{baseUrl: \"{url}\", model: m}}}}\n  tools:\n{tools}"
        )
    };
    [
        agent("boss", "  - name: worker\n    agent: {ref: worker}\n"),
        agent("worker", "  - {name: echo, builtin: {function: echo}}\n"),
        "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: boss}\nspec: {agentRef: {name: boss}, messages: [go], limits: {tokens: 1000}}\n".to_string(),
    ]
    .concat()
}
