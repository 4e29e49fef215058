//! Sessions at scale in etcd (issue 17), measured in one run on the test
//! cluster:
//!
//! - the raw bound: Session status patches a second by plain clients, at
//!   the operator's reconcile concurrency (16), each patch the size of an
//!   operator's status write;
//! - the operator driving batches of sessions of the requested flow's shape
//!   (two model turns; a runSync and a runAsync call): sessions a second,
//!   API writes per session (Session and Continuation writes apart), the
//!   ratio of the writes it drove to the raw bound, wake latency p50/p99 and
//!   reconcile p99 from its own histograms, its RSS and peak RSS, and
//!   kube-apiserver's RSS;
//! - etcd's database before, after, and once retention
//!   (`--finished-session-ttl-seconds`) has removed the finished sessions
//!   (then compacted and defragmented, as a cluster's maintenance does).
//!
//! Ignored by default (minutes):
//!
//!     AGENTS_SCALE_SESSIONS=200,1000 cargo test --test cluster_exclusive cluster_scale:: -- --ignored --nocapture
//!
//! The operator measured is a release build (built by the test unless
//! `AGENTS_SCALE_BIN` names one). It keeps only what reconcile reads of
//! each Session, and its Events leave through a bounded, paced queue, so
//! its memory per session stays well below what a full copy of each object
//! cost (55 KB a session before). The API server's requests per session,
//! by verb and resource (reads included), show where its time goes; the
//! operator's own counters show the requests each wake by the completer
//! sent before its first write, and its reads per completed call.

use crate::support;

use kube::api::{Api, Patch, PatchParams, PostParams};
use std::time::{Duration, Instant};
use support::{kubectl_ok, TestNamespace};

/// The operator measured: the release build the image ships.
fn operator_bin() -> String {
    support::release_agents_bin()
}

fn sessions_yaml(from: usize, to: usize) -> String {
    sessions_of("flow", "s", from, to)
}

fn sessions_of(agent: &str, prefix: &str, from: usize, to: usize) -> String {
    (from..to)
        .map(|i| {
            format!(
                r#"---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {prefix}{i:05}}}
spec:
  messages: ["fetch two things, please, session {i}"]
  agentRef: {{name: {agent}}}
"#
            )
        })
        .collect()
}

/// The flow each session runs: two built-in calls (one runAsync), then an
/// answer about as long as a real one.
fn agent() -> String {
    support::fake::builtin_flow_agent(
        "both things are here, and this answer is about as long as a real one tends to be",
    )
}

fn apply(ns: &str, yaml: &str) {
    support::apply_with(ns, yaml, &["--server-side"]);
}

/// kube-apiserver's live heap: what its last garbage collection marked
/// live (`go_gc_heap_live_bytes`), in MiB. RSS is a high-water mark of a
/// heap that runs up to twice its live size between collections, so it
/// says little of what each stored session keeps.
fn api_live_heap_mib() -> f64 {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("go_gc_heap_live_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|b| b / (1024.0 * 1024.0))
        .unwrap_or(f64::NAN)
}

/// kube-apiserver's memory after a batch, and the event history its
/// Session watch cache keeps: an object per write of the last 75 s at
/// least (`eventFreshDuration`), in a ring that doubles while full of
/// fresh events and empties only as later writes overwrite it. So after a
/// batch the heap holds each session's writes, not only the session.
struct HeapRow {
    sessions: usize,
    live_mib: f64,
    rss_mib: f64,
    history_capacity: f64,
}

fn heap_row(sessions: usize) -> HeapRow {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    HeapRow {
        sessions,
        live_mib: api_live_heap_mib(),
        rss_mib: rss_mib(apiserver_pid()),
        history_capacity: sample(
            &metrics,
            "watch_cache_capacity{group=\"agents-exe.io\",resource=\"sessions\"}",
        ),
    }
}

/// kube-apiserver's live heap and RSS after each batch, and what each
/// grew per 1,000 sessions from one batch to the next.
fn print_heap_rows(rows: &[HeapRow]) {
    println!("| sessions | kube-apiserver live heap MiB | per 1,000 sessions since the batch before | its RSS MiB | per 1,000 sessions since the batch before | Session watch cache history (events) |");
    println!("|---|---|---|---|---|---|");
    let mut before: Option<&HeapRow> = None;
    for row in rows {
        let per = |now: f64, then: f64, then_size: usize| {
            format!(
                "{:.0}",
                (now - then) * 1000.0 / (row.sessions - then_size) as f64
            )
        };
        let (heap_per, rss_per) = match before {
            Some(b) if row.sessions > b.sessions => (
                per(row.live_mib, b.live_mib, b.sessions),
                per(row.rss_mib, b.rss_mib, b.sessions),
            ),
            _ => ("-".into(), "-".into()),
        };
        println!(
            "| {} | {:.0} | {heap_per} | {:.0} | {rss_per} | {:.0} |",
            row.sessions, row.live_mib, row.rss_mib, row.history_capacity
        );
        before = Some(row);
    }
}

/// kube-apiserver holding what etcd stores and no history of writes:
/// restarted, its Session and Continuation watch caches filled from etcd,
/// then collected. The difference between two of these is what stored
/// sessions cost it at rest.
struct AtRest {
    sessions: usize,
    live_mib: f64,
    rss_mib: f64,
}

fn api_memory_at_rest() -> AtRest {
    let restarted = support::chaos(&["restart", "kube-apiserver", "1"]);
    assert!(
        restarted.status.success(),
        "tests/cluster/chaos restart kube-apiserver failed (its output above)"
    );
    support::wait_for(
        "kube-apiserver ready again",
        Duration::from_secs(90),
        || {
            support::kubectl(["get", "--raw", "/readyz"])
                .status
                .success()
        },
    );
    // A CRD's watch cache starts with the first request for it, and counts
    // its initialisation once filled from etcd.
    let sessions = kubectl_ok(["get", "sessions", "-A", "-o", "name"])
        .lines()
        .count();
    kubectl_ok(["get", "continuations", "-A", "-o", "name"]);
    for resource in ["sessions", "continuations"] {
        let series = format!(
            "apiserver_watch_cache_initializations_total{{group=\"agents-exe.io\",resource=\"{resource}\"}}"
        );
        support::wait_for(
            &format!("the {resource} watch cache"),
            Duration::from_secs(60),
            || sample(&kubectl_ok(["get", "--raw", "/metrics"]), &series) >= 1.0,
        );
    }
    force_api_gc();
    AtRest {
        sessions,
        live_mib: api_live_heap_mib(),
        rss_mib: settled_rss_mib(apiserver_pid()),
    }
}

/// A process's RSS once the Go runtime has given back what its last
/// collection freed: its scavenger returns pages in the background, down
/// to about 1.1 times the heap's next goal. Read every 5 s until two
/// readings 10 s apart differ by under 1 MiB, or for 2 minutes at most.
fn settled_rss_mib(pid: i32) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut readings = vec![rss_mib(pid)];
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_secs(5));
        readings.push(rss_mib(pid));
        if let [.., ten_seconds_ago, _, now] = readings[..] {
            if (ten_seconds_ago - now).abs() < 1.0 {
                break;
            }
        }
    }
    *readings.last().unwrap()
}

/// Collects kube-apiserver's heap: at once through `/debug/pprof/heap?gc=1`
/// when it profiles (`AGENTS_CLUSTER_PROFILING=true tests/cluster/up`),
/// else by waiting for its next collection (the Go runtime forces one at
/// least every two minutes).
fn force_api_gc() {
    if support::kubectl(["get", "--raw", "/debug/pprof/heap?gc=1"])
        .status
        .success()
    {
        return;
    }
    let collections = || {
        sample(
            &kubectl_ok(["get", "--raw", "/metrics"]),
            "go_gc_duration_seconds_count",
        )
    };
    let before = collections();
    support::wait_for(
        "kube-apiserver's next garbage collection",
        Duration::from_secs(150),
        || collections() > before,
    );
}

fn print_at_rest(before: &AtRest, after: &AtRest) {
    let stored = after.sessions.saturating_sub(before.sessions).max(1) as f64;
    let per = |now: f64, then: f64| (now - then) * 1000.0 / stored;
    println!("| kube-apiserver at rest (restarted, caches filled, collected) | sessions stored | live heap MiB | RSS MiB, settled |");
    println!("|---|---|---|---|");
    println!(
        "| before the batches | {} | {:.0} | {:.0} |",
        before.sessions, before.live_mib, before.rss_mib
    );
    println!(
        "| with the sessions | {} | {:.0} | {:.0} |",
        after.sessions, after.live_mib, after.rss_mib
    );
    println!(
        "| per 1,000 sessions stored (with their Continuations and Events) | | {:.1} | {:.1} |",
        per(after.live_mib, before.live_mib),
        per(after.rss_mib, before.rss_mib)
    );
}

fn rss_mib(pid: i32) -> f64 {
    vm_kib(pid, "VmRSS:") / 1024.0
}

fn apiserver_pid() -> i32 {
    cluster_pid("kube-apiserver")
}

fn cluster_pid(component: &str) -> i32 {
    std::fs::read_to_string(format!("/var/lib/agents-test-cluster/pids/{component}.pid"))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0)
}

/// CPU seconds a process has used (user and system), from /proc.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command (which may hold spaces) in parentheses.
    let after = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of stat, 12 and 13 here.
    let hz = 100.0; // USER_HZ on Linux
    (ticks(11) + ticks(12)) / hz
}

/// CPU seconds of the operator, kube-apiserver and etcd.
fn cpu_of(operator: i32) -> [f64; 3] {
    [
        cpu_seconds(operator),
        cpu_seconds(apiserver_pid()),
        cpu_seconds(cluster_pid("etcd")),
    ]
}

/// Sessions of `ns` that have succeeded (phases only are fetched).
fn succeeded(ns: &str) -> usize {
    let out = kubectl_ok([
        "get",
        "sessions",
        "-n",
        ns,
        "-o",
        "jsonpath={.items[*].status.phase}",
    ]);
    out.split_whitespace().filter(|p| *p == "Succeeded").count()
}

/// The operator's reconcile concurrency (its default).
const CONCURRENCY: usize = 16;

/// Status patches a second that `CONCURRENCY` plain clients get through,
/// each the size of an operator's status write (about 4 KB), on Sessions
/// no operator watches.
async fn raw_patch_bound(client: &kube::Client, ns: &str, patches: usize) -> f64 {
    let api: Api<agents::api::Session> = Api::namespaced(client.clone(), ns);
    for i in 0..CONCURRENCY {
        let object = serde_json::json!({
            "apiVersion": "agents-exe.io/v1alpha1", "kind": "Session",
            "metadata": {"name": format!("raw{i}")},
            "spec": {"messages": ["raw"], "agentRef": {"name": "none"}},
        });
        let object: agents::api::Session = serde_json::from_value(object).unwrap();
        api.create(&PostParams::default(), &object).await.unwrap();
    }
    let started = Instant::now();
    let tasks = (0..CONCURRENCY).map(|i| {
        let api = api.clone();
        tokio::spawn(async move {
            for n in 0..patches / CONCURRENCY {
                let message = format!("{n:06} {}", "x".repeat(4000));
                let body = serde_json::json!({"status": {"conditions": [{
                    "type": "Succeeded", "status": "Unknown", "reason": "InProgress",
                    "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
                api.patch_status(
                    &format!("raw{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(&body),
                )
                .await
                .unwrap();
            }
        })
    });
    for t in futures::future::join_all(tasks).await {
        t.unwrap();
    }
    (patches / CONCURRENCY * CONCURRENCY) as f64 / started.elapsed().as_secs_f64()
}

/// A histogram's cumulative buckets (upper bound, count) in `metrics`.
fn buckets(metrics: &str, name: &str) -> Vec<(f64, f64)> {
    buckets_where(metrics, name, &[])
}

/// A histogram's cumulative buckets over the series whose labels include
/// every one of `labels`, summed by bound.
fn buckets_where(metrics: &str, name: &str, labels: &[(&str, &str)]) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut by_bound: Vec<(f64, f64)> = Vec::new();
    for line in metrics.lines() {
        let Some((set, n)) = line
            .strip_prefix(&prefix)
            .and_then(|rest| rest.rsplit_once("} "))
        else {
            continue;
        };
        let pairs: Vec<(&str, &str)> = set
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        if !labels.iter().all(|l| pairs.contains(l)) {
            continue;
        }
        let Some(le) = pairs.iter().find(|(k, _)| *k == "le").map(|(_, v)| *v) else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            let Ok(le) = le.parse() else { continue };
            le
        };
        let n: f64 = n.trim().parse().unwrap_or(0.0);
        match by_bound.iter_mut().find(|(l, _)| *l == le) {
            Some((_, total)) => *total += n,
            None => by_bound.push((le, n)),
        }
    }
    by_bound.sort_by(|a, b| a.0.total_cmp(&b.0));
    by_bound
}

/// [`quantile`] of the API server's own request latency for one verb and
/// resource (`subresource` "" for the object itself).
fn api_quantile(before: &str, after: &str, verb: &str, resource: &str, q: f64) -> String {
    let labels = [("verb", verb), ("resource", resource)];
    let old = buckets_where(before, "apiserver_request_duration_seconds", &labels);
    let new = buckets_where(after, "apiserver_request_duration_seconds", &labels);
    ms(quantile_of(&old, new, q))
}

/// Quantile `q` of what a histogram took in between two scrapes: the upper
/// bound of the bucket that holds it.
fn quantile(before: &str, after: &str, name: &str, q: f64) -> Option<f64> {
    quantile_of(&buckets(before, name), buckets(after, name), q)
}

fn quantile_of(old: &[(f64, f64)], new: Vec<(f64, f64)>, q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = new
        .into_iter()
        .map(|(le, n)| {
            let was = old.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, n)| *n);
            (le, n - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    delta
        .iter()
        .find(|(_, n)| *n >= q * total)
        .map(|(le, _)| *le)
}

fn ms(v: Option<f64>) -> String {
    match v {
        Some(s) if s.is_finite() => format!("{:.0}", s * 1000.0),
        Some(_) => "> max".into(),
        None => "-".into(),
    }
}

fn vm_kib(pid: i32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

const ETCD: &str = "http://127.0.0.1:23790";

fn etcdctl(args: &[&str]) -> String {
    let bin = std::fs::read_dir("/var/cache/agents-cluster")
        .unwrap()
        .flatten()
        .map(|e| e.path().join("etcdctl"))
        .find(|p| p.is_file())
        .expect("etcdctl, built by tests/cluster/build");
    let out = std::process::Command::new(bin)
        .arg(format!("--endpoints={ETCD}"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// etcd's database size and the part of it in use, in MB.
fn etcd_mb() -> (f64, f64) {
    let status: serde_json::Value =
        serde_json::from_str(&etcdctl(&["endpoint", "status", "-w", "json"])).unwrap();
    let s = &status[0]["Status"];
    let mb = |k: &str| s[k].as_f64().unwrap_or(0.0) / 1e6;
    (mb("dbSize"), mb("dbSizeInUse"))
}

/// Compacts etcd's history up to now and defragments it: what the API
/// server's periodic compaction and an operator's maintenance do.
fn etcd_compact_and_defrag() {
    let status: serde_json::Value =
        serde_json::from_str(&etcdctl(&["endpoint", "status", "-w", "json"])).unwrap();
    let revision = status[0]["Status"]["header"]["revision"].as_u64().unwrap();
    let out = etcdctl(&["compact", &revision.to_string(), "--physical"]);
    assert!(out.contains("compacted"), "{out}");
    etcdctl(&["defrag"]);
}

/// Keys and value bytes etcd holds under `prefix` (each value as stored:
/// JSON for custom resources, protobuf for built-in kinds).
fn etcd_bytes_under(prefix: &str) -> (usize, usize) {
    let out = etcdctl(&["get", prefix, "--prefix", "-w", "json"]);
    let got: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let kvs = got["kvs"].as_array().cloned().unwrap_or_default();
    let bytes = kvs
        .iter()
        .filter_map(|kv| kv["value"].as_str())
        // base64: four characters for three bytes
        .map(|v| v.len() / 4 * 3 - v.matches('=').count())
        .sum();
    (kvs.len(), bytes)
}

/// What finished flow sessions cost etcd, by kind, per session; the bytes
/// of a status write on the wire; the managedFields of one session.
fn capture_cost_per_session(
    ns: &str,
    sessions: usize,
    body_before: &str,
    body_after: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    out.push(format!(
        "| {sessions} finished sessions in etcd | objects | bytes | bytes per session |"
    ));
    out.push("|---|---|---|---|".to_string());
    let mut total = 0;
    for (kind, prefix) in [
        ("Session", format!("/registry/agents-exe.io/sessions/{ns}/")),
        (
            "Continuation",
            format!("/registry/agents-exe.io/continuations/{ns}/"),
        ),
        ("ConfigMap (blobs)", format!("/registry/configmaps/{ns}/")),
        ("Event", format!("/registry/events/{ns}/")),
    ] {
        let (objects, bytes) = etcd_bytes_under(&prefix);
        total += bytes;
        out.push(format!(
            "| {kind} | {objects} | {bytes} | {:.0} |",
            bytes as f64 / sessions as f64
        ));
    }
    out.push(format!(
        "| all | | {total} | {:.0} |",
        total as f64 / sessions as f64
    ));
    let sum = |m: &str, which: &str| {
        m.lines()
            .filter(|l| l.starts_with(&format!("apiserver_request_body_size_bytes_{which}{{")))
            // Status writes are PUTs (verb "update"); the creates, by
            // server-side apply, are "patch".
            .filter(|l| l.contains("resource=\"sessions\"") && l.contains("verb=\"update\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let bytes = sum(body_after, "sum") - sum(body_before, "sum");
    let patches = sum(body_after, "count") - sum(body_before, "count");
    let one: serde_json::Value = serde_json::from_str(&kubectl_ok([
        "get",
        "session",
        "s00000",
        "-n",
        ns,
        "--show-managed-fields",
        "-o",
        "json",
    ]))
    .unwrap();
    let managed = serde_json::to_vec(&one["metadata"]["managedFields"])
        .unwrap()
        .len();
    out.push(format!(
        "status writes on the wire: {:.0} bytes each ({patches:.0} PUTs); managedFields of a finished session: {managed} bytes ({} managers)",
        bytes / patches.max(1.0),
        one["metadata"]["managedFields"].as_array().map_or(0, |a| a.len())
    ));
    out
}

fn sessions_left(ns: &str) -> usize {
    kubectl_ok(["get", "sessions", "-n", ns, "-o", "name"])
        .lines()
        .count()
}

/// Every request the API server counted, by verb and resource (reads
/// included): where its time goes.
fn requests_by_verb() -> std::collections::BTreeMap<(String, String), f64> {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    let mut out = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some((labels, value)) = line
            .strip_prefix("apiserver_request_total{")
            .and_then(|r| r.split_once("} "))
        else {
            continue;
        };
        let get = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let n: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry((get("verb"), get("resource"))).or_insert(0.0) += n;
    }
    out
}

fn writes_by_resource() -> (u64, u64, u64) {
    let w = support::api_writes();
    let of = |r: &str| {
        w.iter()
            .filter(|((_, res), _)| res == r)
            .map(|(_, n)| n)
            .sum()
    };
    (of("sessions"), of("continuations"), of("events"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes of load on the test cluster; run by hand (see the module doc)"]
async fn sessions_at_scale() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let sizes: Vec<usize> = std::env::var("AGENTS_SCALE_SESSIONS")
        .unwrap_or_else(|_| "200,1000".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("AGENTS_SCALE_SESSIONS: numbers, comma-separated")
        })
        .collect();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let at_rest_before = api_memory_at_rest();
    // Compacted and defragmented first, so before and after compare alike.
    etcd_compact_and_defrag();
    let etcd_start = etcd_mb();
    let raw_ns = TestNamespace::create(&client, "scale-raw").await;
    let api_cpu_before = cpu_seconds(apiserver_pid());
    let raw = raw_patch_bound(&client, &raw_ns.name, 4000).await;
    let api_ms_per_patch = (cpu_seconds(apiserver_pid()) - api_cpu_before) * 1000.0 / 4000.0;
    raw_ns.delete(&client).await;
    println!("machine: {cores} cores; raw bound: {raw:.0} status patches/s ({CONCURRENCY} clients, 4 KB each), kube-apiserver CPU {api_ms_per_patch:.1} ms a patch");

    let ns = TestNamespace::create(&client, "scale").await;
    apply(&ns.name, &agent());
    let kubeconfig = support::kubeconfig_path().unwrap();
    let bin = operator_bin();
    println!("operator: {bin}");
    let op = support::launcher::Operator::start(&bin, "scale", &kubeconfig, &["-n", &ns.name], &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_rss = rss_mib(op.pid());
    println!("operator idle RSS {idle_rss:.0} MiB");
    println!("| sessions | sessions/s | Session writes/session | Continuation writes/session | Event writes/session | API writes/s | ratio to raw bound | of the sessions/s the raw bound allows | wake p50 ms | wake p99 ms | reconcile p99 ms | operator RSS MiB | peak MiB | KB/session | kube-apiserver RSS MiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut made = 0;
    let mut per_session_kb = 0.0;
    let mut last_requests = None;
    let mut cpu_rows = Vec::new();
    let mut first_batch_cost = None;
    let mut heap_rows: Vec<HeapRow> = Vec::new();
    for (batch_index, size) in sizes.into_iter().enumerate() {
        let metrics_before = op.probe("/metrics").1;
        let api_metrics_before = kubectl_ok(["get", "--raw", "/metrics"]);
        let (s_before, c_before, e_before) = writes_by_resource();
        let requests_before = requests_by_verb();
        let cpu_before = cpu_of(op.pid());
        let started = Instant::now();
        for chunk in (made..size).step_by(500) {
            apply(&ns.name, &sessions_yaml(chunk, (chunk + 500).min(size)));
        }
        let batch = size - made;
        made = size;
        let deadline = Instant::now() + Duration::from_secs(60 + batch as u64);
        while succeeded(&ns.name) < size {
            assert!(
                Instant::now() < deadline,
                "{size} sessions did not all succeed in time"
            );
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let took = started.elapsed().as_secs_f64();
        let (s_after, c_after, e_after) = writes_by_resource();
        let requests_after = requests_by_verb();
        let cpu_after = cpu_of(op.pid());
        // The creates are the client's (one per session); the rest are the
        // operator's.
        let session_writes = (s_after - s_before) as f64 / batch as f64;
        let continuation_writes = (c_after - c_before) as f64 / batch as f64;
        // Events are written off the reconcile path, paced (--event-qps):
        // they share the API server but are not the session's writes.
        let event_writes = (e_after - e_before) as f64 / batch as f64;
        let operator_writes_per_s =
            ((s_after - s_before) + (c_after - c_before) - batch as u64) as f64 / took;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss = rss_mib(op.pid());
        let peak = vm_kib(op.pid(), "VmHWM:") / 1024.0;
        per_session_kb = (rss - idle_rss).max(0.0) * 1024.0 / size as f64;
        heap_rows.push(heap_row(size));
        let metrics = op.probe("/metrics").1;
        let q = |name: &str, q: f64| ms(quantile(&metrics_before, &metrics, name, q));
        println!(
            "| {size} | {:.1} | {session_writes:.1} | {continuation_writes:.1} | {event_writes:.1} | {operator_writes_per_s:.0} | {:.2} | {:.2} | {} | {} | {} | {rss:.0} | {peak:.0} | {per_session_kb:.1} | {:.0} |",
            batch as f64 / took,
            operator_writes_per_s / raw,
            // The issue's measure: sessions/s against raw / (the writes one
            // session needs, its create included).
            (batch as f64 / took) * (session_writes + continuation_writes) / raw,
            q("agents_wake_latency_seconds", 0.5),
            q("agents_wake_latency_seconds", 0.99),
            q("agents_reconcile_duration_seconds", 0.99),
            rss_mib(apiserver_pid())
        );
        last_requests = Some((batch, requests_before, requests_after));
        if batch_index == 0 {
            // Measured now, printed after the table: later batches add to etcd.
            let api_metrics = kubectl_ok(["get", "--raw", "/metrics"]);
            first_batch_cost = Some(capture_cost_per_session(
                &ns.name,
                size,
                &api_metrics_before,
                &api_metrics,
            ));
        }
        let per = |i: usize| (cpu_after[i] - cpu_before[i]) * 1000.0 / batch as f64;
        cpu_rows.push(format!(
            "| {size} | {:.1} | {:.1} | {:.1} | {:.0} % |",
            per(0),
            per(1),
            per(2),
            100.0 * (cpu_after.iter().sum::<f64>() - cpu_before.iter().sum::<f64>())
                / (took * cores.max(1) as f64)
        ));
    }
    for line in first_batch_cost.unwrap_or_default() {
        println!("{line}");
    }
    print_heap_rows(&heap_rows);
    println!("| sessions | operator CPU ms/session | kube-apiserver CPU ms/session | etcd CPU ms/session | of the machine's CPU |");
    println!("|---|---|---|---|---|");
    for row in &cpu_rows {
        println!("{row}");
    }
    if let Some((size, before, after)) = last_requests {
        println!("| API requests per session ({size}-session batch) | verb | resource |");
        println!("|---|---|---|");
        for (k, n) in &after {
            let d = (n - before.get(k).copied().unwrap_or(0.0)) / size as f64;
            if d >= 0.05 {
                println!("| {d:.2} | {} | {} |", k.0, k.1);
            }
        }
    }
    // The raw bound again, with the sessions in etcd: it moves from run to
    // run on a shared machine, so both ends are shown.
    let raw_ns = TestNamespace::create(&client, "scale-raw").await;
    let raw_after = raw_patch_bound(&client, &raw_ns.name, 4000).await;
    raw_ns.delete(&client).await;
    println!(
        "raw bound after the batches: {raw_after:.0} status patches/s (before: {raw:.0}); \
         sessions/s against the mean of both: see the table's ratio times {:.2}",
        raw / ((raw + raw_after) / 2.0)
    );
    completer_rounds(&client, &ns.name, &op, made).await;
    let etcd_full = etcd_mb();
    drop(op);
    print_at_rest(&at_rest_before, &api_memory_at_rest());

    // Retention: a TTL of one second for finished sessions; the operator
    // deletes them, the garbage collector their continuations.
    let op = support::launcher::Operator::start(
        &bin,
        "scale-retention",
        &kubeconfig,
        &["-n", &ns.name, "--finished-session-ttl-seconds", "1"],
        &[],
    );
    let started = Instant::now();
    // The batches' sessions and the completer's.
    let finished = sessions_left(&ns.name);
    let deadline = started + Duration::from_secs(120 + finished as u64 / 5);
    while sessions_left(&ns.name) > 0 {
        assert!(
            Instant::now() < deadline,
            "retention did not remove the sessions in time"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let retention_took = started.elapsed().as_secs_f64();
    drop(op);
    let continuations = || {
        kubectl_ok(["get", "continuations", "-n", &ns.name, "-o", "name"])
            .lines()
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    while continuations() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    etcd_compact_and_defrag();
    let etcd_after = etcd_mb();
    // What is left is mostly the sessions' Events, which the API server
    // keeps for an hour (--event-ttl); gone with them, etcd is back.
    // One delete-collection request (`kubectl delete events --all` sends
    // one request per Event: minutes for tens of thousands).
    kubectl_ok([
        "delete",
        "--raw",
        &format!("/api/v1/namespaces/{}/events", ns.name),
    ]);
    etcd_compact_and_defrag();
    let etcd_no_events = etcd_mb();
    println!(
        "retention removed {finished} sessions in {retention_took:.0} s ({:.0}/s)",
        finished as f64 / retention_took
    );
    println!("| etcd | database MB | in use MB |");
    println!("|---|---|---|");
    println!("| before | {:.1} | {:.1} |", etcd_start.0, etcd_start.1);
    println!(
        "| with the sessions | {:.1} | {:.1} |",
        etcd_full.0, etcd_full.1
    );
    println!(
        "| after retention, compacted and defragmented | {:.1} | {:.1} |",
        etcd_after.0, etcd_after.1
    );
    println!(
        "| and once the sessions' Events expire | {:.1} | {:.1} |",
        etcd_no_events.0, etcd_no_events.1
    );
    // Before, the operator kept a full copy of each Session: 55 KB a
    // session. (Small runs are dominated by fixed costs.)
    assert!(
        made < 1000 || per_session_kb < 30.0,
        "the operator holds {per_session_kb:.1} KB per finished session"
    );
    ns.delete(&client).await;
}

/// Sessions waiting on one deferred call each, completed by a concurrent
/// completer (8 tasks, as a worker pool would): first as fast as it can (a
/// saturating burst: round trips a second), then paced at half that rate
/// (the wake latency of an operator that is not queueing).
async fn completer_rounds(
    client: &kube::Client,
    ns: &str,
    op: &support::launcher::Operator,
    offset: usize,
) {
    let n = support::sized("AGENTS_SCALE_DEFERRED", 200);
    apply(ns, support::fake::WAITING_AGENT);
    println!(
        "| completer | calls | round trips/s | wake p50 ms | wake p99 ms | reconcile p99 ms | operator RSS MiB, the calls waiting | completion write p50/p99 ms | of which after the write returned p50/p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut rate = None;
    let mut api_rows = Vec::new();
    let mut wake_rows = Vec::new();
    for (round, label) in ["burst", "half the burst's rate"].into_iter().enumerate() {
        let from = offset + round * n;
        apply(ns, &sessions_of("waits", "w", from, from + n));
        let tokens: Vec<String> = (from..from + n).map(|i| format!("w{i:05}-t1-c0")).collect();
        let store = agents::store::kube::KubeStore::new(client.clone(), ns);
        let deadline = Instant::now() + Duration::from_secs(120 + n as u64);
        for t in &tokens {
            while store
                .get_continuation(&agents::core::ContinuationToken(t.clone()))
                .await
                .ok()
                .flatten()
                .is_none()
            {
                assert!(Instant::now() < deadline, "{t} never waited");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let before = op.probe("/metrics").1;
        let api_before = kubectl_ok(["get", "--raw", "/metrics"]);
        let rss_waiting = rss_mib(op.pid());
        let started = Instant::now();
        let pace = rate.map(|r: f64| Duration::from_secs_f64(8.0 / (r / 2.0)));
        let chunks: Vec<Vec<String>> = tokens.chunks(n.div_ceil(8)).map(|c| c.to_vec()).collect();
        let tasks = chunks.into_iter().map(|chunk| {
            let store = agents::store::kube::KubeStore::new(client.clone(), ns);
            tokio::spawn(async move {
                let mut took = Vec::new();
                for t in chunk {
                    let tick = Instant::now();
                    let result = agents::core::ToolResult::text("42");
                    let now = agents::core::Millis(epoch_millis());
                    agents::ports::ContinuationPort::complete(
                        &store,
                        &agents::core::ContinuationToken(t.clone()),
                        &result,
                        "completer",
                        now,
                    )
                    .await
                    .unwrap();
                    took.push((t, tick.elapsed(), epoch_millis()));
                    if let Some(p) = pace {
                        tokio::time::sleep(p.saturating_sub(tick.elapsed())).await;
                    }
                }
                took
            })
        });
        // How long a completion itself takes (the completer's read and
        // write): the first part of every wake latency.
        let mut writes: Vec<Duration> = Vec::new();
        let mut written_at = std::collections::HashMap::new();
        for t in futures::future::join_all(tasks).await {
            for (token, took, at) in t.unwrap() {
                writes.push(took);
                written_at.insert(token, at);
            }
        }
        writes.sort();
        let write_ms = |q: f64| {
            writes
                .get(((writes.len() as f64 * q) as usize).min(writes.len().saturating_sub(1)))
                .map(|d| d.as_millis())
                .unwrap_or(0)
        };
        let done = |ns: String| {
            let out = kubectl_ok([
                "get",
                "sessions",
                "-n",
                &ns,
                "-o",
                "jsonpath={.items[*].status.phase}",
            ]);
            out.split_whitespace().filter(|p| *p == "Succeeded").count()
        };
        let want = offset + (round + 1) * n;
        while done(ns.to_string()) < want {
            assert!(
                Instant::now() < deadline + Duration::from_secs(120),
                "completed sessions did not all succeed"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let took = started.elapsed().as_secs_f64();
        let round_trips = n as f64 / took;
        rate.get_or_insert(round_trips);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = op.probe("/metrics").1;
        wake_rows.push(wake_requests_row(label, n, &before, &after));
        let q = |name: &str, q: f64| ms(quantile(&before, &after, name, q));
        let mut reaction = operator_reactions(client, ns, &written_at).await;
        reaction.sort();
        let reaction_ms = |q: f64| {
            reaction
                .get(((reaction.len() as f64 * q) as usize).min(reaction.len().saturating_sub(1)))
                .map_or("-".to_string(), |m| m.to_string())
        };
        println!(
            "| {label} | {n} | {round_trips:.1} | {} | {} | {} | {rss_waiting:.0} | {}/{} | {}/{} |",
            q("agents_wake_latency_seconds", 0.5),
            q("agents_wake_latency_seconds", 0.99),
            q("agents_reconcile_duration_seconds", 0.99),
            write_ms(0.5),
            write_ms(0.99),
            reaction_ms(0.5),
            reaction_ms(0.99),
        );
        // The API server's own view of the requests on a wake's path.
        let api_after = kubectl_ok(["get", "--raw", "/metrics"]);
        let a = |verb: &str, resource: &str| {
            format!(
                "{}/{}",
                api_quantile(&api_before, &api_after, verb, resource, 0.5),
                api_quantile(&api_before, &api_after, verb, resource, 0.99)
            )
        };
        api_rows.push(format!(
            "| {label} | {} | {} | {} | {} |",
            a("GET", "continuations"),
            a("PATCH", "continuations"),
            a("GET", "sessions"),
            a("PUT", "sessions"),
        ));
    }
    println!("| completer: kube-apiserver's request latency p50/p99 ms (bucket bounds) | GET continuation | PATCH continuation | GET session | PUT session (status) |");
    println!("|---|---|---|---|---|");
    for row in api_rows {
        println!("{row}");
    }
    println!("| completer: the operator's requests (its own counters) | wakes | requests per wake before its first write: mean | p99 | Session GETs per call | Continuation LISTs per call | Continuation GETs per call |");
    println!("|---|---|---|---|---|---|---|");
    for row in wake_rows {
        println!("{row}");
    }
}

fn epoch_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Per completed call, how long after the completer's write returned the
/// operator took the result in (the session's `finishedAt` for it, stamped
/// by the core at take-in): the operator's share of a wake, the rest being
/// the completion's own write through the API server.
async fn operator_reactions(
    client: &kube::Client,
    ns: &str,
    written_at: &std::collections::HashMap<String, i64>,
) -> Vec<i64> {
    let sessions: Api<agents::api::Session> = Api::namespaced(client.clone(), ns);
    let list = sessions
        .list(&kube::api::ListParams::default())
        .await
        .unwrap();
    let mut out = Vec::new();
    for s in list.items {
        let state = s.status.and_then(|st| st.state).unwrap_or_default();
        let results = state["turns"].as_array().into_iter().flatten();
        for r in results.flat_map(|t| t["toolResults"].as_array().into_iter().flatten()) {
            let (Some(token), Some(taken)) = (r["token"].as_str(), r["finishedAt"].as_i64()) else {
                continue;
            };
            if let Some(at) = written_at.get(token) {
                out.push((taken - at).max(0));
            }
        }
    }
    out
}

/// The value of one sample (its name and labels, as scraped), or 0.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// What the operator's own counters say of the `n` calls completed between
/// two scrapes: the wakes, the requests each sent before its first write
/// (`agents_wake_requests_before_write`), and its reads per call
/// (`agents_api_requests_total`).
fn wake_requests_row(label: &str, n: usize, before: &str, after: &str) -> String {
    let delta = |series: &str| sample(after, series) - sample(before, series);
    let wakes = delta("agents_wake_requests_before_write_count");
    let mean = delta("agents_wake_requests_before_write_sum") / wakes.max(1.0);
    let p99 = quantile(before, after, "agents_wake_requests_before_write", 0.99)
        .map_or("-".to_string(), |v| format!("≤ {v:.0}"));
    let per_call = |verb: &str, resource: &str| {
        let series =
            format!("agents_api_requests_total{{verb=\"{verb}\",resource=\"{resource}\"}}");
        delta(&series) / n.max(1) as f64
    };
    format!(
        "| {label} | {wakes:.0} | {mean:.2} | {p99} | {:.2} | {:.2} | {:.2} |",
        per_call("get", "sessions"),
        per_call("list", "continuations"),
        per_call("get", "continuations"),
    )
}
