//! Storage limits on the real cluster: a session with a 5 MB tool result,
//! a session of 300 turns and a session whose model writes 1.2 MB of
//! tool-call arguments all succeed under the operator, and every object
//! the operator stored stays under 1 MiB (etcd refuses requests over about
//! 1.5 MiB). The CLI reads the whole conversation back.

use crate::support;

use serde_json::json;
use std::path::Path;
use std::process::Command;
use support::http::{Response, Server};
use support::launcher::Operator;
use support::scratch::Scratch;
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const BIG: usize = 5 * 1024 * 1024;
const TURNS: usize = 300;

fn operator(ns: &str, kubeconfig: &Path) -> Operator {
    Operator::start(BIN, ns, kubeconfig, &["-n", ns], &[])
}

/// At least `n` bytes of barely compressible hex text, one per `seed`.
fn noise(seed: u64, n: usize) -> String {
    let mut text = String::with_capacity(n + 16);
    let mut x: u64 = seed;
    while text.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{x:016x}"));
    }
    text
}

/// An HTTP tool answering every POST with a 5 MB JSON document of
/// barely compressible text.
fn big_tool() -> u16 {
    let text = noise(0x9e37_79b9_7f4a_7c15, BIG);
    let body = serde_json::json!({ "dump": text }).to_string();
    Server::start(move |_| Response::json(200, body.clone())).port
}

fn manifests(port: u16) -> String {
    let mut replies = String::new();
    for i in 0..TURNS {
        replies.push_str(&format!(
            "          - toolCalls: [{{name: echo, arguments: {{text: \"turn {i} {}\"}}}}]\n",
            "lorem ipsum dolor sit amet ".repeat(8)
        ));
    }
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: big}}
spec:
  messages: ["fetch the dump"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: dump, arguments: {{}}}}]
          - text: got it all
    tools:
      - {{name: dump, http: {{url: "http://127.0.0.1:{port}/dump"}}}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: long}}
spec:
  messages: ["talk for a long time"]
  limits: {{maxTurns: 400}}
  agent:
    model:
      provider: scripted
      scripted:
        replies:
{replies}          - text: that was a long conversation
    tools:
      - {{name: echo, builtin: {{function: echo}}}}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5mb_result_and_300_turns_succeed_with_every_object_under_1mib() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "storage").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _op = operator(&ns.name, &kubeconfig);
    let port = big_tool();
    support::apply(&ns.name, &manifests(port));
    // A bound for a stuck session, not a speed check: 300 turns by a debug
    // build of the operator, beside the suite's other tests on two cores,
    // took over 240 s in one CI run.
    for s in ["big", "long"] {
        let out = kubectl([
            "wait",
            "-n",
            &ns.name,
            "--for=condition=Succeeded",
            &format!("session/{s}"),
            "--timeout=600s",
        ]);
        assert!(
            out.status.success(),
            "session {s}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            kubectl_ok([
                "get",
                "session",
                s,
                "-n",
                &ns.name,
                "-o",
                "jsonpath={.status.phase} turns={.status.agentTurns} \
                 archived={.status.archivedTurns} {.status.conditions}",
            ])
        );
    }
    // Every object in the namespace, by size.
    let mut sizes = Vec::new();
    for kind in ["sessions", "continuations", "configmaps"] {
        let list: serde_json::Value =
            serde_json::from_str(&kubectl_ok(["get", kind, "-n", &ns.name, "-o", "json"])).unwrap();
        for item in list["items"].as_array().unwrap() {
            let name = item["metadata"]["name"].as_str().unwrap().to_string();
            sizes.push((
                serde_json::to_vec(item).unwrap().len(),
                format!("{kind}/{name}"),
            ));
        }
    }
    sizes.sort();
    let (largest, which) = sizes.last().cloned().unwrap();
    eprintln!(
        "{} objects stored; largest: {which} = {largest} bytes; sessions: {:?}",
        sizes.len(),
        sizes
            .iter()
            .filter(|(_, n)| n.starts_with("sessions/"))
            .collect::<Vec<_>>()
    );
    assert!(largest < 1024 * 1024, "{which} is {largest} bytes");
    assert!(
        sizes.iter().any(|(_, n)| n.starts_with("configmaps/big-")),
        "the 5 MB result spilled into ConfigMaps: {sizes:?}"
    );

    // The CLI reads the whole conversation back: 5 MB and 300 turns.
    let shown = Command::new(BIN)
        .args([
            "session", "show", "big", "--store", "kube", "-n", &ns.name, "-o", "json",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    let dump = v["session"]["turns"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["toolResults"].as_array().cloned().unwrap_or_default())
        .find_map(|r| {
            // A JSON reply over 1 MiB is kept as its text (parsed JSON can
            // take many times its size in memory): the same bytes.
            let content = &r["result"]["response"]["content"];
            content["dump"]
                .as_str()
                .or_else(|| content.as_str().filter(|t| t.contains("\"dump\"")))
                .map(str::len)
        });
    assert!(
        dump.is_some_and(|n| n >= BIG),
        "the whole 5 MB came back: {dump:?}"
    );
    let shown = Command::new(BIN)
        .args([
            "session", "show", "long", "--store", "kube", "-n", &ns.name, "-o", "json",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    let turns = v["session"]["turns"].as_array().unwrap().len();
    // user, then (agent, tool results) x 300, then the final answer
    assert_eq!(turns, 1 + 2 * TURNS + 1, "every turn came back");
}

const ARG_BYTES: usize = 300_000;
const ARG_TURNS: u64 = 4;

fn arg_text(turn: u64) -> String {
    noise(turn + 1, ARG_BYTES)
}

/// An Agent whose scripted model calls `echo` in four turns, each with
/// 300 KB of arguments (more than a status may hold together), then
/// answers. An Agent object, so the Session's own spec stays small.
fn chatty_agent() -> serde_json::Value {
    let calls = (0..ARG_TURNS).map(
        |turn| json!({"toolCalls": [{"name": "echo", "arguments": {"text": arg_text(turn)}}]}),
    );
    let replies: Vec<_> = calls.chain([json!({"text": "echoed them all"})]).collect();
    json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Agent",
        "metadata": {"name": "chatty"},
        "spec": {
            "model": {"provider": "scripted", "scripted": {"replies": replies}},
            "tools": [{"name": "echo", "builtin": {"function": "echo"}}],
        },
    })
}

/// `agents ARGS --store kube -n NS -o json`, parsed.
fn cli_json(args: &[&str], ns: &str, kubeconfig: &Path) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(args)
        .args(["--store", "kube", "-n", ns, "-o", "json"])
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Waits for `session` to succeed; fails as soon as it fails, saying why.
async fn wait_succeeded(ns: &str, session: &str) {
    let phase = || {
        kubectl_ok([
            "get",
            "session",
            session,
            "-n",
            ns,
            "-o",
            "jsonpath={.status.phase}: {.status.failure}",
        ])
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        let now = phase();
        assert!(!now.starts_with("Failed"), "session {session}: {now}");
        if now.starts_with("Succeeded") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "session {session}: {now}"
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// The Agent and a Session using it, created (not applied: no 1.2 MB
/// last-applied annotation).
fn create_chatty(ns: &str) {
    let scratch = Scratch::new("storage");
    let file = scratch.path("object.json");
    let session = json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Session",
        "metadata": {"name": "chatty"},
        "spec": {"agentRef": {"name": "chatty"}, "messages": ["echo four large texts"]},
    });
    for object in [chatty_agent(), session] {
        std::fs::write(&file, object.to_string()).unwrap();
        kubectl_ok(["create", "-n", ns, "-f", file.to_str().unwrap()]);
    }
}

/// Every argument and every echo in `shown` (`session show -o json`) whole.
fn assert_whole_conversation(shown: &serde_json::Value) {
    let turns = shown["session"]["turns"].as_array().unwrap();
    let arguments: Vec<String> = turns
        .iter()
        .flat_map(|t| t["toolCalls"].as_array().cloned().unwrap_or_default())
        .map(|c| {
            let args: serde_json::Value =
                serde_json::from_str(c["arguments"].as_str().unwrap()).unwrap();
            args["text"].as_str().unwrap().to_string()
        })
        .collect();
    let expected: Vec<String> = (0..ARG_TURNS).map(arg_text).collect();
    assert!(arguments == expected, "every argument came back whole");
    let echoed = turns
        .iter()
        .flat_map(|t| t["toolResults"].as_array().cloned().unwrap_or_default())
        .filter(|r| r["result"].to_string().len() > ARG_BYTES)
        .count();
    assert_eq!(echoed, ARG_TURNS as usize, "every echo came back whole");
    assert_eq!(shown["session"]["answer"], "echoed them all");
}

/// `session pause` and `session list` read the status as stored (packed).
fn assert_packed_status_usable(ns: &str, kubeconfig: &Path) {
    let paused = Command::new(BIN)
        .args(["session", "pause", "chatty", "--store", "kube", "-n", ns])
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    assert!(
        paused.status.success(),
        "{}",
        String::from_utf8_lossy(&paused.stderr)
    );
    let list = cli_json(&["session", "list"], ns, kubeconfig);
    let phase = list[0]["phase"].as_str().map(str::to_lowercase);
    assert_eq!(phase.as_deref(), Some("succeeded"), "{list}");
}

/// Tool-call arguments spill like results: four model turns of 300 KB of
/// arguments each (and the echoed results) leave the Session small, the
/// session succeeds, and the CLI reads every argument back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_tool_call_arguments_spill_and_the_session_succeeds() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "storage-args").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _op = operator(&ns.name, &kubeconfig);
    create_chatty(&ns.name);
    wait_succeeded(&ns.name, "chatty").await;
    let stored = kubectl_ok(["get", "session", "chatty", "-n", &ns.name, "-o", "json"]);
    let size = stored.len();
    assert!(size < 256 * 1024, "the Session takes {size} bytes");
    assert_whole_conversation(&cli_json(
        &["session", "show", "chatty"],
        &ns.name,
        &kubeconfig,
    ));
    assert_packed_status_usable(&ns.name, &kubeconfig);
    ns.delete(&client).await;
}
