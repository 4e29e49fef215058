//! Sub-agents on the real test cluster: a root Session whose Agent calls
//! another Agent as a tool (3 children), each of which calls a third (2
//! grandchildren each), against an OpenAI-compatible fake model. Every
//! session also sends one side effect (an http tool, runSync) to a counting
//! server under its idempotency key. Every session must succeed, each
//! Session must be created once (one UID per name over the whole run), each
//! model turn asked once, each side effect sent under one key of its own,
//! and the root's answer holds its children's answers, which hold their
//! children's.
//!
//! Each test starts its own `agents operator -n NS` child process.

use crate::support;

use agents::api::session::SessionPhase;
use agents::api::Session;
use futures::StreamExt;
use kube::api::{Api, ListParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::chat::{calling, first_text, reply, saying};
use support::http::{Request, Response, Server};
use support::{apply, launcher, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// (first user message, turn) -> times asked.
pub(crate) type Turns = Arc<Mutex<BTreeMap<(String, usize), u32>>>;
/// Idempotency key -> times the `effect` tool was sent it.
pub(crate) type Effects = Arc<Mutex<BTreeMap<String, u32>>>;

/// What the tree's fake model and its `effect` tool saw.
#[derive(Clone, Default)]
pub(crate) struct Seen {
    pub turns: Turns,
    pub effects: Effects,
}

/// The fake model, and the `effect` tool at `/effect` (counted by
/// idempotency key): the planner asks 3 researchers, each researcher asks
/// 2 leaves, each of them sends one `effect` on its first turn; a leaf
/// answers once its effect is back, a caller once its calls are back,
/// quoting their results. Sessions are told apart by their first message
/// (the root's is "root", a child's the prompt its parent gave).
pub(crate) fn model(seen: Seen) -> Server {
    Server::start(move |req| {
        if req.path.ends_with("/effect") {
            let key = req.header("idempotency-key").unwrap_or("").to_string();
            *seen.effects.lock().unwrap().entry(key).or_insert(0) += 1;
            return Response::json(200, r#"{"ok":true}"#);
        }
        model_reply(req, &seen.turns)
    })
}

fn model_reply(req: &Request, turns: &Turns) -> Response {
    let body = req.json();
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let system = first_text(&messages, "system").unwrap_or_default();
    let first = first_text(&messages, "user").unwrap_or_else(|| "?".into());
    let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
    *turns
        .lock()
        .unwrap()
        .entry((first.clone(), turn))
        .or_insert(0) += 1;
    let effect = json!({"id": "effect", "type": "function",
        "function": {"name": "effect", "arguments": json!({"who": first}).to_string()}});
    let calls = |tool: &str, n: usize| -> Value {
        let mut calls: Vec<Value> = (0..n)
            .map(|i| {
                let args = json!({"prompt": format!("{first}.{i}")}).to_string();
                json!({"id": format!("call{i}"), "type": "function",
                    "function": {"name": tool, "arguments": args}})
            })
            .collect();
        if tool != "waits" {
            calls.push(effect.clone());
        }
        Value::Array(calls)
    };
    let results: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str().map(str::to_string))
        .collect();
    let message = match (system.as_str(), turn) {
        ("planner", 0) => calling(calls("researcher", 3)),
        ("boss", 0) => calling(calls("waits", 1)),
        ("researcher", 0) => calling(calls("leaf", 2)),
        ("leaf", 0) => calling(json!([effect])),
        ("leaf", _) => saying(format!("leaf {first}")),
        _ => saying(format!("{first} [{}]", results.join(" | "))),
    };
    reply(message, 10, 5)
}

/// The planner, researcher and leaf Agents at the fake on `port`, each
/// with the `effect` tool; `leaf_policy` is the leaf's `policy` (YAML
/// flow, empty for none), e.g. an approval before its effect.
pub(crate) fn tree_agents_yaml(port: u16, leaf_policy: &str) -> String {
    let agent = |name: &str, tool: Option<&str>| {
        let sub = tool
            .map(|t| format!("  - name: {t}\n    agent: {{ref: {t}}}\n"))
            .unwrap_or_default();
        let policy = match (name, leaf_policy) {
            ("leaf", p) if !p.is_empty() => format!("  policy: {p}\n"),
            _ => String::new(),
        };
        format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n  description: the {name}\n  systemPrompt: {name}\n  model: {{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{port}/v1\", model: m}}}}\n{policy}  tools:\n{sub}  - name: effect\n    http: {{url: \"http://127.0.0.1:{port}/effect\"}}\n"
        )
    };
    [
        agent("planner", Some("researcher")),
        agent("researcher", Some("leaf")),
        agent("leaf", None),
    ]
    .concat()
}

/// Every model turn of the tree: (the session's first message, turn).
pub(crate) fn tree_turns() -> BTreeSet<(String, usize)> {
    let mut sessions = vec!["root".to_string()];
    for i in 0..3 {
        sessions.push(format!("root.{i}"));
        sessions.extend((0..2).map(|j| format!("root.{i}.{j}")));
    }
    sessions
        .into_iter()
        .flat_map(|s| [(s.clone(), 0), (s, 1)])
        .collect()
}

/// Every UID each Session name had while the watch ran.
fn watch_uids(api: Api<Session>) -> Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> {
    let seen: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
    let into = seen.clone();
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .boxed();
        // An error (a dropped connection under load) is retried after a
        // backoff; ending the watch there would miss later UIDs.
        while let Some(event) = events.next().await {
            let Ok(s) = event else { continue };
            into.lock()
                .unwrap()
                .entry(s.name_any())
                .or_default()
                .insert(s.uid().unwrap_or_default());
        }
    });
    seen
}

fn operator(ns: &str, kubeconfig: &Path) -> launcher::Operator {
    launcher::Operator::start(BIN, &format!("{ns}-tree"), kubeconfig, &["-n", ns], &[])
}

/// The operator, exporting its traces to `collector` when there is one.
fn traced_operator(
    ns: &str,
    kubeconfig: &Path,
    collector: Option<&support::otel::Collector>,
) -> launcher::Operator {
    let env = collector.map(|c| c.env()).unwrap_or_default();
    launcher::Operator::start(BIN, &format!("{ns}-tree"), kubeconfig, &["-n", ns], &env)
}

/// The tree is one trace, each child's steps under a span of its parent.
/// Without kills every child's steps are waited for; a kill loses what
/// its exporter still queued, so then what arrived is checked. (The
/// parent's exact span for the call is asserted in cluster_tracing and
/// engine::tests::subagents.)
fn one_trace(collector: &support::otel::Collector, kills: usize) {
    let spans = if kills == 0 {
        collector.wait_for("every child's steps", |s| {
            let leaves = s.iter().filter(|s| s.name == "invoke_agent leaf").count();
            let middle = s.iter().filter(|s| s.name == "invoke_agent researcher");
            leaves >= 6 && middle.count() >= 3
        })
    } else {
        std::thread::sleep(Duration::from_secs(2));
        collector.spans()
    };
    let tree = support::otel::tree(&spans);
    let traces: BTreeSet<&str> = spans.iter().map(|s| s.trace_id.as_str()).collect();
    assert!(traces.len() <= 1, "one trace for the tree:\n{tree}");
    let child_steps = spans
        .iter()
        .filter(|s| s.name == "invoke_agent researcher" || s.name == "invoke_agent leaf");
    for step in child_steps {
        assert!(
            !step.parent.is_empty(),
            "a child's step has a parent:\n{tree}"
        );
    }
}

#[tokio::test]
async fn a_tree_of_sub_agents_runs_each_session_and_turn_once() {
    tree_of_sub_agents(0).await;
}

/// The same tree while the operator is SIGKILLed at random moments (and
/// started again): every Session is still created once, each answer
/// taken once and each side effect sent under one key of its own; a model
/// turn or a side effect cut by a kill may be asked again (the effect
/// under the same key, which the tool recognises).
#[tokio::test]
async fn a_tree_of_sub_agents_under_operator_kills_creates_each_session_once() {
    tree_of_sub_agents(support::sized("AGENTS_SUBAGENT_KILLS", 5)).await;
}

async fn tree_of_sub_agents(kills: usize) {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "subagents-tree").await;
    let seen = Seen::default();
    let server = model(seen.clone());
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let uids = watch_uids(api.clone());
    apply(&ns.name, &tree_agents_yaml(server.port, ""));
    let kubeconfig = support::kubeconfig_path().expect("kubeconfig");
    let collector = support::otel::Collector::start(&format!("tree-{kills}"));
    let mut op = traced_operator(&ns.name, &kubeconfig, collector.as_ref());
    apply(
        &ns.name,
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: root}\nspec: {agentRef: {name: planner}, messages: [root]}\n",
    );
    let mut rng = support::rng::Rng::from_env_or_time();
    for _ in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.below(1500))).await;
        op.kill();
        op = traced_operator(&ns.name, &kubeconfig, collector.as_ref());
    }
    let all = wait_until(Duration::from_secs(180), "the whole tree succeeded", || {
        let api = api.clone();
        async move {
            let list = api.list(&ListParams::default()).await.ok()?;
            let done = list.items.len() == 10
                && list
                    .items
                    .iter()
                    .all(|s| s.status.as_ref().map(|st| st.phase) == Some(SessionPhase::Succeeded));
            done.then_some(list.items)
        }
    })
    .await;
    if let Some(collector) = &collector {
        one_trace(collector, kills);
    }
    let log = op.log_text();
    op.kill();

    let by_name: BTreeMap<String, &Session> = all.iter().map(|s| (s.name_any(), s)).collect();
    let root = by_name["root"];
    let answer = root
        .status
        .as_ref()
        .unwrap()
        .answer
        .clone()
        .unwrap_or_default();
    for i in 0..3 {
        for j in 0..2 {
            assert!(
                answer.contains(&format!("leaf root.{i}.{j}")),
                "root's answer: {answer}"
            );
        }
    }
    // Lineage: labels, ownerReference, spec.parent, depth.
    for s in &all {
        let name = s.name_any();
        if name == "root" {
            continue;
        }
        let parent = s.spec.parent.as_ref().expect("a child has spec.parent");
        let labels = s.labels();
        assert_eq!(
            labels.get("agents-exe.io/parent"),
            Some(&parent.name),
            "{name}"
        );
        assert_eq!(
            labels.get("agents-exe.io/root").map(String::as_str),
            Some("root"),
            "{name}"
        );
        let owner = &s.owner_references()[0];
        assert_eq!(owner.uid, by_name[&parent.name].uid().unwrap(), "{name}");
        assert_eq!(
            parent.depth,
            if parent.name == "root" { 1 } else { 2 },
            "{name}"
        );
    }
    // Each Session created once; each model turn asked once.
    let uids = uids.lock().unwrap().clone();
    assert_eq!(uids.len(), 10, "{uids:?}");
    assert!(
        uids.values().all(|u| u.len() == 1),
        "a name had two UIDs: {uids:?}"
    );
    let turns = seen.turns.lock().unwrap().clone();
    let asked: BTreeSet<(String, usize)> = turns.keys().cloned().collect();
    assert_eq!(asked, tree_turns(), "{turns:?}");
    // A model call cut by a kill is asked again (its reply was never
    // recorded); without kills, each turn is asked exactly once.
    let repeated: Vec<_> = turns.iter().filter(|(_, n)| **n > 1).collect();
    println!("{kills} kills: turns asked again after a kill: {repeated:?}");
    assert!(
        turns.values().all(|n| *n as usize <= 1 + kills),
        "turns asked more than once: {turns:?}\n{log}"
    );
    // Usage up the tree, once across kills: the root's usage is every
    // recorded model turn of the tree (20 turns, 10 + 5 tokens each).
    let usage = root.status.as_ref().unwrap().usage;
    let recorded = tree_turns().len() as u64;
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens),
        (recorded * 10, recorded * 5),
        "the root's usage after {kills} kills\n{log}"
    );
    // Each child's answer taken once: the root quotes each leaf once.
    for i in 0..3 {
        for j in 0..2 {
            let leaf = format!("leaf root.{i}.{j}");
            assert_eq!(answer.matches(&leaf).count(), 1, "root's answer: {answer}");
        }
    }
    let names: Vec<String> = by_name.keys().cloned().collect();
    check_effects(&seen, &names, kills);
    ns.delete(&client).await;
}

/// Each session sent its one side effect under a key of its own (the key
/// names the namespace, the session, its UID and the call). A call cut by
/// a kill may be sent again under the same key, which the tool recognises
/// (at most once per kill); never under another key.
pub(crate) fn check_effects(seen: &Seen, sessions: &[String], kills: usize) {
    let keys = seen.effects.lock().unwrap().clone();
    assert_eq!(keys.len(), sessions.len(), "one key per session: {keys:?}");
    for s in sessions {
        let mine = keys.keys().filter(|k| k.contains(&format!("/{s}/")));
        assert_eq!(mine.count(), 1, "{s}: one effect key: {keys:?}");
    }
    let again: Vec<_> = keys.iter().filter(|(_, n)| **n > 1).collect();
    println!("{kills} kills: effects sent again under their key after a kill: {again:?}");
    assert!(
        keys.values().all(|n| *n as usize <= 1 + kills),
        "effects sent more than once: {keys:?}"
    );
}

/// A child that waits for an outside party forever: deleting it by hand
/// ends the parent's call with an error result saying so, and the parent
/// finishes (no wait for ever).
#[tokio::test]
async fn a_child_deleted_by_hand_is_an_error_result_not_a_wait_for_ever() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "subagents-deleted").await;
    let server = model(Seen::default());
    let port = server.port;
    let yaml = format!(
        "---\napiVersion: agents-exe.io/v1alpha1\nkind: Agent\nmetadata: {{name: planner}}\nspec:\n  systemPrompt: boss\n  model: {{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{port}/v1\", model: m}}}}\n  tools:\n  - name: waits\n    agent: {{ref: waits}}\n  policy:\n    rules: [{{tool: waits, disposition: runSync}}]\n{}",
        support::fake::WAITING_AGENT.replace("apiVersion", "---\napiVersion")
    );
    apply(&ns.name, &yaml);
    let kubeconfig = support::kubeconfig_path().expect("kubeconfig");
    let mut op = operator(&ns.name, &kubeconfig);
    apply(
        &ns.name,
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: root}\nspec: {agentRef: {name: planner}, messages: [root]}\n",
    );
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    // The boss asks "waits" once; that child waits for an outside party.
    wait_until(Duration::from_secs(60), "the child waits", || {
        let api = api.clone();
        async move {
            let c = api.get_opt("root-t1-c0").await.ok()??;
            (c.status?.phase == SessionPhase::Waiting).then_some(())
        }
    })
    .await;
    support::kubectl_ok(["delete", "session", "root-t1-c0", "-n", &ns.name]);
    let answer = wait_until(Duration::from_secs(60), "the root finished", || {
        let api = api.clone();
        async move {
            let s = api.get_opt("root").await.ok()??;
            let st = s.status?;
            (st.phase == SessionPhase::Succeeded).then_some(st.answer.unwrap_or_default())
        }
    })
    .await;
    let log = op.log_text();
    op.kill();
    assert!(
        answer.contains("was deleted before it answered"),
        "root's answer: {answer}\n{log}"
    );
    ns.delete(&client).await;
}
