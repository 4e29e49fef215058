//! Tools whose outcome can be unknown (issue 34, item 1), end to end:
//! a non-idempotent http tool's server records the request and holds its
//! answer; `agents run` is SIGKILLed mid-call; `agents session resume`
//! then never sends it again on its own (`ask`: a person says what came
//! of it, and that reaches the model), or sends it again under the same
//! idempotency key (`retry`, or a person's `run-again`).

use crate::support;

use agents::core::{SessionId, WaitingFor};
use agents::store::sqlite::SqliteStore;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::http::Server;
use support::scratch::*;

fn model_server() -> (Server, Arc<Mutex<Vec<String>>>) {
    support::fake::pay_model_server()
}

/// The payment server: holds its first request while the driver is killed.
fn pay_server() -> Server {
    support::fake::held_payment_server(Duration::from_secs(30))
}

fn definition(model: u16, pay: u16, rule: &str) -> String {
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
      openai: {{baseUrl: "http://127.0.0.1:{model}/v1", model: test}}
    tools:
      - name: pay
        idempotent: false
        onUnknownOutcome: {rule}
        http: {{url: "http://127.0.0.1:{pay}/pay"}}
"#
    )
}

/// `agents run` is SIGKILLed once the payment request has arrived.
fn run_and_kill_mid_call(s: &Scratch, file: &str, pay: &Server) {
    let mut child = s.spawn(&["run", "-f", file]);
    let since = Instant::now();
    while pay.requests().is_empty() {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "no payment request"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

/// The open continuation of the `pay` call, from the store.
fn pay_continuation(s: &Scratch) -> agents::store::ContinuationRecord {
    let store = SqliteStore::open(s.path("agents.db")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let conts = rt
        .block_on(store.session_continuations(&SessionId("shop".into())))
        .unwrap();
    conts
        .into_iter()
        .find(|c| c.spec.tool_call.name == "pay")
        .expect("the pay call has a continuation")
}

fn keys(pay: &Server) -> Vec<String> {
    pay.requests()
        .iter()
        .map(|r| r.header("idempotency-key").unwrap_or("").to_string())
        .collect()
}

#[test]
fn ask_sends_the_payment_once_and_the_persons_answer_reaches_the_model() {
    let (model, tool_messages) = model_server();
    let pay = pay_server();
    let s = Scratch::new("outcome-ask");
    let file = s.write("shop.yaml", &definition(model.port, pay.port, "ask"));
    run_and_kill_mid_call(&s, &file.display().to_string(), &pay);
    let resumed = s.run(&["session", "resume", "shop"]);
    let out = resumed.ok();
    assert!(out.contains("outcome") || out.contains("unknown"), "{out}");
    let cont = pay_continuation(&s);
    assert_eq!(cont.spec.waiting_for, WaitingFor::Outcome);
    let why = cont.spec.reason.clone().unwrap_or_default();
    assert!(
        why.contains("started at about") && why.contains("cli/"),
        "{why}"
    );
    assert_eq!(cont.spec.tool_call.arguments, r#"{"eur":5}"#);
    let token = cont.spec.token.0.clone();
    let pending = s.run(&["session", "pending", "shop"]);
    let listed = pending.ok();
    assert!(
        listed.contains("run-again") && listed.contains("started at about"),
        "{listed}"
    );
    // A person checked the payment provider: it went through.
    let completed = s.run(&["session", "complete", &token, "--text", "paid, receipt 17"]);
    completed.ok();
    let finished = s.run(&["session", "resume", "shop"]);
    assert!(finished.ok().contains("done"), "{}", finished.stdout);
    assert_eq!(pay.requests().len(), 1, "the payment was sent once");
    let seen = tool_messages.lock().unwrap().clone();
    assert!(
        seen.iter().any(|m| m.contains("paid, receipt 17")),
        "the model got the person's answer: {seen:?}"
    );
}

#[test]
fn run_again_and_retry_send_it_again_under_the_same_key() {
    for rule in ["ask", "retry"] {
        let (model, _) = model_server();
        let pay = pay_server();
        let s = Scratch::new(&format!("outcome-{rule}"));
        let file = s.write("shop.yaml", &definition(model.port, pay.port, rule));
        run_and_kill_mid_call(&s, &file.display().to_string(), &pay);
        if rule == "ask" {
            s.run(&["session", "resume", "shop"]).ok();
            assert_eq!(pay.requests().len(), 1, "ask: not sent again on its own");
            let token = pay_continuation(&s).spec.token.0;
            s.run(&["session", "run-again", &token]).ok();
        }
        let finished = s.run(&["session", "resume", "shop"]);
        assert!(
            finished.ok().contains("done"),
            "{rule}: {}",
            finished.stdout
        );
        let keys = keys(&pay);
        assert_eq!(keys.len(), 2, "{rule}: sent twice: {keys:?}");
        assert!(
            !keys[0].is_empty() && keys[0] == keys[1],
            "{rule}: one key: {keys:?}"
        );
    }
}

#[test]
fn on_unknown_outcome_on_an_idempotent_tool_is_refused_saying_why() {
    let s = Scratch::new("outcome-refused");
    let file = s.write(
        "bad.yaml",
        &definition(1, 1, "fail").replace("idempotent: false", "idempotent: true"),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let err = run.fails_with("onUnknownOutcome");
    assert!(
        err.contains("not idempotent") && err.contains("idempotent: false"),
        "{err}"
    );
}
