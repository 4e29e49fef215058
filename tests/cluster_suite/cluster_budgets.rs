//! Budgets under the operator (issue 31): an OpenAI-compatible fake that
//! reports usage drives a session that would loop for ever. `pause` holds
//! it at its tool-call limit (condition Paused, reason BudgetExceeded)
//! with its turns priced in the status; raising `spec.limits.toolCalls`
//! lets exactly the held work go on. `fail` fails it at the token limit.
//! Negative and absurd values are refused at admission.
//!
//! Each test starts its own `agents operator -n NS` child process against
//! its own namespace. Skipped without a cluster unless
//! AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::Session;
use kube::api::Api;
use kube::Client;
use std::sync::atomic::Ordering;
use std::time::Duration;
use support::http::Server;
use support::launcher;
use support::{apply, kubectl, kubectl_ok, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

async fn setup(prefix: &str) -> Option<(Client, TestNamespace)> {
    support::cluster_namespace(prefix).await
}

fn operator(ns: &str, tag: &str) -> launcher::Operator {
    launcher::Operator::watching(BIN, ns, tag)
}

fn session_yaml(model: &Server, limits: &str, price: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: spend}}
spec:
  messages: ["echo for ever"]
  limits: {limits}
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "{model}", model: test}}
      pricing: {{inputPerMTok: {price}, cachedInputPerMTok: 1, outputPerMTok: 10, currency: EUR}}
    tools:
      - {{name: echo, builtin: {{function: echo}}}}
"#,
        model = model.url("/v1"),
    )
}

/// The session's status once `ready` holds for it.
async fn status_when(
    client: &Client,
    ns: &str,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let sessions: Api<Session> = Api::namespaced(client.clone(), ns);
    wait_until(Duration::from_secs(90), what, || async {
        let s = sessions.get("spend").await.ok()?;
        let status = serde_json::to_value(s.status?).ok()?;
        ready(&status).then_some(status)
    })
    .await
}

fn condition<'a>(status: &'a serde_json::Value, type_: &str) -> &'a serde_json::Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&serde_json::Value::Null)
}

fn held_at(status: &serde_json::Value, spent: &str) -> bool {
    let paused = condition(status, "Paused");
    paused["reason"] == "BudgetExceeded"
        && paused["message"]
            .as_str()
            .is_some_and(|m| m.contains(spent))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_at_the_limit_and_a_raise_lets_the_held_work_go_on() {
    let Some((client, ns)) = setup("budget-pause").await else {
        return;
    };
    let (model, calls) = support::fake::usage_model_server();
    let limits = "{toolCalls: 1, onExceed: pause}";
    apply(&ns.name, &session_yaml(&model, limits, "2"));
    let _operator = operator(&ns.name, "budget");
    let status = status_when(&client, &ns.name, "held at 1 tool call", |s| {
        held_at(s, "tool calls limit: spent 1 of 1")
    })
    .await;
    assert_eq!(status["phase"], "Paused", "{status}");
    // Two turns, each 400 x 2 + 200 x 1 + 100 x 10 micro-units.
    assert_eq!(status["usage"]["costMicros"], 4000, "{status}");
    assert_eq!(status["usage"]["cachedPromptTokens"], 400, "{status}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "no model call past the hold"
    );
    wait_until(
        Duration::from_secs(30),
        "a BudgetExceeded Event",
        || async {
            let args = [
                "get",
                "events",
                "-n",
                &ns.name,
                "-o",
                "jsonpath={.items[*].reason}",
            ];
            let reasons = kubectl_ok(args);
            reasons.contains("BudgetExceeded").then_some(())
        },
    )
    .await;

    let raise = r#"{"spec":{"limits":{"toolCalls":2}}}"#;
    kubectl_ok([
        "patch",
        "session",
        "spend",
        "-n",
        &ns.name,
        "--type=merge",
        "-p",
        raise,
    ]);
    status_when(&client, &ns.name, "held again at 2 tool calls", |s| {
        held_at(s, "tool calls limit: spent 2 of 2")
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 3, "one more turn, no more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_names_the_token_limit_and_the_spend() {
    let Some((client, ns)) = setup("budget-fail").await else {
        return;
    };
    let (model, calls) = support::fake::usage_model_server();
    apply(&ns.name, &session_yaml(&model, "{tokens: 1000}", "2"));
    let _operator = operator(&ns.name, "budget");
    let status = status_when(&client, &ns.name, "failed", |s| s["phase"] == "Failed").await;
    let failure = status["failure"].as_str().unwrap_or_default();
    assert!(
        failure.contains("tokens limit: spent 1400 of 1000 (onExceed: fail)"),
        "{status}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn negative_and_absurd_values_are_refused_at_admission() {
    let Some((_client, ns)) = setup("budget-admission").await else {
        return;
    };
    let model = Server::start(|_| support::http::Response::close());
    for (limits, price, field) in [
        ("{tokens: -5}", "2", "spec.limits.tokens"),
        ("{cost: -1}", "2", "spec.limits.cost"),
        ("{toolCalls: 5000000}", "2", "spec.limits.toolCalls"),
        (
            "{tokens: 10}",
            "20000",
            "spec.agent.model.pricing.inputPerMTok",
        ),
    ] {
        let file = support::scratch::Scratch::new("budget-admission");
        let path = file.write("s.yaml", &session_yaml(&model, limits, price));
        let out = kubectl(["apply", "-n", &ns.name, "-f", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(field),
            "{limits} {price}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_limit_without_pricing_is_not_ready_saying_why() {
    let Some((client, ns)) = setup("budget-unpriced").await else {
        return;
    };
    let (model, calls) = support::fake::usage_model_server();
    let unpriced = session_yaml(&model, "{cost: 1}", "2")
        .lines()
        .filter(|l| !l.contains("pricing:"))
        .collect::<Vec<_>>()
        .join("\n");
    apply(&ns.name, &unpriced);
    let _operator = operator(&ns.name, "budget");
    let status = status_when(&client, &ns.name, "Ready False", |s| {
        condition(s, "Ready")["status"] == "False"
    })
    .await;
    let message = condition(&status, "Ready")["message"].to_string();
    assert!(
        message.contains("spec.limits.cost") && message.contains("spec.model.pricing"),
        "{status}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no model call");
}
