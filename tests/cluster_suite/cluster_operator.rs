//! The operator on the real test cluster, driven only through `kubectl`
//! and the `agents` CLI (`--store kube`): the requested flow across an
//! operator crash (SIGKILL and restart), approvals, pause and resume,
//! deletion mid-session, an agent that appears late, a missing Secret,
//! write-once results, the wake latency, and RBAC (a completer may complete
//! a call and nothing else; the operator runs under its ClusterRole).
//!
//! Each test starts its own `agents operator -n NS` child process against
//! its own namespace. Skipped without a cluster unless
//! AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::{Continuation, Session};
use futures::StreamExt;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::http::{Response, Server};
use support::launcher;
use support::{apply, kubectl, kubectl_ok, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn kubeconfig() -> PathBuf {
    support::kubeconfig_path().expect("the test cluster's kubeconfig")
}

/// `agents operator -n NS` as a child process (the shared launcher);
/// SIGKILLed when dropped, its log removed unless the test failed.
struct Operator(launcher::Operator);

impl Operator {
    fn start(ns: &str, kubeconfig: &Path, tag: &str) -> Operator {
        Operator::start_watching(&[ns], kubeconfig, tag)
    }

    /// `agents operator -n NS1 -n NS2 ...`.
    fn start_watching(namespaces: &[&str], kubeconfig: &Path, tag: &str) -> Operator {
        let args: Vec<&str> = namespaces.iter().flat_map(|ns| ["-n", *ns]).collect();
        let name = format!("{}-{tag}", namespaces[0]);
        Operator(launcher::Operator::start(
            BIN,
            &name,
            kubeconfig,
            &args,
            &[],
        ))
    }

    fn kill(&mut self) {
        self.0.kill();
    }

    fn log(&self) -> String {
        self.0.log_text()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
        // Kept when the test fails: it tells what the operator did.
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.0.log);
        }
    }
}

/// `agents ARGS --store kube -n NS` with `kubeconfig`.
fn agents_as(kubeconfig: &Path, ns: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", kubeconfig)
        .env("USER", "tester")
        .env_remove("AGENTS_STORE")
        .env_remove("AGENTS_NAMESPACE")
        .output()
        .expect("run agents")
}

fn agents(ns: &str, args: &[&str]) -> Output {
    agents_as(&kubeconfig(), ns, args)
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn agents_ok(ns: &str, args: &[&str]) -> String {
    let o = agents(ns, args);
    assert!(o.status.success(), "agents {args:?}: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

async fn session(client: &Client, ns: &str, name: &str) -> Session {
    Api::<Session>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap()
}

fn status_json(s: &Session) -> Value {
    serde_json::to_value(s.status.clone().unwrap_or_default()).unwrap()
}

fn condition<'a>(
    s: &'a Session,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    s.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

/// A local HTTP tool server on 127.0.0.1 that counts the idempotency keys
/// it receives. Paths starting with `/slow` answer after a minute,
/// `/sleep/N` after N seconds.
struct ToolServer {
    base: String,
    keys: Arc<Mutex<HashMap<String, usize>>>,
}

impl ToolServer {
    fn start() -> ToolServer {
        let keys: Arc<Mutex<HashMap<String, usize>>> = Default::default();
        let counted = keys.clone();
        let server = Server::start(move |req| {
            let (path, key) = (&req.path, req.header("idempotency-key").unwrap_or(""));
            *counted.lock().unwrap().entry(key.to_string()).or_insert(0) += 1;
            if path.starts_with("/slow") {
                std::thread::sleep(Duration::from_secs(60));
            }
            if let Some(secs) = path.strip_prefix("/sleep/") {
                std::thread::sleep(Duration::from_secs(secs.parse().unwrap_or(1)));
            }
            Response::json(
                200,
                serde_json::json!({"path": path, "key": key}).to_string(),
            )
        });
        ToolServer {
            base: server.url(""),
            keys,
        }
    }

    fn keys(&self) -> HashMap<String, usize> {
        self.keys.lock().unwrap().clone()
    }
}

/// Instants at which the test's own watches saw a continuation's result
/// and the session's next model turn.
struct WakeWatch {
    result_seen: tokio::task::JoinHandle<Instant>,
    model_seen: tokio::task::JoinHandle<Instant>,
}

/// The instant a watch of object `name` first sees it with `done` true.
fn first_seen<K>(
    api: Api<K>,
    name: &str,
    done: impl Fn(K) -> bool + Send + 'static,
) -> tokio::task::JoinHandle<Instant>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let name = name.to_string();
    tokio::spawn(async move {
        let mut stream = watcher::watcher(api, cfg)
            .default_backoff()
            .applied_objects()
            .boxed();
        // A watch error (a dropped connection under load) is retried after
        // a backoff, not taken for the end of the watch.
        while let Some(event) = stream.next().await {
            if event.is_ok_and(&done) {
                return Instant::now();
            }
        }
        panic!("the watch of {name} ended");
    })
}

impl WakeWatch {
    /// Starts watching before the result is written: `token` gets an
    /// outcome (or decision), then session `name` takes agent turn `turns + 1`.
    async fn start(client: &Client, ns: &str, name: &str, token: &str, turns: u32) -> WakeWatch {
        let conts: Api<Continuation> = Api::namespaced(client.clone(), ns);
        let sessions: Api<Session> = Api::namespaced(client.clone(), ns);
        let result_seen = first_seen(conts, token, |c: Continuation| {
            let s = c.status.unwrap_or_default();
            s.outcome.is_some() || s.decision.is_some()
        });
        let model_seen = first_seen(sessions, name, move |s: Session| {
            s.status.map(|s| s.agent_turns).unwrap_or(0) > turns
        });
        // Let both watches list before anything is written.
        tokio::time::sleep(Duration::from_millis(500)).await;
        WakeWatch {
            result_seen,
            model_seen,
        }
    }

    async fn latency(self) -> Duration {
        let wait = Duration::from_secs(60);
        let r = tokio::time::timeout(wait, self.result_seen)
            .await
            .expect("result seen")
            .unwrap();
        let m = tokio::time::timeout(wait, self.model_seen)
            .await
            .expect("next model turn seen")
            .unwrap();
        m.saturating_duration_since(r)
    }
}

/// Reconciles that stepped session `name`, and the API writes they sent,
/// from operator logs (`step session=NS/NAME ... api_writes=N`).
fn api_writes(log: &str, name: &str) -> (u32, u32) {
    let mut steps = 0;
    let mut writes = 0;
    for line in log.lines().filter(|l| l.contains(" step ")) {
        if !line.contains(&format!("/{name} ")) {
            continue;
        }
        steps += 1;
        writes += line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("api_writes="))
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0);
    }
    (steps, writes)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn setup(prefix: &str) -> Option<(Client, TestNamespace)> {
    let client = support::cluster().await?;
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, prefix).await;
    Some((client, ns))
}

fn flow_yaml(tool_base: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: flow-agent}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: fetch, arguments: {{what: now}}}}
            - {{name: fetch_later, arguments: {{what: later}}}}
            - {{name: ask_person, arguments: {{question: "what is the answer?"}}}}
        - text: all three results are in
  tools:
    - {{name: fetch, http: {{url: "{tool_base}/sync"}}}}
    - {{name: fetch_later, http: {{url: "{tool_base}/async"}}}}
    - {{name: ask_person, builtin: {{function: echo}}}}
  policy:
    default: runSync
    rules:
      - {{tool: fetch_later, disposition: runAsync}}
      - {{tool: ask_person, disposition: defer, reason: a person answers}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: flow}}
spec:
  agentRef: {{name: flow-agent}}
  messages: ["fetch two things and ask a person"]
"#
    )
}

/// The requested flow: 3 tool calls (runSync, runAsync, defer); the
/// operator SIGKILLed and restarted while the session waits; the deferred
/// call completed with the CLI; `kubectl wait` for Succeeded; each tool ran
/// once; the model got all 3 results in call order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requested_flow_survives_an_operator_crash() {
    let Some((client, ns)) = setup("op-flow").await else {
        return;
    };
    let tools = ToolServer::start();
    apply(&ns.name, &flow_yaml(&tools.base));
    let mut operator = Operator::start(&ns.name, &kubeconfig(), "first");

    // Waits for the person, after the sync and the background call ran.
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    wait_until(
        Duration::from_secs(60),
        "the session to wait for the person only",
        || async {
            let s = session(&client, &ns.name, "flow").await;
            let st = s.status.as_ref()?;
            let open = &st.state.as_ref()?["open"];
            let done = |i: usize| open["calls"][i]["state"] == "Completed";
            let waiting = condition(&s, "Waiting").is_some_and(|c| c.status == "True");
            (done(0) && done(1) && waiting).then_some(())
        },
    )
    .await;
    // Events are written off the reconcile path, a moment after the step,
    // and a kill in that moment loses them (they are best effort, as
    // every Kubernetes event recorder's are): the crash comes once the
    // Yielded event that the story below tells is written.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), &ns.name);
    wait_until(Duration::from_secs(30), "the Yielded event", || async {
        let listed = events
            .list(&ListParams::default().fields("involvedObject.name=flow,reason=Yielded"))
            .await
            .ok()?;
        (!listed.items.is_empty()).then_some(())
    })
    .await;
    // The runAsync call ran in the operator: its result is in the session
    // (call 1 completed above) and it needed no continuation.
    assert!(
        conts.get_opt("flow-t1-c1").await.unwrap().is_none(),
        "a runAsync call the operator runs itself makes no continuation"
    );
    operator.kill();
    let first_log = operator.log();
    let mut operator = Operator::start(&ns.name, &kubeconfig(), "second");

    let pending = agents_ok(&ns.name, &["session", "pending", "flow"]);
    assert!(pending.contains("flow-t1-c2"), "{pending}");
    assert!(pending.contains("a person answers"), "{pending}");

    let watch = WakeWatch::start(&client, &ns.name, "flow", "flow-t1-c2", 1).await;
    let done = agents_ok(
        &ns.name,
        &["session", "complete", "flow-t1-c2", "--text", "forty-two"],
    );
    assert!(done.contains("completed flow-t1-c2"), "{done}");
    support::wait_session_condition(&ns.name, "flow", "Succeeded", 90);
    let latency = watch.latency().await;
    println!("wake latency (result written -> next model turn committed): {latency:?}");

    let keys = tools.keys();
    assert_eq!(keys.len(), 2, "two tools ran in the operator: {keys:?}");
    for (key, n) in &keys {
        assert_eq!(*n, 1, "{key} ran {n} times");
    }
    assert!(keys.keys().any(|k| k.ends_with("/t1-c0")), "{keys:?}");
    assert!(keys.keys().any(|k| k.ends_with("/t1-c1")), "{keys:?}");

    let s = session(&client, &ns.name, "flow").await;
    let st = status_json(&s);
    assert_eq!(st["answer"], "all three results are in");
    let turns = st["state"]["turns"].as_array().unwrap();
    let results = turns
        .iter()
        .find(|t| t["toolResults"].is_array())
        .expect("a turn with the tool results")["toolResults"]
        .as_array()
        .unwrap()
        .clone();
    let ids: Vec<&str> = results
        .iter()
        .map(|r| r["callId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["t1-c0", "t1-c1", "t1-c2"], "results in call order");
    assert_eq!(results[0]["result"]["response"]["content"]["path"], "/sync");
    assert_eq!(
        results[1]["result"]["response"]["content"]["path"],
        "/async"
    );
    assert_eq!(results[2]["result"]["response"]["content"], "forty-two");
    // The model was asked again only after all three: its second turn
    // follows the results.
    assert_eq!(turns.last().unwrap()["role"], "agent");
    assert_eq!(st["observedGeneration"], 1);
    let ready = condition(&s, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "AgentResolved")
    );

    // kubectl describe tells the story (Events are written off the
    // reconcile path, a moment after the step).
    // Events only where a person needs one: waits and the end; none for
    // routine steps (model replies, successful results).
    let reasons = ["CallDeferred", "Yielded", "Succeeded"];
    let mut described = String::new();
    for _ in 0..40 {
        described = kubectl_ok(["describe", "session", "flow", "-n", &ns.name]);
        if reasons.iter().all(|r| described.contains(r)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    for reason in reasons {
        assert!(
            described.contains(reason),
            "no {reason} event:\n{described}"
        );
    }
    for routine in ["ModelReplied", "ResultArrived", "MessageReceived"] {
        assert!(
            !described.contains(routine),
            "a routine {routine} event:\n{described}"
        );
    }
    assert!(
        operator.log().contains("step"),
        "the restarted operator stepped the session:\n{}",
        operator.log()
    );
    operator.kill();
    let (steps, writes) = api_writes(&(first_log + &operator.log()), "flow");
    println!(
        "API writes by the operator for the flow: {writes} in {steps} reconciles (3 tool calls: {:.1} per call), plus 1 by `complete`",
        writes as f64 / 3.0
    );
    ns.delete(&client).await;
}

/// Approve runs the call; deny reaches the model as an error; a result
/// for a call still waiting for approval is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_runs_the_call_and_deny_tells_the_model() {
    let Some((client, ns)) = setup("op-approve").await else {
        return;
    };
    let tools = ToolServer::start();
    let yaml = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: gated}}
spec:
  messages: ["two risky things"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: deploy, arguments: {{env: staging}}}}
              - {{name: drop_db, arguments: {{db: prod}}}}
          - text: done what was allowed
    tools:
      - {{name: deploy, http: {{url: "{base}/deploy"}}}}
      - {{name: drop_db, http: {{url: "{base}/drop"}}}}
    policy:
      default: runSync
      defaultDecorators: {{approval: true}}
"#,
        base = tools.base
    );
    apply(&ns.name, &yaml);
    let _operator = Operator::start(&ns.name, &kubeconfig(), "approve");
    wait_until(Duration::from_secs(60), "two approvals pending", || async {
        let s = session(&client, &ns.name, "gated").await;
        (condition(&s, "Waiting")?.reason == "AwaitingApproval"
            && s.status.as_ref()?.pending_count == 2)
            .then_some(())
    })
    .await;
    assert!(tools.keys().is_empty(), "nothing ran before a decision");

    let early = agents(
        &ns.name,
        &["session", "complete", "gated-t1-c0", "--text", "x"],
    );
    assert!(!early.status.success(), "{}", text(&early));
    assert!(
        text(&early).contains("waits for an approval"),
        "{}",
        text(&early)
    );

    let watch = WakeWatch::start(&client, &ns.name, "gated", "gated-t1-c1", 1).await;
    agents_ok(&ns.name, &["session", "approve", "gated-t1-c0"]);
    agents_ok(
        &ns.name,
        &[
            "session",
            "deny",
            "gated-t1-c1",
            "--reason",
            "never on prod",
        ],
    );
    support::wait_session_condition(&ns.name, "gated", "Succeeded", 90);
    println!(
        "wake latency (decision -> next model turn): {:?}",
        watch.latency().await
    );

    let keys = tools.keys();
    assert_eq!(keys.len(), 1, "only the approved call ran: {keys:?}");
    assert!(keys.keys().next().unwrap().ends_with("/t1-c0"));
    let st = status_json(&session(&client, &ns.name, "gated").await);
    let results = st["state"]["turns"][2]["toolResults"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(results[0]["result"]["status"], "success");
    assert_eq!(results[1]["result"]["status"], "error");
    assert_eq!(
        results[1]["result"]["message"],
        // Signed with the user the API server knows, not $USER.
        "denied by kubernetes-admin: never on prod"
    );
    ns.delete(&client).await;
}

/// `spec.paused` stops the session after the current step, a result that
/// arrives meanwhile is kept, and `resume` goes on where it left off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_the_session_and_resume_continues() {
    let Some((client, ns)) = setup("op-pause").await else {
        return;
    };
    let yaml = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: held}
spec:
  messages: ["ask and then answer"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: ask, arguments: {q: "?"}}]
          - text: finished after the pause
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      rules:
        - {tool: ask, disposition: defer}
"#;
    apply(&ns.name, yaml);
    let _operator = Operator::start(&ns.name, &kubeconfig(), "pause");
    support::wait_session_condition(&ns.name, "held", "Waiting", 60);
    let out = agents_ok(&ns.name, &["session", "pause", "held"]);
    assert!(out.contains("paused"), "{out}");
    support::wait_session_condition(&ns.name, "held", "Paused", 60);
    agents_ok(
        &ns.name,
        &["session", "complete", "held-t1-c0", "--text", "42"],
    );
    // Held: the result is in its continuation, but no model call starts.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let s = session(&client, &ns.name, "held").await;
    let st = s.status.clone().unwrap();
    assert_eq!(st.agent_turns, 1, "no model call while paused");
    assert_eq!(condition(&s, "Paused").unwrap().status, "True");
    assert!(s.spec.paused);

    let out = agents_ok(&ns.name, &["session", "resume", "held"]);
    assert!(out.contains("resumed"), "{out}");
    support::wait_session_condition(&ns.name, "held", "Succeeded", 60);
    let st = status_json(&session(&client, &ns.name, "held").await);
    assert_eq!(st["answer"], "finished after the pause");
    assert_eq!(
        st["state"]["turns"][2]["toolResults"][0]["result"]["response"]["content"],
        "42"
    );
    ns.delete(&client).await;
}

/// Deleting a Session mid-way removes its continuations (owner references)
/// and stops its background run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_session_leaves_nothing_behind() {
    let Some((client, ns)) = setup("op-delete").await else {
        return;
    };
    let tools = ToolServer::start();
    let yaml = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: doomed}}
spec:
  messages: ["start something slow"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: slow, arguments: {{}}}}
              - {{name: ask, arguments: {{}}}}
          - text: never reached
    tools:
      - {{name: slow, http: {{url: "{base}/slow"}}}}
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
      rules:
        - {{tool: slow, disposition: runAsync, timeoutSeconds: 600}}
        - {{tool: ask, disposition: defer}}
"#,
        base = tools.base
    );
    apply(&ns.name, &yaml);
    let operator = Operator::start(&ns.name, &kubeconfig(), "delete");
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    wait_until(
        Duration::from_secs(60),
        "the deferred call's continuation and the slow call under way",
        || async {
            // The runAsync call runs in the operator and has none.
            let n = conts.list(&ListParams::default()).await.ok()?.items.len();
            (n == 1 && tools.keys().len() == 1).then_some(())
        },
    )
    .await;
    Api::<Session>::namespaced(client.clone(), &ns.name)
        .delete("doomed", &DeleteParams::background())
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(90),
        "continuations garbage-collected",
        || async {
            conts
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .is_empty()
                .then_some(())
        },
    )
    .await;
    wait_until(
        Duration::from_secs(20),
        "the background run stopped",
        || async {
            operator
                .log()
                .contains("its background run is stopped")
                .then_some(())
        },
    )
    .await;
    // Nothing comes back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(conts
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());
    ns.delete(&client).await;
}

/// An unknown agentRef waits with Ready=False AgentNotFound and proceeds
/// once the Agent exists; a missing Secret is a clear condition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_agent_and_a_missing_secret_show_as_conditions() {
    let Some((client, ns)) = setup("op-agent").await else {
        return;
    };
    apply(
        &ns.name,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: early}
spec:
  agentRef: {name: later}
  messages: ["hello"]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: keyed}
spec:
  model:
    provider: openai
    openai:
      baseUrl: http://127.0.0.1:9/v1
      model: gpt-test
      apiKeySecretRef: {name: llm-credentials, key: api-key}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: keyless}
spec:
  agentRef: {name: keyed}
  messages: ["hello"]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: broken}
spec:
  model:
    provider: scripted
    scripted: {replies: [{text: hi}]}
  policy:
    rules:
      - {tool: "[oops", disposition: defer}
"#,
    );
    let _operator = Operator::start(&ns.name, &kubeconfig(), "agent");
    let early = wait_until(
        Duration::from_secs(60),
        "Ready=False AgentNotFound",
        || async {
            let s = session(&client, &ns.name, "early").await;
            let c = condition(&s, "Ready")?.clone();
            (c.reason == "AgentNotFound").then_some(c)
        },
    )
    .await;
    assert_eq!(early.status, "False");
    assert!(early.message.contains("\"later\""), "{}", early.message);
    let keyless = wait_until(
        Duration::from_secs(60),
        "Ready=False SecretNotUsable",
        || async {
            let s = session(&client, &ns.name, "keyless").await;
            let c = condition(&s, "Ready")?.clone();
            (c.reason == "SecretNotUsable").then_some(c)
        },
    )
    .await;
    assert_eq!(keyless.status, "False");
    assert!(
        keyless.message.contains("llm-credentials")
            && keyless
                .message
                .contains("agents-exe.io/usable-by-agents=true"),
        "{}",
        keyless.message
    );
    assert_eq!(
        session(&client, &ns.name, "keyless")
            .await
            .status
            .unwrap()
            .agent_turns,
        0
    );

    apply(
        &ns.name,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: later}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - text: here at last
"#,
    );
    support::wait_session_condition(&ns.name, "early", "Succeeded", 60);
    // Each Agent reports whether it is usable, before any session runs it.
    let agents_api: Api<agents::api::Agent> = Api::namespaced(client.clone(), &ns.name);
    let agent_ready = |name: &'static str| {
        let api = agents_api.clone();
        async move {
            wait_until(
                Duration::from_secs(60),
                &format!("agent {name} Ready"),
                || async {
                    let a = api.get(name).await.ok()?;
                    let st = a.status?;
                    let c = st.conditions.iter().find(|c| c.type_ == "Ready")?.clone();
                    (st.observed_generation == a.metadata.generation).then_some(c)
                },
            )
            .await
        }
    };
    let later = agent_ready("later").await;
    assert_eq!(
        (later.status.as_str(), later.reason.as_str()),
        ("True", "Valid")
    );
    let keyed = agent_ready("keyed").await;
    assert_eq!(
        (keyed.status.as_str(), keyed.reason.as_str()),
        ("False", "SecretNotUsable")
    );
    let broken = agent_ready("broken").await;
    assert_eq!(
        (broken.status.as_str(), broken.reason.as_str()),
        ("False", "InvalidAgent")
    );
    assert!(
        broken.message.contains("policy.rules[0].tool") && broken.message.contains("[oops"),
        "{}",
        broken.message
    );
    let s = session(&client, &ns.name, "early").await;
    assert_eq!(condition(&s, "Ready").unwrap().status, "True");
    assert_eq!(s.status.unwrap().answer.as_deref(), Some("here at last"));
    ns.delete(&client).await;
}

/// A completed token completed again: the same result is harmless, a
/// different one exits 3; an unknown token says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_different_result_exits_3() {
    let Some((client, ns)) = setup("op-once").await else {
        return;
    };
    apply(
        &ns.name,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: once}
spec:
  messages: ["ask"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: ask, arguments: {}}]
          - text: thanks
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      rules:
        - {tool: ask, disposition: defer}
"#,
    );
    let _operator = Operator::start(&ns.name, &kubeconfig(), "once");
    support::wait_session_condition(&ns.name, "once", "Waiting", 60);
    agents_ok(
        &ns.name,
        &["session", "complete", "once-t1-c0", "--text", "first"],
    );
    support::wait_session_condition(&ns.name, "once", "Succeeded", 60);
    let same = agents_ok(
        &ns.name,
        &["session", "complete", "once-t1-c0", "--text", "first"],
    );
    assert!(same.contains("already completed"), "{same}");
    let other = agents(
        &ns.name,
        &["session", "complete", "once-t1-c0", "--text", "second"],
    );
    assert_eq!(other.status.code(), Some(3), "{}", text(&other));
    assert!(
        text(&other).contains("already completed (by kubernetes-admin"),
        "{}",
        text(&other)
    );
    let unknown = agents(
        &ns.name,
        &["session", "complete", "nope-t1-c0", "--text", "x"],
    );
    assert_eq!(unknown.status.code(), Some(1), "{}", text(&unknown));
    assert!(
        text(&unknown).contains("no continuation with token nope-t1-c0"),
        "{}",
        text(&unknown)
    );
    let st = status_json(&session(&client, &ns.name, "once").await);
    assert_eq!(
        st["state"]["turns"][2]["toolResults"][0]["result"]["response"]["content"],
        "first"
    );
    // The CLI reads the session back as the operator left it.
    let shown = agents_ok(&ns.name, &["session", "show", "once"]);
    assert!(
        shown.contains("Succeeded") && shown.contains("answer: thanks"),
        "{shown}"
    );
    let listed = agents_ok(&ns.name, &["session", "list"]);
    assert!(
        listed.contains("once") && listed.contains("Succeeded"),
        "{listed}"
    );
    ns.delete(&client).await;
}

/// The delay from a result write to the next model turn, over several
/// sessions: p50 and p99.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_latency_over_sessions() {
    let Some((client, ns)) = setup("op-wake").await else {
        return;
    };
    const N: usize = 8;
    let mut yaml = String::new();
    for i in 0..N {
        yaml.push_str(&format!(
            r#"
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: w{i}}}
spec:
  messages: ["ask"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: ask, arguments: {{}}}}]
          - text: woke
    tools:
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
      rules:
        - {{tool: ask, disposition: defer}}
"#
        ));
    }
    apply(&ns.name, &yaml);
    let _operator = Operator::start(&ns.name, &kubeconfig(), "wake");
    let mut latencies = Vec::new();
    for i in 0..N {
        let name = format!("w{i}");
        support::wait_session_condition(&ns.name, &name, "Waiting", 60);
        let token = format!("{name}-t1-c0");
        let watch = WakeWatch::start(&client, &ns.name, &name, &token, 1).await;
        agents_ok(&ns.name, &["session", "complete", &token, "--text", "ok"]);
        latencies.push(watch.latency().await);
    }
    latencies.sort();
    println!(
        "wake latency over {N} sessions (result written -> next model turn committed): p50 {:?}, p99 {:?}, max {:?}",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().unwrap()
    );
    assert!(
        percentile(&latencies, 0.5) < Duration::from_secs(5),
        "a result wakes its session by watch, not by a poll: {latencies:?}"
    );
    ns.delete(&client).await;
}

/// The chart's RBAC and ServiceAccount, with the release's objects named
/// `<release>-...`.
fn rbac_manifests(release: &str, ns: &str) -> String {
    support::helm_template(
        release,
        ns,
        &[
            "--show-only",
            "templates/rbac.yaml",
            "--show-only",
            "templates/serviceaccount.yaml",
        ],
    )
}

/// A Session that waits for an outside party's result.
const GUARDED: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: guarded}
spec:
  messages: ["ask"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: ask, arguments: {}}]
          - text: completed by the completer
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      rules:
        - {tool: ask, disposition: defer}
"#;

/// The operator runs under its ClusterRole only, bound by a RoleBinding in
/// each namespace it watches: the release's and a team's. The completer
/// ClusterRole, bound by a RoleBinding in the team's namespace to a
/// service account of that namespace (not the release's), lets it complete
/// a call there with the CLI but not edit a Session; in the release's
/// namespace, where nothing binds it, it may not complete a call at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_the_operator_role_suffices_and_a_completer_only_completes() {
    let Some((client, ns)) = setup("op-rbac").await else {
        return;
    };
    let team = TestNamespace::create(&client, "op-rbac-team").await;
    let release = ns.name.clone();
    // Cluster-scoped: not deleted with the namespace, so deleted on drop
    // (also when the test fails).
    let _cluster_scoped = support::ClusterScoped(vec![
        format!("clusterrole/{release}-operator"),
        format!("clusterrolebinding/{release}-operator"),
        format!("clusterrole/{release}-completer"),
    ]);
    apply(&ns.name, &rbac_manifests(&release, &ns.name));
    // Namespace-scoped run: the ClusterRole bound in the two watched
    // namespaces only.
    for watched in [&ns.name, &team.name] {
        kubectl_ok([
            "create",
            "rolebinding",
            "operator-here",
            "-n",
            watched,
            &format!("--clusterrole={release}-operator"),
            &format!("--serviceaccount={}:{release}-operator", ns.name),
        ]);
    }
    // The completer lives in the team's namespace and is bound there only.
    kubectl_ok(["create", "serviceaccount", "completer", "-n", &team.name]);
    kubectl_ok([
        "create",
        "rolebinding",
        "completer",
        "-n",
        &team.name,
        &format!("--clusterrole={release}-completer"),
        &format!("--serviceaccount={}:completer", team.name),
    ]);
    let operator_config =
        support::service_account_kubeconfig(&ns.name, &format!("{release}-operator"));
    let completer_config = support::service_account_kubeconfig(&team.name, "completer");
    apply(&team.name, GUARDED);
    apply(&ns.name, GUARDED);
    let operator = Operator::start_watching(&[&ns.name, &team.name], &operator_config, "rbac");
    for watched in [&ns.name, &team.name] {
        let waited = kubectl([
            "wait",
            "-n",
            watched,
            "--for=condition=Waiting",
            "session/guarded",
            "--timeout=60s",
        ]);
        assert!(
            waited.status.success(),
            "the operator under its ClusterRole did not get the session in {watched} waiting:\n{}",
            operator.log()
        );
    }
    let as_completer = |ns: &str, args: &[&str]| agents_as(&completer_config, ns, args);
    let denied = as_completer(&team.name, &["session", "pause", "guarded"]);
    assert!(!denied.status.success(), "{}", text(&denied));
    assert!(
        text(&denied).to_lowercase().contains("forbidden"),
        "{}",
        text(&denied)
    );
    let patch = Command::new(support::kubectl_path())
        .args(["--kubeconfig", completer_config.to_str().unwrap()])
        .args([
            "patch",
            "session",
            "guarded",
            "-n",
            &team.name,
            "--type=merge",
        ])
        .args(["-p", r#"{"spec":{"paused":true}}"#])
        .output()
        .unwrap();
    assert!(!patch.status.success(), "a completer edited a Session");
    assert!(String::from_utf8_lossy(&patch.stderr).contains("forbidden"));

    // In the release's namespace nothing binds the completer.
    let elsewhere = as_completer(
        &ns.name,
        &[
            "session",
            "complete",
            "guarded-t1-c0",
            "--text",
            "from the wrong namespace",
        ],
    );
    assert!(!elsewhere.status.success(), "{}", text(&elsewhere));
    assert!(
        text(&elsewhere).to_lowercase().contains("forbidden"),
        "{}",
        text(&elsewhere)
    );
    let untouched: Continuation = Api::namespaced(client.clone(), &ns.name)
        .get("guarded-t1-c0")
        .await
        .unwrap();
    let untouched = serde_json::to_value(untouched.status.unwrap_or_default()).unwrap();
    assert!(untouched["outcome"].is_null(), "{untouched}");

    let done = as_completer(
        &team.name,
        &[
            "session",
            "complete",
            "guarded-t1-c0",
            "--text",
            "from the completer",
        ],
    );
    assert!(done.status.success(), "{}", text(&done));
    support::wait_session_condition(&team.name, "guarded", "Succeeded", 60);
    let s = session(&client, &team.name, "guarded").await;
    assert!(!s.spec.paused);
    assert_eq!(status_json(&s)["answer"], "completed by the completer");
    let waiting = session(&client, &ns.name, "guarded").await;
    assert_eq!(status_json(&waiting)["phase"], "Waiting");
    assert!(
        !operator.log().to_lowercase().contains("forbidden"),
        "the operator hit a permission it lacks:\n{}",
        operator.log()
    );
    drop(operator);
    // They hold tokens.
    let _ = std::fs::remove_file(&operator_config);
    let _ = std::fs::remove_file(&completer_config);
    team.delete(&client).await;
    ns.delete(&client).await;
}

/// Isolated calls wait for a worker until the Job runner comes:
/// `agents session run-isolated --store kube` runs them as local processes
/// under a claim, and the operator takes the session on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_call_runs_with_the_cli_worker() {
    let Some((client, ns)) = setup("op-iso").await else {
        return;
    };
    // The worker runs the image tool in the local engine: the image must be
    // there, whichever tests ran before (none, on a fresh machine).
    let Some(_engine) = support::podman_busybox_or_skip() else {
        return;
    };
    apply(
        &ns.name,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: iso}
spec:
  messages: ["measure"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: measure, arguments: {}}]
          - text: measured
    tools:
      - name: measure
        container: {image: "agents.local/busybox:ci", command: ["/bin/sh", "-c", "echo isolated-ok"]}
"#,
    );
    let _operator = Operator::start(&ns.name, &kubeconfig(), "iso");
    let waiting = wait_until(Duration::from_secs(60), "AwaitingJob", || async {
        let s = session(&client, &ns.name, "iso").await;
        let c = condition(&s, "Waiting")?.clone();
        (c.reason == "AwaitingJob").then_some(c)
    })
    .await;
    assert!(waiting.message.contains("iso-t1-c0"), "{}", waiting.message);
    let pending = agents_ok(&ns.name, &["session", "pending", "iso"]);
    assert!(
        pending.contains("run-isolated iso --store kube"),
        "{pending}"
    );
    let worker = agents_ok(&ns.name, &["session", "run-isolated", "iso"]);
    assert!(worker.contains("isolated-ok"), "{worker}");
    support::wait_session_condition(&ns.name, "iso", "Succeeded", 60);
    let st = status_json(&session(&client, &ns.name, "iso").await);
    let result = &st["state"]["turns"][2]["toolResults"][0]["result"];
    assert_eq!(result["response"]["content"], "isolated-ok", "{result}");
    ns.delete(&client).await;
}

/// A background run under way when the operator is SIGKILLed runs again
/// after the restart, under the same idempotency key, and its result
/// reaches the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_run_cut_by_a_crash_runs_again_under_the_same_key() {
    let Some((client, ns)) = setup("op-rerun").await else {
        return;
    };
    let tools = ToolServer::start();
    let yaml = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: rerun}}
spec:
  messages: ["fetch slowly"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: fetch, arguments: {{}}}}]
          - text: fetched
    tools:
      - {{name: fetch, http: {{url: "{base}/sleep/4"}}}}
    policy:
      rules:
        - {{tool: fetch, disposition: runAsync, timeoutSeconds: 30}}
"#,
        base = tools.base
    );
    apply(&ns.name, &yaml);
    let mut operator = Operator::start(&ns.name, &kubeconfig(), "rerun-first");
    wait_until(
        Duration::from_secs(60),
        "the background run to start",
        || async { (tools.keys().len() == 1).then_some(()) },
    )
    .await;
    operator.kill();
    let _operator = Operator::start(&ns.name, &kubeconfig(), "rerun-second");
    support::wait_session_condition(&ns.name, "rerun", "Succeeded", 90);
    let keys = tools.keys();
    assert_eq!(keys.len(), 1, "one call, one key: {keys:?}");
    let (key, runs) = keys.iter().next().unwrap();
    assert!(key.ends_with("/t1-c0"), "{key}");
    assert_eq!(
        *runs, 2,
        "cut once by the crash, run again after it: {keys:?}"
    );
    let st = status_json(&session(&client, &ns.name, "rerun").await);
    assert_eq!(
        st["state"]["turns"][2]["toolResults"][0]["result"]["status"],
        "success"
    );
    ns.delete(&client).await;
}

/// A minimal chat-completions endpoint on 127.0.0.1: answers 503 while
/// `failing`, else a final answer; records the Authorization headers.
struct ChatServer {
    base: String,
    failing: Arc<std::sync::atomic::AtomicBool>,
    auth: Arc<Mutex<Vec<String>>>,
}

impl ChatServer {
    fn start() -> ChatServer {
        let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let auth: Arc<Mutex<Vec<String>>> = Default::default();
        let (f, a) = (failing.clone(), auth.clone());
        let server = Server::start(move |req| {
            let authorization = req.header("authorization").unwrap_or("").to_string();
            a.lock().unwrap().push(authorization);
            if f.load(std::sync::atomic::Ordering::SeqCst) {
                Response::json(503, r#"{"error":{"message":"overloaded"}}"#)
            } else {
                Response::json(200, serde_json::json!({
                    "choices": [{"message": {"role": "assistant", "content": "hello from the fake"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4}
                }).to_string())
            }
        });
        ChatServer {
            base: server.url("/v1"),
            failing,
            auth,
        }
    }
}

/// The OpenAI key comes from the Secret the Agent names and reaches the
/// model, never status, Events or logs; `maxRetries` holds; a session that
/// failed on its model runs again after `agents session retry`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_key_comes_from_the_secret_and_retry_reruns_a_failed_session() {
    let Some((client, ns)) = setup("op-model").await else {
        return;
    };
    const KEY: &str = "sk-test-Zq81rT0pSecret";
    let chat = ChatServer::start();
    kubectl_ok([
        "create",
        "secret",
        "generic",
        "llm-credentials",
        "-n",
        &ns.name,
        &format!("--from-literal=api-key={KEY}"),
    ]);
    kubectl_ok([
        "label",
        "secret",
        "llm-credentials",
        "-n",
        &ns.name,
        "agents-exe.io/usable-by-agents=true",
    ]);
    apply(
        &ns.name,
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: chatty}}
spec:
  model:
    provider: openai
    timeoutSeconds: 5
    maxRetries: 0
    openai:
      baseUrl: "{base}"
      model: gpt-test
      apiKeySecretRef: {{name: llm-credentials, key: api-key}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: talk}}
spec:
  agentRef: {{name: chatty}}
  messages: ["hello?"]
"#,
            base = chat.base
        ),
    );
    let operator = Operator::start(&ns.name, &kubeconfig(), "model");
    support::wait_session_condition(&ns.name, "talk", "Failed", 60);
    let failed = session(&client, &ns.name, "talk").await;
    assert!(
        failed
            .status
            .as_ref()
            .unwrap()
            .failure
            .as_deref()
            .unwrap_or("")
            .contains("503"),
        "{:?}",
        failed.status
    );
    assert_eq!(
        chat.auth.lock().unwrap().len(),
        1,
        "maxRetries: 0 means one request"
    );

    chat.failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let out = agents_ok(&ns.name, &["session", "retry", "talk"]);
    assert!(out.contains("retries"), "{out}");
    support::wait_session_condition(&ns.name, "talk", "Succeeded", 60);
    let s = session(&client, &ns.name, "talk").await;
    assert_eq!(
        s.status.as_ref().unwrap().answer.as_deref(),
        Some("hello from the fake")
    );
    assert_eq!(s.status.as_ref().unwrap().retries_taken, 1);
    let auth = chat.auth.lock().unwrap().clone();
    assert_eq!(auth.len(), 2, "{auth:?}");
    assert!(
        auth.iter().all(|a| a == &format!("Bearer {KEY}")),
        "{auth:?}"
    );

    let stored = kubectl_ok([
        "get",
        "sessions,continuations,agents",
        "-n",
        &ns.name,
        "-o",
        "yaml",
    ]);
    let events = kubectl_ok(["get", "events", "-n", &ns.name, "-o", "yaml"]);
    assert!(!stored.contains(KEY), "the key leaked into an object");
    assert!(!events.contains(KEY), "the key leaked into an Event");
    assert!(!operator.log().contains(KEY), "the key leaked into the log");
    ns.delete(&client).await;
}

/// A Session re-created under the same name never adopts the old one's
/// continuation (same token, other owner UID); once that is gone, it
/// creates its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_session_does_not_adopt_the_old_ones_continuation() {
    let Some((client, ns)) = setup("op-adopt").await else {
        return;
    };
    let yaml = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: again}
spec:
  messages: ["ask"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: ask, arguments: {}}]
          - text: thanks
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      rules:
        - {tool: ask, disposition: defer}
"#;
    apply(&ns.name, yaml);
    let operator = Operator::start(&ns.name, &kubeconfig(), "adopt");
    support::wait_session_condition(&ns.name, "again", "Waiting", 60);
    // The wait is committed to status before its continuation is created.
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let old_owner = wait_until(
        Duration::from_secs(30),
        "the first continuation",
        || async {
            let c = conts.get_opt("again-t1-c0").await.ok()??;
            Some(c.metadata.owner_references?.first()?.uid.clone())
        },
    )
    .await;
    // Orphaned by hand, then the session deleted: `--cascade=orphan` leaves
    // the orphaning to the garbage collector, which right after the CRDs'
    // install may not watch Continuations yet; it then drops the finalizer
    // without orphaning and later deletes the continuation as a dependent of
    // a gone owner.
    kubectl_ok([
        "patch",
        "continuation",
        "again-t1-c0",
        "-n",
        &ns.name,
        "--type=json",
        "-p",
        r#"[{"op": "remove", "path": "/metadata/ownerReferences"}]"#,
    ]);
    kubectl_ok(["delete", "session", "again", "-n", &ns.name]);
    apply(&ns.name, yaml);
    wait_until(Duration::from_secs(60), "the refusal to adopt", || async {
        operator
            .log()
            .contains("is not this session's")
            .then_some(())
    })
    .await;
    // Orphaned: it kept its name and has no owner, and the new session did
    // not take it.
    let kept = conts
        .get_opt("again-t1-c0")
        .await
        .unwrap()
        .expect("the orphaned continuation is gone");
    assert!(
        kept.metadata
            .owner_references
            .clone()
            .unwrap_or_default()
            .is_empty(),
        "{:?}",
        kept.metadata
    );

    kubectl_ok(["delete", "continuation", "again-t1-c0", "-n", &ns.name]);
    let fresh_uid = session(&client, &ns.name, "again")
        .await
        .metadata
        .uid
        .unwrap();
    let new_owner = wait_until(Duration::from_secs(60), "its own continuation", || async {
        let c = conts.get_opt("again-t1-c0").await.ok()??;
        Some(c.metadata.owner_references?.first()?.uid.clone())
    })
    .await;
    assert_eq!(new_owner, fresh_uid);
    assert_ne!(new_owner, old_owner);
    ns.delete(&client).await;
}

/// A step that fails for a reason of the session's own (its continuation
/// refused by an admission policy of the namespace: a real refusal, unlike
/// a ResourceQuota's, which is a wait) is counted in the session's
/// status: an operator SIGKILLed after a few failures and started again
/// goes on counting, and the session fails after 8 in all, not 8 more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_steps_are_counted_across_an_operator_restart() {
    let Some((client, ns)) = setup("op-failcount").await else {
        return;
    };
    let policy = format!("{}-no-continuations", ns.name);
    let _cluster_scoped = support::ClusterScoped(vec![
        format!("validatingadmissionpolicy/{policy}"),
        format!("validatingadmissionpolicybinding/{policy}"),
    ]);
    apply(
        &ns.name,
        &format!(
            r#"
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {{name: {policy}}}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - {{apiGroups: [agents-exe.io], apiVersions: ["*"], operations: [CREATE], resources: [continuations]}}
  validations:
    - {{expression: "false", reason: Forbidden, message: "this namespace's admission policy refuses every Continuation"}}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {{name: {policy}}}
spec:
  policyName: {policy}
  validationActions: [Deny]
  matchResources:
    namespaceSelector:
      matchLabels: {{kubernetes.io/metadata.name: {ns}}}
"#,
            ns = ns.name
        ),
    );
    // The policy takes a moment to be enforced after it is created.
    std::thread::sleep(Duration::from_secs(2));
    apply(
        &ns.name,
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: asks}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{name: ask_person, arguments: {question: "?"}}]
  tools: [{name: ask_person, builtin: {function: echo}}]
  policy:
    default: runSync
    rules: [{tool: ask_person, disposition: defer, reason: a person answers}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: refused}
spec:
  agentRef: {name: asks}
  messages: ["ask a person"]
"#,
    );
    let failed_steps = |s: &Session| status_json(s)["state"]["failedSteps"].as_u64().unwrap_or(0);
    let mut operator = Operator::start(&ns.name, &kubeconfig(), "first");
    wait_until(Duration::from_secs(60), "three failed steps", || async {
        let s = session(&client, &ns.name, "refused").await;
        (failed_steps(&s) >= 3).then_some(())
    })
    .await;
    operator.kill();
    let before = failed_steps(&session(&client, &ns.name, "refused").await);
    assert!(before < 8, "killed before the session failed: {before}");
    let operator = Operator::start(&ns.name, &kubeconfig(), "second");
    support::wait_session_condition(&ns.name, "refused", "Failed", 120);
    let s = session(&client, &ns.name, "refused").await;
    let failure = status_json(&s)["failure"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        failure.starts_with("8 steps in a row failed")
            && failure.contains("admission policy refuses every Continuation"),
        "{failure}"
    );
    let counted_here = operator.log().matches("reconcile failed; retrying").count();
    assert!(
        counted_here < 8,
        "the restarted operator went on from {before}, it did not count 8 anew: {counted_here} failures"
    );
    assert_eq!(failed_steps(&s), 0, "a retry would count afresh");
}
