//! The `Continuation` resource: one tool call that waits on something
//! outside the session step (an approval, a person, a Job, a worker).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use super::session::{AppliedPolicyStatus, ApprovalStatus, ToolCallStatus, WaitingForName};
use super::{conditions_schema, free_form_object};

/// A deferred tool call. Its name is its token. Complete it by writing
/// `status.result` (e.g. `agents session complete TOKEN --text ...`); the
/// API server refuses a second, different result.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agents-exe.io",
    version = "v1alpha1",
    kind = "Continuation",
    doc = "A deferred tool call of a Session, named by its token. Complete it by writing status.result once.",
    namespaced,
    status = "ContinuationStatus",
    shortname = "cont",
    category = "agents",
    printcolumn = r#"{"name":"Session","type":"string","jsonPath":".spec.session","description":"Owning session"}"#,
    printcolumn = r#"{"name":"Tool","type":"string","jsonPath":".spec.toolCall.name","description":"Tool called"}"#,
    printcolumn = r#"{"name":"Waiting-For","type":"string","jsonPath":".spec.waitingFor","description":"What the call waits for"}"#,
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state","description":"Pending or Completed"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ContinuationSpec {
    /// The session the call belongs to.
    pub session: String,
    /// The agent turn that issued the call.
    pub turn: u32,
    /// Our call id, `t<turn>-c<index>`.
    pub call_id: String,
    /// The call as the model issued it.
    pub tool_call: ToolCallStatus,
    /// The policy decision that deferred it.
    pub policy: AppliedPolicyStatus,
    /// What the call waits for now.
    pub waiting_for: WaitingForName,
    /// Why it waits, for whoever completes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The serialisable context of the call. Never holds secrets.
    pub context: ContextSnapshotSpec,
    /// Cache key (`tool:sha256`) when the call is cacheable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
    /// When the wait gives up (the `timeout` decorator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
}

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
    /// Holds its final result.
    Completed,
}

/// The call's outcome. `result` and `decision` are written once.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.result) || (has(self.result) && self.result == oldSelf.result)").message("status.result is already set and cannot change: the call was already completed"))]
#[x_kube(validation = Rule::new("!has(oldSelf.decision) || (has(self.decision) && self.decision == oldSelf.decision)").message("status.decision is already set and cannot change"))]
pub struct ContinuationStatus {
    /// Pending or Completed.
    #[serde(default)]
    pub state: ContinuationState,
    /// The final result: `{status: success, response: {type: text, content}}`
    /// or `{status: error, message}`. Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub result: Option<Value>,
    /// Who supplied the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_by: Option<String>,
    /// When the result was supplied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// The approve/deny decision, for calls under `approval`. Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<ApprovalStatus>,
    /// The Job running the call (isolated calls in a cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Executions started.
    #[serde(default)]
    pub attempts: u32,
    /// `Completed`, and while running isolated, `JobRunning`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}
