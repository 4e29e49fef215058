//! Crash safety: every `agents` process of a session is SIGKILLed at a
//! random moment, again and again; resuming always finishes the session
//! with each call's result recorded exactly once and none lost.
//!
//! Replay a failing run with the printed `AGENTS_TEST_SEED=...`.

use crate::support;

use agents::core::{Phase, SessionId, SessionState, Turn, WaitingFor};
use agents::store::sqlite::SqliteStore;
use agents::store::ContinuationRecord;
use std::collections::BTreeMap;
use std::time::Duration;
use support::rng::Rng;
use support::scratch::*;

fn definition(log: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: crashy}}
spec:
  messages: ["work through it"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - text: first batch
            toolCalls:
              - {{name: echo, arguments: {{text: a}}}}
              - {{name: nap, arguments: {{ms: 30}}}}
              - {{name: count, arguments: {{n: 1}}}}
              - {{name: ask, arguments: {{q: colour}}}}
              - {{name: echo, arguments: {{text: b}}}}
          - text: second batch
            toolCalls:
              - {{name: nap, arguments: {{ms: 20}}}}
              - {{name: count, arguments: {{n: 2}}}}
              - {{name: echo, arguments: {{text: c}}}}
          - text: all done
    tools:
      - {{name: echo, builtin: {{function: echo}}}}
      - {{name: nap, builtin: {{function: sleep}}}}
      - {{name: ask, builtin: {{function: echo}}}}
      - name: count
        container:
          command: ["/bin/sh", "-c", "sleep 0.03; echo ran >> {log}; echo counted"]
    policy:
      rules:
        - {{tool: nap, disposition: runAsync}}
        - {{tool: count, disposition: runIsolated}}
        - {{tool: ask, disposition: defer, reason: a person answers}}
"#
    )
}

const CALLS: usize = 8;

fn load(s: &Scratch) -> Option<(SessionState, Vec<ContinuationRecord>)> {
    if !s.path("agents.db").exists() {
        return None;
    }
    let store = SqliteStore::open(s.path("agents.db")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let id = SessionId("crashy".into());
    let rec = rt.block_on(store.load_session(&id)).unwrap()?;
    let conts = rt.block_on(store.session_continuations(&id)).unwrap();
    Some((rec.value.state, conts))
}

/// The next command a user (or worker) would run.
fn next_step(s: &Scratch, file: &str) -> Vec<String> {
    let strs = |v: &[&str]| v.iter().map(|a| a.to_string()).collect();
    let Some((state, conts)) = load(s) else {
        return strs(&["run", "-f", file]);
    };
    if state.phase == Phase::Waiting {
        let open: Vec<&ContinuationRecord> = conts.iter().filter(|c| !c.is_completed()).collect();
        if let Some(c) = open
            .iter()
            .find(|c| c.spec.waiting_for == WaitingFor::External)
        {
            return vec![
                "session".into(),
                "complete".into(),
                c.spec.token.0.clone(),
                "--text".into(),
                "blue".into(),
            ];
        }
        if open
            .iter()
            .any(|c| c.spec.waiting_for == WaitingFor::Isolated)
        {
            return strs(&["session", "run-isolated", "crashy"]);
        }
    }
    strs(&["session", "resume", "crashy"])
}

#[test]
fn sigkill_at_random_points_never_loses_or_repeats_a_result() {
    let mut rng = Rng::from_env_or_time();
    let rounds = support::sized("AGENTS_CRASH_ROUNDS", 8) as u32;
    let mut kills = 0;
    let mut total_steps = 0;
    for round in 0..rounds {
        let s = Scratch::new("crash");
        let log = s.path("isolated.log");
        let file = s.write("crashy.yaml", &definition(&log.display().to_string()));
        let file = file.display().to_string();
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 200, "round {round}: no progress after 200 steps");
            if let Some((state, _)) = load(&s) {
                if state.phase == Phase::Succeeded {
                    break;
                }
                assert_ne!(state.phase, Phase::Failed, "{:?}", state.failure);
            }
            let args = next_step(&s, &file);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut child = s.spawn(&args);
            // Three in four processes are killed, somewhere in their first
            // 60 ms (a whole run of one step takes about that long).
            if rng.below(4) > 0 {
                std::thread::sleep(Duration::from_millis(rng.below(60)));
                if child.try_wait().unwrap().is_none() {
                    child.kill().unwrap(); // SIGKILL
                    kills += 1;
                }
            }
            let out = child.wait_with_output().unwrap();
            if out.status.code().is_some_and(|c| c != 0) {
                panic!(
                    "round {round}: `agents {}` failed:\n{}\n{}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        total_steps += steps;
        let (state, conts) = load(&s).unwrap();
        check_every_result_once(&state, &conts, round);
        let runs = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count();
        assert!(runs >= 2, "both isolated calls ran at least once");
    }
    eprintln!("{rounds} rounds, {total_steps} processes, {kills} killed mid-run");
    assert!(kills > 0, "the test killed nothing; it proves nothing");
}

fn check_every_result_once(state: &SessionState, conts: &[ContinuationRecord], round: u32) {
    assert!(state.open.is_none(), "round {round}: no call is left open");
    let issued: usize = state
        .turns
        .iter()
        .map(|t| match t {
            Turn::Agent(a) => a.tool_calls.len(),
            Turn::User(_) => 0,
        })
        .sum();
    assert_eq!(
        issued, CALLS,
        "round {round}: the model was asked twice for a turn"
    );
    let mut results = BTreeMap::new();
    for t in &state.turns {
        if let Turn::User(u) = t {
            for r in &u.tool_results {
                assert!(
                    results.insert(r.call_id, r.clone()).is_none(),
                    "round {round}: {} has two results",
                    r.call_id
                );
            }
        }
    }
    assert_eq!(results.len(), CALLS, "round {round}: a result is missing");
    for r in results.values() {
        assert!(
            !r.result.is_error(),
            "round {round}: {} failed: {:?}",
            r.call_id,
            r.result
        );
    }
    // Each continuation holds exactly the result the model received.
    // One continuation per call that waits outside the step: the two
    // isolated calls and the deferred one. The two runAsync calls run by
    // the driver itself are recorded with the session alone.
    assert_eq!(
        conts.len(),
        3,
        "round {round}: one continuation per call that waits outside the step"
    );
    for c in conts {
        let entry = &results[&c.spec.call_id];
        if c.result.as_ref() != Some(&entry.result) {
            eprintln!(
                "mismatch: {:?} waiting={:?} result={:?} by={:?} decision={:?}",
                c.spec.token, c.spec.waiting_for, c.result, c.completed_by, c.decision
            );
        }
        assert_eq!(
            c.result.as_ref(),
            Some(&entry.result),
            "round {round}: {} differs between its continuation and the conversation",
            c.spec.token
        );
    }
}
