//! The result cache in the memory of one process, bounded in entries and bytes.

use super::*;

/// Cached results in this process's memory. Keys carry their scope (the
/// namespace and the tool's fingerprint), so sharing one cache between
/// sessions of different namespaces shares nothing across them.
#[derive(Debug, Default)]
pub struct MemoryCache {
    entries: Mutex<CacheEntries>,
}

impl MemoryCache {
    /// Bytes of results held now.
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> usize {
        self.entries.lock().expect("cache lock").bytes
    }
}

#[derive(Debug, Default)]
struct CacheEntries {
    results: HashMap<String, ToolResult>,
    bytes: usize,
}

/// Entries kept before the cache is dropped; a miss only re-runs.
const CACHE_ENTRIES: usize = 4096;
/// Bytes of results kept in all (one shared service, a fixed memory
/// limit): past it the cache is dropped.
pub const CACHE_BYTES: usize = 64 * 1024 * 1024;
/// A result larger than this is not kept in memory at all.
pub const CACHE_ENTRY_BYTES: usize = CACHE_BYTES / 16;

impl CachePort for MemoryCache {
    fn lookup<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, StoreResult<Option<ToolResult>>> {
        let hit = self
            .entries
            .lock()
            .expect("cache lock")
            .results
            .get(&key.to_string())
            .cloned();
        Box::pin(async move { Ok(hit) })
    }
    fn remember<'a>(
        &'a self,
        key: &'a CacheKey,
        result: &'a ToolResult,
        _now: Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        let size = result_bytes(result);
        let mut entries = self.entries.lock().expect("cache lock");
        if size > CACHE_ENTRY_BYTES || entries.results.contains_key(&key.to_string()) {
            return Box::pin(async { Ok(()) });
        }
        if entries.results.len() >= CACHE_ENTRIES || entries.bytes + size > CACHE_BYTES {
            warn!(
                entries = entries.results.len(),
                bytes = entries.bytes,
                "result cache full; dropping it"
            );
            *entries = CacheEntries::default();
        }
        entries.results.insert(key.to_string(), result.clone());
        entries.bytes += size;
        Box::pin(async { Ok(()) })
    }
}

/// About what a result takes in memory.
fn result_bytes(result: &ToolResult) -> usize {
    match result {
        ToolResult::Success { response } => response.size(),
        ToolResult::Error { message } => message.len(),
    }
}
