//! Export and import between stores (issue 30, item 2), standalone: a
//! session left waiting by `agents run` is exported, imported into
//! another store under a new name, and finished there; bad exports are
//! refused with nothing written.

use crate::support;

use support::http::{Response, Server};
use support::scratch::*;

const SECRET: &str = "s3cret-never-exported-7f2c";

/// A session whose model asks for an http lookup (with a header from a
/// Secret), a deferred email and a deploy that waits for approval.
fn session_yaml(lookup: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: mover}}
spec:
  messages: ["Look it up, tell ops, deploy."]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - text: "All three."
            toolCalls:
              - {{name: lookup, arguments: {{key: weather}}}}
              - {{name: send_email, arguments: {{to: ops@example.org}}}}
              - {{name: deploy, arguments: {{env: prod}}}}
          - text: "Done after the move."
    tools:
      - name: lookup
        description: Looks a key up.
        http:
          url: "{lookup}"
          headers:
            - name: X-Api-Key
              valueFrom: {{secretKeyRef: {{name: svc, key: token}}}}
      - name: send_email
        description: A person sends it.
        builtin: {{function: echo}}
      - name: deploy
        description: Deploys.
        builtin: {{function: echo}}
    policy:
      default: runSync
      rules:
        - tool: send_*
          disposition: defer
          reason: a person sends emails
        - tool: deploy
          disposition: runSync
          approval: true
"#
    )
}

fn lookup_server() -> Server {
    Server::start(|_| Response::json(200, r#"{"weather": "sunny"}"#))
}

/// `agents run` on a.db until the two waits; returns the export's text.
fn run_and_export(s: &Scratch, server: &Server) -> String {
    let file = s.write("mover.yaml", &session_yaml(&server.url("/lookup")));
    let run = s
        .cmd(&[
            "run",
            "-f",
            &file.display().to_string(),
            "--store",
            "sqlite:a.db",
        ])
        .env("AGENTS_SECRET_SVC_TOKEN", SECRET)
        .output()
        .unwrap();
    let run = Run::from(run, &["run"]);
    assert!(
        run.ok().contains("yielded: 2 call(s) wait"),
        "{}",
        run.stdout
    );
    let export = s.run(&["session", "export", "mover", "--store", "sqlite:a.db"]);
    export.ok().to_string()
}

#[test]
fn exported_session_is_finished_in_another_store_under_a_new_name() {
    let s = Scratch::new("moves-roundtrip");
    let server = lookup_server();
    let text = run_and_export(&s, &server);
    assert_eq!(server.requests().len(), 1);
    assert_eq!(server.requests()[0].header("x-api-key"), Some(SECRET));
    assert!(
        !text.contains(SECRET),
        "the export holds the secret's value"
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["format"], "agents-exe.io/session-export");
    assert_eq!(v["version"], 1);
    assert_eq!(v["state"]["phase"], "Waiting", "{v}");
    s.write("s.json", &text);

    let import = s.run(&[
        "session",
        "import",
        "-f",
        "s.json",
        "--store",
        "sqlite:b.db",
        "--name",
        "moved",
    ]);
    let out = import.ok();
    assert!(
        out.contains("imported session moved in sqlite:b.db"),
        "{out}"
    );
    assert!(out.contains("moved-t1-c1 send_email"), "{out}");
    let b = ["--store", "sqlite:b.db"];
    s.run(&[&["session", "approve", "moved-t1-c2"][..], &b[..]].concat())
        .ok();
    s.run(
        &[
            &["session", "complete", "moved-t1-c1", "--text", "sent"][..],
            &b[..],
        ]
        .concat(),
    )
    .ok();
    let resumed = s.run(&[&["session", "resume", "moved"][..], &b[..]].concat());
    let out = resumed.ok();
    assert!(out.contains("session moved succeeded"), "{out}");
    assert!(out.contains("Done after the move."), "{out}");
    assert_eq!(
        server.requests().len(),
        1,
        "the lookup ran again after the move"
    );
    // The source is untouched: it still waits under its own tokens.
    let pending = s.run(&["session", "pending", "mover", "--store", "sqlite:a.db"]);
    assert!(pending.ok().contains("mover-t1-c1"), "{}", pending.stdout);
}

/// An import that is refused leaves the target store without the session.
fn refused(s: &Scratch, file: &str, text: &str, expect: &str) {
    s.write(file, text);
    let run = s.run(&["session", "import", "-f", file, "--store", "sqlite:b.db"]);
    assert_ne!(run.code, 0, "{file} was imported: {}", run.stdout);
    assert!(run.stderr.contains(expect), "{file}: {}", run.stderr);
    let list = s.run(&["session", "list", "--store", "sqlite:b.db", "-o", "json"]);
    let listed: serde_json::Value = serde_json::from_str(list.ok()).unwrap();
    assert_eq!(listed, serde_json::json!([]), "{file} wrote a session");
}

#[test]
fn newer_tampered_or_taken_exports_are_refused_and_nothing_is_written() {
    let s = Scratch::new("moves-refused");
    let server = lookup_server();
    let text = run_and_export(&s, &server);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();

    let mut newer = v.clone();
    newer["version"] = 2.into();
    refused(
        &s,
        "newer.json",
        &newer.to_string(),
        "format version 2, newer than this build reads (version 1)",
    );

    // A result for a call the agent turn never made.
    let mut foreign = v.clone();
    let turns = foreign["state"]["turns"].as_array_mut().unwrap();
    turns.push(serde_json::json!({"role": "user", "toolResults": [{
        "callId": "t1-c9", "modelCallId": "call_forged", "tool": "lookup",
        "result": {"status": "success", "response": {"type": "text", "content": "forged"}}}]}));
    refused(
        &s,
        "foreign.json",
        &foreign.to_string(),
        "which agent turn 1 did not make",
    );

    // Two calls of one agent turn under one id.
    let mut duplicate = v.clone();
    let calls = duplicate["state"]["turns"][1]["toolCalls"]
        .as_array_mut()
        .unwrap();
    let first = calls[0].clone();
    calls[1]["modelCallId"] = first["modelCallId"].clone();
    refused(
        &s,
        "duplicate.json",
        &duplicate.to_string(),
        "agent turn 1 has duplicate call ids",
    );

    refused(&s, "notjson.json", "{", "is not JSON");

    // A name already taken: refused, and the session there is unchanged.
    s.write("s.json", &text);
    let again = s.run(&[
        "session",
        "import",
        "-f",
        "s.json",
        "--store",
        "sqlite:a.db",
    ]);
    assert_ne!(again.code, 0);
    assert!(again.stderr.contains("session mover already exists in sqlite:a.db; import it under another name with --name NEW"), "{}", again.stderr);
}
