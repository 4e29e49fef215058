//! The tracked tool call and its state machine.
//!
//! ```text
//! Ready    -> Running | Deferred | Completed
//! Running  -> Completed | Failed
//! Deferred -> Ready | Completed | Failed
//! Completed, Failed: final
//! ```
//! `Completed` may carry an error result (a denied approval, a timeout, a
//! malformed call): the model is told. `Failed` is a call that ran (here,
//! in the background or isolated) and failed after its retries; the seed's
//! `Deferred -> Failed` is added because background and isolated attempts
//! run while their call stays deferred (its continuation is the handle).

use super::conversation::{ToolCall, ToolResult};
use super::ids::{CallId, ContinuationToken};
use super::policy::AppliedPolicy;
use super::time::Millis;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CallState {
    Ready,
    Running,
    Deferred,
    Completed,
    Failed,
}

impl CallState {
    pub fn is_final(self) -> bool {
        matches!(self, CallState::Completed | CallState::Failed)
    }

    pub fn can_move_to(self, to: CallState) -> bool {
        use CallState::*;
        matches!(
            (self, to),
            (Ready, Running)
                | (Ready, Deferred)
                | (Ready, Completed)
                | (Running, Completed)
                | (Running, Failed)
                | (Deferred, Ready)
                | (Deferred, Completed)
                | (Deferred, Failed)
        )
    }
}

impl fmt::Display for CallState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A refused state change, naming the call, its state and the attempted move.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("tool call {call} ({tool}) cannot move from {from} to {to}")]
pub struct TransitionError {
    pub call: CallId,
    pub tool: String,
    pub from: CallState,
    pub to: CallState,
}

/// Why a deferred call waits, so users can tell from `status` what it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WaitingFor {
    /// An approve/deny decision.
    Approval,
    /// The operator's own background execution (`runAsync`).
    Background,
    /// An isolated run (a Job, or a process for an external worker).
    Isolated,
    /// An outside party (`defer`).
    External,
}

/// A driver's committed claim on work with side effects (a model call, a
/// tool run, a background or isolated attempt). It is written with the
/// same checkpoint that starts the work; another driver leaves claimed work
/// alone until `until`, or until the driver reports the holder dead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    pub holder: String,
    pub until: Millis,
}

impl Claim {
    /// True when this claim keeps `me` from starting the work at `now`.
    pub fn blocks(&self, me: &str, dead: &std::collections::BTreeSet<String>, now: Millis) -> bool {
        self.holder != me && self.until > now && !dead.contains(&self.holder)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Approval {
    pub approved: bool,
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Arguments an approver put in place of the model's (`allowEdit`);
    /// the call runs with these, and the model's stay in `call`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TrackedToolCall {
    pub id: CallId,
    pub call: ToolCall,
    pub state: CallState,
    pub policy: AppliedPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<ContinuationToken>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingFor>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Approval>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResult>,
    /// Who supplied the result (a user, a worker, `operator`, `cache`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_by: Option<String>,
    /// Executions started so far (retries count here).
    #[serde(default)]
    pub attempts: u32,
    /// When the current wait gives up (the `timeout` decorator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Millis>,
    /// When a failed attempt is retried (the `retries` decorator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<Millis>,
    /// The driver running the current attempt (see [`Claim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
}

impl TrackedToolCall {
    /// The call as it runs: the model's, with an approver's edited
    /// arguments in place where there are some.
    pub fn effective_call(&self) -> ToolCall {
        let mut call = self.call.clone();
        if let Some(edited) = self.approval.as_ref().and_then(|a| a.arguments.clone()) {
            call.arguments = edited;
        }
        call
    }

    pub fn new(id: CallId, call: ToolCall, policy: AppliedPolicy) -> Self {
        TrackedToolCall {
            id,
            call,
            state: CallState::Ready,
            policy,
            token: None,
            waiting_for: None,
            approval: None,
            result: None,
            completed_by: None,
            attempts: 0,
            deadline: None,
            retry_at: None,
            claim: None,
        }
    }

    /// The combinations a state allows; a stored call that breaks one (a
    /// deferred call without a token, a call both waiting and completed)
    /// was edited by hand or written by a bug, and is refused on load.
    pub fn check(&self) -> Result<(), String> {
        let problem = match self.state {
            CallState::Deferred if self.token.is_none() => Some("is Deferred but has no token"),
            CallState::Deferred if self.waiting_for.is_none() => {
                Some("is Deferred but says nothing about what it waits for")
            }
            CallState::Deferred | CallState::Ready | CallState::Running
                if self.result.is_some() =>
            {
                Some("holds a result but is not final")
            }
            CallState::Ready | CallState::Running if self.waiting_for.is_some() => {
                Some("waits for something but is not Deferred")
            }
            CallState::Completed | CallState::Failed if self.result.is_none() => {
                Some("is final but holds no result")
            }
            CallState::Completed | CallState::Failed
                if self.waiting_for.is_some() || self.claim.is_some() =>
            {
                Some("is final but still waits or is claimed")
            }
            _ => None,
        };
        match problem {
            Some(p) => Err(format!("tool call {} ({}) {p}", self.id, self.call.name)),
            None => Ok(()),
        }
    }

    /// Moves to `to`, or refuses with an error naming the call and the move.
    pub fn transition(&mut self, to: CallState) -> Result<(), TransitionError> {
        if !self.state.can_move_to(to) {
            return Err(TransitionError {
                call: self.id,
                tool: self.call.name.clone(),
                from: self.state,
                to,
            });
        }
        self.state = to;
        if to != CallState::Deferred {
            self.waiting_for = None;
        }
        Ok(())
    }

    /// Records the final result. The state must allow the move.
    pub fn finish(
        &mut self,
        to: CallState,
        result: ToolResult,
        by: &str,
    ) -> Result<(), TransitionError> {
        self.transition(to)?;
        self.result = Some(result);
        self.completed_by = Some(by.to_string());
        self.deadline = None;
        self.retry_at = None;
        self.claim = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CallState::*;

    #[test]
    fn only_the_documented_transitions_are_legal() {
        let all = [Ready, Running, Deferred, Completed, Failed];
        let legal = [
            (Ready, Running),
            (Ready, Deferred),
            (Ready, Completed),
            (Running, Completed),
            (Running, Failed),
            (Deferred, Ready),
            (Deferred, Completed),
            (Deferred, Failed),
        ];
        for from in all {
            for to in all {
                assert_eq!(
                    from.can_move_to(to),
                    legal.contains(&(from, to)),
                    "{from}->{to}"
                );
            }
        }
    }

    #[test]
    fn impossible_combinations_are_named() {
        let mut c = TrackedToolCall::new(
            CallId::new(1, 0),
            ToolCall {
                model_call_id: "m".into(),
                name: "search".into(),
                arguments: "{}".into(),
            },
            AppliedPolicy::default(),
        );
        assert_eq!(c.check(), Ok(()));
        c.state = Deferred;
        c.waiting_for = Some(WaitingFor::External);
        assert!(c.check().unwrap_err().contains("has no token"));
        c.token = Some(ContinuationToken("s-t1-c0".into()));
        assert_eq!(c.check(), Ok(()));
        c.result = Some(ToolResult::text("x"));
        assert!(c.check().unwrap_err().contains("not final"));
        c.state = Completed;
        assert!(c.check().unwrap_err().contains("still waits"));
        c.waiting_for = None;
        assert_eq!(c.check(), Ok(()));
    }

    #[test]
    fn illegal_transition_names_call_state_and_move() {
        let mut c = TrackedToolCall::new(
            CallId::new(1, 0),
            ToolCall {
                model_call_id: "m".into(),
                name: "search".into(),
                arguments: "{}".into(),
            },
            AppliedPolicy::default(),
        );
        c.finish(Completed, ToolResult::text("x"), "test").unwrap();
        let err = c.transition(Running).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tool call t1-c0 (search) cannot move from Completed to Running"
        );
        assert_eq!(c.state, Completed);
        assert_eq!(c.result, Some(ToolResult::text("x")));
    }
}
