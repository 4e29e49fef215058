//! Events of the conversation: a user message, a model reply (checked,
//! then planned call by call), a failed model call and its retry.

use super::{
    outcome, subagent, Action, CoreError, PartialUserTurn, Phase, Session,
    DEFAULT_MAX_CALLS_PER_REPLY,
};
use crate::core::call::{Attempt, CallState, TrackedToolCall};
use crate::core::conversation::{AgentTurn, ToolCall, ToolResult, Turn, UserTurn};
use crate::core::ids::CallId;
use crate::core::policy::{retry_backoff_millis, PolicyContext};
use crate::core::time::Millis;

impl Session {
    // ---- events -------------------------------------------------------

    pub(super) fn on_user_message(&mut self, text: String, now: Millis) -> Result<(), CoreError> {
        if text.trim().is_empty() {
            return Err(CoreError::EmptyMessage);
        }
        self.state.messages_taken += 1;
        match self.state.phase {
            Phase::Idle | Phase::Succeeded | Phase::Failed => {
                self.state.failure = None;
                self.state.answer = None;
                self.state.model_attempts = 0;
                self.state.turns.push(Turn::User(UserTurn {
                    message: Some(text),
                    tool_results: Vec::new(),
                }));
                self.await_model(now);
            }
            // The model has not been asked yet (no driver holds the call,
            // or ours is still queued): the message joins the request as
            // its own user message.
            Phase::AwaitingModel
                if self.state.model_attempt.claim().is_none()
                    || self
                        .actions
                        .iter()
                        .any(|a| matches!(a, Action::CallModel { .. })) =>
            {
                self.state.turns.push(Turn::User(UserTurn {
                    message: Some(text),
                    tool_results: Vec::new(),
                }));
            }
            Phase::AwaitingModel | Phase::RunningTools | Phase::Waiting => {
                self.state.inbox.push(text)
            }
        }
        Ok(())
    }

    pub(super) fn on_model_reply(
        &mut self,
        mut turn: AgentTurn,
        now: Millis,
    ) -> Result<(), CoreError> {
        if self.state.phase != Phase::AwaitingModel {
            return Err(CoreError::UnexpectedModelReply {
                phase: self.state.phase,
            });
        }
        // The claim is kept to the millisecond, so it tells when the model
        // was asked at no cost of its own.
        turn.asked_at = self
            .state
            .model_attempt
            .claim()
            .map(|c| outcome::started_at_about(c, self.config.model_timeout_secs));
        turn.replied_at = Some(now);
        if let Some(pricing) = &self.config.pricing {
            turn.usage.cost_micros = pricing.cost_micros(&turn.usage);
        }
        self.state.usage.add(turn.usage);
        self.state.model_attempts = 0;
        self.state.model_attempt = Attempt::Unclaimed;
        let most = self
            .config
            .limits
            .max_calls_per_reply
            .unwrap_or(DEFAULT_MAX_CALLS_PER_REPLY);
        if turn.tool_calls.len() > most as usize {
            self.fail(format!(
                "the model asked for {} tool calls in one reply; at most {most} are taken (the operator's --max-calls-per-reply, chart value maxCallsPerReply); the reply was not kept",
                turn.tool_calls.len()
            ));
            return Ok(());
        }
        self.state.agent_turns += 1;
        let turn_no = self.state.agent_turns;
        let calls = turn.tool_calls.clone();
        let text = turn.text.clone();
        self.state.turns.push(Turn::Agent(turn));

        if calls.is_empty() {
            if self.state.inbox.is_empty() {
                let answer = text.unwrap_or_default();
                self.state.answer = Some(answer.clone());
                self.state.phase = Phase::Succeeded;
                self.push(Action::Checkpoint);
                self.push(Action::Finished { answer });
            } else {
                self.flush_inbox();
                self.push(Action::Checkpoint);
                self.await_model(now);
            }
            return Ok(());
        }

        let mut tracked = Vec::with_capacity(calls.len());
        for (i, call) in calls.into_iter().enumerate() {
            let id = CallId::new(turn_no, i as u32);
            let tool = self.config.tools.get(&call.name);
            let ctx = PolicyContext {
                session: Some(&self.state.id),
                tool_container: tool.and_then(|t| t.container.as_ref()),
                sub_agent: tool.and_then(|t| t.sub_agent.as_deref()),
            };
            let policy = self.config.policy.classify(&ctx, &call);
            let mut tc = TrackedToolCall::new(id, call, policy);
            let problem = self.refuse_reason(&tc.call).or_else(|| {
                let agent = tool.and_then(|t| t.sub_agent.as_deref())?;
                let args = serde_json::Value::Object(tc.call.parsed_arguments().ok()?);
                subagent::refuse_reason(&self.config, &self.state.id, agent, &args)
            });
            if let Some(problem) = problem {
                tc.finish(CallState::Completed, ToolResult::error(problem), "agents")?;
            }
            tracked.push(tc);
        }
        self.state.open = Some(PartialUserTurn {
            turn: turn_no,
            calls: tracked,
        });
        self.state.phase = Phase::RunningTools;
        // The agent turn is stored before any of its calls runs.
        self.push(Action::Checkpoint);
        self.dispatch(now);
        self.settle(now);
        Ok(())
    }

    /// Why a call cannot run at all; the model is told and can correct itself.
    pub(super) fn refuse_reason(&self, call: &ToolCall) -> Option<String> {
        if !self.config.tools.is_empty() && !self.config.tools.contains_key(&call.name) {
            let known: Vec<&str> = self.config.tools.keys().map(String::as_str).collect();
            return Some(format!(
                "unknown tool {:?}; available tools: {}",
                call.name,
                known.join(", ")
            ));
        }
        call.parsed_arguments().err()
    }

    pub(super) fn on_model_failed(
        &mut self,
        error: String,
        retryable: bool,
        retry_after_ms: Option<u64>,
        now: Millis,
    ) {
        if self.state.phase != Phase::AwaitingModel {
            return;
        }
        self.state.model_attempt = Attempt::Unclaimed;
        self.state.model_attempts += 1;
        if retryable && self.state.model_attempts <= self.config.model_retries {
            let backoff = retry_backoff_millis(self.state.model_attempts);
            let wait = retry_after_ms.map_or(backoff, |r| r.max(backoff));
            self.state.model_attempt = Attempt::RetryAt(now.plus_millis(wait).ceil_to_second());
        } else {
            self.fail(format!(
                "the model call failed after {} attempt(s): {error}",
                self.state.model_attempts
            ));
        }
    }

    /// A user asked to retry a failed session: the failed model step (or
    /// the step that failed) runs again from the last checkpoint.
    pub(super) fn on_retry(&mut self, now: Millis) -> Result<(), CoreError> {
        self.state.retries_taken += 1;
        if self.state.phase != Phase::Failed {
            return Ok(());
        }
        self.state.failure = None;
        self.state.model_attempts = 0;
        self.state.model_attempt = Attempt::Unclaimed;
        if self.state.open.is_some() {
            self.state.phase = Phase::RunningTools;
            self.settle(now);
            self.replan(now);
        } else {
            match self.state.turns.last() {
                Some(Turn::User(_)) => {
                    self.state.phase = Phase::AwaitingModel;
                    self.replan(now);
                }
                _ => self.state.phase = Phase::Idle,
            }
        }
        Ok(())
    }
}
