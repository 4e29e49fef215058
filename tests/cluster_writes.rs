//! API writes per tool call, counted by the API server itself
//! (`apiserver_request_total` by verb and resource), around one run of the
//! requested flow under the operator: a runSync call, a runAsync call and a
//! deferred call completed with the CLI.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn operator(ns: &str, kubeconfig: &Path, n: usize) -> Child {
    let log = std::env::temp_dir().join(format!("agents-operator-{ns}-{n}.log"));
    Command::new(BIN)
        .args(["operator", "-n", ns, "--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info,kube=warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Counts requests per Idempotency-Key; answers after a short delay so
/// kills land while tools run.
fn tool_server() -> (u16, Arc<Mutex<HashMap<String, u32>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let keys = Arc::new(Mutex::new(HashMap::new()));
    let seen = keys.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                let (mut len, mut key) = (0, String::new());
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                    if lower.starts_with("idempotency-key:") {
                        key = line["idempotency-key:".len()..].trim().to_string();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut buf = vec![0; len];
                let _ = reader.read_exact(&mut buf);
                *seen.lock().unwrap().entry(key).or_insert(0) += 1;
                std::thread::sleep(Duration::from_millis(150));
                let body = r#"{"done":true}"#;
                let _ = write!(
                    reader.into_inner(),
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    (port, keys)
}

/// `apiserver_request_total` summed by (verb, resource) for our kinds.
fn api_writes() -> BTreeMap<(String, String), u64> {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let get = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let (verb, resource) = (get("verb"), get("resource"));
        if !matches!(verb.as_str(), "POST" | "PUT" | "PATCH" | "DELETE" | "APPLY") {
            continue;
        }
        if !matches!(
            resource.as_str(),
            "sessions" | "continuations" | "configmaps" | "jobs"
        ) {
            continue;
        }
        let n: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry((verb, resource)).or_insert(0) += n as u64;
    }
    out
}

fn manifests(port: u16) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: counted}}
spec:
  messages: ["three calls"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: now, arguments: {{n: 1}}}}
              - {{name: later, arguments: {{n: 2}}}}
              - {{name: ask, arguments: {{n: 3}}}}
          - text: all three in
    tools:
      - {{name: now, http: {{url: "http://127.0.0.1:{port}/now"}}}}
      - {{name: later, http: {{url: "http://127.0.0.1:{port}/later"}}}}
      - {{name: ask, builtin: {{function: echo}}}}
    policy:
      default: runSync
      rules:
        - {{tool: later, disposition: runAsync}}
        - {{tool: ask, disposition: defer, reason: a person answers}}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_writes_per_call_of_the_requested_flow() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "writes").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let (port, keys) = tool_server();
    let file = std::env::temp_dir().join(format!("agents-writes-{}.yaml", ns.name));
    std::fs::write(&file, manifests(port)).unwrap();
    let mut op = operator(&ns.name, &kubeconfig, 0);
    let before = api_writes();
    kubectl_ok(["apply", "-n", &ns.name, "-f", file.to_str().unwrap()]);
    let mut waiting = false;
    for _ in 0..120 {
        let phase = kubectl_ok([
            "get",
            "session",
            "counted",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.status.phase}",
        ]);
        if phase == "Waiting" {
            waiting = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(waiting, "the session yields on the deferred call");
    let done = Command::new(BIN)
        .args(["session", "complete", "counted-t1-c2", "--text", "42"])
        .args(["--store", "kube", "-n", &ns.name])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/counted",
        "--timeout=60s",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Let the last status write settle before reading the counters.
    std::thread::sleep(Duration::from_secs(1));
    let after = api_writes();
    // The operator's own view: /metrics, /healthz, /readyz on its address.
    let log = std::fs::read_to_string(
        std::env::temp_dir().join(format!("agents-operator-{}-0.log", ns.name)),
    )
    .unwrap();
    let addr = log
        .lines()
        .find(|l| l.contains("serving /metrics"))
        .and_then(|l| l.split("addr=").nth(1))
        .map(|a| a.split_whitespace().next().unwrap_or_default().to_string())
        .expect("the operator logs its metrics address");
    let get = |path: &str| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    };
    assert!(get("/healthz").starts_with("HTTP/1.1 200"));
    assert!(get("/readyz").starts_with("HTTP/1.1 200"));
    let metrics = get("/metrics");
    let value = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    eprintln!(
        "operator metrics: wake latency count {}, sum {:.3} s; reconciles {}",
        value("agents_wake_latency_seconds_count"),
        value("agents_wake_latency_seconds_sum"),
        value("agents_reconciles_total")
    );
    assert!(
        value("agents_wake_latency_seconds_count") >= 1.0,
        "{metrics}"
    );
    assert!(
        value("agents_tool_calls_total{disposition=\"runSync\",outcome=\"completed\"}") >= 1.0,
        "{metrics}"
    );
    assert!(
        value("agents_model_calls_total{outcome=\"ok\"}") >= 2.0,
        "{metrics}"
    );
    let _ = op.kill();
    let _ = op.wait();
    assert_eq!(keys.lock().unwrap().len(), 2, "both http calls ran");
    let delta: BTreeMap<_, _> = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    let of = |verb: &str, res: &str| {
        delta
            .get(&(verb.to_string(), res.to_string()))
            .copied()
            .unwrap_or(0)
    };
    let session_writes = of("PATCH", "sessions");
    let continuation_writes = of("POST", "continuations") + of("PATCH", "continuations");
    eprintln!(
        "API writes for the flow (1 runSync, 1 runAsync, 1 defer; 2 model turns): {delta:?}; \
         session status writes: {session_writes}, continuation writes: {continuation_writes} \
         ({:.1} per deferred call, the CLI's completion included)",
        continuation_writes as f64 / 2.0
    );
    // kubectl apply's own POST of the Session is the user's write.
    assert_eq!(of("POST", "sessions"), 1);
    // Two deferred calls: create, wait fields, result each.
    assert!(continuation_writes <= 6, "{delta:?}");
    // Steps: claim+turn, results, the second model turn, the answer.
    assert!(session_writes <= 8, "{delta:?}");
}
