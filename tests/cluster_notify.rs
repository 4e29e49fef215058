//! Notifications of waits for a person (issue 19): an approval and a
//! `defer` call are each POSTed once to the agent's `notify.webhook`, with
//! a header from an opted-in Secret, and never again after the operator is
//! SIGKILLed and restarted (the marker in the Continuation's status); a
//! webhook that answers 500 is retried up to the cap, then the marker says
//! `Failed`. Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

mod support;

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const SECRET_VALUE: &str = "hook-s3cret-0a9f";

/// One request the receiver got.
#[derive(Clone, Debug)]
struct Received {
    headers: Vec<(String, String)>,
    body: Value,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A loopback HTTP server that records every request and answers with
/// `status`.
struct Receiver {
    port: u16,
    got: Arc<Mutex<Vec<Received>>>,
    status: Arc<AtomicU16>,
}

impl Receiver {
    fn start(status: u16) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let got = Arc::new(Mutex::new(Vec::new()));
        let status = Arc::new(AtomicU16::new(status));
        let (g, s) = (got.clone(), status.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let mut headers = Vec::new();
                let mut length = 0usize;
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = h.trim_end().split_once(':') {
                        let (k, v) = (k.trim().to_string(), v.trim().to_string());
                        if k.eq_ignore_ascii_case("content-length") {
                            length = v.parse().unwrap_or(0);
                        }
                        headers.push((k, v));
                    }
                }
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
                g.lock().unwrap().push(Received { headers, body });
                let code = s.load(Ordering::SeqCst);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {code} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                );
            }
        });
        Receiver { port, got, status }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    fn requests(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
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

fn apply(ns: &str, name: &str, yaml: &str) {
    let file = std::env::temp_dir().join(format!("agents-{ns}-{name}.yaml"));
    std::fs::write(&file, yaml).unwrap();
    kubectl_ok(["apply", "-n", ns, "-f", file.to_str().unwrap()]);
    let _ = std::fs::remove_file(&file);
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
    apply(
        &ns.name,
        "waits",
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
    let sent = events(&ns.name, "NotificationSent");
    assert!(sent.contains(deploy) && sent.contains(ask), "{sent}");
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
    apply(
        &ns.name,
        "failing",
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
    let failed = events(&ns.name, "NotificationFailed");
    assert!(failed.contains(token), "{failed}");
    assert!(!failed.contains(SECRET_VALUE));
    hook.status.store(200, Ordering::SeqCst);
    drop(op);
    ns.delete(&client).await;
}
