//! What flows down a sub-agent tree on the real test cluster:
//! - deletion: the root deleted mid-run takes every descendant with it
//!   (ownerReferences, collected by the cluster's garbage collector in
//!   kube-controller-manager), the grandchild's tool Job and its pod go,
//!   and the child's open MCP task gets `tasks/cancel` (the child's
//!   finalizer holds its deletion until the cancel is sent);
//! - pause: pausing the root pauses its running descendants, nothing steps
//!   while paused (the fake model counts turns), resuming the root resumes
//!   them; a child a person paused stays paused until the person resumes
//!   it; the tree then finishes with each turn asked once.
//!
//! Each test starts its own `agents operator -n NS` child process.

use crate::cluster_subagent_waits::{agents, said};
use crate::cluster_subagents::{check_effects, model, tree_agents_yaml, tree_turns, Seen};
use crate::support;

use serde_json::Value;
use std::time::{Duration, Instant};
use support::launcher::Operator;
use support::mcp::McpServer;
use support::{apply, kubectl_ok, wait_until, BUSYBOX_IMAGE};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const PAUSED_BY_PARENT: &str = "agents-exe.io/paused-by-parent";

/// `boss` calls `mid`; `mid` calls `slow` (a sub-agent) and the MCP
/// server's `long_job` (a task of ten minutes); `slow` runs a tool Job
/// that sleeps ten minutes. Scripted models: nothing here answers.
fn doomed_tree(mcp_url: &str) -> String {
    format!(
        r#"---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: boss}}
spec:
  model: {{provider: scripted, scripted: {{replies: [{{toolCalls: [{{name: mid, arguments: {{prompt: go}}}}]}}, {{text: never}}]}}}}
  tools: [{{name: mid, agent: {{ref: mid}}}}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: mid}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: slow, arguments: {{prompt: sleep}}}}
            - {{name: long_job, arguments: {{text: never, ms: 600000}}}}
        - text: never
  tools:
    - {{name: slow, agent: {{ref: slow}}}}
    - {{name: jobs, mcp: {{url: "{mcp_url}", tools: [long_job]}}}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: slow}}
spec:
  model: {{provider: scripted, scripted: {{replies: [{{toolCalls: [{{name: sleeper, arguments: {{}}}}]}}, {{text: never}}]}}}}
  tools:
    - name: sleeper
      container: {{image: {BUSYBOX_IMAGE}, command: ["/bin/sh", "-c", "echo sleeping; sleep 600"]}}
  policy: {{default: runIsolated}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: root}}
spec: {{agentRef: {{name: boss}}, messages: [go]}}
"#
    )
}

fn get_json(ns: &str, what: &str) -> Value {
    serde_json::from_str(&kubectl_ok(["get", "-n", ns, what, "-o", "json"])).unwrap()
}

/// The names of the `kind` objects in `ns`.
fn names(ns: &str, kind: &str) -> Vec<String> {
    get_json(ns, kind)["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// The id of the open MCP task `session` waits on, if it waits on one.
fn open_task(ns: &str, session: &str) -> Option<String> {
    let out = support::kubectl(["get", "-n", ns, "session", session, "-o", "json"]);
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    let calls = v["status"]["state"]["open"]["calls"].as_array()?;
    calls
        .iter()
        .find(|c| c["waitingFor"] == "mcpTask")
        .and_then(|c| c["task"]["id"].as_str().map(str::to_string))
}

fn running_pod(ns: &str) -> bool {
    get_json(ns, "pods")["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["status"]["phase"] == "Running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_root_takes_the_tree_and_cancels_its_jobs_and_mcp_tasks() {
    let Some((client, ns)) = support::cluster_namespace("subagents-delete").await else {
        return;
    };
    let Some(image) = support::agents_image() else {
        return;
    };
    let server = McpServer::start("cluster-tree-delete", &[]);
    let allowed = format!(
        "--http-tool-allowed-urls=http://127.0.0.1:{}/*",
        server.port
    );
    let kubeconfig = support::kubeconfig_path().expect("kubeconfig");
    let args = ["-n", &ns.name, "--agents-image", &image, &allowed];
    let op = Operator::start(BIN, &format!("{}-delete", ns.name), &kubeconfig, &args, &[]);
    apply(&ns.name, &doomed_tree(&server.url()));
    let (child, grandchild) = ("root-t1-c0", "root-t1-c0-t1-c0");
    let task = wait_until(Duration::from_secs(120), "the task and the Job run", || {
        let ns = ns.name.clone();
        async move {
            let task = open_task(&ns, child)?;
            running_pod(&ns).then_some(task)
        }
    })
    .await;
    let sessions = names(&ns.name, "sessions");
    assert_eq!(sessions.len(), 3, "{sessions:?}");
    assert!(sessions.iter().any(|s| s == grandchild), "{sessions:?}");
    let jobs = names(&ns.name, "jobs");
    assert_eq!(jobs.len(), 1, "the grandchild's Job: {jobs:?}");
    assert!(!names(&ns.name, "continuations").is_empty());

    let deleted = Instant::now();
    kubectl_ok(["delete", "-n", &ns.name, "session/root", "--wait=false"]);
    let kinds = ["sessions", "continuations", "jobs", "pods"];
    wait_until(Duration::from_secs(90), "the whole tree gone", || {
        let ns = ns.name.clone();
        async move { kinds.iter().all(|k| names(&ns, k).is_empty()).then_some(()) }
    })
    .await;
    println!(
        "the tree, its Continuations, Job and pod gone {:?} after the root's deletion",
        deleted.elapsed()
    );
    // Nothing comes back: no step of a deleted session makes a child again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for kind in kinds {
        assert_eq!(names(&ns.name, kind), Vec::<String>::new(), "{kind}");
    }
    let log = op.log_text();
    drop(op);
    let cancels: Vec<Value> = server
        .calls()
        .into_iter()
        .filter(|c| c["method"] == "tasks/cancel")
        .collect();
    assert_eq!(cancels.len(), 1, "{cancels:?}\n{log}");
    assert_eq!(cancels[0]["taskId"], task.as_str(), "{log}");
    ns.delete(&client).await;
}

/// Each session of the tree: (name, spec.paused, paused by its parent,
/// phase).
fn tree_state(ns: &str) -> Vec<(String, bool, bool, String)> {
    get_json(ns, "sessions")["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let name = s["metadata"]["name"].as_str().unwrap_or("").to_string();
            let paused = s["spec"]["paused"] == true;
            let by_parent = s["metadata"]["annotations"][PAUSED_BY_PARENT].is_string();
            let phase = s["status"]["phase"].as_str().unwrap_or("").to_string();
            (name, paused, by_parent, phase)
        })
        .collect()
}

fn agents_ok(ns: &str, args: &[&str]) -> String {
    let out = agents(ns, args);
    assert!(out.status.success(), "agents {args:?}: {}", said(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn turns_asked(seen: &Seen) -> u32 {
    seen.turns.lock().unwrap().values().sum()
}

/// The tree of `cluster_subagents` whose leaves wait for an approval
/// before their effect. With every leaf waiting, a person pauses one
/// child (`root-t1-c1`), then the root is paused: every running
/// descendant is paused, the others by their parent. The leaves' approvals
/// given while paused start nothing. Resuming the root resumes what it
/// paused and the other two branches finish; the child the person paused
/// (and the leaves it paused) stay paused until the person resumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_the_root_pauses_the_tree_and_resuming_it_resumes_the_tree() {
    let Some((client, ns)) = support::cluster_namespace("subagents-pause").await else {
        return;
    };
    let seen = Seen::default();
    let server = model(seen.clone());
    let approval = "{rules: [{tool: effect, disposition: runSync, approval: {}}]}";
    apply(&ns.name, &tree_agents_yaml(server.port, approval));
    let op = Operator::watching(BIN, &ns.name, "pause");
    apply(
        &ns.name,
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: root}\nspec: {agentRef: {name: planner}, messages: [root]}\n",
    );
    let tokens = wait_until(Duration::from_secs(90), "six leaves waiting", || {
        let ns = ns.name.clone();
        async move {
            let out = agents(&ns, &["session", "pending", "root", "-o", "json"]);
            let list: Value = serde_json::from_slice(&out.stdout).ok()?;
            let tokens: Vec<String> = list
                .as_array()?
                .iter()
                .filter_map(|w| w["token"].as_str().map(str::to_string))
                .collect();
            (tokens.len() == 6).then_some(tokens)
        }
    })
    .await;
    let (mine, before) = ("root-t1-c1", turns_asked(&seen));
    assert_eq!(before, 10, "each session's first turn: {:?}", seen.turns);

    agents_ok(&ns.name, &["session", "pause", mine]);
    agents_ok(&ns.name, &["session", "pause", "root"]);
    let state = wait_until(Duration::from_secs(60), "the tree paused", || {
        let ns = ns.name.clone();
        async move {
            let state = tree_state(&ns);
            (state.len() == 10 && state.iter().all(|s| s.1)).then_some(state)
        }
    })
    .await;
    for (name, _, by_parent, _) in &state {
        let expected = name != "root" && name != mine;
        assert_eq!(
            *by_parent, expected,
            "{name} paused by its parent: {state:?}"
        );
    }
    for token in &tokens {
        agents_ok(&ns.name, &["session", "approve", token, "--by", "alice"]);
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        turns_asked(&seen),
        before,
        "nothing steps while the tree is paused: {:?}",
        seen.turns
    );
    assert_eq!(
        seen.effects.lock().unwrap().len(),
        4,
        "no leaf's effect ran"
    );

    agents_ok(&ns.name, &["session", "resume", "root"]);
    let state = wait_until(Duration::from_secs(90), "two branches finish", || {
        let ns = ns.name.clone();
        async move {
            let state = tree_state(&ns);
            let done = |n: &str| state.iter().any(|s| s.0 == n && s.3 == "Succeeded");
            (done("root-t1-c0") && done("root-t1-c2")).then_some(state)
        }
    })
    .await;
    for (name, paused, _, phase) in &state {
        let held = name.starts_with(mine);
        assert_eq!(*paused, held, "{name}: {state:?}");
        if held || name == "root" {
            assert_ne!(phase, "Succeeded", "{name} went on: {state:?}");
        } else {
            assert_eq!(phase, "Succeeded", "{name}: {state:?}");
        }
    }
    let asked = seen.turns.lock().unwrap().clone();
    for leaf in ["root.1.0", "root.1.1"] {
        assert!(!asked.contains_key(&(leaf.into(), 1)), "{leaf}: {asked:?}");
    }
    // The person resumes their child; it resumes the leaves it paused.
    agents_ok(&ns.name, &["session", "resume", mine]);
    wait_until(Duration::from_secs(90), "the root finished", || {
        let ns = ns.name.clone();
        async move {
            let state = tree_state(&ns);
            let root = state.iter().find(|s| s.0 == "root")?;
            (root.3 == "Succeeded").then_some(())
        }
    })
    .await;
    let log = op.log_text();
    drop(op);
    let turns = seen.turns.lock().unwrap().clone();
    let wanted = tree_turns();
    assert_eq!(turns.len(), wanted.len(), "{turns:?}");
    for turn in &wanted {
        assert_eq!(
            turns.get(turn),
            Some(&1),
            "{turn:?} asked once: {turns:?}\n{log}"
        );
    }
    let names: Vec<String> = tree_state(&ns.name).into_iter().map(|s| s.0).collect();
    check_effects(&seen, &names, 0);
    ns.delete(&client).await;
}
