//! The engine's ports over the kube store.

use super::*;

impl SessionPort for KubeStore {
    fn load<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Option<Versioned<SessionRecord>>>> {
        Box::pin(self.load_record(id))
    }
    fn save<'a>(
        &'a self,
        record: &'a SessionRecord,
        expected: &'a Version,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        Box::pin(self.save_record(record, expected))
    }
}

impl ContinuationPort for KubeStore {
    fn ensure<'a>(
        &'a self,
        owner: &'a SessionRef,
        spec: &'a ContinuationSpec,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<ContinuationRecord>> {
        Box::pin(self.ensure_continuation(owner, spec, now))
    }
    fn list_for<'a>(
        &'a self,
        owner: &'a SessionRef,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>> {
        Box::pin(self.list_owned(owner))
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

impl CachePort for KubeStore {
    fn lookup<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, StoreResult<Option<ToolResult>>> {
        self.cache.lookup(key)
    }
    fn remember<'a>(
        &'a self,
        key: &'a CacheKey,
        result: &'a ToolResult,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        self.cache.remember(key, result, now)
    }
}
