//! A real OpenTelemetry Collector for trace tests: the binary that
//! `tests/cluster/build otelcol` builds from Go modules (built here when
//! the cache lacks it), run with `tests/otel/collector.yaml` on free
//! loopback ports, its file exporter's JSON lines read back as spans.

use super::launcher::free_port;
use super::{cache_dir, repo_root, skip_or_fail};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The collector release `tools/otelcol/go.mod` pins (the cache key).
fn version() -> String {
    let gomod = std::fs::read_to_string(repo_root().join("tools/otelcol/go.mod"))
        .expect("tools/otelcol/go.mod");
    gomod
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("go.opentelemetry.io/collector/otelcol "))
        .map(|v| v.split_whitespace().next().unwrap_or(v).to_string())
        .expect("go.opentelemetry.io/collector/otelcol in tools/otelcol/go.mod")
}

/// The collector binary, built (once, cached by version) when missing;
/// `None` (skipped) when it cannot be had and the tests may skip.
pub fn binary() -> Option<PathBuf> {
    let bin = cache_dir()
        .join(format!("otelcol-{}", version()))
        .join("otelcol");
    if bin.is_file() {
        return Some(bin);
    }
    eprintln!("building the test collector: tests/cluster/build otelcol");
    let built = Command::new(repo_root().join("tests/cluster/build"))
        .arg("otelcol")
        .status();
    match built {
        Ok(s) if s.success() && bin.is_file() => Some(bin),
        other => skip_or_fail(&format!(
            "no OpenTelemetry Collector at {} (tests/cluster/build otelcol: {other:?})",
            bin.display()
        )),
    }
}

/// A running collector; stopped (SIGTERM, by PID) when dropped.
pub struct Collector {
    child: Child,
    pub http_port: u16,
    pub spans_file: PathBuf,
    log: PathBuf,
    dir: PathBuf,
}

impl Collector {
    /// Starts one on free loopback ports; `None` when there is no binary.
    pub fn start(name: &str) -> Option<Collector> {
        let bin = binary()?;
        let dir = std::env::temp_dir().join(format!("agents-otel-{name}-{}", free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let (spans_file, log) = (dir.join("spans.jsonl"), dir.join("collector.log"));
        let http_port = free_port();
        let child = Command::new(bin)
            .arg(format!(
                "--config={}",
                repo_root().join("tests/otel/collector.yaml").display()
            ))
            .env("OTEL_TEST_SPANS_FILE", &spans_file)
            .env("OTEL_TEST_GRPC_PORT", free_port().to_string())
            .env("OTEL_TEST_HTTP_PORT", http_port.to_string())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("the collector starts");
        let collector = Collector {
            child,
            http_port,
            spans_file,
            log,
            dir,
        };
        collector.wait_ready();
        Some(collector)
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log_text().contains("Everything is ready") {
            assert!(
                Instant::now() < deadline,
                "the collector did not start:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for a process that exports here.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// The environment that turns tracing on, exporting here promptly.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", self.endpoint()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ]
    }

    /// Everything exported so far, as the file holds it.
    pub fn raw(&self) -> String {
        std::fs::read_to_string(&self.spans_file).unwrap_or_default()
    }

    /// Every span exported so far.
    pub fn spans(&self) -> Vec<Span> {
        self.raw()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .flat_map(|l| spans_of(&serde_json::from_str(l).expect("an OTLP JSON line")))
            .collect()
    }

    /// Waits until `done` holds for the exported spans; returns them.
    pub fn wait_for(&self, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "no {what} in 60 s; exported:\n{}",
                tree(&spans)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// One exported span, its attributes flattened to strings.
#[derive(Clone, Debug)]
pub struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent: String,
    pub start_ns: u128,
    pub end_ns: u128,
    pub attributes: BTreeMap<String, String>,
    pub resource: BTreeMap<String, String>,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    pub events: Vec<String>,
    pub error: bool,
}

impl Span {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

fn flat(attributes: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for a in attributes.as_array().into_iter().flatten() {
        let value = a["value"]
            .as_object()
            .and_then(|v| v.values().next())
            .map(|v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .unwrap_or_default();
        out.insert(a["key"].as_str().unwrap_or("").to_string(), value);
    }
    out
}

fn spans_of(export: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in export["resourceSpans"].as_array().into_iter().flatten() {
        let resource = flat(&rs["resource"]["attributes"]);
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                out.push(span_of(s, &resource));
            }
        }
    }
    out
}

fn span_of(s: &Value, resource: &BTreeMap<String, String>) -> Span {
    let text = |v: &Value| v.as_str().unwrap_or("").to_string();
    let nanos = |v: &Value| v.as_str().and_then(|n| n.parse().ok()).unwrap_or(0);
    Span {
        name: text(&s["name"]),
        trace_id: text(&s["traceId"]),
        span_id: text(&s["spanId"]),
        parent: text(&s["parentSpanId"]),
        start_ns: nanos(&s["startTimeUnixNano"]),
        end_ns: nanos(&s["endTimeUnixNano"]),
        attributes: flat(&s["attributes"]),
        resource: resource.clone(),
        links: s["links"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| (text(&l["traceId"]), text(&l["spanId"])))
            .collect(),
        events: s["events"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| text(&e["name"]))
            .collect(),
        error: s["status"]["code"].as_i64() == Some(2),
    }
}

/// The spans as an indented tree (children under their parent, in start
/// order), each with its duration, its key attributes and its links.
pub fn tree(spans: &[Span]) -> String {
    let mut sorted: Vec<&Span> = spans.iter().collect();
    sorted.sort_by_key(|s| s.start_ns);
    let short = |id: &str| id.chars().take(8).collect::<String>();
    let traces: std::collections::BTreeSet<&str> =
        sorted.iter().map(|s| s.trace_id.as_str()).collect();
    let mut out = format!(
        "trace {}\n",
        traces.into_iter().collect::<Vec<_>>().join(", ")
    );
    for root in sorted.iter().filter(|s| s.parent.is_empty()) {
        below(&sorted, root, 0, &short, &mut out);
    }
    out
}

/// `span` and, indented, the spans under it (a sub-agent's steps go under
/// its parent's call span), to a bounded depth.
fn below(
    sorted: &[&Span],
    span: &Span,
    depth: usize,
    short: &dyn Fn(&str) -> String,
    out: &mut String,
) {
    out.push_str(&line(span, depth, short));
    if depth >= 16 {
        return;
    }
    for child in sorted.iter().filter(|c| c.parent == span.span_id) {
        below(sorted, child, depth + 1, short, out);
    }
}

fn line(s: &Span, depth: usize, short: &dyn Fn(&str) -> String) -> String {
    const SHOWN: &[&str] = &[
        "agents.step.outcome",
        "gen_ai.request.model",
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
        "gen_ai.tool.call.id",
        "agents.result.source",
        "agents.tool.runner",
        "agents.result.completed_by",
    ];
    let attrs: Vec<String> = SHOWN
        .iter()
        .filter_map(|k| s.attr(k).map(|v| format!("{k}={v}")))
        .collect();
    let mut text = format!(
        "{}{} [span {}, {} ms] {}",
        "    ".repeat(depth),
        s.name,
        short(&s.span_id),
        (s.end_ns.saturating_sub(s.start_ns)) / 1_000_000,
        attrs.join(" ")
    );
    for (_, span) in &s.links {
        text.push_str(&format!(" (link -> span {})", short(span)));
    }
    for e in &s.events {
        text.push_str(&format!(" (event {e})"));
    }
    text.push('\n');
    text
}
