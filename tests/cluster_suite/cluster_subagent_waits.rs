//! Waits deep in a sub-agent tree surface at the top: a root (`top`)
//! calls `mid`, which calls `guarded`, whose `deploy` needs an approval.
//! `agents session pending root` lists the grandchild's wait with its path
//! from the root; approving that token from there lets the whole tree
//! finish. The root's usage then holds its descendants' tokens, and
//! `agents session tree` shows each session's own.
//!
//! Each test starts its own `agents operator -n NS` child process.

use crate::support;

use agents::api::session::SessionPhase;
use agents::api::Session;
use kube::api::Api;
use serde_json::{json, Value};
use std::process::{Command, Output};
use std::time::Duration;
use support::chat::{calling, first_text, reply, saying};
use support::http::Server;
use support::{apply, launcher, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const PROMPT_TOKENS: u64 = 10;
const COMPLETION_TOKENS: u64 = 5;

/// The fake model: `top`, `mid` and `boss` call their sub-agent, `guarded`
/// calls `deploy`; each answers once its call is back, quoting the result.
fn model() -> Server {
    Server::start(move |req| {
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let system = first_text(&messages, "system").unwrap_or_default();
        let result = first_text(&messages, "tool");
        let call = |tool: &str, args: Value| {
            calling(json!([{"id": "call0", "type": "function",
                "function": {"name": tool, "arguments": args.to_string()}}]))
        };
        let message = match (system.as_str(), result) {
            ("top", None) => call("mid", json!({"prompt": "plan the release"})),
            ("mid", None) => call("guarded", json!({"prompt": "ship it"})),
            ("guarded", None) => call("deploy", json!({"to": "prod"})),
            ("boss", None) => call("waits", json!({"prompt": "wait for a number"})),
            (_, Some(r)) => saying(format!("{system} saw [{r}]")),
            (_, None) => saying("?"),
        };
        reply(message, PROMPT_TOKENS, COMPLETION_TOKENS)
    })
}

fn agents_yaml(port: u16) -> String {
    let model = format!(
        "{{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{port}/v1\", model: m}}}}"
    );
    format!(
        r#"---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: top}}
spec:
  systemPrompt: top
  model: {model}
  tools: [{{name: mid, agent: {{ref: mid}}}}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: mid}}
spec:
  systemPrompt: mid
  model: {model}
  tools: [{{name: guarded, agent: {{ref: guarded}}}}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: guarded}}
spec:
  systemPrompt: guarded
  model: {model}
  tools: [{{name: deploy, builtin: {{function: echo}}}}]
  policy:
    rules: [{{tool: deploy, disposition: runSync, approval: {{}}}}]
"#
    )
}

/// `agents ARGS --store kube -n NS`.
pub(crate) fn agents(ns: &str, args: &[&str]) -> Output {
    let kubeconfig = support::kubeconfig_path().expect("kubeconfig");
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

pub(crate) fn said(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test]
async fn a_grandchilds_approval_is_pending_at_the_root_and_approved_from_there() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "subagents-waits").await;
    let server = model();
    apply(&ns.name, &agents_yaml(server.port));
    let kubeconfig = support::kubeconfig_path().expect("kubeconfig");
    let mut op = launcher::Operator::start(
        BIN,
        &format!("{}-waits", ns.name),
        &kubeconfig,
        &["-n", &ns.name],
        &[],
    );
    apply(
        &ns.name,
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: root}\nspec: {agentRef: {name: top}, messages: [go]}\n",
    );
    let grandchild = "root-t1-c0-t1-c0";
    let waits = wait_until(
        Duration::from_secs(90),
        "the grandchild's wait at the root",
        || {
            let ns = ns.name.clone();
            async move {
                let out = agents(&ns, &["session", "pending", "root", "-o", "json"]);
                let list: Value = serde_json::from_slice(&out.stdout).ok()?;
                let found = list.as_array()?.iter().any(|w| w["session"] == grandchild);
                found.then_some(list)
            }
        },
    )
    .await;
    let wait = &waits.as_array().unwrap()[0];
    assert_eq!(
        waits.as_array().unwrap().len(),
        1,
        "only the approval waits for a person: {waits}"
    );
    assert_eq!(
        wait["path"],
        json!(["root", "root-t1-c0", grandchild]),
        "{wait}"
    );
    assert_eq!(wait["waitingFor"], "approval", "{wait}");
    assert_eq!(wait["tool"], "deploy", "{wait}");
    let token = wait["token"].as_str().unwrap().to_string();
    let text = agents(&ns.name, &["session", "pending", "root"]);
    let shown = said(&text);
    assert!(
        shown.contains(&format!("root > root-t1-c0 > {grandchild}")),
        "{shown}"
    );
    assert!(
        shown.contains(&format!("agents session approve {token}")),
        "{shown}"
    );
    // Approved from the root's list, as if it were the root's own call.
    let approve = agents(&ns.name, &["session", "approve", &token, "--by", "alice"]);
    assert!(approve.status.success(), "{}", said(&approve));
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let status = wait_until(Duration::from_secs(90), "the root finished", || {
        let api = api.clone();
        async move {
            let st = api.get_opt("root").await.ok()??.status?;
            (st.phase == SessionPhase::Succeeded).then_some(st)
        }
    })
    .await;
    let log = op.log_text();
    op.kill();
    let answer = status.answer.clone().unwrap_or_default();
    assert!(
        answer.contains("top saw [mid saw [guarded saw ["),
        "root's answer: {answer}\n{log}"
    );
    assert!(answer.contains("prod"), "the approved deploy ran: {answer}");
    // Usage up the tree: each session's model turns (2 each) and, added
    // with each child's answer, its descendants'.
    let turn = PROMPT_TOKENS + COMPLETION_TOKENS;
    assert_eq!(
        status.usage.total(),
        3 * 2 * turn,
        "root: {:?}",
        status.usage
    );
    let tree = agents(&ns.name, &["session", "tree", "root", "-o", "json"]);
    let tree: Value = serde_json::from_slice(&tree.stdout).expect("tree as JSON");
    let mid = &tree["children"][0];
    let guarded = &mid["children"][0];
    assert_eq!(
        tree["usage"]["promptTokens"],
        3 * 2 * PROMPT_TOKENS,
        "{tree}"
    );
    assert_eq!(
        mid["usage"]["promptTokens"],
        2 * 2 * PROMPT_TOKENS,
        "{tree}"
    );
    assert_eq!(
        guarded["usage"]["promptTokens"],
        2 * PROMPT_TOKENS,
        "{tree}"
    );
    assert_eq!(guarded["name"], grandchild, "{tree}");
    let after = agents(&ns.name, &["session", "pending", "root", "-o", "json"]);
    assert_eq!(
        String::from_utf8_lossy(&after.stdout).trim(),
        "[]",
        "{}",
        said(&after)
    );
    ns.delete(&client).await;
}

/// The parent's deadline flows down: a child of a root with
/// `limits.deadlineSeconds` (the child's own spec has none) is failed by
/// it while it waits for an outside party.
#[tokio::test]
async fn a_childs_deadline_is_its_parents() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "subagents-deadline").await;
    let server = model();
    let port = server.port;
    let yaml = format!(
        "---\napiVersion: agents-exe.io/v1alpha1\nkind: Agent\nmetadata: {{name: boss}}\nspec:\n  systemPrompt: boss\n  model: {{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{port}/v1\", model: m}}}}\n  tools:\n  - name: waits\n    agent: {{ref: waits}}\n{}",
        support::fake::WAITING_AGENT.replace("apiVersion", "---\napiVersion")
    );
    apply(&ns.name, &yaml);
    let kubeconfig = support::kubeconfig_path().expect("kubeconfig");
    let mut op = launcher::Operator::start(
        BIN,
        &format!("{}-deadline", ns.name),
        &kubeconfig,
        &["-n", &ns.name],
        &[],
    );
    apply(
        &ns.name,
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: root}\nspec: {agentRef: {name: boss}, messages: [go], limits: {deadlineSeconds: 8}}\n",
    );
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let child = wait_until(Duration::from_secs(60), "the child failed", || {
        let api = api.clone();
        async move {
            let c = api.get_opt("root-t1-c0").await.ok()??;
            (c.status.as_ref()?.phase == SessionPhase::Failed).then_some(c)
        }
    })
    .await;
    let log = op.log_text();
    op.kill();
    let root = api.get("root").await.unwrap();
    assert!(
        child.spec.limits.is_none(),
        "the child's own spec sets no deadline"
    );
    let deadline = child.spec.parent.as_ref().and_then(|p| p.deadline_ms);
    let created = root
        .metadata
        .creation_timestamp
        .as_ref()
        .unwrap()
        .0
        .as_millisecond();
    let deadline = deadline.expect("spec.parent.deadlineMs");
    assert!(
        (created + 8_000 - 1_000..=created + 8_000 + 1_000).contains(&deadline),
        "the child's deadline {deadline} is the root's (created {created} + 8 s)"
    );
    let failure = child.status.unwrap().failure.unwrap_or_default();
    assert!(failure.contains("passed its deadline"), "{failure}\n{log}");
    ns.delete(&client).await;
}
