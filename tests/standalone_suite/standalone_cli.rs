//! Standalone mode through the CLI alone, as a user runs it: every step is
//! a new `agents` process on the embedded store.

use crate::support;

use agents::core::{Phase, SessionId, ToolResult, Turn};
use agents::store::sqlite::SqliteStore;
use support::scratch::*;

fn quickstart(s: &Scratch) -> String {
    let p = repo_file("examples/quickstart.yaml");
    let copy = s.path("quickstart.yaml");
    std::fs::copy(p, &copy).unwrap();
    copy.display().to_string()
}

#[test]
fn requested_flow_yield_complete_run_isolated_resume() {
    let s = Scratch::new("flow");
    let file = quickstart(&s);

    // 1-4: three calls, one runs now, two wait; the process ends.
    let run = s.run(&["run", "-f", &file]);
    let out = run.ok();
    assert!(out.contains("call t1-c0 lookup"), "{out}");
    assert!(out.contains("result t1-c0 lookup [runSync]"), "{out}");
    assert!(out.contains("yielded: 2 call(s) wait"), "{out}");
    assert!(
        out.contains("$ agents session complete quickstart-t1-c1 --text RESULT"),
        "{out}"
    );
    assert!(
        out.contains("$ agents session run-isolated quickstart"),
        "{out}"
    );

    let pending = s.run(&["session", "pending", "quickstart", "-o", "json"]);
    let pending: serde_json::Value = serde_json::from_str(pending.ok()).unwrap();
    assert_eq!(pending.as_array().unwrap().len(), 2, "{pending}");

    // 5: results placed from new processes.
    let done = s.run(&[
        "session",
        "complete",
        "quickstart-t1-c1",
        "--text",
        "sent to ops",
    ]);
    assert!(done.ok().contains("completed quickstart-t1-c1"));
    let worker = s.run(&["session", "run-isolated", "quickstart"]);
    let out = worker.ok();
    assert!(out.contains("result t1-c2 disk_usage [process]"), "{out}");
    assert!(out.contains("agents session resume quickstart"), "{out}");

    // 6-7: the user turn with all three results goes to the model.
    let resumed = s.run(&["session", "resume", "quickstart"]);
    let out = resumed.ok();
    assert!(out.contains("session quickstart succeeded"), "{out}");
    assert!(out.contains("answer: Done"), "{out}");

    let store = SqliteStore::open(s.path("agents.db")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let rec = rt
        .block_on(store.load_session(&SessionId("quickstart".into())))
        .unwrap()
        .unwrap()
        .value;
    assert_eq!(rec.state.phase, Phase::Succeeded);
    let results: Vec<(String, ToolResult)> = rec
        .state
        .turns
        .iter()
        .filter_map(|t| match t {
            Turn::User(u) if !u.tool_results.is_empty() => Some(u),
            _ => None,
        })
        .flat_map(|u| u.tool_results.iter())
        .map(|r| (r.tool.clone(), r.result.clone()))
        .collect();
    assert_eq!(
        results.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
        ["lookup", "send_email", "disk_usage"],
        "all three results, in the model's call order"
    );
    assert_eq!(results[1].1, ToolResult::text("sent to ops"));

    // Running the same file again shows the stored answer; nothing re-runs.
    let again = s.run(&["run", "-f", &file]);
    assert!(again.ok().contains("succeeded"), "{}", again.stdout);
}

#[test]
fn two_processes_completing_one_token_exactly_one_wins() {
    for round in 0..4 {
        let s = Scratch::new("race");
        let file = quickstart(&s);
        s.run(&["run", "-f", &file]).ok();
        let a = s.spawn(&[
            "session",
            "complete",
            "quickstart-t1-c1",
            "--text",
            "from A",
        ]);
        let b = s.spawn(&[
            "session",
            "complete",
            "quickstart-t1-c1",
            "--text",
            "from B",
        ]);
        let a = Run::from(a.wait_with_output().unwrap(), &["complete", "A"]);
        let b = Run::from(b.wait_with_output().unwrap(), &["complete", "B"]);
        let (winner, loser) = match (a.code, b.code) {
            (0, 3) => (a, b),
            (3, 0) => (b, a),
            _ => panic!("round {round}: expected one 0 and one 3:\n{a:?}\n{b:?}"),
        };
        assert!(winner.stdout.contains("completed quickstart-t1-c1"));
        assert!(
            loser.stderr.contains("is already completed (by tester"),
            "{}",
            loser.stderr
        );
        // The winner's result is the one the session gets.
        let show = s.run(&["session", "show", "quickstart", "-o", "json"]);
        let v: serde_json::Value = serde_json::from_str(show.ok()).unwrap();
        let recorded = v["continuations"][0]["result"]["response"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let expected = if winner.args.ends_with('A') {
            "from A"
        } else {
            "from B"
        };
        assert_eq!(recorded, expected);
        // The same result again is harmless.
        let same = s.run(&[
            "session",
            "complete",
            "quickstart-t1-c1",
            "--text",
            expected,
        ]);
        assert!(same.ok().contains("already completed"), "{}", same.stdout);
    }
}

const AGENT: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: bad}
spec:
  messages: ["go"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {name: echo, arguments: {text: hi}}
              - {name: no_such_tool, arguments: {}}
              - {name: echo, arguments: "{not json"}
          - text: finished
    tools:
      - name: echo
        builtin: {function: echo}
"#;

#[test]
fn bad_yaml_and_unknown_tools_give_clear_errors() {
    let s = Scratch::new("bad-yaml");
    let typo = s.write("typo.yaml", &AGENT.replace("messages:", "mesages:"));
    s.run(&["run", "-f", &typo.display().to_string()])
        .fails_with("unknown field spec.mesages");
    let nested = s.write(
        "nested.yaml",
        &AGENT.replace(
            "builtin: {function: echo}",
            "builtin: {function: echo, shell: true}",
        ),
    );
    s.run(&["run", "-f", &nested.display().to_string()])
        .fails_with("unknown field spec.agent.tools[0].builtin.shell");
    let builtin = s.write(
        "builtin.yaml",
        &AGENT.replace("function: echo", "function: rm"),
    );
    s.run(&["run", "-f", &builtin.display().to_string()])
        .fails_with("builtin \"rm\", which does not exist");
    let kind = s.write("kind.yaml", &AGENT.replace("kind: Session", "kind: Pod"));
    s.run(&["run", "-f", &kind.display().to_string()])
        .fails_with("kind \"Pod\" is not runnable");
    s.run(&["run", "-f", "missing.yaml"])
        .fails_with("cannot read missing.yaml");
    assert!(
        !s.path("agents.db").exists() || {
            let l = s.run(&["session", "list"]);
            !l.ok().contains("bad")
        },
        "nothing is stored from a refused file"
    );

    // A model that calls an unknown tool or sends malformed arguments is
    // told so, and the session goes on.
    let good = s.write("good.yaml", AGENT);
    let run = s.run(&["run", "-f", &good.display().to_string()]);
    let out = run.ok();
    assert!(
        out.contains("unknown tool \\\"no_such_tool\\\"") || out.contains("unknown tool"),
        "{out}"
    );
    assert!(out.contains("not valid JSON"), "{out}");
    assert!(out.contains("answer: finished"), "{out}");
}

#[test]
fn corrupt_foreign_and_locked_stores_are_refused_and_nothing_is_lost() {
    let s = Scratch::new("bad-store");
    s.write("corrupt.db", &"this is not a database ".repeat(300));
    s.run(&["session", "list", "--store", "sqlite:corrupt.db"])
        .fails_with("corrupt.db is not an agents store");
    assert_eq!(
        std::fs::read_to_string(s.path("corrupt.db")).unwrap(),
        "this is not a database ".repeat(300),
        "a refused file is left untouched"
    );

    {
        let c = rusqlite::Connection::open(s.path("foreign.db")).unwrap();
        c.execute_batch("CREATE TABLE invoices (id INTEGER PRIMARY KEY);")
            .unwrap();
    }
    s.run(&["session", "list", "--store", "sqlite:foreign.db"])
        .fails_with("another application");

    s.run(&["session", "list", "--store", "kube2"])
        .fails_with("unknown store");

    // A locked store: a clear error after the wait, and no lost state.
    let file = quickstart(&s);
    s.run(&["run", "-f", &file]).ok();
    let lock = rusqlite::Connection::open(s.path("agents.db")).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE;").unwrap();
    let locked = s
        .cmd(&["session", "complete", "quickstart-t1-c1", "--text", "sent"])
        .env("AGENTS_STORE_BUSY_TIMEOUT_MS", "200")
        .output()
        .unwrap();
    let locked = Run::from(locked, &["complete while locked"]);
    locked.fails_with("is locked by another process");
    lock.execute_batch("ROLLBACK;").unwrap();
    drop(lock);
    let pending = s.run(&["session", "pending", "quickstart", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(pending.ok()).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2, "both calls still wait: {v}");
    s.run(&["session", "complete", "quickstart-t1-c1", "--text", "sent"])
        .ok();

    s.run(&["session", "complete", "nope-t1-c0", "--text", "x"])
        .fails_with("no continuation with token nope-t1-c0");
    s.run(&["session", "resume", "nope"])
        .fails_with("session nope not found");
}

const APPROVAL: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: careful}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {name: deploy, arguments: {env: prod}}
            - {name: wipe, arguments: {}}
        - text: deployed, not wiped
  tools:
    - {name: deploy, builtin: {function: echo}}
    - {name: wipe, builtin: {function: echo}}
  policy:
    defaultDecorators: {approval: true}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: gated}
spec:
  agentRef: {name: careful}
  messages: ["ship it"]
"#;

#[test]
fn approvals_pause_and_resume_with_json_output() {
    let s = Scratch::new("approval");
    let file = s.write("gated.yaml", APPROVAL);
    let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
    let events: Vec<serde_json::Value> = run
        .ok()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = events.last().unwrap();
    assert_eq!(last["event"], "yielded", "{events:#?}");
    assert_eq!(last["pending"].as_array().unwrap().len(), 2);
    assert_eq!(last["pending"][0]["waitingFor"], "approval");

    s.run(&["session", "complete", "gated-t1-c0", "--text", "x"])
        .fails_with("waits for an approval");
    s.run(&["session", "approve", "gated-t1-c0"]).ok();
    // Approved, the call runs by its policy (runSync): nobody outside
    // answers for it, whatever name they give.
    s.run(&["session", "complete", "gated-t1-c0", "--text", "made up"])
        .fails_with("only that run completes it");
    s.run(&[
        "session",
        "complete",
        "gated-t1-c0",
        "--text",
        "x",
        "--by",
        "cache",
    ])
    .fails_with("reserved for what the engine records itself");
    s.run(&["session", "deny", "gated-t1-c1", "--reason", "too risky"])
        .ok();
    s.run(&["session", "approve", "gated-t1-c1"]).fails_with("");
    s.run(&["session", "pause", "gated"]).ok();
    let paused = s.run(&["session", "list"]);
    assert!(paused.ok().contains("yes"), "{}", paused.stdout);
    let resumed = s.run(&["session", "resume", "gated"]);
    let out = resumed.ok();
    assert!(out.contains("answer: deployed, not wiped"), "{out}");
    let show = s.run(&["session", "show", "gated"]);
    assert!(
        show.ok().contains("denied by tester: too risky"),
        "{}",
        show.stdout
    );
    assert!(!show.stdout.contains("made up"), "{}", show.stdout);
}

const SLOW: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: slow}
spec:
  messages: ["take your time"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {name: nap, arguments: {ms: 1500}}
          - text: rested
    tools:
      - {name: nap, builtin: {function: sleep}}
"#;

#[test]
fn a_pause_from_another_process_stops_a_running_session_without_losing_it() {
    let s = Scratch::new("pause");
    let file = s.write("slow.yaml", SLOW);
    let running = s.spawn(&["run", "-f", &file.display().to_string()]);
    // Wait until the run has stored the agent turn and sleeps in the tool.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let show = s.run(&["session", "show", "slow"]);
        if show.code == 0 && show.stdout.contains("call t1-c0 nap") {
            break;
        }
        if std::time::Instant::now() > deadline {
            let run = Run::from(running.wait_with_output().unwrap(), &["run slow"]);
            panic!("the run never started: {show:?}\n{run:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    s.run(&["session", "pause", "slow"]).ok();
    let out = Run::from(running.wait_with_output().unwrap(), &["run slow"]);
    // The run's next write finds the session changed, reloads, and stops.
    assert!(
        out.ok().contains("session slow is paused"),
        "{}",
        out.stdout
    );
    let resumed = s.run(&["session", "resume", "slow"]);
    assert!(
        resumed.ok().contains("answer: rested"),
        "{}",
        resumed.stdout
    );
}

#[test]
fn processes_creating_the_store_at_once_all_succeed() {
    for _ in 0..5 {
        let s = Scratch::new("create-race");
        let children: Vec<_> = (0..4)
            .map(|_| s.spawn(&["session", "list", "--store", "sqlite:fresh.db"]))
            .collect();
        for c in children {
            Run::from(c.wait_with_output().unwrap(), &["session list"]).ok();
        }
    }
}

const CHAT: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: chat}
spec:
  messages:
    - "hello"
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - text: first answer
          - text: second answer
"#;

#[test]
fn appending_a_message_continues_and_changing_the_agent_is_refused() {
    let s = Scratch::new("append");
    let file = s.write("chat.yaml", CHAT);
    let f = file.display().to_string();
    assert!(s
        .run(&["run", "-f", &f])
        .ok()
        .contains("answer: first answer"));
    s.write(
        "chat.yaml",
        &CHAT.replace(
            "    - \"hello\"\n",
            "    - \"hello\"\n    - \"and then?\"\n",
        ),
    );
    let again = s.run(&["run", "-f", &f]);
    let out = again.ok();
    assert!(out.contains("user: and then?"), "{out}");
    assert!(out.contains("answer: second answer"), "{out}");
    s.write("chat.yaml", &CHAT.replace("first answer", "other answer"));
    s.run(&["run", "-f", &f])
        .fails_with("already exists in sqlite:./agents.db with a different agent");
}

#[test]
fn a_result_that_starts_like_json_but_is_broken_is_refused_and_nothing_is_stored() {
    let s = Scratch::new("broken-json");
    let file = quickstart(&s);
    s.run(&["run", "-f", &file]).ok();
    let bad = s.run(&[
        "session",
        "complete",
        "quickstart-t1-c1",
        "--text",
        r#"{"sent": true,"#,
    ]);
    bad.fails_with("starts like JSON but is not valid JSON");
    // Nothing was written: the call still waits and takes a good result.
    let pending = s.run(&["session", "pending", "quickstart", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(pending.ok()).unwrap();
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .any(|p| p["token"] == "quickstart-t1-c1"),
        "{v}"
    );
    s.run(&[
        "session",
        "complete",
        "quickstart-t1-c1",
        "--text",
        r#"{"type":"text","content":"{ not json, and that is fine"}"#,
    ])
    .ok();
}

#[test]
fn the_result_file_may_follow_the_token_as_the_plan_writes_it() {
    let s = Scratch::new("positional-result");
    let file = quickstart(&s);
    s.run(&["run", "-f", &file]).ok();
    let result = s.write("result.json", r#"{"type":"text","content":"filed"}"#);
    let result = result.display().to_string();

    let both = s.run(&[
        "session",
        "complete",
        "quickstart-t1-c1",
        &result,
        "--result-file",
        &result,
    ]);
    let err = both.fails_with("the result file is given twice");
    assert!(err.contains("give it once"), "{err}");

    let done = s.run(&["session", "complete", "quickstart-t1-c1", &result]);
    assert!(done.ok().contains("completed quickstart-t1-c1"));
    let show = s.run(&["session", "show", "quickstart", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(show.ok()).unwrap();
    assert_eq!(
        v["continuations"][0]["result"]["response"]["content"], "filed",
        "{v}"
    );
}
