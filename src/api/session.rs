//! The `Session` resource: one agent conversation, run durably.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::agent::{AgentSpec, ApprovalPolicySpec, ContainerTool, DispositionMode};
use super::{conditions_schema, free_form_object};

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
    printcolumn = r#"{"name":"Waiting-For","type":"string","jsonPath":".status.conditions[?(@.type==\"Waiting\")].reason","description":"What the session waits for"}"#,
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
    /// (it compares it with `status.retriesSeen`). It can only go up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<u32>,
    /// Delete the session (and with it its Continuations) this many seconds
    /// after it Succeeded or Failed, as `ttlSecondsAfterFinished` does for
    /// Jobs. Unset: the operator's `--finished-session-ttl-seconds`, and by
    /// default finished sessions are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 31_536_000))]
    pub ttl_seconds_after_finished: Option<u64>,
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

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
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

/// What the session has done so far: written by the operator (or `agents run`).
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
    /// The session is held: `spec.paused` was set and observed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// How many of `spec.messages` the session has taken in.
    #[serde(default)]
    pub messages_seen: u32,
    /// The `spec.retry` value last acted on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retries_seen: u32,
    /// Model turns taken.
    #[serde(default)]
    pub agent_turns: u32,
    /// Deferred calls of the open turn.
    #[serde(default)]
    pub pending_count: u32,
    /// Token usage summed over the session.
    #[serde(default)]
    pub usage: UsageStatus,
    /// The final answer, once the session succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Why the session failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The oldest turns, moved out of the status to keep it small (owned
    /// immutable ConfigMaps); `turns` continues after them. Readers (the
    /// operator, `agents session show`) put them back transparently.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4096))]
    pub archived_turns: Vec<ArchivedTurnsStatus>,
    /// The conversation, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<TurnStatus>,
    /// The calls of the latest agent turn, tracked until all are final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_turn: Option<OpenTurnStatus>,
    /// Messages that arrived while the session was busy, not yet sent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inbox: Vec<String>,
    /// Failed model calls in a row.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub model_attempts: u32,
    /// Steps of the operator that failed in a row for a reason of the
    /// session's own; at 8 the session fails. Reset by a step that ends well.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_steps: u32,
    /// When the model call is retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_retry_at: Option<Time>,
    /// The driver whose model call is under way, and until when its claim holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_claim: Option<ClaimStatus>,
    /// W3C `traceparent` of the session's latest step span, set while the
    /// operator exports OpenTelemetry traces: every step of the session
    /// joins this trace and links to this span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
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

/// A driver's claim on work with side effects: no other driver starts the
/// work before `until` unless the holder is known dead.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClaimStatus {
    /// The driver holding the claim (an operator replica or a CLI process).
    pub holder: String,
    /// When the claim lapses if the holder has not finished.
    pub until: Time,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct UsageStatus {
    /// Tokens sent to the model.
    pub prompt_tokens: u64,
    /// Tokens the model produced.
    pub completion_tokens: u64,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Role {
    /// The user's message and/or tool results.
    User,
    /// The model's reply.
    Agent,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TurnStatus {
    /// Who spoke.
    pub role: Role,
    /// The user's message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The model's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The model's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallStatus>,
    /// Tool results, in the model's call order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_results: Vec<ToolResultStatus>,
    /// Tokens this model turn used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageStatus>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ToolCallStatus {
    /// The model's own call id.
    pub model_call_id: String,
    /// Tool name.
    pub name: String,
    /// Arguments exactly as the model wrote them (JSON text).
    pub arguments: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ToolResultStatus {
    /// Our call id, `t<turn>-c<index>`.
    pub call_id: String,
    /// The model's call id.
    pub model_call_id: String,
    /// Tool name.
    pub tool: String,
    /// The continuation token, for calls that waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// `{status: success, response: {...}}` or `{status: error, message}`.
    #[schemars(schema_with = "free_form_object")]
    pub result: Value,
    /// The `truncate` limit the result was cut to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate_bytes: Option<u64>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OpenTurnStatus {
    /// The agent turn whose calls these are.
    pub turn: u32,
    /// The calls, in the model's order.
    pub calls: Vec<TrackedCallStatus>,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallStateName {
    /// Classified, not started.
    Ready,
    /// Running here.
    Running,
    /// Waiting on a continuation.
    Deferred,
    /// Final, with a result (which may be an error).
    Completed,
    /// Final: ran here and failed.
    Failed,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum WaitingForName {
    /// An approve/deny decision.
    Approval,
    /// The operator's own background run.
    Background,
    /// An isolated run (Job or process).
    Isolated,
    /// An outside party.
    External,
    /// A task of an MCP server, polled by the operator.
    McpTask,
}

/// An MCP task a call became.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatus {
    /// The task's id, as the server gave it.
    pub id: String,
    /// How often the server asked to be polled, in milliseconds (the
    /// operator polls within 1 s and 60 s).
    pub poll_ms: u64,
}

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

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalStatus {
    /// The decision.
    pub approved: bool,
    /// Who decided.
    pub by: String,
    /// Why, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Arguments an approver put in place of the model's (the call ran
    /// with these; the model's stay in `call`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TrackedCallStatus {
    /// Our call id, `t<turn>-c<index>`.
    pub id: String,
    /// The call as the model issued it.
    pub call: ToolCallStatus,
    /// Ready, Running, Deferred, Completed or Failed.
    pub state: CallStateName,
    /// The policy decision.
    pub policy: AppliedPolicyStatus,
    /// The continuation token (`agents session complete TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// What a deferred call waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingForName>,
    /// The approval decision, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalStatus>,
    /// The result, once final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub result: Option<Value>,
    /// Who supplied the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_by: Option<String>,
    /// Executions started.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempts: u32,
    /// When the current wait gives up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Time>,
    /// When a failed attempt is retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<Time>,
    /// The driver running the current attempt, and until when its claim holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<ClaimStatus>,
    /// The Job running the call, for isolated calls in a cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// The MCP task the call became: its id and the poll interval the
    /// server asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskStatus>,
    /// While the MCP task asks for input: its `inputRequests` (JSON), for
    /// a person to answer with `agents session answer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_asks: Option<String>,
}
