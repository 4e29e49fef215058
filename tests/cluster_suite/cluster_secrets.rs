//! A tool's secrets in a cluster: an `http` tool's header `valueFrom` a
//! Secret is read from that Secret in the session's namespace, never from
//! the operator's own environment, and never written to the Session; and
//! only once the Secret is labelled usable by agents (a Secret without the
//! label reads exactly like a missing one).

use crate::support;

use std::sync::{Arc, Mutex};
use support::http::{Response, Server};
use support::launcher::Operator;
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// Records the `X-Api-Token` header of each request.
fn tool_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let server = Server::start(move |req| {
        let token = req.header("x-api-token").unwrap_or("").to_string();
        record.lock().unwrap().push(token);
        Response::new(200, r#"{"ok":true}"#)
    });
    (server.port, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_tool_headers_come_from_the_sessions_secret_not_the_operator_env() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "secrets").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let (port, seen) = tool_server();
    kubectl_ok([
        "create",
        "secret",
        "generic",
        "weather",
        "-n",
        &ns.name,
        "--from-literal=token=from-the-secret-7f3a",
    ]);
    let yaml = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: sec}}
spec:
  messages: ["weather?"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: weather, arguments: {{city: Oslo}}}}]
          - text: sunny
    tools:
      - name: weather
        http:
          url: "http://127.0.0.1:{port}/weather"
          headers:
            - name: X-Api-Token
              valueFrom: {{secretKeyRef: {{name: weather, key: token}}}}
"#
    );
    let op = Operator::start(
        BIN,
        &format!("sec-{}", ns.name),
        &kubeconfig,
        &["-n", &ns.name],
        // The operator's own environment holds a different value: it must
        // never reach the tool.
        &[(
            "AGENTS_SECRET_WEATHER_TOKEN",
            "from-the-operator-env".into(),
        )],
    );
    support::apply(&ns.name, &yaml);
    // Not labelled: not usable, and said so as for a Secret that is not there.
    let not_usable = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=jsonpath={.status.conditions[?(@.type==\"Ready\")].reason}=SecretNotUsable",
        "session/sec",
        "--timeout=60s",
    ]);
    assert!(
        not_usable.status.success(),
        "{}",
        String::from_utf8_lossy(&not_usable.stderr)
    );
    assert!(
        seen.lock().unwrap().is_empty(),
        "an unlabelled Secret was sent"
    );
    kubectl_ok([
        "label",
        "secret",
        "weather",
        "-n",
        &ns.name,
        "agents-exe.io/usable-by-agents=true",
    ]);
    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/sec",
        "--timeout=60s",
    ]);
    let stored = kubectl_ok(["get", "session", "sec", "-n", &ns.name, "-o", "json"]);
    assert!(
        out.status.success(),
        "{}\nsession: {stored}\noperator log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        op.log_text()
    );
    assert_eq!(
        *seen.lock().unwrap(),
        ["from-the-secret-7f3a"],
        "the tool was called once, with the Secret's value\nsession: {stored}\noperator log:\n{}",
        op.log_text()
    );
    assert!(
        !stored.contains("from-the-secret-7f3a"),
        "the secret is never stored"
    );
}
