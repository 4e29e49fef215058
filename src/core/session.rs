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

use super::acceptance::ENGINE_BY;
use super::budget::{Budget, BudgetStop, Pricing, Raise, Spend, Work};
use super::cache::{cache_key, CacheKey, CacheScope};
use super::call::{
    flat, Approval, Attempt, CallStage, CallState, Claim, TaskHandle, TrackedToolCall,
    TransitionError, Wait, WaitingFor,
};
use super::conversation::{
    AgentTurn, TokenUsage, ToolCall, ToolResponse, ToolResult, ToolResultEntry, Turn, UserTurn,
};
use super::envelope::{CallEnvelope, ContextSnapshot};
use super::ids::{CallId, ContinuationToken, SessionId};
use super::policy::{
    retry_backoff_millis, AppliedPolicy, Disposition, IsolationSpec, OnTimeout, Policy,
    PolicyContext,
};
use super::time::Millis;
use serde::{Deserialize, Serialize};
pub use spend::{BudgetAsk, BUDGET_TOOL};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

mod outcome;
mod spend;
pub mod subagent;
mod task;
pub use outcome::{reason as unknown_outcome_reason, tool_rule, OnUnknownOutcome};
pub use task::{next_poll, MAX_POLL_MS, MIN_POLL_MS, TASK_BY};

/// How many times a failing model call is retried before the session fails
/// (the default of `spec.model.maxRetries`).
pub const MODEL_RETRIES: u32 = 4;
/// Default model call timeout (`spec.model.timeoutSeconds`).
pub const MODEL_TIMEOUT_SECS: u64 = 60;
/// A tool without a `timeout` decorator is stopped after this long, so a
/// claim on it always expires.
pub const DEFAULT_TOOL_TIMEOUT_SECS: u64 = 300;
/// Added to a claim beyond the work's own timeout: the holder has stopped
/// the work by then.
pub const CLAIM_GRACE_MILLIS: i64 = 15_000;
/// Default largest result kept (`spec.maxResultBytes`): 8 MiB.
pub const MAX_RESULT_BYTES: usize = 8 << 20;

/// What the agent definition and the driver contribute. Not persisted with
/// the state: the driver rebuilds it each time.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub agent: Option<String>,
    pub policy: Policy,
    /// The tools the model may call. Empty means "any name" (the driver
    /// resolves tools itself); otherwise other names are refused.
    pub tools: BTreeMap<String, ToolInfo>,
    pub limits: Limits,
    /// The call context holds secrets: nothing may be cached.
    pub context_has_secrets: bool,
    /// Where keys that leave the process are valid: idempotency and cache keys.
    pub scope: Scope,
    /// Model call timeout and retries.
    pub model_timeout_secs: u64,
    pub model_retries: u32,
    /// Results larger than this are cut, and the model is told.
    pub max_result_bytes: usize,
    /// Timeout of a tool without a `timeout` decorator.
    pub default_tool_timeout_secs: u64,
    /// Fingerprints of tool definitions (image and command, URL), so a
    /// changed tool never reuses cached results of the old one.
    pub tool_fingerprints: BTreeMap<String, String>,
    /// Who drives and what it may start.
    pub driver: DriverRole,
    /// Where the session sits in its tree, and the limits on children.
    pub lineage: subagent::Lineage,
    /// Limits on tokens, cost and tool calls, and what happens past them.
    pub budget: Budget,
    /// What the model's tokens cost (`spec.model.pricing`).
    pub pricing: Option<Pricing>,
    /// The namespace's Budgets that select the session, as the driver
    /// last saw them: no model call starts while one is spent.
    pub shared_budgets: Vec<super::shared_budget::SharedBudget>,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            agent: None,
            policy: Policy::default(),
            tools: BTreeMap::new(),
            limits: Limits::default(),
            context_has_secrets: false,
            scope: Scope::default(),
            model_timeout_secs: MODEL_TIMEOUT_SECS,
            model_retries: MODEL_RETRIES,
            max_result_bytes: MAX_RESULT_BYTES,
            default_tool_timeout_secs: DEFAULT_TOOL_TIMEOUT_SECS,
            tool_fingerprints: BTreeMap::new(),
            driver: DriverRole::default(),
            lineage: subagent::Lineage::default(),
            budget: Budget::default(),
            pricing: None,
            shared_budgets: Vec::new(),
        }
    }
}

/// The namespace and unique id of the session: two sessions named alike (in
/// two namespaces, or one re-created) never share keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    pub namespace: String,
    pub uid: String,
}

/// The driver performing this step: its claim holder name and the kinds of
/// work it starts. A worker (`agents session run-isolated`) starts isolated
/// runs only; `agents run` and the operator start everything they can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRole {
    pub holder: String,
    /// Holders the driver knows to be dead (a crashed process, an earlier
    /// instance of itself): their claims are void.
    pub dead_holders: BTreeSet<String>,
    /// Calls the model and runs `runSync` tools.
    pub model: bool,
    /// Runs `runAsync` calls.
    pub background: bool,
    /// Runs `runIsolated` calls.
    pub isolated: bool,
}

impl DriverRole {
    /// True when this driver runs `call`'s current attempt itself (it does
    /// not wait on the outside for it).
    pub fn runs(&self, call: &TrackedToolCall) -> bool {
        match call.stage() {
            CallStage::Running(_) => self.model,
            CallStage::Deferred { wait, .. } => match wait {
                Wait::Background(_) => self.background,
                Wait::Isolated(_) => self.isolated,
                // Polled by the driver that runs tools in the step.
                Wait::McpTask { .. } => self.model,
                // Made by the driver that calls the model (a worker makes none).
                Wait::SubAgent(_) => self.model,
                Wait::Approval | Wait::External | Wait::Outcome { .. } => false,
            },
            CallStage::Ready | CallStage::Completed(_) | CallStage::Failed(_) => false,
        }
    }
}

impl Default for DriverRole {
    fn default() -> Self {
        DriverRole {
            holder: "driver".into(),
            dead_holders: BTreeSet::new(),
            model: true,
            background: true,
            isolated: true,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolInfo {
    /// Set for container tools: they can only run isolated.
    pub container: Option<IsolationSpec>,
    /// Set for `agent` tools: the Agent a call runs as a child Session.
    pub sub_agent: Option<String>,
    /// Set for a tool that is not idempotent: what happens when an
    /// attempt's outcome is unknown. `None`: the tool honours the
    /// idempotency key, and a lost attempt is sent again under it.
    pub unknown_outcome: Option<OnUnknownOutcome>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Most model turns (agent turns) the session may take.
    pub max_turns: Option<u32>,
    /// The session fails if not finished by then.
    pub deadline: Option<Millis>,
    /// Most tool calls one model reply may ask for; `None` is
    /// [`DEFAULT_MAX_CALLS_PER_REPLY`]. A reply over it fails the session
    /// before anything of it is kept or run.
    pub max_calls_per_reply: Option<u32>,
}

/// The cap on tool calls per model reply when nobody sets one: far above
/// what a model asks for in earnest, far below what would burst a status.
pub const DEFAULT_MAX_CALLS_PER_REPLY: u32 = 64;

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
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
    /// The model gave its final answer.
    Succeeded,
    /// The session stopped on an error.
    Failed,
}

impl Phase {
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// The open turn: the calls of the latest agent turn, tracked until every
/// one is final; then it becomes a full [`UserTurn`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PartialUserTurn {
    /// The agent turn whose calls these are.
    pub turn: u32,
    /// The calls, in the model's order.
    pub calls: Vec<TrackedToolCall>,
}

/// Everything a store keeps about a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionState {
    /// The session's name.
    pub id: SessionId,
    /// Where the session is, as the core tracks it.
    pub phase: Phase,
    /// Held: no model or tool call starts.
    #[serde(default)]
    pub paused: bool,
    /// The conversation, oldest first.
    #[serde(default)]
    pub turns: Vec<Turn>,
    /// The calls of the latest agent turn, tracked until all are final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<PartialUserTurn>,
    /// User messages that arrived while the session was busy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inbox: Vec<String>,
    /// Model turns taken.
    #[serde(default)]
    pub agent_turns: u32,
    /// Token usage summed over the session.
    #[serde(default)]
    pub usage: TokenUsage,
    /// Of `usage`, what the session's sub-agents spent (added with each
    /// child's answer): a namespace Budget counts each session's own spend
    /// only, since the children are sessions it counts too.
    #[serde(default, skip_serializing_if = "TokenUsage::is_none")]
    pub children_usage: TokenUsage,
    /// The final answer, once the session succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Why the session failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Failed model calls in a row.
    #[serde(default)]
    pub model_attempts: u32,
    /// The model call's current attempt: the driver whose call is under
    /// way, or when a failed call is retried (stored as `modelRetryAt` and
    /// `modelClaim`).
    #[serde(flatten, with = "flat::model_attempt")]
    #[schemars(with = "flat::model_attempt::Fields")]
    pub model_attempt: Attempt,
    /// How many user messages the session has taken in (from `spec.messages`),
    /// so a driver re-reading them never sends one twice.
    #[serde(default)]
    pub messages_taken: u32,
    /// How many user retries of a failed session were taken (`spec.retry`).
    #[serde(default)]
    pub retries_taken: u32,
    /// Steps of a driver that failed in a row (for a reason of the
    /// session's own), kept with the session so that the limit holds
    /// across driver restarts; a step that ends well resets it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_steps: u32,
    /// Tool runs started (a call's retries count once): what
    /// `spec.limits.toolCalls` is compared with.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tool_calls: u32,
    /// The limit that holds the session (`onExceed: pause`) until raised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_stop: Option<BudgetStop>,
    /// The session and turn this one was forked from; its history up to
    /// there is the source's, recorded, never run again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<super::fork::ForkedFrom>,
    /// The open question to a person about a limit (`onExceed: ask`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_ask: Option<BudgetAsk>,
    /// Questions about limits asked so far: the next one's token number.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub budget_asks: u32,
    /// The limits people raised when asked.
    #[serde(default, skip_serializing_if = "Raise::is_empty")]
    pub budget_raise: Raise,
    /// The namespace Budget that is spent: the session waits for it
    /// before its next model call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_exhausted: Option<super::shared_budget::BudgetExhausted>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl SessionState {
    /// Ends the session as `Failed` with `reason`: the core's own failures,
    /// and a driver's when the state can no longer be stored.
    pub fn fail(&mut self, reason: String) {
        self.phase = Phase::Failed;
        self.failure = Some(reason);
        self.model_attempt = Attempt::Unclaimed;
    }

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
            children_usage: TokenUsage::default(),
            answer: None,
            failure: None,
            model_attempts: 0,
            model_attempt: Attempt::Unclaimed,
            messages_taken: 0,
            retries_taken: 0,
            failed_steps: 0,
            tool_calls: 0,
            budget_stop: None,
            forked_from: None,
            budget_ask: None,
            budget_asks: 0,
            budget_raise: Raise::default(),
            budget_exhausted: None,
        }
    }

    /// Deferred calls of the open turn, with what each waits for.
    pub fn pending(&self) -> Vec<&TrackedToolCall> {
        self.open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| c.state() == CallState::Deferred)
            .collect()
    }

    pub fn find_call(&self, token: &ContinuationToken) -> Option<&TrackedToolCall> {
        self.open
            .iter()
            .flat_map(|o| o.calls.iter())
            .find(|c| c.token() == Some(token))
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
    /// With a cache hit under `cache_key` the driver may answer at once
    /// with `Wake` (by `cache`) instead.
    RunInBackground {
        envelope: CallEnvelope,
        attempt: u32,
        cache_key: Option<CacheKey>,
    },
    /// Make (or adopt) the call's child Session and take its answer once it
    /// ends; answer with `AttemptFinished`.
    StartSubAgent {
        envelope: CallEnvelope,
        child: subagent::ChildPlan,
        attempt: u32,
    },
    /// Run the call isolated (Job or process); answer with `AttemptFinished`.
    LaunchIsolated {
        envelope: CallEnvelope,
        spec: IsolationSpec,
        attempt: u32,
    },
    /// While paused: take the result of an attempt already under way, if
    /// it has ended, and start nothing (answer with `AttemptFinished`).
    /// A result that ends while the session is paused is kept then, not
    /// left to a runner that may lose it (a Job's pod removed).
    Collect {
        envelope: CallEnvelope,
        /// The isolation of an isolated call; `None` for a background run.
        isolated: Option<IsolationSpec>,
        /// The child of a sub-agent call.
        child: Option<subagent::ChildPlan>,
        attempt: u32,
    },
    /// Ask the MCP server how the call's task is doing (`tasks/get`),
    /// after delivering the answers people gave to `asks` (its open
    /// request for input) where there are some; answer with `TaskAsks`
    /// or `TaskEnded`. Reads only: no claim is taken.
    PollTask {
        envelope: CallEnvelope,
        task: TaskHandle,
        asks: Option<String>,
    },
    /// Tell the MCP server the call's task is no longer wanted
    /// (`tasks/cancel`; the call timed out). Best effort: the call has
    /// already ended.
    CancelTask {
        envelope: CallEnvelope,
        task: TaskHandle,
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

impl Action {
    /// Work with side effects that a pause or a lost claim must not start.
    pub fn starts_work(&self) -> bool {
        matches!(
            self,
            Action::CallModel { .. }
                | Action::RunTool { .. }
                | Action::RunInBackground { .. }
                | Action::LaunchIsolated { .. }
                | Action::StartSubAgent { .. }
        )
    }
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
        /// The server asked to wait this long (`Retry-After`).
        retry_after_ms: Option<u64>,
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
    /// A run (`RunTool`, or a background attempt) was answered with an
    /// MCP task handle instead of a result.
    TaskCreated {
        call: CallId,
        attempt: u32,
        task: TaskHandle,
    },
    /// A poll found the call's task asking for input (`Some`, the
    /// request as JSON) or working (`None`).
    TaskAsks {
        token: ContinuationToken,
        asks: Option<String>,
    },
    /// A poll found the call's task ended, with this result.
    TaskEnded {
        token: ContinuationToken,
        result: ToolResult,
    },
    /// A sub-agent call's answer (`answer`: `AttemptFinished` or `Wake`)
    /// with the child's final usage, added to this session's when the
    /// answer ends the call (see [`Session::take_child_answer`]).
    ChildAnswered {
        answer: Box<Event>,
        usage: TokenUsage,
    },
    /// A continuation was completed from outside (a user, a worker, the cache).
    Wake {
        token: ContinuationToken,
        result: ToolResult,
        by: String,
    },
    /// A person answered "run it again" (at `decided_at`) to a call whose
    /// outcome is unknown (`waitingFor: outcome`).
    RunAgain {
        token: ContinuationToken,
        by: String,
        decided_at: Millis,
    },
    Decide {
        token: ContinuationToken,
        approved: bool,
        by: String,
        reason: Option<String>,
        /// Edited arguments (a JSON object's text), where the policy
        /// allows edits.
        arguments: Option<String>,
    },
    /// A person answered the session's question about a limit
    /// (`onExceed: ask`): approved with `raise`, or denied.
    BudgetDecided {
        token: ContinuationToken,
        approved: bool,
        by: String,
        reason: Option<String>,
        raise: Raise,
    },
    /// A timer from `poll_timeout` fired (or any periodic check).
    Tick,
    Pause,
    Resume,
    /// The user asked to retry a failed session.
    Retry,
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
    #[error("continuation {token} waits for an approval; approve or deny it before a result can be recorded")]
    AwaitsApproval { token: ContinuationToken },
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
    /// This step started a model call under namespace Budgets: the next
    /// waits for a new step, after the driver has counted this one's
    /// usage and sees the Budgets as they are now.
    budget_turn_taken: bool,
}

impl Session {
    pub fn new(id: SessionId, config: SessionConfig) -> Self {
        Session {
            state: SessionState::new(id),
            config,
            actions: VecDeque::new(),
            budget_turn_taken: false,
        }
    }

    /// Rebuilds a session from stored state and re-derives what it still
    /// has to do (at-least-once for steps that were under way).
    pub fn restore(state: SessionState, config: SessionConfig, now: Millis) -> Self {
        let mut s = Session::restore_quiet(state, config);
        s.replan(now);
        s
    }

    /// Rebuilds a session without planning any work: a driver first feeds
    /// it what the outside wrote, then calls [`Session::replan`].
    pub fn restore_quiet(state: SessionState, config: SessionConfig) -> Self {
        Session {
            state,
            config,
            actions: VecDeque::new(),
            budget_turn_taken: false,
        }
    }

    pub fn state(&self) -> &SessionState {
        &self.state
    }

    /// A driver's step ended well: failures in a row count from zero again.
    pub fn step_succeeded(&mut self) {
        self.state.failed_steps = 0;
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

    /// When the core next needs a `Tick`: retries, timeouts, the deadline,
    /// and claims of other drivers that expire.
    pub fn poll_timeout(&self) -> Option<Millis> {
        if self.state.phase.is_final() {
            return None;
        }
        let mut times: Vec<Millis> = Vec::new();
        times.extend(self.config.limits.deadline);
        let paused = self.state.paused;
        if !paused && self.state.phase == Phase::AwaitingModel && self.config.driver.model {
            times.extend(wake_time(&self.state.model_attempt));
        }
        for c in self.state.open.iter().flat_map(|o| o.calls.iter()) {
            times.extend(c.deadline());
            if !paused && self.config.driver.runs(c) {
                times.extend(c.attempt().and_then(wake_time));
            }
        }
        times.into_iter().min()
    }

    /// What the session waits for once the action queue is empty: the
    /// driver's outcome, decided here and nowhere else.
    pub fn outlook(&self, now: Millis) -> Outlook {
        if let Some(settled) = self.settled_outlook() {
            return settled;
        }
        let Timers {
            own,
            mut deadlines,
            in_flight_here,
        } = self.timers(now);
        let pending = self.waited_on();
        if let Some(at) = own.iter().min().copied() {
            if !in_flight_here {
                // A deadline before our own work is looked at on time.
                let at = deadlines.iter().copied().fold(at, Millis::min);
                return Outlook::Busy { at };
            }
            deadlines.push(at);
        }
        Outlook::Waiting {
            pending,
            wake_at: deadlines.into_iter().min(),
        }
    }

    /// The outlook that needs no timers: finished, paused or idle.
    fn settled_outlook(&self) -> Option<Outlook> {
        match self.state.phase {
            Phase::Succeeded => Some(Outlook::Succeeded {
                answer: self.state.answer.clone().unwrap_or_default(),
            }),
            Phase::Failed => Some(Outlook::Failed {
                reason: self.state.failure.clone().unwrap_or_default(),
            }),
            _ if self.state.paused || self.state.budget_stop.is_some() => Some(Outlook::Paused),
            // Woken by the Budget's change or the end of its period.
            Phase::AwaitingModel if self.state.budget_exhausted.is_some() => Some(Outlook::Paused),
            Phase::Idle => Some(Outlook::Idle),
            _ => None,
        }
    }

    /// This driver's own due work and the times to look again, over the
    /// model and every open call.
    fn timers(&self, now: Millis) -> Timers {
        let mut timers = Timers::default();
        if self.state.phase == Phase::AwaitingModel && self.config.driver.model {
            let model = &self.state.model_attempt;
            timers.own.extend(model.retry_at());
            if self.budget_turn_taken && model.claim().is_none() {
                // The next turn, in the next step, after the count.
                timers.own.push(now);
            }
            timers.own.extend(
                model
                    .claim()
                    .filter(|c| self.blocked(c, now))
                    .map(|c| c.until),
            );
        }
        timers.deadlines.extend(self.config.limits.deadline);
        for c in self.state.open.iter().flat_map(|o| o.calls.iter()) {
            self.add_call_timers(c, now, &mut timers);
        }
        timers
    }

    /// Adds one open call's deadline, and, where this driver runs it, its
    /// poll, retry or claim.
    fn add_call_timers(&self, c: &TrackedToolCall, now: Millis, timers: &mut Timers) {
        timers.deadlines.extend(c.deadline());
        if let Some(task) = c.task().filter(|_| self.config.driver.runs(c)) {
            // Our poll: due work while the task works; while it asks
            // for input, a look now and then beside the person's answer.
            if c.waiting_for() == Some(WaitingFor::McpTask) {
                match c.task_asks() {
                    None => timers.own.push(next_poll(task, now)),
                    Some(_) => timers.deadlines.push(next_poll(task, now)),
                }
            }
            return;
        }
        if self.config.driver.runs(c) {
            timers.own.extend(c.retry_at());
            match c.claim() {
                Some(claim) if self.blocked(claim, now) => timers.own.push(claim.until),
                // Ours and under way elsewhere in this process (a
                // background task, a Job): its end wakes us; the claim's
                // expiry is the fallback.
                Some(claim) => {
                    timers.in_flight_here = true;
                    timers.deadlines.push(claim.until);
                }
                None => {}
            }
        }
    }

    /// The tokens the session waits on from outside or from work under way.
    fn waited_on(&self) -> Vec<ContinuationToken> {
        self.state
            .pending()
            .into_iter()
            .filter(|c| {
                !self.config.driver.runs(c) || c.claim().is_some() || c.task_asks().is_some()
            })
            .filter_map(|c| c.token().cloned())
            .chain(self.state.budget_ask.iter().map(|a| a.token.clone()))
            .collect()
    }

    pub fn handle(&mut self, event: Event, now: Millis) -> Result<Handled, CoreError> {
        if comes_from_outside(&event) && self.state.phase.is_final() {
            // A finished session takes no results or decisions: they stay
            // in their continuations, and a retry takes them then.
            return Ok(Handled::Wake(WakeOutcome::Unknown));
        }
        match event {
            Event::UserMessage { text } => self.on_user_message(text, now).map(|_| Handled::Done),
            Event::ModelReplied { turn } => {
                // Under namespace Budgets, one turn a step: the driver
                // counts it before the next one is checked.
                self.budget_turn_taken = !self.config.shared_budgets.is_empty();
                self.on_model_reply(turn, now).map(|_| Handled::Done)
            }
            Event::ModelFailed {
                error,
                retryable,
                retry_after_ms,
            } => {
                self.on_model_failed(error, retryable, retry_after_ms, now);
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
            Event::TaskCreated {
                call,
                attempt,
                task,
            } => self
                .on_task_created(call, attempt, task, now)
                .map(|_| Handled::Done),
            Event::TaskAsks { token, asks } => {
                self.on_task_asks(&token, asks);
                Ok(Handled::Done)
            }
            Event::TaskEnded { token, result } => {
                self.on_task_ended(&token, result, now).map(Handled::Wake)
            }
            Event::Wake { token, result, by } => {
                self.on_wake(&token, result, &by, now).map(Handled::Wake)
            }
            Event::RunAgain {
                token, decided_at, ..
            } => self
                .on_run_again(&token, decided_at, now)
                .map(Handled::Wake),
            Event::Decide {
                token,
                approved,
                by,
                reason,
                arguments,
            } => self
                .on_decide(&token, (approved, by, reason, arguments), now)
                .map(Handled::Wake),
            Event::BudgetDecided {
                token,
                approved,
                by,
                reason,
                raise,
            } => Ok(Handled::Wake(self.on_budget_decided(
                &token,
                (approved, by, reason),
                raise,
                now,
            ))),
            Event::Tick => {
                self.on_tick(now);
                Ok(Handled::Done)
            }
            Event::Pause => {
                self.on_pause();
                Ok(Handled::Done)
            }
            Event::Resume => {
                self.on_resume(now);
                Ok(Handled::Done)
            }
            Event::Retry => self.on_retry(now).map(|_| Handled::Done),
            Event::ChildAnswered { answer, usage } => self.take_child_answer(*answer, usage, now),
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

    /// True when `action` still matches the state: a queued start whose
    /// call was answered meanwhile (from the cache, from outside) is stale.
    pub fn is_current(&self, action: &Action) -> bool {
        let deferred_attempt = |token: &ContinuationToken, attempt: u32| {
            self.state.find_call(token).is_some_and(|c| {
                c.state() == CallState::Deferred && c.attempts == attempt && c.retry_at().is_none()
            })
        };
        match action {
            Action::CallModel { .. } => {
                self.state.phase == Phase::AwaitingModel && !self.state.paused
            }
            Action::RunTool { call, .. } => self
                .state
                .open
                .iter()
                .flat_map(|o| o.calls.iter())
                .any(|c| {
                    c.id == *call && c.state() == CallState::Running && c.retry_at().is_none()
                }),
            Action::RunInBackground {
                envelope, attempt, ..
            } => deferred_attempt(&envelope.token, *attempt),
            Action::LaunchIsolated {
                envelope, attempt, ..
            }
            | Action::StartSubAgent {
                envelope, attempt, ..
            }
            | Action::Collect {
                envelope, attempt, ..
            } => deferred_attempt(&envelope.token, *attempt),
            Action::PollTask { envelope, task, .. } => {
                self.state.find_call(&envelope.token).is_some_and(|c| {
                    c.waiting_for() == Some(WaitingFor::McpTask) && c.task() == Some(task)
                })
            }
            _ => true,
        }
    }

    // ---- events -------------------------------------------------------

    fn on_user_message(&mut self, text: String, now: Millis) -> Result<(), CoreError> {
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

    fn on_model_reply(&mut self, mut turn: AgentTurn, now: Millis) -> Result<(), CoreError> {
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

    fn on_model_failed(
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
    fn on_retry(&mut self, now: Millis) -> Result<(), CoreError> {
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

    fn on_tool_finished(
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
    fn cache_scope(&self) -> (CacheScope, usize) {
        (
            CacheScope {
                namespace: self.config.scope.namespace.clone(),
                fingerprints: self.config.tool_fingerprints.clone(),
            },
            self.config.max_result_bytes,
        )
    }

    fn on_attempt_finished(
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

    fn on_wake(
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

    fn on_decide(
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
            .and_then(|args| super::acceptance::edit_refusal(&call.policy, args));
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
            let result = super::acceptance::denial(&by, reason.as_deref());
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
    fn on_pause(&mut self) {
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

    fn on_resume(&mut self, now: Millis) {
        if self.state.paused {
            self.state.paused = false;
            self.replan(now);
        }
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
    fn approvals_timed_out(&mut self, now: Millis) -> Option<String> {
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
                    let result = super::acceptance::denial(ENGINE_BY, Some(&why));
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

    // ---- the scheduler ------------------------------------------------

    /// Moves every ready call on according to its policy.
    fn dispatch(&mut self, now: Millis) {
        let budget = &self.budget();
        let mut spend = Spend {
            usage: self.state.usage,
            tool_calls: self.state.tool_calls,
        };
        let (mut stop, mut counted) = (None, false);
        let ready = self
            .state
            .open
            .iter_mut()
            .flat_map(|o| o.calls.iter_mut())
            .filter(|c| c.state() == CallState::Ready);
        for call in ready {
            let token = ContinuationToken::for_call(&self.state.id, call.id);
            let needs_approval = call.policy.decorators.approval && call.approval().is_none();
            let timeout = match &call.policy.decorators.approval_policy {
                Some(p) if needs_approval && p.timeout_seconds.is_some() => p.timeout_seconds,
                _ => call.policy.decorators.timeout_seconds,
            };
            let deadline = timeout.map(|s| now.plus_secs(s).ceil_to_second());
            let waiting = if needs_approval {
                Some(WaitingFor::Approval)
            } else {
                match call.policy.disposition {
                    Disposition::RunSync => None,
                    Disposition::RunAsync => Some(WaitingFor::Background),
                    Disposition::RunIsolated { .. } => Some(WaitingFor::Isolated),
                    Disposition::Defer { .. } => Some(WaitingFor::External),
                    Disposition::SubAgent { .. } => Some(WaitingFor::SubAgent),
                }
            };
            // A run (not an approval wait) spends a tool call: it starts
            // only within the budget; the calls after it stay ready.
            if waiting != Some(WaitingFor::Approval) {
                stop = budget.stops(&spend, Work::ToolRun);
                if stop.is_some() {
                    break;
                }
                spend.tool_calls += 1;
                counted = true;
            }
            match waiting {
                None => call.start().expect("ready calls may start"),
                Some(w) => {
                    call.defer(token, w, deadline)
                        .expect("ready calls may defer");
                    call.mark_started(now);
                }
            }
        }
        self.state.tool_calls = spend.tool_calls;
        self.budget_checked(stop, counted);
        self.start_due(now, true);
    }

    /// Emits the actions that start (or continue) the work the state
    /// implies and this driver may do: continuations for deferred calls,
    /// tool runs, background and isolated attempts. A start first takes a
    /// claim, written by the `Checkpoint` queued before it. `ensure`
    /// re-issues `EnsureContinuation` for every open deferred call (after a
    /// restart or a new turn); a tick only starts work that came due.
    fn start_due(&mut self, now: Millis, ensure: bool) {
        if self.state.paused || self.state.phase.is_final() {
            return;
        }
        // A lost attempt of a tool that is not idempotent is never
        // started again on its own: its rule is applied first.
        self.settle_unknown_outcomes(now);
        if self.state.paused || self.state.phase.is_final() {
            return;
        }
        // Per call, in call order: its continuation, then its start.
        let (mut planned, mut starts) = self.plan_calls(now, ensure);
        if let Some(call_model) = self.plan_model(now, ensure) {
            starts = true;
            planned.push(call_model);
        }
        // The claims are committed before any start is performed.
        if starts && self.actions.back() != Some(&Action::Checkpoint) {
            self.push(Action::Checkpoint);
        }
        for mut a in planned {
            self.bound_child(&mut a);
            self.push(a);
        }
    }

    /// The open calls' continuations (when `ensure`) and the starts this
    /// driver may make, with their claims taken; and whether any starts.
    fn plan_calls(&mut self, now: Millis, ensure: bool) -> (Vec<Action>, bool) {
        let (mut planned, mut starts) = (Vec::new(), false);
        let id = &self.state.id;
        let config = &self.config;
        let Some(open) = self.state.open.as_mut() else {
            return (planned, starts);
        };
        let mut children = subagent::running_children(&open.calls);
        for call in open.calls.iter_mut() {
            if call.state() == CallState::Deferred && ensure && call.has_continuation() {
                planned.extend(ensure_action(id, config, call));
            }
            let secs = call
                .policy
                .decorators
                .timeout_seconds
                .unwrap_or(config.default_tool_timeout_secs);
            // Past `maxChildren` a new child waits its turn (unclaimed).
            let new_child = subagent::is_new_child(call);
            let turn_waits = new_child && children >= config.lineage.max_children;
            let may_run = config.driver.runs(call) && !turn_waits;
            let Some(attempt) = call.attempt_mut().filter(|_| may_run) else {
                continue;
            };
            let Some(taken) = take_attempt(attempt, &config.driver, secs, ensure, now) else {
                continue;
            };
            if taken.retry {
                call.attempts += 1;
            }
            call.mark_started(now);
            if new_child {
                children += 1;
            }
            let run = run_action(id, config, call);
            starts |= !run.is_empty();
            planned.extend(run);
        }
        planned.extend(self.task_polls());
        (planned, starts)
    }

    /// A poll of every MCP task this driver watches.
    fn task_polls(&self) -> Vec<Action> {
        self.state
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| self.config.driver.runs(c))
            .filter_map(|c| task::poll_action(self, c))
            .collect()
    }

    /// True when the next action records a wait (the checkpoint before a
    /// `Yield`).
    pub fn yields_next(&self) -> bool {
        matches!(self.actions.front(), Some(Action::Yield { .. }))
    }

    /// While paused: a `Collect` for every attempt this driver runs that may
    /// be under way (none retries; nothing new starts).
    fn plan_collects(&mut self) {
        for a in self.collects().into_iter().chain(self.task_polls()) {
            self.push(a);
        }
    }

    /// A `Collect` for every attempt this driver runs that may be under
    /// way: no claim is taken or renewed, nothing new starts.
    pub fn collects(&self) -> Vec<Action> {
        self.state
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| {
                c.state() == CallState::Deferred
                    && c.retry_at().is_none()
                    && self.config.driver.runs(c)
            })
            .flat_map(|c| run_action(&self.state.id, &self.config, c))
            .filter_map(|a| match a {
                Action::RunInBackground {
                    envelope, attempt, ..
                } => Some(Action::Collect {
                    envelope,
                    isolated: None,
                    child: None,
                    attempt,
                }),
                Action::StartSubAgent {
                    envelope,
                    child,
                    attempt,
                } => Some(Action::Collect {
                    envelope,
                    isolated: None,
                    child: Some(child),
                    attempt,
                }),
                Action::LaunchIsolated {
                    envelope,
                    spec,
                    attempt,
                } => Some(Action::Collect {
                    envelope,
                    isolated: Some(spec),
                    child: None,
                    attempt,
                }),
                _ => None,
            })
            .collect()
    }

    /// The model call this driver may start now, with its claim taken.
    fn plan_model(&mut self, now: Millis, ensure: bool) -> Option<Action> {
        let role = &self.config.driver;
        if self.state.phase != Phase::AwaitingModel || !role.model {
            return None;
        }
        // A call already queued is under way: never two.
        let queued = self
            .actions
            .iter()
            .any(|a| matches!(a, Action::CallModel { .. }));
        if queued {
            return None;
        }
        if self.budget_turn_taken || !self.shared_budgets_checked() {
            return None;
        }
        let stop = self.budget().stops(&self.spend(), Work::ModelCall);
        if !self.budget_checked(stop, true) {
            return None;
        }
        let secs = self.config.model_timeout_secs;
        let role = &self.config.driver;
        take_attempt(&mut self.state.model_attempt, role, secs, ensure, now)?;
        Some(Action::CallModel {
            turn: self.state.agent_turns + 1,
        })
    }

    /// Re-derives the actions the stored state implies (after a restart, a
    /// resume, or outside results were fed in). Result and cache writes
    /// already queued stay; every other action is planned again. Every
    /// action is idempotent for the driver.
    pub fn replan(&mut self, now: Millis) {
        self.actions.retain(|a| {
            matches!(
                a,
                Action::RecordResult { .. } | Action::StoreCache { .. } | Action::CancelTask { .. }
            )
        });
        if self.state.phase.is_final() {
            return;
        }
        if self.state.paused {
            self.plan_collects();
            return;
        }
        self.ensure_budget_question();
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
        let Some(open) = self.state.open.as_mut() else {
            return;
        };
        // Every path that ends a call settles at the same `now`.
        for call in open.calls.iter_mut() {
            call.mark_finished(now);
        }
        if open.calls.iter().all(|c| c.state().is_final()) {
            let open = self.state.open.take().expect("checked");
            let tool_results = open.calls.into_iter().map(result_entry).collect();
            self.state.turns.push(Turn::User(UserTurn {
                message: None,
                tool_results,
            }));
            self.flush_inbox();
            if self.state.phase.is_final() {
                return;
            }
            self.push(Action::Checkpoint);
            self.await_model(now);
            return;
        }
        // Phase follows the call states alone (a status reader derives it
        // the same way); what this driver still runs is the outlook's.
        let busy = open
            .calls
            .iter()
            .any(|c| matches!(c.state(), CallState::Ready | CallState::Running));
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

    fn blocked(&self, claim: &Claim, now: Millis) -> bool {
        claim.blocks(
            &self.config.driver.holder,
            &self.config.driver.dead_holders,
            now,
        )
    }

    fn push_yield(&mut self) {
        let pending = self
            .state
            .pending()
            .into_iter()
            .filter_map(|c| c.token().cloned())
            .collect();
        self.push(Action::Checkpoint);
        self.push(Action::Yield { pending });
    }

    fn await_model(&mut self, now: Millis) {
        if let Some(max) = self.config.limits.max_turns {
            if self.state.agent_turns >= max {
                self.fail(format!(
                    "the session reached its limit of {max} model turns; raise spec.limits.maxTurns to go on"
                ));
                return;
            }
        }
        self.state.phase = Phase::AwaitingModel;
        self.start_due(now, false);
    }

    fn fail(&mut self, reason: String) {
        self.state.fail(reason.clone());
        self.push(Action::Checkpoint);
        self.push(Action::Failed { reason });
    }

    /// Messages that arrived while the session was busy, each as its own
    /// user turn, in order.
    fn flush_inbox(&mut self) {
        for message in std::mem::take(&mut self.state.inbox) {
            self.state.turns.push(Turn::User(UserTurn {
                message: Some(message),
                tool_results: Vec::new(),
            }));
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

    /// Queues a result write ahead of every queued checkpoint: a stored
    /// state never holds a result that its continuation lacks.
    fn push_result(&mut self, action: Action) {
        match self
            .actions
            .iter()
            .position(|a| matches!(a, Action::Checkpoint))
        {
            Some(i) => self.actions.insert(i, action),
            None => self.actions.push_back(action),
        }
    }
}

/// What the session waits for when the queue is empty (see [`Session::outlook`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Outlook {
    Succeeded {
        answer: String,
    },
    Failed {
        reason: String,
    },
    Paused,
    /// No user message yet.
    Idle,
    /// This driver has work due at `at` (a retry, a backoff, a claim of
    /// another driver that expires): sleep, then `Tick`.
    Busy {
        at: Millis,
    },
    /// Only the outside (or work under way elsewhere) moves the session;
    /// `wake_at` is the earliest deadline to check.
    Waiting {
        pending: Vec<ContinuationToken>,
        wake_at: Option<Millis>,
    },
}

/// What [`Session::outlook`] gathers from the model and the open calls.
#[derive(Default)]
struct Timers {
    /// Work this driver will do itself later: a retry or backoff, or work
    /// another driver holds that falls to us when its claim expires.
    own: Vec<Millis>,
    /// Times to look again while only others move the session.
    deadlines: Vec<Millis>,
    /// Some work of ours is under way in this process; its end wakes us.
    in_flight_here: bool,
}

/// Results and decisions from outside the core, which a finished session
/// no longer takes.
fn comes_from_outside(event: &Event) -> bool {
    matches!(
        event,
        Event::AttemptFinished { .. }
            | Event::Wake { .. }
            | Event::Decide { .. }
            | Event::BudgetDecided { .. }
            | Event::RunAgain { .. }
            | Event::TaskAsks { .. }
            | Event::TaskEnded { .. }
    )
}

/// The continuation a deferred call needs.
fn ensure_action(
    session: &SessionId,
    config: &SessionConfig,
    call: &TrackedToolCall,
) -> Option<Action> {
    let (Some(token), Some(waiting_for)) = (call.token().cloned(), call.waiting_for()) else {
        return None;
    };
    let reason = match (&call.policy.disposition, waiting_for) {
        (_, WaitingFor::Approval) => Some("waiting for approval".to_string()),
        (_, WaitingFor::McpTask) => call
            .task()
            .map(|t| format!("waiting for MCP task {}", t.id)),
        (_, WaitingFor::Outcome) => outcome::reason(call, config.default_tool_timeout_secs),
        (Disposition::Defer { reason }, _) => Some(reason.clone()),
        _ => None,
    };
    let context = ContextSnapshot::for_call(session, &config.scope, call, config.agent.as_deref());
    Some(Action::EnsureContinuation(ContinuationSpec {
        token,
        session: session.clone(),
        call_id: call.id,
        tool_call: call.call.clone(),
        policy: call.policy.clone(),
        waiting_for,
        reason,
        context,
        cache_key: cache_key_for(config, call),
        expires_at: call.deadline(),
    }))
}

fn cache_key_for(config: &SessionConfig, call: &TrackedToolCall) -> Option<CacheKey> {
    let scope = CacheScope {
        namespace: config.scope.namespace.clone(),
        fingerprints: config.tool_fingerprints.clone(),
    };
    call.policy
        .decorators
        .cache
        .then(|| cache_key(&call.call, config.context_has_secrets, &scope))
        .flatten()
}

/// The envelope a deferred call is run (or its MCP task asked about)
/// under; `None` before it has a token.
fn call_envelope(
    session: &SessionId,
    config: &SessionConfig,
    call: &TrackedToolCall,
) -> Option<CallEnvelope> {
    let token = call.token()?.clone();
    let mut context =
        ContextSnapshot::for_call(session, &config.scope, call, config.agent.as_deref());
    context.call_stack = subagent::call_stack(config, session);
    Some(CallEnvelope::new(
        token,
        call.effective_call(),
        context,
        call.policy.clone(),
    ))
}

/// The action that starts `call`'s current attempt.
fn run_action(session: &SessionId, config: &SessionConfig, call: &TrackedToolCall) -> Vec<Action> {
    let cache = cache_key_for(config, call);
    match call.stage() {
        CallStage::Running(_) => vec![Action::RunTool {
            call: call.id,
            tool_call: call.effective_call(),
            idempotency_key: ContextSnapshot::for_call(
                session,
                &config.scope,
                call,
                config.agent.as_deref(),
            )
            .idempotency_key,
            timeout_seconds: Some(
                call.policy
                    .decorators
                    .timeout_seconds
                    .unwrap_or(config.default_tool_timeout_secs),
            ),
            cache_key: cache,
            attempt: call.attempts,
        }],
        CallStage::Deferred { wait, .. } => {
            let Some(envelope) = call_envelope(session, config, call) else {
                return Vec::new();
            };
            match (wait, &call.policy.disposition) {
                (Wait::Background(_), _) => vec![Action::RunInBackground {
                    envelope,
                    attempt: call.attempts,
                    cache_key: cache,
                }],
                (Wait::SubAgent(_), Disposition::SubAgent { agent }) => {
                    vec![Action::StartSubAgent {
                        child: subagent::plan(session, config, call, agent),
                        envelope,
                        attempt: call.attempts,
                    }]
                }
                (Wait::Isolated(_), Disposition::RunIsolated { spec }) => {
                    vec![Action::LaunchIsolated {
                        envelope,
                        spec: spec.clone(),
                        attempt: call.attempts,
                    }]
                }
                _ => Vec::new(),
            }
        }
        _ => Vec::new(),
    }
}

/// Ends a deferred call whose wait passed its deadline, and returns the
/// result write for its continuation. Only a wait has a deadline: a
/// running tool is stopped by its own timeout.
fn time_out(call: &mut TrackedToolCall, now: Millis) -> Option<Action> {
    let CallStage::Deferred {
        wait,
        deadline: Some(deadline),
    } = call.stage()
    else {
        return None;
    };
    if now < *deadline {
        return None;
    }
    // A run of ours that outlived its time failed; a wait on a person or
    // an outside party completes, and the model is told.
    let (what, to) = match wait {
        Wait::Approval => ("an approval", CallState::Completed),
        Wait::External => ("an outside result", CallState::Completed),
        Wait::Background(_) | Wait::Isolated(_) => ("the tool", CallState::Failed),
        // The model is told; the driver stops the child when the result
        // is recorded.
        Wait::SubAgent(_) => ("the sub-agent", CallState::Completed),
        Wait::McpTask { .. } => ("its MCP task", CallState::Completed),
        // Never given a deadline: the person decides in their own time.
        Wait::Outcome { .. } => ("a person", CallState::Completed),
    };
    let secs = call.policy.decorators.timeout_seconds.unwrap_or(0);
    let result = ToolResult::error(format!("timed out after {secs}s waiting for {what}"));
    call.finish(to, result.clone(), "agents").ok()?;
    if !call.has_continuation() {
        return None;
    }
    Some(Action::RecordResult {
        token: call.token()?.clone(),
        result,
        by: "agents".into(),
    })
}

/// The most bytes a call's result may keep: its `truncate` decorator
/// within the agent's limit.
fn result_limit(call: &TrackedToolCall, agent_limit: usize) -> usize {
    call.policy
        .decorators
        .truncate_bytes
        .map_or(agent_limit, |t| t.min(agent_limit))
}

/// An approver's edit is allowed by the call's policy and is a JSON object.
/// The result the model hears for a call an approver edited: what ran, then
/// what came back.
fn with_edit_note(result: ToolResult, approval: Option<&Approval>) -> ToolResult {
    let Some((by, args)) = approval.and_then(|a| a.arguments.as_ref().map(|x| (&a.by, x))) else {
        return result;
    };
    let note = format!("{by} edited the arguments before the call ran; it ran with {args}");
    match result {
        ToolResult::Success { response } => ToolResult::ok(ToolResponse::Mixed {
            parts: vec![ToolResponse::text(note), response],
        }),
        ToolResult::Error { message } => ToolResult::error(format!("{note}\n{message}")),
    }
}

/// What taking an attempt did: `retry` when a failed attempt comes round.
struct Taken {
    retry: bool,
}

/// The claim rule, written once for tool calls and the model call. Work
/// that is due starts unless someone alive holds it; a tick restarts only
/// work nobody holds, while a restore or a new dispatch (`ensure`)
/// re-issues our own starts too (runners adopt what is under way). A start
/// takes a claim for `secs`, except that our own live claim stands as it
/// is, so re-issuing work under way writes nothing.
fn take_attempt(
    attempt: &mut Attempt,
    role: &DriverRole,
    secs: u64,
    ensure: bool,
    now: Millis,
) -> Option<Taken> {
    let claim = match attempt {
        Attempt::RetryAt(at) if now < *at => return None,
        Attempt::RetryAt(_) | Attempt::Unclaimed => None,
        Attempt::Claimed(c) => Some(&*c),
    };
    let ours = claim.is_some_and(|c| c.holder == role.holder);
    let blocked = claim.is_some_and(|c| c.blocks(&role.holder, &role.dead_holders, now));
    if blocked || (!ensure && ours) {
        return None;
    }
    let live_own = ours && claim.is_some_and(|c| c.until > now);
    let retry = matches!(attempt, Attempt::RetryAt(_));
    if !live_own {
        *attempt = Attempt::Claimed(new_claim(&role.holder, secs, now));
    }
    Some(Taken { retry })
}

/// When a driver must look at an attempt again: its retry, or the expiry
/// of its claim.
fn wake_time(attempt: &Attempt) -> Option<Millis> {
    attempt
        .retry_at()
        .or_else(|| attempt.claim().map(|c| c.until))
}

/// When the attempt that failed as attempt number `attempts` is retried.
fn retry_time(attempts: u32, now: Millis) -> Millis {
    now.plus_millis(retry_backoff_millis(attempts))
        .ceil_to_second()
}

/// A closed call as the user turn records it.
fn result_entry(c: TrackedToolCall) -> ToolResultEntry {
    let note_on = c.approval().cloned();
    let token = c.token().cloned();
    let truncate_bytes = c.policy.decorators.truncate_bytes;
    let (call_id, call) = (c.id, c.call.clone());
    let (started_at, finished_at) = (c.started_at, c.finished_at);
    let outcome = c.into_outcome().expect("final calls hold a result");
    ToolResultEntry {
        call_id,
        model_call_id: call.model_call_id,
        tool: call.name,
        token,
        result: with_edit_note(outcome.result, note_on.as_ref()),
        truncate_bytes,
        started_at,
        finished_at,
    }
}

/// A claim by `holder` for work that may take `secs`, with a grace. Kept
/// to the millisecond (the state stores milliseconds): the attempt's start
/// is then known exactly from it, which tells a person's "run again" to
/// this lost attempt from one given to an earlier loss.
fn new_claim(holder: &str, secs: u64, now: Millis) -> Claim {
    Claim {
        holder: holder.to_string(),
        until: now.plus_secs(secs).plus_millis(CLAIM_GRACE_MILLIS as u64),
    }
}

/// Most bytes of an error message a result keeps. Errors are never
/// spilled, so a tool (or a completer) that answers with a huge error must
/// not grow the session past its budget.
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// Applies the `truncate` decorator; error messages are cut to
/// [`MAX_ERROR_BYTES`] whatever it says.
pub fn truncate(result: ToolResult, max: Option<usize>) -> ToolResult {
    match result {
        ToolResult::Success { response } if max.is_some_and(|m| response.size() > m) => {
            let text = response.to_model_text();
            ToolResult::ok(ToolResponse::text(cut_to(&text, max.unwrap_or(usize::MAX))))
        }
        ToolResult::Error { message } if message.len() > MAX_ERROR_BYTES => {
            ToolResult::error(cut_to(&message, MAX_ERROR_BYTES))
        }
        other => other,
    }
}

/// `text` cut to at most `max` bytes (on a character boundary), saying so.
fn cut_to(text: &str, max: usize) -> String {
    let mut cut = max.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}\n[truncated: showing {} of {} bytes]",
        &text[..cut],
        cut,
        text.len()
    )
}
