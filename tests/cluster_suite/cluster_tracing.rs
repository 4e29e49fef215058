//! OpenTelemetry traces of the requested flow, read back from a real
//! collector (issue 20 item 5): the operator exports to an OpenTelemetry
//! Collector built from Go modules (`tests/cluster/build otelcol`) whose
//! file exporter writes the spans; the flow runs across an operator
//! SIGKILL and restart while the session waits. One trace for the session;
//! `invoke_agent`, `chat` and `execute_tool` spans with their GenAI
//! attributes; each step linked to the one before across the restart; a
//! result from outside marked as such; no secret (the model's API key, an
//! http tool's header) and no idempotency key anywhere in what was
//! exported, even with content recording on.
//!
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::Session;
use kube::api::Api;
use kube::ResourceExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::{Request, Response, Server};
use support::otel::{tree, Collector, Span};
use support::{apply, kubectl_ok, launcher, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn kubeconfig() -> PathBuf {
    support::kubeconfig_path().expect("the test cluster's kubeconfig")
}

/// An OpenAI-compatible model: the first turn asks for the flow's three
/// calls, the second answers; every reply reports token usage.
fn model_server(keys_seen: Arc<Mutex<Vec<String>>>) -> Server {
    Server::start(move |req: &Request| {
        let auth = req.header("authorization").unwrap_or("").to_string();
        keys_seen.lock().unwrap().push(auth);
        let body = req.json();
        let asked = body["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count());
        let call = |id: &str, name: &str, args: &str| {
            serde_json::json!({"id": id, "type": "function",
                "function": {"name": name, "arguments": args}})
        };
        let message = if asked == 0 {
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
                call("call_fetch", "fetch", r#"{"what":"now"}"#),
                call("call_later", "fetch_later", r#"{"what":"later"}"#),
                call("call_person", "ask_person", r#"{"question":"what is the answer?"}"#),
            ]})
        } else {
            serde_json::json!({"role": "assistant", "content": "all three results are in"})
        };
        Response::json(
            200,
            serde_json::json!({
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 11 + asked, "completion_tokens": 7}
            })
            .to_string(),
        )
    })
}

/// The http tools: each answer echoes the call's idempotency key.
fn tool_server() -> Server {
    Server::start(|req: &Request| {
        let key = req.header("idempotency-key").unwrap_or("");
        Response::json(
            200,
            serde_json::json!({"path": req.path, "key": key}).to_string(),
        )
    })
}

fn flow_yaml(model_base: &str, tool_base: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: flow-agent}}
spec:
  model:
    provider: openai
    openai:
      baseUrl: "{model_base}"
      model: gpt-trace
      apiKeySecretRef: {{name: llm-credentials, key: api-key}}
  tools:
    - name: fetch
      http:
        url: "{tool_base}/sync"
        headers:
          - name: X-Api-Token
            valueFrom: {{secretKeyRef: {{name: tool-token, key: token}}}}
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

fn usable_secret(ns: &str, name: &str, key: &str, value: &str) {
    let literal = format!("--from-literal={key}={value}");
    kubectl_ok(["create", "secret", "generic", name, "-n", ns, &literal]);
    let label = "agents-exe.io/usable-by-agents=true";
    kubectl_ok(["label", "secret", name, "-n", ns, label]);
}

/// `agents operator -n NS` exporting to `collector`, with content on.
fn operator(ns: &str, collector: &Collector, tag: &str) -> launcher::Operator {
    let mut env = collector.env();
    env.push(("AGENTS_TRACE_CONTENT", "true".into()));
    let name = format!("{ns}-{tag}");
    launcher::Operator::start(BIN, &name, &kubeconfig(), &["-n", ns], &env)
}

fn named<'a>(spans: &'a [Span], prefix: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| s.name.starts_with(prefix))
        .collect()
}

fn tool_span<'a>(spans: &'a [Span], tool: &str) -> Option<&'a Span> {
    spans
        .iter()
        .find(|s| s.name == format!("execute_tool {tool}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requested_flow_is_one_trace_linked_across_an_operator_restart() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let Some(collector) = Collector::start("cluster-flow") else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "trace-flow").await;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (api_key, tool_token) = (format!("sk-trace-{suffix}"), format!("tok-{suffix}"));
    usable_secret(&ns.name, "llm-credentials", "api-key", &api_key);
    usable_secret(&ns.name, "tool-token", "token", &tool_token);
    let keys_seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (model, tools) = (model_server(keys_seen.clone()), tool_server());
    apply(&ns.name, &flow_yaml(&model.url("/v1"), &tools.url("")));

    let mut first = operator(&ns.name, &collector, "first");
    // Waits for the person once the runAsync result is in, and its spans
    // have left the operator: a SIGKILL loses only what is still queued.
    let before = collector.wait_for("the first operator's steps", |s| {
        tool_span(s, "fetch_later").is_some() && tool_span(s, "fetch").is_some()
    });
    first.kill();
    let mut second = operator(&ns.name, &collector, "second");
    let done = agents_complete(&ns.name, "flow-t1-c2", "forty-two");
    assert!(done.contains("completed flow-t1-c2"), "{done}");
    wait_succeeded(&ns.name, "flow");
    collector.wait_for("the resumed step", |s| {
        tool_span(s, "ask_person").is_some() && named(s, "chat ").len() == 2
    });
    // A late duplicate would show up by now: then "once" below fails.
    std::thread::sleep(Duration::from_secs(1));
    let spans = collector.spans();
    second.kill();
    println!("the trace of the requested flow:\n{}", tree(&spans));

    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let session = sessions.get("flow").await.unwrap();
    let uid = session.uid().unwrap();
    one_trace_with_the_genai_spans(&spans, &uid);
    steps_link_across_the_restart(&spans, &before, &session);
    nothing_secret_was_exported(&collector.raw(), &[&api_key, &tool_token], &tools);
    assert!(
        keys_seen
            .lock()
            .unwrap()
            .iter()
            .all(|k| k == &format!("Bearer {api_key}")),
        "the model got the key from the Secret"
    );
    ns.delete(&client).await;
}

fn agents_complete(ns: &str, token: &str, text: &str) -> String {
    let out = std::process::Command::new(BIN)
        .args(["session", "complete", token, "--text", text])
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", kubeconfig())
        .env("USER", "tester")
        .env_remove("AGENTS_STORE")
        .output()
        .expect("agents runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One trace id; the span names and GenAI attributes; each tool result
/// reported once, with where it came from.
fn one_trace_with_the_genai_spans(spans: &[Span], uid: &str) {
    let traces: std::collections::BTreeSet<&str> =
        spans.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(traces.len(), 1, "one trace:\n{}", tree(spans));
    for s in spans {
        assert_eq!(s.attr("gen_ai.conversation.id"), Some(uid), "{s:?}");
        assert_eq!(
            s.resource.get("service.name").map(String::as_str),
            Some("agents-operator")
        );
    }
    let steps = named(spans, "invoke_agent ");
    assert!(steps.len() >= 2, "{}", tree(spans));
    for step in &steps {
        assert_eq!(step.name, "invoke_agent flow-agent");
        assert_eq!(step.attr("gen_ai.operation.name"), Some("invoke_agent"));
        assert_eq!(step.attr("gen_ai.agent.name"), Some("flow-agent"));
        assert!(step.parent.is_empty(), "a step span is a root: {step:?}");
    }
    let chats = named(spans, "chat ");
    assert_eq!(chats.len(), 2, "two model turns:\n{}", tree(spans));
    for (chat, input) in chats.iter().zip(["11", "12"]) {
        assert_eq!(chat.name, "chat gpt-trace");
        assert_eq!(chat.attr("gen_ai.request.model"), Some("gpt-trace"));
        assert_eq!(chat.attr("gen_ai.provider.name"), Some("openai"));
        assert_eq!(chat.attr("gen_ai.usage.input_tokens"), Some(input));
        assert_eq!(chat.attr("gen_ai.usage.output_tokens"), Some("7"));
    }
    let tools = named(spans, "execute_tool ");
    assert_eq!(tools.len(), 3, "each result once:\n{}", tree(spans));
    for (tool, call_id, source, runner) in [
        ("fetch", "call_fetch", "executed", Some("runSync")),
        ("fetch_later", "call_later", "executed", Some("runAsync")),
        ("ask_person", "call_person", "outside", None),
    ] {
        let s = tool_span(spans, tool).unwrap();
        assert_eq!(s.attr("gen_ai.operation.name"), Some("execute_tool"));
        assert_eq!(s.attr("gen_ai.tool.name"), Some(tool));
        assert_eq!(s.attr("gen_ai.tool.call.id"), Some(call_id));
        assert_eq!(s.attr("agents.result.source"), Some(source), "{s:?}");
        assert_eq!(s.attr("agents.tool.runner"), runner, "{s:?}");
        let parent = spans.iter().find(|p| p.span_id == s.parent).unwrap();
        assert!(parent.name.starts_with("invoke_agent"), "{s:?}");
    }
    let person = tool_span(spans, "ask_person").unwrap();
    assert!(person.attr("agents.result.completed_by").is_some());
    assert!(person
        .attr("gen_ai.tool.call.result")
        .unwrap()
        .contains("forty-two"));
}

/// Each step after the first links to the step before it; the step that
/// resumed after the restart links to one the first operator exported,
/// and the Session stores the last step's context.
fn steps_link_across_the_restart(spans: &[Span], before: &[Span], session: &Session) {
    let mut steps = named(spans, "invoke_agent ");
    steps.sort_by_key(|s| s.start_ns);
    assert!(steps[0].links.is_empty(), "the first step starts the trace");
    for pair in steps.windows(2) {
        let (earlier, later) = (pair[0], pair[1]);
        let to: Vec<&str> = later.links.iter().map(|(_, s)| s.as_str()).collect();
        assert_eq!(to, [earlier.span_id.as_str()], "{}", tree(spans));
        assert_eq!(later.links[0].0, earlier.trace_id);
    }
    let person = tool_span(spans, "ask_person").unwrap();
    let resumed = steps.iter().find(|s| s.span_id == person.parent).unwrap();
    let linked = &resumed.links[0].1;
    assert!(
        before
            .iter()
            .any(|s| &s.span_id == linked && s.name.starts_with("invoke_agent")),
        "the resumed step links to a step of the first operator:\n{}",
        tree(spans)
    );
    let last = steps.last().unwrap();
    let stored = session.status.as_ref().unwrap().traceparent.clone();
    let expected = format!("00-{}-{}-01", last.trace_id, last.span_id);
    assert_eq!(stored.as_deref(), Some(expected.as_str()));
    let deferred = steps
        .iter()
        .filter(|s| s.events.iter().any(|e| e == "agents.call.deferred"));
    assert_eq!(deferred.count(), 1, "the wait began in one step");
}

/// Neither Secret's value nor any idempotency key the tools were sent is
/// anywhere in the export; the tools' echo of their key was scrubbed.
fn nothing_secret_was_exported(raw: &str, secrets: &[&str], tools: &Server) {
    for secret in secrets {
        assert!(!raw.contains(secret), "a secret value was exported");
    }
    let keys: Vec<String> = tools
        .requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key").map(str::to_string))
        .collect();
    assert_eq!(keys.len(), 2, "two http tool calls: {keys:?}");
    for key in &keys {
        assert!(!key.is_empty());
        assert!(
            !raw.contains(key.as_str()),
            "idempotency key {key} was exported"
        );
    }
    assert!(
        raw.contains("[idempotency key]"),
        "the echoed key was scrubbed, not absent"
    );
}

const TREE_YAML: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: researcher}
spec:
  description: Answers one question.
  model: {provider: scripted, scripted: {replies: [{text: "Lisbon: 22 C"}]}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: planner}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{name: researcher, arguments: {prompt: "weather?"}}]
        - text: "go in May"
  tools:
    - {name: researcher, agent: {ref: researcher}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: plan}
spec:
  agentRef: {name: planner}
  messages: ["plan a trip"]
"#;

/// A tree of sessions is one trace: the child's step spans are in the
/// parent's trace, each under the parent's `execute_tool` span of the
/// call that made the child.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_of_sessions_is_one_trace() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let Some(collector) = Collector::start("cluster-tree") else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "trace-tree").await;
    let _op = operator(&ns.name, &collector, "tree");
    apply(&ns.name, TREE_YAML);
    wait_succeeded(&ns.name, "plan");
    let spans = collector.wait_for("the parent's span of the call", |s| {
        tool_span(s, "researcher").is_some() && !named(s, "invoke_agent researcher").is_empty()
    });
    println!("the tree's trace:\n{}", tree(&spans));
    let call = tool_span(&spans, "researcher").unwrap();
    let child_steps = named(&spans, "invoke_agent researcher");
    // The call's span has the id the child was given, whichever way the
    // answer came back: the parent's runner, or the call's Continuation
    // (engine::tests::subagents covers the Continuation's path on purpose).
    println!(
        "the answer came back: {:?}",
        call.attr("agents.result.source")
    );
    for step in &child_steps {
        assert_eq!(step.trace_id, call.trace_id, "one trace:\n{}", tree(&spans));
        assert_eq!(
            step.parent,
            call.span_id,
            "under the call:\n{}",
            tree(&spans)
        );
    }
    let traces: std::collections::BTreeSet<&str> =
        spans.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(traces.len(), 1, "one trace:\n{}", tree(&spans));
    ns.delete(&client).await;
}

fn wait_succeeded(ns: &str, name: &str) {
    support::wait_session_condition(ns, name, "Succeeded", 90);
}
