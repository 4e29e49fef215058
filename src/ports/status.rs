//! What a session's status says about it beyond its state: its
//! conditions. A driver's report stage decides them; a store applies them
//! with every status write it makes, so a checkpoint carries them and
//! needs no write of its own.

use crate::core::conditions::{self, Condition};
use crate::core::{Millis, SessionState};

/// The conditions to store for a session, computed purely.
pub trait StatusReport: Send + Sync {
    /// For `state`, given the stored conditions (`previous`), the object's
    /// generation and the wall clock's `now`.
    fn conditions(
        &self,
        state: &SessionState,
        previous: &[Condition],
        generation: Option<i64>,
        now: Millis,
    ) -> Vec<Condition>;
}

/// The state's own conditions and nothing more: for a writer with none of
/// its own (the CLI over `--store kube`). Another writer's conditions
/// (the operator's `Ready`) are kept as they are.
pub struct StateConditions;

impl StatusReport for StateConditions {
    fn conditions(
        &self,
        state: &SessionState,
        previous: &[Condition],
        generation: Option<i64>,
        now: Millis,
    ) -> Vec<Condition> {
        conditions::settle(previous, conditions::of(state), generation, now)
    }
}
