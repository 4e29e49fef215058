//! The CLI's admin port over the API server (`--store kube`): commands
//! change the Session's spec and the operator acts on it.

use super::kube::{session_input, version_of, KubeStore};
use crate::api::{Agent, AgentSpec};
use crate::core::{ContinuationToken, SessionId};
use crate::ports::{
    AdminPort, AgentDocuments, AgentSource, ContinuationRecord, InputChange, SessionInput,
    SessionRecord, SessionSummary, StoreError, StoreResult,
};
use futures::future::BoxFuture;
use kube::Api;

/// The Agents of one namespace, from the API server.
pub struct ClusterAgents(pub Api<Agent>);

impl ClusterAgents {
    /// The Agent's spec, `Ok(None)` when there is no such Agent, or why it
    /// cannot be read.
    pub fn agent<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<AgentSpec>, String>> {
        Box::pin(async move {
            match self.0.get_opt(name).await {
                Ok(found) => Ok(found.map(|a| a.spec)),
                Err(kube::Error::Api(s)) => Err(format!("{} {}", s.code, s.message)),
                Err(other) => Err(other.to_string()),
            }
        })
    }
}

/// The port speaks documents: the Agent's spec as the API server holds it.
impl AgentDocuments for ClusterAgents {
    fn agent_document<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, String>> {
        Box::pin(async move {
            let found = self.agent(name).await?;
            found
                .map(|spec| serde_json::to_value(spec).map_err(|e| e.to_string()))
                .transpose()
        })
    }
}

impl AdminPort for KubeStore {
    fn operator_driven(&self) -> bool {
        true
    }
    fn place(&self) -> String {
        format!("in namespace {}", self.namespace())
    }
    fn identity(&self) -> BoxFuture<'_, StoreResult<String>> {
        Box::pin(KubeStore::identity(self))
    }
    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<SessionSummary>>> {
        Box::pin(self.list_sessions())
    }
    fn answer_task<'a>(
        &'a self,
        token: &'a ContinuationToken,
        answers: &'a str,
        by: &'a str,
        now: crate::core::Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.answer_continuation(token, answers, by, now))
    }
    fn continuation<'a>(
        &'a self,
        token: &'a ContinuationToken,
    ) -> BoxFuture<'a, StoreResult<Option<ContinuationRecord>>> {
        Box::pin(self.get_continuation(token))
    }
    fn continuations_of<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>> {
        // Continuations only: a completer's Role may read nothing else.
        Box::pin(self.labelled_continuations(id))
    }
    fn change_input<'a>(
        &'a self,
        id: &'a SessionId,
        change: InputChange<'a>,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            // Computed from what was read, written only over that version:
            // a concurrent edit (another user, the operator) is re-read.
            for _ in 0..16 {
                let obj = self
                    .get_session(id)
                    .await?
                    .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
                // From the spec alone: the stored status is packed.
                let Some(patch) = input_patch(&session_input(&obj.spec), change) else {
                    return Ok(());
                };
                let version = version_of(&obj.metadata)?;
                match self.patch_spec(id, &version, patch).await {
                    Err(StoreError::Conflict { .. }) => continue,
                    other => return other.map(|_| ()),
                }
            }
            Err(StoreError::Backend(format!(
                "session {id} kept changing while its spec was edited; try again"
            )))
        })
    }
    fn agent_source<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<(SessionRecord, AgentSource)>> {
        Box::pin(async move {
            let obj = self
                .get_session(id)
                .await?
                .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
            let record = self.read_session(&obj).await?;
            let agents = Box::new(ClusterAgents(self.agents_api().clone()));
            let spec = serde_json::to_value(&obj.spec)
                .map_err(|e| StoreError::Backend(format!("session {id}: its spec: {e}")))?;
            Ok((record, AgentSource::Cluster { spec, agents }))
        })
    }
    fn create_fork<'a>(
        &'a self,
        source: &'a SessionRecord,
        fork: SessionRecord,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move { self.create_fork_session(source, &fork).await })
    }
}

/// The merge patch of the spec fields `change` touches, or `None` when it
/// changes nothing.
fn input_patch(before: &SessionInput, change: InputChange<'_>) -> Option<serde_json::Value> {
    let mut input = before.clone();
    change(&mut input);
    let mut patch = serde_json::Map::new();
    if input.paused != before.paused {
        patch.insert("paused".into(), input.paused.into());
    }
    if input.retry != before.retry {
        patch.insert("retry".into(), input.retry.into());
    }
    (!patch.is_empty()).then_some(serde_json::Value::Object(patch))
}
