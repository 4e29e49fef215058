//! Storage limits on the real cluster: a session with a 5 MB tool result
//! and a session of 300 turns both succeed under the operator, and every
//! object the operator stored stays under 1 MiB (etcd refuses requests over
//! about 1.5 MiB). The CLI reads the whole conversation back.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const BIG: usize = 5 * 1024 * 1024;
const TURNS: usize = 300;

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn operator(ns: &str, kubeconfig: &Path) -> Operator {
    let log = std::env::temp_dir().join(format!("agents-operator-{ns}.log"));
    Operator(
        Command::new(BIN)
            .args(["operator", "-n", ns, "--metrics-addr", "127.0.0.1:0"])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// An HTTP tool answering every POST with a 5 MB JSON document of
/// barely compressible text.
fn big_tool() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut text = String::with_capacity(BIG);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while text.len() < BIG {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{x:016x}"));
    }
    let body = serde_json::json!({ "dump": text }).to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let mut reader = BufReader::new(stream);
            let mut len = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut buf = vec![0; len];
            let _ = reader.read_exact(&mut buf);
            let mut stream = reader.into_inner();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
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
    let file = std::env::temp_dir().join(format!("agents-storage-{}.yaml", ns.name));
    std::fs::write(&file, manifests(port)).unwrap();
    kubectl_ok(["apply", "-n", &ns.name, "-f", file.to_str().unwrap()]);
    for s in ["big", "long"] {
        let out = kubectl([
            "wait",
            "-n",
            &ns.name,
            "--for=condition=Succeeded",
            &format!("session/{s}"),
            "--timeout=240s",
        ]);
        assert!(
            out.status.success(),
            "session {s}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            kubectl_ok(["get", "session", s, "-n", &ns.name, "-o", "yaml"])
                .chars()
                .take(4000)
                .collect::<String>()
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
