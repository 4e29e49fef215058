//! Tool calls per second through the engine on the embedded store, against
//! the raw SQLite write rate measured in the same run on the same disk with
//! the same settings (WAL, synchronous=FULL).
//!
//! `cargo bench --bench engine_vs_sqlite` (env: BENCH_SESSIONS, BENCH_TURNS,
//! BENCH_CALLS). A benchmark, not a timed test: it prints, it never fails on
//! speed.

use agents::core::SessionState;
use agents::standalone::definition;
use agents::standalone::driver::{drive, now, DriveOptions, Outcome};
use agents::store::sqlite::SqliteStore;
use agents::store::*;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn yaml(name: &str, turns: usize, calls: usize, disposition: &str) -> String {
    let mut replies = String::new();
    for t in 0..turns {
        replies.push_str("          - toolCalls:\n");
        for c in 0..calls {
            replies.push_str(&format!(
                "              - {{name: echo, arguments: {{text: \"turn {t} call {c}\"}}}}\n"
            ));
        }
    }
    replies.push_str("          - text: done\n");
    format!(
        r#"apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["go"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
{replies}    tools:
      - {{name: echo, builtin: {{function: echo}}}}
    policy:
      default: {disposition}
"#
    )
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("agents-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Drives `sessions` sessions to the end; returns (calls, seconds, writes, state bytes).
async fn engine(
    dir: &Path,
    disposition: &str,
    sessions: usize,
    turns: usize,
    calls: usize,
) -> (usize, f64, u64, usize) {
    let path = dir.join(format!("engine-{disposition}.db"));
    let store = SqliteStore::open(&path).unwrap();
    let mut state_bytes = 0;
    let started = Instant::now();
    for i in 0..sessions {
        let def =
            definition::parse(&yaml(&format!("s{i}"), turns, calls, disposition), "bench").unwrap();
        let agent = def.build(now(), &agents::agent::NoSecrets).unwrap();
        let id = def.session_id();
        store
            .create_session(SessionRecord {
                state: SessionState::new(id.clone()),
                input: SessionInput {
                    messages: vec!["go".into()],
                    ..SessionInput::default()
                },
                namespace: String::new(),
                uid: format!("bench-{i}"),
                definition: serde_json::to_value(&def).unwrap(),
                created_at: now(),
                updated_at: now(),
                trace: None,
            })
            .await
            .unwrap();
        let outcome = drive(&store, &agent, &id, &DriveOptions::default(), &|_| {})
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Succeeded { .. }), "{outcome:?}");
        let state: SessionState = store.load_session(&id).await.unwrap().unwrap().value.state;
        state_bytes = serde_json::to_string(&state).unwrap().len();
    }
    let secs = started.elapsed().as_secs_f64();
    (
        sessions * turns * calls,
        secs,
        writes_in(&path),
        state_bytes,
    )
}

/// Write transactions the engine made: session saves (the version counts
/// them, creation included), continuation inserts and their result writes.
fn writes_in(path: &Path) -> u64 {
    let conn = rusqlite::Connection::open(path).unwrap();
    let q = |sql: &str| -> u64 { conn.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap() as u64 };
    q("SELECT COALESCE(SUM(version), 0) FROM sessions")
        + q("SELECT COUNT(*) FROM continuations")
        + q("SELECT COUNT(result) FROM continuations")
        + q("SELECT COUNT(*) FROM tool_cache")
}

/// Single-row write transactions of `bytes` bytes, as the store commits them.
fn raw_sqlite(dir: &Path, writes: usize, bytes: usize) -> f64 {
    let conn = rusqlite::Connection::open(dir.join("raw.db")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", "FULL").unwrap();
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, version INTEGER, doc TEXT)")
        .unwrap();
    conn.execute("INSERT INTO t VALUES (1, 0, '')", []).unwrap();
    let doc = "x".repeat(bytes);
    let started = Instant::now();
    for v in 0..writes {
        conn.execute(
            "UPDATE t SET version = version + 1, doc = ?1 WHERE id = 1 AND version = ?2",
            rusqlite::params![doc, v as i64],
        )
        .unwrap();
    }
    writes as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    // `cargo test --benches` runs this with `--bench`-less args; keep it quick then.
    let quick = std::env::args().any(|a| a == "--test");
    let sessions = env("BENCH_SESSIONS", if quick { 1 } else { 20 });
    let turns = env("BENCH_TURNS", if quick { 2 } else { 10 });
    let calls = env("BENCH_CALLS", if quick { 2 } else { 5 });
    let dir = scratch();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    println!("workload: {sessions} sessions x {turns} turns x {calls} tool calls (builtin echo), embedded store: WAL, synchronous=FULL");
    let mut results = Vec::new();
    for disposition in ["runSync", "runAsync"] {
        let (n, secs, writes, bytes) =
            rt.block_on(engine(&dir, disposition, sessions, turns, calls));
        let rate = n as f64 / secs;
        println!(
            "engine  {disposition:<8}: {n} tool calls in {secs:.3} s = {rate:>9.0} calls/s  ({writes} store writes, {:.2} per call; final state {bytes} bytes)",
            writes as f64 / n as f64
        );
        results.push((disposition, rate, bytes));
    }
    let doc = results.iter().map(|r| r.2).max().unwrap_or(1024) / 2;
    let raw_writes = env("BENCH_RAW_WRITES", if quick { 50 } else { 2000 });
    let raw = raw_sqlite(&dir, raw_writes, doc.max(256));
    println!(
        "raw SQLite        : {raw_writes} single-row transactions of {} bytes = {raw:>9.0} writes/s",
        doc.max(256)
    );
    for (disposition, rate, _) in &results {
        println!(
            "ratio   {disposition:<8}: engine calls/s / raw writes/s = {:.2}",
            rate / raw
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
