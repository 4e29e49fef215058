//! Decorators as a user sees them standalone: retries, cache, timeouts of
//! waiting calls, turn limits, a session created paused.

use crate::support;

use support::scratch::*;

fn session(name: &str, replies: &str, policy: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["go"]
{extra_spec}  agent:
    model:
      provider: scripted
      scripted:
        replies:
{replies}
    tools:
      - {{name: echo, builtin: {{function: echo}}}}
      - {{name: flaky, builtin: {{function: fail}}}}
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
{policy}
"#
    )
}

#[test]
fn background_failures_are_retried_then_reported_to_the_model() {
    let s = Scratch::new("retries");
    let yaml = session(
        "retry",
        "          - toolCalls: [{name: flaky, arguments: {message: down}}]\n          - text: gave up",
        "      rules: [{tool: flaky, disposition: runAsync, retries: 1}]",
        "",
    );
    let file = s.write("r.yaml", &yaml);
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let out = run.ok();
    assert_eq!(
        out.matches("result t1-c0 flaky [runAsync]: error: down")
            .count(),
        2,
        "one attempt and one retry: {out}"
    );
    assert!(out.contains("answer: gave up"), "{out}");
}

#[test]
fn cached_results_are_reused_across_sessions() {
    let s = Scratch::new("cache");
    for name in ["first", "second"] {
        let yaml = session(
            name,
            "          - toolCalls: [{name: echo, arguments: {text: same}}]\n          - text: ok",
            "      rules: [{tool: echo, disposition: runAsync, cache: true}]",
            "",
        );
        let file = s.write(&format!("{name}.yaml"), &yaml);
        let run = s.run(&["run", "-f", &file.display().to_string()]);
        let out = run.ok();
        assert!(out.contains("answer: ok"), "{out}");
        if name == "second" {
            assert!(!out.contains("[runAsync]"), "served from the cache: {out}");
            assert!(
                out.contains("result t1-c0 echo [cache]: same"),
                "served from the cache: {out}"
            );
            // A runAsync call is recorded with the session alone: no
            // continuation, the cached result in the conversation.
            let show = s.run(&["session", "show", "second", "-o", "json"]);
            let v: serde_json::Value = serde_json::from_str(show.ok()).unwrap();
            assert_eq!(v["continuations"], serde_json::json!([]), "{v}");
            assert_eq!(
                v["session"]["turns"][2]["toolResults"][0]["result"]["response"]["content"], "same",
                "{v}"
            );
        }
    }
}

#[test]
fn a_waiting_call_past_its_timeout_is_answered_with_an_error_on_resume() {
    let s = Scratch::new("timeout");
    let yaml = session(
        "late",
        "          - toolCalls: [{name: ask, arguments: {q: anyone}}]\n          - text: nobody answered",
        "      rules: [{tool: ask, disposition: defer, reason: a person answers, timeoutSeconds: 1}]",
        "",
    );
    let file = s.write("t.yaml", &yaml);
    assert!(s
        .run(&["run", "-f", &file.display().to_string()])
        .ok()
        .contains("yielded"));
    // Deadlines are whole seconds (as Kubernetes times are): wait past it.
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let resumed = s.run(&["session", "resume", "late"]);
    assert!(
        resumed.ok().contains("answer: nobody answered"),
        "{}",
        resumed.stdout
    );
    s.run(&["session", "complete", "late-t1-c0", "--text", "too late"])
        .fails_with("already completed (by agents");
    let show = s.run(&["session", "show", "late"]);
    assert!(show.ok().contains("timed out after 1s"), "{}", show.stdout);
}

#[test]
fn turn_limits_fail_clearly_and_paused_sessions_wait_for_resume() {
    let s = Scratch::new("limits");
    let yaml = session(
        "loop",
        "          - toolCalls: [{name: echo, arguments: {text: a}}]\n          - toolCalls: [{name: echo, arguments: {text: b}}]\n          - text: never",
        "      default: runSync",
        "  limits: {maxTurns: 1}\n",
    );
    let file = s.write("l.yaml", &yaml);
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stdout.contains("limit of 1 model turns"),
        "{}",
        run.stdout
    );

    let yaml = session(
        "held",
        "          - text: hello",
        "      default: runSync",
        "  paused: true\n",
    );
    let file = s.write("p.yaml", &yaml);
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    assert!(run.ok().contains("is paused"), "{}", run.stdout);
    let resumed = s.run(&["session", "resume", "held"]);
    assert!(resumed.ok().contains("answer: hello"), "{}", resumed.stdout);
}

#[test]
fn the_isolated_worker_retries_per_policy_and_captures_failures() {
    let s = Scratch::new("worker-retry");
    let marker = s.path("tried");
    let yaml = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: work}}
spec:
  messages: ["go"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: once_flaky, arguments: {{}}}}
              - {{name: broken, arguments: {{}}}}
          - text: worked around it
    tools:
      - name: once_flaky
        container:
          command: ["/bin/sh", "-c", "if [ -e {m} ]; then echo second time lucky; else touch {m}; echo not yet >&2; exit 1; fi"]
      - name: broken
        container:
          command: ["/bin/sh", "-c", "echo missing config >&2; exit 2"]
    policy:
      rules:
        - {{tool: once_flaky, disposition: runIsolated, retries: 1}}
        - {{tool: broken, disposition: runIsolated}}
"#,
        m = marker.display()
    );
    let file = s.write("w.yaml", &yaml);
    s.run(&["run", "-f", &file.display().to_string()]).ok();
    let worker = s.run(&["session", "run-isolated", "work"]);
    let out = worker.ok();
    assert!(out.contains("attempt 1 failed"), "{out}");
    assert!(
        out.contains("once_flaky [process]: second time lucky"),
        "{out}"
    );
    assert!(
        out.contains("broken [process]: error: the tool ended with exit status 2: missing config"),
        "{out}"
    );
    let resumed = s.run(&["session", "resume", "work"]);
    assert!(
        resumed.ok().contains("answer: worked around it"),
        "{}",
        resumed.stdout
    );
}
