//! Restarts while people decide (issue 34, item 3): 50 sessions wait on an
//! approval with a quorum of two. Two people (service accounts, each with
//! its own token) approve every call with `agents session approve`; the
//! first while kube-apiserver is SIGKILLed and restarted, the second while
//! etcd is (`tests/cluster/chaos`).
//!
//! - A decision the cluster could not take is tried again by the CLI (or
//!   refused saying it may not be recorded, and run again);
//! - every session finishes with its own tool result, and the tool (a local
//!   HTTP server) sees each call once, under one idempotency key;
//! - each wait is notified once: the webhook's POSTs are all sent before
//!   the restarts, and none is sent again (the documented repeat is only
//!   for an operator killed between its claim and the webhook's answer).
//!
//! It takes the cluster down in turns: run it alone, under
//! `flock -x /work/cluster.lock`. It leaves the cluster up and answering,
//! and the components it restarts hold no descriptor of that lock.

use crate::support;

use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::{Response, Server};
use support::{apply, chaos, kubectl, kubectl_ok, wait_for, ClusterScoped, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const SESSIONS: usize = 50;
const APPROVERS: [&str; 2] = ["approver-a", "approver-b"];

/// The API server answers again (through kubectl).
fn api_back() {
    wait_for("the API server", Duration::from_secs(90), || {
        kubectl(["get", "--raw", "/readyz"]).status.success()
    });
}

/// Starts again whatever of etcd and kube-apiserver is down when the test
/// ends, also when it fails: the cluster is shared.
struct ClusterBack;

impl Drop for ClusterBack {
    fn drop(&mut self) {
        let status = chaos(&["status"]);
        let said = String::from_utf8_lossy(&status.stdout).to_string();
        for component in ["etcd", "kube-apiserver"] {
            if said.contains(&format!("{component}: down")) {
                chaos(&["start", component]);
            }
        }
    }
}

/// Counts what reaches it: tool calls per idempotency key, notifications
/// per continuation token (and their keys).
#[derive(Default)]
struct Counted {
    calls: HashMap<String, usize>,
    notified: HashMap<String, Vec<String>>,
}

fn serve(counted: Arc<Mutex<Counted>>) -> Server {
    Server::start(move |req| {
        let key = req.header("idempotency-key").unwrap_or("").to_string();
        let mut counted = counted.lock().unwrap();
        if req.path.starts_with("/notify") {
            let token = req.json()["token"].as_str().unwrap_or("").to_string();
            counted.notified.entry(token).or_default().push(key);
            return Response::json(200, "{}");
        }
        *counted.calls.entry(key.clone()).or_insert(0) += 1;
        Response::json(200, serde_json::json!({"shipped": key}).to_string())
    })
}

fn agent(url: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: shipper}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{{name: ship, arguments: {{to: prod}}}}]
        - text: shipped
  tools: [{{name: ship, http: {{url: "{url}ship"}}}}]
  notify: {{webhook: {{url: "{url}notify"}}}}
  policy:
    rules:
      - tool: ship
        disposition: runSync
        approval:
          approvers: {{serviceAccounts: [{a}, {b}]}}
          quorum: 2
"#,
        a = APPROVERS[0],
        b = APPROVERS[1]
    )
}

fn token(i: usize) -> String {
    format!("s{i}-t1-c0")
}

/// `agents session approve TOKEN` as the person of `kubeconfig`, run
/// again when the CLI gave up saying the decision may not be recorded;
/// returns whether it had to try again.
fn approve(ns: &str, token: &str, kubeconfig: &Path) -> bool {
    let mut retried = false;
    for _ in 0..5 {
        let out = Command::new(BIN)
            .args(["session", "approve", token, "--store", "kube", "-n", ns])
            .env("KUBECONFIG", kubeconfig)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr).to_string();
        retried |= said.contains("the cluster did not answer");
        if out.status.success() {
            return retried;
        }
        assert!(
            said.contains("may not be recorded") && said.contains("run the same command again"),
            "a decision refused without saying why or what to do: {said}"
        );
    }
    panic!("{token}: the decision was never taken");
}

/// Each call approved by `kubeconfig`'s person, in a thread; the restart
/// of `component` begins once `before` of them are done.
fn approve_all_through_a_restart(ns: &str, kubeconfig: PathBuf, component: &str, before: usize) {
    let done = Arc::new(AtomicUsize::new(0));
    let retried = Arc::new(AtomicUsize::new(0));
    let people = {
        let (ns, done, retried) = (ns.to_string(), done.clone(), retried.clone());
        std::thread::spawn(move || {
            for i in 0..SESSIONS {
                if approve(&ns, &token(i), &kubeconfig) {
                    retried.fetch_add(1, Ordering::SeqCst);
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    wait_for("the first decisions", Duration::from_secs(120), || {
        done.load(Ordering::SeqCst) >= before
    });
    let restart = chaos(&["restart", component, "3"]);
    assert!(restart.status.success(), "chaos restart {component} failed");
    api_back();
    people.join().expect("the approvals");
    let retried = retried.load(Ordering::SeqCst);
    eprintln!("{component} restarted; {retried} decisions were tried again by the CLI");
    // Without its API server a request is refused at once; without etcd
    // the API server may hold a request until etcd is back instead.
    assert!(
        retried > 0 || component == "etcd",
        "no decision met the {component} restart: the test proves nothing"
    );
}

fn continuation(ns: &str, token: &str) -> Value {
    let out = kubectl(["get", "continuation", token, "-n", ns, "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// The tokens whose wait is marked notified (`Sent`).
fn notified_marks(ns: &str) -> usize {
    let out = kubectl_ok([
        "get",
        "continuations",
        "-n",
        ns,
        "-o",
        "jsonpath={range .items[*]}{.status.notified.state}{\"\\n\"}{end}",
    ]);
    out.lines().filter(|l| *l == "Sent").count()
}

/// The namespace's people: the chart's roles and approvals policy, a
/// service account (with a kubeconfig) per approver, and the operator's
/// (the policy lets only it write the notification record), last.
fn people(ns: &str) -> (ClusterScoped, Vec<PathBuf>) {
    let scoped = ClusterScoped(vec![
        format!("clusterrole/{ns}-operator"),
        format!("clusterrole/{ns}-completer"),
        format!("validatingadmissionpolicy/{ns}-approvals"),
        format!("validatingadmissionpolicybinding/{ns}-approvals"),
    ]);
    let selector =
        format!("approvals.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name={ns}");
    let manifests = support::helm_template(
        ns,
        ns,
        &[
            "--set",
            &selector,
            "--show-only",
            "templates/rbac.yaml",
            "--show-only",
            "templates/serviceaccount.yaml",
            "--show-only",
            "templates/approvals-policy.yaml",
        ],
    );
    apply(ns, &manifests);
    kubectl_ok([
        "create",
        "rolebinding",
        "operator-here",
        "-n",
        ns,
        &format!("--clusterrole={ns}-operator"),
        &format!("--serviceaccount={ns}:{ns}-operator"),
    ]);
    let mut configs = Vec::new();
    for sa in APPROVERS {
        kubectl_ok(["create", "serviceaccount", sa, "-n", ns]);
        kubectl_ok([
            "create",
            "rolebinding",
            sa,
            "-n",
            ns,
            &format!("--clusterrole={ns}-completer"),
            &format!("--serviceaccount={ns}:{sa}"),
        ]);
        configs.push(support::service_account_kubeconfig(ns, sa));
    }
    configs.push(support::service_account_kubeconfig(
        ns,
        &format!("{ns}-operator"),
    ));
    // The policy takes a moment to be enforced after it is created.
    std::thread::sleep(Duration::from_secs(2));
    (scoped, configs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_survive_api_server_and_etcd_restarts_while_people_decide() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let _back = ClusterBack;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "approval-restarts").await;
    let (_scoped, configs) = people(&ns.name);
    let counted: Arc<Mutex<Counted>> = Default::default();
    let server = serve(counted.clone());
    apply(&ns.name, &agent(&server.url("/")));
    let sessions: Vec<String> = (0..SESSIONS)
        .map(|i| {
            format!(
                "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: s{i}}}\nspec:\n  agentRef: {{name: shipper}}\n  messages: [\"ship {i}\"]\n"
            )
        })
        .collect();
    apply(&ns.name, &sessions.join("---\n"));
    let op = support::launcher::Operator::start(
        BIN,
        "approval-restarts",
        &configs[2],
        &["-n", &ns.name],
        &[],
    );
    // Every wait announced, and marked so, before anyone decides.
    wait_for("every wait notified", Duration::from_secs(180), || {
        counted.lock().unwrap().notified.len() >= SESSIONS && notified_marks(&ns.name) >= SESSIONS
    });

    approve_all_through_a_restart(&ns.name, configs[0].clone(), "kube-apiserver", 10);
    // One approval of two: nothing ran yet.
    assert!(
        counted.lock().unwrap().calls.is_empty(),
        "a call ran on one approval of two"
    );
    approve_all_through_a_restart(&ns.name, configs[1].clone(), "etcd", 10);

    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "sessions",
        "--all",
        "--timeout=240s",
    ]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        kubectl_ok(["get", "sessions", "-n", &ns.name])
    );
    // Later steps (resyncs) send nothing again either.
    std::thread::sleep(Duration::from_secs(5));
    check_nothing_lost_or_repeated(&ns.name, &counted.lock().unwrap());
    assert_eq!(op.probe("/healthz").0, 200, "{}", op.probe("/healthz").1);
    drop(op);
    for config in &configs {
        let _ = std::fs::remove_file(config);
    }
    ns.delete(&client).await;
    // The cluster is left up and answering.
    api_back();
    let status = String::from_utf8_lossy(&chaos(&["status"]).stdout).to_string();
    assert!(!status.contains(": down"), "{status}");
}

/// Each session's call ran once, under its own key, and its result is the
/// tool's answer to that key; two votes by the two people; one
/// notification per wait.
fn check_nothing_lost_or_repeated(ns: &str, counted: &Counted) {
    let repeated: BTreeMap<&String, &usize> =
        counted.calls.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "calls that ran more than once: {repeated:?}"
    );
    assert_eq!(
        counted.calls.len(),
        SESSIONS,
        "one call per session: {:?}",
        counted.calls
    );
    for i in 0..SESSIONS {
        let s: Value = serde_json::from_str(&kubectl_ok([
            "get",
            "session",
            &format!("s{i}"),
            "-n",
            ns,
            "-o",
            "json",
        ]))
        .unwrap();
        let uid = s["metadata"]["uid"].as_str().unwrap();
        let result = &s["status"]["state"]["turns"][2]["toolResults"][0]["result"];
        assert_eq!(result["status"], "success", "s{i}: {result}");
        let text = result.to_string();
        let key = counted
            .calls
            .keys()
            .find(|k| k.contains(uid))
            .unwrap_or_else(|| panic!("s{i}: no call under its uid {uid}"));
        assert!(
            text.contains(key.as_str()),
            "s{i}: its own call's result: {text}"
        );
        let c = continuation(ns, &token(i));
        let votes: Vec<&str> = c["status"]["decisions"]
            .as_array()
            .map(|v| v.iter().filter_map(|d| d["by"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(votes.len(), 2, "{}: {votes:?}", token(i));
        let notified = counted.notified.get(&token(i)).cloned().unwrap_or_default();
        assert_eq!(notified.len(), 1, "{}: notified {notified:?}", token(i));
    }
    assert_eq!(
        counted.notified.len(),
        SESSIONS,
        "{:?}",
        counted.notified.keys()
    );
}
