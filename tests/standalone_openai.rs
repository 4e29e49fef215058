//! The real OpenAI-compatible client against a local server that speaks
//! the chat-completions wire format: a transient 503 is retried, tool
//! calls round-trip, and the API key (from the environment) is sent but
//! never stored or printed.

mod standalone_common;

use standalone_common::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

struct Seen {
    bodies: Vec<serde_json::Value>,
    auth: Vec<String>,
    idempotency_keys: Vec<String>,
}

/// Serves `replies` in order, one connection per request.
fn serve(replies: Vec<(u16, String)>) -> (u16, Arc<Mutex<Seen>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Seen {
        bodies: vec![],
        auth: vec![],
        idempotency_keys: vec![],
    }));
    let record = seen.clone();
    std::thread::spawn(move || {
        for (status, body) in replies {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let mut len = 0;
            let mut auth = String::new();
            let mut key = String::new();
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                if lower.starts_with("authorization:") {
                    auth = line["authorization:".len()..].trim().to_string();
                }
                if lower.starts_with("idempotency-key:") {
                    key = line["idempotency-key:".len()..].trim().to_string();
                }
                if line == "\r\n" || line.is_empty() {
                    break;
                }
            }
            let mut buf = vec![0; len];
            reader.read_exact(&mut buf).unwrap();
            {
                let mut s = record.lock().unwrap();
                s.bodies.push(serde_json::from_slice(&buf).unwrap());
                s.auth.push(auth);
                s.idempotency_keys.push(key);
            }
            let mut stream = reader.into_inner();
            write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
        }
    });
    (port, seen)
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
        .output()
        .unwrap();
    let run = Run::from(out, &["run"]);
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
    assert_eq!(seen.idempotency_keys, ["weather/t1-c0", "weather/t1-c1"]);
}
