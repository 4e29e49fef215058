//! An operator that outlives its control plane (issue 15), on the test
//! cluster's own processes (`tests/cluster/chaos`):
//!
//! - kube-apiserver SIGKILLed and restarted mid-session;
//! - etcd SIGKILLed and restarted while background calls run;
//! - the operator's traffic to the API server dropped for 30 s (iptables on
//!   its own loopback address), with `/healthz` and `/readyz` failing while
//!   it is cut off and passing again after;
//! - the API server answering 429 under a tight priority level;
//! - two operators on one host (no POD_NAME) never repeat each other's work;
//! - a leader paused (SIGSTOP) past its Lease starts nothing when it wakes;
//! - the resync reconciles a waiting session with no write.
//!
//! Each: every session finishes, each model turn is asked once (the local
//! OpenAI-compatible server counts them), and every side effect arrives
//! under one key per call. The tests take the cluster down in turns (one at
//! a time; cargo runs one test binary at a time).

use crate::support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use support::fake::World;
use support::{apply, chaos, kubectl, kubectl_ok, wait_for, TestNamespace};

/// The operator of this checkout.
struct Operator(support::launcher::Operator);

impl Operator {
    fn start(
        name: &str,
        kubeconfig: &std::path::Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> Operator {
        Operator(support::launcher::Operator::start(
            BIN,
            &format!("chaos-{name}"),
            kubeconfig,
            args,
            env,
        ))
    }
}

impl std::ops::Deref for Operator {
    type Target = support::launcher::Operator;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// The cluster is shared: one disruption at a time.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

// ---------------------------------------------------------------- helpers

fn chaos_ok(args: &[&str]) {
    let out = chaos(args);
    assert!(out.status.success(), "chaos {args:?} failed");
}

/// The admin kubeconfig with its server at `host` (another loopback
/// address, which a test may cut without cutting its own traffic).
fn kubeconfig_at(host: &str, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(support::kubeconfig_path().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("agents-chaos-{name}.kubeconfig"));
    std::fs::write(
        &path,
        text.replace("https://127.0.0.1:6443", &format!("https://{host}:6443")),
    )
    .unwrap();
    path
}

fn agent(port: u16) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: worker}}
spec:
  model:
    provider: openai
    openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m, }}
  tools:
    - {{name: now, http: {{url: "http://127.0.0.1:{port}/now"}}}}
    - {{name: later, http: {{url: "http://127.0.0.1:{port}/later"}}}}
  policy:
    default: runSync
    rules:
      - {{tool: later, disposition: runAsync}}
"#
    )
}

/// Creates sessions `prefix0..prefixN` that ask the world; returns names.
fn sessions(ns: &str, prefix: &str, n: usize) -> Vec<String> {
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
    let yaml: Vec<String> = names
        .iter()
        .map(|s| {
            format!(
                "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: {s}}}\nspec:\n  agentRef: {{name: worker}}\n  messages: [\"work {s}\"]\n"
            )
        })
        .collect();
    apply(ns, &yaml.join("---\n"));
    names
}

fn wait_succeeded(ns: &str, timeout: &str) {
    let out = kubectl([
        "wait",
        "-n",
        ns,
        "--for=condition=Succeeded",
        "sessions",
        "--all",
        &format!("--timeout={timeout}"),
    ]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        kubectl_ok(["get", "sessions", "-n", ns])
    );
}

fn phases(ns: &str) -> BTreeMap<String, String> {
    let out = kubectl_ok([
        "get",
        "sessions",
        "-n",
        ns,
        "-o",
        "jsonpath={range .items[*]}{.metadata.name}={.status.phase}{\"\\n\"}{end}",
    ]);
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// The API server is back (kubectl through loopback answers).
fn api_back() {
    wait_for("the API server", Duration::from_secs(60), || {
        kubectl(["get", "--raw", "/readyz"]).status.success()
    });
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_restart_mid_session_loses_and_repeats_nothing() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-api").await;
    let world = World::new(3, Duration::from_millis(800));
    let port = world.listen("direct");
    apply(&ns.name, &agent(port));
    let op = Operator::start(
        "api",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let mut names = sessions(&ns.name, "a", 8);
    // Mid-session: some turns asked, background calls under way.
    wait_for("first model turns", Duration::from_secs(60), || {
        world.turns_seen().len() >= 4
    });
    chaos_ok(&["restart", "kube-apiserver", "3"]);
    api_back();
    // Sessions created after the restart are taken up too.
    let restarted = Instant::now();
    names.extend(sessions(&ns.name, "b", 4));
    wait_succeeded(&ns.name, "180s");
    eprintln!(
        "all sessions succeeded {:?} after the API server answered again",
        restarted.elapsed()
    );
    world.check(&names, 0);
    assert_eq!(op.probe("/healthz").0, 200, "{}", op.probe("/healthz").1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_restart_while_background_calls_run_loses_and_repeats_nothing() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-etcd").await;
    // Background (`later`) calls take 3 s: etcd dies while they run.
    let world = World::new(2, Duration::from_secs(3));
    let port = world.listen("direct");
    apply(&ns.name, &agent(port));
    let op = Operator::start(
        "etcd",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let names = sessions(&ns.name, "e", 8);
    wait_for(
        "background calls under way",
        Duration::from_secs(60),
        || {
            world
                .keys_seen()
                .keys()
                .filter(|k| k.ends_with("-c1"))
                .count()
                >= 4
        },
    );
    chaos_ok(&["restart", "etcd", "3"]);
    api_back();
    wait_succeeded(&ns.name, "180s");
    world.check(&names, 0);
    assert_eq!(op.probe("/healthz").0, 200, "{}", op.probe("/healthz").1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_seconds_cut_off_fail_the_probes_then_everything_resumes() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-cut").await;
    let world = World::new(2, Duration::from_millis(500));
    let port = world.listen("direct");
    apply(&ns.name, &agent(port));
    // The operator alone reaches the API server at 127.0.0.2: cutting it
    // leaves this test's own traffic (127.0.0.1) alone.
    let kubeconfig = kubeconfig_at("127.0.0.2", "cut");
    let op = Operator::start(
        "cut",
        &kubeconfig,
        &["-n", &ns.name, "--stall-seconds", "10"],
        &[],
    );
    let mut names = sessions(&ns.name, "c", 6);
    wait_for("first turns", Duration::from_secs(60), || {
        world.turns_seen().len() >= 3
    });
    wait_for("ready", Duration::from_secs(30), || {
        op.probe("/readyz").0 == 200
    });
    chaos_ok(&["cut", "127.0.0.2"]);
    let cut = Instant::now();
    // Written while the operator cannot see: taken up once it can.
    names.extend(sessions(&ns.name, "d", 4));
    let mut failed_at = None;
    while cut.elapsed() < Duration::from_secs(30) {
        if failed_at.is_none() && op.probe("/healthz").0 == 503 {
            failed_at = Some(cut.elapsed());
            let (code, body) = op.probe("/readyz");
            assert_eq!(code, 503, "readyz follows healthz: {body}");
            eprintln!(
                "/healthz failing {:?} after the cut: {}",
                cut.elapsed(),
                op.probe("/healthz").1
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    chaos_ok(&["heal", "127.0.0.2"]);
    let healed = Instant::now();
    let failed_at = failed_at.expect("/healthz never failed while the operator was cut off");
    assert!(
        failed_at >= Duration::from_secs(10),
        "the probe may fail only after the stall bound: {failed_at:?}"
    );
    wait_succeeded(&ns.name, "180s");
    eprintln!(
        "all sessions succeeded {:?} after the heal",
        healed.elapsed()
    );
    wait_for("/healthz passing again", Duration::from_secs(30), || {
        op.probe("/healthz").0 == 200 && op.probe("/readyz").0 == 200
    });
    world.check(&names, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_by_a_tight_priority_level_every_session_still_finishes() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-apf").await;
    let world = World::new(2, Duration::from_millis(100));
    let port = world.listen("direct");
    apply(&ns.name, &agent(port));
    // An identity outside system:masters (which is exempt from priority
    // and fairness), limited to one share that rejects at once.
    let sa = "chaos-operator";
    let level = format!("agents-chaos-{}", ns.name);
    apply(
        &ns.name,
        &format!(
            r#"
apiVersion: v1
kind: ServiceAccount
metadata: {{name: {sa}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {level}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}}
subjects: [{{kind: ServiceAccount, name: {sa}, namespace: {ns}}}]
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {{name: {level}}}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 1
    lendablePercent: 0
    borrowingLimitPercent: 0
    limitResponse: {{type: Reject}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {{name: {level}}}
spec:
  priorityLevelConfiguration: {{name: {level}}}
  matchingPrecedence: 100
  rules:
    - subjects: [{{kind: ServiceAccount, serviceAccount: {{name: {sa}, namespace: {ns}}}}}]
      resourceRules: [{{verbs: ["*"], apiGroups: ["*"], resources: ["*"], namespaces: ["*"], clusterScope: true}}]
      nonResourceRules: [{{verbs: ["*"], nonResourceURLs: ["*"]}}]
"#,
            ns = ns.name
        ),
    );
    let cleanup = level.clone();
    let _cluster_scoped = scopeguard(move || {
        for kind in [
            "flowschema",
            "prioritylevelconfiguration",
            "clusterrolebinding",
        ] {
            let _ = kubectl([
                "delete",
                kind,
                &cleanup,
                "--ignore-not-found",
                "--wait=false",
            ]);
        }
    });
    let token = kubectl_ok(["create", "token", sa, "-n", &ns.name, "--duration=1h"]);
    let admin = std::fs::read_to_string(support::kubeconfig_path().unwrap()).unwrap();
    let ca = admin
        .lines()
        .find_map(|l| l.trim().strip_prefix("certificate-authority-data: "))
        .unwrap()
        .to_string();
    let kubeconfig = std::env::temp_dir().join(format!("agents-chaos-{}.kubeconfig", ns.name));
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"https://127.0.0.1:6443\", certificate-authority-data: {ca}}}\nusers:\n- name: u\n  user: {{token: {}}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u, namespace: {}}}\ncurrent-context: c\n",
            token.trim(),
            ns.name
        ),
    )
    .unwrap();
    let rejected_before = rejected(&level);
    let _op = Operator::start("apf", &kubeconfig, &["-n", &ns.name], &[]);
    let names = sessions(&ns.name, "t", 24);
    wait_succeeded(&ns.name, "240s");
    let rejected = rejected(&level) - rejected_before;
    eprintln!("requests the API server rejected (429) at level {level}: {rejected}");
    assert!(
        rejected > 0,
        "the priority level never rejected a request: the test proves nothing"
    );
    world.check(&names, 0);
}

/// `apiserver_flowcontrol_rejected_requests_total` of priority level `level`.
fn rejected(level: &str) -> u64 {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    metrics
        .lines()
        .filter(|l| l.starts_with("apiserver_flowcontrol_rejected_requests_total{"))
        .filter(|l| l.contains(&format!("priority_level=\"{level}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

struct Guard<F: FnMut()>(F);
impl<F: FnMut()> Drop for Guard<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}
fn scopeguard<F: FnMut()>(f: F) -> Guard<F> {
    Guard(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_operators_on_one_host_never_repeat_each_others_work() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-twins").await;
    let world = World::new(3, Duration::from_millis(300));
    let port = world.listen("direct");
    apply(&ns.name, &agent(port));
    // Same host, no POD_NAME, no leader election: both drive every session;
    // only the claims keep them apart.
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _a = Operator::start("twin-a", &kubeconfig, &["-n", &ns.name], &[]);
    let _b = Operator::start("twin-b", &kubeconfig, &["-n", &ns.name], &[]);
    let names = sessions(&ns.name, "w", 30);
    wait_succeeded(&ns.name, "240s");
    world.check(&names, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_paused_past_its_lease_starts_nothing_when_it_wakes() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-fence").await;
    // Many turns, so the leader always has work it would start; a slow
    // model, so the stop finds its work waiting on replies rather than in
    // the instant between its fence check and its first byte on the wire
    // (which no check can close; the tool's idempotency key covers it).
    let world = World::new(6, Duration::from_millis(200)).with_model_delay(Duration::from_secs(1));
    let port = world.listen("direct");
    let via_a = world.listen("a");
    let via_b = world.listen("b");
    apply(&ns.name, &agent(port));
    let kubeconfig = support::kubeconfig_path().unwrap();
    let lease = [
        "-n",
        &ns.name,
        "--leader-elect",
        "--lease-duration-seconds",
        "4",
        "--lease-grace-seconds",
        "1",
    ];
    // Each operator reaches the model and tools through its own listener
    // (as its HTTP proxy), so the world knows who asked.
    let env = |port: u16, pod: &str| {
        vec![
            ("http_proxy", format!("http://127.0.0.1:{port}")),
            ("POD_NAMESPACE", ns.name.clone()),
            ("POD_NAME", pod.to_string()),
            ("POD_UID", uuid::Uuid::new_v4().to_string()),
        ]
    };
    let a = Operator::start("fence-a", &kubeconfig, &lease, &env(via_a, "op-a"));
    wait_for("a leads", Duration::from_secs(30), || {
        a.probe("/metrics").1.contains("agents_leader 1")
    });
    let b = Operator::start("fence-b", &kubeconfig, &lease, &env(via_b, "op-b"));
    let names = sessions(&ns.name, "f", 10);
    // Stopped while every session's first turn waits on the model.
    wait_for("a at work", Duration::from_secs(60), || {
        world.turns_seen().len() >= 10 && world.in_flight.load(Ordering::SeqCst) >= 10
    });
    let in_flight = world.in_flight.load(Ordering::SeqCst);
    unsafe_signal(a.pid(), "STOP");
    std::thread::sleep(Duration::from_secs(9));
    let resumed = Instant::now();
    unsafe_signal(a.pid(), "CONT");
    wait_succeeded(&ns.name, "180s");
    let after = world.requests_by_after("a", resumed);
    eprintln!(
        "a was stopped with {in_flight} model requests in flight; requests by a after it woke: {after}; by b: {}",
        world.requests_by_after("b", resumed - Duration::from_secs(9))
    );
    assert_eq!(
        after,
        0,
        "the ex-leader started work after losing its Lease: {:?}",
        world.requests_after("a", resumed)
    );
    assert!(
        world.requests_by_after("b", resumed - Duration::from_secs(9)) > 0,
        "b took over"
    );
    // A model turn or a tool call a had begun when it stopped (its result
    // not yet committed) is done again by b, under the same key: a before
    // the stop, then b. Never twice by one operator, never by a after it
    // woke.
    world.check_with(&names, 0, |senders| senders == ["a", "b"]);
    let log = a.log_text();
    eprintln!(
        "a's log after waking: {}",
        log.lines()
            .filter(|l| l.contains("not starting work")
                || l.contains("lost")
                || l.contains("stepping down"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(b);
}

fn unsafe_signal(pid: i32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resync_steps_a_waiting_session_without_writing() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _serial = serial().await;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "chaos-resync").await;
    apply(
        &ns.name,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: waits}
spec:
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: ask, arguments: {q: 1}}]
          - text: finished
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      default: defer
  messages: ["hello"]
"#,
    );
    let op = Operator::start(
        "resync",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name, "--resync-seconds", "2"],
        &[],
    );
    wait_for("waiting", Duration::from_secs(60), || {
        phases(&ns.name).get("waits").map(String::as_str) == Some("Waiting")
    });
    std::thread::sleep(Duration::from_secs(1));
    let version = || {
        kubectl_ok([
            "get",
            "session",
            "waits",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ])
    };
    let steps = |log: &str| {
        log.lines()
            .filter(|l| l.contains("step") && l.contains(&format!("{}/waits", ns.name)))
            .count()
    };
    let (before, steps_before) = (version(), steps(&op.log_text()));
    std::thread::sleep(Duration::from_secs(9));
    let (after, steps_after) = (version(), steps(&op.log_text()));
    eprintln!("resync: {} steps in 9 s", steps_after - steps_before);
    assert!(
        steps_after - steps_before >= 3,
        "a waiting session is stepped every resync period: {steps_before} -> {steps_after}"
    );
    assert_eq!(before, after, "a step with nothing to do writes nothing");
}
