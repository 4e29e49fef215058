//! The CLI's admin port over the API server (`--store kube`): commands
//! change the Session's spec and the operator acts on it.

use super::kube::{session_record, KubeStore};
use crate::api::{Agent, AgentSpec};
use crate::core::{ContinuationToken, SessionId};
use crate::ports::{
    AdminPort, AgentLookup, AgentSource, ContinuationRecord, InputChange, SessionRecord,
    SessionSummary, StoreError, StoreResult,
};
use futures::future::BoxFuture;
use kube::Api;

/// The Agents of one namespace, from the API server.
pub struct ClusterAgents(pub Api<Agent>);

impl AgentLookup for ClusterAgents {
    fn agent<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<AgentSpec>, String>> {
        Box::pin(async move {
            match self.0.get_opt(name).await {
                Ok(found) => Ok(found.map(|a| a.spec)),
                Err(kube::Error::Api(s)) => Err(format!("{} {}", s.code, s.message)),
                Err(other) => Err(other.to_string()),
            }
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
    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<SessionSummary>>> {
        Box::pin(self.list_sessions())
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
            let obj = self
                .get_session(id)
                .await?
                .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
            let before = session_record(&obj)?.input;
            let mut input = before.clone();
            change(&mut input);
            let mut patch = serde_json::Map::new();
            if input.paused != before.paused {
                patch.insert("paused".into(), input.paused.into());
            }
            if input.retry != before.retry {
                patch.insert("retry".into(), input.retry.into());
            }
            if !patch.is_empty() {
                self.patch_spec(id, serde_json::Value::Object(patch))
                    .await?;
            }
            Ok(())
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
            let spec = Box::new(obj.spec);
            Ok((record, AgentSource::Cluster { spec, agents }))
        })
    }
}
