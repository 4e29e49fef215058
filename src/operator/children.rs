//! Sub-agent calls in the operator: each call's child is a Session of the
//! same namespace, made once (create if absent, adopt when this session
//! owns it by UID) after the call's claim is committed, and its final
//! answer is the call's result.
//!
//! A child changing wakes its parent: the controller watches Sessions that
//! carry the parent label, through their ownerReference (see `run.rs`).

use crate::api::session::SessionPhase;
use crate::api::Continuation;
use crate::api::Session;
use crate::core::session::subagent::ChildPlan;
use crate::core::{ContinuationToken, TokenUsage, ToolResult};
use crate::ports::RunStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use std::collections::BTreeMap;
use std::sync::Mutex;
use tracing::{info, warn};

/// The label naming a child's parent Session.
pub const LABEL_PARENT: &str = "agents-exe.io/parent";
/// The label naming the root Session of a child's tree.
pub const LABEL_ROOT: &str = "agents-exe.io/root";
/// On a child the operator paused because its parent was: resuming the
/// parent resumes it (a child a person paused stays paused).
pub const ANNOTATION_PAUSED_BY_PARENT: &str = "agents-exe.io/paused-by-parent";
/// On the call's Continuation: `<name>/<uid>` of the child made for its
/// latest attempt, so a child deleted by hand is told from one not made yet.
pub const ANNOTATION_CHILD: &str = "agents-exe.io/child-uid";

/// The children of one session, as one reconcile makes and reads them.
pub struct Children {
    pub client: Client,
    pub namespace: String,
    pub parent: String,
    pub parent_uid: String,
    /// A paused parent makes its children paused.
    pub paused: bool,
    /// The final usage of each ended child this step read, by name: the
    /// usage is added with the child's answer, without reading it again.
    pub ended_usage: Mutex<BTreeMap<String, TokenUsage>>,
}

impl Children {
    fn api(&self) -> Api<Session> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The child of `plan` (the call under `token`): made if absent, then
    /// its outcome if it ended.
    pub async fn start(&self, plan: &ChildPlan, token: &ContinuationToken) -> RunStatus {
        match self.api().get_opt(&plan.name).await {
            Ok(Some(child)) => {
                self.follow_pause(&child).await;
                self.outcome(plan, &child)
            }
            Ok(None) => match self.made_before(token, &plan.name).await {
                Some(uid) => RunStatus::Finished(ToolResult::error(format!(
                    "the sub-agent session {} (agent {}, uid {uid}) was deleted before it answered; call the agent again if its answer is still needed",
                    plan.name, plan.agent
                ))),
                None => self.create(plan, token).await,
            },
            // Transient: the next step looks again.
            Err(e) => {
                warn!(child = %plan.name, error = %e, "reading a sub-agent session failed");
                RunStatus::InFlight
            }
        }
    }

    /// The child's outcome if it ended; never makes one. A paused parent
    /// collects: its running child is paused too.
    pub async fn collect(&self, plan: &ChildPlan) -> RunStatus {
        match self.api().get_opt(&plan.name).await {
            Ok(Some(child)) => {
                self.follow_pause(&child).await;
                self.outcome(plan, &child)
            }
            Ok(None) | Err(_) => RunStatus::InFlight,
        }
    }

    /// The final usage of the child of `plan`, if it is this session's and
    /// has ended (read again only after a crash lost the step that saw it).
    pub async fn usage(&self, plan: &ChildPlan) -> Option<TokenUsage> {
        if let Some(u) = self.ended_usage.lock().expect("usage lock").get(&plan.name) {
            return Some(*u);
        }
        let child = self.api().get_opt(&plan.name).await.ok()??;
        (owned_by(&child, &self.parent_uid) && is_final(&child))
            .then(|| child.status.map(|s| s.usage).unwrap_or_default())
    }

    /// Pauses or resumes an owned child that is still running as its
    /// parent is (a best-effort patch; the next step tries again).
    async fn follow_pause(&self, child: &Session) {
        if !owned_by(child, &self.parent_uid) || is_final(child) {
            return;
        }
        let Some(patch) = pause_patch(self.paused, child) else {
            return;
        };
        let name = child.name_any();
        info!(parent = %self.parent, child = %name, paused = self.paused, "the parent's pause flows down");
        if let Err(e) = self
            .api()
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            warn!(child = %name, error = %e, "pausing or resuming a sub-agent session failed");
        }
    }

    /// Stops the call's child (a timeout ended the call first); a finished
    /// child is left to its retention.
    pub async fn release(&self, token: &ContinuationToken) {
        let api = self.api();
        let Ok(Some(child)) = api.get_opt(token.as_str()).await else {
            return;
        };
        if !owned_by(&child, &self.parent_uid) || is_final(&child) {
            return;
        }
        info!(child = %token, "the call ended first; its sub-agent session is deleted");
        let _ = api
            .delete(token.as_str(), &DeleteParams::foreground())
            .await;
    }

    /// The UID of the child `name` made for the call, as its Continuation
    /// keeps it (a retry's new child has another name).
    async fn made_before(&self, token: &ContinuationToken, name: &str) -> Option<String> {
        let api: Api<Continuation> = Api::namespaced(self.client.clone(), &self.namespace);
        let c = api.get_opt(token.as_str()).await.ok()??;
        let noted = c.annotations().get(ANNOTATION_CHILD)?;
        let (made, uid) = noted.split_once('/')?;
        (made == name).then(|| uid.to_string())
    }

    /// Notes the child's UID on the call's Continuation (best effort: a
    /// child made without the note is only re-made if deleted by hand).
    async fn note_made(&self, token: &ContinuationToken, noted: &str) {
        let api: Api<Continuation> = Api::namespaced(self.client.clone(), &self.namespace);
        let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_CHILD: noted}}});
        if let Err(e) = api
            .patch(
                token.as_str(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            warn!(token = %token, error = %e, "noting a sub-agent session on its continuation failed");
        }
    }

    async fn create(&self, plan: &ChildPlan, token: &ContinuationToken) -> RunStatus {
        let child = self.child_object(plan);
        match self.api().create(&PostParams::default(), &child).await {
            Ok(made) => {
                info!(parent = %self.parent, child = %plan.name, agent = %plan.agent, depth = plan.depth, "sub-agent session created");
                let noted = format!("{}/{}", plan.name, made.uid().unwrap_or_default());
                self.note_made(token, &noted).await;
                self.outcome(plan, &made)
            }
            // Made by an earlier step that lost its reply: adopt it.
            Err(kube::Error::Api(e)) if e.code == 409 => RunStatus::InFlight,
            Err(kube::Error::Api(e)) if e.code == 422 || e.code == 400 => {
                RunStatus::Finished(ToolResult::error(format!(
                    "the sub-agent session {} for agent {:?} was refused by the API server: {}",
                    plan.name, plan.agent, e.message
                )))
            }
            Err(e) => {
                warn!(child = %plan.name, error = %e, "creating a sub-agent session failed");
                RunStatus::InFlight
            }
        }
    }

    fn child_object(&self, plan: &ChildPlan) -> Session {
        let root = plan
            .stack
            .first()
            .map_or(self.parent.clone(), |e| e.session.clone());
        let labels = BTreeMap::from([
            (LABEL_PARENT.to_string(), self.parent.clone()),
            (LABEL_ROOT.to_string(), root),
        ]);
        let owner = OwnerReference {
            api_version: Session::api_version(&()).into_owned(),
            kind: Session::kind(&()).into_owned(),
            name: self.parent.clone(),
            uid: self.parent_uid.clone(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let spec = crate::agent::subagents::child_spec(plan, &self.parent_uid, self.paused);
        Session {
            metadata: ObjectMeta {
                name: Some(plan.name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels),
                owner_references: Some(vec![owner]),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        }
    }

    fn outcome(&self, plan: &ChildPlan, child: &Session) -> RunStatus {
        if !owned_by(child, &self.parent_uid) {
            return RunStatus::Finished(ToolResult::error(format!(
                "a Session named {} exists and is not this call's child (its owner is not session {}); delete or rename it",
                plan.name, self.parent
            )));
        }
        let status = child.status.as_ref();
        if let (true, Some(s)) = (is_final(child), status) {
            self.ended_usage
                .lock()
                .expect("usage lock")
                .insert(plan.name.clone(), s.usage);
        }
        match status.map(|s| s.phase) {
            Some(SessionPhase::Succeeded) => RunStatus::Finished(ToolResult::text(
                status.and_then(|s| s.answer.clone()).unwrap_or_default(),
            )),
            Some(SessionPhase::Failed) => RunStatus::Finished(ToolResult::error(format!(
                "the sub-agent {} (session {}) failed: {}",
                plan.agent,
                plan.name,
                status
                    .and_then(|s| s.failure.clone())
                    .unwrap_or_else(|| "no reason given".into())
            ))),
            _ => RunStatus::InFlight,
        }
    }
}

fn owned_by(child: &Session, uid: &str) -> bool {
    child
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

fn is_final(child: &Session) -> bool {
    matches!(
        child.status.as_ref().map(|s| s.phase),
        Some(SessionPhase::Succeeded | SessionPhase::Failed)
    )
}

/// The patch that makes a child follow its parent's pause: pause a running
/// child (marking it as paused by the parent), resume one the parent paused.
fn pause_patch(parent_paused: bool, child: &Session) -> Option<serde_json::Value> {
    let by_parent = child
        .annotations()
        .contains_key(ANNOTATION_PAUSED_BY_PARENT);
    match (parent_paused, child.spec.paused) {
        (true, false) => Some(serde_json::json!({
            "metadata": {"annotations": {ANNOTATION_PAUSED_BY_PARENT: "true"}},
            "spec": {"paused": true},
        })),
        (false, true) if by_parent => Some(serde_json::json!({
            "metadata": {"annotations": {ANNOTATION_PAUSED_BY_PARENT: null}},
            "spec": {"paused": false},
        })),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn child(paused: bool, by_parent: bool) -> Session {
        let mut s = Session::new(
            "c",
            serde_json::from_value(serde_json::json!({"messages": ["x"], "paused": paused}))
                .unwrap(),
        );
        if by_parent {
            s.annotations_mut()
                .insert(ANNOTATION_PAUSED_BY_PARENT.into(), "true".into());
        }
        s
    }

    #[test]
    fn a_pause_flows_down_and_back_but_a_persons_pause_stays() {
        let p = pause_patch(true, &child(false, false)).expect("pause the child");
        assert_eq!(p["spec"]["paused"], true);
        assert_eq!(
            p["metadata"]["annotations"][ANNOTATION_PAUSED_BY_PARENT],
            "true"
        );
        assert_eq!(
            pause_patch(true, &child(true, false)),
            None,
            "already paused"
        );
        let r = pause_patch(false, &child(true, true)).expect("resume the child");
        assert_eq!(r["spec"]["paused"], false);
        assert_eq!(
            pause_patch(false, &child(true, false)),
            None,
            "a child a person paused stays paused"
        );
        assert_eq!(pause_patch(false, &child(false, false)), None);
    }
}
