//! Tool calls per second through the engine on the embedded store, against
//! the raw SQLite write rate measured in the same run on the same disk with
//! the same settings (WAL, synchronous=FULL).
//!
//! `cargo bench --bench engine_vs_sqlite` (env: BENCH_SESSIONS, BENCH_TURNS,
//! BENCH_CALLS). A benchmark, not a timed test: it prints, it never fails on
//! speed.

use agents::core::session::ContinuationSpec;
use agents::core::{CacheKey, ContinuationToken, Millis, SessionId, SessionState, ToolResult};
use agents::standalone::definition;
use agents::standalone::driver::{drive, now, DriveOptions, Outcome};
use agents::store::sqlite::SqliteStore;
use agents::store::*;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Counts the writes the engine makes, to explain the ratio.
struct Counting<S> {
    inner: S,
    writes: Cell<u64>,
}

impl<S: Store> Counting<S> {
    fn bump(&self) {
        self.writes.set(self.writes.get() + 1);
    }
}

impl<S: Store> Store for Counting<S> {
    async fn create_session(&self, record: SessionRecord) -> StoreResult<Version> {
        self.bump();
        self.inner.create_session(record).await
    }
    async fn load_session(&self, id: &SessionId) -> StoreResult<Option<Versioned<SessionRecord>>> {
        self.inner.load_session(id).await
    }
    async fn save_session(&self, r: &SessionRecord, v: &Version) -> StoreResult<Version> {
        self.bump();
        self.inner.save_session(r, v).await
    }
    async fn list_sessions(&self) -> StoreResult<Vec<SessionSummary>> {
        self.inner.list_sessions().await
    }
    async fn ensure_continuation(
        &self,
        spec: &ContinuationSpec,
        now: Millis,
    ) -> StoreResult<ContinuationRecord> {
        self.bump();
        self.inner.ensure_continuation(spec, now).await
    }
    async fn get_continuation(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>> {
        self.inner.get_continuation(token).await
    }
    async fn session_continuations(&self, id: &SessionId) -> StoreResult<Vec<ContinuationRecord>> {
        self.inner.session_continuations(id).await
    }
    async fn complete_continuation(
        &self,
        token: &ContinuationToken,
        result: &ToolResult,
        by: &str,
        now: Millis,
    ) -> StoreResult<WriteOnce> {
        self.bump();
        self.inner
            .complete_continuation(token, result, by, now)
            .await
    }
    async fn decide_continuation(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<WriteOnce> {
        self.bump();
        self.inner.decide_continuation(token, decision).await
    }
    async fn cache_get(&self, key: &CacheKey) -> StoreResult<Option<ToolResult>> {
        self.inner.cache_get(key).await
    }
    async fn cache_put(&self, key: &CacheKey, result: &ToolResult, now: Millis) -> StoreResult<()> {
        self.bump();
        self.inner.cache_put(key, result, now).await
    }
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
    let store = Counting {
        inner: SqliteStore::open(dir.join(format!("engine-{disposition}.db"))).unwrap(),
        writes: Cell::new(0),
    };
    let mut state_bytes = 0;
    let started = Instant::now();
    for i in 0..sessions {
        let def =
            definition::parse(&yaml(&format!("s{i}"), turns, calls, disposition), "bench").unwrap();
        let agent = def.build(now()).unwrap();
        let id = def.session_id();
        let mut s = agents::core::Session::new(id.clone(), agent.config.clone());
        s.handle(
            agents::core::Event::UserMessage { text: "go".into() },
            now(),
        )
        .unwrap();
        store
            .create_session(SessionRecord {
                state: s.into_state(),
                definition: serde_json::to_value(&def).unwrap(),
                created_at: now(),
                updated_at: now(),
            })
            .await
            .unwrap();
        let outcome = drive(&store, &agent, &id, &DriveOptions::default(), &mut |_| {})
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
        store.writes.get(),
        state_bytes,
    )
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
