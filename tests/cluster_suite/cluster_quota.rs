//! A namespace's ResourceQuota that refuses the operator's own writes
//! (issue 34, item 2): a Continuation refused by `count/continuations`, a
//! result's blob ConfigMap refused by `configmaps`. Each is a wait with a
//! `QuotaExceeded` Event, never a counted failure: the sessions wait longer
//! than eight failures in a row would take to fail them, and finish with
//! the right results once the quotas are raised. Skipped without a cluster
//! unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use serde_json::Value;
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use support::{apply, kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// What eight failed steps in a row take before the session fails: the
/// operator's backoff between them (250 ms doubling from the first) sums
/// to 63.5 s; the sessions here wait longer than that.
const EIGHT_FAILURES: Duration = Duration::from_millis(63_500);

const AGENT: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: asks}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{name: ask_person, arguments: {question: "?"}}]
        - text: the person answered
  tools: [{name: ask_person, builtin: {function: echo}}]
  policy:
    default: runSync
    rules: [{tool: ask_person, disposition: defer, reason: a person answers}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: held}
spec:
  agentRef: {name: asks}
  messages: ["ask a person"]
"#;

/// The deferred call's token (session `held`, turn 1, call 0).
const TOKEN: &str = "held-t1-c0";

fn session_json(ns: &str) -> Value {
    serde_json::from_str(&kubectl_ok([
        "get", "session", "held", "-n", ns, "-o", "json",
    ]))
    .unwrap()
}

/// The notes of the session's `QuotaExceeded` Events.
fn quota_events(ns: &str) -> String {
    kubectl_ok([
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        "reason=QuotaExceeded,involvedObject.name=held",
        "-o",
        "jsonpath={.items[*].note}{.items[*].message}",
    ])
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn agents(ns: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", support::kubeconfig_path().unwrap())
        .output()
        .unwrap()
}

fn agents_ok(ns: &str, args: &[&str]) -> String {
    let out = agents(ns, args);
    assert!(
        out.status.success(),
        "agents {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The session waits on the quota: not failed, no failed step counted,
/// and a QuotaExceeded Event names what was refused.
fn assert_waiting_on_quota(ns: &str, refused: &str) {
    let s = session_json(ns);
    let status = &s["status"];
    assert_ne!(status["phase"], "Failed", "{status}");
    assert_eq!(
        status["state"]["failedSteps"].as_u64().unwrap_or(0),
        0,
        "a quota's refusal is no failed step: {status}"
    );
    let said = quota_events(ns);
    assert!(
        said.contains("waits for room in the namespace's ResourceQuota")
            && said.contains(refused)
            && said.contains("exceeded quota"),
        "a QuotaExceeded Event says what waits: {said:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_on_continuations_or_blobs_is_a_wait_not_a_failure() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    // `held` in `cont` cannot create its Continuation; in `blob` it can,
    // but the person's large result cannot spill into a ConfigMap (the
    // namespace's kube-root-ca.crt already exceeds a quota of none).
    let cont = TestNamespace::create(&client, "quota-cont").await;
    let blob = TestNamespace::create(&client, "quota-blob").await;
    let quota = |ns: &str, resource: &str, n: u32| {
        apply(
            ns,
            &format!(
                "apiVersion: v1\nkind: ResourceQuota\nmetadata: {{name: held}}\nspec: {{hard: {{{resource}: \"{n}\"}}}}\n"
            ),
        );
    };
    quota(&cont.name, "count/continuations.agents-exe.io", 0);
    quota(&blob.name, "configmaps", 0);
    // A new quota refuses creates ("status unknown") until its usage is
    // counted: let that pass first.
    std::thread::sleep(Duration::from_secs(2));
    apply(&cont.name, AGENT);
    apply(&blob.name, AGENT);
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _op = support::launcher::Operator::start(
        BIN,
        "quota",
        &kubeconfig,
        &["-n", &cont.name, "-n", &blob.name],
        &[],
    );

    wait_for(
        "the Continuation's quota wait",
        Duration::from_secs(60),
        || quota_events(&cont.name).contains("exceeded quota"),
    );
    let cont_held = Instant::now();
    wait_for("the deferred call", Duration::from_secs(60), || {
        kubectl(["get", "continuation", TOKEN, "-n", &blob.name])
            .status
            .success()
    });
    // Over the Continuation's 256 KiB inline limit it is not; over the
    // session's 16 KiB it is: taking it in must spill into a ConfigMap.
    let large = format!("answer-{}-end", "0123456789abcdef".repeat(3 * 1024));
    agents_ok(
        &blob.name,
        &["session", "complete", TOKEN, "--text", &large],
    );
    wait_for("the blob's quota wait", Duration::from_secs(60), || {
        quota_events(&blob.name).contains("exceeded quota")
    });
    let blob_held = Instant::now();

    // Held longer than eight failures in a row would take to fail them.
    let longest = cont_held.min(blob_held);
    let shortest = cont_held.max(blob_held);
    while shortest.elapsed() < EIGHT_FAILURES + Duration::from_secs(6) {
        assert_waiting_on_quota(&cont.name, "Continuation");
        assert_waiting_on_quota(&blob.name, "ConfigMap");
        std::thread::sleep(Duration::from_secs(5));
    }
    eprintln!(
        "held by the quotas for {:?} and {:?}",
        longest.elapsed(),
        shortest.elapsed()
    );
    assert_waiting_on_quota(&cont.name, "Continuation");
    assert_waiting_on_quota(&blob.name, "ConfigMap");
    assert!(
        !kubectl(["get", "continuation", TOKEN, "-n", &cont.name])
            .status
            .success(),
        "no Continuation passed the quota"
    );

    // Room again: both carry on, nothing lost.
    quota(&cont.name, "count/continuations.agents-exe.io", 10);
    quota(&blob.name, "configmaps", 10);
    wait_for(
        "the Continuation, once room",
        Duration::from_secs(60),
        || {
            kubectl(["get", "continuation", TOKEN, "-n", &cont.name])
                .status
                .success()
        },
    );
    agents_ok(
        &cont.name,
        &["session", "complete", TOKEN, "--text", "a small answer"],
    );
    for (ns, answer) in [(&cont.name, "a small answer"), (&blob.name, large.as_str())] {
        let out = kubectl([
            "wait",
            "-n",
            ns,
            "--for=condition=Succeeded",
            "session/held",
            "--timeout=60s",
        ]);
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            session_json(ns)["status"]
        );
        let s = session_json(ns);
        assert_eq!(s["status"]["state"]["failedSteps"].as_u64().unwrap_or(0), 0);
        let shown: Value =
            serde_json::from_str(&agents_ok(ns, &["session", "show", "held", "-o", "json"]))
                .unwrap();
        let turns = shown["session"]["turns"].to_string();
        assert!(
            turns.contains(answer) && turns.contains("the person answered"),
            "the person's result reached the model, whole: {}",
            &turns[..turns.len().min(2000)]
        );
    }
    cont.delete(&client).await;
    blob.delete(&client).await;
}
