//! Sessions at scale in etcd (issue 17): the operator drives batches of
//! sessions of the requested flow's shape (two model turns; a runSync and
//! a runAsync call) on the test cluster and prints, per size, sessions a
//! second, API writes per session, and the RSS of the operator and of
//! kube-apiserver, measured in this one run. Ignored by default (minutes):
//!
//!     AGENTS_SCALE_SESSIONS=200,1000 cargo test --test cluster_scale -- --ignored --nocapture
//!
//! The operator keeps only what reconcile reads of each Session, so its
//! memory per session is asserted to stay well below what a full copy of
//! each object cost (55 KB a session before). What remains per session
//! includes kube-runtime's Event recorder cache, which keeps each Event for
//! minutes (bounded by the event rate, not by the sessions ever created).

mod support;

use std::time::{Duration, Instant};
use support::{kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn sessions_yaml(from: usize, to: usize) -> String {
    (from..to)
        .map(|i| {
            format!(
                r#"---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: s{i:05}}}
spec:
  messages: ["fetch two things, please, session {i}"]
  agentRef: {{name: flow}}
"#
            )
        })
        .collect()
}

const AGENT: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: flow}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {name: now, arguments: {what: "the first thing"}}
            - {name: later, arguments: {what: "the second thing"}}
        - text: both things are here, and this answer is about as long as a real one tends to be
  tools:
    - {name: now, builtin: {function: echo}}
    - {name: later, builtin: {function: echo}}
  policy:
    default: runSync
    rules:
      - {tool: later, disposition: runAsync}
"#;

fn apply(ns: &str, yaml: &str) {
    support::apply_with(ns, yaml, &["--server-side"]);
}

fn rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn apiserver_pid() -> i32 {
    std::fs::read_to_string("/var/lib/agents-test-cluster/pids/kube-apiserver.pid")
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0)
}

fn writes_total() -> u64 {
    support::api_writes().values().sum()
}

/// Sessions of `ns` that have succeeded (phases only are fetched).
fn succeeded(ns: &str) -> usize {
    let out = kubectl_ok([
        "get",
        "sessions",
        "-n",
        ns,
        "-o",
        "jsonpath={.items[*].status.phase}",
    ]);
    out.split_whitespace().filter(|p| *p == "Succeeded").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes of load on the test cluster; run by hand (see the module doc)"]
async fn sessions_at_scale() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let sizes: Vec<usize> = std::env::var("AGENTS_SCALE_SESSIONS")
        .unwrap_or_else(|_| "200,1000".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("AGENTS_SCALE_SESSIONS: numbers, comma-separated")
        })
        .collect();
    let ns = TestNamespace::create(&client, "scale").await;
    apply(&ns.name, AGENT);
    let op = support::launcher::Operator::start(
        BIN,
        "scale",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_rss = rss_mib(op.pid());
    println!(
        "machine: {} cores; operator idle RSS {idle_rss:.0} MiB",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!("| sessions | sessions/s | API writes/session | operator RSS MiB | KB/session | kube-apiserver RSS MiB |");
    println!("|---|---|---|---|---|---|");
    let mut made = 0;
    let mut per_session_kb = 0.0;
    for size in sizes {
        let writes_before = writes_total();
        let started = Instant::now();
        for chunk in (made..size).step_by(500) {
            apply(&ns.name, &sessions_yaml(chunk, (chunk + 500).min(size)));
        }
        let batch = size - made;
        made = size;
        let deadline = Instant::now() + Duration::from_secs(60 + batch as u64);
        while succeeded(&ns.name) < size {
            assert!(
                Instant::now() < deadline,
                "{size} sessions did not all succeed in time"
            );
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let took = started.elapsed().as_secs_f64();
        // The creates are the client's; the rest are the operator's.
        let writes = (writes_total() - writes_before) as f64 / batch as f64;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss = rss_mib(op.pid());
        per_session_kb = (rss - idle_rss).max(0.0) * 1024.0 / size as f64;
        println!(
            "| {size} | {:.1} | {writes:.1} | {rss:.0} | {per_session_kb:.1} | {:.0} |",
            batch as f64 / took,
            rss_mib(apiserver_pid())
        );
    }
    // Before the operator kept only what reconcile reads, 55 KB a session.
    assert!(
        per_session_kb < 30.0,
        "the operator holds {per_session_kb:.1} KB per finished session"
    );
    ns.delete(&client).await;
}
