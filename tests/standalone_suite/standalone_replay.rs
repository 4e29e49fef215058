//! Golden sessions (issue 30, item 3): a recorded session replayed
//! through an agent, standalone. The tools' server counts requests: no
//! tool runs during a replay.

use crate::support;

use support::http::{Response, Server};
use support::scratch::*;

/// A session whose scripted model asks for `first` (an http tool) and a
/// deferred email, then answers.
fn session_yaml(server: &Server, first: &str, key: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: golden}}
spec:
  messages: ["Look it up and tell ops."]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - text: "Both."
            toolCalls:
              - {{name: {first}, arguments: {{key: {key}}}}}
              - {{name: send_email, arguments: {{to: ops@example.org}}}}
          - text: "All done."
    tools:
      - {{name: lookup, description: Looks up., http: {{url: "{url}"}}}}
      - {{name: search, description: Searches., http: {{url: "{url}"}}}}
      - {{name: send_email, description: A person sends it., builtin: {{function: echo}}}}
    policy:
      default: runSync
      rules:
        - {{tool: send_*, disposition: defer, reason: a person sends emails}}
"#,
        url = server.url("/tool")
    )
}

/// Records the session (run, complete, resume to Succeeded) and exports it.
fn record(s: &Scratch, server: &Server) {
    let file = s.write("golden.yaml", &session_yaml(server, "lookup", "weather"));
    s.run(&["run", "-f", &file.display().to_string()]).ok();
    s.run(&["session", "complete", "golden-t1-c1", "--text", "sent"])
        .ok();
    let done = s.run(&["session", "resume", "golden"]);
    assert!(
        done.ok().contains("session golden succeeded"),
        "{}",
        done.stdout
    );
    let export = s.run(&["session", "export", "golden"]);
    s.write("golden.json", export.ok());
    assert_eq!(server.requests().len(), 1);
}

fn tool_server() -> Server {
    Server::start(|_| Response::json(200, r#"{"weather": "sunny"}"#))
}

fn report(run: &Run) -> serde_json::Value {
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {run:?}"))
}

#[test]
fn a_recorded_session_replayed_against_the_same_agent_passes_and_runs_nothing() {
    let s = Scratch::new("replay-same");
    let server = tool_server();
    record(&s, &server);
    for source in ["golden.json", "golden"] {
        let run = s.run(&["session", "replay", source, "--strict", "-o", "json"]);
        assert_eq!(run.code, 0, "{source}: {run:?}");
        let v = report(&run);
        assert_eq!(v["passed"], true, "{v}");
        assert_eq!(v["turns"][0]["verdict"], "same", "{v}");
        assert_eq!(v["turns"][1]["answer"], "All done.", "{v}");
        assert_eq!(v["unmatched"], serde_json::json!([]), "{v}");
    }
    let text = s.run(&["session", "replay", "golden.json"]);
    assert!(
        text.ok().contains("replay of golden passed"),
        "{}",
        text.stdout
    );
    assert_eq!(server.requests().len(), 1, "a tool ran during a replay");
}

#[test]
fn an_agent_asking_for_another_tool_fails_with_the_turn_named() {
    let s = Scratch::new("replay-other");
    let server = tool_server();
    record(&s, &server);
    let other = s.write("other.yaml", &session_yaml(&server, "search", "weather"));
    let other = other.display().to_string();
    let run = s.run(&["session", "replay", "golden.json", "--agent", &other]);
    assert_eq!(run.code, 4, "{run:?}");
    assert!(run.stdout.contains("turn 1: different"), "{}", run.stdout);
    assert!(
        run.stdout
            .contains("unmatched call (no recorded result): search"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("replay of golden FAILED"),
        "{}",
        run.stdout
    );
    let json = s.run(&[
        "session",
        "replay",
        "golden.json",
        "--agent",
        &other,
        "-o",
        "json",
    ]);
    assert_eq!(json.code, 4);
    let v = report(&json);
    assert_eq!(v["turns"][0]["verdict"], "different", "{v}");
    assert_eq!(
        v["turns"][0]["replayedCalls"][0], r#"search({"key":"weather"})"#,
        "{v}"
    );
    assert_eq!(
        server.requests().len(),
        1,
        "an unmatched call ran without --run-unmatched"
    );
}

#[test]
fn other_arguments_pass_by_default_and_fail_strict() {
    let s = Scratch::new("replay-strict");
    let server = tool_server();
    record(&s, &server);
    let other = s.write("args.yaml", &session_yaml(&server, "lookup", "rain"));
    let other = other.display().to_string();
    // Same tools in the same order: the turn is the same by default, but
    // the call has no recorded result (other arguments), so it fails...
    let default = s.run(&[
        "session",
        "replay",
        "golden.json",
        "--agent",
        &other,
        "-o",
        "json",
    ]);
    let v = report(&default);
    assert_eq!(v["turns"][0]["verdict"], "same", "{v}");
    assert_eq!(default.code, 4, "{default:?}");
    // ...unless it may run: then only --strict tells the calls apart.
    let ran = s.run(&[
        "session",
        "replay",
        "golden.json",
        "--agent",
        &other,
        "--run-unmatched",
    ]);
    assert_eq!(
        ran.code, 4,
        "an unmatched call is reported even when it ran: {ran:?}"
    );
    assert_eq!(server.requests().len(), 2, "--run-unmatched ran the call");
    let strict = s.run(&[
        "session",
        "replay",
        "golden.json",
        "--agent",
        &other,
        "--strict",
        "-o",
        "json",
    ]);
    let v = report(&strict);
    assert_eq!(v["turns"][0]["verdict"], "different", "{v}");
    assert_eq!(strict.code, 4);
}

/// The replay's tool spans say the result was replayed, not executed.
#[test]
fn traces_mark_replayed_results() {
    let Some(collector) = support::otel::Collector::start("replay") else {
        return;
    };
    let s = Scratch::new("replay-traced");
    let server = tool_server();
    record(&s, &server);
    let mut cmd = s.cmd(&["session", "replay", "golden.json"]);
    for (k, v) in collector.env() {
        cmd.env(k, v);
    }
    let run = Run::from(cmd.output().unwrap(), &["session", "replay"]);
    assert!(run.ok().contains("passed"), "{}", run.stdout);
    let spans = collector.wait_for("the replayed lookup", |spans| {
        spans.iter().any(|s| s.name == "execute_tool lookup")
    });
    let lookup = spans
        .iter()
        .find(|s| s.name == "execute_tool lookup")
        .unwrap();
    assert_eq!(
        lookup.attr("agents.result.source"),
        Some("replayed"),
        "{lookup:?}"
    );
    assert_eq!(lookup.attr("agents.tool.runner"), None, "{lookup:?}");
}

/// `--model` puts another model in the recorded agent's place.
#[test]
fn another_model_in_the_agents_place() {
    let s = Scratch::new("replay-model");
    let server = tool_server();
    record(&s, &server);
    let model = |first: &str| {
        format!(
            r#"
provider: scripted
scripted:
  replies:
    - toolCalls:
        - {{name: {first}, arguments: {{key: weather}}}}
        - {{name: send_email, arguments: {{to: ops@example.org}}}}
    - text: "Another model's answer."
"#
        )
    };
    s.write("same.yaml", &model("lookup"));
    let same = s.run(&[
        "session",
        "replay",
        "golden.json",
        "--model",
        "same.yaml",
        "--strict",
    ]);
    assert_eq!(same.code, 0, "{same:?}");
    assert!(
        same.stdout.contains("Another model's answer."),
        "{}",
        same.stdout
    );
    s.write("other.yaml", &model("search"));
    let other = s.run(&["session", "replay", "golden.json", "--model", "other.yaml"]);
    assert_eq!(other.code, 4, "{other:?}");
    assert!(
        other.stdout.contains("turn 1: different"),
        "{}",
        other.stdout
    );
    s.write("typo.yaml", "provider: scripted\nscriptd: {replies: []}\n");
    let typo = s.run(&["session", "replay", "golden.json", "--model", "typo.yaml"]);
    assert_eq!(typo.code, 1, "{typo:?}");
    assert!(
        typo.stderr.contains("unknown field model.scriptd"),
        "{}",
        typo.stderr
    );
    assert_eq!(server.requests().len(), 1, "a tool ran during a replay");
}
