//! Notifications of waits for a person (issue 19): an approval and a
//! `defer` call are each POSTed once to the agent's `notify.webhook`, with
//! a header from an opted-in Secret, and never again after the operator is
//! SIGKILLed and restarted (the marker in the Continuation's status); a
//! webhook that answers 500 is retried up to the cap, then the marker says
//! `Failed`. Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use serde_json::Value;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::http::{Request, Response, Server};
use support::{kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const SECRET_VALUE: &str = "hook-s3cret-0a9f";

/// One request the receiver got, its body as JSON.
#[derive(Clone, Debug)]
struct Received {
    request: Request,
    body: Value,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.request.header(name)
    }
}

/// A loopback HTTP server that records every request and answers with
/// `status`.
struct Receiver {
    server: Server,
    status: Arc<AtomicU16>,
}

impl Receiver {
    fn start(status: u16) -> Receiver {
        let status = Arc::new(AtomicU16::new(status));
        let s = status.clone();
        let server = Server::start(move |_| Response::new(s.load(Ordering::SeqCst), "ok"));
        Receiver { server, status }
    }

    fn url(&self) -> String {
        self.server.url("/hook")
    }

    fn requests(&self) -> Vec<Received> {
        self.server
            .requests()
            .into_iter()
            .map(|request| Received {
                body: request.json(),
                request,
            })
            .collect()
    }
}

fn session(name: &str, url: &str, calls: &str, rules: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["ship it"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
{calls}
          - text: done
    tools:
      - {{name: deploy, builtin: {{function: echo}}}}
      - {{name: ask, builtin: {{function: echo}}}}
    notify:
      webhook:
        url: {url}
        headers:
          - name: X-Hook-Token
            valueFrom: {{secretKeyRef: {{name: hook, key: token}}}}
    policy:
      rules:
{rules}
"#
    )
}

fn labelled_secret(ns: &str) {
    kubectl_ok([
        "create",
        "secret",
        "generic",
        "hook",
        "-n",
        ns,
        &format!("--from-literal=token={SECRET_VALUE}"),
    ]);
    kubectl_ok([
        "label",
        "secret",
        "hook",
        "-n",
        ns,
        "agents-exe.io/usable-by-agents=true",
    ]);
}

fn continuation(ns: &str, token: &str) -> Value {
    let out = support::kubectl(["get", "continuation", token, "-n", ns, "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

fn marker(ns: &str, token: &str) -> Value {
    continuation(ns, token)["status"]["notified"].clone()
}

fn events(ns: &str, reason: &str) -> String {
    kubectl_ok([
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        &format!("reason={reason}"),
        "-o",
        "json",
    ])
}

fn wait_for(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    for _ in 0..secs * 4 {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_wait_is_notified_once_across_a_restart() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "notify").await;
    let hook = Receiver::start(200);
    labelled_secret(&ns.name);
    support::apply(
        &ns.name,
        &session(
            "waits",
            &hook.url(),
            "              - {name: deploy, arguments: {to: prod}}\n              - {name: ask, arguments: {q: colour}}",
            "        - {tool: deploy, disposition: runSync, approval: true}\n        - {tool: ask, disposition: defer, reason: a person answers}",
        ),
    );
    let kubeconfig = support::kubeconfig_path().unwrap();
    let op =
        support::launcher::Operator::start(BIN, "notify-once", &kubeconfig, &["-n", &ns.name], &[]);
    let (deploy, ask) = ("waits-t1-c0", "waits-t1-c1");
    wait_for("both waits notified and marked", 60, || {
        hook.requests().len() >= 2
            && marker(&ns.name, deploy)["state"] == "Sent"
            && marker(&ns.name, ask)["state"] == "Sent"
    });
    let log = op.log_text();
    // SIGKILL, and a new operator: it steps the session again, and must
    // not announce either wait again.
    drop(op);
    let op = support::launcher::Operator::start(
        BIN,
        "notify-once-2",
        &kubeconfig,
        &["-n", &ns.name],
        &[],
    );
    wait_for("the restarted operator to step the session", 60, || {
        op.log_text().contains("waits")
    });
    std::thread::sleep(Duration::from_secs(5));
    let got = hook.requests();
    assert_eq!(got.len(), 2, "one POST per wait: {got:?}");
    let by_token = |t: &str| {
        got.iter()
            .find(|r| r.body["token"] == t)
            .unwrap_or_else(|| panic!("no notification of {t}: {got:?}"))
            .clone()
    };
    let (d, a) = (by_token(deploy), by_token(ask));
    assert_eq!(d.body["waitingFor"], "approval");
    assert_eq!(d.body["tool"], "deploy");
    assert_eq!(d.body["session"], "waits");
    assert_eq!(d.body["namespace"], ns.name.as_str());
    assert_eq!(d.body["arguments"], r#"{"to":"prod"}"#);
    assert_eq!(
        d.body["link"],
        format!(
            "agents session approve {deploy} --store kube -n {}",
            ns.name
        )
        .as_str()
    );
    assert!(d.body["text"]
        .as_str()
        .unwrap()
        .contains("waits for approval"));
    assert_eq!(a.body["waitingFor"], "external");
    assert_eq!(a.body["reason"], "a person answers");
    assert_eq!(a.body["tool"], "ask");
    for r in [&d, &a] {
        assert_eq!(r.header("x-hook-token"), Some(SECRET_VALUE));
        assert!(r
            .header("content-type")
            .is_some_and(|c| c.contains("application/json")));
    }
    let m = marker(&ns.name, deploy);
    assert_eq!(m["attempts"], 1, "{m}");
    assert_eq!(m["waitingFor"], "approval", "{m}");
    assert!(m["at"].is_string(), "{m}");
    let mut sent = String::new();
    wait_for("both NotificationSent Events", 10, || {
        sent = events(&ns.name, "NotificationSent");
        sent.contains(deploy) && sent.contains(ask)
    });
    // The secret is nowhere but in the POSTs.
    for text in [
        continuation(&ns.name, deploy).to_string(),
        continuation(&ns.name, ask).to_string(),
        sent,
        log,
        op.log_text(),
    ] {
        assert!(!text.contains(SECRET_VALUE), "the secret leaked: {text}");
    }
    drop(op);
    ns.delete(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_webhook_is_retried_up_to_the_cap_then_given_up() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "notify-fail").await;
    let hook = Receiver::start(500);
    labelled_secret(&ns.name);
    support::apply(
        &ns.name,
        &session(
            "failing",
            &hook.url(),
            "              - {name: deploy, arguments: {to: prod}}",
            "        - {tool: deploy, disposition: runSync, approval: true}",
        ),
    );
    let op = support::launcher::Operator::start(
        BIN,
        "notify-fail",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let token = "failing-t1-c0";
    wait_for("the notification given up", 90, || {
        marker(&ns.name, token)["state"] == "Failed"
    });
    let m = marker(&ns.name, token);
    assert_eq!(m["attempts"], 5, "{m}");
    assert!(m["at"].is_null(), "{m}");
    assert!(
        m["error"].as_str().unwrap_or("").contains("500"),
        "the marker says why: {m}"
    );
    assert!(
        !m.to_string().contains("/hook"),
        "no URL path in the marker: {m}"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(hook.requests().len(), 5, "five attempts, no more");
    let mut failed = String::new();
    wait_for("the NotificationFailed Event", 10, || {
        failed = events(&ns.name, "NotificationFailed");
        failed.contains(token)
    });
    assert!(!failed.contains(SECRET_VALUE));
    hook.status.store(200, Ordering::SeqCst);
    drop(op);
    ns.delete(&client).await;
}
