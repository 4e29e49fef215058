//! Events from people and clocks: an approval decision, pause and
//! resume, and the tick that times out calls and approvals.

use super::calls::time_out;
use super::{task, Action, CoreError, Session, WakeOutcome};
use crate::core::acceptance::ENGINE_BY;
use crate::core::call::{CallState, WaitingFor};
use crate::core::conversation::ToolResult;
use crate::core::ids::ContinuationToken;
use crate::core::policy::OnTimeout;
use crate::core::time::Millis;

impl Session {
    pub(super) fn on_decide(
        &mut self,
        token: &ContinuationToken,
        (approved, by, reason, arguments): (bool, String, Option<String>, Option<String>),
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let Some(call) = self.open_call_mut(|c| c.token() == Some(token)) else {
            return Ok(match self.closed_entry(token) {
                Some(_) => WakeOutcome::AlreadyCompleted,
                None => WakeOutcome::Unknown,
            });
        };
        if let Some(previous) = call.approval() {
            return if previous.approved == approved {
                Ok(WakeOutcome::AlreadyCompleted)
            } else {
                Err(CoreError::ConflictingDecision {
                    token: token.clone(),
                    decision: if previous.approved {
                        "approved"
                    } else {
                        "denied"
                    },
                })
            };
        }
        if call.waiting_for() != Some(WaitingFor::Approval) {
            if call.state().is_final() {
                return Ok(WakeOutcome::AlreadyCompleted);
            }
            return Err(CoreError::NotWaiting {
                token: token.clone(),
                state: call.state(),
                what: "an approval",
            });
        }
        // A bad edit (a raw write past the CLI's checks) fails the call,
        // saying why, rather than leaving it waiting on a decision that
        // stays for ever.
        let bad_edit = arguments
            .as_deref()
            .filter(|_| approved)
            .and_then(|args| crate::core::acceptance::edit_refusal(&call.policy, args));
        if let Some(why) = bad_edit {
            let result = ToolResult::error(format!(
                "{by} approved with edited arguments, which were refused: {why}"
            ));
            call.finish(CallState::Completed, result.clone(), &by)?;
            self.push_result(Action::RecordResult {
                token: token.clone(),
                result,
                by,
            });
            self.settle(now);
            return Ok(WakeOutcome::Applied);
        }
        if approved {
            call.approve(by, reason, arguments)?;
            self.dispatch(now);
        } else {
            let result = crate::core::acceptance::denial(&by, reason.as_deref());
            call.deny(by.clone(), reason, result.clone())?;
            self.push_result(Action::RecordResult {
                token: token.clone(),
                result,
                by,
            });
        }
        self.settle(now);
        Ok(WakeOutcome::Applied)
    }

    /// Holds the session: queued starts are dropped (their claims released),
    /// checkpoints and result writes stay.
    pub(super) fn on_pause(&mut self) {
        self.state.paused = true;
        self.actions.retain(|a| !a.starts_work());
        let me = &self.config.driver.holder;
        self.state.model_attempt.release(me);
        for call in self.state.open.iter_mut().flat_map(|o| o.calls.iter_mut()) {
            if let Some(attempt) = call.attempt_mut() {
                attempt.release(me);
            }
        }
    }

    pub(super) fn on_resume(&mut self, now: Millis) {
        if self.state.paused {
            self.state.paused = false;
            self.replan(now);
        }
    }

    pub(super) fn on_tick(&mut self, now: Millis) {
        if self.state.phase.is_final() {
            return;
        }
        if let Some(deadline) = self.config.limits.deadline {
            if now >= deadline {
                self.fail("the session passed its deadline".to_string());
                return;
            }
        }
        if let Some(failure) = self.approvals_timed_out(now) {
            self.fail(failure);
            return;
        }
        let cancels: Vec<Action> = self
            .state
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| c.task_is_due_to_time_out(now))
            .filter_map(|c| task::cancel_action(self, c))
            .collect();
        let actions: Vec<Action> = self
            .state
            .open
            .iter_mut()
            .flat_map(|o| o.calls.iter_mut())
            .filter_map(|call| time_out(call, now))
            .collect();
        for a in actions {
            self.push_result(a);
        }
        for a in cancels {
            self.push(a);
        }
        self.start_due(now, false);
        self.settle(now);
    }

    /// Applies `onTimeout` to approvals whose time ran out: `approve` lets
    /// the call run, `deny` denies it (the model is told); `fail` ends the
    /// session, returned as its reason.
    pub(super) fn approvals_timed_out(&mut self, now: Millis) -> Option<String> {
        let mut denials = Vec::new();
        let mut approved = false;
        let open = self.state.open.as_mut()?;
        for call in open.calls.iter_mut() {
            let waiting = call.waiting_for() == Some(WaitingFor::Approval)
                && call.deadline().is_some_and(|d| now >= d);
            let Some(policy) = call.policy.decorators.approval_policy.clone() else {
                continue;
            };
            if !waiting {
                continue;
            }
            let secs = policy.timeout_seconds.unwrap_or(0);
            let why = format!(
                "no decision within {secs}s (onTimeout: {})",
                policy.on_timeout.name()
            );
            match policy.on_timeout {
                OnTimeout::Fail => {
                    return Some(format!(
                        "call {} of tool {}: {why}",
                        call.id, call.call.name
                    ))
                }
                OnTimeout::Approve => {
                    approved |= call.approve(ENGINE_BY.into(), Some(why), None).is_ok();
                }
                OnTimeout::Deny => {
                    let result = crate::core::acceptance::denial(ENGINE_BY, Some(&why));
                    if call
                        .finish(CallState::Completed, result.clone(), ENGINE_BY)
                        .is_ok()
                    {
                        denials.extend(call.token().cloned().map(|token| Action::RecordResult {
                            token,
                            result,
                            by: ENGINE_BY.into(),
                        }));
                    }
                }
            }
        }
        for a in denials {
            self.push_result(a);
        }
        if approved {
            self.dispatch(now);
        }
        None
    }
}
