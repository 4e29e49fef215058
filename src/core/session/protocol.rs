//! What goes in and out of the state machine: the actions a driver
//! performs, the events it feeds back, and the errors it may get.

use super::{subagent, Phase};
use crate::core::budget::Raise;
use crate::core::cache::CacheKey;
use crate::core::call::{CallState, TaskHandle, TransitionError, WaitingFor};
use crate::core::conversation::{AgentTurn, TokenUsage, ToolCall, ToolResult};
use crate::core::envelope::{CallEnvelope, ContextSnapshot};
use crate::core::ids::{CallId, ContinuationToken, SessionId};
use crate::core::policy::{AppliedPolicy, IsolationSpec};
use crate::core::time::Millis;
use serde::{Deserialize, Serialize};

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
