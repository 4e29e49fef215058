//! The ports over the embedded SQLite store: the engine's, and the CLI's
//! admin port.

use super::sqlite::SqliteStore;
use super::*;
use crate::core::session::ContinuationSpec;
use crate::core::{CacheKey, ContinuationToken, Millis, SessionId, ToolResult};
use crate::ports::{
    AdminPort, AgentSource, CachePort, Clock, ContinuationPort, InputChange, SessionPort,
    SessionRef,
};
use futures::future::BoxFuture;

impl SessionPort for SqliteStore {
    fn load<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Option<Versioned<SessionRecord>>>> {
        Box::pin(self.load_session(id))
    }
    fn save<'a>(
        &'a self,
        record: &'a SessionRecord,
        expected: &'a Version,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        Box::pin(self.save_session(record, expected))
    }
}

impl ContinuationPort for SqliteStore {
    fn ensure<'a>(
        &'a self,
        _owner: &'a SessionRef,
        spec: &'a ContinuationSpec,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<ContinuationRecord>> {
        Box::pin(self.ensure_continuation(spec, now))
    }
    fn list_for<'a>(
        &'a self,
        owner: &'a SessionRef,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>> {
        Box::pin(self.session_continuations(&owner.id))
    }
    fn complete<'a>(
        &'a self,
        token: &'a ContinuationToken,
        result: &'a ToolResult,
        by: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        Box::pin(self.complete_continuation(token, result, by, now))
    }
    fn decide<'a>(
        &'a self,
        token: &'a ContinuationToken,
        decision: &'a Decision,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        Box::pin(self.decide_continuation(token, decision))
    }
}

impl CachePort for SqliteStore {
    fn lookup<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, StoreResult<Option<ToolResult>>> {
        Box::pin(self.cache_get(key))
    }
    fn remember<'a>(
        &'a self,
        key: &'a CacheKey,
        result: &'a ToolResult,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.cache_put(key, result, now))
    }
}

impl AdminPort for SqliteStore {
    fn operator_driven(&self) -> bool {
        false
    }
    fn identity(&self) -> BoxFuture<'_, StoreResult<String>> {
        let user = std::env::var("USER").unwrap_or_else(|_| "cli".into());
        Box::pin(async move { Ok(user) })
    }
    fn answer_task<'a>(
        &'a self,
        token: &'a ContinuationToken,
        answers: &'a str,
        _by: &'a str,
        _now: crate::core::Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move { SqliteStore::answer_task(self, token, answers) })
    }
    fn place(&self) -> String {
        format!("in {}", self.path().display())
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
        Box::pin(self.session_continuations(id))
    }
    fn change_input<'a>(
        &'a self,
        id: &'a SessionId,
        change: InputChange<'a>,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            for _ in 0..16 {
                let loaded = self
                    .load_session(id)
                    .await?
                    .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
                let mut record = loaded.value;
                let before = record.input.clone();
                change(&mut record.input);
                if record.input == before {
                    return Ok(());
                }
                record.updated_at = crate::ports::SystemClock.now();
                match self.save_session(&record, &loaded.version).await {
                    Err(StoreError::Conflict { .. }) => continue,
                    other => return other.map(|_| ()),
                }
            }
            Err(StoreError::Backend(format!(
                "session {id} kept changing under this process; try again"
            )))
        })
    }
    fn agent_source<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<(SessionRecord, AgentSource)>> {
        Box::pin(async move {
            let loaded = self
                .load_session(id)
                .await?
                .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
            let stored = AgentSource::Stored(loaded.value.definition.clone());
            Ok((loaded.value, stored))
        })
    }
    fn create_child<'a>(
        &'a self,
        record: SessionRecord,
        link: &'a TreeLink,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        Box::pin(self.create_child_session(record, link))
    }
    fn create_fork<'a>(
        &'a self,
        _source: &'a SessionRecord,
        fork: SessionRecord,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move { self.create_session(fork).await.map(|_| ()) })
    }
    fn tree<'a>(&'a self, root: &'a SessionId) -> BoxFuture<'a, StoreResult<Vec<TreeMember>>> {
        Box::pin(self.tree_members(root))
    }
}
