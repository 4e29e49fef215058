//! A Session with `spec.forkFrom`: before its first step, its history is
//! written once from the source (another Session of the same namespace,
//! only read), through `core::fork`. A source or turn that is not there
//! is the fork's `Ready=False` (ForkSourceNotFound, ForkTurnNotFound),
//! rechecked, never a crash.

use super::resolve::NotReady;
use super::{Error, INVALID_RECHECK};
use crate::api::session::ForkFrom;
use crate::core::fork::{fork_state, ForkError};
use crate::core::{Phase, SessionId, SessionState};
use crate::ports::SessionPort;
use crate::store::kube::KubeStore;
use std::time::Duration;

/// A fork whose source is missing is looked at again this often (the
/// source may yet be created, as a missing Agent may).
const SOURCE_RECHECK: Duration = Duration::from_secs(30);

/// Writes the fork's history if it has none yet; `Some` when it cannot
/// be written now, and why.
pub(super) async fn seed(
    store: &KubeStore,
    id: &SessionId,
    from: &ForkFrom,
) -> Result<Option<NotReady>, Error> {
    let Some(loaded) = store.load(id).await? else {
        return Ok(None);
    };
    if !unseeded(&loaded.value.state) {
        return Ok(None);
    }
    let source_id = SessionId(from.session.clone());
    let Some(source) = store.load(&source_id).await? else {
        return Ok(Some(source_not_found(store.namespace(), from)));
    };
    let state = match fork_state(
        &source.value.state,
        &source.value.uid,
        from.turn,
        id.clone(),
    ) {
        Ok(state) => state,
        Err(e @ ForkError::NoSuchTurn { .. }) => return Ok(Some(turn_not_found(e))),
    };
    let mut record = loaded.value;
    record.state = state;
    store.save(&record, &loaded.version).await?;
    Ok(None)
}

/// A fork whose history is still to be written: nothing recorded yet.
fn unseeded(state: &SessionState) -> bool {
    state.forked_from.is_none()
        && state.turns.is_empty()
        && state.open.is_none()
        && state.phase == Phase::Idle
}

fn source_not_found(ns: &str, from: &ForkFrom) -> NotReady {
    NotReady {
        reason: "ForkSourceNotFound",
        message: format!(
            "spec.forkFrom names session {} which is not in namespace {ns} (a fork reads only a \
             session of its own namespace); the fork waits until it exists, or delete this \
             session and fork one that does",
            from.session
        ),
        recheck: SOURCE_RECHECK,
    }
}

fn turn_not_found(e: ForkError) -> NotReady {
    NotReady {
        reason: "ForkTurnNotFound",
        message: format!("spec.forkFrom.turn: {e}; delete this session and fork again"),
        recheck: INVALID_RECHECK,
    }
}
