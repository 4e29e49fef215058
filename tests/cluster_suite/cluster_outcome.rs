//! Tools whose outcome can be unknown (issue 34, item 1) under the
//! operator: a non-idempotent http tool's server records the request and
//! holds its answer; the operator is SIGKILLed mid-call and started
//! again. With `ask` the payment is sent once and a person's answer
//! (`agents session complete`) reaches the model; with `retry` it is sent
//! again under the same idempotency key.
//!
//! Each test starts its own `agents operator -n NS` child process against
//! its own namespace. Skipped without a cluster unless
//! AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::Continuation;
use kube::api::{Api, ListParams};
use kube::Client;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::Server;
use support::launcher;
use support::{apply, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

async fn setup(prefix: &str) -> Option<(Client, TestNamespace)> {
    support::cluster_namespace(prefix).await
}

fn operator(ns: &str, tag: &str) -> launcher::Operator {
    launcher::Operator::watching(BIN, ns, tag)
}

fn model_server() -> (Server, Arc<Mutex<Vec<String>>>) {
    support::fake::pay_model_server()
}

/// The payment server: holds its first request while the driver is killed.
fn pay_server() -> Server {
    support::fake::held_payment_server(Duration::from_secs(60))
}

fn session_yaml(model: &Server, pay: &Server, rule: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: shop}}
spec:
  messages: ["pay five euros"]
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "{model}", model: test}}
    tools:
      - name: pay
        idempotent: false
        onUnknownOutcome: {rule}
        http: {{url: "{pay}"}}
"#,
        model = model.url("/v1"),
        pay = pay.url("/pay"),
    )
}

/// The operator is SIGKILLed once the payment request arrived; a second
/// one takes over.
async fn kill_mid_call(ns: &str, pay: &Server) -> launcher::Operator {
    let mut first = operator(ns, "outcome-first");
    wait_until(Duration::from_secs(60), "the payment request", || async {
        (!pay.requests().is_empty()).then_some(())
    })
    .await;
    first.kill();
    operator(ns, "outcome-second")
}

fn keys(pay: &Server) -> Vec<String> {
    pay.requests()
        .iter()
        .map(|r| r.header("idempotency-key").unwrap_or("").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_sends_the_payment_once_and_the_persons_answer_reaches_the_model() {
    let Some((client, ns)) = setup("outcome-ask").await else {
        return;
    };
    let (model, tool_messages) = model_server();
    let pay = pay_server();
    apply(&ns.name, &session_yaml(&model, &pay, "ask"));
    let _second = kill_mid_call(&ns.name, &pay).await;
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let waiting = wait_until(
        Duration::from_secs(60),
        "a continuation waiting for the outcome",
        || async {
            let list = conts.list(&ListParams::default()).await.ok()?;
            list.items.into_iter().find(|c| {
                let st = serde_json::to_value(&c.status).unwrap_or_default();
                st["waitingFor"] == "outcome"
            })
        },
    )
    .await;
    let status = serde_json::to_value(&waiting.status).unwrap();
    let why = status["reason"].as_str().unwrap_or_default();
    assert!(
        why.contains("started at about") && why.contains("operator/"),
        "{why}"
    );
    assert_eq!(waiting.spec.tool_call.arguments, r#"{"eur":5}"#);
    let token = waiting.metadata.name.clone().unwrap();
    let kubeconfig = support::kubeconfig_path().unwrap();
    let done = Command::new(BIN)
        .args(["session", "complete", &token, "--text", "paid, receipt 17"])
        .args(["--store", "kube", "-n", &ns.name])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("AGENTS_STORE")
        .env_remove("AGENTS_NAMESPACE")
        .output()
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    wait_succeeded(&ns.name);
    assert_eq!(pay.requests().len(), 1, "the payment was sent once");
    let seen = tool_messages.lock().unwrap().clone();
    assert!(
        seen.iter().any(|m| m.contains("paid, receipt 17")),
        "the model got the person's answer: {seen:?}"
    );
    ns.delete(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_sends_it_again_under_the_same_key() {
    let Some((client, ns)) = setup("outcome-retry").await else {
        return;
    };
    let (model, _) = model_server();
    let pay = pay_server();
    apply(&ns.name, &session_yaml(&model, &pay, "retry"));
    let _second = kill_mid_call(&ns.name, &pay).await;
    wait_succeeded(&ns.name);
    let keys = keys(&pay);
    assert_eq!(keys.len(), 2, "sent again after the crash: {keys:?}");
    assert!(
        !keys[0].is_empty() && keys[0] == keys[1],
        "one key: {keys:?}"
    );
    ns.delete(&client).await;
}

fn wait_succeeded(ns: &str) {
    support::wait_session_condition(ns, "shop", "Succeeded", 90);
}
