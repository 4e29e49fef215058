//! A fake of Anthropic's Messages API on 127.0.0.1. It answers from a
//! script and checks every request against the documented shape
//! (<https://docs.anthropic.com/en/api/messages>): `POST /v1/messages`, the
//! `x-api-key` and `anthropic-version: 2023-06-01` headers, a `model`, a
//! positive `max_tokens`, the system prompt as the top-level `system`
//! field, messages that start with `user` and alternate, `tool_use` blocks
//! only from the assistant, `tool_result` blocks first in the next user
//! message and each naming a `tool_use` of the message before, every
//! `tool_use` answered, and tools with an `input_schema`.
//!
//! A request that breaks a rule is answered 400 `invalid_request_error`, as
//! the API would, and the rule is recorded: [`FakeAnthropic::violations`].

use super::http::{Request, Response, Server};
use serde_json::{json, Value};
use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};

/// One scripted answer: status, extra headers, body.
pub struct Answer(pub u16, pub Vec<(&'static str, String)>, pub String);

pub struct FakeAnthropic {
    pub server: Server,
    violations: Arc<Mutex<Vec<String>>>,
}

impl FakeAnthropic {
    /// Answers `answers` in order to requests carrying `key`; past the last
    /// one, closes the connection.
    pub fn start(key: &str, answers: Vec<Answer>) -> FakeAnthropic {
        let violations: Arc<Mutex<Vec<String>>> = Arc::default();
        let (record, key) = (violations.clone(), key.to_string());
        let answers = Mutex::new(VecDeque::from(answers));
        let server = Server::start(move |req| {
            let broken = check_request(req, &key);
            if !broken.is_empty() {
                record.lock().unwrap().extend(broken.iter().cloned());
                return error(400, "invalid_request_error", &broken.join("; "));
            }
            match answers.lock().unwrap().pop_front() {
                Some(Answer(status, headers, body)) => headers
                    .into_iter()
                    .fold(Response::json(status, body), |r, (k, v)| r.header(k, v)),
                None => Response::close(),
            }
        });
        FakeAnthropic { server, violations }
    }

    /// The `baseUrl` to give an agent.
    pub fn base_url(&self) -> String {
        self.server.url("")
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        self.server.requests()
    }

    /// The rules requests broke, in order.
    pub fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }
}

/// A 200 message with `content`, `stop_reason` and `usage`.
pub fn message(content: Value, stop_reason: &str, usage: Value) -> Answer {
    let body = json!({
        "id": "msg_fake", "type": "message", "role": "assistant", "model": "claude-fake",
        "content": content, "stop_reason": stop_reason, "stop_sequence": null, "usage": usage,
    });
    Answer(200, vec![], body.to_string())
}

pub fn text(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

pub fn tool_use(id: &str, name: &str, input: Value) -> Value {
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

/// The API's error body.
pub fn error_body(kind: &str, message: &str) -> String {
    json!({"type": "error", "error": {"type": kind, "message": message}}).to_string()
}

fn error(status: u16, kind: &str, message: &str) -> Response {
    Response::json(status, error_body(kind, message))
}

/// What `req` gets wrong against the documented request, if anything.
pub fn check_request(req: &Request, key: &str) -> Vec<String> {
    let mut broken = Vec::new();
    if req.method != "POST" || req.path != "/v1/messages" {
        broken.push(format!(
            "{} {}: expected POST /v1/messages",
            req.method, req.path
        ));
    }
    let header = |name: &str| req.header(name).unwrap_or("");
    if header("x-api-key") != key {
        broken.push(format!("x-api-key is {:?}", header("x-api-key")));
    }
    if header("anthropic-version") != "2023-06-01" {
        broken.push(format!(
            "anthropic-version is {:?}",
            header("anthropic-version")
        ));
    }
    if !header("content-type").starts_with("application/json") {
        broken.push(format!("content-type is {:?}", header("content-type")));
    }
    if req.header("authorization").is_some() {
        broken.push("an Authorization header was sent".into());
    }
    let body: Value = match serde_json::from_slice(&req.body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            broken.push("the body is not a JSON object".into());
            return broken;
        }
    };
    check_body(&body, &mut broken);
    broken
}

const TOP_LEVEL: [&str; 14] = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "thinking",
    "service_tier",
];

fn check_body(body: &Value, broken: &mut Vec<String>) {
    for k in body.as_object().unwrap().keys() {
        if !TOP_LEVEL.contains(&k.as_str()) {
            broken.push(format!("{k}: Extra inputs are not permitted"));
        }
    }
    if body["model"].as_str().is_none_or(str::is_empty) {
        broken.push("model: Field required".into());
    }
    if body["max_tokens"].as_u64().is_none_or(|n| n < 1) {
        broken.push(format!(
            "max_tokens: a positive integer is required, got {}",
            body["max_tokens"]
        ));
    }
    if let Some(system) = body.get("system") {
        if !system.is_string() && !system.is_array() {
            broken.push("system: a string or a list of text blocks".into());
        }
    }
    match body["messages"].as_array() {
        Some(m) if !m.is_empty() => check_messages(m, broken),
        _ => broken.push("messages: at least one message is required".into()),
    }
    if let Some(tools) = body.get("tools") {
        check_tools(tools, broken);
    }
}

fn check_messages(messages: &[Value], broken: &mut Vec<String>) {
    let mut asked: BTreeSet<String> = BTreeSet::new();
    let mut expected = "user";
    for (i, m) in messages.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or("");
        if role != expected {
            broken.push(format!("messages.{i}.role: expected {expected} (roles alternate, starting with user), got {role:?}"));
        }
        expected = if role == "user" { "assistant" } else { "user" };
        let blocks = match &m["content"] {
            Value::String(s) if !s.is_empty() => vec![text(s)],
            Value::Array(b) if !b.is_empty() => b.clone(),
            _ => {
                broken.push(format!(
                    "messages.{i}: all messages must have non-empty content"
                ));
                continue;
            }
        };
        let answered = check_blocks(i, role, &blocks, &asked, broken);
        if role == "user" {
            let missing: Vec<_> = asked.difference(&answered).collect();
            if !missing.is_empty() {
                broken.push(format!("messages.{i}: tool_use ids were found without tool_result blocks immediately after: {missing:?}"));
            }
            asked.clear();
        } else {
            asked = blocks
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .filter_map(|b| b["id"].as_str().map(str::to_string))
                .collect();
        }
    }
    if !asked.is_empty() {
        broken.push("the last message asks for tools that no user message answers".into());
    }
}

/// Checks one message's blocks; returns the tool_use ids it answers.
fn check_blocks(
    i: usize,
    role: &str,
    blocks: &[Value],
    asked: &BTreeSet<String>,
    broken: &mut Vec<String>,
) -> BTreeSet<String> {
    let mut answered = BTreeSet::new();
    let mut past_results = false;
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("messages.{i}.content.{j}");
        match (b["type"].as_str().unwrap_or(""), role) {
            ("text", _) => {
                past_results = true;
                if b["text"].as_str().is_none_or(str::is_empty) {
                    broken.push(format!("{at}: text content blocks must be non-empty"));
                }
            }
            ("tool_use", "assistant") => {
                let ok = b["id"].is_string() && b["name"].is_string() && b["input"].is_object();
                if !ok {
                    broken.push(format!(
                        "{at}: tool_use needs id, name and an input object: {b}"
                    ));
                }
            }
            ("tool_result", "user") => {
                let id = b["tool_use_id"].as_str().unwrap_or("");
                if past_results {
                    broken.push(format!(
                        "{at}: tool_result blocks must come before other content"
                    ));
                }
                if !asked.contains(id) {
                    broken.push(format!("{at}: unexpected tool_use_id {id:?}: no tool_use of that id in the previous message"));
                }
                if !b["content"].is_string() && !b["content"].is_array() {
                    broken.push(format!("{at}: tool_result content is a string or blocks"));
                }
                answered.insert(id.to_string());
            }
            (kind, role) => broken.push(format!(
                "{at}: a {kind:?} block has no place in a {role} message"
            )),
        }
    }
    answered
}

fn check_tools(tools: &Value, broken: &mut Vec<String>) {
    let Some(tools) = tools.as_array() else {
        broken.push("tools: a list".into());
        return;
    };
    for (i, t) in tools.iter().enumerate() {
        let name_ok = t["name"].as_str().is_some_and(|n| {
            (1..=64).contains(&n.len())
                && n.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
        });
        if !name_ok {
            broken.push(format!(
                "tools.{i}.name: must match ^[a-zA-Z0-9_-]{{1,64}}$"
            ));
        }
        if t["input_schema"]["type"] != "object" {
            broken.push(format!(
                "tools.{i}.input_schema: an object schema is required"
            ));
        }
        for k in t.as_object().into_iter().flat_map(|o| o.keys()) {
            if !["name", "description", "input_schema", "cache_control"].contains(&k.as_str()) {
                broken.push(format!("tools.{i}.{k}: Extra inputs are not permitted"));
            }
        }
    }
}
