//! The real OpenAI-compatible client against a local server that speaks
//! the chat-completions wire format.
//!
//! - Through the CLI: a transient 503 is retried, tool calls round-trip,
//!   and the API key (from the environment) is sent but never stored or
//!   printed; the `http` tool kind sends idempotency keys.
//! - At the adapter (`OpenAiModel` called directly): tool calls with JSON
//!   arguments, tool results in call order, a 429 with `Retry-After` then
//!   success, 200s that are not completions, a hung endpoint bounded by the
//!   agent's timeout, a 401, and the key kept out of every error.

use crate::support;

use agents::core::conversation::ToolResultEntry;
use agents::core::{AgentTurn, CallId, ToolResult, ToolSchema, Turn, UserTurn};
use agents::model::{ModelError, ModelRequest, OpenAiModel, MAX_RETRY_AFTER};
use serde_json::json;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::http::{Response, Server};
use support::launcher::free_port;
use support::scratch::*;

struct Seen {
    bodies: Vec<serde_json::Value>,
    auth: Vec<String>,
    idempotency_keys: Vec<String>,
}

/// What the test server does with one request.
enum Reply {
    /// Status, extra headers, body.
    Answer(u16, Vec<(&'static str, String)>, String),
    /// Reads the request and never answers; holds the connection until the
    /// client gives up and closes it.
    Hang,
}

/// Serves `replies` in order, one connection per request.
fn serve(replies: Vec<(u16, String)>) -> (u16, Arc<Mutex<Seen>>) {
    serve_replies(
        replies
            .into_iter()
            .map(|(status, body)| Reply::Answer(status, vec![], body))
            .collect(),
    )
}

fn serve_replies(replies: Vec<Reply>) -> (u16, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen {
        bodies: vec![],
        auth: vec![],
        idempotency_keys: vec![],
    }));
    let record = seen.clone();
    let replies = Mutex::new(VecDeque::from(replies));
    let server = Server::start(move |req| {
        // Past the last reply the original server was gone: no answer.
        let Some(reply) = replies.lock().unwrap().pop_front() else {
            return Response::close();
        };
        {
            let mut s = record.lock().unwrap();
            s.bodies.push(serde_json::from_slice(&req.body).unwrap());
            s.auth
                .push(req.header("authorization").unwrap_or("").to_string());
            s.idempotency_keys
                .push(req.header("idempotency-key").unwrap_or("").to_string());
        }
        match reply {
            Reply::Answer(status, headers, body) => headers
                .into_iter()
                .fold(Response::json(status, body), |r, (name, value)| {
                    r.header(name, value)
                }),
            Reply::Hang => Response::hang(),
        }
    });
    (server.port, seen)
}

#[test]
fn the_openai_client_runs_a_session_against_a_compatible_endpoint() {
    let first = r#"{"choices":[{"message":{"role":"assistant","content":null,"tool_calls":[
        {"id":"call_abc","type":"function","function":{"name":"echo","arguments":"{\"text\":\"ping\"}"}}]}}],
        "usage":{"prompt_tokens":11,"completion_tokens":7}}"#;
    let second = r#"{"choices":[{"message":{"role":"assistant","content":"pong received"}}],
        "usage":{"prompt_tokens":20,"completion_tokens":3}}"#;
    let (port, seen) = serve(vec![
        (503, r#"{"error":"busy"}"#.into()),
        (200, first.into()),
        (200, second.into()),
    ]);
    let s = Scratch::new("openai");
    let file = s.write(
        "openai.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: remote}}
spec:
  messages: ["say ping"]
  agent:
    systemPrompt: You are terse.
    model:
      provider: openai
      openai:
        baseUrl: http://127.0.0.1:{port}/v1
        model: test-model
        apiKeySecretRef: {{name: llm, key: api-key}}
    tools:
      - name: echo
        description: Echoes text.
        parameters: {{type: object, properties: {{text: {{type: string}}}}}}
        builtin: {{function: echo}}
"#
        ),
    );
    let out = s
        .cmd(&["run", "-f", &file.display().to_string()])
        .env("AGENTS_SECRET_LLM_API_KEY", "sk-test-123")
        // Every log line of ours, as JSON: none may carry the key.
        .env("RUST_LOG", "agents=trace")
        .env("AGENTS_LOG_FORMAT", "json")
        .output()
        .unwrap();
    let run = Run::from(out, &["run"]);
    let logs = run.stderr.clone();
    assert!(
        logs.lines()
            .any(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
        "JSON log lines on stderr: {logs}"
    );
    assert!(!logs.contains("sk-test-123"), "a log line shows the key");
    let stdout = run.ok();
    assert!(stdout.contains("will retry"), "{stdout}");
    assert!(
        stdout.contains("result t1-c0 echo [runSync]: ping"),
        "{stdout}"
    );
    assert!(stdout.contains("answer: pong received"), "{stdout}");
    assert!(!stdout.contains("sk-test-123"));

    let seen = seen.lock().unwrap();
    assert_eq!(seen.auth[1], "Bearer sk-test-123");
    let body = &seen.bodies[2];
    assert_eq!(body["model"], "test-model");
    assert_eq!(body["tools"][0]["function"]["name"], "echo");
    let roles: Vec<&str> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    assert_eq!(body["messages"][3]["tool_call_id"], "call_abc");
    assert_eq!(body["messages"][3]["content"], "ping");

    let db = std::fs::read(s.path("agents.db")).unwrap();
    let wal = std::fs::read(s.path("agents.db-wal")).unwrap_or_default();
    for bytes in [db, wal] {
        assert!(
            !String::from_utf8_lossy(&bytes).contains("sk-test-123"),
            "the API key is never stored"
        );
    }
}

#[test]
fn the_http_tool_posts_arguments_with_an_idempotency_key() {
    let (port, seen) = serve(vec![
        (200, r#"{"temperature": 21}"#.into()),
        (500, "backend down".into()),
    ]);
    let s = Scratch::new("http-tool");
    let file = s.write(
        "http.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: weather}}
spec:
  messages: ["weather?"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: weather, arguments: {{city: Oslo}}}}
              - {{name: weather, arguments: {{city: Bergen}}}}
          - text: checked
    tools:
      - name: weather
        http: {{url: "http://127.0.0.1:{port}/weather"}}
"#
        ),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let out = run.ok();
    assert!(
        out.contains(r#"result t1-c0 weather [runSync]: {"temperature":21}"#),
        "{out}"
    );
    assert!(
        out.contains("answered 500 Internal Server Error: backend down"),
        "{out}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.bodies[0]["city"], "Oslo");
    // namespace (none standalone) / session / the session's unique id / call
    let keys = &seen.idempotency_keys;
    assert_eq!(keys.len(), 2, "{keys:?}");
    let parts: Vec<Vec<&str>> = keys.iter().map(|k| k.split('/').collect()).collect();
    assert_eq!(parts[0][..2], ["-", "weather"], "{keys:?}");
    assert_eq!(parts[0][3], "t1-c0");
    assert_eq!(parts[1][3], "t1-c1");
    assert!(parts[0][2].len() >= 32, "a unique session id: {keys:?}");
    assert_eq!(parts[0][2], parts[1][2], "one session, one id");
}

const KEY: &str = "sk-test-123";

fn client(port: u16, timeout: Duration) -> OpenAiModel {
    OpenAiModel::new(
        &format!("http://127.0.0.1:{port}/v1"),
        "test-model",
        Some(KEY.into()),
        timeout,
    )
}

fn echo_schema() -> Vec<ToolSchema> {
    vec![ToolSchema {
        name: "echo".into(),
        description: "Echoes text.".into(),
        parameters: Some(json!({"type": "object", "properties": {"text": {"type": "string"}}})),
    }]
}

fn first_turns() -> Vec<Turn> {
    vec![Turn::User(UserTurn {
        message: Some("say ping".into()),
        tool_results: vec![],
    })]
}

async fn ask(m: &OpenAiModel, turns: &[Turn]) -> Result<AgentTurn, ModelError> {
    m.reply(&ModelRequest {
        system_prompt: "You are terse.",
        turns,
        tools: &echo_schema(),
    })
    .await
}

fn completion(text: &str) -> String {
    json!({"choices": [{"message": {"role": "assistant", "content": text}}]}).to_string()
}

/// No error text, nor the client's `Debug`, holds the key.
fn assert_no_key(m: &OpenAiModel, e: &ModelError) {
    println!("{e}");
    assert!(!e.message.contains(KEY), "{e}");
    assert!(!format!("{e:?}").contains(KEY), "{e:?}");
    assert!(!format!("{m:?}").contains(KEY), "{m:?}");
}

#[tokio::test]
async fn the_adapter_parses_tool_calls_and_sends_results_in_call_order() {
    let calls = json!({"choices": [{"message": {"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "echo", "arguments": "{\"text\":\"ping\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "echo", "arguments": "{\"text\":\"pong\",\"n\":[1,2]}"}}
    ]}}], "usage": {"prompt_tokens": 11, "completion_tokens": 7}});
    let (port, seen) = serve(vec![
        (200, calls.to_string()),
        (200, completion("both echoed")),
    ]);
    let m = client(port, Duration::from_secs(10));

    let mut turns = first_turns();
    let turn = ask(&m, &turns).await.unwrap();
    assert_eq!(turn.text, None);
    assert_eq!(turn.usage.total(), 18);
    let ids: Vec<&str> = turn
        .tool_calls
        .iter()
        .map(|c| c.model_call_id.as_str())
        .collect();
    assert_eq!(ids, ["call_a", "call_b"]);
    assert!(turn.tool_calls.iter().all(|c| c.name == "echo"));
    let args = turn.tool_calls[1].parsed_arguments().unwrap();
    assert_eq!(args["text"], "pong");
    assert_eq!(args["n"], json!([1, 2]));
    assert_eq!(
        turn.tool_calls[0].parsed_arguments().unwrap()["text"],
        "ping"
    );

    // The results come back in the other order; the wire keeps the model's.
    let result = |index, id: &str, text: &str| ToolResultEntry {
        call_id: CallId::new(1, index),
        model_call_id: id.into(),
        tool: "echo".into(),
        token: None,
        result: ToolResult::text(text),
        truncate_bytes: None,
        started_at: None,
        finished_at: None,
    };
    turns.push(Turn::Agent(turn));
    turns.push(Turn::User(UserTurn {
        message: None,
        tool_results: vec![result(1, "call_b", "pong"), result(0, "call_a", "ping")],
    }));
    let last = ask(&m, &turns).await.unwrap();
    assert_eq!(last.text.as_deref(), Some("both echoed"));

    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.auth,
        [format!("Bearer {KEY}"), format!("Bearer {KEY}")]
    );
    let first = &seen.bodies[0];
    assert_eq!(first["model"], "test-model");
    assert_eq!(first["tools"][0]["type"], "function");
    assert_eq!(first["tools"][0]["function"]["name"], "echo");
    assert_eq!(first["tools"][0]["function"]["description"], "Echoes text.");
    assert_eq!(
        first["tools"][0]["function"]["parameters"]["properties"]["text"]["type"],
        "string"
    );
    let messages = seen.bodies[1]["messages"].as_array().unwrap();
    let wire: Vec<(&str, &str)> = messages
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap(),
                m["tool_call_id"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        wire,
        [
            ("system", ""),
            ("user", ""),
            ("assistant", ""),
            ("tool", "call_a"),
            ("tool", "call_b")
        ]
    );
    assert_eq!(messages[2]["tool_calls"][1]["id"], "call_b");
    assert_eq!(messages[3]["content"], "ping");
    assert_eq!(messages[4]["content"], "pong");
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_retryable_with_retry_after() {
    let (port, _seen) = serve_replies(vec![
        Reply::Answer(
            429,
            vec![("Retry-After", "7".into())],
            r#"{"error":{"message":"Rate limit reached for test-model","type":"requests"}}"#.into(),
        ),
        Reply::Answer(200, vec![], completion("pong")),
        Reply::Answer(503, vec![], "upstream busy".into()),
        Reply::Answer(
            503,
            vec![("Retry-After", "Thu, 01 Jan 2099 00:00:00 GMT".into())],
            String::new(),
        ),
    ]);
    let m = client(port, Duration::from_secs(10));
    let turns = first_turns();

    let limited = ask(&m, &turns).await.unwrap_err();
    println!("{limited}");
    assert!(limited.retryable, "{limited}");
    assert_eq!(limited.retry_after, Some(Duration::from_secs(7)));
    assert!(
        limited.message.contains("429 Too Many Requests"),
        "{limited}"
    );
    assert!(
        limited
            .message
            .contains("Rate limit reached for test-model"),
        "{limited}"
    );
    assert_eq!(ask(&m, &turns).await.unwrap().text.as_deref(), Some("pong"));

    let busy = ask(&m, &turns).await.unwrap_err();
    println!("{busy}");
    assert!(busy.retryable, "{busy}");
    assert_eq!(busy.retry_after, None);
    assert!(busy.message.contains("503 Service Unavailable"), "{busy}");
    assert!(busy.message.contains(r#""upstream busy""#), "{busy}");

    // An HTTP-date far ahead is honoured but capped.
    let far = ask(&m, &turns).await.unwrap_err();
    assert!(far.retryable);
    assert_eq!(far.retry_after, Some(MAX_RETRY_AFTER));
}

#[tokio::test]
async fn a_200_that_is_not_a_completion_is_a_retryable_error_that_says_why() {
    let page = format!("<html><body>{}</body></html>", "gateway ".repeat(100));
    let (port, _seen) = serve(vec![
        (200, page.clone()),
        (200, r#"{"id":"x","choices":[]}"#.into()),
        (200, completion("fine now")),
    ]);
    let m = client(port, Duration::from_secs(10));
    let turns = first_turns();

    let html = ask(&m, &turns).await.unwrap_err();
    println!("{html}");
    assert!(html.retryable, "{html}");
    assert!(
        html.message
            .contains("answered 200 OK, but not with a chat completion: the body is not JSON"),
        "{html}"
    );
    assert!(html.message.contains("<html><body>gateway"), "{html}");
    assert!(
        html.message.contains(&format!(
            "({} bytes in all, the first 200 shown)",
            page.len()
        )),
        "{html}"
    );
    assert!(
        !html.message.contains("</html>"),
        "at most 200 bytes quoted: {html}"
    );
    assert!(html.message.len() < 600, "{}", html.message.len());

    let empty = ask(&m, &turns).await.unwrap_err();
    println!("{empty}");
    assert!(empty.retryable, "{empty}");
    assert!(empty.message.contains("`choices` is empty"), "{empty}");

    assert_eq!(
        ask(&m, &turns).await.unwrap().text.as_deref(),
        Some("fine now")
    );
}

#[tokio::test]
async fn a_hung_endpoint_fails_after_the_agents_timeout() {
    let (port, seen) = serve_replies(vec![Reply::Hang]);
    let timeout = Duration::from_millis(700);
    let m = client(port, timeout);
    let started = Instant::now();
    let err = ask(&m, &first_turns()).await.unwrap_err();
    let took = started.elapsed();
    println!("a hung endpoint failed after {took:?} (timeout {timeout:?})");
    assert!(took >= timeout, "gave up early: {took:?}");
    assert!(
        took < Duration::from_secs(10),
        "not bounded by the agent's timeout: {took:?}"
    );
    assert!(err.retryable, "{err}");
    assert!(
        err.message
            .contains("no complete answer within 700ms, the agent's model timeout"),
        "{err}"
    );
    assert_eq!(
        seen.lock().unwrap().bodies.len(),
        1,
        "the request did arrive"
    );
    assert_no_key(&m, &err);
}

#[tokio::test]
async fn an_unreachable_endpoint_is_retryable() {
    let port = free_port();
    let m = client(port, Duration::from_secs(5));
    let err = ask(&m, &first_turns()).await.unwrap_err();
    println!("{err}");
    assert!(err.retryable, "{err}");
    assert!(
        err.message.starts_with(&format!(
            "POST http://127.0.0.1:{port}/v1/chat/completions failed: "
        )),
        "{err}"
    );
}

#[tokio::test]
async fn a_401_is_not_retryable_names_the_status_and_never_shows_the_key() {
    // Servers echo keys back; none of it may reach our errors.
    let (port, seen) = serve(vec![
        (
            401,
            format!(
                r#"{{"error":{{"message":"Incorrect API key provided: {KEY}.","type":"invalid_request_error"}}}}"#
            ),
        ),
        (500, format!("proxy error for Bearer {KEY}")),
        (200, format!("not json {KEY}")),
    ]);
    let m = client(port, Duration::from_secs(10));
    let turns = first_turns();

    let denied = ask(&m, &turns).await.unwrap_err();
    assert!(!denied.retryable, "{denied}");
    assert_eq!(denied.retry_after, None);
    assert!(denied.message.contains("401 Unauthorized"), "{denied}");
    assert!(
        denied
            .message
            .contains("Incorrect API key provided: <redacted>."),
        "{denied}"
    );
    assert!(denied.message.contains("check the API key"), "{denied}");
    assert_no_key(&m, &denied);

    let proxy = ask(&m, &turns).await.unwrap_err();
    assert!(proxy.retryable);
    assert!(proxy.message.contains("Bearer <redacted>"), "{proxy}");
    assert_no_key(&m, &proxy);

    let garbage = ask(&m, &turns).await.unwrap_err();
    assert!(garbage.retryable);
    assert_no_key(&m, &garbage);

    let seen = seen.lock().unwrap();
    assert!(
        seen.auth.iter().all(|a| *a == format!("Bearer {KEY}")),
        "{:?}",
        seen.auth
    );
}

#[test]
fn a_session_failed_by_its_model_can_be_retried_by_the_user() {
    let done = r#"{"choices":[{"message":{"role":"assistant","content":"back in business"}}]}"#;
    let (port, seen) = serve(vec![
        (401, r#"{"error":{"message":"bad key"}}"#.into()),
        (200, done.into()),
    ]);
    let s = Scratch::new("retry");
    let file = s.write(
        "r.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: flaky}}
spec:
  messages: ["hello"]
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m}}
"#
        ),
    );
    let failed = s
        .cmd(&["run", "-f", &file.display().to_string()])
        .output()
        .unwrap();
    let failed = Run::from(failed, &["run"]);
    assert_eq!(failed.code, 1, "{}", failed.stdout);
    assert!(failed.stdout.contains("401"), "{}", failed.stdout);
    // The user fixes the cause (here: the server recovers) and retries.
    let retried = s.run(&["session", "retry", "flaky"]);
    assert!(
        retried.ok().contains("answer: back in business"),
        "{}",
        retried.stdout
    );
    assert_eq!(seen.lock().unwrap().bodies.len(), 2);
    // Retrying a session that has not failed says so.
    s.run(&["session", "retry", "flaky"])
        .fails_with("has not failed");
}
