//! The records the ports carry: sessions and continuations as stored, the
//! answers of write-once writes, and the stores' errors. Shared by the
//! engine and every store adapter.

use crate::core::acceptance::{self, Decided, Held, Recorded, Verdict};
use crate::core::session::ContinuationSpec;
use crate::core::Disposition;
use crate::core::{ContinuationToken, Millis, SessionId, SessionState, ToolResult};
use serde::{Deserialize, Serialize};
use std::fmt;

/// An opaque revision of a stored object, compared for equality only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Version(pub String);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stored value with the revision it was read at.
#[derive(Clone, Debug, PartialEq)]
pub struct Versioned<T> {
    pub value: T,
    pub version: Version,
}

/// A session as stored: the core's state plus the definition it was started
/// from (the `Agent`/`Session` manifests), so any later process can rebuild
/// the agent without the original file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionRecord {
    pub state: SessionState,
    /// What the user asked for (the Session's spec): the engine feeds what
    /// the state has not taken yet into the core.
    #[serde(default)]
    pub input: SessionInput,
    /// The session's namespace (empty standalone) and unique id: keys and
    /// adopted children are scoped by them.
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub uid: String,
    /// Opaque to the store: the driver's own description of the agent.
    pub definition: serde_json::Value,
    pub created_at: Millis,
    pub updated_at: Millis,
    /// The `traceparent` of the session's latest step span, while traces
    /// are exported: the next step joins that trace and links to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// The user's side of a session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionInput {
    /// Every user message, oldest first (append-only).
    #[serde(default)]
    pub messages: Vec<String>,
    #[serde(default)]
    pub paused: bool,
    /// Raised by the user to retry a failed session.
    #[serde(default)]
    pub retry: u32,
}

/// An approve/deny decision on a call that waits for approval.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    pub approved: bool,
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub at: Millis,
    /// Edited arguments (a JSON object's text), where the policy allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
    /// The limits raised with an approval of a session's question about
    /// its budget (`waitingFor: budget`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raise: Option<crate::core::budget::Raise>,
}

/// A continuation as stored: what the core asked for, and what the outside
/// world has written into it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContinuationRecord {
    pub spec: ContinuationSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
    pub created_at: Millis,
    /// Answers people gave to the call's MCP task's request for input
    /// (an `inputResponses` object, JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answers: Option<String>,
}

impl ContinuationRecord {
    pub fn token(&self) -> &ContinuationToken {
        &self.spec.token
    }
    pub fn is_completed(&self) -> bool {
        self.result.is_some()
    }

    /// The continuation as the acceptance rules see it.
    pub fn held(&self) -> Held<'_> {
        Held {
            token: &self.spec.token.0,
            waiting_for: self.spec.waiting_for,
            runs_by_itself: match self.spec.policy.disposition {
                Disposition::Defer { .. } => None,
                Disposition::RunSync => Some("runSync"),
                Disposition::RunAsync => Some("runAsync"),
                Disposition::RunIsolated { .. } => Some("runIsolated"),
                Disposition::SubAgent { .. } => Some("subAgent"),
            },
            decision: self.decision.as_ref().map(|d| Decided {
                approved: d.approved,
                by: &d.by,
                reason: d.reason.as_deref(),
                at: d.at,
            }),
            result: self.result.as_ref().map(|result| Recorded {
                result,
                by: self.completed_by.as_deref().unwrap_or_default(),
                at: self.completed_at.unwrap_or_default(),
            }),
        }
    }
}

/// The answer to a write-once write (a result or a decision).
#[derive(Clone, Debug, PartialEq)]
pub enum WriteOnce {
    /// This write set the value.
    Recorded,
    /// The value was already set, to this same value (a harmless repeat).
    AlreadySame { by: String, at: Millis },
    /// The value was already set to something else; this write was refused.
    AlreadyDifferent { by: String, at: Millis },
}

impl WriteOnce {
    /// The store's answer once the rules' verdict on a write is settled:
    /// written, already there (the same or a different value), or refused.
    pub fn judged(token: &ContinuationToken, verdict: Verdict) -> StoreResult<WriteOnce> {
        match verdict {
            Verdict::Write => Ok(WriteOnce::Recorded),
            Verdict::Same { by, at } => Ok(WriteOnce::AlreadySame { by, at }),
            Verdict::Different { by, at } => Ok(WriteOnce::AlreadyDifferent { by, at }),
            Verdict::Refused(why) => Err(StoreError::NotAccepting {
                token: token.clone(),
                why,
            }),
        }
    }
}

/// Where a child session sits in its tree (the embedded store keeps it in
/// columns, so a tree is read without parsing every record).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TreeLink {
    /// The parent session.
    pub parent: SessionId,
    /// The parent's call that made this child (`t1-c0`).
    pub call_id: String,
    /// The child's depth: the root is 0.
    pub depth: u32,
    /// The root of the tree.
    pub root: SessionId,
}

/// A session of a tree, as the store lists it: root first, then by depth.
#[derive(Clone, Debug, PartialEq)]
pub struct TreeMember {
    pub record: SessionRecord,
    /// `None` for the root.
    pub link: Option<TreeLink>,
}

/// One line of `agents session list`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionSummary {
    pub id: SessionId,
    pub phase: crate::core::Phase,
    pub paused: bool,
    pub pending: usize,
    pub updated_at: Millis,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("session {0} not found in the store")]
    SessionNotFound(SessionId),
    #[error("session {0} already exists in the store")]
    SessionExists(SessionId),
    #[error("no continuation with token {0}; `agents session pending` lists the open ones")]
    UnknownToken(ContinuationToken),
    /// Someone else wrote the session since it was read: reload and retry.
    #[error("session {id} was changed by another writer (expected version {expected})")]
    Conflict { id: SessionId, expected: Version },
    #[error("the store {path} is locked by another process (waited {waited_ms} ms); try again when it finishes")]
    Locked { path: String, waited_ms: u64 },
    #[error("{path} is not an agents store: {why}")]
    NotAStore { path: String, why: String },
    #[error("the store {path} has schema version {found}, newer than this build knows ({known}); upgrade agents")]
    TooNew {
        path: String,
        found: i64,
        known: i64,
    },
    #[error(
        "stored data for {what} cannot be read ({why}); the store may have been edited by hand"
    )]
    Corrupt { what: String, why: String },
    /// The session no longer fits its object, even with what can spill
    /// moved out; the write was refused and will be refused again.
    #[error("session {id} no longer fits its store: {why}")]
    TooLarge { id: SessionId, why: String },
    /// The store refuses the session's state as invalid (a CRD older than
    /// this build, a rule it breaks), and will refuse it again.
    #[error("the store refuses the state of session {id}: {why}")]
    Refused { id: SessionId, why: String },
    /// This process may read the store but not write it.
    #[error("the store {path} is read-only for this user (no write access to the file or its directory): reading works, but this command writes; run it as a user who can write the store")]
    ReadOnly { path: String },
    /// `--store sqlite:nope/x/agents.db` where `nope/x` does not exist.
    #[error("the store {path} cannot be opened: the directory {dir} does not exist; create that directory first, or give another path with --store sqlite:PATH")]
    NoDirectory { path: String, dir: String },
    /// The path, or a file SQLite keeps beside it (`-wal`, `-shm`,
    /// `-journal`), is not a regular file: `why` names which and what it is.
    #[error("the store {path} cannot be opened: {why}")]
    Unusable { path: String, why: String },
    /// The continuation takes no result now (see [`ContinuationRecord::not_accepting`]).
    #[error("{token} does not accept a result: {why}")]
    NotAccepting {
        token: ContinuationToken,
        why: String,
    },
    #[error("store error: {0}")]
    Backend(String),
    /// The store did not answer, or answered "try later" (a connection
    /// error, a timeout, 429, 5xx): the same write may succeed soon.
    #[error("the store is unavailable for now: {0}")]
    Unavailable(String),
    /// A namespace's ResourceQuota refused to create `what` for now (a
    /// 403 "exceeded quota"): it goes through once the quota has room, so
    /// a driver waits and tries again; it is not the session's failure.
    #[error("the namespace's ResourceQuota has no room for {what} for now ({message}); it goes through once the quota is raised or room is freed")]
    QuotaExceeded { what: String, message: String },
}

impl StoreError {
    /// An error that retrying the same request soon may cure.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }

    /// A ResourceQuota holds the write: a wait, never counted as a failure.
    pub fn is_quota(&self) -> bool {
        matches!(self, StoreError::QuotaExceeded { .. })
    }
}

/// Who the engine writes as when it records a result itself (a timeout,
/// a runner's final result after retries); no person or worker may use it.
pub use crate::core::acceptance::ENGINE_BY;

/// The error result the model is given for a denied call: exactly what
/// the core records for the denial.
pub fn denial_result(decision: &Decision) -> ToolResult {
    acceptance::denial(&decision.by, decision.reason.as_deref())
}

pub type StoreResult<T> = Result<T, StoreError>;
