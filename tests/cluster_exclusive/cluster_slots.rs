//! Reconcile slots shared by every namespace. An operator that serves
//! them all (no `-n`, the chart's default) steps sessions in one pool of
//! reconciles; a step runs the model and `runSync` tools, so one
//! namespace's slow calls could hold every slot. `--max-reconciles-per-
//! namespace` caps what one namespace holds.
//!
//! It lives in `cluster_exclusive`: its operator serves every namespace,
//! so beside other tests it would step their sessions too, under its own
//! URL allow-list (it once failed `cluster_secrets` that way).

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::http::{Response, Server};
use support::launcher::Operator;
use support::{apply, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// A step runs `runSync` tools inside its reconcile, so a tool that hangs
/// holds a reconcile slot until its timeout. With 4 slots and at most 2
/// per namespace, six sessions whose tool hangs hold 2 of them, and another
/// namespace's sessions all finish meanwhile. Without the cap they would
/// wait for the hanging calls' 60 s timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_whose_tools_hang_leaves_reconcile_slots_to_the_others() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let stuck = TestNamespace::create(&client, "tenant-hangs").await;
    let others = TestNamespace::create(&client, "tenant-goes-on").await;
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    let server = Server::start(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
        Response::hang()
    });
    let hangs = support::fake::sessions("hangs", "h", 6);
    apply(
        &stuck.name,
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: hangs}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{{name: wait, arguments: {{}}}}]
        - text: never
  tools:
    - name: wait
      http: {{url: "http://127.0.0.1:{port}/wait"}}
  policy:
    defaultDecorators: {{timeoutSeconds: 60}}
{hangs}"#,
            port = server.port
        ),
    );
    let quick = support::fake::builtin_flow_agent("done");
    let sessions = support::fake::sessions("flow", "q", 5);
    let allowed = format!(
        "--http-tool-allowed-urls=http://127.0.0.1:{}/*",
        server.port
    );
    let op = Operator::start(
        BIN,
        &format!("tenant-slots-{}", stuck.name),
        &support::kubeconfig_path().unwrap(),
        &[
            "--max-concurrent-reconciles=4",
            "--max-reconciles-per-namespace=2",
            &allowed,
        ],
        &[],
    );
    // The hanging calls take their slots first.
    wait_until(Duration::from_secs(30), "two calls hang", || {
        let n = asked.load(Ordering::SeqCst);
        async move { (n >= 2).then_some(()) }
    })
    .await;
    let started = std::time::Instant::now();
    apply(&others.name, &format!("{quick}{sessions}"));
    for i in 0..5 {
        support::kubectl_ok([
            "wait",
            "-n",
            &others.name,
            &format!("session/q{i}"),
            "--for=condition=Succeeded",
            "--timeout=40s",
        ]);
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(40),
        "the other namespace took {took:?}"
    );
    assert_eq!(
        asked.load(Ordering::SeqCst),
        2,
        "the hanging namespace held no more than its 2 slots"
    );
    let (_, metrics) = op.probe("/metrics");
    assert!(
        metrics.contains("agents_namespace_at_cap_total"),
        "the put-off reconciles are counted"
    );
    drop(op);
    stuck.delete(&client).await;
    others.delete(&client).await;
}
