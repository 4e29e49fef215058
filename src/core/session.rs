//! The session state machine: events in, actions out.
//!
//! A [`Session`] pairs the durable [`SessionState`] (what the store keeps)
//! with the agent's [`SessionConfig`] and a queue of [`Action`]s. Drivers
//! follow one loop, quinn-style:
//!
//! 1. `Session::restore(state, config, now)` after loading (it re-derives
//!    the actions the state implies, so a crash anywhere is recoverable);
//! 2. drain [`Session::poll_action`] and perform each action, feeding the
//!    outcome back with [`Session::handle`];
//! 3. on [`Action::Checkpoint`] persist the state before going on (the
//!    agent turn is stored before any of its tool calls runs);
//! 4. when the queue is empty, persist and sleep until
//!    [`Session::poll_timeout`] or the next outside event.

use super::cache::{cache_key, CacheKey};
use super::call::{Approval, CallState, TrackedToolCall, TransitionError, WaitingFor};
use super::conversation::{
    AgentTurn, TokenUsage, ToolCall, ToolResponse, ToolResult, ToolResultEntry, Turn, UserTurn,
};
use super::envelope::{CallEnvelope, ContextSnapshot};
use super::ids::{CallId, ContinuationToken, SessionId};
use super::policy::{
    retry_backoff_millis, AppliedPolicy, Disposition, IsolationSpec, Policy, PolicyContext,
};
use super::time::Millis;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// How many times a failing model call is retried before the session fails.
pub const MODEL_RETRIES: u32 = 4;

/// What the agent definition contributes. Not persisted with the state: the
/// driver rebuilds it from the agent each time.
#[derive(Clone, Debug, Default)]
pub struct SessionConfig {
    pub agent: Option<String>,
    pub policy: Policy,
    /// The tools the model may call. Empty means "any name" (the driver
    /// resolves tools itself); otherwise other names are refused.
    pub tools: BTreeMap<String, ToolInfo>,
    pub limits: Limits,
    /// The call context holds secrets: nothing may be cached.
    pub context_has_secrets: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolInfo {
    /// Set for container tools: they can only run isolated.
    pub container: Option<IsolationSpec>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Most model turns (agent turns) the session may take.
    pub max_turns: Option<u32>,
    /// The session fails if not finished by then.
    pub deadline: Option<Millis>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// No user input yet.
    #[default]
    Idle,
    /// The model is to be called.
    AwaitingModel,
    /// Tool calls are ready or running here.
    RunningTools,
    /// Every open call is deferred: the session has yielded.
    Waiting,
    Succeeded,
    Failed,
}

impl Phase {
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// The open turn: the calls of the latest agent turn, tracked until every
/// one is final; then it becomes a full [`UserTurn`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PartialUserTurn {
    pub turn: u32,
    pub calls: Vec<TrackedToolCall>,
}

/// Everything a store keeps about a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionState {
    pub id: SessionId,
    pub phase: Phase,
    #[serde(default)]
    pub paused: bool,
    #[serde(default)]
    pub turns: Vec<Turn>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<PartialUserTurn>,
    /// User messages that arrived while the session was busy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inbox: Vec<String>,
    #[serde(default)]
    pub agent_turns: u32,
    #[serde(default)]
    pub usage: TokenUsage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    #[serde(default)]
    pub model_attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_retry_at: Option<Millis>,
}

impl SessionState {
    pub fn new(id: SessionId) -> Self {
        SessionState {
            id,
            phase: Phase::Idle,
            paused: false,
            turns: Vec::new(),
            open: None,
            inbox: Vec::new(),
            agent_turns: 0,
            usage: TokenUsage::default(),
            answer: None,
            failure: None,
            model_attempts: 0,
            model_retry_at: None,
        }
    }

    /// Deferred calls of the open turn, with what each waits for.
    pub fn pending(&self) -> Vec<&TrackedToolCall> {
        self.open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| c.state == CallState::Deferred)
            .collect()
    }

    pub fn find_call(&self, token: &ContinuationToken) -> Option<&TrackedToolCall> {
        self.open
            .iter()
            .flat_map(|o| o.calls.iter())
            .find(|c| c.token.as_ref() == Some(token))
    }
}

/// What the driver is asked to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Persist the state now, before performing the actions that follow.
    Checkpoint,
    /// Send the history to the model; answer with `ModelReplied` or `ModelFailed`.
    CallModel {
        turn: u32,
    },
    /// Run the tool here and now; answer with `ToolFinished`. A driver with
    /// a cache looks `cache_key` up first.
    RunTool {
        call: CallId,
        tool_call: ToolCall,
        idempotency_key: String,
        timeout_seconds: Option<u64>,
        cache_key: Option<CacheKey>,
        attempt: u32,
    },
    /// Make sure the continuation exists (create, or adopt the existing one)
    /// and says what it waits for. With a cache hit the driver may answer
    /// at once with `Wake`.
    EnsureContinuation(ContinuationSpec),
    /// Run the call in the background; answer with `AttemptFinished`.
    RunInBackground {
        envelope: CallEnvelope,
        attempt: u32,
    },
    /// Run the call isolated (Job or process); answer with `AttemptFinished`.
    LaunchIsolated {
        envelope: CallEnvelope,
        spec: IsolationSpec,
        attempt: u32,
    },
    /// Write this final result into the continuation (the core decided it:
    /// a runner's result after retries, a timeout, a denial).
    RecordResult {
        token: ContinuationToken,
        result: ToolResult,
        by: String,
    },
    StoreCache {
        key: CacheKey,
        result: ToolResult,
    },
    /// Every open call waits on the outside: stop until woken.
    Yield {
        pending: Vec<ContinuationToken>,
    },
    Finished {
        answer: String,
    },
    Failed {
        reason: String,
    },
}

/// What a `Continuation` holds when created.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContinuationSpec {
    pub token: ContinuationToken,
    pub session: SessionId,
    pub call_id: CallId,
    pub tool_call: ToolCall,
    pub policy: AppliedPolicy,
    pub waiting_for: WaitingFor,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub context: ContextSnapshot,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<CacheKey>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Millis>,
}

/// Something that happened, fed to [`Session::handle`] with the time.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    UserMessage {
        text: String,
    },
    ModelReplied {
        turn: AgentTurn,
    },
    ModelFailed {
        error: String,
        retryable: bool,
    },
    /// A `RunTool` finished.
    ToolFinished {
        call: CallId,
        result: ToolResult,
        from_cache: bool,
    },
    /// One background or isolated attempt finished; the core decides
    /// between retrying and recording the result.
    AttemptFinished {
        token: ContinuationToken,
        attempt: u32,
        result: ToolResult,
    },
    /// A continuation was completed from outside (a user, a worker, the cache).
    Wake {
        token: ContinuationToken,
        result: ToolResult,
        by: String,
    },
    Decide {
        token: ContinuationToken,
        approved: bool,
        by: String,
        reason: Option<String>,
    },
    /// A timer from `poll_timeout` fired (or any periodic check).
    Tick,
    Pause,
    Resume,
}

/// The answer to a wake or decision for one token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WakeOutcome {
    Applied,
    AlreadyCompleted,
    Unknown,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Transition(#[from] TransitionError),
    #[error("a model reply arrived while the session is {phase:?}; it expects one only while awaiting the model")]
    UnexpectedModelReply { phase: Phase },
    #[error("no running tool call {call} in the open turn")]
    UnknownCall { call: CallId },
    #[error("continuation {token} already holds a different result; a completed call's result cannot change")]
    ConflictingResult { token: ContinuationToken },
    #[error("continuation {token} was already {decision}; the decision cannot change")]
    ConflictingDecision {
        token: ContinuationToken,
        decision: &'static str,
    },
    #[error("tool call behind {token} is {state}, not waiting for {what}")]
    NotWaiting {
        token: ContinuationToken,
        state: CallState,
        what: &'static str,
    },
    #[error("the message is empty; send some text")]
    EmptyMessage,
    #[error("session {id} has failed ({reason}); start a new session")]
    SessionFailed { id: SessionId, reason: String },
}

/// The reply to [`Session::handle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    Done,
    Wake(WakeOutcome),
}

#[derive(Clone, Debug)]
pub struct Session {
    state: SessionState,
    config: SessionConfig,
    actions: VecDeque<Action>,
}

impl Session {
    pub fn new(id: SessionId, config: SessionConfig) -> Self {
        Session {
            state: SessionState::new(id),
            config,
            actions: VecDeque::new(),
        }
    }

    /// Rebuilds a session from stored state and re-derives what it still
    /// has to do (at-least-once for steps that were under way).
    pub fn restore(state: SessionState, config: SessionConfig, now: Millis) -> Self {
        let mut s = Session {
            state,
            config,
            actions: VecDeque::new(),
        };
        s.rederive(now);
        s
    }

    pub fn state(&self) -> &SessionState {
        &self.state
    }

    pub fn into_state(self) -> SessionState {
        self.state
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When the core next needs a `Tick`: retries, timeouts, the deadline.
    pub fn poll_timeout(&self) -> Option<Millis> {
        if self.state.phase.is_final() {
            return None;
        }
        let mut times: Vec<Millis> = Vec::new();
        times.extend(self.config.limits.deadline);
        if !self.state.paused {
            times.extend(self.state.model_retry_at);
        }
        for c in self.state.open.iter().flat_map(|o| o.calls.iter()) {
            if c.state.is_final() {
                continue;
            }
            times.extend(c.deadline);
            if !self.state.paused {
                times.extend(c.retry_at);
            }
        }
        times.into_iter().min()
    }

    pub fn handle(&mut self, event: Event, now: Millis) -> Result<Handled, CoreError> {
        match event {
            Event::UserMessage { text } => self.on_user_message(text, now).map(|_| Handled::Done),
            Event::ModelReplied { turn } => self.on_model_reply(turn, now).map(|_| Handled::Done),
            Event::ModelFailed { error, retryable } => {
                self.on_model_failed(error, retryable, now);
                Ok(Handled::Done)
            }
            Event::ToolFinished {
                call,
                result,
                from_cache,
            } => self
                .on_tool_finished(call, result, from_cache, now)
                .map(|_| Handled::Done),
            Event::AttemptFinished {
                token,
                attempt,
                result,
            } => self
                .on_attempt_finished(&token, attempt, result, now)
                .map(Handled::Wake),
            Event::Wake { token, result, by } => {
                self.on_wake(&token, result, &by, now).map(Handled::Wake)
            }
            Event::Decide {
                token,
                approved,
                by,
                reason,
            } => self
                .on_decide(&token, approved, by, reason, now)
                .map(Handled::Wake),
            Event::Tick => {
                self.on_tick(now);
                Ok(Handled::Done)
            }
            Event::Pause => {
                self.state.paused = true;
                Ok(Handled::Done)
            }
            Event::Resume => {
                if self.state.paused {
                    self.state.paused = false;
                    self.rederive(now);
                }
                Ok(Handled::Done)
            }
        }
    }

    /// Wakes several tokens at once; each gets its own outcome, and one
    /// refused token does not stop the others.
    pub fn wake_many(
        &mut self,
        results: Vec<(ContinuationToken, ToolResult)>,
        by: &str,
        now: Millis,
    ) -> Vec<(ContinuationToken, Result<WakeOutcome, CoreError>)> {
        results
            .into_iter()
            .map(|(token, result)| {
                let outcome = self.on_wake(&token, result, by, now);
                (token, outcome)
            })
            .collect()
    }

    // ---- events -------------------------------------------------------

    fn on_user_message(&mut self, text: String, now: Millis) -> Result<(), CoreError> {
        if text.trim().is_empty() {
            return Err(CoreError::EmptyMessage);
        }
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
            Phase::AwaitingModel | Phase::RunningTools | Phase::Waiting => {
                self.state.inbox.push(text)
            }
        }
        Ok(())
    }

    fn on_model_reply(&mut self, turn: AgentTurn, now: Millis) -> Result<(), CoreError> {
        if self.state.phase != Phase::AwaitingModel {
            return Err(CoreError::UnexpectedModelReply {
                phase: self.state.phase,
            });
        }
        self.state.agent_turns += 1;
        self.state.usage.add(turn.usage);
        self.state.model_attempts = 0;
        self.state.model_retry_at = None;
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
                let message = self.take_inbox();
                self.state.turns.push(Turn::User(UserTurn {
                    message,
                    tool_results: Vec::new(),
                }));
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
            };
            let policy = self.config.policy.classify(&ctx, &call);
            let mut tc = TrackedToolCall::new(id, call, policy);
            if let Some(problem) = self.refuse_reason(&tc.call) {
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
    fn refuse_reason(&self, call: &ToolCall) -> Option<String> {
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

    fn on_model_failed(&mut self, error: String, retryable: bool, now: Millis) {
        if self.state.phase != Phase::AwaitingModel {
            return;
        }
        self.state.model_attempts += 1;
        if retryable && self.state.model_attempts <= MODEL_RETRIES {
            let at = now
                .plus_millis(retry_backoff_millis(self.state.model_attempts))
                .ceil_to_second();
            self.state.model_retry_at = Some(at);
        } else {
            self.fail(format!(
                "the model call failed after {} attempt(s): {error}",
                self.state.model_attempts
            ));
        }
    }

    fn on_tool_finished(
        &mut self,
        id: CallId,
        result: ToolResult,
        from_cache: bool,
        now: Millis,
    ) -> Result<(), CoreError> {
        let secrets = self.config.context_has_secrets;
        let call = self
            .open_call_mut(|c| c.id == id && c.state == CallState::Running)
            .ok_or(CoreError::UnknownCall { call: id })?;
        let mut store = None;
        if result.is_error() && !from_cache && call.attempts <= call.policy.decorators.retries {
            call.retry_at = Some(
                now.plus_millis(retry_backoff_millis(call.attempts))
                    .ceil_to_second(),
            );
        } else {
            let result = truncate(result, call.policy.decorators.truncate_bytes);
            if call.policy.decorators.cache && !from_cache && !result.is_error() {
                store = cache_key(&call.call, secrets).map(|key| Action::StoreCache {
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

    fn on_attempt_finished(
        &mut self,
        token: &ContinuationToken,
        attempt: u32,
        result: ToolResult,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let secrets = self.config.context_has_secrets;
        let Some(call) = self.open_call_mut(|c| c.token.as_ref() == Some(token)) else {
            return Ok(WakeOutcome::Unknown);
        };
        if call.state.is_final() || attempt != call.attempts {
            // A stale attempt (a retry superseded it) or a finished call.
            return Ok(WakeOutcome::AlreadyCompleted);
        }
        let running_here = matches!(
            call.waiting_for,
            Some(WaitingFor::Background | WaitingFor::Isolated)
        );
        if !running_here {
            return Err(CoreError::NotWaiting {
                token: token.clone(),
                state: call.state,
                what: "a runner's result",
            });
        }
        if result.is_error() && call.attempts <= call.policy.decorators.retries {
            call.retry_at = Some(
                now.plus_millis(retry_backoff_millis(call.attempts))
                    .ceil_to_second(),
            );
            return Ok(WakeOutcome::Applied);
        }
        let result = truncate(result, call.policy.decorators.truncate_bytes);
        let store = (call.policy.decorators.cache && !result.is_error())
            .then(|| cache_key(&call.call, secrets))
            .flatten();
        let call = self
            .open_call_mut(|c| c.token.as_ref() == Some(token))
            .expect("found above");
        call.finish(CallState::Completed, result.clone(), "agents")?;
        self.push(Action::RecordResult {
            token: token.clone(),
            result: result.clone(),
            by: "agents".into(),
        });
        if let Some(key) = store {
            self.push(Action::StoreCache { key, result });
        }
        self.settle(now);
        Ok(WakeOutcome::Applied)
    }

    fn on_wake(
        &mut self,
        token: &ContinuationToken,
        result: ToolResult,
        by: &str,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let Some(call) = self.open_call_mut(|c| c.token.as_ref() == Some(token)) else {
            return self.wake_closed(token, result);
        };
        let result = truncate(result, call.policy.decorators.truncate_bytes);
        match call.state {
            CallState::Deferred => {
                call.finish(CallState::Completed, result, by)?;
                self.settle(now);
                Ok(WakeOutcome::Applied)
            }
            CallState::Completed | CallState::Failed => {
                if call.result.as_ref() == Some(&result) {
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
    fn closed_entry(&self, token: &ContinuationToken) -> Option<&ToolResultEntry> {
        self.state.turns.iter().rev().find_map(|t| match t {
            Turn::User(u) => u
                .tool_results
                .iter()
                .find(|r| r.token.as_ref() == Some(token)),
            Turn::Agent(_) => None,
        })
    }

    fn wake_closed(
        &self,
        token: &ContinuationToken,
        result: ToolResult,
    ) -> Result<WakeOutcome, CoreError> {
        match self.closed_entry(token) {
            None => Ok(WakeOutcome::Unknown),
            Some(entry) if entry.result == truncate(result, entry.truncate_bytes) => {
                Ok(WakeOutcome::AlreadyCompleted)
            }
            Some(_) => Err(CoreError::ConflictingResult {
                token: token.clone(),
            }),
        }
    }

    fn on_decide(
        &mut self,
        token: &ContinuationToken,
        approved: bool,
        by: String,
        reason: Option<String>,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let Some(call) = self.open_call_mut(|c| c.token.as_ref() == Some(token)) else {
            return Ok(match self.closed_entry(token) {
                Some(_) => WakeOutcome::AlreadyCompleted,
                None => WakeOutcome::Unknown,
            });
        };
        if let Some(previous) = &call.approval {
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
        if call.state != CallState::Deferred || call.waiting_for != Some(WaitingFor::Approval) {
            if call.state.is_final() {
                return Ok(WakeOutcome::AlreadyCompleted);
            }
            return Err(CoreError::NotWaiting {
                token: token.clone(),
                state: call.state,
                what: "an approval",
            });
        }
        let message = match (&reason, approved) {
            (Some(r), false) => format!("denied by {by}: {r}"),
            (None, false) => format!("denied by {by}"),
            _ => String::new(),
        };
        call.approval = Some(Approval {
            approved,
            by: by.clone(),
            reason,
        });
        call.deadline = None;
        if approved {
            call.transition(CallState::Ready)?;
            self.dispatch(now);
        } else {
            let result = ToolResult::error(message);
            call.finish(CallState::Completed, result.clone(), &by)?;
            self.push(Action::RecordResult {
                token: token.clone(),
                result,
                by,
            });
        }
        self.settle(now);
        Ok(WakeOutcome::Applied)
    }

    fn on_tick(&mut self, now: Millis) {
        if self.state.phase.is_final() {
            return;
        }
        if let Some(deadline) = self.config.limits.deadline {
            if now >= deadline {
                self.fail("the session passed its deadline".to_string());
                return;
            }
        }
        let paused = self.state.paused;
        let mut actions = Vec::new();
        if let Some(open) = self.state.open.as_mut() {
            for call in open.calls.iter_mut() {
                if call.state.is_final() {
                    continue;
                }
                if call.deadline.is_some_and(|d| now >= d) {
                    let secs = call.policy.decorators.timeout_seconds.unwrap_or(0);
                    let what = match call.waiting_for {
                        Some(WaitingFor::Approval) => "an approval",
                        Some(WaitingFor::External) => "an outside result",
                        _ => "the tool",
                    };
                    let result =
                        ToolResult::error(format!("timed out after {secs}s waiting for {what}"));
                    let to = if call.state == CallState::Running {
                        CallState::Failed
                    } else {
                        CallState::Completed
                    };
                    if call.finish(to, result.clone(), "agents").is_ok() {
                        if let Some(token) = call.token.clone() {
                            actions.push(Action::RecordResult {
                                token,
                                result,
                                by: "agents".into(),
                            });
                        }
                    }
                    continue;
                }
                if paused {
                    continue;
                }
                if call.retry_at.is_some_and(|t| now >= t) {
                    call.retry_at = None;
                    call.attempts += 1;
                    actions.extend(run_action(&self.state.id, &self.config, call));
                }
            }
        }
        for a in actions {
            self.push(a);
        }
        if !paused && self.state.phase == Phase::AwaitingModel {
            if let Some(at) = self.state.model_retry_at {
                if now >= at {
                    self.state.model_retry_at = None;
                    self.push(Action::CallModel {
                        turn: self.state.agent_turns + 1,
                    });
                }
            }
        }
        self.settle(now);
    }

    // ---- the scheduler ------------------------------------------------

    /// Moves every ready call on according to its policy.
    fn dispatch(&mut self, now: Millis) {
        if self.state.paused {
            return;
        }
        let Some(open) = self.state.open.as_mut() else {
            return;
        };
        let mut actions = Vec::new();
        for call in open
            .calls
            .iter_mut()
            .filter(|c| c.state == CallState::Ready)
        {
            let token = ContinuationToken::for_call(&self.state.id, call.id);
            let timeout = call.policy.decorators.timeout_seconds;
            let deadline = timeout.map(|s| now.plus_secs(s).ceil_to_second());
            let needs_approval = call.policy.decorators.approval && call.approval.is_none();
            let waiting = if needs_approval {
                Some(WaitingFor::Approval)
            } else {
                match call.policy.disposition {
                    Disposition::RunSync => None,
                    Disposition::RunAsync => Some(WaitingFor::Background),
                    Disposition::RunIsolated { .. } => Some(WaitingFor::Isolated),
                    Disposition::Defer { .. } => Some(WaitingFor::External),
                }
            };
            match waiting {
                None => {
                    call.transition(CallState::Running)
                        .expect("ready calls may start");
                    call.attempts += 1;
                    call.deadline = None;
                }
                Some(w) => {
                    call.transition(CallState::Deferred)
                        .expect("ready calls may defer");
                    call.token = Some(token);
                    call.waiting_for = Some(w);
                    call.deadline = deadline;
                    if matches!(w, WaitingFor::Background | WaitingFor::Isolated) {
                        call.attempts += 1;
                    }
                }
            }
            actions.extend(run_action(&self.state.id, &self.config, call));
        }
        for a in actions {
            self.push(a);
        }
    }

    /// Re-derives the actions the stored state implies (after a restart or
    /// a resume). Every action is idempotent for the driver.
    fn rederive(&mut self, now: Millis) {
        self.actions.clear();
        if self.state.paused || self.state.phase.is_final() {
            return;
        }
        if self.state.phase == Phase::AwaitingModel {
            if self.state.model_retry_at.is_none_or(|t| now >= t) {
                self.state.model_retry_at = None;
                self.push(Action::CallModel {
                    turn: self.state.agent_turns + 1,
                });
            }
            return;
        }
        let mut actions = Vec::new();
        if let Some(open) = self.state.open.as_ref() {
            for call in &open.calls {
                if call.retry_at.is_some()
                    || call.state.is_final()
                    || call.state == CallState::Ready
                {
                    continue;
                }
                actions.extend(run_action(&self.state.id, &self.config, call));
            }
        }
        for a in actions {
            self.push(a);
        }
        self.dispatch(now);
        self.settle(now);
        if self.state.phase == Phase::Waiting
            && !self
                .actions
                .iter()
                .any(|a| matches!(a, Action::Yield { .. }))
        {
            self.push_yield();
        }
    }

    /// Closes the open turn when every call is final, and keeps `phase`
    /// true to the state.
    fn settle(&mut self, now: Millis) {
        if self.state.phase.is_final() && self.state.open.is_none() {
            return;
        }
        let Some(open) = self.state.open.as_ref() else {
            return;
        };
        if open.calls.iter().all(|c| c.state.is_final()) {
            let open = self.state.open.take().expect("checked");
            let tool_results = open
                .calls
                .into_iter()
                .map(|c| ToolResultEntry {
                    call_id: c.id,
                    model_call_id: c.call.model_call_id,
                    tool: c.call.name,
                    token: c.token,
                    result: c.result.expect("final calls hold a result"),
                    truncate_bytes: c.policy.decorators.truncate_bytes,
                })
                .collect();
            let message = self.take_inbox();
            self.state.turns.push(Turn::User(UserTurn {
                message,
                tool_results,
            }));
            if self.state.phase.is_final() {
                return;
            }
            self.push(Action::Checkpoint);
            self.await_model(now);
            return;
        }
        let busy = open
            .calls
            .iter()
            .any(|c| matches!(c.state, CallState::Ready | CallState::Running));
        let before = self.state.phase;
        if before.is_final() {
            return;
        }
        self.state.phase = if busy {
            Phase::RunningTools
        } else {
            Phase::Waiting
        };
        if self.state.phase == Phase::Waiting && before != Phase::Waiting {
            self.push_yield();
        }
    }

    fn push_yield(&mut self) {
        let pending = self
            .state
            .pending()
            .into_iter()
            .filter_map(|c| c.token.clone())
            .collect();
        self.push(Action::Checkpoint);
        self.push(Action::Yield { pending });
    }

    fn await_model(&mut self, _now: Millis) {
        if let Some(max) = self.config.limits.max_turns {
            if self.state.agent_turns >= max {
                self.fail(format!(
                    "the session reached its limit of {max} model turns; raise spec.limits.maxTurns to go on"
                ));
                return;
            }
        }
        self.state.phase = Phase::AwaitingModel;
        if !self.state.paused {
            self.push(Action::CallModel {
                turn: self.state.agent_turns + 1,
            });
        }
    }

    fn fail(&mut self, reason: String) {
        self.state.phase = Phase::Failed;
        self.state.failure = Some(reason.clone());
        self.push(Action::Checkpoint);
        self.push(Action::Failed { reason });
    }

    fn take_inbox(&mut self) -> Option<String> {
        if self.state.inbox.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.state.inbox).join("\n\n"))
        }
    }

    fn open_call_mut(
        &mut self,
        pred: impl Fn(&TrackedToolCall) -> bool,
    ) -> Option<&mut TrackedToolCall> {
        self.state
            .open
            .as_mut()
            .and_then(|o| o.calls.iter_mut().find(|c| pred(c)))
    }

    fn push(&mut self, action: Action) {
        self.actions.push_back(action);
    }
}

/// The actions that (re)start `call` in its current state.
fn run_action(session: &SessionId, config: &SessionConfig, call: &TrackedToolCall) -> Vec<Action> {
    let cache = call
        .policy
        .decorators
        .cache
        .then(|| cache_key(&call.call, config.context_has_secrets))
        .flatten();
    let context = ContextSnapshot::for_call(session, call, config.agent.as_deref());
    match call.state {
        CallState::Running => vec![Action::RunTool {
            call: call.id,
            tool_call: call.call.clone(),
            idempotency_key: context.idempotency_key.clone(),
            timeout_seconds: call.policy.decorators.timeout_seconds,
            cache_key: cache,
            attempt: call.attempts,
        }],
        CallState::Deferred => {
            let (Some(token), Some(waiting_for)) = (call.token.clone(), call.waiting_for) else {
                return Vec::new();
            };
            let reason = match (&call.policy.disposition, waiting_for) {
                (_, WaitingFor::Approval) => Some("waiting for approval".to_string()),
                (Disposition::Defer { reason }, _) => Some(reason.clone()),
                _ => None,
            };
            let envelope = CallEnvelope::new(
                token.clone(),
                call.call.clone(),
                context.clone(),
                call.policy.clone(),
            );
            let mut out = vec![Action::EnsureContinuation(ContinuationSpec {
                token,
                session: session.clone(),
                call_id: call.id,
                tool_call: call.call.clone(),
                policy: call.policy.clone(),
                waiting_for,
                reason,
                context,
                cache_key: cache,
                expires_at: call.deadline,
            })];
            match (waiting_for, &call.policy.disposition) {
                (WaitingFor::Background, _) => out.push(Action::RunInBackground {
                    envelope,
                    attempt: call.attempts,
                }),
                (WaitingFor::Isolated, Disposition::RunIsolated { spec }) => {
                    out.push(Action::LaunchIsolated {
                        envelope,
                        spec: spec.clone(),
                        attempt: call.attempts,
                    })
                }
                _ => {}
            }
            out
        }
        _ => Vec::new(),
    }
}

/// Applies the `truncate` decorator.
pub fn truncate(result: ToolResult, max: Option<usize>) -> ToolResult {
    let Some(max) = max else { return result };
    match result {
        ToolResult::Success { response } if response.size() > max => {
            let text = response.to_model_text();
            let mut cut = max.min(text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            ToolResult::ok(ToolResponse::text(format!(
                "{}\n[truncated: showing {} of {} bytes]",
                &text[..cut],
                cut,
                text.len()
            )))
        }
        other => other,
    }
}
