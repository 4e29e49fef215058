//! `agents session fork` on the embedded store: the fork starts with the
//! source's history up to a turn, runs nothing of it again, runs what comes
//! after under its own keys, and leaves the source as it was; bad input is
//! refused before anything is written; `session tree` shows the fork.

use crate::support;

use support::fork::{assert_each_key_once, assert_tree_shows_fork_f, keyed_tool_server, Keys};
use support::http::Server;
use support::scratch::*;

fn tool_server() -> (Server, Keys) {
    keyed_tool_server(|path| format!("{{\"path\":\"{path}\"}}"))
}

/// Turn 1: `fetch /a` now and `ask` a person; turn 2: `fetch /b`; then done.
fn session_yaml(port: u16) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: src}}
spec:
  messages: ["look things up"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: fetch, arguments: {{what: a}}}}
              - {{name: ask, arguments: {{q: anyone}}}}
          - toolCalls: [{{name: fetch_b, arguments: {{}}}}]
          - text: done
    tools:
      - {{name: fetch, http: {{url: "http://127.0.0.1:{port}/a"}}}}
      - {{name: fetch_b, http: {{url: "http://127.0.0.1:{port}/b"}}}}
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
      default: runSync
      rules: [{{tool: ask, disposition: defer, reason: a person answers}}]
"#
    )
}

fn show_json(s: &Scratch, name: &str) -> serde_json::Value {
    serde_json::from_str(s.run(&["session", "show", name, "-o", "json"]).ok()).unwrap()
}

fn port_of(server: &Server) -> u16 {
    server.url("").rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn a_fork_runs_only_what_comes_after_its_turn_and_leaves_the_source_alone() {
    let s = Scratch::new("fork");
    let (server, keys) = tool_server();
    let file = s.write("src.yaml", &session_yaml(port_of(&server)));
    assert!(s
        .run(&["run", "-f", &file.display().to_string()])
        .ok()
        .contains("yielded"));

    // Forked while the person's call is still open: that call is planned
    // afresh in the fork (a token of its own), the done fetch is history.
    let open = s.run(&[
        "session",
        "fork",
        "src",
        "--at-turn",
        "1",
        "--name",
        "early",
    ]);
    assert!(open.ok().contains("early-t1-c1"), "{}", open.stdout);
    assert_eq!(keys.lock().unwrap().len(), 1, "the fork ran no fetch again");

    s.run(&["session", "complete", "src-t1-c1", "--text", "yes"])
        .ok();
    assert!(s
        .run(&["session", "resume", "src"])
        .ok()
        .contains("answer: done"));
    let source_before = show_json(&s, "src");

    let fork = s.run(&[
        "session",
        "fork",
        "src",
        "--at-turn",
        "1",
        "--name",
        "f",
        "--message",
        "and again?",
    ]);
    assert!(fork.ok().contains("answer: done"), "{}", fork.stdout);
    let keys = keys.lock().unwrap().clone();
    assert_eq!(
        keys.len(),
        3,
        "src's /a and /b, and the fork's /b: {keys:?}"
    );
    assert_each_key_once(&keys);
    let fork_keys: Vec<_> = keys.iter().filter(|(_, (p, _))| p == "/a").collect();
    assert_eq!(fork_keys.len(), 1, "/a ran only for the source: {keys:?}");
    let b: Vec<&String> = keys
        .iter()
        .filter(|(_, (p, _))| p == "/b")
        .map(|(k, _)| k)
        .collect();
    assert_eq!(b.len(), 2, "/b once for each session: {keys:?}");
    assert!(b.iter().all(|k| k.ends_with("/t2-c0")), "{b:?}");

    let forked = show_json(&s, "f");
    let from = &forked["session"]["forkedFrom"];
    assert_eq!(
        (from["session"].as_str(), from["turn"].as_u64()),
        (Some("src"), Some(1)),
        "{forked}"
    );
    assert!(
        from["uid"].as_str().is_some_and(|u| !u.is_empty()),
        "{forked}"
    );
    let turns = forked["session"]["turns"].as_array().unwrap();
    assert_eq!(
        turns[..3],
        source_before["session"]["turns"].as_array().unwrap()[..3]
    );
    assert_eq!(turns[3]["message"], "and again?", "{forked}");
    assert_eq!(
        show_json(&s, "src"),
        source_before,
        "the source is only read"
    );

    let tree = s.run(&["session", "tree", "src"]);
    let text = tree.ok();
    assert_tree_shows_fork_f(text);
    assert!(text.contains("fork early [Waiting]"), "{text}");
}

#[test]
fn bad_forks_are_refused_with_what_to_do_and_write_nothing() {
    let s = Scratch::new("fork-bad");
    let (server, _keys) = tool_server();
    let file = s.write("src.yaml", &session_yaml(port_of(&server)));
    s.run(&["run", "-f", &file.display().to_string()]).ok();
    let listed = s.run(&["session", "list"]).ok().to_string();
    s.run(&["session", "fork", "src", "--at-turn", "5"])
        .fails_with("session src has no agent turn 5: it has 1");
    s.run(&["session", "fork", "src", "--at-turn", "0"])
        .fails_with("between 1 and 1");
    s.run(&["session", "fork", "nope", "--at-turn", "1"])
        .fails_with("session nope not found");
    s.run(&["session", "fork", "src", "--at-turn", "1", "--name", "src"])
        .fails_with("session src already exists");
    s.run(&["session", "fork", "src", "--at-turn", "1", "--message", " "])
        .fails_with("is empty");
    assert_eq!(
        s.run(&["session", "list"]).ok(),
        listed,
        "nothing was written"
    );
}
