//! A session's Continuations as the operator's watch last showed them, so
//! a step reads them without an API request when the watch is known to be
//! new enough.
//!
//! The watch shows what others wrote (a person's result, a decision)
//! before it wakes the session: the cache is updated first, then the
//! controller is triggered. It can lag behind this process's own writes,
//! though: a step right after one that created a Continuation might not
//! see it, and create it again. So every object this process received
//! from the API server (created, patched or read) whose version the cache
//! does not show yet is *pending*, and a session with a pending
//! Continuation is read from the API server, as before. Resource versions
//! are only compared for equality, as the API's contract allows: a pending
//! entry ends when the watch shows that very version, or when a read from
//! the API server shows the cache holds what the server holds.
//!
//! Until the first list of the watch is in, nothing is trusted. An object
//! too large to keep, or past the cache's byte bound, is kept as its
//! version only, and its session is read from the API server.

use super::handed::json_size;
use super::SESSION_LABEL;
use crate::api::Continuation;
use kube::runtime::watcher::Event;
use kube::ResourceExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// A Continuation larger than this (as JSON) is not kept whole.
const KEPT_OBJECT_BYTES: usize = 64 * 1024;
/// Bytes of whole objects kept at most; past it, new ones are not kept.
const KEPT_BYTES_MOST: usize = 64 * 1024 * 1024;

/// (namespace, session name): what a step asks for.
type SessionKey = (String, String);

/// What the cache holds of one Continuation.
#[derive(Clone, Debug)]
struct Entry {
    version: String,
    /// `None` when too large to keep: its session is read from the API.
    object: Option<Arc<Continuation>>,
    bytes: usize,
}

/// The Continuations the operator's watch delivered, by session.
#[derive(Debug, Default)]
pub struct WatchedContinuations(Mutex<Watched>);

#[derive(Debug, Default)]
struct Watched {
    /// The first list is in: an absent object is absent.
    synced: bool,
    by_session: HashMap<SessionKey, BTreeMap<String, Entry>>,
    /// Objects of a relist, kept until it is complete.
    relisting: Option<Vec<Continuation>>,
    /// Versions this process got from the API server that the watch has
    /// not shown yet, by session and name.
    pending: HashMap<SessionKey, HashMap<String, String>>,
    bytes: usize,
}

fn session_key(c: &Continuation) -> Option<SessionKey> {
    let session = c.labels().get(SESSION_LABEL)?.clone();
    Some((c.namespace().unwrap_or_default(), session))
}

impl WatchedContinuations {
    /// Takes in one event of the Continuation watch (before the controller
    /// sees it, so a woken step finds what woke it).
    pub fn apply(&self, event: &Event<Continuation>) {
        let mut w = self.0.lock().expect("watched lock");
        match event {
            Event::Apply(c) => w.upsert(c),
            Event::Delete(c) => w.remove(c),
            Event::Init => w.relisting = Some(Vec::new()),
            Event::InitApply(c) => {
                if let Some(buffer) = w.relisting.as_mut() {
                    buffer.push(c.clone());
                }
            }
            Event::InitDone => {
                let listed = w.relisting.take().unwrap_or_default();
                w.by_session.clear();
                w.bytes = 0;
                for c in &listed {
                    w.upsert(c);
                }
                w.synced = true;
            }
        }
    }

    /// The Continuations labelled with session `name` in `namespace`, when
    /// the cache is new enough to be trusted for them; `None` sends the
    /// step to the API server.
    pub fn labelled(&self, namespace: &str, name: &str) -> Option<Vec<Arc<Continuation>>> {
        let w = self.0.lock().expect("watched lock");
        let key = (namespace.to_string(), name.to_string());
        if !w.synced || w.pending.get(&key).is_some_and(|p| !p.is_empty()) {
            return None;
        }
        let Some(entries) = w.by_session.get(&key) else {
            return Some(Vec::new());
        };
        entries.values().map(|e| e.object.clone()).collect()
    }

    /// Notes an object this process got from the API server (its answer
    /// to a create or a patch, or a read): until the watch shows this
    /// version, its session is read from the API server.
    pub fn note_live(&self, c: &Continuation) {
        let (Some(key), Some(version)) = (session_key(c), c.resource_version()) else {
            return;
        };
        let mut w = self.0.lock().expect("watched lock");
        let name = c.name_any();
        let shown = w.version_of(&key, &name) == Some(version.as_str());
        let pending = w.pending.entry(key.clone()).or_default();
        if shown {
            pending.remove(&name);
        } else {
            pending.insert(name, version);
        }
        if pending.is_empty() {
            w.pending.remove(&key);
        }
    }

    /// Notes what a read from the API server listed for session `name`:
    /// a pending object the cache now holds as listed is no longer
    /// pending; one the cache is behind on waits for the listed version;
    /// one no longer listed is gone.
    pub fn note_listed(&self, namespace: &str, name: &str, listed: &[Continuation]) {
        let key = (namespace.to_string(), name.to_string());
        let mut w = self.0.lock().expect("watched lock");
        let Some(pending) = w.pending.get(&key).cloned() else {
            return;
        };
        let mut still = HashMap::new();
        for object in pending.keys() {
            let live = listed.iter().find(|c| &c.name_any() == object);
            let Some(version) = live.and_then(|c| c.resource_version()) else {
                continue;
            };
            if w.version_of(&key, object) != Some(version.as_str()) {
                still.insert(object.clone(), version);
            }
        }
        if still.is_empty() {
            w.pending.remove(&key);
        } else {
            w.pending.insert(key, still);
        }
    }
}

impl Watched {
    fn version_of(&self, key: &SessionKey, name: &str) -> Option<&str> {
        let entry = self.by_session.get(key)?.get(name)?;
        Some(entry.version.as_str())
    }

    fn upsert(&mut self, c: &Continuation) {
        let (Some(key), Some(version)) = (session_key(c), c.resource_version()) else {
            return;
        };
        let name = c.name_any();
        self.drop_entry(&key, &name);
        let mut kept = c.clone();
        kept.metadata.managed_fields = None;
        if let Some(notes) = kept.metadata.annotations.as_mut() {
            notes.remove("kubectl.kubernetes.io/last-applied-configuration");
        }
        let bytes = json_size(&kept);
        let fits = bytes <= KEPT_OBJECT_BYTES && self.bytes + bytes <= KEPT_BYTES_MOST;
        let entry = Entry {
            version: version.clone(),
            object: fits.then(|| Arc::new(kept)),
            bytes: if fits { bytes } else { 0 },
        };
        self.bytes += entry.bytes;
        self.by_session
            .entry(key.clone())
            .or_default()
            .insert(name.clone(), entry);
        self.forget_pending(&key, &name, Some(&version));
    }

    fn remove(&mut self, c: &Continuation) {
        let Some(key) = session_key(c) else {
            return;
        };
        let name = c.name_any();
        self.drop_entry(&key, &name);
        self.forget_pending(&key, &name, None);
    }

    fn drop_entry(&mut self, key: &SessionKey, name: &str) {
        let Some(entries) = self.by_session.get_mut(key) else {
            return;
        };
        if let Some(old) = entries.remove(name) {
            self.bytes -= old.bytes;
        }
        if entries.is_empty() {
            self.by_session.remove(key);
        }
    }

    /// Ends the pending entry of `name` when the watch shows `version`
    /// (any version: the object is gone).
    fn forget_pending(&mut self, key: &SessionKey, name: &str, version: Option<&str>) {
        let Some(pending) = self.pending.get_mut(key) else {
            return;
        };
        if version.is_none() || pending.get(name).map(String::as_str) == version {
            pending.remove(name);
        }
        if pending.is_empty() {
            self.pending.remove(key);
        }
    }
}

#[cfg(test)]
mod tests;
