//! The chart's alert rules on a real Prometheus (Debian's `prometheus`, on
//! loopback, its own config, data folder and port, started and killed by
//! PID here) scraping a real operator:
//!
//! - a real scrape of the operator's `/metrics` passes `promtool check metrics`;
//! - `AgentsReconcileStalled` (no reconcile progress) is quiet while the
//!   operator steps a waiting session, fires while the operator's API
//!   traffic is cut, and clears once it flows again.
//!
//! The operator reaches the API server through a loopback TCP proxy of this
//! test; cutting the proxy cuts only the operator, never the shared cluster.
//! The rules are the chart's PrometheusRule rendered by helm with shorter
//! durations (`window` 20s, `for` 5s instead of 10m/10m): the expressions
//! are the same. Needs the test cluster, helm (tests/cluster/build) and
//! prometheus (tests/cluster/install-deps); skipped without them unless
//! AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::launcher::{free_port, Operator};
use support::scratch::Scratch;
use support::{apply, kubectl_ok, TestNamespace};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const STALL_ALERT: &str = "AgentsReconcileStalled";
/// The scrape job: what the chart's rules select by default for release
/// "agents" (job="<fullname>-metrics", the metrics Service's name).
const JOB: &str = "agents-metrics";

/// A loopback TCP proxy to the API server. Cut, it closes the connections
/// it carries and every new one at once: the operator behind it finds the
/// API server unreachable, everyone else does not.
struct ApiProxy {
    port: u16,
    cut: watch::Sender<bool>,
}

impl ApiProxy {
    async fn start(upstream: &str) -> ApiProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, cut_rx) = watch::channel(false);
        let upstream = upstream.to_string();
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let mut cut = cut_rx.clone();
                if *cut.borrow() {
                    continue; // dropped: the client sees the connection close
                }
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut up) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        ApiProxy { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// Debian's Prometheus on a loopback port of its own, killed by PID on drop.
struct Prometheus {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Prometheus {
    fn start(dir: &Path, rules: &Path, target_port: u16) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [{rules}]\n\
                 scrape_configs:\n\
                 - job_name: {JOB}\n  \
                   static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n",
                rules = rules.display()
            ),
        )
        .unwrap();
        let port = free_port();
        let log = dir.join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start prometheus");
        Prometheus { child, port, log }
    }

    async fn get(&self, path: &str) -> Option<Value> {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let response = reqwest::get(url).await.ok()?;
        response.json().await.ok()
    }

    /// The state ("pending", "firing") of the alert, or None when inactive.
    async fn alert_state(&self, name: &str) -> Option<String> {
        let alerts = self.get("/api/v1/alerts").await?;
        alerts["data"]["alerts"]
            .as_array()?
            .iter()
            .find(|a| a["labels"]["alertname"] == name)
            .map(|a| a["state"].as_str().unwrap_or_default().to_string())
    }

    /// The value of an instant query returning one sample.
    async fn query(&self, promql: &str) -> Option<f64> {
        let q: String = form_urlencoded::byte_serialize(promql.as_bytes()).collect();
        let answer = self.get(&format!("/api/v1/query?query={q}")).await?;
        answer["data"]["result"][0]["value"][1]
            .as_str()?
            .parse()
            .ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill(); // SIGKILL by PID
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("prometheus log: {}", self.log.display());
        }
    }
}

/// The chart's rule groups (its PrometheusRule's spec.groups) as a plain
/// rules file, rendered with short durations.
fn chart_rules(scratch: &Scratch, ns: &str) -> PathBuf {
    let rendered = support::helm_template(
        "agents",
        ns,
        &[
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "metrics.prometheusRule.window=20s",
            "--set",
            "metrics.prometheusRule.for=5s",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
    );
    let rule: serde_norway::Value = serde_norway::from_str(&rendered).unwrap();
    let groups =
        serde_norway::to_string(&serde_json::json!({ "groups": rule["spec"]["groups"] })).unwrap();
    assert!(groups.contains(STALL_ALERT), "{groups}");
    scratch.write("rules.yaml", &groups)
}

/// `promtool check metrics` on a scrape; its complaints, if any.
fn promtool_check_metrics(scrape: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(scrape.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.success().then_some(()).ok_or(said)
}

/// The scrape in the Prometheus text format 0.0.4 that promtool's linter
/// reads: an OpenMetrics counter family `x` (samples `x_total`) is named
/// `x_total` in its HELP and TYPE lines there, and `# UNIT` / `# EOF` do
/// not exist. Nothing else changes (names, labels, help, values).
fn as_text_format(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::new();
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(&name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// promtool's linter passes the scrape. On the raw OpenMetrics text its
/// only complaint may be each counter's `_total` series lacking HELP (it
/// parses text format 0.0.4, see [`as_text_format`]); converted, none.
fn assert_promtool_accepts(scrape: &str) {
    if let Err(said) = promtool_check_metrics(&as_text_format(scrape)) {
        panic!("promtool check metrics:\n{said}\non:\n{scrape}");
    }
    if let Err(said) = promtool_check_metrics(scrape) {
        for complaint in said.lines().filter(|l| !l.trim().is_empty()) {
            let family = complaint
                .strip_suffix("_total no help text")
                .unwrap_or_else(|| panic!("promtool on the raw scrape: {complaint}\n{scrape}"));
            assert!(
                scrape.contains(&format!("# TYPE {family} counter")),
                "{complaint}"
            );
        }
    }
}

fn have(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

fn helm_built() -> bool {
    std::fs::read_dir(support::BINARY_CACHE)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            e.file_name().to_string_lossy().starts_with("helm-") && e.path().join("helm").is_file()
        })
}

/// The admin kubeconfig with its server at the proxy (the API server's
/// certificate names 127.0.0.1, so TLS verifies through it).
fn kubeconfig_via(scratch: &Scratch, port: u16) -> PathBuf {
    let text = std::fs::read_to_string(support::kubeconfig_path().unwrap()).unwrap();
    assert!(text.contains("https://127.0.0.1:6443"), "{text}");
    scratch.write(
        "operator.kubeconfig",
        &text.replace(
            "https://127.0.0.1:6443",
            &format!("https://127.0.0.1:{port}"),
        ),
    )
}

/// An Agent whose scripted model asks for a call that needs approval, and
/// its Session: it waits, and every resync reconciles it (reading it from
/// the API server, writing nothing).
const WAITING_SESSION: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: gated}
spec:
  systemPrompt: Ask before deploying.
  model:
    provider: scripted
    scripted:
      replies:
        - text: deploying after approval
          toolCalls: [{name: deploy, arguments: {env: staging}}]
        - text: done
  tools:
    - name: deploy
      description: Deploys.
      builtin: {function: echo}
  policy:
    default: runSync
    rules: [{tool: deploy, disposition: runSync, approval: true, timeoutSeconds: 3600}]
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: waiting}
spec:
  agentRef: {name: gated}
  messages: ["ship it"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stall_alert_fires_while_the_api_is_cut_and_clears_after() {
    let Some(client) = support::cluster().await else {
        return;
    };
    if !have("prometheus", "--version") || !have("promtool", "--version") {
        support::skip_or_fail::<()>("no prometheus/promtool: run tests/cluster/install-deps");
        return;
    }
    if !helm_built() {
        support::skip_or_fail::<()>("no helm: run tests/cluster/build helm");
        return;
    }
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "prom").await;
    let scratch = Scratch::new("prometheus");
    let rules = chart_rules(&scratch, &ns.name);
    apply(&ns.name, WAITING_SESSION);

    let proxy = ApiProxy::start("127.0.0.1:6443").await;
    let kubeconfig = kubeconfig_via(&scratch, proxy.port);
    let operator = Operator::start(
        BIN,
        "prometheus",
        &kubeconfig,
        &["--namespace", &ns.name, "--resync-seconds", "2"],
        &[],
    );
    let prometheus = Prometheus::start(&scratch.path("."), &rules, operator.metrics);
    kubectl_ok([
        "-n",
        &ns.name,
        "wait",
        "--for=condition=Waiting",
        "session/waiting",
        "--timeout=90s",
    ]);

    // A real scrape, once this operator has reconciled, passes promtool's linter.
    let scrape = support::wait_until(
        Duration::from_secs(60),
        "a successful reconcile",
        || async {
            let (code, scrape) = operator.probe("/metrics");
            (code == 200 && scrape.contains("agents_reconciles_total{result=\"ok\"}"))
                .then_some(scrape)
        },
    )
    .await;
    assert_promtool_accepts(&scrape);

    let ok_recently =
        format!("sum(increase(agents_reconciles_total{{job=\"{JOB}\",result=\"ok\"}}[20s]))");
    support::wait_until(
        Duration::from_secs(60),
        "Prometheus to see successful reconciles",
        || async { prometheus.query(&ok_recently).await.filter(|v| *v > 0.0) },
    )
    .await;
    assert_eq!(
        prometheus.alert_state(STALL_ALERT).await,
        None,
        "stalled before any cut"
    );

    proxy.set_cut(true);
    let cut_at = Instant::now();
    support::wait_until(
        Duration::from_secs(120),
        "the stall alert to fire while cut",
        || async {
            (prometheus.alert_state(STALL_ALERT).await.as_deref() == Some("firing")).then_some(())
        },
    )
    .await;
    eprintln!("{STALL_ALERT} firing {:?} after the cut", cut_at.elapsed());

    proxy.set_cut(false);
    let healed_at = Instant::now();
    support::wait_until(
        Duration::from_secs(120),
        "the stall alert to clear once healed",
        || async {
            prometheus
                .alert_state(STALL_ALERT)
                .await
                .is_none()
                .then_some(())
        },
    )
    .await;
    eprintln!(
        "{STALL_ALERT} cleared {:?} after healing",
        healed_at.elapsed()
    );
    let errors = prometheus
        .query(&format!(
            "sum(agents_reconcile_errors_total{{job=\"{JOB}\"}})"
        ))
        .await
        .unwrap_or(0.0);
    assert!(errors > 0.0, "the cut produced no reconcile errors");

    drop(prometheus);
    drop(operator);
    ns.delete(&client).await;
}
