//! Events that carry results: a tool that finished here, an attempt
//! finished by a runner, and a wake by a continuation's outcome.

use super::calls::{result_limit, retry_time};
use super::{truncate, Action, CoreError, Session, WakeOutcome};
use crate::core::cache::{cache_key, CacheScope};
use crate::core::call::{CallState, WaitingFor};
use crate::core::conversation::{ToolResult, ToolResultEntry, Turn};
use crate::core::ids::{CallId, ContinuationToken};
use crate::core::time::Millis;

impl Session {
    pub(super) fn on_tool_finished(
        &mut self,
        id: CallId,
        result: ToolResult,
        from_cache: bool,
        now: Millis,
    ) -> Result<(), CoreError> {
        let secrets = self.config.context_has_secrets;
        let scope = self.cache_scope();
        let call = self
            .open_call_mut(|c| c.id == id && c.state() == CallState::Running)
            .ok_or(CoreError::UnknownCall { call: id })?;
        let mut store = None;
        if result.is_error() && !from_cache && call.attempts <= call.policy.decorators.retries {
            call.schedule_retry(retry_time(call.attempts, now));
        } else {
            let result = truncate(result, Some(result_limit(call, scope.1)));
            if call.policy.decorators.cache && !from_cache && !result.is_error() {
                store = cache_key(&call.call, secrets, &scope.0).map(|key| Action::StoreCache {
                    key,
                    result: result.clone(),
                });
            }
            let to = if result.is_error() {
                CallState::Failed
            } else {
                CallState::Completed
            };
            let by = if from_cache { "cache" } else { "agents" };
            call.finish(to, result, by)?;
        }
        if let Some(a) = store {
            self.push(a);
        }
        self.settle(now);
        Ok(())
    }

    /// The cache scope of this session's calls (tool fingerprint is added
    /// per tool) and the result size limit.
    pub(super) fn cache_scope(&self) -> (CacheScope, usize) {
        (
            CacheScope {
                namespace: self.config.scope.namespace.clone(),
                fingerprints: self.config.tool_fingerprints.clone(),
            },
            self.config.max_result_bytes,
        )
    }

    pub(super) fn on_attempt_finished(
        &mut self,
        token: &ContinuationToken,
        attempt: u32,
        result: ToolResult,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let secrets = self.config.context_has_secrets;
        let scope = self.cache_scope();
        let Some(call) = self.open_call_mut(|c| c.token() == Some(token)) else {
            return Ok(WakeOutcome::Unknown);
        };
        if call.state().is_final() || attempt != call.attempts {
            // A stale attempt (a retry superseded it) or a finished call.
            return Ok(WakeOutcome::AlreadyCompleted);
        }
        let running_here = matches!(
            call.waiting_for(),
            Some(WaitingFor::Background | WaitingFor::Isolated | WaitingFor::SubAgent)
        );
        if !running_here {
            return Err(CoreError::NotWaiting {
                token: token.clone(),
                state: call.state(),
                what: "a runner's result",
            });
        }
        if result.is_error() && call.attempts <= call.policy.decorators.retries {
            call.schedule_retry(retry_time(call.attempts, now));
            return Ok(WakeOutcome::Applied);
        }
        let result = truncate(result, Some(result_limit(call, scope.1)));
        let store = (call.policy.decorators.cache && !result.is_error())
            .then(|| cache_key(&call.call, secrets, &scope.0))
            .flatten();
        // A run that failed after its retries fails like a sync call.
        let to = if result.is_error() {
            CallState::Failed
        } else {
            CallState::Completed
        };
        call.finish(to, result.clone(), "agents")?;
        if call.has_continuation() {
            self.push_result(Action::RecordResult {
                token: token.clone(),
                result: result.clone(),
                by: "agents".into(),
            });
        }
        if let Some(key) = store {
            self.push(Action::StoreCache { key, result });
        }
        self.settle(now);
        Ok(WakeOutcome::Applied)
    }

    pub(super) fn on_wake(
        &mut self,
        token: &ContinuationToken,
        result: ToolResult,
        by: &str,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let limit = self.config.max_result_bytes;
        let Some(call) = self.open_call_mut(|c| c.token() == Some(token)) else {
            return self.wake_closed(token, result);
        };
        let result = truncate(result, Some(result_limit(call, limit)));
        match call.state() {
            // A result never pre-empts an approval.
            CallState::Deferred if call.waiting_for() == Some(WaitingFor::Approval) => {
                Err(CoreError::AwaitsApproval {
                    token: token.clone(),
                })
            }
            CallState::Deferred => {
                call.finish(CallState::Completed, result, by)?;
                self.settle(now);
                Ok(WakeOutcome::Applied)
            }
            CallState::Completed | CallState::Failed => {
                if call.result() == Some(&result) {
                    Ok(WakeOutcome::AlreadyCompleted)
                } else {
                    Err(CoreError::ConflictingResult {
                        token: token.clone(),
                    })
                }
            }
            state => Err(CoreError::NotWaiting {
                token: token.clone(),
                state,
                what: "a result",
            }),
        }
    }

    /// The recorded result of a token from an earlier, closed turn.
    pub(super) fn closed_entry(&self, token: &ContinuationToken) -> Option<&ToolResultEntry> {
        self.state.turns.iter().rev().find_map(|t| match t {
            Turn::User(u) => u
                .tool_results
                .iter()
                .find(|r| r.token.as_ref() == Some(token)),
            Turn::Agent(_) => None,
        })
    }

    pub(super) fn wake_closed(
        &self,
        token: &ContinuationToken,
        result: ToolResult,
    ) -> Result<WakeOutcome, CoreError> {
        let limit = self.config.max_result_bytes;
        match self.closed_entry(token) {
            None => Ok(WakeOutcome::Unknown),
            Some(entry)
                if entry.result
                    == truncate(
                        result,
                        Some(entry.truncate_bytes.unwrap_or(usize::MAX).min(limit)),
                    ) =>
            {
                Ok(WakeOutcome::AlreadyCompleted)
            }
            Some(_) => Err(CoreError::ConflictingResult {
                token: token.clone(),
            }),
        }
    }
}
