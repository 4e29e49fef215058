//! The session's configuration and its durable state: what a driver
//! brings to a step, and what the store keeps between steps.

use super::OnUnknownOutcome;
use super::{
    subagent, BudgetAsk, DEFAULT_TOOL_TIMEOUT_SECS, MAX_RESULT_BYTES, MODEL_RETRIES,
    MODEL_TIMEOUT_SECS,
};
use crate::core::budget::{Budget, BudgetStop, Pricing, Raise};
use crate::core::call::{flat, Attempt, CallStage, CallState, TrackedToolCall, Wait};
use crate::core::conversation::{TokenUsage, Turn};
use crate::core::ids::{ContinuationToken, SessionId};
use crate::core::policy::{IsolationSpec, Policy};
use crate::core::time::Millis;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

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
    pub shared_budgets: Vec<crate::core::shared_budget::SharedBudget>,
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
    #[serde(default, skip_serializing_if = "is_false")]
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
    #[serde(default, skip_serializing_if = "is_zero")]
    pub model_attempts: u32,
    /// The model call's current attempt: the driver whose call is under
    /// way, or when a failed call is retried (stored as `modelRetryAt` and
    /// `modelClaim`).
    #[serde(flatten, with = "flat::model_attempt")]
    #[schemars(with = "flat::model_attempt::Fields")]
    pub model_attempt: Attempt,
    /// How many user messages the session has taken in (from `spec.messages`),
    /// so a driver re-reading them never sends one twice.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub messages_taken: u32,
    /// How many user retries of a failed session were taken (`spec.retry`).
    #[serde(default, skip_serializing_if = "is_zero")]
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
    pub forked_from: Option<crate::core::fork::ForkedFrom>,
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
    pub budget_exhausted: Option<crate::core::shared_budget::BudgetExhausted>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
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
