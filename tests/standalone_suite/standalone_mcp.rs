//! The `mcp` tool kind standalone, against the real MCP server
//! (tests/mcp/server.py, the official Python SDK): over stdio (a child
//! process with a clean environment), over Streamable HTTP speaking the
//! stateless 2026-07-28 revision with SSE replies, and over HTTP to a
//! server of the session-based revision only (the client falls back to
//! `initialize` and `Mcp-Session-Id`) with JSON replies. A fake
//! OpenAI-compatible model shows what the model is offered and told.

use crate::support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use support::mcp::{read_calls, stdio_command, McpServer};
use support::scratch::*;

/// An OpenAI-compatible endpoint answering `replies` in order; keeps the
/// request bodies.
fn fake_model(replies: Vec<Value>) -> (u16, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for reply in replies {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let mut len = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                if line == "\r\n" || line.is_empty() {
                    break;
                }
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            record
                .lock()
                .unwrap()
                .push(serde_json::from_slice(&body).unwrap());
            let body = json!({"choices": [{"message": reply}]}).to_string();
            let mut stream = reader.into_inner();
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
        }
    });
    (port, seen)
}

fn call(id: &str, name: &str, args: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
}

#[test]
fn a_model_calls_mcp_tools_over_stdio_and_streamable_http_in_both_revisions() {
    let modern = McpServer::start("standalone-modern", &[]);
    let legacy = McpServer::start("standalone-legacy", &["--legacy", "--json"]);
    let s = Scratch::new("mcp");
    let stdio_calls = s.path("stdio.calls");
    let (port, bodies) = fake_model(vec![
        json!({"role": "assistant", "content": null, "tool_calls": [
            call("c_add", "add", json!({"a": 2, "b": 3})),
            call("c_greet", "greet", json!({"name": "Ann"})),
            call("c_refuse", "refuse", json!({"reason": "no"})),
            call("c_echo", "slow_echo", json!({"text": "later", "ms": 50})),
            call("c_hidden", "hidden", json!({})),
        ]}),
        json!({"role": "assistant", "content": "all done"}),
    ]);
    let command = serde_json::to_string(&stdio_command()).unwrap();
    let file = s.write(
        "mcp.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: mcp}}
spec:
  messages: ["use the tools"]
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m}}
    policy:
      rules:
        - {{tool: slow_echo, disposition: runAsync, timeoutSeconds: 30}}
    tools:
      - name: local
        mcp:
          command: {command}
          env: [{{name: MCP_CALL_LOG, value: "{calls}"}}]
          tools: [add]
      - name: remote
        mcp:
          url: {modern}
          tools: [greet, refuse]
          headers:
            - {{name: X-Team, value: blue}}
            - {{name: Authorization, valueFrom: {{secretKeyRef: {{name: mcp, key: token}}}}}}
      - name: old
        mcp:
          url: {legacy}
          tools: [slow_echo]
"#,
            calls = stdio_calls.display(),
            modern = modern.url(),
            legacy = legacy.url(),
        ),
    );
    let out = s
        .cmd(&["run", "-f", &file.display().to_string()])
        .env("AGENTS_SECRET_MCP_TOKEN", "Bearer s3cret")
        .output()
        .unwrap();
    let run = Run::from(out, &["run"]);
    let stdout = run.ok();
    assert!(stdout.contains("answer: all done"), "{stdout}");

    // The model is offered the listed tools, with their schemas; `hidden`
    // (left out by every `tools:`) is not among them.
    let bodies = bodies.lock().unwrap();
    let offered: Vec<&Value> = bodies[0]["tools"].as_array().unwrap().iter().collect();
    let names: Vec<&str> = offered
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["add", "greet", "refuse", "slow_echo"],
        "{offered:?}"
    );
    let add = &offered[0]["function"];
    assert_eq!(add["description"], "Adds two integers.");
    assert_eq!(add["parameters"]["properties"]["a"]["type"], "integer");
    assert_eq!(add["parameters"]["required"], json!(["a", "b"]));

    // The results reach the model: values, the isError result as an
    // error, the filtered tool as unknown.
    let results: std::collections::BTreeMap<&str, &str> = bodies[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap(),
                m["content"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(results["c_add"], "5");
    assert_eq!(results["c_greet"], "Hello, Ann!");
    assert_eq!(results["c_echo"], "later");
    assert!(
        results["c_refuse"].contains("error") && results["c_refuse"].contains("refused: no"),
        "{results:?}"
    );
    assert!(results["c_hidden"].contains("hidden"), "{results:?}");
    assert!(
        stdout.contains("result t1-c1 greet [runSync]: Hello, Ann!"),
        "{stdout}"
    );
    assert!(
        stdout.contains("result t1-c3 slow_echo [runAsync]: later"),
        "{stdout}"
    );

    // Each server saw its calls only, in the revision it speaks, with the
    // headers its entry names (the Secret's value among them).
    let stdio = read_calls(&stdio_calls);
    assert_eq!(stdio.len(), 1, "{stdio:?}");
    assert_eq!(stdio[0]["tool"], "add");
    assert_eq!(stdio[0]["protocolVersion"], "2026-07-28");
    // The call's stable idempotency key, as http tools send it.
    let key = stdio[0]["idempotencyKey"].as_str().unwrap_or_default();
    assert!(
        key.starts_with("-/mcp/") && key.ends_with("/t1-c0"),
        "{stdio:?}"
    );
    let calls = modern.calls();
    let tools: Vec<&str> = calls.iter().map(|c| c["tool"].as_str().unwrap()).collect();
    assert_eq!(tools, ["greet", "refuse"]);
    for c in &calls {
        assert_eq!(c["protocolVersion"], "2026-07-28", "{c}");
        assert_eq!(c["xTeam"], "blue");
        assert_eq!(c["authorization"], "Bearer s3cret");
    }
    let old = legacy.calls();
    assert_eq!(old.len(), 1, "{old:?}");
    assert_eq!(old[0]["tool"], "slow_echo");
    assert_eq!(old[0]["protocolVersion"], "2025-11-25");
    assert!(
        legacy
            .log_text()
            .contains("Created new transport with session ID"),
        "{}",
        legacy.log_text()
    );
    // The secret is not stored with the session.
    let db = std::fs::read(s.path("agents.db")).unwrap();
    let wal = std::fs::read(s.path("agents.db-wal")).unwrap_or_default();
    for bytes in [db, wal] {
        assert!(!String::from_utf8_lossy(&bytes).contains("s3cret"));
    }
}

/// A session file with a scripted model and the `tools` entries given.
fn scripted(name: &str, tools: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["hi"]
  agent:
    model: {{provider: scripted, scripted: {{replies: [{{text: ok}}]}}}}
    tools:
{tools}
"#
    )
}

#[test]
fn bad_mcp_entries_are_refused_before_the_session_runs_and_say_how_to_fix_them() {
    let server = McpServer::start("standalone-bad", &["--json"]);
    let s = Scratch::new("mcp-bad");
    let url = server.url();
    let cases = [
        (
            format!("      - name: srv\n        mcp: {{url: \"{url}\", tools: [add, nope]}}"),
            format!("mcp server \"srv\" ({url}) offers no tool \"nope\", which its `tools:` names; it offers: add, greet, slow_echo, refuse, long_job, confirm, hidden"),
        ),
        (
            format!("      - name: add\n        builtin: {{function: add}}\n      - name: srv\n        mcp: {{url: \"{url}\"}}"),
            "mcp server \"srv\" offers a tool \"add\", and another tool of the agent has that name too".to_string(),
        ),
        (
            "      - name: srv\n        mcp: {url: \"http://127.0.0.1:9/mcp\"}".to_string(),
            "mcp server \"srv\" (http://127.0.0.1:9/mcp): listing its tools failed: POST http://127.0.0.1:9/mcp failed".to_string(),
        ),
        (
            format!("      - name: srv\n        mcp: {{url: \"{url}\", headers: [{{name: Mcp-Session-Id, value: x}}]}}"),
            "header \"Mcp-Session-Id\": set by the MCP client itself; remove it".to_string(),
        ),
        (
            format!("      - name: srv\n        mcp: {{url: \"{url}\", command: [x]}}"),
            "an mcp server needs exactly one of url and command".to_string(),
        ),
    ];
    for (i, (tools, expected)) in cases.iter().enumerate() {
        let file = s.write(
            &format!("bad{i}.yaml"),
            &scripted(&format!("bad{i}"), tools),
        );
        s.run(&["run", "-f", &file.display().to_string()])
            .fails_with(expected);
    }
    assert!(server.calls().is_empty(), "{:?}", server.calls());
    // Refused before anything was stored: the fixed file runs under its name.
    let listed = s.run(&["session", "list"]);
    assert!(!listed.stdout.contains("bad0"), "{}", listed.stdout);
    let fixed = s.write(
        "bad0.yaml",
        &scripted(
            "bad0",
            &format!("      - name: srv\n        mcp: {{url: \"{url}\", tools: [add]}}"),
        ),
    );
    let run = s.run(&["run", "-f", &fixed.display().to_string()]);
    assert!(run.ok().contains("answer: ok"), "{}", run.stdout);
}

#[test]
fn an_mcp_call_behind_approval_runs_once_approved_and_the_session_resumes() {
    let server = McpServer::start("standalone-approval", &[]);
    let s = Scratch::new("mcp-approval");
    let command = serde_json::to_string(&stdio_command()).unwrap();
    let file = s.write(
        "gated.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: gated}}
spec:
  messages: ["greet and add"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: greet, arguments: {{name: Bo}}}}
              - {{name: add, arguments: {{a: 1, b: 2}}}}
          - text: greeted
    policy:
      rules:
        - {{tool: greet, disposition: runSync, approval: true}}
        - {{tool: add, disposition: runAsync, approval: true}}
    tools:
      - name: remote
        mcp: {{url: "{url}", tools: [greet]}}
      - name: local
        mcp: {{command: {command}, tools: [add]}}
"#,
            url = server.url()
        ),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    assert!(run.ok().contains("gated-t1-c0"), "{}", run.stdout);
    assert!(server.calls().is_empty(), "ran before its approval");
    s.run(&["session", "approve", "gated-t1-c0"]).ok();
    s.run(&["session", "approve", "gated-t1-c1"]).ok();
    // A new process: it lists the servers again (the stdio one started
    // anew) and runs the approved calls.
    let resumed = s.run(&["session", "resume", "gated"]);
    let out = resumed.ok();
    assert!(
        out.contains("result t1-c0 greet [runSync]: Hello, Bo!"),
        "{out}"
    );
    assert!(out.contains("result t1-c1 add [runAsync]: 3"), "{out}");
    assert!(out.contains("answer: greeted"), "{out}");
    assert_eq!(server.calls().len(), 1, "{:?}", server.calls());
}

/// A call the server answers with a task (`long_job`): `agents run` polls
/// it at the server's interval (one `tools/call`, `tasks/get` until it
/// ends) and the model gets the task's result; a timed-out task is
/// cancelled with `tasks/cancel` and the model is told.
#[test]
fn an_mcp_task_is_polled_until_it_ends_and_a_timed_out_one_is_cancelled() {
    let server = McpServer::start("standalone-task", &[]);
    let s = Scratch::new("mcp-task");
    let session = |name: &str, ms: u32, rule: &str| {
        format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["run the job"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: long_job, arguments: {{text: report, ms: {ms}}}}}]
          - text: finished
    policy:
      rules: [{rule}]
    tools:
      - name: jobs
        mcp: {{url: "{url}", tools: [long_job]}}
"#,
            url = server.url()
        )
    };
    let file = s.write(
        "task.yaml",
        &session("task", 2500, "{tool: long_job, disposition: runSync}"),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let out = run.ok();
    assert!(
        out.contains("result t1-c0 long_job [mcp-task]: done: report"),
        "{out}"
    );
    assert!(out.contains("answer: finished"), "{out}");
    let calls = server.calls();
    let started: Vec<_> = calls.iter().filter(|c| c["tool"] == "long_job").collect();
    assert_eq!(started.len(), 1, "{calls:?}");
    assert_eq!(
        started[0]["tasks"], true,
        "the client declares the tasks extension"
    );
    let polls = calls.iter().filter(|c| c["method"] == "tasks/get").count();
    assert!(
        (2..=5).contains(&polls),
        "polled at the 1 s interval: {polls} polls"
    );
    // Shown in the session: the call waited on the task, by mcp-task.
    let shown = s.run(&["session", "show", "task", "-o", "json"]);
    assert!(shown.ok().contains("mcp-task"), "{}", shown.stdout);

    let file = s.write(
        "slow.yaml",
        &session(
            "slow",
            60_000,
            "{tool: long_job, disposition: runSync, timeoutSeconds: 3}",
        ),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    assert!(run.ok().contains("answer: finished"), "{}", run.stdout);
    let shown = s.run(&["session", "show", "slow", "-o", "json"]);
    let out = shown.ok();
    assert!(
        out.contains("timed out after 3s waiting for its MCP task"),
        "{out}"
    );
    let cancels: Vec<_> = server
        .calls()
        .into_iter()
        .filter(|c| c["method"] == "tasks/cancel")
        .collect();
    assert_eq!(cancels.len(), 1, "{cancels:?}");
}

/// A task that asks for input (`confirm`): `agents run` yields with the
/// command that answers it; `agents session answer` stores the answers
/// and `agents session resume` hands them over (`tasks/update`) and takes
/// the task's result.
#[test]
fn an_mcp_task_that_asks_for_input_is_answered_and_resumed() {
    let server = McpServer::start("standalone-ask", &[]);
    let s = Scratch::new("mcp-ask");
    let file = s.write(
        "ask.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: ask}}
spec:
  messages: ["ship it?"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: confirm, arguments: {{question: "ship it?"}}}}]
          - text: shipped
    tools:
      - name: gate
        mcp: {{url: "{url}", tools: [confirm]}}
"#,
            url = server.url()
        ),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let out = run.ok();
    assert!(out.contains("agents session answer ask-t1-c0"), "{out}");
    assert!(out.contains("ship it?"), "the request is shown: {out}");
    let bad = s.run(&["session", "answer", "ask-t1-c0", "not json"]);
    bad.fails_with("the answers are not JSON");
    let answered = s.run(&[
        "session",
        "answer",
        "ask-t1-c0",
        r#"{"q1": {"action": "accept", "content": {"ok": true}}}"#,
    ]);
    assert!(
        answered.ok().contains("agents session resume ask"),
        "{}",
        answered.stdout
    );
    let resumed = s.run(&["session", "resume", "ask"]);
    let out = resumed.ok();
    assert!(out.contains("confirmed:"), "{out}");
    assert!(out.contains("answer: shipped"), "{out}");
    let updates: Vec<_> = server
        .calls()
        .into_iter()
        .filter(|c| c["method"] == "tasks/update")
        .collect();
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert_eq!(updates[0]["inputResponses"]["q1"]["content"]["ok"], true);
}

#[test]
fn the_server_answers_before_its_url_is_handed_out() {
    // Its first 1.5 s it answers 503, as a server still starting does.
    let server = McpServer::start_with_env("ready", &["--json"], &[("MCP_NOT_READY_MS", "1500")]);
    assert_eq!(support::mcp::answers_initialize(server.port), Ok(()));
}
