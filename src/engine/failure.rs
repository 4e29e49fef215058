//! Ending a session from outside a step. Both drivers fail a session that
//! cannot go on through [`fail`], and count a step that failed through
//! [`step_failed`]. Each is a compare-and-swap over the stored state, like
//! every checkpoint: a session another driver moved on meanwhile is read
//! again, and one that became final is left as it is.

use super::{patiently, Clock, EngineError, SessionPort, MAX_CONFLICTS};
use crate::core::SessionId;
use crate::ports::{SessionRecord, StoreError};

/// Steps of one session that may fail in a row (for a reason of its own)
/// before the session is failed: a failure repeats a counted number of
/// times, never for ever, and the count is kept with the session, so a
/// driver's restart does not start it again.
pub const MAX_FAILED_STEPS: u32 = 8;

/// What [`fail`] or [`step_failed`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failing {
    /// The failed step was counted: this many in a row now.
    Counted(u32),
    /// The session is `Failed` now, by this call.
    Failed { reason: String },
    /// Already succeeded or failed, or gone: left as it is.
    Final,
}

/// Ends session `id` as `Failed`, saying why.
pub async fn fail(
    sessions: &dyn SessionPort,
    clock: &dyn Clock,
    id: &SessionId,
    reason: &str,
) -> Result<Failing, EngineError> {
    update(sessions, clock, id, |record| {
        fail_record(record, reason.to_string());
        Failing::Failed {
            reason: reason.to_string(),
        }
    })
    .await
}

/// Counts a step of session `id` that failed with `error`; the
/// [`MAX_FAILED_STEPS`]th in a row fails the session.
pub async fn step_failed(
    sessions: &dyn SessionPort,
    clock: &dyn Clock,
    id: &SessionId,
    error: &str,
) -> Result<Failing, EngineError> {
    update(sessions, clock, id, |record| {
        let n = record.state.failed_steps.saturating_add(1);
        if n < MAX_FAILED_STEPS {
            record.state.failed_steps = n;
            return Failing::Counted(n);
        }
        let reason = format!("{n} steps in a row failed; the last: {error}");
        fail_record(record, reason.clone());
        Failing::Failed { reason }
    })
    .await
}

/// `record` ends `Failed`. The spec's messages and retry count as seen:
/// taking them again would only fail again (a new message or a retry
/// restarts the session, with its count of failed steps at zero).
fn fail_record(record: &mut SessionRecord, reason: String) {
    record.state.messages_taken = record.input.messages.len() as u32;
    record.state.retries_taken = record.input.retry;
    record.state.failed_steps = 0;
    record.state.fail(reason);
}

/// Applies `change` to the stored session and saves it over the version
/// read; reads again after a lost race.
async fn update(
    sessions: &dyn SessionPort,
    clock: &dyn Clock,
    id: &SessionId,
    mut change: impl FnMut(&mut SessionRecord) -> Failing,
) -> Result<Failing, EngineError> {
    for _ in 0..MAX_CONFLICTS {
        let Some(loaded) = patiently(clock, "load", || sessions.load(id)).await? else {
            return Ok(Failing::Final);
        };
        if loaded.value.state.phase.is_final() {
            return Ok(Failing::Final);
        }
        let mut record = loaded.value;
        let outcome = change(&mut record);
        record.updated_at = clock.now();
        match patiently(clock, "save", || sessions.save(&record, &loaded.version)).await {
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::SessionNotFound(_)) => return Ok(Failing::Final),
            saved => {
                saved?;
                return Ok(outcome);
            }
        }
    }
    Err(EngineError::TooManyConflicts(id.clone()))
}

impl EngineError {
    /// An error that says something about this session, not about its
    /// store being away, a lost race or the fence: repeated, it fails the
    /// session ([`step_failed`]).
    pub fn counts_against_the_session(&self) -> bool {
        match self {
            EngineError::TooManyConflicts(_) | EngineError::Fenced { .. } => false,
            EngineError::Store(e) => counts_against_the_session(e),
        }
    }

    /// Retrying soon will not fix it: stored data that cannot be read, or
    /// a session that no longer fits its store (retrying would ask the
    /// model again).
    pub fn is_permanent(&self) -> bool {
        matches!(self, EngineError::Store(e) if is_permanent(e))
    }
}

/// See [`EngineError::counts_against_the_session`].
pub fn counts_against_the_session(e: &StoreError) -> bool {
    // A quota's refusal is a wait for room, not the session's failure.
    !e.is_transient() && !e.is_quota() && !matches!(e, StoreError::Conflict { .. })
}

/// See [`EngineError::is_permanent`].
pub fn is_permanent(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Corrupt { .. } | StoreError::TooLarge { .. } | StoreError::Refused { .. }
    )
}
