//! A reconcile that failed: its metrics, its log line, the backoff, and
//! the session's own count of failed steps. A failure that says something
//! about the session is counted in its status through the engine
//! ([`engine::step_failed`]): the eighth in a row, across operator
//! restarts too, fails the session. A failure that retrying will not fix
//! fails it at once ([`engine::fail`]). Both are compare-and-swap writes,
//! like every other status write: a session another operator moved on
//! meanwhile is read again, never overwritten.

use super::{publish, Context, INVALID_RECHECK};
use crate::api::Session;
use crate::core::SessionId;
use crate::engine::{self, EngineError, Failing, SystemClock};
use crate::store::kube::KubeStore;
use crate::store::StoreError;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// Sessions whose backoff is tracked at once.
const MAX_TRACKED_FAILURES: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the API server: {0}")]
    Kube(#[from] kube::Error),
    #[error("session {0} has no namespace")]
    NoNamespace(String),
}

impl Error {
    /// An error that says something about this session, not about the API
    /// server being away, a lost race or the fence: repeated, it fails the
    /// session.
    fn counts_against_the_session(&self) -> bool {
        match self {
            Error::Engine(e) => e.counts_against_the_session(),
            Error::Store(e) => engine::failure::counts_against_the_session(e),
            Error::Kube(_) | Error::NoNamespace(_) => !self.is_transient(),
        }
    }

    /// The API server (or its etcd) is away or throttling for now.
    fn is_transient(&self) -> bool {
        match self {
            Error::Store(e) | Error::Engine(EngineError::Store(e)) => e.is_transient(),
            Error::Kube(kube::Error::Api(s)) => s.code == 429 || s.code >= 500,
            Error::Kube(_) => true,
            _ => false,
        }
    }

    /// Errors that retrying soon will not fix (stored data that cannot be
    /// read, a session that no longer fits its object: retrying would ask
    /// the model again); everything else (API errors, conflicts) is retried
    /// with backoff.
    fn is_permanent(&self) -> bool {
        match self {
            Error::Engine(e) => e.is_permanent(),
            Error::Store(e) => engine::failure::is_permanent(e),
            Error::NoNamespace(_) => true,
            Error::Kube(_) => false,
        }
    }

    /// Why a ResourceQuota held the step's write, if one did: a wait.
    fn quota(&self) -> Option<&StoreError> {
        match self {
            Error::Store(e) | Error::Engine(EngineError::Store(e)) if e.is_quota() => Some(e),
            _ => None,
        }
    }

    fn is_conflict(&self) -> bool {
        matches!(
            self,
            Error::Engine(EngineError::Store(StoreError::Conflict { .. }))
                | Error::Store(StoreError::Conflict { .. })
        )
    }

    /// The `reason` label of the reconcile error metric.
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Engine(EngineError::TooManyConflicts(_)) => "conflicts",
            Error::Engine(EngineError::Fenced { .. }) => "fenced",
            _ if self.quota().is_some() => "quota",
            Error::Engine(EngineError::Store(_)) | Error::Store(_) => "store",
            Error::Kube(_) => "api",
            Error::NoNamespace(_) => "spec",
        }
    }
}

/// "namespace/name": how a session is named in logs and tracked here.
pub(super) fn key(session: &Session) -> String {
    format!(
        "{}/{}",
        session.namespace().unwrap_or_default(),
        session.name_any()
    )
}

/// Failed reconciles in a row per session, in this process: how long the
/// next backoff is, and until when a session whose failure was counted in
/// its status is left alone.
#[derive(Default)]
pub(super) struct Backoffs {
    sessions: Mutex<HashMap<String, Backoff>>,
}

#[derive(Clone, Copy, Default)]
struct Backoff {
    failures: u32,
    not_before: Option<Instant>,
}

impl Backoffs {
    /// One more failure of `key`: how many in a row now.
    fn failed(&self, key: &str) -> u32 {
        let mut sessions = self.sessions.lock().expect("backoffs");
        // Entries of sessions deleted while failing are never removed by a
        // success: bound the map (a lost entry only restarts a backoff).
        if sessions.len() >= MAX_TRACKED_FAILURES && !sessions.contains_key(key) {
            sessions.clear();
        }
        let entry = sessions.entry(key.to_string()).or_default();
        entry.failures += 1;
        entry.failures
    }

    fn hold(&self, key: &str, backoff: Duration) {
        if let Some(entry) = self.sessions.lock().expect("backoffs").get_mut(key) {
            entry.not_before = Some(Instant::now() + backoff);
        }
    }

    pub(super) fn succeeded(&self, key: &str) {
        self.sessions.lock().expect("backoffs").remove(key);
    }

    fn remaining(&self, key: &str) -> Option<Duration> {
        let sessions = self.sessions.lock().expect("backoffs");
        let not_before = sessions.get(key)?.not_before?;
        let left = not_before.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }
}

/// How long a session whose last failure was counted in its status waits
/// still: that write wakes it at once through the watch, and the backoff
/// must hold all the same. A final session is not held (its conditions
/// follow at once).
pub(super) fn backing_off(ctx: &Context, session: &Session) -> Option<Duration> {
    if super::is_final(session) {
        return None;
    }
    ctx.failures.remaining(&key(session))
}

pub(super) fn error_policy(session: Arc<Session>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconciled(false);
    ctx.metrics.reconcile_error(error.metric_label());
    let key = key(&session);
    if error.is_permanent() {
        warn!(session = %key, error = %error, "reconcile failed; the session fails");
        tokio::spawn(fail_session(
            ctx.clone(),
            session.clone(),
            error.to_string(),
        ));
        let note = error.to_string().chars().take(900).collect();
        publish(
            &ctx,
            &session.object_ref(&()),
            warning("ReconcileFailed", note),
        );
        return Action::requeue(INVALID_RECHECK);
    }
    let n = ctx.failures.failed(&key);
    let backoff = backoff(error, n);
    if let Some(held) = error.quota() {
        return held_by_quota(&ctx, &session, held, backoff);
    }
    if error.counts_against_the_session() {
        ctx.failures.hold(&key, backoff);
        tokio::spawn(count_failed_step(
            ctx.clone(),
            session.clone(),
            error.to_string(),
        ));
    }
    if error.is_conflict() {
        debug!(session = %key, attempt = n, ?backoff, "conflict; retrying");
    } else {
        warn!(session = %key, error = %error, attempt = n, ?backoff, "reconcile failed; retrying");
    }
    Action::requeue(backoff)
}

/// 250 ms doubling with each failure in a row, up to a minute; while the
/// API server is away, up to 5 s: the session resumes within seconds of
/// its return, not a minute later.
fn backoff(error: &Error, failures: u32) -> Duration {
    let cap = if error.is_transient() {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(60)
    };
    Duration::from_millis(250u64.saturating_mul(1 << failures.min(8))).min(cap)
}

/// A write of the step that a namespace's ResourceQuota refused (a
/// Continuation, a blob ConfigMap): the session waits for room, said in a
/// Warning Event (repeats fold into its series), and is looked at again
/// with a backoff no longer than a Job's quota wait. Nothing is counted:
/// what the step had not stored is taken up again by the next one.
fn held_by_quota(ctx: &Context, session: &Session, held: &StoreError, backoff: Duration) -> Action {
    let retry = backoff.min(crate::runner::job::QUOTA_RETRY);
    warn!(session = %key(session), error = %held, ?retry, "a ResourceQuota holds the step's write; the session waits");
    let note = format!(
        "the session waits for room in the namespace's ResourceQuota, tried again within {} s: {held}",
        crate::runner::job::QUOTA_RETRY.as_secs()
    );
    let event = Event {
        type_: EventType::Warning,
        reason: "QuotaExceeded".into(),
        note: Some(note.chars().take(900).collect()),
        action: "Reconcile".into(),
        secondary: None,
    };
    publish(ctx, &session.object_ref(&()), event);
    Action::requeue(retry)
}

/// Counts a failed step in the session's status; the eighth in a row
/// fails it.
async fn count_failed_step(ctx: Arc<Context>, session: Arc<Session>, error: String) {
    let Some(store) = store_of(&ctx, &session) else {
        return;
    };
    let id = SessionId(session.name_any());
    match engine::step_failed(&store, &SystemClock, &id, &error).await {
        Ok(Failing::Failed { reason }) => {
            warn!(session = %key(&session), error = %error, "reconcile failed too often; the session fails");
            announce_failure(&ctx, &session, &reason);
        }
        Ok(_) => {}
        Err(e) => {
            warn!(session = %key(&session), error = %e, "could not count the failed step");
        }
    }
}

/// Ends a session that cannot go on as `Failed`, saying why (a session
/// already final is left as it is).
async fn fail_session(ctx: Arc<Context>, session: Arc<Session>, reason: String) {
    let Some(store) = store_of(&ctx, &session) else {
        return;
    };
    let id = SessionId(session.name_any());
    match engine::fail(&store, &SystemClock, &id, &reason).await {
        Ok(Failing::Failed { reason }) => announce_failure(&ctx, &session, &reason),
        Ok(_) => {}
        // The engine cannot read the state to fail it: the status for
        // people says Failed, over the version read (never blind).
        Err(EngineError::Store(StoreError::Corrupt { .. })) => {
            match mark_unreadable_failed(&ctx, &session, &reason).await {
                Ok(()) => announce_failure(&ctx, &session, &reason),
                Err(e) => {
                    warn!(session = %key(&session), error = %e, "could not mark the session Failed")
                }
            }
        }
        // Unwritable: the ReconcileFailed Event says why, and the session is
        // looked at again.
        Err(e) => {
            warn!(session = %key(&session), error = %e, "could not mark the session Failed");
        }
    }
}

/// A session whose stored state cannot be read is Failed in its status
/// for people (phase and failure), written over the resourceVersion just
/// read and read again after a conflict: a session another operator
/// mended or moved on meanwhile is not overwritten. The unreadable state
/// stays as it was, for a person to look at.
async fn mark_unreadable_failed(
    ctx: &Context,
    session: &Session,
    reason: &str,
) -> Result<(), kube::Error> {
    use kube::api::{Api, Patch};
    let Some(ns) = session.namespace() else {
        return Ok(());
    };
    let api: Api<Session> = Api::namespaced(ctx.client.clone(), &ns);
    let name = session.name_any();
    for _ in 0..5 {
        let Some(now) = api.get_opt(&name).await? else {
            return Ok(());
        };
        if super::run::is_final(&now) || now.uid() != session.uid() {
            return Ok(());
        }
        let body = serde_json::json!({
            "metadata": {"resourceVersion": now.resource_version()},
            "status": {"phase": "Failed", "failure": reason},
        });
        match api
            .patch_status(
                &name,
                &crate::store::kube::status_patch_params(),
                &Patch::Merge(&body),
            )
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            other => return other.map(|_| ()),
        }
    }
    Ok(())
}

fn store_of(ctx: &Context, session: &Session) -> Option<KubeStore> {
    Some(ctx.store(&session.namespace()?))
}

fn announce_failure(ctx: &Context, session: &Session, reason: &str) {
    let note = reason.chars().take(900).collect();
    publish(
        ctx,
        &session.object_ref(&()),
        warning("SessionFailed", note),
    );
}

fn warning(reason: &str, note: String) -> Event {
    Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_that_counts_backs_off_and_a_conflict_does_not_count() {
        let api = Error::Store(StoreError::Backend("403 Forbidden".into()));
        let conflict = Error::Engine(EngineError::TooManyConflicts(SessionId("s".into())));
        let away = Error::Store(StoreError::Unavailable("gone".into()));
        assert!(api.counts_against_the_session());
        assert!(!conflict.counts_against_the_session());
        assert!(!away.counts_against_the_session());
        assert_eq!(backoff(&api, 1), Duration::from_millis(500));
        assert_eq!(backoff(&api, 20), Duration::from_secs(60));
        assert_eq!(backoff(&away, 20), Duration::from_secs(5));
        let held = Backoffs::default();
        assert_eq!(held.failed("ns/s"), 1);
        assert_eq!(held.remaining("ns/s"), None, "not held until counted");
        held.hold("ns/s", Duration::from_secs(30));
        assert!(held
            .remaining("ns/s")
            .is_some_and(|d| d > Duration::from_secs(29)));
        held.succeeded("ns/s");
        assert_eq!(held.remaining("ns/s"), None);
    }

    #[test]
    fn a_quotas_refusal_is_a_wait_not_a_counted_failure() {
        let quota = Error::Engine(EngineError::Store(StoreError::QuotaExceeded {
            what: "the Continuation c".into(),
            message: "exceeded quota: q".into(),
        }));
        assert!(!quota.counts_against_the_session());
        assert!(!quota.is_permanent());
        assert!(quota.quota().is_some());
        assert_eq!(quota.metric_label(), "quota");
        let forbidden = Error::Store(StoreError::Backend("403 Forbidden".into()));
        assert!(forbidden.quota().is_none());
    }
}

/// Every status write in `src/` carries a precondition: a `resourceVersion`
/// in its body (compare-and-swap) or server-side apply under a field manager
/// of its own. A status written blind can undo what another writer (another
/// operator, a person) just did.
#[cfg(test)]
mod status_writes {
    use std::path::{Path, PathBuf};

    /// Status writes without a precondition, each with why it may stand.
    /// A new one makes the test fail; one given a precondition must leave
    /// this list.
    const KNOWN: &[(&str, &str)] = &[
        (
            "store/kube/continuations.rs::set_wait",
            "a Continuation's wait fields; a result written meanwhile makes the API server refuse it (CEL), and it reads back",
        ),
        (
            "store/kube/continuations.rs::answer_continuation",
            "a person's answers to an MCP task's questions, replaced whole",
        ),
    ];

    #[test]
    fn no_status_write_lacks_a_precondition() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut blind = Vec::new();
        for file in rust_files(&src) {
            let text = std::fs::read_to_string(&file).unwrap();
            let name = file.strip_prefix(&src).unwrap().display().to_string();
            blind.extend(
                blind_writes(&text)
                    .into_iter()
                    .map(|f| format!("{name}::{f}")),
            );
        }
        let known: Vec<&str> = KNOWN.iter().map(|(at, _)| *at).collect();
        assert_eq!(
            blind, known,
            "status writes without a precondition (put a resourceVersion in the body, or use server-side apply with a field manager)"
        );
    }

    #[test]
    fn the_scan_finds_a_blind_status_write() {
        let code = [
            "async fn careful(api: &Api<Session>) {",
            r#"    let body = json!({"metadata": {"resourceVersion": v}, "status": s});"#,
            &format!(
                "    api.{}(name, &pp, &Patch::Merge(&body)).await;",
                write()
            ),
            "}",
            "async fn blind(api: &Api<Session>) {",
            r#"    let body = json!({"status": {"phase": "Failed"}});"#,
            &format!(
                "    api.{}(name, &pp, &Patch::Merge(&body)).await;",
                write()
            ),
            "}",
            "fn applied(api: &Api<Session>) {",
            &format!("    api.{}(", write()),
            "        name, &PatchParams::apply(MANAGER), &Patch::Apply(&body));",
            "}",
            "async fn read_then_put(api: &Api<Budget>) {",
            "    let mut fresh = api.get_opt(name).await?.unwrap();",
            &format!("    api.replace{}(name, &pp, &fresh).await;", "_status"),
            "}",
            "async fn put_unread(api: &Api<Budget>, made: Budget) {",
            &format!("    api.replace{}(name, &pp, &made).await;", "_status"),
            "}",
            "async fn read_then_put_blind(api: &Api<Budget>) {",
            "    let mut fresh = api.get_opt(name).await?.unwrap();",
            "    fresh.metadata.resource_version = None;",
            &format!("    api.replace{}(name, &pp, &fresh).await;", "_status"),
            "}",
        ]
        .join("\n");
        assert_eq!(
            blind_writes(&code),
            ["blind", "put_unread", "read_then_put_blind"]
        );
    }

    /// The method that writes a status (spelt apart so this file is no hit).
    fn write() -> String {
        ["patch", "_status"].concat()
    }

    /// The calls that write a status, spelt apart as [`write`] is.
    fn writes() -> [String; 2] {
        [format!(".{}(", write()), format!(".replace{}(", "_status")]
    }

    /// The functions of `text` that write a status without a precondition.
    fn blind_writes(text: &str) -> Vec<String> {
        let lines: Vec<&str> = text.lines().collect();
        let writes = writes();
        let mut blind = Vec::new();
        for (at, line) in lines.iter().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") || !writes.iter().any(|w| line.contains(w.as_str())) {
                continue;
            }
            let Some((start, name)) = enclosing_fn(&lines, at) else {
                continue;
            };
            let body = lines[start..=at].join("\n");
            let call = lines[at..(at + 4).min(lines.len())].join("\n");
            let guarded = body.contains("\"resourceVersion\"")
                || call.contains("PatchParams::apply(")
                || replaces_what_it_read(&body, &call);
            if !guarded {
                blind.push(name);
            }
        }
        blind
    }

    /// A whole object put back as the function read it (`get`, then
    /// `replace_status`): its `metadata.resourceVersion` is the read's, and
    /// the API server refuses the write (409) if the object changed since.
    fn replaces_what_it_read(body: &str, call: &str) -> bool {
        call.contains(&format!(".replace{}(", "_status"))
            && (body.contains(".get_opt(") || body.contains(".get("))
            && !body.contains("resource_version = None")
    }

    /// The line and name of the function around line `at`.
    fn enclosing_fn(lines: &[&str], at: usize) -> Option<(usize, String)> {
        (0..=at).rev().find_map(|i| {
            let words: Vec<&str> = lines[i].split_whitespace().collect();
            let fn_at = words.iter().position(|w| *w == "fn")?;
            let keywords_before = words[..fn_at]
                .iter()
                .all(|w| matches!(*w, "pub" | "pub(crate)" | "pub(super)" | "async"));
            let name = words.get(fn_at + 1)?.split(['(', '<']).next()?;
            keywords_before.then(|| (i, name.to_string()))
        })
    }

    fn rust_files(dir: &Path) -> Vec<PathBuf> {
        let mut files = Vec::new();
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.path());
        for entry in entries {
            let path = entry.path();
            if path.is_dir() {
                files.extend(rust_files(&path));
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
        files
    }
}
