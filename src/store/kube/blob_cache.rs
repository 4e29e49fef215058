//! Spilled blobs this process read or wrote, shared by the steps of every
//! session and bounded in bytes.
//!
//! Blobs are immutable and content-named, so a kept one is never stale:
//! without this, each step of a long session read every archived chunk of
//! its conversation again (requests and bytes growing with its length), and
//! tried to create each again. Keyed by the owning session's UID and the
//! blob's name, so a session re-created under the same name never meets the
//! old one's blobs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Bytes kept at most by the operator's shared cache.
pub const SHARED_BLOB_BYTES: usize = 16 * 1024 * 1024;

/// Immutable blobs by key, oldest dropped first past the byte bound.
pub struct BlobCache {
    most: usize,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    blobs: HashMap<String, Arc<Vec<u8>>>,
    order: VecDeque<String>,
    bytes: usize,
}

impl Default for BlobCache {
    /// A cache for one store's own steps (a CLI command): unbounded in
    /// practice, as a session's blobs are bounded (24 MiB spilled at most).
    fn default() -> Self {
        BlobCache::with_bound(usize::MAX)
    }
}

impl BlobCache {
    pub fn with_bound(most: usize) -> Self {
        BlobCache {
            most,
            kept: Mutex::default(),
        }
    }

    pub fn get(&self, key: &str) -> Option<Arc<Vec<u8>>> {
        self.kept
            .lock()
            .expect("blob cache lock")
            .blobs
            .get(key)
            .cloned()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.kept
            .lock()
            .expect("blob cache lock")
            .blobs
            .contains_key(key)
    }

    /// Keeps `data` under `key`, dropping the oldest blobs to make room; a
    /// blob larger than the whole bound is not kept.
    pub fn insert(&self, key: String, data: Arc<Vec<u8>>) {
        if data.len() > self.most {
            return;
        }
        let mut kept = self.kept.lock().expect("blob cache lock");
        if kept.blobs.contains_key(&key) {
            return;
        }
        while kept.bytes + data.len() > self.most {
            let Some(oldest) = kept.order.pop_front() else {
                break;
            };
            if let Some(gone) = kept.blobs.remove(&oldest) {
                kept.bytes -= gone.len();
            }
        }
        kept.bytes += data.len();
        kept.order.push_back(key.clone());
        kept.blobs.insert(key, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_blobs_go_past_the_byte_bound() {
        let cache = BlobCache::with_bound(10);
        cache.insert("a".into(), Arc::new(vec![0; 4]));
        cache.insert("b".into(), Arc::new(vec![0; 4]));
        cache.insert("c".into(), Arc::new(vec![0; 4]));
        assert!(!cache.contains("a"), "dropped to make room");
        assert!(cache.contains("b") && cache.contains("c"));
        cache.insert("huge".into(), Arc::new(vec![0; 11]));
        assert!(!cache.contains("huge"), "larger than the bound: not kept");
        assert!(cache.contains("b"), "and nothing dropped for it");
    }
}
