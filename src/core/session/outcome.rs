//! Tools whose outcome can be unknown. A claimed attempt whose holder is
//! gone (dead, or its claim lapsed) left no result: the tool may or may
//! not have acted. A tool that honours the idempotency key is simply sent
//! again under the same key (exactly once). A tool that does not
//! (`idempotent: false`) is never run again on its own: per its
//! `onUnknownOutcome`, a person is asked (`ask`), the model is told
//! (`fail`), or it is sent again all the same (`retry`). So such a tool
//! runs at most once unless someone says otherwise.

use super::calls::ensure_action;
use super::{Action, CoreError, Session, ToolInfo, WakeOutcome};
use crate::core::acceptance::ENGINE_BY;
use crate::core::call::{CallState, Claim, TrackedToolCall};
use crate::core::conversation::ToolResult;
use crate::core::ids::ContinuationToken;
use crate::core::session::{DriverRole, CLAIM_GRACE_MILLIS};
use crate::core::time::Millis;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What happens to a call of a tool that is not idempotent when its
/// attempt's outcome is unknown.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum OnUnknownOutcome {
    /// A person says what came of it (`waitingFor: outcome`): they give
    /// the real result, or answer "run it again".
    #[default]
    Ask,
    /// The model gets an error result saying the outcome is unknown.
    Fail,
    /// Sent again under the same idempotency key (what an idempotent
    /// tool always gets).
    Retry,
}

impl OnUnknownOutcome {
    pub fn name(self) -> &'static str {
        match self {
            OnUnknownOutcome::Ask => "ask",
            OnUnknownOutcome::Fail => "fail",
            OnUnknownOutcome::Retry => "retry",
        }
    }
}

/// The rule for `call`'s tool: `Retry` for an idempotent tool, and for a
/// tool the config does not know (the driver resolves it itself).
pub fn rule_for(tools: &BTreeMap<String, ToolInfo>, call: &TrackedToolCall) -> OnUnknownOutcome {
    tools
        .get(&call.call.name)
        .and_then(|t| t.unknown_outcome)
        .unwrap_or(OnUnknownOutcome::Retry)
}

/// The claim of `call`'s attempt when its outcome is unknown to `role`
/// at `now`: claimed by another holder that is dead or whose claim
/// lapsed, with no result. `None` for work `role` may simply take on.
pub fn lost_claim<'a>(
    call: &'a TrackedToolCall,
    role: &DriverRole,
    now: Millis,
) -> Option<&'a Claim> {
    let claim = call.claim()?;
    (claim.holder != role.holder && !claim.blocks(&role.holder, &role.dead_holders, now))
        .then_some(claim)
}

/// When the attempt of `claim` started: a claim runs for the tool's
/// timeout plus a grace (claims written before claims kept milliseconds
/// were rounded up to a second, so for those it is within a second).
pub fn started_at_about(claim: &Claim, timeout_secs: u64) -> Millis {
    let span = (timeout_secs as i64).saturating_mul(1000) + CLAIM_GRACE_MILLIS;
    Millis(claim.until.0.saturating_sub(span))
}

/// What a person or the model is told about the lost attempt.
pub fn describe(call: &TrackedToolCall, claim: &Claim, timeout_secs: u64) -> String {
    format!(
        "the outcome of {} ({}) is unknown: its attempt was started at about {} by {}, which is gone without reporting a result; the tool is not idempotent, so it was not run again",
        call.call.name,
        call.id,
        started_at_about(claim, timeout_secs).utc(),
        claim.holder,
    )
}

/// The error result of `onUnknownOutcome: fail`.
pub fn unknown_outcome_error(
    call: &TrackedToolCall,
    claim: &Claim,
    timeout_secs: u64,
) -> ToolResult {
    ToolResult::error(format!(
        "{}; check whether it took effect before calling it again",
        describe(call, claim, timeout_secs)
    ))
}

impl Session {
    fn tool_timeout(&self, call: &TrackedToolCall) -> u64 {
        call.policy
            .decorators
            .timeout_seconds
            .unwrap_or(self.config.default_tool_timeout_secs)
    }

    /// Applies the rule to every open call this driver runs whose
    /// attempt's outcome is unknown: such calls are failed or wait for a
    /// person, before anything starts them again. True when any changed.
    pub(super) fn settle_unknown_outcomes(&mut self, now: Millis) -> bool {
        let role = &self.config.driver;
        let lost: Vec<(usize, OnUnknownOutcome, Claim)> = self
            .state
            .open
            .iter()
            .flat_map(|o| o.calls.iter().enumerate())
            .filter(|(_, c)| role.runs(c))
            .filter_map(|(i, c)| {
                let rule = rule_for(&self.config.tools, c);
                let claim = lost_claim(c, role, now)?;
                (rule != OnUnknownOutcome::Retry).then(|| (i, rule, claim.clone()))
            })
            .collect();
        if lost.is_empty() {
            return false;
        }
        for (i, rule, claim) in lost {
            self.lose(i, rule, claim);
        }
        self.push(Action::Checkpoint);
        self.settle(now);
        true
    }

    /// Fails the open call at `index`, or makes it wait for a person.
    fn lose(&mut self, index: usize, rule: OnUnknownOutcome, claim: Claim) {
        let id = self.state.id.clone();
        let open = self.state.open.as_mut().expect("lost calls are open");
        let call = &mut open.calls[index];
        let timeout = call
            .policy
            .decorators
            .timeout_seconds
            .unwrap_or(self.config.default_tool_timeout_secs);
        match rule {
            OnUnknownOutcome::Fail => {
                let result = unknown_outcome_error(call, &claim, timeout);
                call.finish(CallState::Failed, result.clone(), ENGINE_BY)
                    .expect("an attempt under way may fail");
                if let (Some(token), true) = (call.token().cloned(), call.has_continuation()) {
                    self.push_result(Action::RecordResult {
                        token,
                        result,
                        by: ENGINE_BY.into(),
                    });
                }
            }
            OnUnknownOutcome::Ask => {
                let token = ContinuationToken::for_call(&id, call.id);
                call.lose_outcome(token, claim)
                    .expect("an attempt under way may lose its outcome");
                let call = call.clone();
                if let Some(ensure) = ensure_action(&id, &self.config, &call) {
                    self.push(ensure);
                }
            }
            OnUnknownOutcome::Retry => {}
        }
    }

    /// A person answered "run it again" to a call whose outcome was
    /// unknown; an answer given before this attempt started (to an
    /// earlier loss of the same call) is not taken again.
    pub(super) fn on_run_again(
        &mut self,
        token: &ContinuationToken,
        decided_at: Millis,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let Some(call) = self
            .state
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .find(|c| c.token() == Some(token))
        else {
            return Ok(WakeOutcome::Unknown);
        };
        let Some(lost) = call.lost_attempt() else {
            if call.state().is_final() {
                return Ok(WakeOutcome::AlreadyCompleted);
            }
            return Err(CoreError::NotWaiting {
                token: token.clone(),
                state: call.state(),
                what: "an answer about an unknown outcome",
            });
        };
        if decided_at < started_at_about(lost, self.tool_timeout(call)) {
            return Ok(WakeOutcome::AlreadyCompleted);
        }
        let call = self
            .open_call_mut(|c| c.token() == Some(token))
            .expect("found above");
        call.run_again()?;
        self.dispatch(now);
        self.settle(now);
        Ok(WakeOutcome::Applied)
    }
}

/// The reason a continuation that waits for an outcome shows.
pub fn reason(call: &TrackedToolCall, default_timeout_secs: u64) -> Option<String> {
    let claim = call.lost_attempt()?;
    let timeout = call
        .policy
        .decorators
        .timeout_seconds
        .unwrap_or(default_timeout_secs);
    Some(format!(
        "{}; complete it with the real result (`agents session complete TOKEN`), or answer `agents session run-again TOKEN` to send it again",
        describe(call, claim, timeout)
    ))
}

/// The rule of a tool: `None` when it is idempotent, else what happens
/// to a lost attempt. `idempotent` is the Agent's own setting, which
/// overrides `hinted` (an MCP server's annotations); unset both, a tool
/// is idempotent (it gets the key and is sent again under it).
pub fn tool_rule(
    idempotent: Option<bool>,
    hinted: Option<bool>,
    on_unknown: Option<OnUnknownOutcome>,
) -> Option<OnUnknownOutcome> {
    match idempotent.or(hinted) {
        Some(false) => Some(on_unknown.unwrap_or_default()),
        _ => None,
    }
}
