//! A step that starts from the Session the watch handed in, only when that
//! copy is exactly what a fresh read would return.
//!
//! The watch can lag behind this process's own writes: a step from a copy
//! older than its own last write would see its own claim of a call as work
//! cut off and run that call again. So the copy is used only when its
//! resourceVersion is the newest this process has seen of the session
//! through its own requests (or the process never touched the session);
//! otherwise the step reads, as it always did. Resource versions are only
//! compared for equality, as the API's contract allows.
//!
//! A step hands back the newest copy it holds (what it read or its last
//! write returned) when the watch delivered nothing meanwhile: the next
//! step, often a wake by a result, then starts from it without a read.
//! Anything newer is still to be delivered by the watch, which replaces
//! the copy and wakes the session again. A copy is handed on only while
//! the API server confirmed it (a read, a write, a watch delivery) less
//! than [`HANDED_FRESH`] ago: steps on a timer (the resync) never go on
//! from a copy for ever, so an operator cut off from the API server reads,
//! fails and says so (the stall alert) instead of reporting success.

use crate::api::Session;
use kube::ResourceExt;
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Key = (String, String);

fn key_of(session: &Session) -> Key {
    (session.namespace().unwrap_or_default(), session.name_any())
}

/// Whole objects kept at most: each waits only for its reconcile, and one
/// whose reconcile never comes (it was deleted) must not pile up.
const HANDED_MOST: usize = 4096;
/// Bytes (as JSON) of whole objects kept at most, so a burst of long
/// sessions cannot grow the operator: a copy past it is not kept, and its
/// step reads instead.
const HANDED_BYTES_MOST: usize = 32 * 1024 * 1024;
/// Sessions whose newest known version is kept at most.
const KNOWN_MOST: usize = 200_000;
/// How long after the API server last confirmed a copy a step may start
/// from it without a read.
pub const HANDED_FRESH: Duration = Duration::from_secs(30);

/// A whole Session a step may start from, and when the API server last
/// confirmed it (read, written or delivered by the watch).
#[derive(Clone, Debug)]
pub struct HandedCopy {
    pub session: Session,
    pub confirmed: Instant,
}

/// The newest whole Session objects a watch delivered, each kept until a
/// step takes it, within [`HANDED_MOST`] objects and [`HANDED_BYTES_MOST`].
#[derive(Clone, Default)]
pub struct HandedSessions(Arc<Mutex<Handed>>);

#[derive(Default)]
struct Handed {
    kept: HashMap<Key, Kept>,
    /// Bytes of the kept copies' JSON, which is what they take in memory.
    bytes: usize,
}

/// A copy as kept: its compact JSON (a parsed Session takes about six
/// times as much, so a bound on JSON bytes would not bound the memory),
/// without its managedFields, which no step reads.
struct Kept {
    json: Box<[u8]>,
    version: Option<String>,
    confirmed: Instant,
}

/// A Session serialised as itself but without its managedFields, from a
/// borrow: a watch delivers every write, and a clone of each delivery
/// only to drop a part of it cost a copy of the whole object.
struct Bare<'a>(&'a Session);

impl serde::Serialize for Bare<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use kube::Resource;
        use serde::ser::SerializeMap;
        let session = self.0;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("apiVersion", &Session::api_version(&()))?;
        map.serialize_entry("kind", &Session::kind(&()))?;
        map.serialize_entry("metadata", &BareMeta(&session.metadata))?;
        map.serialize_entry("spec", &session.spec)?;
        if let Some(status) = &session.status {
            map.serialize_entry("status", status)?;
        }
        map.end()
    }
}

/// Object metadata without managedFields: serialised through
/// `ObjectMeta`'s own `Serialize`, with the one field it skips left out.
struct BareMeta<'a>(&'a kube::api::ObjectMeta);

impl serde::Serialize for BareMeta<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let m = self.0;
        let meta = kube::api::ObjectMeta {
            annotations: m.annotations.clone(),
            creation_timestamp: m.creation_timestamp.clone(),
            deletion_grace_period_seconds: m.deletion_grace_period_seconds,
            deletion_timestamp: m.deletion_timestamp.clone(),
            finalizers: m.finalizers.clone(),
            generate_name: m.generate_name.clone(),
            generation: m.generation,
            labels: m.labels.clone(),
            managed_fields: None,
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            owner_references: m.owner_references.clone(),
            resource_version: m.resource_version.clone(),
            self_link: m.self_link.clone(),
            uid: m.uid.clone(),
        };
        meta.serialize(serializer)
    }
}

impl Kept {
    fn of(session: &Session, confirmed: Instant) -> Option<Kept> {
        let json = serde_json::to_vec(&Bare(session)).ok()?.into_boxed_slice();
        Some(Kept {
            json,
            version: session.resource_version(),
            confirmed,
        })
    }

    fn copy(&self) -> Option<HandedCopy> {
        let session = serde_json::from_slice(&self.json).ok()?;
        Some(HandedCopy {
            session,
            confirmed: self.confirmed,
        })
    }
}

impl Handed {
    fn remove(&mut self, key: &Key) -> Option<Kept> {
        let kept = self.kept.remove(key)?;
        self.bytes -= kept.json.len();
        Some(kept)
    }

    fn insert(&mut self, key: Key, kept: Kept) {
        self.bytes += kept.json.len();
        if let Some(old) = self.kept.insert(key, kept) {
            self.bytes -= old.json.len();
        }
    }
}

impl HandedSessions {
    /// Keeps `session` (the watch's newest) for its next step.
    pub fn hand_in(&self, session: &Session) {
        let key = key_of(session);
        let mut handed = self.0.lock().expect("handed lock");
        handed.remove(&key);
        let Some(kept) = Kept::of(session, Instant::now()) else {
            return;
        };
        let full = handed.kept.len() >= HANDED_MOST;
        if full || handed.bytes + kept.json.len() > HANDED_BYTES_MOST {
            return;
        }
        handed.insert(key, kept);
    }

    /// Keeps `session`, the newest copy a step holds, for the next step,
    /// unless the watch handed in a copy since that step took its own that
    /// is not one of the `older` versions the step itself got (another may
    /// be newer: versions do not say). A finished session is not kept:
    /// only an edit steps it again, and the watch delivers that.
    pub fn hand_back(&self, session: &Session, older: &[String], confirmed: Instant) {
        let finished = session.status.as_ref().is_some_and(|s| {
            matches!(
                s.phase,
                crate::api::session::SessionPhase::Succeeded
                    | crate::api::session::SessionPhase::Failed
            )
        });
        if finished {
            return;
        }
        let Some(kept) = Kept::of(session, confirmed) else {
            return;
        };
        let key = key_of(session);
        let mut handed = self.0.lock().expect("handed lock");
        let replaceable = match handed.kept.get(&key) {
            None => true,
            Some(delivered) => delivered
                .version
                .as_ref()
                .is_some_and(|v| older.contains(v)),
        };
        if !replaceable {
            return;
        }
        // The copy there is one this step got itself: older than this one.
        handed.remove(&key);
        // Half the room at most, so copies kept for waiting sessions never
        // crowd out what the watch hands in.
        let full = handed.kept.len() >= HANDED_MOST / 2
            || handed.bytes + kept.json.len() > HANDED_BYTES_MOST / 2;
        if !full {
            handed.insert(key, kept);
        }
    }

    /// Drops the copy of `session` (deleted: no step will take it).
    pub fn forget(&self, session: &Session) {
        self.0.lock().expect("handed lock").remove(&key_of(session));
    }

    /// The copy last handed in or back for `namespace/name`, once; none
    /// when the API server confirmed it [`HANDED_FRESH`] ago or more.
    pub fn take(&self, namespace: &str, name: &str) -> Option<HandedCopy> {
        let key = (namespace.to_string(), name.to_string());
        let kept = self.0.lock().expect("handed lock").remove(&key)?;
        (kept.confirmed.elapsed() < HANDED_FRESH)
            .then(|| kept.copy())
            .flatten()
    }

    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.0.lock().expect("handed lock").bytes
    }
}

/// The newest resourceVersion this process saw of each session through its
/// own reads and writes, and the few it saw just before (superseded).
#[derive(Default)]
pub struct KnownVersions {
    newest: Mutex<HashMap<Key, Known>>,
    /// Set once entries were dropped: a session with no entry may then have
    /// been touched, and its handed copy is no longer trusted.
    forgot: AtomicBool,
}

/// Versions of one session this process saw.
struct Known {
    newest: String,
    /// When `newest` was seen.
    at: Instant,
    /// Versions seen before `newest` since the watch last delivered the
    /// newest: each is older than it. At most [`SUPERSEDED_MOST`].
    superseded: Vec<String>,
}

/// Superseded versions kept per session: a step writes a few times (claim,
/// reply, results), and the watch delivers each of those writes after it.
const SUPERSEDED_MOST: usize = 4;

impl KnownVersions {
    /// Notes `version` as the newest seen of `namespace/name`.
    pub fn note(&self, namespace: &str, name: &str, version: &str) {
        let mut newest = self.newest.lock().expect("known lock");
        let key: Key = (namespace.into(), name.into());
        if newest.len() >= KNOWN_MOST && !newest.contains_key(&key) {
            newest.clear();
            self.forgot.store(true, Ordering::Relaxed);
        }
        let mut superseded = Vec::new();
        if let Some(was) = newest.remove(&key) {
            superseded = was.superseded;
            if was.newest != version {
                if superseded.len() >= SUPERSEDED_MOST {
                    superseded.remove(0);
                }
                superseded.push(was.newest);
            }
        }
        let known = Known {
            newest: version.into(),
            at: Instant::now(),
            superseded,
        };
        newest.insert(key, known);
    }

    /// Whether a step may start from `session` as handed in: it is the
    /// newest this process knows of, or this process never touched it.
    pub fn trusts(&self, session: &Session) -> bool {
        let Some(version) = session.resource_version() else {
            return false;
        };
        match self
            .newest
            .lock()
            .expect("known lock")
            .get(&key_of(session))
        {
            Some(known) => known.newest == version,
            None => !self.forgot.load(Ordering::Relaxed),
        }
    }

    /// Whether `session`, as the watch delivered it, is a version this
    /// process already saw replaced by a newer one, lately: the watch
    /// still has that newer one to deliver (and with it anything after
    /// it), so a step for this copy has nothing to do and needs no read.
    /// Lately means within [`HANDED_FRESH`]: past that, a step reads as
    /// before, so an operator cut off from the API server still finds out.
    /// Once the watch delivers the newest, the versions before it are
    /// dropped: none of them comes again.
    pub fn is_superseded(&self, session: &Session) -> bool {
        let Some(version) = session.resource_version() else {
            return false;
        };
        let mut newest = self.newest.lock().expect("known lock");
        let Some(known) = newest.get_mut(&key_of(session)) else {
            return false;
        };
        if known.newest == version {
            known.superseded = Vec::new();
            return false;
        }
        known.at.elapsed() < HANDED_FRESH && known.superseded.contains(&version)
    }
}

/// JSON bytes of `value`, counted without keeping them.
pub(super) fn json_size<T: serde::Serialize>(value: &T) -> usize {
    struct Count(usize);
    impl Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    match serde_json::to_writer(&mut count, value) {
        Ok(()) => count.0,
        Err(_) => usize::MAX / 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::session::SessionSpec;

    fn session(name: &str, version: &str, message: &str) -> Session {
        let spec: SessionSpec = serde_json::from_value(
            serde_json::json!({"agentRef": {"name": "a"}, "messages": [message]}),
        )
        .expect("a valid spec");
        let mut s = Session::new(name, spec);
        s.metadata.namespace = Some("ns".into());
        s.metadata.resource_version = Some(version.into());
        s
    }

    #[test]
    fn a_copy_older_than_the_last_write_is_not_trusted() {
        let known = KnownVersions::default();
        let watched = session("s", "5", "hi");
        assert!(
            known.trusts(&watched),
            "never touched: the copy is as good as a read"
        );
        known.note("ns", "s", "6");
        assert!(
            !known.trusts(&watched),
            "the process wrote 6 after the copy's 5"
        );
        known.note("ns", "s", "5");
        assert!(known.trusts(&watched));
    }

    #[test]
    fn a_copy_the_process_saw_replaced_is_superseded_until_the_watch_catches_up() {
        let known = KnownVersions::default();
        let (five, six) = (session("s", "5", "hi"), session("s", "6", "hi"));
        assert!(!known.is_superseded(&five), "never touched");
        known.note("ns", "s", "5");
        assert!(!known.is_superseded(&five), "the newest is not superseded");
        known.note("ns", "s", "6");
        known.note("ns", "s", "7");
        assert!(known.is_superseded(&five), "5 was seen replaced");
        assert!(known.is_superseded(&six));
        assert!(
            !known.is_superseded(&session("s", "8", "edited")),
            "a version it never saw may be newer: the step reads"
        );
        assert!(
            !known.is_superseded(&session("other", "5", "hi")),
            "another session"
        );
        assert!(!known.is_superseded(&session("s", "7", "hi")), "the newest");
        assert!(
            !known.is_superseded(&five),
            "once the watch delivered the newest, older copies come no more"
        );
        for v in 10..20 {
            known.note("ns", "s", &v.to_string());
        }
        let kept = known.newest.lock().unwrap()[&("ns".into(), "s".into())]
            .superseded
            .len();
        assert_eq!(kept, SUPERSEDED_MOST, "bounded");
    }

    #[test]
    fn a_version_replaced_long_ago_is_read_again() {
        let known = KnownVersions::default();
        known.note("ns", "s", "5");
        known.note("ns", "s", "6");
        let long_ago = Instant::now().checked_sub(HANDED_FRESH).unwrap();
        known
            .newest
            .lock()
            .unwrap()
            .get_mut(&("ns".into(), "s".into()))
            .unwrap()
            .at = long_ago;
        assert!(!known.is_superseded(&session("s", "5", "hi")));
    }

    #[test]
    fn once_entries_were_dropped_an_untouched_session_is_read() {
        let known = KnownVersions::default();
        for i in 0..=KNOWN_MOST {
            known.note("ns", &format!("s{i}"), "1");
        }
        assert!(!known.trusts(&session("other", "1", "hi")));
    }

    #[test]
    fn a_copy_handed_back_never_replaces_one_the_watch_delivered_since() {
        let handed = HandedSessions::default();
        handed.hand_back(&session("s", "7", "hi"), &[], Instant::now());
        assert_eq!(
            handed
                .take("ns", "s")
                .and_then(|c| c.session.resource_version()),
            Some("7".into()),
            "nothing delivered meanwhile: kept"
        );
        handed.hand_in(&session("s", "5", "hi"));
        handed.hand_back(
            &session("s", "7", "hi"),
            &["5".into(), "6".into()],
            Instant::now(),
        );
        assert_eq!(
            handed
                .take("ns", "s")
                .and_then(|c| c.session.resource_version()),
            Some("7".into()),
            "the watch delivered one the step wrote before: replaced"
        );
        assert_eq!(handed.bytes(), 0);
        handed.hand_in(&session("s", "8", "edited"));
        handed.hand_back(
            &session("s", "7", "hi"),
            &["5".into(), "6".into()],
            Instant::now(),
        );
        assert_eq!(
            handed
                .take("ns", "s")
                .and_then(|c| c.session.resource_version()),
            Some("8".into()),
            "the watch's copy stays"
        );
        let mut done = session("s", "9", "hi");
        done.status = Some(crate::api::SessionStatus {
            phase: crate::api::session::SessionPhase::Succeeded,
            ..Default::default()
        });
        handed.hand_back(&done, &[], Instant::now());
        assert!(handed.take("ns", "s").is_none(), "finished: not kept");
        handed.hand_in(&session("s", "10", "hi"));
        handed.forget(&session("s", "11", "hi"));
        assert!(handed.take("ns", "s").is_none(), "deleted: forgotten");
        assert_eq!(handed.bytes(), 0);
    }

    #[test]
    fn a_kept_copy_comes_back_whole_without_its_managed_fields() {
        let handed = HandedSessions::default();
        let mut watched = session("s", "5", "hi");
        watched.metadata.managed_fields = Some(vec![Default::default()]);
        watched.metadata.labels = Some([("team".into(), "a".into())].into());
        watched.metadata.finalizers = Some(vec!["agents-exe.io/x".into()]);
        watched.metadata.uid = Some("u-1".into());
        watched.metadata.generation = Some(3);
        watched.status = Some(crate::api::SessionStatus {
            state: Some(
                serde_json::json!({"phase": "Waiting", "turns": [{"role": "user", "message": "hi"}]}),
            ),
            ..Default::default()
        });
        handed.hand_in(&watched);
        let mut bare = watched.clone();
        bare.metadata.managed_fields = None;
        assert_eq!(handed.bytes(), serde_json::to_vec(&bare).unwrap().len());
        let copy = handed.take("ns", "s").expect("kept");
        assert_eq!(
            serde_json::to_value(&copy.session).unwrap(),
            serde_json::to_value(&bare).unwrap()
        );
        assert_eq!(handed.bytes(), 0);
    }

    #[test]
    fn a_copy_the_api_server_confirmed_long_ago_is_not_started_from() {
        let handed = HandedSessions::default();
        let long_ago = Instant::now().checked_sub(HANDED_FRESH).unwrap();
        handed.hand_back(&session("s", "7", "hi"), &[], long_ago);
        assert!(handed.take("ns", "s").is_none(), "the step reads");
        assert_eq!(handed.bytes(), 0);
        let lately = Instant::now() - HANDED_FRESH / 2;
        handed.hand_back(&session("s", "7", "hi"), &[], lately);
        let copy = handed.take("ns", "s").expect("fresh enough");
        assert_eq!(
            copy.confirmed, lately,
            "a step hands on when it was confirmed"
        );
    }

    #[test]
    fn copies_handed_back_take_half_the_room_at_most() {
        let handed = HandedSessions::default();
        for i in 0..HANDED_MOST {
            handed.hand_back(&session(&format!("s{i}"), "1", "hi"), &[], Instant::now());
        }
        assert_eq!(handed.0.lock().unwrap().kept.len(), HANDED_MOST / 2);
        handed.hand_in(&session("watched", "1", "hi"));
        assert!(handed.take("ns", "watched").is_some(), "room for the watch");
    }

    #[test]
    fn handed_copies_are_bounded_in_bytes_and_taken_once() {
        let handed = HandedSessions::default();
        let big = "x".repeat(HANDED_BYTES_MOST / 2 + 1);
        handed.hand_in(&session("a", "1", &big));
        handed.hand_in(&session("b", "1", &big));
        assert!(
            handed.take("ns", "b").is_none(),
            "past the byte bound: not kept"
        );
        handed.hand_in(&session("a", "2", "small"));
        assert!(
            handed.bytes() < 1024,
            "a newer copy replaces the old one's bytes"
        );
        let taken = handed.take("ns", "a").expect("kept");
        assert_eq!(taken.session.resource_version().as_deref(), Some("2"));
        assert!(handed.take("ns", "a").is_none());
        assert_eq!(handed.bytes(), 0);
    }
}
