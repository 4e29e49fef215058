//! Failure cases of a shared operator at scale, on the test cluster:
//!
//! - a burst of sessions created at once (1000; `AGENTS_BURST_SESSIONS`)
//!   while 20 others wait on people: every burst session succeeds, the
//!   waiting ones keep waiting with nothing lost, and a person's answer
//!   still moves each on;
//! - a namespace holding 500 running sessions deleted under them
//!   (`AGENTS_DOOMED_SESSIONS`): the namespace goes away (nothing of ours
//!   holds it), the operator stays healthy, and another namespace's
//!   sessions all succeed with each side effect once.

use crate::support;

use agents::api::Session;
use agents::core::{ContinuationToken, Millis, ToolResult};
use agents::store::kube::KubeStore;
use futures::StreamExt;
use kube::api::{Api, DeleteParams, PostParams};
use std::time::{Duration, Instant};
use support::fake::{self, World};
use support::launcher::Operator;
use support::{kubectl_ok, sized, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// The Agents `flow` (two built-in calls, one of them runAsync) and
/// `waits` (one call that waits for a person).
fn agents() -> String {
    format!(
        "{}---{}",
        fake::builtin_flow_agent("both things are here"),
        fake::WAITING_AGENT
    )
}

fn session(name: &str, agent: &str) -> Session {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Session",
        "metadata": {"name": name},
        "spec": {"agentRef": {"name": agent}, "messages": [format!("work {name}")]},
    }))
    .expect("a session object")
}

/// Creates `names` with 32 requests in flight: a burst, not a trickle.
async fn create_all(api: &Api<Session>, names: Vec<String>, agent: &str) {
    futures::stream::iter(names)
        .map(|name| {
            let s = session(&name, agent);
            async move {
                api.create(&PostParams::default(), &s)
                    .await
                    .unwrap_or_else(|e| panic!("create {name}: {e}"));
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

/// Sessions of `ns` by phase.
fn phases(ns: &str) -> std::collections::BTreeMap<String, usize> {
    let out = kubectl_ok([
        "get",
        "sessions",
        "-n",
        ns,
        "-o",
        "jsonpath={range .items[*]}{.status.phase}{\"\\n\"}{end}",
    ]);
    let mut by = std::collections::BTreeMap::new();
    for p in out.lines() {
        let p = if p.is_empty() { "(none)" } else { p };
        *by.entry(p.to_string()).or_insert(0) += 1;
    }
    by
}

fn count(by: &std::collections::BTreeMap<String, usize>, phase: &str) -> usize {
    by.get(phase).copied().unwrap_or(0)
}

/// The sum of a metric's series in the operator's /metrics.
fn metric(op: &Operator, prefix: &str) -> f64 {
    op.probe("/metrics")
        .1
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

fn peak_rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn now() -> Millis {
    Millis(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64,
    )
}

async fn wait_phases(
    ns: &str,
    what: &str,
    within: Duration,
    done: impl Fn(&std::collections::BTreeMap<String, usize>) -> bool,
) {
    let deadline = Instant::now() + within;
    loop {
        let by = phases(ns);
        if done(&by) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: sessions by phase {by:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_sessions_finishes_while_others_wait_on_people() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let burst = sized("AGENTS_BURST_SESSIONS", 1000);
    let ns = TestNamespace::create(&client, "burst").await;
    support::apply(&ns.name, &agents());
    let kubeconfig = support::kubeconfig_path().unwrap();
    let op = Operator::start(BIN, "burst", &kubeconfig, &["-n", &ns.name], &[]);
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);

    // Twenty sessions wait on people before the burst.
    let waiting: Vec<String> = (0..20).map(|i| format!("w{i:02}")).collect();
    create_all(&api, waiting.clone(), "waits").await;
    wait_phases(&ns.name, "20 waiting", Duration::from_secs(60), |by| {
        count(by, "Waiting") == 20
    })
    .await;

    let started = Instant::now();
    create_all(
        &api,
        (0..burst).map(|i| format!("b{i:05}")).collect(),
        "flow",
    )
    .await;
    let created = started.elapsed();
    wait_phases(
        &ns.name,
        "the burst succeeds",
        Duration::from_secs(120 + burst as u64 / 2),
        |by| count(by, "Succeeded") == burst,
    )
    .await;
    let took = started.elapsed();
    let by = phases(&ns.name);
    assert_eq!(
        count(&by, "Waiting"),
        20,
        "the waiting ones wait on: {by:?}"
    );
    assert_eq!(count(&by, "Failed"), 0, "{by:?}");
    let peak_kib = peak_rss_kib(op.pid());
    eprintln!(
        "{burst} sessions created in {created:?}, all succeeded in {took:?} ({:.1}/s); \
         operator peak RSS {} MiB; events dropped {}; reconcile errors {}",
        burst as f64 / took.as_secs_f64(),
        peak_kib / 1024,
        metric(&op, "agents_events_dropped_total"),
        metric(&op, "agents_reconcile_errors_total"),
    );

    // Nothing of the waiting ones was lost: each still has its one
    // continuation, and a person's answer moves it on.
    let store = KubeStore::new(client.clone(), &ns.name);
    for w in &waiting {
        let token = ContinuationToken(format!("{w}-t1-c0"));
        let c = store.get_continuation(&token).await.unwrap();
        assert!(c.is_some_and(|c| c.result.is_none()), "{w} still waits");
        agents::ports::ContinuationPort::complete(
            &store,
            &token,
            &ToolResult::text("42"),
            "a-person",
            now(),
        )
        .await
        .unwrap();
    }
    wait_phases(
        &ns.name,
        "the answered ones succeed",
        Duration::from_secs(60),
        |by| count(by, "Succeeded") == burst + 20,
    )
    .await;
    assert_eq!(op.probe("/healthz").0, 200, "{}", op.log_text());
    drop(op);
    ns.delete(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_namespace_of_running_sessions_harms_no_one_else() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let doomed_n = sized("AGENTS_DOOMED_SESSIONS", 500);
    // The runAsync tool takes 2 s, so sessions are mid-flight when their
    // namespace goes.
    let world = World::new(3, Duration::from_secs(2)).with_model_delay(Duration::ZERO);
    let port = world.listen("tools");
    let doomed = TestNamespace::create(&client, "doomed").await;
    let other = TestNamespace::create(&client, "bystander").await;
    support::apply(&doomed.name, &support::fake::flow_manifests(port, 0));
    support::apply(&doomed.name, &agents());
    support::apply(&other.name, &support::fake::flow_manifests(port, 0));
    let kubeconfig = support::kubeconfig_path().unwrap();
    let op = Operator::start(
        BIN,
        "doomed",
        &kubeconfig,
        &["-n", &doomed.name, "-n", &other.name],
        &[],
    );

    // Half run the http flow, a tenth wait on people (continuations owned
    // by their sessions), the rest run the builtin flow.
    let api: Api<Session> = Api::namespaced(client.clone(), &doomed.name);
    let names = |from: usize, to: usize| (from..to).map(|i| format!("s{i}")).collect::<Vec<_>>();
    let (half, tenth) = (doomed_n / 2, doomed_n / 10);
    create_all(&api, names(0, half), "worker").await;
    create_all(&api, names(half, half + tenth), "waits").await;
    create_all(&api, names(half + tenth, doomed_n), "flow").await;
    // Let them get going, then pull the namespace out from under them.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let by = phases(&doomed.name);
    eprintln!("when the namespace was deleted: {by:?}");
    let ns_api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    ns_api
        .delete(&doomed.name, &DeleteParams::background())
        .await
        .unwrap();
    let deleted_at = Instant::now();

    // Another tenant's sessions, started while that goes on, all succeed.
    let others = 40;
    let other_api: Api<Session> = Api::namespaced(client.clone(), &other.name);
    create_all(
        &other_api,
        (0..others).map(|i| format!("o{i}")).collect(),
        "worker",
    )
    .await;
    wait_phases(
        &other.name,
        "the other namespace's sessions succeed",
        Duration::from_secs(180),
        |by| count(by, "Succeeded") == others,
    )
    .await;

    // The namespace goes: no finalizer of ours holds it.
    let name = doomed.name.clone();
    support::wait_until(
        Duration::from_secs(180),
        "the doomed namespace to go",
        || async { matches!(ns_api.get_opt(&name).await, Ok(None)).then_some(()) },
    )
    .await;
    eprintln!(
        "namespace with {doomed_n} sessions gone in {:?}",
        deleted_at.elapsed()
    );

    // The operator is well and counted its errors instead of looping.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(op.probe("/healthz").0, 200, "{}", op.log_text());
    let errors = metric(&op, "agents_reconcile_errors_total");
    eprintln!("reconcile errors while the namespace went: {errors}");
    assert!(
        errors <= 3.0 * doomed_n as f64,
        "each doomed session fails a counted number of times, not in a loop: {errors}"
    );
    let log = op.log_text();
    assert!(!log.contains("panicked"), "{log}");
    // Each of the bystanders' calls ran once.
    let keys = world.keys_seen();
    for i in 0..others {
        let mine: Vec<_> = keys
            .iter()
            .filter(|(k, _)| k.contains(&format!("/o{i}/")))
            .collect();
        assert_eq!(
            mine.len(),
            3,
            "o{i}: three calls, each its own key: {mine:?}"
        );
        assert!(
            mine.iter().all(|(_, n)| **n == 1),
            "o{i} once each: {mine:?}"
        );
    }
    drop(op);
    other.delete(&client).await;
}
