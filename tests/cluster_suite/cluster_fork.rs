//! Fork on the cluster: a session with runSync http tools, a Job and a
//! deferred call is forked at turn 1 with a new message (`agents session
//! fork`, which writes `spec.forkFrom`; the operator writes the history).
//! The fork Succeeds; the http server sees no new request for the calls
//! before the fork point and one for each call after it; no Job runs
//! again; the source's resourceVersion is unchanged. Bad input is refused
//! with nothing written; a `spec.forkFrom` naming a missing source is the
//! fork's `Ready=False ForkSourceNotFound`; a spilled result the fork needs
//! is its own (it still loads once the source is deleted).

use crate::support;

use agents::api::Session;
use kube::api::Api;
use kube::{Client, ResourceExt};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;
use support::fork::{assert_each_key_once, assert_tree_shows_fork_f, keyed_tool_server, Keys};
use support::http::Server;
use support::launcher::Operator;
use support::{apply, kubectl_ok, wait_until, BUSYBOX_IMAGE};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
/// Over the status's inline limit for a result (16 KiB): it spills.
const BIG: usize = 20_000;

fn tool_server() -> (Server, Keys) {
    keyed_tool_server(|path| {
        let pad = if path == "/big" {
            "x".repeat(BIG)
        } else {
            String::new()
        };
        format!("{{\"path\":\"{path}\",\"pad\":\"{pad}END\"}}")
    })
}

fn manifests(base: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: forker}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: fetch, arguments: {{what: a}}}}
            - {{name: fetch_big, arguments: {{}}}}
            - {{name: count, arguments: {{}}}}
            - {{name: ask, arguments: {{q: anyone}}}}
        - toolCalls: [{{name: fetch_after, arguments: {{}}}}]
        - text: done
  tools:
    - {{name: fetch, http: {{url: "{base}/a"}}}}
    - {{name: fetch_big, http: {{url: "{base}/big"}}}}
    - {{name: fetch_after, http: {{url: "{base}/after"}}}}
    - name: count
      container:
        image: {BUSYBOX_IMAGE}
        command: ["/bin/sh", "-c", "echo counted"]
    - {{name: ask, builtin: {{function: echo}}}}
  policy:
    default: runSync
    rules:
      - {{tool: count, disposition: runIsolated}}
      - {{tool: ask, disposition: defer, reason: a person answers}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: src}}
spec:
  agentRef: {{name: forker}}
  messages: ["look things up"]
"#
    )
}

fn agents(ns: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", support::kubeconfig_path().unwrap())
        .env("USER", "tester")
        .env_remove("AGENTS_STORE")
        .env_remove("AGENTS_NAMESPACE")
        .output()
        .expect("run agents")
}

fn agents_ok(ns: &str, args: &[&str]) -> String {
    let o = agents(ns, args);
    assert!(o.status.success(), "agents {args:?}: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn agents_fails(ns: &str, args: &[&str], needle: &str) {
    let o = agents(ns, args);
    let t = text(&o);
    assert!(
        !o.status.success() && t.contains(needle),
        "agents {args:?}: want {needle:?}: {t}"
    );
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

async fn get(client: &Client, ns: &str, name: &str) -> Session {
    Api::<Session>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap()
}

fn condition(s: &Session, kind: &str) -> Option<(String, String)> {
    let st = s.status.as_ref()?;
    let c = st.conditions.iter().find(|c| c.type_ == kind)?;
    Some((c.status.clone(), c.reason.clone()))
}

/// The source's resourceVersion once it has stopped changing (the
/// operator's last writes after Succeeded are done).
async fn settled_version(client: &Client, ns: &str, name: &str) -> String {
    let mut last = get(client, ns, name).await.resource_version();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = get(client, ns, name).await.resource_version();
        if now == last {
            return now.unwrap();
        }
        last = now;
    }
    panic!("session {name} kept changing")
}

fn jobs(ns: &str) -> usize {
    let out = kubectl_ok(["get", "jobs", "-n", ns, "-o", "name"]);
    out.lines().filter(|l| !l.is_empty()).count()
}

fn operator(ns: &str, kubeconfig: &Path, image: &str) -> Operator {
    let name = format!("{ns}-fork");
    Operator::start(
        BIN,
        &name,
        kubeconfig,
        &["-n", ns, "--agents-image", image],
        &[],
    )
}

/// Runs the source to its end: its Job and fetches ran, the person answered.
async fn finished_source(client: &Client, ns: &str) {
    wait_until(
        Duration::from_secs(120),
        "src to wait for the person only",
        || async {
            let s = get(client, ns, "src").await;
            let waiting = condition(&s, "Waiting").is_some_and(|(st, _)| st == "True");
            let state = s.status?.state?;
            let done = |i: usize| state["open"]["calls"][i]["state"] == "Completed";
            (waiting && done(0) && done(1) && done(2)).then_some(())
        },
    )
    .await;
    agents_ok(ns, &["session", "complete", "src-t1-c3", "--text", "yes"]);
    support::wait_session_condition(ns, "src", "Succeeded", 90);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_runs_only_what_comes_after_its_turn_and_never_changes_its_source() {
    let Some((client, ns)) = support::cluster_namespace("fork").await else {
        return;
    };
    let Some(image) = support::agents_image() else {
        return;
    };
    let (server, keys) = tool_server();
    apply(&ns.name, &manifests(&server.url("")));
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _operator = operator(&ns.name, &kubeconfig, &image);
    finished_source(&client, &ns.name).await;
    let source_version = settled_version(&client, &ns.name, "src").await;
    let source_uid = get(&client, &ns.name, "src").await.uid().unwrap();
    let before = keys.lock().unwrap().clone();
    assert_eq!(
        before.len(),
        3,
        "src ran /a, /big, /after once each: {before:?}"
    );
    assert_eq!(jobs(&ns.name), 1, "src's one Job");

    refuses_bad_forks(&ns.name);
    let made = agents_ok(
        &ns.name,
        &[
            "session",
            "fork",
            "src",
            "--at-turn",
            "1",
            "--name",
            "f",
            "--message",
            "again?",
        ],
    );
    assert!(
        made.contains("session f forked from src at turn 1"),
        "{made}"
    );
    support::wait_session_condition(&ns.name, "f", "Succeeded", 90);
    let fork = get(&client, &ns.name, "f").await;
    let fork_uid = fork.uid().unwrap();

    let after = keys.lock().unwrap().clone();
    let new: Vec<_> = after
        .iter()
        .filter(|(k, _)| !before.contains_key(*k))
        .collect();
    assert_eq!(
        new.len(),
        1,
        "one new request, the fork's call after turn 1: {after:?}"
    );
    let (key, (path, n)) = new[0];
    assert_eq!((path.as_str(), *n), ("/after", 1), "{after:?}");
    assert!(key.contains(&fork_uid) && key.ends_with("/t2-c0"), "{key}");
    assert_each_key_once(&after);
    assert_eq!(jobs(&ns.name), 1, "the fork ran no Job");
    let now = get(&client, &ns.name, "src")
        .await
        .resource_version()
        .unwrap();
    assert_eq!(now, source_version, "the source was only read");

    let st = serde_json::to_value(fork.status.clone().unwrap()).unwrap();
    let from = &st["forkedFrom"];
    assert_eq!(
        (
            from["session"].as_str(),
            from["uid"].as_str(),
            from["turn"].as_u64()
        ),
        (Some("src"), Some(source_uid.as_str()), Some(1)),
        "{st}"
    );
    assert_eq!(
        fork.labels()
            .get("agents-exe.io/fork-from")
            .map(String::as_str),
        Some("src")
    );
    let tree = agents_ok(&ns.name, &["session", "tree", "src"]);
    assert_tree_shows_fork_f(&tree);

    a_missing_source_is_a_condition(&client, &ns.name).await;
    the_fork_outlives_its_source(&ns.name, &fork_uid).await;
    drop(server);
    ns.delete(&client).await;
}

/// A turn, source or name that is not right: refused, nothing written.
fn refuses_bad_forks(ns: &str) {
    let before = kubectl_ok(["get", "sessions", "-n", ns, "-o", "name"]);
    agents_fails(
        ns,
        &["session", "fork", "src", "--at-turn", "7"],
        "session src has no agent turn 7: it has 3",
    );
    agents_fails(
        ns,
        &["session", "fork", "ghost", "--at-turn", "1"],
        "session ghost not found in namespace",
    );
    agents_fails(
        ns,
        &["session", "fork", "src", "--at-turn", "1", "--name", "src"],
        "session src already exists",
    );
    assert_eq!(
        kubectl_ok(["get", "sessions", "-n", ns, "-o", "name"]),
        before,
        "nothing was written"
    );
}

async fn a_missing_source_is_a_condition(client: &Client, ns: &str) {
    apply(
        ns,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: orphan}
spec:
  agentRef: {name: forker}
  messages: ["hello"]
  forkFrom: {session: ghost, turn: 1}
"#,
    );
    let (status, reason) = wait_until(Duration::from_secs(60), "orphan's Ready=False", || async {
        let s = get(client, ns, "orphan").await;
        condition(&s, "Ready").filter(|(st, _)| st == "False")
    })
    .await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ForkSourceNotFound")
    );
    let s = get(client, ns, "orphan").await;
    let turns = s.status.and_then(|st| st.state).map(|v| v["turns"].clone());
    assert!(
        turns.is_none_or(|t| t.as_array().is_none_or(Vec::is_empty)),
        "nothing ran"
    );
}

/// The fork's spilled result lives in ConfigMaps it owns: with the source
/// deleted (and its blobs collected), the fork still loads whole.
async fn the_fork_outlives_its_source(ns: &str, fork_uid: &str) {
    let owned = kubectl_ok([
        "get",
        "configmaps",
        "-n",
        ns,
        "-l",
        "agents-exe.io/session=f",
        "-o",
        "jsonpath={.items[*].metadata.ownerReferences[0].uid}",
    ]);
    assert!(
        !owned.is_empty() && owned.split(' ').all(|u| u == fork_uid),
        "{owned:?}"
    );
    let source_blobs = || {
        let names = [
            "get",
            "configmaps",
            "-n",
            ns,
            "-l",
            "agents-exe.io/session=src",
            "-o",
            "name",
        ];
        kubectl_ok(names)
    };
    assert!(
        !source_blobs().trim().is_empty(),
        "the source spilled its big result too"
    );
    kubectl_ok(["delete", "session", "src", "-n", ns, "--wait=true"]);
    wait_until(
        Duration::from_secs(60),
        "the source's blobs collected",
        || async { source_blobs().trim().is_empty().then_some(()) },
    )
    .await;
    let shown = agents_ok(ns, &["session", "show", "f", "-o", "json"]);
    let v: Value = serde_json::from_str(&shown).unwrap();
    let results = &v["session"]["turns"][2]["toolResults"];
    let big = results[1]["result"]["response"]["content"]["pad"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(big.len(), BIG + 3, "the spilled result, whole: {results}");
}
