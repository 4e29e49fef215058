//! The `Continuation` resource: one tool call that waits on something
//! outside the session step (an approval, a person, a Job, a worker).
//!
//! What the call is never changes: the spec is immutable after creation.
//! What it waits for now (`status.waitingFor`, `status.reason`,
//! `status.expiresAt`) is status, written by the operator. What the outside
//! writes is status too, each part once: `status.decision` (approve/deny)
//! and `status.outcome` (result, who, when). The API server enforces it
//! (CEL rules below), so a mistake or a race cannot rewrite either.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use super::session::{AppliedPolicyStatus, ToolCallStatus, WaitingForName};
use super::{conditions_schema, tool_result_schema};

/// A deferred tool call. Its name is its token. Complete it by writing
/// `status.outcome` once (e.g. `agents session complete TOKEN --text ...`);
/// the API server refuses a second, different outcome.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agents-exe.io",
    version = "v1alpha1",
    kind = "Continuation",
    doc = "A deferred tool call of a Session, named by its token. Complete it by writing status.outcome once.",
    namespaced,
    status = "ContinuationStatus",
    shortname = "cont",
    category = "agents-exe",
    // Needs the spec (does the call need approval?) and the status (is it
    // approved? is the result an error?), so it sits at the root; the API
    // server evaluates it on status writes too.
    // At the root, so removing the whole status (`{"status": null}`) is
    // judged too: a rule on `status` itself is not evaluated once it is gone.
    validation = Rule::new(OUTCOME_KEPT).message("status.outcome is already set and cannot change or be removed: the call was already completed"),
    validation = Rule::new(DECISION_KEPT).message("status.decision is already set and cannot change or be removed: the call was already decided"),
    validation = Rule::new(DECISIONS_KEPT).message("status.decisions only grows: a decision, once written, cannot change or be removed"),
    validation = Rule::new(EDITS_ALLOWED).message("this call's policy does not let approvers edit its arguments (approval.allowEdit is not set): decide without arguments"),
    validation = Rule::new(OUTSIDE_ONLY_WHEN_AWAITED).message("this call is run by the operator (spec.policy.disposition is runSync, runAsync or runIsolated), so only its run completes it; an outside result is taken only by a call whose disposition is defer, or whose run's outcome is unknown (waitingFor: outcome)"),
    validation = Rule::new(SUCCESS_NEEDS_APPROVAL).message("this call needs an approval before a success result: approve it first (agents session approve TOKEN); an error result (a timeout, a denial, a cancellation) is always accepted"),
    printcolumn = r#"{"name":"Session","type":"string","jsonPath":".spec.session","description":"Owning session"}"#,
    printcolumn = r#"{"name":"Tool","type":"string","jsonPath":".spec.toolCall.name","description":"Tool called"}"#,
    printcolumn = r#"{"name":"Waiting-For","type":"string","jsonPath":".status.waitingFor","description":"What the call waits for"}"#,
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state","description":"Pending or Completed"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("the spec of a Continuation cannot change after creation; what changes (waitingFor, reason, expiresAt) is in status"))]
#[serde(rename_all = "camelCase")]
pub struct ContinuationSpec {
    /// The session the call belongs to.
    #[schemars(length(max = 253))]
    pub session: String,
    /// The agent turn that issued the call.
    pub turn: u32,
    /// Our call id, `t<turn>-c<index>`.
    #[schemars(length(max = 64))]
    pub call_id: String,
    /// The call as the model issued it.
    pub tool_call: ToolCallStatus,
    /// The policy decision that deferred it. `policy.approval` set means a
    /// success result is accepted only after an approving decision.
    pub policy: AppliedPolicyStatus,
    /// The serialisable context of the call. Never holds secrets.
    pub context: ContextSnapshotSpec,
    /// Cache key (`tool:sha256`) when the call is cacheable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 400))]
    pub cache_key: Option<String>,
}

/// Once written, the outcome stays, whatever the patch removes.
pub const OUTCOME_KEPT: &str = "!has(oldSelf.status) || !has(oldSelf.status.outcome) || (has(self.status) && has(self.status.outcome) && self.status.outcome == oldSelf.status.outcome)";

/// Once written, the decision stays, whatever the patch removes.
pub const DECISION_KEPT: &str = "!has(oldSelf.status) || !has(oldSelf.status.decision) || (has(self.status) && has(self.status.decision) && self.status.decision == oldSelf.status.decision)";

/// Votes under an approval policy are appended; none changes or goes.
pub const DECISIONS_KEPT: &str = "!has(oldSelf.status) || !has(oldSelf.status.decisions) || (has(self.status) && has(self.status.decisions) && oldSelf.status.decisions.all(d, d in self.status.decisions))";

/// Edited arguments only where the policy has `allowEdit`.
pub const EDITS_ALLOWED: &str = "!has(self.status) || (has(self.spec.policy.approvalPolicy) && has(self.spec.policy.approvalPolicy.allowEdit) && self.spec.policy.approvalPolicy.allowEdit) || ((!has(self.status.decision) || !has(self.status.decision.arguments)) && (!has(self.status.decisions) || self.status.decisions.all(d, !has(d.arguments))))";

/// A new outcome comes from outside only for a `defer` call, or a call
/// whose run's outcome is unknown (it already waited for a person to say
/// what it was: `waitingFor: outcome`, set by the operator). The operator
/// writes as `agents` (or `cache`); a denial's error result is written
/// under the decider's name. (Who may claim which name is the business of
/// RBAC and admission policy; this rule keeps honest clients honest.)
pub const OUTSIDE_ONLY_WHEN_AWAITED: &str = "!has(self.status) || !has(self.status.outcome) || (has(oldSelf.status) && has(oldSelf.status.outcome)) || self.spec.policy.disposition == 'defer' || (has(oldSelf.status) && has(oldSelf.status.waitingFor) && oldSelf.status.waitingFor == 'outcome') || self.status.outcome.completedBy in ['agents', 'cache', 'mcp-task'] || (self.status.outcome.result.status == 'error' && has(self.status.decision) && !self.status.decision.approved) || (self.status.outcome.result.status == 'error' && has(self.status.decisions) && self.status.decisions.exists(d, !d.approved))";

/// A success outcome on a call whose policy asks for approval needs an
/// approving decision; error outcomes (a timeout while waiting, the error
/// a denial writes, a cancellation) are always accepted: they run nothing.
/// Under an approval policy: a quorum of approving votes and no denial,
/// or the operator's run after `onTimeout: approve`.
pub const SUCCESS_NEEDS_APPROVAL: &str = "!has(self.status) || !has(self.status.outcome) || self.status.outcome.result.status == 'error' || !has(self.spec.policy.approval) || !self.spec.policy.approval || (has(self.status.decision) && self.status.decision.approved) || (has(self.status.decisions) && !self.status.decisions.exists(d, !d.approved) && self.status.decisions.size() >= (has(self.spec.policy.approvalPolicy) && has(self.spec.policy.approvalPolicy.quorum) ? self.spec.policy.approvalPolicy.quorum : 1)) || (self.status.outcome.completedBy == 'agents' && has(self.spec.policy.approvalPolicy) && has(self.spec.policy.approvalPolicy.onTimeout) && self.spec.policy.approvalPolicy.onTimeout == 'approve')";

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ContextSnapshotSpec {
    /// Session name.
    pub session: String,
    /// Agent turn.
    pub turn: u32,
    /// Our call id.
    pub call_id: String,
    /// The agent's name, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Stable across retries and restarts; tools use it to act once.
    pub idempotency_key: String,
    /// The agent's non-secret parameters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
}

#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
pub enum ContinuationState {
    /// Waiting for a result (or a decision).
    #[default]
    Pending,
    /// Holds its final outcome.
    Completed,
}

/// The most an answer to an MCP task's request for input may hold, as
/// compact JSON: the CLI refuses more, and the CRD's schema bounds it.
pub const MAX_ANSWERS_BYTES: usize = 16 * 1024;

/// Answers a person gave to an MCP task's request for input.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AnswersStatus {
    /// The `inputResponses` object, as JSON text.
    #[schemars(length(max = MAX_ANSWERS_BYTES))]
    pub input_responses: String,
    /// Who answered.
    pub by: String,
    /// When.
    pub answered_at: Time,
}

/// Where the call is, and what the outside wrote. `outcome` and
/// `decision` are each written once, as a whole.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.outcome) || (has(self.outcome) && self.outcome == oldSelf.outcome)").message("status.outcome is already set and cannot change: the call was already completed"))]
#[x_kube(validation = Rule::new("!has(oldSelf.decision) || (has(self.decision) && self.decision == oldSelf.decision)").message("status.decision is already set and cannot change: the call was already decided"))]
#[x_kube(validation = Rule::new("(self.state == 'Completed') == has(self.outcome)").message("status.state is Completed exactly when status.outcome is set: write them together"))]
pub struct ContinuationStatus {
    /// Pending, or Completed once `outcome` is set.
    #[serde(default)]
    pub state: ContinuationState,
    /// What the call waits for now: `approval` until decided, then its
    /// runner (`background`, `isolated`) or an outside party (`external`).
    /// Written by the operator; absent until it first writes the status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingForName>,
    /// Why it waits, for whoever completes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When the current wait gives up (the `timeout` decorator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// The final result, who supplied it and when. Written once, as a
    /// whole; a repeat of the very same outcome is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<OutcomeStatus>,
    /// The approve/deny decision, for calls under `approval`. Written once,
    /// as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecisionStatus>,
    /// Under an approval policy: one decision per approver, each written
    /// once and appended; the call is decided at the quorum of approvals
    /// or the first denial.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["by"]))]
    pub decisions: Vec<DecisionStatus>,
    /// The Job running the call (isolated calls in a cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Answers to the call's MCP task's request for input (the
    /// `inputRequests` in the Session's `status.state.open.calls[].taskAsks`):
    /// an `inputResponses` object as JSON, written by `agents session
    /// answer`, delivered with `tasks/update`. A later answer replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answers: Option<AnswersStatus>,
    /// Executions started.
    #[serde(default)]
    pub attempts: u32,
    /// `Completed`, and while running isolated, `JobRunning`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The notification of this wait (the agent's `notify`), written by
    /// the operator: sent once, or retried and then given up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notified: Option<NotifiedStatus>,
}

/// Delivery of the notification of one wait.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NotifiedStatus {
    /// The wait notified (`approval` or `external`); a later wait of the
    /// same call is notified anew.
    pub waiting_for: WaitingForName,
    /// `Sent`, `Retrying` (after a failed attempt) or `Failed` (given up).
    pub state: NotifyState,
    /// POSTs tried so far.
    #[schemars(range(max = 100))]
    pub attempts: u32,
    /// When the last attempt was made.
    pub last_attempt_at: Time,
    /// When a POST was answered with 2xx.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Time>,
    /// Why the last attempt failed (never a header or secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub error: Option<String>,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotifyState {
    /// Delivered (a 2xx answer).
    Sent,
    /// An attempt failed; another follows after a backoff.
    Retrying,
    /// Every attempt failed; no more are made.
    Failed,
}

/// A call's final outcome: one write-once unit.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OutcomeStatus {
    /// `{status: success, response: {type: text, content}}` or
    /// `{status: error, message}`.
    #[schemars(schema_with = "tool_result_schema")]
    pub result: Value,
    /// Who supplied the result (a user, `agents` for the operator's own
    /// runs and timeouts, `cache`).
    #[schemars(length(min = 1, max = 253))]
    pub completed_by: String,
    /// When the result was supplied, to the microsecond: a session's wake
    /// latency is measured from it (a whole-second `Time` would add up to
    /// a second to each).
    pub completed_at: MicroTime,
}

/// An approve/deny decision: one write-once unit.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DecisionStatus {
    /// True to run the call, false to deny it (the model is told).
    pub approved: bool,
    /// Who decided.
    #[schemars(length(min = 1, max = 253))]
    pub by: String,
    /// Why, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub reason: Option<String>,
    /// When the decision was made.
    pub decided_at: Time,
    /// Arguments (a JSON object's text) the approver puts in place of the
    /// model's, where the policy has `allowEdit`; the call runs with them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 65536))]
    pub arguments: Option<String>,
    /// With an approval of a session's question about its budget
    /// (`waitingFor: budget`): the limits raised, each the new bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raise: Option<crate::core::budget::Raise>,
}
