//! Exactly once, however many drivers: processes racing on one session
//! each run a model turn or a tool call only after a committed claim, so
//! ten `resume` processes make one model request per turn and run each
//! call once, and five `run-isolated` workers run each isolated call once.
//! Counted at the servers and in the tools' own log, not in our store.

use crate::support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::{Response, Server};
use support::scratch::*;

/// A chat-completions server: with no assistant message in the request it
/// asks for two calls of the `count` tool, then it answers. Counts the
/// requests by the number of assistant messages they carry (the turn).
fn model_server() -> (u16, Arc<Mutex<BTreeMap<usize, u32>>>) {
    let turns = Arc::new(Mutex::new(BTreeMap::new()));
    let seen = turns.clone();
    let server = Server::start(move |req| {
        let req: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
        let assistant = req["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "assistant")
            .count();
        *seen.lock().unwrap().entry(assistant).or_insert(0) += 1;
        // Slow enough that every racer is in flight at once.
        std::thread::sleep(Duration::from_millis(150));
        let message = if assistant == 0 {
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "count", "arguments": "{\"n\":1}"}},
                {"id": "c2", "type": "function", "function": {"name": "count", "arguments": "{\"n\":2}"}}
            ]})
        } else {
            serde_json::json!({"role": "assistant", "content": "done"})
        };
        Response::json(
            200,
            serde_json::json!({"choices": [{"index": 0, "message": message}]}).to_string(),
        )
    });
    (server.port, turns)
}

/// An HTTP tool server counting the idempotency keys it receives.
fn tool_server() -> (u16, Arc<Mutex<BTreeMap<String, u32>>>) {
    let keys = Arc::new(Mutex::new(BTreeMap::new()));
    let seen = keys.clone();
    let server = Server::start(move |req| {
        let key = req.header("idempotency-key").unwrap_or("").to_string();
        *seen.lock().unwrap().entry(key).or_insert(0) += 1;
        std::thread::sleep(Duration::from_millis(100));
        Response::json(200, r#"{"counted":true}"#)
    });
    (server.port, keys)
}

#[test]
fn ten_resume_processes_make_one_model_request_per_turn_and_run_each_call_once() {
    let (model, turns) = model_server();
    let (tool, keys) = tool_server();
    let s = Scratch::new("claims-resume");
    let file = s.write(
        "racy.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: racy}}
spec:
  messages: ["count twice"]
  paused: true
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "http://127.0.0.1:{model}/v1", model: test}}
    tools:
      - {{name: count, http: {{url: "http://127.0.0.1:{tool}/count"}}}}
"#
        ),
    );
    // Created paused: nothing runs until the racers resume it.
    let created = s.run(&["run", "-f", &file.display().to_string()]);
    assert!(created.ok().contains("paused"), "{}", created.stdout);
    let racers: Vec<_> = (0..10)
        .map(|_| s.spawn(&["session", "resume", "racy", "-o", "json"]))
        .collect();
    for r in racers {
        let out = r.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let shown = s.run(&["session", "show", "racy"]);
    assert!(shown.ok().contains("Succeeded"), "{}", shown.stdout);
    let turns = turns.lock().unwrap().clone();
    let keys = keys.lock().unwrap().clone();
    eprintln!("model requests by turn: {turns:?}; tool runs by key: {keys:?}");
    assert_eq!(
        turns,
        BTreeMap::from([(0, 1), (1, 1)]),
        "one model request per turn"
    );
    assert_eq!(keys.len(), 2, "two calls: {keys:?}");
    assert!(
        keys.values().all(|n| *n == 1),
        "each call ran once: {keys:?}"
    );
}

#[test]
fn five_isolated_workers_run_each_call_once() {
    let s = Scratch::new("claims-workers");
    let log = s.path("runs.log");
    let file = s.write(
        "work.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: work}}
spec:
  messages: ["three jobs"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: job, arguments: {{n: 1}}}}
              - {{name: job, arguments: {{n: 2}}}}
              - {{name: job, arguments: {{n: 3}}}}
          - text: all three done
    tools:
      - name: job
        container:
          command: ["/bin/sh", "-c", "read -r envelope; echo \"$AGENTS_TOKEN\" >> {}; sleep 0.3; echo ok"]
"#,
            log.display()
        ),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    assert!(
        run.ok().contains("yielded: 3 call(s) wait"),
        "{}",
        run.stdout
    );
    let workers: Vec<_> = (0..5)
        .map(|_| s.spawn(&["session", "run-isolated", "work"]))
        .collect();
    for w in workers {
        let out = w.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let runs = std::fs::read_to_string(&log).unwrap();
    let mut tokens: Vec<&str> = runs.lines().collect();
    tokens.sort();
    eprintln!("isolated runs: {tokens:?}");
    assert_eq!(
        tokens,
        ["work-t1-c0", "work-t1-c1", "work-t1-c2"],
        "each call ran exactly once"
    );
    let resumed = s.run(&["session", "resume", "work"]);
    assert!(
        resumed.ok().contains("answer: all three done"),
        "{}",
        resumed.stdout
    );
}
