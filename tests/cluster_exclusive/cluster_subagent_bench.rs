//! Benchmark: one sub-agent call against one plain tool call, under the
//! operator, in API writes (counted by the API server itself,
//! `apiserver_request_total` by verb and resource) and in latency (from
//! `kubectl apply` of the Session to its `Succeeded` phase, read every
//! 20 ms). Both sessions use scripted models, so the figures are the
//! operator's and the API server's alone.
//!
//! - plain: the model calls `echo` (runSync), then answers;
//! - sub-agent: the model calls `helper` (an `agent` tool), whose child
//!   Session answers at once; then the parent answers.
//!
//! Runs alone (the API server's counters count every request):
//! `flock -x /work/cluster.lock cargo test --test cluster_exclusive
//! cluster_subagent_bench:: -- --nocapture`. `AGENTS_BENCH_RUNS` (default
//! 3) sessions of each kind run one after the other; the medians print.

use crate::support;

use agents::api::session::SessionPhase;
use agents::api::Session;
use kube::api::Api;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use support::launcher::Operator;
use support::TestNamespace;

const BIN: &str = env!("CARGO_BIN_EXE_agents");

const AGENTS: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: plain}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{name: echo, arguments: {text: hi}}]
        - text: done
  tools: [{name: echo, builtin: {function: echo}}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: delegator}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{name: helper, arguments: {prompt: hi}}]
        - text: done
  tools: [{name: helper, agent: {ref: helper}}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: helper}
spec:
  description: answers at once
  model:
    provider: scripted
    scripted:
      replies: [{text: helped}]
"#;

/// One measured session: its API writes by (verb, resource), and how long
/// it took from `apply` to `Succeeded`.
struct Measured {
    writes: BTreeMap<(String, String), u64>,
    latency: Duration,
}

async fn measure(api: &Api<Session>, ns: &str, name: &str, agent: &str) -> Measured {
    let before = support::api_writes();
    let started = Instant::now();
    support::apply(
        ns,
        &format!("apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: {name}}}\nspec: {{agentRef: {{name: {agent}}}, messages: [go]}}\n"),
    );
    let latency = loop {
        let phase = api
            .get_opt(name)
            .await
            .ok()
            .flatten()
            .and_then(|s| s.status)
            .map(|s| s.phase);
        if phase == Some(SessionPhase::Succeeded) {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{name} did not succeed: {phase:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Let the last writes (events, a final status) settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = support::api_writes();
    let writes = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        // The counts are the whole cluster's: DELETEs are the namespace
        // controller emptying earlier tests' namespaces (a measured
        // session deletes nothing), and they made a run look 12 to 29
        // writes dearer.
        .filter(|((verb, _), v)| *v > 0 && verb != "DELETE")
        .collect();
    Measured { writes, latency }
}

fn median<T: Ord + Copy>(mut xs: Vec<T>) -> T {
    xs.sort();
    xs[xs.len() / 2]
}

fn total(m: &Measured) -> u64 {
    m.writes.values().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agent_call_against_a_plain_tool_call() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "subagent-bench").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    support::apply(&ns.name, AGENTS);
    let op = Operator::start(
        BIN,
        &format!("{}-bench", ns.name),
        &kubeconfig,
        &["-n", &ns.name],
        &[],
    );
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let runs = support::sized("AGENTS_BENCH_RUNS", 3);
    // A first session of each warms the operator's caches and watches.
    measure(&api, &ns.name, "warm-plain", "plain").await;
    measure(&api, &ns.name, "warm-sub", "delegator").await;
    let (mut plain, mut sub) = (Vec::new(), Vec::new());
    for i in 0..runs {
        plain.push(measure(&api, &ns.name, &format!("plain-{i}"), "plain").await);
        sub.push(measure(&api, &ns.name, &format!("sub-{i}"), "delegator").await);
    }
    drop(op);
    let report = |label: &str, ms: &[Measured]| {
        let writes = median(ms.iter().map(total).collect());
        let latency = median(ms.iter().map(|m| m.latency).collect());
        println!(
            "{label}: median {writes} API writes, median latency {} ms (apply to Succeeded); each run: {:?}",
            latency.as_millis(),
            ms.iter()
                .map(|m| (total(m), m.latency.as_millis(), m.writes.clone()))
                .collect::<Vec<_>>()
        );
        (writes, latency)
    };
    let (plain_writes, plain_latency) = report("plain tool call (runSync echo)", &plain);
    let (sub_writes, sub_latency) = report("sub-agent call (child Session answers at once)", &sub);
    println!(
        "a sub-agent call costs {} more API writes and {} ms more than a plain tool call",
        sub_writes as i64 - plain_writes as i64,
        sub_latency.as_millis() as i64 - plain_latency.as_millis() as i64
    );
    // The child is a whole Session: at least its creation and its own
    // steps' writes on top of the parent's.
    assert!(sub_writes > plain_writes, "a child Session is written too");
    // Bounded: the child's status writes, its creation, the call's
    // continuation and its note; a regression that loops shows here.
    assert!(
        sub_writes <= plain_writes + 15,
        "plain {plain_writes}, sub-agent {sub_writes}"
    );
    ns.delete(&client).await;
}
