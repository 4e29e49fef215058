//! API writes per tool call, counted by the API server itself
//! (`apiserver_request_total` by verb and resource), around one run of the
//! requested flow under the operator: a runSync call, a runAsync call and a
//! deferred call completed with the CLI.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::fake::World;
use support::launcher::Operator;
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn operator(ns: &str, kubeconfig: &Path, n: usize) -> Operator {
    Operator::start(BIN, &format!("{ns}-{n}"), kubeconfig, &["-n", ns], &[])
}

/// Counts requests per Idempotency-Key; `later` answers after a short
/// delay so kills land while tools run.
fn tool_server() -> (u16, World) {
    let world = World::new(2, Duration::from_millis(150));
    (world.listen("direct"), world)
}

fn manifests(port: u16) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: counted}}
spec:
  messages: ["three calls"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: now, arguments: {{n: 1}}}}
              - {{name: later, arguments: {{n: 2}}}}
              - {{name: ask, arguments: {{n: 3}}}}
          - text: all three in
    tools:
      - {{name: now, http: {{url: "http://127.0.0.1:{port}/now"}}}}
      - {{name: later, http: {{url: "http://127.0.0.1:{port}/later"}}}}
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
      default: runSync
      rules:
        - {{tool: later, disposition: runAsync}}
        - {{tool: ask, disposition: defer, reason: a person answers}}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_writes_per_call_of_the_requested_flow() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "writes").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let (port, keys) = tool_server();
    let op = operator(&ns.name, &kubeconfig, 0);
    let before = support::api_writes();
    support::apply(&ns.name, &manifests(port));
    let mut waiting = false;
    for _ in 0..120 {
        let phase = kubectl_ok([
            "get",
            "session",
            "counted",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.status.phase}",
        ]);
        if phase == "Waiting" {
            waiting = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(waiting, "the session yields on the deferred call");
    let done = Command::new(BIN)
        .args(["session", "complete", "counted-t1-c2", "--text", "42"])
        .args(["--store", "kube", "-n", &ns.name])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/counted",
        "--timeout=60s",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Let the last status write settle before reading the counters.
    std::thread::sleep(Duration::from_secs(1));
    let after = support::api_writes();
    // The operator's own view: /metrics, /healthz, /readyz on its address.
    assert_eq!(op.probe("/healthz").0, 200);
    assert_eq!(op.probe("/readyz").0, 200);
    let metrics = op.probe("/metrics").1;
    let value = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    eprintln!(
        "operator metrics: wake latency count {}, sum {:.3} s; reconciles {}",
        value("agents_wake_latency_seconds_count"),
        value("agents_wake_latency_seconds_sum"),
        value("agents_reconciles_total")
    );
    assert!(
        value("agents_wake_latency_seconds_count") >= 1.0,
        "{metrics}"
    );
    assert!(
        value("agents_tool_calls_total{disposition=\"runSync\",outcome=\"completed\"}") >= 1.0,
        "{metrics}"
    );
    assert!(
        value("agents_model_calls_total{outcome=\"ok\"}") >= 2.0,
        "{metrics}"
    );
    // The phase gauge is set from the watch's cache every few seconds.
    let mut succeeded = 0.0;
    for _ in 0..30 {
        let metrics = op.probe("/metrics").1;
        succeeded = metrics
            .lines()
            .filter(|l| l.starts_with("agents_sessions{phase=\"Succeeded\"}"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if succeeded >= 1.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        succeeded, 1.0,
        "agents_sessions counts the finished session"
    );
    drop(op);
    assert_eq!(keys.keys_seen().len(), 2, "both http calls ran");
    let delta: BTreeMap<_, _> = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    let of = |verb: &str, res: &str| {
        delta
            .get(&(verb.to_string(), res.to_string()))
            .copied()
            .unwrap_or(0)
    };
    // Status writes are PUTs (a merge patch where the store held no copy
    // at the expected version); the finalizer and settle are patches.
    let session_writes = of("PATCH", "sessions") + of("PUT", "sessions");
    let continuation_writes = of("POST", "continuations") + of("PATCH", "continuations");
    eprintln!(
        "API writes for the flow (1 runSync, 1 runAsync, 1 defer; 2 model turns): {delta:?}; \
         session status writes: {session_writes}, continuation writes: {continuation_writes} \
         ({:.1} per deferred call, the CLI's completion included)",
        continuation_writes as f64 / 2.0
    );
    // kubectl apply's own POST of the Session is the user's write.
    assert_eq!(of("POST", "sessions"), 1);
    // Two deferred calls: create, wait fields, result each.
    assert!(continuation_writes <= 6, "{delta:?}");
    // Steps: claim+turn, results, the second model turn, the answer.
    assert!(session_writes <= 8, "{delta:?}");
}
