//! Sessions carried between a laptop and the cluster (issue 30, item 2):
//! `agents run` leaves a session waiting on SQLite, it is exported,
//! imported into the cluster, completed there and finished by the
//! operator; and the reverse, a cluster session exported, imported into
//! SQLite and resumed there. An import whose Agent the cluster lacks
//! shows `Ready=False AgentNotFound`.
//!
//! Each test starts its own `agents operator -n NS`. Skipped without a
//! cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use std::time::Duration;
use support::launcher;
use support::scratch::{Run, Scratch};
use support::{apply, kubectl, kubectl_ok, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

const SESSION: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: mover}
spec:
  messages: ["Look it up and tell ops."]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - text: "Both."
            toolCalls:
              - {name: lookup, arguments: {key: weather}}
              - {name: send_email, arguments: {to: ops@example.org}}
          - text: "Done after the move."
    tools:
      - {name: lookup, description: Looks up., builtin: {function: echo}}
      - {name: send_email, description: A person sends it., builtin: {function: echo}}
    policy:
      default: runSync
      rules:
        - {tool: send_*, disposition: defer, reason: a person sends emails}
"#;

/// `agents ARGS` in the scratch directory, against the test cluster.
fn agents(s: &Scratch, args: &[&str]) -> Run {
    let kubeconfig = support::kubeconfig_path().unwrap();
    let out = s
        .cmd(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("AGENTS_NAMESPACE")
        .output()
        .unwrap();
    Run::from(out, args)
}

fn kube<'a>(args: &[&'a str], ns: &'a str) -> Vec<&'a str> {
    [args, &["--store", "kube", "-n", ns]].concat()
}

/// Waits until session `name` is checkpointed `Waiting` with its call's
/// Continuation `token` made (the Continuation is made first).
async fn waiting_on(ns: &str, name: &str, token: &str) {
    wait_until(Duration::from_secs(90), "the waiting session", || async {
        let made = kubectl(["get", "continuation", token, "-n", ns])
            .status
            .success();
        let phase = kubectl_ok([
            "get",
            "session",
            name,
            "-n",
            ns,
            "-o",
            "jsonpath={.status.phase}",
        ]);
        (made && phase == "Waiting").then_some(())
    })
    .await;
}

fn exported(run: &Run) -> serde_json::Value {
    serde_json::from_str(run.ok()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_on_a_laptop_imported_into_the_cluster_is_finished_by_the_operator() {
    let Some((client, ns)) = support::cluster_namespace("moves-up").await else {
        return;
    };
    let s = Scratch::new("moves-up");
    let file = s.write("mover.yaml", SESSION);
    let run = agents(&s, &["run", "-f", &file.display().to_string()]);
    assert!(
        run.ok().contains("yielded: 1 call(s) wait"),
        "{}",
        run.stdout
    );
    let export = agents(&s, &["session", "export", "mover"]);
    s.write("s.json", export.ok());

    let _operator = launcher::Operator::watching(BIN, &ns.name, "moves-up");
    let import = agents(&s, &kube(&["session", "import", "-f", "s.json"], &ns.name));
    assert!(
        import.ok().contains("mover-t1-c1 send_email"),
        "{}",
        import.stdout
    );
    // The wait is there at once: the token is answered without waiting for
    // the operator.
    let done = agents(
        &s,
        &kube(
            &["session", "complete", "mover-t1-c1", "--text", "sent"],
            &ns.name,
        ),
    );
    done.ok();
    wait_succeeded(&ns.name, "mover");
    let back = exported(&agents(
        &s,
        &kube(&["session", "export", "mover"], &ns.name),
    ));
    assert_eq!(back["state"]["answer"], "Done after the move.", "{back}");
    assert_eq!(back["state"]["agentTurns"], 2, "{back}");
    let results: Vec<&serde_json::Value> = back["state"]["turns"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["toolResults"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(results.len(), 2, "{back}");
    assert_eq!(results[1]["result"]["response"]["content"], "sent");
    ns.delete(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_in_the_cluster_imported_into_sqlite_is_resumed_there() {
    let Some((client, ns)) = support::cluster_namespace("moves-down").await else {
        return;
    };
    let s = Scratch::new("moves-down");
    let operator = launcher::Operator::watching(BIN, &ns.name, "moves-down");
    apply(&ns.name, SESSION);
    waiting_on(&ns.name, "mover", "mover-t1-c1").await;
    drop(operator);
    let version = || {
        kubectl_ok([
            "get",
            "session",
            "mover",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ])
    };
    let before = version();
    let export = agents(&s, &kube(&["session", "export", "mover"], &ns.name));
    let v = exported(&export);
    assert_eq!(v["source"]["store"], "kube");
    assert_eq!(v["state"]["phase"], "Waiting", "{v}");
    s.write("s.json", export.ok());
    assert_eq!(version(), before, "the export changed the source");

    let import = agents(
        &s,
        &["session", "import", "-f", "s.json", "--name", "local"],
    );
    assert!(
        import.ok().contains("local-t1-c1 send_email"),
        "{}",
        import.stdout
    );
    agents(
        &s,
        &["session", "complete", "local-t1-c1", "--text", "sent"],
    )
    .ok();
    let resumed = agents(&s, &["session", "resume", "local"]);
    let out = resumed.ok();
    assert!(out.contains("session local succeeded"), "{out}");
    assert!(out.contains("Done after the move."), "{out}");
    ns.delete(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_whose_agent_the_cluster_lacks_shows_agent_not_found() {
    let Some((client, ns)) = support::cluster_namespace("moves-noagent").await else {
        return;
    };
    let s = Scratch::new("moves-noagent");
    let file = s.write(
        "ref.yaml",
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: helper}
spec:
  model:
    provider: scripted
    scripted: {replies: [{toolCalls: [{name: ask, arguments: {}}]}, {text: hi}]}
  tools:
    - {name: ask, description: A person answers., builtin: {function: echo}}
  policy:
    rules:
      - {tool: ask, disposition: defer}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: referring}
spec:
  agentRef: {name: helper}
  messages: ["hello"]
"#,
    );
    agents(&s, &["run", "-f", &file.display().to_string()]).ok();
    let export = agents(&s, &["session", "export", "referring"]);
    s.write("s.json", export.ok());
    let _operator = launcher::Operator::watching(BIN, &ns.name, "moves-noagent");
    agents(&s, &kube(&["session", "import", "-f", "s.json"], &ns.name)).ok();
    let reason = || {
        kubectl_ok([
            "get",
            "session",
            "referring",
            "-n",
            &ns.name,
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Ready")].reason}"#,
        ])
    };
    wait_until(
        Duration::from_secs(60),
        "Ready=False AgentNotFound",
        || async { (reason() == "AgentNotFound").then_some(()) },
    )
    .await;
    // A second import under the same name is refused.
    let again = agents(&s, &kube(&["session", "import", "-f", "s.json"], &ns.name));
    assert_ne!(again.code, 0);
    assert!(
        again.stderr.contains("already exists in namespace"),
        "{}",
        again.stderr
    );
    ns.delete(&client).await;
}

/// Eight turns of 9 KB each (more than the status keeps: older turns go
/// into blobs), then a deferred call, then the answer.
fn long_session_yaml() -> String {
    let text = "nine kilobytes of agent text, turn after turn; ".repeat(200)[..9000].to_string();
    let long = (0..8).map(|i| {
        format!("          - text: \"{i} {text}\"\n            toolCalls: [{{name: lookup, arguments: {{turn: {i}}}}}]\n")
    });
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: long}}
spec:
  messages: ["Talk at length, then ask ops."]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
{long}          - toolCalls: [{{name: send_email, arguments: {{to: ops@example.org}}}}]
          - text: "Done after the move."
    tools:
      - {{name: lookup, description: Looks up., builtin: {{function: echo}}}}
      - {{name: send_email, description: A person sends it., builtin: {{function: echo}}}}
    policy:
      default: runSync
      rules:
        - {{tool: send_*, disposition: defer, reason: a person sends emails}}
"#,
        long = long.collect::<String>()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_holds_the_turns_the_cluster_spilled() {
    let Some((client, ns)) = support::cluster_namespace("moves-spilled").await else {
        return;
    };
    let s = Scratch::new("moves-spilled");
    let _operator = launcher::Operator::watching(BIN, &ns.name, "moves-spilled");
    apply(&ns.name, &long_session_yaml());
    waiting_on(&ns.name, "long", "long-t9-c0").await;
    let archived = kubectl_ok([
        "get",
        "session",
        "long",
        "-n",
        &ns.name,
        "-o",
        "jsonpath={.status.archivedTurns[*].turns}",
    ]);
    assert!(!archived.trim().is_empty(), "no turn was archived");
    let export = agents(&s, &kube(&["session", "export", "long"], &ns.name));
    let v = exported(&export);
    let texts: Vec<usize> = v["state"]["turns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["role"] == "agent")
        .map(|t| t["text"].as_str().unwrap_or_default().len())
        .collect();
    assert_eq!(texts.len(), 9, "every agent turn: {texts:?}");
    assert!(texts[..8].iter().all(|n| *n == 9002), "{texts:?}");
    s.write("long.json", export.ok());
    agents(&s, &["session", "import", "-f", "long.json"]).ok();
    agents(&s, &["session", "complete", "long-t9-c0", "--text", "sent"]).ok();
    let resumed = agents(&s, &["session", "resume", "long"]);
    assert!(
        resumed.ok().contains("Done after the move."),
        "{}",
        resumed.stdout
    );
    ns.delete(&client).await;
}

fn wait_succeeded(ns: &str, name: &str) {
    support::wait_session_condition(ns, name, "Succeeded", 90);
}

/// A cluster fork (a Session with `spec.forkFrom`) exported and imported
/// under another name lands as a root with its history in its state: the
/// import drops `spec.forkFrom`, so the operator does not fork it again,
/// and the new session finishes from where the fork waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_imported_under_another_name_is_not_forked_again() {
    let Some((client, ns)) = support::cluster_namespace("moves-fork").await else {
        return;
    };
    let s = Scratch::new("moves-fork");
    let _operator = launcher::Operator::watching(BIN, &ns.name, "moves-fork");
    apply(&ns.name, SESSION);
    waiting_on(&ns.name, "mover", "mover-t1-c1").await;
    let fork = &[
        "session",
        "fork",
        "mover",
        "--at-turn",
        "1",
        "--name",
        "forked",
    ];
    agents(&s, &kube(fork, &ns.name)).ok();
    waiting_on(&ns.name, "forked", "forked-t1-c1").await;
    let export = exported(&agents(
        &s,
        &kube(&["session", "export", "forked"], &ns.name),
    ));
    assert_eq!(
        export["definition"]["spec"]["forkFrom"]["session"], "mover",
        "the export keeps what the fork was made from: {export}"
    );
    s.write("forked.json", &export.to_string());
    let import = &["session", "import", "-f", "forked.json", "--name", "moved"];
    agents(&s, &kube(import, &ns.name)).ok();
    let spec = |name: &str, path: &str| {
        kubectl_ok([
            "get",
            "session",
            name,
            "-n",
            &ns.name,
            "-o",
            &format!("jsonpath={path}"),
        ])
    };
    assert_eq!(
        spec("moved", "{.spec.forkFrom}"),
        "",
        "the import kept spec.forkFrom"
    );
    assert_eq!(spec("moved", "{.spec.parent}"), "");
    agents(
        &s,
        &kube(
            &["session", "complete", "moved-t1-c1", "--text", "sent"],
            &ns.name,
        ),
    )
    .ok();
    wait_succeeded(&ns.name, "moved");
    assert_eq!(spec("moved", "{.status.agentTurns}"), "2");
    assert_eq!(spec("moved", "{.status.answer}"), "Done after the move.");
    assert_eq!(
        spec("mover", "{.status.phase}"),
        "Waiting",
        "the source moved on"
    );
    assert_eq!(
        spec("forked", "{.status.phase}"),
        "Waiting",
        "the fork moved on"
    );
    ns.delete(&client).await;
}
