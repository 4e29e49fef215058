//! The session's budget checks: what happens when work would start past
//! a limit (`spec.limits.tokens`, `cost`, `toolCalls` with `onExceed`).

use super::Session;
use crate::core::budget::{BudgetStop, OnExceed, Spend};

impl Session {
    /// What the session has spent so far.
    pub(super) fn spend(&self) -> Spend {
        Spend {
            usage: self.state.usage,
            tool_calls: self.state.tool_calls,
        }
    }

    /// Applies the outcome of a budget check; true when the work may start.
    /// A stop fails the session or holds it (`budget_stop`, stored at
    /// once); a check that passes with `starting` work lifts a hold (the
    /// limit was raised).
    pub(super) fn budget_checked(&mut self, stop: Option<BudgetStop>, starting: bool) -> bool {
        let Some(stop) = stop else {
            if starting && self.state.budget_stop.take().is_some() {
                self.push(super::Action::Checkpoint);
            }
            return true;
        };
        match self.config.budget.on_exceed {
            OnExceed::Fail => self.fail(stop.message),
            OnExceed::Pause => {
                if self.state.budget_stop.as_ref() != Some(&stop) {
                    self.state.budget_stop = Some(stop);
                    self.push(super::Action::Checkpoint);
                }
            }
        }
        false
    }
}
