//! A session's Continuations as the operator's watch last showed them, so
//! a step reads them without an API request when the watch is known to be
//! new enough.
//!
//! The watch shows what others wrote (a person's result, a decision)
//! before it wakes the session: the cache is updated first, then the
//! controller is triggered. So a view that lags the API server only by
//! what the watch has yet to deliver is safe: each later change wakes the
//! session again. The watch can lag behind this process's own writes,
//! though: a step right after one that created a Continuation might not
//! see it, and create it again. So every object this process got from the
//! API server (created, patched or read) whose version the watch has not
//! shown yet is *pending*:
//!
//! - while the watch shows nothing of it, or only versions this process
//!   itself got before (so older ones), the view holds this process's own
//!   copy: anything newer is still to be delivered;
//! - when the watch shows a version this process never got, nothing says
//!   which of the two is newer (resource versions are only compared for
//!   equality, as the API's contract allows), and the session is read from
//!   the API server, as before the cache; that read settles it;
//! - the entry ends when the watch shows this process's newest version, or
//!   a read shows the cache holds what the server holds.
//!
//! Until the first list of the watch is in, nothing is trusted; after a
//! relist (objects may have gone meanwhile) pending objects are read
//! again. An object too large to keep, or past the cache's byte bound, is
//! kept as its version only, and its session is read from the API server.

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
/// Own versions remembered per pending object (the oldest go first).
const OWN_VERSIONS_MOST: usize = 16;

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

/// An object this process got from the API server that the watch has not
/// shown yet.
#[derive(Clone, Debug, Default)]
struct Pending {
    /// The versions this process got, and those its writes were based on,
    /// oldest first: none is newer than the last, this process's newest.
    ours: Vec<String>,
    /// Our newest copy, while it is known to be at least as new as what
    /// the watch shows; `None`: the session is read from the API server.
    copy: Option<Arc<Continuation>>,
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
    pending: HashMap<SessionKey, HashMap<String, Pending>>,
    bytes: usize,
}

fn session_key(c: &Continuation) -> Option<SessionKey> {
    let session = c.labels().get(SESSION_LABEL)?.clone();
    Some((c.namespace().unwrap_or_default(), session))
}

/// `c` as kept: without what no step reads, `None` when too large.
fn kept(c: &Continuation) -> Option<(Continuation, usize)> {
    let mut kept = c.clone();
    kept.metadata.managed_fields = None;
    if let Some(notes) = kept.metadata.annotations.as_mut() {
        notes.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    let bytes = json_size(&kept);
    (bytes <= KEPT_OBJECT_BYTES).then_some((kept, bytes))
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
            Event::InitDone => w.relisted(),
        }
    }

    /// The Continuations labelled with session `name` in `namespace`, when
    /// the cache (with this process's own newer copies) is new enough to be
    /// trusted for them; `None` sends the step to the API server.
    pub fn labelled(&self, namespace: &str, name: &str) -> Option<Vec<Arc<Continuation>>> {
        let w = self.0.lock().expect("watched lock");
        if !w.synced {
            return None;
        }
        let key = (namespace.to_string(), name.to_string());
        let mut view: BTreeMap<&String, Option<Arc<Continuation>>> = BTreeMap::new();
        for (object, entry) in w.by_session.get(&key).into_iter().flatten() {
            view.insert(object, entry.object.clone());
        }
        for (object, pending) in w.pending.get(&key).into_iter().flatten() {
            view.insert(object, Some(pending.copy.clone()?));
        }
        view.into_values().collect()
    }

    /// Notes an object this process got from the API server: its answer
    /// to a create or a patch of the object at version `based_on` (older,
    /// then, than the answer), or a read.
    pub fn note_live(&self, c: &Continuation, based_on: Option<&str>) {
        let mut w = self.0.lock().expect("watched lock");
        w.note_live(c, based_on);
    }

    /// Notes what a read from the API server listed for session `name`:
    /// each pending object is settled by its listed copy, and one no
    /// longer listed is gone.
    pub fn note_listed(&self, namespace: &str, name: &str, listed: &[Continuation]) {
        let key = (namespace.to_string(), name.to_string());
        let mut w = self.0.lock().expect("watched lock");
        let Some(pending) = w.pending.get(&key) else {
            return;
        };
        let objects: Vec<String> = pending.keys().cloned().collect();
        for object in objects {
            match listed.iter().find(|c| c.name_any() == object) {
                Some(live) => w.note_live(live, None),
                None => w.end_pending(&key, &object),
            }
        }
    }
}

impl Watched {
    fn version_of(&self, key: &SessionKey, name: &str) -> Option<&str> {
        let entry = self.by_session.get(key)?.get(name)?;
        Some(entry.version.as_str())
    }

    fn note_live(&mut self, c: &Continuation, based_on: Option<&str>) {
        let (Some(key), Some(version)) = (session_key(c), c.resource_version()) else {
            return;
        };
        let name = c.name_any();
        let shown = self.version_of(&key, &name).map(str::to_string);
        if shown.as_deref() == Some(version.as_str()) {
            self.end_pending(&key, &name);
            return;
        }
        let pending = self
            .pending
            .entry(key)
            .or_default()
            .entry(name)
            .or_default();
        for known in based_on.into_iter().chain([version.as_str()]) {
            if pending.ours.last().map(String::as_str) != Some(known) {
                pending.ours.push(known.to_string());
            }
        }
        if pending.ours.len() > OWN_VERSIONS_MOST {
            pending.ours.remove(0);
        }
        // Ours is newer only when the watch shows nothing or an own older one.
        let newer = shown.is_none_or(|v| pending.ours.contains(&v));
        pending.copy = newer
            .then(|| kept(c))
            .flatten()
            .map(|(copy, _)| Arc::new(copy));
    }

    fn upsert(&mut self, c: &Continuation) {
        let (Some(key), Some(version)) = (session_key(c), c.resource_version()) else {
            return;
        };
        let name = c.name_any();
        self.drop_entry(&key, &name);
        let fits = kept(c).filter(|(_, bytes)| self.bytes + bytes <= KEPT_BYTES_MOST);
        let entry = Entry {
            version: version.clone(),
            bytes: fits.as_ref().map_or(0, |(_, bytes)| *bytes),
            object: fits.map(|(object, _)| Arc::new(object)),
        };
        self.bytes += entry.bytes;
        self.by_session
            .entry(key.clone())
            .or_default()
            .insert(name.clone(), entry);
        self.shown(&key, &name, &version);
    }

    /// The watch shows `version` of `name`: our newest ends the pending
    /// entry, an older one of ours leaves our copy in the view, any other
    /// sends the session to the API server.
    fn shown(&mut self, key: &SessionKey, name: &str, version: &str) {
        let Some(pending) = self.pending.get_mut(key).and_then(|p| p.get_mut(name)) else {
            return;
        };
        if pending.ours.last().map(String::as_str) == Some(version) {
            self.end_pending(key, name);
        } else if !pending.ours.iter().any(|v| v == version) {
            pending.copy = None;
        }
    }

    fn remove(&mut self, c: &Continuation) {
        let Some(key) = session_key(c) else {
            return;
        };
        let name = c.name_any();
        self.drop_entry(&key, &name);
        let version = c.resource_version().unwrap_or_default();
        let Some(pending) = self.pending.get_mut(&key).and_then(|p| p.get_mut(&name)) else {
            return;
        };
        if pending.ours.contains(&version) {
            self.end_pending(&key, &name);
        } else {
            // Deleted, and created again since? A read tells.
            pending.copy = None;
        }
    }

    /// A relist is complete: the cache becomes what it listed. A pending
    /// object the list did not show may have gone meanwhile: read it.
    fn relisted(&mut self) {
        let listed = self.relisting.take().unwrap_or_default();
        self.by_session.clear();
        self.bytes = 0;
        for c in &listed {
            self.upsert(c);
        }
        for (key, objects) in self.pending.iter_mut() {
            for (name, pending) in objects.iter_mut() {
                let shown = self.by_session.get(key).and_then(|e| e.get(name));
                if shown.is_none() {
                    pending.copy = None;
                }
            }
        }
        self.synced = true;
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

    fn end_pending(&mut self, key: &SessionKey, name: &str) {
        let Some(pending) = self.pending.get_mut(key) else {
            return;
        };
        pending.remove(name);
        if pending.is_empty() {
            self.pending.remove(key);
        }
    }
}

#[cfg(test)]
mod tests;
