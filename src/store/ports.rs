//! The engine's store ports over the embedded SQLite store.

use super::sqlite::SqliteStore;
use super::*;
use crate::ports::{CachePort, ContinuationPort, SessionPort, SessionRef};
use futures::future::BoxFuture;

impl SessionPort for SqliteStore {
    fn load<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Option<Versioned<SessionRecord>>>> {
        Box::pin(Store::load_session(self, id))
    }
    fn save<'a>(
        &'a self,
        record: &'a SessionRecord,
        expected: &'a Version,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        Box::pin(Store::save_session(self, record, expected))
    }
}

impl ContinuationPort for SqliteStore {
    fn ensure<'a>(
        &'a self,
        _owner: &'a SessionRef,
        spec: &'a ContinuationSpec,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<ContinuationRecord>> {
        Box::pin(Store::ensure_continuation(self, spec, now))
    }
    fn list_for<'a>(
        &'a self,
        owner: &'a SessionRef,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>> {
        Box::pin(Store::session_continuations(self, &owner.id))
    }
    fn complete<'a>(
        &'a self,
        token: &'a ContinuationToken,
        result: &'a ToolResult,
        by: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        Box::pin(Store::complete_continuation(self, token, result, by, now))
    }
    fn decide<'a>(
        &'a self,
        token: &'a ContinuationToken,
        decision: &'a Decision,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        Box::pin(Store::decide_continuation(self, token, decision))
    }
}

impl CachePort for SqliteStore {
    fn lookup<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, StoreResult<Option<ToolResult>>> {
        Box::pin(Store::cache_get(self, key))
    }
    fn remember<'a>(
        &'a self,
        key: &'a CacheKey,
        result: &'a ToolResult,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(Store::cache_put(self, key, result, now))
    }
}
