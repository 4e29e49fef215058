//! The embedded store: one SQLite file in WAL mode.
//!
//! Rows hold JSON documents (the same serde shapes the CRDs carry), plus the
//! few columns that are queried or compared: the session `version` for
//! compare-and-swap, and `result`/`decision` guarded by `IS NULL` so they
//! are written once. `PRAGMA application_id` marks the file as ours and
//! `PRAGMA user_version` counts the migrations applied.

use super::*;
use crate::core::acceptance::{self, Verdict};
use crate::core::session::ContinuationSpec;
use crate::core::{
    CacheKey, CallState, ContinuationToken, Millis, Phase, SessionId, SessionState, ToolResult,
};
use rusqlite::{params, Connection, ErrorCode, OptionalExtension};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

mod files;
mod tree;
#[cfg(test)]
use files::SIDE_FILES;
use files::{file_uri, parent_dir, regular_files, writable};

/// "AGNT": marks a SQLite file as an agents store.
const APPLICATION_ID: i64 = 0x4147_4e54;

/// Each entry is one schema version; never edit a released one, append.
const MIGRATIONS: &[&str] = &[
    // v1: sessions, continuations, cache.
    "CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        version INTEGER NOT NULL,
        phase TEXT NOT NULL,
        paused INTEGER NOT NULL,
        pending INTEGER NOT NULL,
        record TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE TABLE continuations (
        token TEXT PRIMARY KEY,
        session TEXT NOT NULL REFERENCES sessions(id),
        turn INTEGER NOT NULL,
        call_index INTEGER NOT NULL,
        spec TEXT NOT NULL,
        result TEXT,
        completed_by TEXT,
        completed_at INTEGER,
        decision TEXT,
        created_at INTEGER NOT NULL
    );
    CREATE INDEX continuations_by_session ON continuations(session, turn, call_index);
    CREATE TABLE tool_cache (
        tool TEXT NOT NULL,
        arguments_sha256 TEXT NOT NULL,
        result TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (tool, arguments_sha256)
    );",
    // v2: answers to an MCP task's request for input (`agents session answer`).
    "ALTER TABLE continuations ADD COLUMN answers TEXT;",
    // v3: sub-agent trees: a child's parent session, the parent's call that
    // made it, its depth and its root (all NULL, depth 0, for a root).
    "ALTER TABLE sessions ADD COLUMN parent TEXT;
    ALTER TABLE sessions ADD COLUMN parent_call TEXT;
    ALTER TABLE sessions ADD COLUMN depth INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sessions ADD COLUMN root TEXT;
    CREATE INDEX sessions_by_parent ON sessions(parent);",
];

struct Header {
    user_version: i64,
}

/// How long a writer waits for another process's lock before giving up.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

pub struct SqliteStore {
    // rusqlite connections are not Sync; one connection per process is
    // plenty for a CLI, and the mutex makes the store shareable.
    conn: Mutex<Connection>,
    path: PathBuf,
    busy_timeout: Duration,
    /// Opened read-only: every write is refused with [`StoreError::ReadOnly`].
    read_only: bool,
}

impl SqliteStore {
    /// Opens (creating if needed) the store at `path` and applies pending
    /// migrations. Refuses files that are not SQLite or belong to another
    /// application, rather than writing into them. A store this user
    /// cannot write (the file or its directory) is opened read-only.
    pub fn open(path: impl AsRef<Path>) -> StoreResult<Self> {
        Self::open_with_timeout(path, busy_timeout_from_env())
    }

    pub fn open_with_timeout(path: impl AsRef<Path>, busy_timeout: Duration) -> StoreResult<Self> {
        let path = path.as_ref().to_path_buf();
        let display = path.display().to_string();
        let dir = parent_dir(&path);
        if !dir.is_dir() {
            return Err(StoreError::NoDirectory {
                path: display,
                dir: dir.display().to_string(),
            });
        }
        regular_files(&path)?;
        if path.exists() && !(writable(&path) && writable(&dir)) {
            return Self::open_read_only_with_timeout(&path, busy_timeout);
        }
        let conn = match Connection::open(&path) {
            Ok(c) => c,
            Err(_) if path.exists() => {
                return Self::open_read_only_with_timeout(&path, busy_timeout)
            }
            Err(e) => {
                return Err(StoreError::NotAStore {
                    path: display,
                    why: e.to_string(),
                })
            }
        };
        let store = SqliteStore {
            conn: Mutex::new(conn),
            path,
            busy_timeout,
            read_only: false,
        };
        let started = std::time::Instant::now();
        loop {
            match store.init() {
                // Some lock waits (a store being created or switched to WAL
                // by another process) do not go through SQLite's busy
                // handler; wait for them here, within the same budget.
                Err(StoreError::Locked { .. }) if started.elapsed() < busy_timeout => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                // Writable by its mode but not in fact (a read-only mount).
                Err(StoreError::ReadOnly { .. }) => {
                    drop(store);
                    return Self::open_read_only_with_timeout(&display, busy_timeout);
                }
                other => return other.map(|_| store),
            }
        }
    }

    /// Opens an existing store for reading only; writes are refused with
    /// [`StoreError::ReadOnly`]. Nothing is created beside the file: when
    /// no other process has the store open (no `-shm` file), the file is
    /// read as it is (`immutable=1`), since a WAL reader would otherwise
    /// create `-shm`/`-wal` files in a directory that is not ours, or fail
    /// where it cannot; a writer that starts during such a read may make
    /// it fail (run it again), which a short read like `list` accepts.
    /// With a writer at work, its `-shm` is shared (`mode=ro`) and reads
    /// see its commits.
    pub fn open_read_only(path: impl AsRef<Path>) -> StoreResult<Self> {
        Self::open_read_only_with_timeout(path, busy_timeout_from_env())
    }

    fn open_read_only_with_timeout(
        path: impl AsRef<Path>,
        busy_timeout: Duration,
    ) -> StoreResult<Self> {
        let path = path.as_ref().to_path_buf();
        regular_files(&path)?;
        let mut shm = path.clone().into_os_string();
        shm.push("-shm");
        let shared = Path::new(&shm).exists();
        // Sharing a writer's `-shm` can still fail (it may vanish as the
        // writer closes): then read the file as it is.
        let attempts: &[bool] = if shared { &[false, true] } else { &[true] };
        let mut last = None;
        for &immutable in attempts {
            let uri = file_uri(&path, immutable);
            let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY
                | rusqlite::OpenFlags::SQLITE_OPEN_URI
                | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX;
            let conn =
                Connection::open_with_flags(&uri, flags).map_err(|e| StoreError::NotAStore {
                    path: path.display().to_string(),
                    why: e.to_string(),
                })?;
            let store = SqliteStore {
                conn: Mutex::new(conn),
                path: path.clone(),
                busy_timeout,
                read_only: true,
            };
            match store.init_read_only() {
                Ok(()) => return Ok(store),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// True when this store refuses writes.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn init_read_only(&self) -> StoreResult<()> {
        let conn = self.conn.lock().expect("store mutex");
        let header = self.snapshot_header(&conn)?;
        let known = MIGRATIONS.len() as i64;
        if header.user_version < known {
            return Err(StoreError::NotAStore {
                path: self.path.display().to_string(),
                why: format!(
                    "it is read-only for this user and has schema version {} where this build needs {known}; open it once as a user who can write it, which upgrades it",
                    header.user_version
                ),
            });
        }
        Ok(())
    }

    /// Refuses a write up front on a read-only store.
    fn writable(&self) -> StoreResult<()> {
        if self.read_only {
            return Err(StoreError::ReadOnly {
                path: self.path.display().to_string(),
            });
        }
        Ok(())
    }

    /// `sqlite:PATH`, or a bare path.
    pub fn open_url(url: &str) -> StoreResult<Self> {
        Self::open(url.strip_prefix("sqlite:").unwrap_or(url))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn init(&self) -> StoreResult<()> {
        let conn = self.conn.lock().expect("store mutex");
        let err = |e| self.map_err(e);
        let header = self.snapshot_header(&conn)?;
        let known = MIGRATIONS.len() as i64;
        // WAL lets readers (`session list`) run beside a writer; FULL sync
        // makes a recorded result survive power loss, not just a crash.
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(err)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(err)?;
        if header.user_version == known {
            return Ok(());
        }
        // IMMEDIATE takes the write lock first (waiting on the busy
        // timeout), then looks again: another process may have migrated.
        let tx =
            rusqlite::Transaction::new_unchecked(&conn, rusqlite::TransactionBehavior::Immediate)
                .map_err(err)?;
        let header = self.header(&tx)?;
        for (i, sql) in MIGRATIONS
            .iter()
            .enumerate()
            .skip(header.user_version as usize)
        {
            tx.execute_batch(sql).map_err(err)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)
                .map_err(err)?;
        }
        tx.pragma_update(None, "application_id", APPLICATION_ID)
            .map_err(err)?;
        tx.commit().map_err(err)
    }

    /// Reads and checks the file's identity and schema version.
    /// The store's header, read in one transaction (with the store's busy
    /// timeout set), so its facts come from one snapshot even while another
    /// process is creating the store. Reading it is the first real access:
    /// a file that is not SQLite fails here.
    fn snapshot_header(&self, conn: &Connection) -> StoreResult<Header> {
        let err = |e| self.map_err(e);
        conn.busy_timeout(self.busy_timeout).map_err(err)?;
        let tx = conn.unchecked_transaction().map_err(err)?;
        let header = self.header(&tx)?;
        tx.commit().map_err(err)?;
        Ok(header)
    }

    fn header(&self, conn: &Connection) -> StoreResult<Header> {
        let err = |e| self.map_err(e);
        let app_id: i64 = conn
            .query_row("PRAGMA application_id", [], |r| r.get(0))
            .map_err(err)?;
        let user_version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(err)?;
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .map_err(err)?;
        if app_id != APPLICATION_ID && (app_id != 0 || tables > 0) {
            return Err(StoreError::NotAStore {
                path: self.path.display().to_string(),
                why: "it is a SQLite database of another application; pass a new path with --store sqlite:PATH".into(),
            });
        }
        let known = MIGRATIONS.len() as i64;
        if user_version > known {
            return Err(StoreError::TooNew {
                path: self.path.display().to_string(),
                found: user_version,
                known,
            });
        }
        Ok(Header { user_version })
    }

    fn map_err(&self, e: rusqlite::Error) -> StoreError {
        let path = self.path.display().to_string();
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Locked {
                path,
                waited_ms: self.busy_timeout.as_millis() as u64,
            },
            Some(ErrorCode::NotADatabase) => StoreError::NotAStore {
                path,
                why: "the file is not a SQLite database (or it is corrupt)".into(),
            },
            Some(ErrorCode::DatabaseCorrupt) => StoreError::NotAStore {
                path,
                why: "the database file is corrupt".into(),
            },
            Some(ErrorCode::ReadOnly) => StoreError::ReadOnly { path },
            _ => StoreError::Backend(format!("{path}: {e}")),
        }
    }

    fn with<T>(
        &self,
        mut f: impl FnMut(&mut Connection) -> Result<T, rusqlite::Error>,
    ) -> StoreResult<T> {
        let mut conn = self.conn.lock().expect("store mutex");
        let started = std::time::Instant::now();
        loop {
            match f(&mut conn) {
                Ok(v) => return Ok(v),
                // A busy error that bypassed the busy handler (e.g. a stale
                // WAL snapshot): the statement left nothing behind, retry.
                Err(e)
                    if matches!(e.sqlite_error_code(), Some(ErrorCode::DatabaseBusy))
                        && started.elapsed() < self.busy_timeout =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(self.map_err(e)),
            }
        }
    }
}

/// The rows of five columns a query read.
type FiveColumns<A, B, C, D, E> = rusqlite::Result<Vec<(A, B, C, D, E)>>;

/// The rows of a query of five columns, as tuples.
fn five_columns<A, B, C, D, E>(
    c: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> FiveColumns<A, B, C, D, E>
where
    A: rusqlite::types::FromSql,
    B: rusqlite::types::FromSql,
    C: rusqlite::types::FromSql,
    D: rusqlite::types::FromSql,
    E: rusqlite::types::FromSql,
{
    let mut stmt = c.prepare(sql)?;
    let rows = stmt.query_map(params, |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })?;
    rows.collect()
}

fn busy_timeout_from_env() -> Duration {
    std::env::var("AGENTS_STORE_BUSY_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_BUSY_TIMEOUT)
}

fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("store types serialise")
}

fn from_json<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> StoreResult<T> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
        what: what.to_string(),
        why: e.to_string(),
    })
}

fn phase_name(p: Phase) -> String {
    format!("{p:?}")
}

fn pending_count(state: &SessionState) -> i64 {
    state
        .open
        .iter()
        .flat_map(|o| o.calls.iter())
        .filter(|c| c.state() == CallState::Deferred)
        .count() as i64
}

fn version_number(v: &Version) -> i64 {
    // A version this store did not hand out can never match.
    v.0.parse().unwrap_or(-1)
}

fn load_continuation(row: &rusqlite::Row<'_>) -> rusqlite::Result<ContinuationRow> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
        row.get(6)?,
        row.get(7)?,
    ))
}

type ContinuationRow = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    i64,
    Option<String>,
);

const CONTINUATION_COLUMNS: &str =
    "token, spec, result, completed_by, completed_at, decision, created_at, answers";

fn continuation_from_row(row: ContinuationRow) -> StoreResult<ContinuationRecord> {
    let (token, spec, result, completed_by, completed_at, decision, created_at, answers) = row;
    let what = format!("continuation {token}");
    Ok(ContinuationRecord {
        spec: from_json(&what, &spec)?,
        result: result.map(|r| from_json(&what, &r)).transpose()?,
        completed_by,
        completed_at: completed_at.map(Millis),
        decision: decision.map(|d| from_json(&what, &d)).transpose()?,
        created_at: Millis(created_at),
        answers,
    })
}

impl SqliteStore {
    /// Records answers to the MCP task behind `token` (an open call's only).
    pub fn answer_task(&self, token: &ContinuationToken, answers: &str) -> StoreResult<()> {
        let changed = self.with(|c| {
            c.execute(
                "UPDATE continuations SET answers = ?2 WHERE token = ?1 AND result IS NULL",
                rusqlite::params![token.0, answers],
            )
        })?;
        if changed == 0 {
            return Err(StoreError::NotAccepting {
                token: token.clone(),
                why: "it is unknown or already completed".into(),
            });
        }
        Ok(())
    }

    fn continuation_row(&self, token: &ContinuationToken) -> StoreResult<Option<ContinuationRow>> {
        self.with(|c| {
            c.query_row(
                &format!("SELECT {CONTINUATION_COLUMNS} FROM continuations WHERE token = ?1"),
                [&token.0],
                load_continuation,
            )
            .optional()
        })
    }

    /// Sync form of [`Store::get_continuation`].
    pub fn get_continuation_now(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>> {
        self.continuation_row(token)?
            .map(continuation_from_row)
            .transpose()
    }
}

/// The store's operations; the ports (`store/ports.rs`) call these.
impl SqliteStore {
    pub async fn create_session(&self, record: SessionRecord) -> StoreResult<Version> {
        self.create_linked(record, None)
    }

    /// Creates a session, a child in its tree when `link` says so.
    fn create_linked(
        &self,
        record: SessionRecord,
        link: Option<&TreeLink>,
    ) -> StoreResult<Version> {
        self.writable()?;
        let id = record.state.id.clone();
        let inserted = self.with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO sessions
                 (id, version, phase, paused, pending, record, created_at, updated_at,
                  parent, parent_call, depth, root)
                 VALUES (?1, 1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    record.state.id.0,
                    phase_name(record.state.phase),
                    record.state.paused,
                    pending_count(&record.state),
                    to_json(&record),
                    record.created_at.0,
                    record.updated_at.0,
                    link.map(|l| l.parent.0.clone()),
                    link.map(|l| l.call_id.clone()),
                    link.map_or(0, |l| l.depth),
                    link.map(|l| l.root.0.clone()),
                ],
            )
        })?;
        if inserted == 0 {
            return Err(StoreError::SessionExists(id));
        }
        Ok(Version("1".into()))
    }

    pub async fn load_session(
        &self,
        id: &SessionId,
    ) -> StoreResult<Option<Versioned<SessionRecord>>> {
        let row: Option<(i64, String)> = self.with(|c| {
            c.query_row(
                "SELECT version, record FROM sessions WHERE id = ?1",
                [&id.0],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
        })?;
        row.map(|(version, record)| {
            Ok(Versioned {
                value: from_json(&format!("session {id}"), &record)?,
                version: Version(version.to_string()),
            })
        })
        .transpose()
    }

    pub async fn save_session(
        &self,
        record: &SessionRecord,
        expected: &Version,
    ) -> StoreResult<Version> {
        self.writable()?;
        let id = &record.state.id;
        let expected_n = version_number(expected);
        let changed = self.with(|c| {
            c.execute(
                "UPDATE sessions SET version = version + 1, phase = ?1, paused = ?2,
                 pending = ?3, record = ?4, updated_at = ?5
                 WHERE id = ?6 AND version = ?7",
                params![
                    phase_name(record.state.phase),
                    record.state.paused,
                    pending_count(&record.state),
                    to_json(record),
                    record.updated_at.0,
                    id.0,
                    expected_n
                ],
            )
        })?;
        if changed == 0 {
            return Err(StoreError::Conflict {
                id: id.clone(),
                expected: expected.clone(),
            });
        }
        Ok(Version((expected_n + 1).to_string()))
    }

    pub async fn list_sessions(&self) -> StoreResult<Vec<SessionSummary>> {
        let rows: Vec<(String, String, bool, i64, i64)> = self.with(|c| {
            five_columns(
                c,
                "SELECT id, phase, paused, pending, updated_at FROM sessions ORDER BY created_at, id",
                [],
            )
        })?;
        rows.into_iter()
            .map(|(id, phase, paused, pending, updated_at)| {
                Ok(SessionSummary {
                    phase: from_json(&format!("session {id}"), &format!("\"{phase}\""))?,
                    id: SessionId(id),
                    paused,
                    pending: pending as usize,
                    updated_at: Millis(updated_at),
                })
            })
            .collect()
    }

    pub async fn ensure_continuation(
        &self,
        spec: &ContinuationSpec,
        now: Millis,
    ) -> StoreResult<ContinuationRecord> {
        self.writable()?;
        let spec_json = to_json(spec);
        self.with(|c| {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT OR IGNORE INTO continuations
                 (token, session, turn, call_index, spec, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![
                    spec.token.0,
                    spec.session.0,
                    spec.call_id.turn,
                    spec.call_id.index,
                    spec_json,
                    now.0
                ],
            )?;
            // Adopt: an open continuation follows the call's current wait.
            tx.execute(
                "UPDATE continuations SET spec = ?1 WHERE token = ?2 AND result IS NULL",
                params![spec_json, spec.token.0],
            )?;
            tx.commit()
        })?;
        self.get_continuation_now(&spec.token)?
            .ok_or_else(|| StoreError::UnknownToken(spec.token.clone()))
    }

    pub async fn get_continuation(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>> {
        self.get_continuation_now(token)
    }

    pub async fn session_continuations(
        &self,
        id: &SessionId,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        let rows = self.with(|c| {
            let mut stmt = c.prepare(&format!(
                "SELECT {CONTINUATION_COLUMNS} FROM continuations
                 WHERE session = ?1 ORDER BY turn, call_index"
            ))?;
            let rows = stmt
                .query_map([&id.0], load_continuation)?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })?;
        rows.into_iter().map(continuation_from_row).collect()
    }

    pub async fn complete_continuation(
        &self,
        token: &ContinuationToken,
        result: &ToolResult,
        by: &str,
        now: Millis,
    ) -> StoreResult<WriteOnce> {
        self.writable()?;
        let text = to_json(result);
        // Judged and written in one IMMEDIATE transaction: a decision
        // written by another process between the two would otherwise slip
        // past (a denial racing a result). SQLite serialises writers.
        let verdict = self.in_immediate(token, |tx, rec| {
            let verdict = acceptance::result(&rec.held(), result, by);
            if verdict == Verdict::Write {
                tx.execute(
                    "UPDATE continuations SET result = ?1, completed_by = ?2, completed_at = ?3
                     WHERE token = ?4 AND result IS NULL",
                    params![text, by, now.0, token.0],
                )?;
            }
            Ok(verdict)
        })?;
        WriteOnce::judged(token, verdict)
    }

    pub async fn decide_continuation(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<WriteOnce> {
        self.writable()?;
        let verdict = self.in_immediate(token, |tx, rec| {
            let verdict = acceptance::decision(&rec.held(), decision.approved);
            if verdict == Verdict::Write {
                tx.execute(
                    "UPDATE continuations SET decision = ?1 WHERE token = ?2 AND decision IS NULL",
                    params![to_json(decision), token.0],
                )?;
            }
            Ok(verdict)
        })?;
        WriteOnce::judged(token, verdict)
    }

    /// Reads the continuation and runs `f` on it inside one IMMEDIATE
    /// transaction, committed when `f` succeeds.
    fn in_immediate(
        &self,
        token: &ContinuationToken,
        f: impl Fn(&rusqlite::Transaction<'_>, &ContinuationRecord) -> rusqlite::Result<Verdict>,
    ) -> StoreResult<Verdict> {
        let read = self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let Some(row) = tx
                .query_row(
                    &format!("SELECT {CONTINUATION_COLUMNS} FROM continuations WHERE token = ?1"),
                    [&token.0],
                    load_continuation,
                )
                .optional()?
            else {
                return Ok(None);
            };
            let verdict = match continuation_from_row(row) {
                Ok(rec) => Ok(f(&tx, &rec)?),
                Err(e) => Err(e),
            };
            tx.commit()?;
            Ok(Some(verdict))
        })?;
        read.ok_or_else(|| StoreError::UnknownToken(token.clone()))?
    }

    pub async fn cache_get(&self, key: &CacheKey) -> StoreResult<Option<ToolResult>> {
        let text: Option<String> = self.with(|c| {
            c.query_row(
                "SELECT result FROM tool_cache WHERE tool = ?1 AND arguments_sha256 = ?2",
                params![key.tool, key.arguments_sha256],
                |r| r.get(0),
            )
            .optional()
        })?;
        text.map(|t| from_json(&format!("cache entry {key}"), &t))
            .transpose()
    }

    pub async fn cache_put(
        &self,
        key: &CacheKey,
        result: &ToolResult,
        now: Millis,
    ) -> StoreResult<()> {
        self.writable()?;
        self.with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO tool_cache (tool, arguments_sha256, result, created_at)
                 VALUES (?1, ?2, ?3, ?4)",
                params![key.tool, key.arguments_sha256, to_json(result), now.0],
            )
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
