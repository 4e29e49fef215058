//! The store an `agents session ...` command works on: the embedded one
//! (`--store sqlite:PATH`) or the cluster's (`--store kube`, `-n`). Both
//! give the engine's ports; what differs (how input changes, where the
//! agent comes from) is here.

use super::definition::{Definition, RunnableAgent};
use crate::api::AgentSpec;
use crate::core::session::ContinuationSpec;
use crate::core::{CacheKey, ContinuationToken, Millis, SessionId, ToolResult};
use crate::engine::{CachePort, ContinuationPort, SessionPort, SessionRef};
use crate::store::kube::{session_record, KubeStore};
use crate::store::sqlite::SqliteStore;
use crate::store::{
    ContinuationRecord, Decision, SessionInput, SessionRecord, SessionSummary, Store, StoreError,
    StoreResult, Version, Versioned, WriteOnce,
};
use anyhow::{anyhow, bail};
use futures::future::BoxFuture;

pub enum AnyStore {
    Sqlite(SqliteStore),
    // Boxed: a client and three API handles outweigh the SQLite handle.
    Kube(Box<KubeStore>),
}

impl AnyStore {
    pub fn is_kube(&self) -> bool {
        matches!(self, AnyStore::Kube(_))
    }

    pub async fn load_session(
        &self,
        id: &SessionId,
    ) -> StoreResult<Option<Versioned<SessionRecord>>> {
        match self {
            AnyStore::Sqlite(s) => s.load_session(id).await,
            AnyStore::Kube(k) => SessionPort::load(k.as_ref(), id).await,
        }
    }

    pub async fn list_sessions(&self) -> StoreResult<Vec<SessionSummary>> {
        match self {
            AnyStore::Sqlite(s) => s.list_sessions().await,
            AnyStore::Kube(k) => k.list_sessions().await,
        }
    }

    pub async fn get_continuation(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>> {
        match self {
            AnyStore::Sqlite(s) => s.get_continuation(token).await,
            AnyStore::Kube(k) => k.get_continuation(token).await,
        }
    }

    pub async fn session_continuations(
        &self,
        id: &SessionId,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        match self {
            AnyStore::Sqlite(s) => s.session_continuations(id).await,
            AnyStore::Kube(k) => k.session_continuations(id).await,
        }
    }

    pub async fn complete_continuation(
        &self,
        token: &ContinuationToken,
        result: &ToolResult,
        by: &str,
        now: Millis,
    ) -> StoreResult<WriteOnce> {
        ContinuationPort::complete(self, token, result, by, now).await
    }

    pub async fn decide_continuation(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<WriteOnce> {
        ContinuationPort::decide(self, token, decision).await
    }

    /// Changes what the user asked for (pause, resume, retry): standalone
    /// the stored input, with compare-and-swap; in a cluster the Session's
    /// spec (the operator acts on it).
    pub async fn update_input(
        &self,
        id: &SessionId,
        change: impl Fn(&mut SessionInput),
    ) -> anyhow::Result<()> {
        match self {
            AnyStore::Sqlite(store) => {
                for _ in 0..16 {
                    let loaded = store
                        .load_session(id)
                        .await?
                        .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
                    let mut record = loaded.value;
                    let before = record.input.clone();
                    change(&mut record.input);
                    if record.input == before {
                        return Ok(());
                    }
                    record.updated_at = super::driver::now();
                    match store.save_session(&record, &loaded.version).await {
                        Ok(_) => return Ok(()),
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                bail!("session {id} kept changing under this process; try again")
            }
            AnyStore::Kube(k) => {
                let obj = k
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
                if patch.is_empty() {
                    return Ok(());
                }
                k.patch_spec(id, serde_json::Value::Object(patch)).await?;
                Ok(())
            }
        }
    }

    /// A stored session and its agent, rebuilt from what the store holds:
    /// standalone the stored definition; in a cluster the Session's spec
    /// and the Agent it refers to.
    pub async fn load_agent(
        &self,
        id: &SessionId,
    ) -> anyhow::Result<(SessionRecord, Definition, RunnableAgent)> {
        let (record, def) = match self {
            AnyStore::Sqlite(store) => {
                let loaded = store
                    .load_session(id)
                    .await?
                    .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
                let def: Definition = serde_json::from_value(loaded.value.definition.clone())
                    .map_err(|e| {
                        anyhow!("session {id}: its stored definition cannot be read: {e}")
                    })?;
                (loaded.value, def)
            }
            AnyStore::Kube(k) => {
                let obj = k.get_session(id).await?.ok_or_else(|| {
                    anyhow!(
                        "session {id} not found in namespace {}; `kubectl get sessions -n {}` lists them",
                        k.namespace(),
                        k.namespace()
                    )
                })?;
                let record = k.read_session(&obj).await?;
                let lookup = ClusterAgents(k.agents_api().clone());
                let place = format!("in namespace {}", k.namespace());
                let def = crate::agent::definition(&id.0, &obj.spec, &lookup, &place).await?;
                (record, def)
            }
        };
        let agent = def
            .build(record.created_at, &super::definition::EnvSecrets)
            .map_err(|e| anyhow!("session {id}: {e}"))?;
        Ok((record, def, agent))
    }
}

impl SessionPort for AnyStore {
    fn load<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Option<Versioned<SessionRecord>>>> {
        match self {
            AnyStore::Sqlite(s) => s.load(id),
            AnyStore::Kube(k) => k.load(id),
        }
    }
    fn save<'a>(
        &'a self,
        record: &'a SessionRecord,
        expected: &'a Version,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        match self {
            AnyStore::Sqlite(s) => s.save(record, expected),
            AnyStore::Kube(k) => k.save(record, expected),
        }
    }
}

impl ContinuationPort for AnyStore {
    fn ensure<'a>(
        &'a self,
        owner: &'a SessionRef,
        spec: &'a ContinuationSpec,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<ContinuationRecord>> {
        match self {
            AnyStore::Sqlite(s) => s.ensure(owner, spec, now),
            AnyStore::Kube(k) => k.ensure(owner, spec, now),
        }
    }
    fn list_for<'a>(
        &'a self,
        owner: &'a SessionRef,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>> {
        match self {
            AnyStore::Sqlite(s) => s.list_for(owner),
            AnyStore::Kube(k) => k.list_for(owner),
        }
    }
    fn complete<'a>(
        &'a self,
        token: &'a ContinuationToken,
        result: &'a ToolResult,
        by: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        match self {
            AnyStore::Sqlite(s) => s.complete(token, result, by, now),
            AnyStore::Kube(k) => k.complete(token, result, by, now),
        }
    }
    fn decide<'a>(
        &'a self,
        token: &'a ContinuationToken,
        decision: &'a Decision,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        match self {
            AnyStore::Sqlite(s) => s.decide(token, decision),
            AnyStore::Kube(k) => k.decide(token, decision),
        }
    }
}

impl CachePort for AnyStore {
    fn lookup<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, StoreResult<Option<ToolResult>>> {
        match self {
            AnyStore::Sqlite(s) => s.lookup(key),
            AnyStore::Kube(k) => k.lookup(key),
        }
    }
    fn remember<'a>(
        &'a self,
        key: &'a CacheKey,
        result: &'a ToolResult,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        match self {
            AnyStore::Sqlite(s) => s.remember(key, result, now),
            AnyStore::Kube(k) => k.remember(key, result, now),
        }
    }
}

/// The Agents of the session's namespace, for `--store kube`.
struct ClusterAgents(kube::Api<crate::api::Agent>);

impl crate::agent::AgentLookup for ClusterAgents {
    fn agent<'a>(
        &'a self,
        name: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<Option<AgentSpec>, String>> {
        Box::pin(async move {
            self.0
                .get_opt(name)
                .await
                .map(|found| found.map(|a| a.spec))
                .map_err(|e| e.to_string())
        })
    }
}
