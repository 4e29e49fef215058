//! A hostile tenant on a shared operator (issue 18): results written wrong
//! on purpose fail only their call, and the session carries on.
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

mod support;

use agents::api::{Continuation, Session};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use std::time::Duration;
use support::{kubectl_ok, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn apply(ns: &str, yaml: &str) {
    let path = std::env::temp_dir().join(format!("agents-tenant-{ns}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    kubectl_ok(["apply", "-n", ns, "-f", path.to_str().unwrap()]);
}

const THREE_ASKS: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: asks}
spec:
  messages: ["ask three people"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {name: ask, arguments: {who: a}}
              - {name: ask, arguments: {who: b}}
              - {name: ask, arguments: {who: c}}
          - text: heard from all three
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      rules:
        - {tool: ask, disposition: defer}
"#;

fn outcome(result: Value) -> Value {
    json!({"status": {"state": "Completed", "outcome": {
        "result": result,
        "completedBy": "mallory",
        "completedAt": "2025-01-01T00:00:00Z",
    }}})
}

/// Three deferred calls completed badly: a made-up spill marker listing
/// hundreds of blobs, a response that is no tool response, and a 1 MiB
/// error message. Each call fails with an error saying what was wrong;
/// the session succeeds and stays small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_results_fail_only_their_call() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-bad").await;
    apply(&ns.name, THREE_ASKS);
    let _op = support::launcher::Operator::start(
        BIN,
        "tenant-bad",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    wait_until(Duration::from_secs(60), "three waiting calls", || async {
        let list = conts.list(&Default::default()).await.ok()?;
        (list.items.len() == 3).then_some(())
    })
    .await;
    let blobs: Vec<String> = (0..500).map(|i| format!("asks-r-{i:016}")).collect();
    let forged = json!({"status": "success", "response": {"spilled": {
        "blobs": blobs, "sha256": "0".repeat(64)}}});
    let bogus = json!({"status": "success", "response": {"type": "hologram"}});
    let huge = json!({"status": "error", "message": "x".repeat(1 << 20)});
    let pp = PatchParams::default();
    for (token, result) in [
        ("asks-t1-c0", forged),
        ("asks-t1-c1", bogus),
        ("asks-t1-c2", huge),
    ] {
        conts
            .patch_status(token, &pp, &Patch::Merge(&outcome(result)))
            .await
            .unwrap_or_else(|e| panic!("{token}: {e}"));
    }
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let done = wait_until(
        Duration::from_secs(90),
        "the session to succeed",
        || async {
            let s = sessions.get("asks").await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Succeeded").then_some(st)
        },
    )
    .await;
    let results = &done["turns"][2]["toolResults"];
    let message = |i: usize| {
        results[i]["result"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    assert!(
        message(0).starts_with("the result written by mallory was malformed")
            && message(0).contains("lists 500 blobs"),
        "{}",
        message(0)
    );
    assert!(
        message(1).starts_with("the result written by mallory was malformed"),
        "{}",
        message(1)
    );
    assert!(message(2).len() < 9 * 1024, "{} bytes", message(2).len());
    assert!(
        message(2).contains("[truncated: showing 8192 of"),
        "{}",
        &message(2)[8000..]
    );
    assert_eq!(done["answer"], "heard from all three");
    ns.delete(&client).await;
}

/// `pause`, `resume` and `retry` edit the spec only over the version they
/// read: a stale edit is refused as a conflict, and the admin port re-reads
/// and keeps what changed meanwhile.
#[tokio::test]
async fn spec_edits_carry_the_version_they_read() {
    use agents::core::SessionId;
    use agents::ports::{AdminPort, StoreError, Version};
    use agents::store::kube::KubeStore;
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-edit").await;
    apply(&ns.name, THREE_ASKS);
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let read = sessions.get("asks").await.unwrap();
    let stale = Version(read.metadata.resource_version.clone().unwrap());
    // Someone else edits the spec after our read.
    sessions
        .patch(
            "asks",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"messages": ["ask three people", "and hurry"]}})),
        )
        .await
        .unwrap();
    let store = KubeStore::new(client.clone(), &ns.name);
    let id = SessionId("asks".into());
    let refused = store
        .patch_spec(&id, &stale, json!({"paused": true}))
        .await
        .unwrap_err();
    assert!(matches!(refused, StoreError::Conflict { .. }), "{refused}");
    store.change_input(&id, &|i| i.paused = true).await.unwrap();
    let now = sessions.get("asks").await.unwrap();
    assert!(now.spec.paused);
    assert_eq!(now.spec.messages.len(), 2, "the other edit is kept");
    ns.delete(&client).await;
}
