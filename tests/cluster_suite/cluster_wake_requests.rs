//! What a wake costs the API server (issue 32, item 3): sessions wait on
//! deferred calls, a person completes each with `agents session complete`,
//! and the operator's own counters say what it asked the API server:
//!
//! - each reconcile that took in a result sent at most one request before
//!   its first write (`agents_wake_requests_before_write`): the Session's
//!   read when the watch's copy was already used, and the Continuations
//!   from the watch's cache, not a list;
//! - the reads per session (Sessions and Continuations, by verb) stay at
//!   or under what they were before the cache (`agents_api_requests_total`).
//!
//! The operator is a child process watching only this test's namespace, so
//! its counters are this test's alone. Skipped without a cluster unless
//! AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::Continuation;
use kube::api::{Api, ListParams};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;
use support::launcher::Operator;
use support::{apply, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
/// Sessions in the test, each waiting twice.
const SESSIONS: usize = 6;
const WAITS: usize = 2;

fn session_yaml(name: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["ask twice"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: ask, arguments: {{q: first}}}}]
          - toolCalls: [{{name: ask, arguments: {{q: second}}}}]
          - text: answered twice
    tools:
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
      rules:
        - {{tool: ask, disposition: defer}}
"#
    )
}

/// The value of the sample `series` (name and labels, as scraped), or 0.
fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Every `agents_api_requests_total` sample: (verb, resource) -> count.
fn api_requests(scrape: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in scrape.lines() {
        let Some(rest) = line.strip_prefix("agents_api_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            let at = labels.find(&format!("{key}=\""))? + key.len() + 2;
            Some(labels[at..].split('"').next()?.to_string())
        };
        if let (Some(verb), Some(resource), Ok(n)) =
            (label("verb"), label("resource"), value.parse())
        {
            out.insert((verb, resource), n);
        }
    }
    out
}

/// The token of `session`'s open continuation, once there is one.
async fn open_token(continuations: &Api<Continuation>, session: &str, done: &[String]) -> String {
    let label = format!("{}={session}", agents::store::kube::SESSION_LABEL);
    wait_until(
        Duration::from_secs(90),
        &format!("an open continuation of {session}"),
        || async {
            let list = continuations
                .list(&ListParams::default().labels(&label))
                .await
                .ok()?;
            list.items
                .into_iter()
                .filter_map(|c| c.metadata.name)
                .find(|name| !done.contains(name))
        },
    )
    .await
}

/// `agents session complete TOKEN`, as a person would.
fn complete(ns: &str, token: &str) {
    let kubeconfig = support::kubeconfig_path().expect("the test cluster's kubeconfig");
    let out = Command::new(BIN)
        .args(["session", "complete", token, "--text", "yes"])
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", kubeconfig)
        .env_remove("AGENTS_STORE")
        .env_remove("AGENTS_NAMESPACE")
        .output()
        .expect("run agents");
    assert!(
        out.status.success(),
        "complete {token}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_asks_at_most_one_request_before_it_writes() {
    let Some((client, ns)) = support::cluster_namespace("wake-requests").await else {
        return;
    };
    let names: Vec<String> = (0..SESSIONS).map(|i| format!("w{i}")).collect();
    for name in &names {
        apply(&ns.name, &session_yaml(name));
    }
    let operator = Operator::watching(BIN, &ns.name, "wake-requests");
    let continuations: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let mut done: Vec<String> = Vec::new();
    for _ in 0..WAITS {
        for name in &names {
            support::wait_session_condition(&ns.name, name, "Waiting", 90);
            let token = open_token(&continuations, name, &done).await;
            complete(&ns.name, &token);
            done.push(token);
        }
        // The next round's continuations are new ones.
    }
    for name in &names {
        support::wait_session_condition(&ns.name, name, "Succeeded", 90);
    }
    let wakes = (SESSIONS * WAITS) as f64;
    let scrape = wait_until(Duration::from_secs(30), "every wake counted", || async {
        let (_, scrape) = operator.probe("/metrics");
        (sample(&scrape, "agents_wake_requests_before_write_count") >= wakes).then_some(scrape)
    })
    .await;
    let requests = api_requests(&scrape);
    let per_session = |verb: &str, resource: &str| {
        requests
            .get(&(verb.to_string(), resource.to_string()))
            .copied()
            .unwrap_or(0.0)
            / SESSIONS as f64
    };
    let histogram = |le: &str| {
        sample(
            &scrape,
            &format!("agents_wake_requests_before_write_bucket{{le=\"{le}\"}}"),
        )
    };
    let (count, sum) = (
        sample(&scrape, "agents_wake_requests_before_write_count"),
        sample(&scrape, "agents_wake_requests_before_write_sum"),
    );
    eprintln!(
        "bench: wake_requests wakes={count} requests_before_first_write_sum={sum} le0={} le1={} le2={} \
         per_session get_sessions={:.2} list_continuations={:.2} get_continuations={:.2} \
         sessions_status_writes={:.2} create_continuations={:.2} patch_continuations_status={:.2}",
        histogram("0.0"),
        histogram("1.0"),
        histogram("2.0"),
        per_session("get", "sessions"),
        per_session("list", "continuations"),
        per_session("get", "continuations"),
        per_session("update", "sessions/status") + per_session("patch", "sessions/status"),
        per_session("create", "continuations"),
        per_session("patch", "continuations/status"),
    );
    eprintln!("api requests: {requests:?}");
    assert_eq!(count, wakes, "each completion woke its session once");
    assert_eq!(
        histogram("1.0"),
        count,
        "a wake sent at most one request before its first write ({sum} in {count} wakes)"
    );
    let sessions_read = per_session("get", "sessions");
    assert!(
        sessions_read <= SESSION_READS_BEFORE,
        "reads of the Session per session: {sessions_read:.2}, before {SESSION_READS_BEFORE}"
    );
    let reads =
        sessions_read + per_session("list", "continuations") + per_session("get", "continuations");
    assert!(
        reads <= READS_PER_SESSION_BEFORE,
        "reads of Sessions and Continuations per session: {reads:.2}, before {READS_PER_SESSION_BEFORE}"
    );
    ns.delete(&client).await;
}

/// Reads per session in this test before a step read Continuations from
/// the watch and a step handed its newest Session to the next (two runs:
/// 2.17 and 2.50 GETs of the Session, 7.67 and 9.17 lists and 2.00 GETs of
/// Continuations; each wake then sent 2 requests before its first write):
/// the lower of each.
const SESSION_READS_BEFORE: f64 = 2.17;
const READS_PER_SESSION_BEFORE: f64 = 11.84;
