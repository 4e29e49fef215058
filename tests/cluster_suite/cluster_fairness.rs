//! API Priority and Fairness, as the chart sets it up: every request of the
//! operator's service account is dispatched in the release's own priority
//! level; and when that level is too small and the API server answers 429,
//! the operator waits and retries, and every session still succeeds with
//! each side effect run once.

use crate::support;

use std::path::PathBuf;
use std::time::Duration;
use support::fake::World;
use support::launcher::Operator;
use support::{kubectl, kubectl_ok, ClusterScoped, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// The chart's RBAC, service account and flow control for release `ns`,
/// with the operator's role bound in `ns`.
struct Release {
    ns: TestNamespace,
    name: String,
    kubeconfig: PathBuf,
    _scoped: ClusterScoped,
}

impl Release {
    async fn install(client: &kube::Client, prefix: &str) -> Release {
        support::install_crds(client).await;
        let ns = TestNamespace::create(client, prefix).await;
        let name = ns.name.clone();
        let scoped = ClusterScoped(vec![
            format!("clusterrole/{name}-operator"),
            format!("clusterrole/{name}-completer"),
            format!("flowschema/{name}-operator"),
            format!("flowschema/{name}-operator-leader-election"),
            format!("prioritylevelconfiguration/{name}-operator"),
        ]);
        let manifests = support::helm_template(
            &name,
            &ns.name,
            &[
                "--show-only",
                "templates/rbac.yaml",
                "--show-only",
                "templates/serviceaccount.yaml",
                "--show-only",
                "templates/flowcontrol.yaml",
            ],
        );
        support::apply(&ns.name, &manifests);
        kubectl_ok([
            "create",
            "rolebinding",
            "operator-here",
            "-n",
            &ns.name,
            &format!("--clusterrole={name}-operator"),
            &format!("--serviceaccount={}:{name}-operator", ns.name),
        ]);
        let kubeconfig = support::service_account_kubeconfig(&ns.name, &format!("{name}-operator"));
        Release {
            ns,
            name,
            kubeconfig,
            _scoped: scoped,
        }
    }

    fn operator(&self, args: &[&str]) -> Operator {
        let mut all = vec!["-n", self.ns.name.as_str()];
        all.extend_from_slice(args);
        Operator::start(BIN, &self.name, &self.kubeconfig, &all, &[])
    }

    fn apply_sessions(&self, port: u16, sessions: usize) {
        support::apply(
            &self.ns.name,
            &support::fake::flow_manifests(port, sessions),
        );
    }

    fn wait_all_succeeded(&self, timeout: &str) {
        let out = kubectl([
            "wait",
            "-n",
            &self.ns.name,
            "--for=condition=Succeeded",
            "sessions",
            "--all",
            &format!("--timeout={timeout}"),
        ]);
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            kubectl_ok(["get", "sessions", "-n", &self.ns.name])
        );
    }
}

/// The API server's count of `metric` over the series whose `label` is
/// `value`.
fn apf_count(metric: &str, label: &str, value: &str) -> u64 {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    let wanted = format!("{label}=\"{value}\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(metric)?.strip_prefix('{'))
        .filter_map(|rest| rest.split_once("} "))
        .filter(|(labels, _)| labels.split(',').any(|kv| kv == wanted))
        .map(|(_, n)| n.trim().parse::<f64>().unwrap_or(0.0) as u64)
        .sum()
}

/// Each call's side effect reached the tool server once: three calls a
/// session (two `now`, one `later`), each under its own key.
fn each_effect_once(world: &World, sessions: usize) {
    let keys = world.keys_seen();
    assert_eq!(keys.len(), 3 * sessions, "{keys:?}");
    let repeated: Vec<_> = keys.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "sent more than once: {repeated:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_requests_are_dispatched_in_its_own_priority_level() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let release = Release::install(&client, "apf-lane").await;
    let schema = format!("{}-operator", release.name);
    let before = apf_count(
        "apiserver_flowcontrol_dispatched_requests_total",
        "flow_schema",
        &schema,
    );
    let world = World::new(2, Duration::from_millis(100));
    let port = world.listen("direct");
    let _op = release.operator(&[]);
    release.apply_sessions(port, 3);
    release.wait_all_succeeded("120s");
    let dispatched = apf_count(
        "apiserver_flowcontrol_dispatched_requests_total",
        "flow_schema",
        &schema,
    ) - before;
    let at_level = apf_count(
        "apiserver_flowcontrol_dispatched_requests_total",
        "priority_level",
        &schema,
    );
    eprintln!(
        "requests dispatched by flow schema {schema}: {dispatched}; at its level: {at_level}"
    );
    // Three sessions take several writes each, and the watches and reads
    // besides: all of them the operator's, all in its lane.
    assert!(
        dispatched >= 10,
        "only {dispatched} requests matched {schema}"
    );
    assert!(at_level >= dispatched, "{at_level} < {dispatched}");
    each_effect_once(&world, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_api_server_is_waited_out_and_nothing_is_lost() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let release = Release::install(&client, "apf-busy").await;
    let level = format!("{}-operator", release.name);
    // A lane of one seat that borrows none and queues nothing: whatever
    // does not fit at once is answered 429.
    kubectl_ok([
        "patch",
        "prioritylevelconfiguration",
        &level,
        "--type=merge",
        "-p",
        r#"{"spec":{"limited":{"nominalConcurrencyShares":1,"lendablePercent":0,"borrowingLimitPercent":0,"limitResponse":{"type":"Reject","queuing":null}}}}"#,
    ]);
    let rejected_before = apf_count(
        "apiserver_flowcontrol_rejected_requests_total",
        "priority_level",
        &level,
    );
    const SESSIONS: usize = 30;
    let world = World::new(2, Duration::from_millis(50));
    let port = world.listen("direct");
    let op = release.operator(&["--max-concurrent-reconciles", "32"]);
    release.apply_sessions(port, SESSIONS);
    release.wait_all_succeeded("300s");
    let rejected = apf_count(
        "apiserver_flowcontrol_rejected_requests_total",
        "priority_level",
        &level,
    ) - rejected_before;
    eprintln!("429s the API server answered the operator: {rejected}");
    assert!(
        rejected > 0,
        "the API server never refused the operator: this run did not test a busy API server"
    );
    each_effect_once(&world, SESSIONS);
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");
}
