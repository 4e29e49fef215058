//! The `Session` resource: one agent conversation, run durably.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::agent::{AgentSpec, ApprovalPolicySpec, ContainerTool, DispositionMode};
use super::conditions_schema;
use super::stored::stored_state_schema;
use crate::core::TokenUsage;
use std::collections::BTreeMap;

/// The label a forked session carries: the name of the one it forked from.
pub const FORK_LABEL: &str = "agents-exe.io/fork-from";

/// A label value holds at most 63 characters.
pub const SESSION_NAME_FITS: &str = "self.metadata.name.size() <= 63";

/// A conversation with an agent. The operator (or `agents run`) drives it:
/// it calls the model, runs or defers each tool call per the agent's
/// policy, yields while calls wait, and wakes when results arrive.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agents-exe.io",
    version = "v1alpha1",
    kind = "Session",
    doc = "A conversation with an agent, run durably: tool calls run now, in the background, isolated in Jobs, or wait for an outside party.",
    namespaced,
    status = "SessionStatus",
    shortname = "sess",
    category = "agents-exe",
    // Its name is a label value on its Continuations and Jobs.
    validation = Rule::new(SESSION_NAME_FITS).message("a Session's name is at most 63 characters (it labels the session's Continuations and Jobs); choose a shorter metadata.name"),
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"Where the session is"}"#,
    printcolumn = r#"{"name":"Turns","type":"integer","jsonPath":".status.agentTurns","description":"Model turns taken"}"#,
    printcolumn = r#"{"name":"Pending","type":"integer","jsonPath":".status.pendingCount","description":"Calls waiting on the outside"}"#,
    printcolumn = r#"{"name":"Tokens","type":"integer","jsonPath":".status.tokens","description":"Prompt and completion tokens spent (sub-agents included)"}"#,
    printcolumn = r#"{"name":"Token-Limit","type":"integer","jsonPath":".spec.limits.tokens","priority":1,"description":"spec.limits.tokens"}"#,
    printcolumn = r#"{"name":"Waiting-For","type":"string","jsonPath":".status.conditions[?(@.type==\"Waiting\")].reason","description":"What the session waits for"}"#,
    printcolumn = r#"{"name":"Parent","type":"string","jsonPath":".spec.parent.name","description":"The session whose sub-agent call made this one"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("has(self.agentRef) != has(self.agent)").message("set exactly one of spec.agentRef (an Agent's name) and spec.agent (an inline agent)"))]
#[x_kube(validation = Rule::new("!has(oldSelf.retry) || (has(self.retry) && self.retry >= oldSelf.retry)").message("spec.retry only goes up: set it to a higher number to retry a failed session"))]
#[serde(rename_all = "camelCase")]
pub struct SessionSpec {
    /// The Agent (in this namespace) that runs the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_ref: Option<AgentRef>,
    /// An inline agent, instead of `agentRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentSpec>,
    /// The user's messages, oldest first (at most 500, each at most 32768 characters).
    /// Append a message to continue the conversation; earlier messages
    /// cannot be removed or changed.
    // Bounded so the per-element CEL comparison stays cheap.
    #[x_kube(validation = Rule::new(MESSAGES_APPEND_ONLY).message("spec.messages is append-only: add new messages at the end; earlier messages cannot be removed or changed"))]
    #[schemars(length(max = 500), inner(length(max = 32768)))]
    pub messages: Vec<String>,
    /// Hold the session: no model call and no tool call starts while set.
    /// Results that arrive are still recorded.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// Bounds on the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsSpec>,
    /// Retry a session that Failed (e.g. its model was unreachable): set
    /// or raise this number and the operator retries once per increase
    /// (it compares it with `status.retriesTaken`). It can only go up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<u32>,
    /// Delete the session (and with it its Continuations) this many seconds
    /// after it Succeeded or Failed, as `ttlSecondsAfterFinished` does for
    /// Jobs. Unset: the operator's `--finished-session-ttl-seconds`, and by
    /// default finished sessions are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 31_536_000))]
    pub ttl_seconds_after_finished: Option<u64>,
    /// Set by the operator on a sub-agent's child: the session and call
    /// that made it. It never changes. The parent takes the answer only of
    /// a child it owns (its ownerReference), so a hand-written `parent`
    /// gives a session no parent's result to write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.parent never changes"))]
    pub parent: Option<ParentRef>,
    /// Start as a fork of another Session of this namespace: its
    /// conversation up to and including agent turn `turn`, with that turn's
    /// recorded results, which are history and never run again. Calls after
    /// the fork point run anew under this session's own idempotency keys.
    /// `spec.messages` holds only the messages after the fork point. The
    /// source is only read. It never changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.forkFrom never changes"))]
    pub fork_from: Option<ForkFrom>,
}

/// The session and turn a fork starts from.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ForkFrom {
    /// The source Session's name (same namespace).
    #[schemars(length(min = 1, max = 63))]
    pub session: String,
    /// The source's agent turn the fork starts after (1 is the first).
    #[schemars(range(min = 1))]
    pub turn: u32,
}

/// The session and call a child Session was made for.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ParentRef {
    /// The parent Session's name (same namespace).
    pub name: String,
    /// The parent Session's UID.
    pub uid: String,
    /// The parent's call that made this child (`t<turn>-c<index>`).
    pub call_id: String,
    /// This session's depth in its tree: the root is 0, its children 1.
    pub depth: u32,
    /// The sessions from the root down to the parent: the call stack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub stack: Vec<crate::core::session::subagent::StackEntry>,
    /// The parent's deadline (milliseconds since the Unix epoch): the
    /// child must end by then too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<i64>,
    /// The W3C `traceparent` of the parent's `execute_tool` span for this
    /// call (set when the operator exports traces): the child's steps are
    /// spans under it, in the parent's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub traceparent: Option<String>,
    /// What the parent had left of its limits when it made this child:
    /// this session's limits are at most these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::core::budget::BudgetLeft>,
}

impl SessionSpec {
    /// A session of Agent `name` with nothing else set: what a session
    /// that names the Agent would be checked against.
    pub fn referring_to(name: &str) -> SessionSpec {
        SessionSpec {
            agent_ref: Some(AgentRef { name: name.into() }),
            agent: None,
            messages: Vec::new(),
            paused: false,
            limits: None,
            retry: None,
            ttl_seconds_after_finished: None,
            parent: None,
            fork_from: None,
        }
    }
}

/// The CEL rule on `spec.messages`: the old list is a prefix of the new one.
pub const MESSAGES_APPEND_ONLY: &str =
    "size(self) >= size(oldSelf) && oldSelf.all(i, m, self[i] == m)";

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AgentRef {
    /// Name of an Agent in the session's namespace.
    pub name: String,
}

/// Bounds on a session. Spend limits (`tokens`, `cost`, `toolCalls`) are
/// checked before each model call and before each tool run: work that
/// would start past a limit does not start, and `onExceed` says what
/// happens instead.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LimitsSpec {
    /// Most model turns the session may take; it fails when it needs more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10_000))]
    pub max_turns: Option<u32>,
    /// The session fails if it has not finished this many seconds after it
    /// was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 31_536_000))]
    pub deadline_seconds: Option<u64>,
    /// Most tokens (prompt plus completion, summed over the session's
    /// model turns) the session may spend: no model call starts once they
    /// are spent. A turn in flight may pass the limit by its own usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000_000_000u64))]
    pub tokens: Option<u64>,
    /// Most the session may cost, in the currency of the agent's
    /// `spec.model.pricing` (which it needs), e.g. `2.5`: no model call
    /// starts once it is spent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1_000_000.0))]
    pub cost: Option<f64>,
    /// Most tool runs the session may start (a call's retries count once;
    /// a wait for approval is not a run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 1_000_000))]
    pub tool_calls: Option<u32>,
    /// What happens when work would start past `tokens`, `cost` or
    /// `toolCalls`: `fail` (the default) fails the session, saying which
    /// limit and the spend; `pause` holds it (condition `Paused`, reason
    /// `BudgetExceeded`) until the limit is raised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_exceed: Option<crate::core::budget::OnExceed>,
}

#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum SessionPhase {
    /// Not started: no message yet.
    #[default]
    Pending,
    /// The model is being asked.
    AwaitingModel,
    /// Tool calls are running.
    Running,
    /// Every open call waits on the outside; the session has yielded.
    Waiting,
    /// Held by `spec.paused`.
    Paused,
    /// The model gave its final answer.
    Succeeded,
    /// The session stopped on an error; see `status.failure`.
    Failed,
}

/// What the session has done so far: written by the operator (or `agents
/// run`). The session's state is `state`, as the core keeps it; the fields
/// beside it are what people, printer columns and `kubectl wait` read.
/// Nothing is stored twice: the core's answer, failure, usage and counters
/// live here rather than in `state`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SessionStatus {
    /// Where the session is.
    #[serde(default)]
    pub phase: SessionPhase,
    /// `Succeeded` (True when finished, False when failed, Unknown while
    /// running), `Waiting` (True while yielded; the reason says for what:
    /// AwaitingApproval, AwaitingExternal, AwaitingJob, AwaitingBackground),
    /// `Paused`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// While the session waits: what it waits for most (an approval
    /// first, then an outside party, an MCP task, a Job, a background run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingForName>,
    /// Deferred calls of the open turn.
    #[serde(default)]
    pub pending_count: u32,
    /// Model turns taken.
    #[serde(default)]
    pub agent_turns: u32,
    /// Token usage summed over the session.
    #[serde(default)]
    pub usage: TokenUsage,
    /// Prompt and completion tokens summed over the session, its ended
    /// sub-agents' included: what `spec.limits.tokens` is compared with.
    #[serde(default)]
    pub tokens: u64,
    /// The final answer, once the session succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Why the session failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The session this one was forked from (`spec.forkFrom`, or `agents
    /// session fork`): its name, its UID when the fork was made, and the
    /// turn. Set once, when the fork's history is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<crate::core::fork::ForkedFrom>,
    /// The `spec.retry` value last acted on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retries_taken: u32,
    /// The oldest turns, moved out of `state` to keep the status small
    /// (owned immutable ConfigMaps); `state.turns` continues after them.
    /// Readers (the operator, `agents session show`) put them back
    /// transparently.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4096))]
    pub archived_turns: Vec<ArchivedTurnsStatus>,
    /// W3C `traceparent` of the session's latest step span, set while the
    /// operator exports OpenTelemetry traces: every step of the session
    /// joins this trace and links to this span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The rest of the session's state, exactly as the core serialises it:
    /// the recent turns, the open turn's calls, the inbox, the model
    /// call's attempt. Large values are moved out like old turns. The API
    /// server stores it as given: the installed CRD leaves its fields
    /// untyped (the operator alone writes it, and reads it back strictly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "stored_state_schema")]
    pub state: Option<Value>,
    /// Fields written by earlier versions of the operator (`turns`,
    /// `openTurn`, ...): read once, and removed by the next status write.
    #[serde(flatten)]
    pub earlier: BTreeMap<String, Value>,
}

/// A chunk of old turns stored outside the status.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ArchivedTurnsStatus {
    /// Index of the chunk's first turn in the whole conversation.
    pub first_turn: u32,
    /// How many turns the chunk holds.
    pub turns: u32,
    /// The ConfigMaps holding the chunk (gzip JSON, in order).
    pub blobs: Vec<String>,
    /// SHA-256 of the chunk's JSON, checked when it is read back.
    pub sha256: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a call waits for: the core's own names.
pub type WaitingForName = crate::core::WaitingFor;

/// A tool call as the model issued it: the core's own form.
pub type ToolCallStatus = crate::core::ToolCall;

/// The policy decision recorded on a call.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AppliedPolicyStatus {
    /// How the call runs.
    pub disposition: DispositionMode,
    /// Why it waits (`defer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Where it runs (`runIsolated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<ContainerTool>,
    /// The Agent the child Session runs (`subAgent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Index of the matching rule; absent when the default applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<u32>,
    #[serde(flatten)]
    pub decorators: AppliedDecoratorsStatus,
}

/// The decorators a call ran under, the approval policy spelt out.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AppliedDecoratorsStatus {
    /// The call waits for an approving decision before it runs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approval: bool,
    /// Who may decide and how many must agree; absent with `approval`:
    /// one decision by anyone RBAC allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_policy: Option<ApprovalPolicySpec>,
    /// Give up after this many seconds (run time, or wait when deferred).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 31_536_000))]
    pub timeout_seconds: Option<u64>,
    /// Extra attempts after a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 20))]
    pub retries: Option<u32>,
    /// A result may be reused for the same tool and arguments.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache: bool,
    /// Results are capped at this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16_777_216))]
    pub truncate_bytes: Option<u64>,
}
