//! The engine's ports over the API server, for one namespace.
//!
//! - a session is a `Session` object: its input (messages, pause, retry)
//!   comes from `spec`, its state lives in `status`, written only through
//!   the status subresource with the `resourceVersion` read as a
//!   precondition (a stale write is a 409, reported as
//!   [`StoreError::Conflict`]);
//! - a continuation is a `Continuation` named by its token, with a
//!   controller owner reference to its Session and the label
//!   [`SESSION_LABEL`]; an existing one is adopted only when its controller
//!   owner is this very Session (same UID), so a re-created session never
//!   takes over the old one's calls;
//! - results and decisions are written once, through
//!   `continuations/status`, with the `resourceVersion` read as a
//!   precondition; the API server's CEL rules refuse a second, different
//!   value (a 422 is read back and mapped to [`WriteOnce`]);
//! - the result cache is [`MemoryCache`]: in the memory of one process
//!   (keys carry their scope: namespace and tool fingerprint), lost on
//!   restart, which only costs a re-run.
//!
//! - large results and old turns spill out of the Session status into
//!   owned, immutable, content-named ConfigMaps ([`crate::store::spill`]),
//!   so no object nears etcd's limit; reads put them back transparently.
//!
//! Sessions are created by `kubectl apply`; nothing here creates one.

use crate::api::quota::exceeded_quota;
use crate::api::session::{ArchivedTurnsStatus, SessionPhase, SessionSpec, SessionStatus};
use crate::api::{convert, legacy, stored};
use crate::api::{Agent, Continuation, Session};
use crate::core::acceptance::{self, Verdict};
use crate::core::conditions::{self, Status as CondStatus};
use crate::core::session::ContinuationSpec;
use crate::core::{CacheKey, ContinuationToken, Millis, SessionId, SessionState, ToolResult};
use crate::ports::{
    CachePort, ContinuationPort, SessionPort, SessionRef, StateConditions, StatusReport,
    SystemClock,
};
use crate::store::spill::{self, Blob};
use crate::store::{
    ContinuationRecord, Decision, SessionInput, SessionRecord, SessionSummary, StoreError,
    StoreResult, Version, Versioned, WriteOnce,
};
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition as MetaCondition, OwnerReference};
use k8s_openapi::ByteString;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tracing::{debug, warn};

mod blob_cache;
mod blobs;
mod continuations;
mod fork;
mod handed;
mod memory_cache;
mod ports;
mod records;
mod watched;
pub use blob_cache::{BlobCache, SHARED_BLOB_BYTES};
pub use fork::fork_spec;
pub use handed::{HandedCopy, HandedSessions, KnownVersions};
pub use memory_cache::*;
pub use records::*;
pub use watched::WatchedContinuations;

/// The label that ties a Continuation to its Session (by name; the owner
/// reference ties it by UID).
pub const SESSION_LABEL: &str = "agents-exe.io/session";

/// Writes to one object before a write-once write gives up on conflicts.
const MAX_RETRIES: usize = 8;

/// What the last read or write of a session showed: what a status write
/// must replace, and what it stamps.
#[derive(Clone, Debug)]
struct Seen {
    status: Value,
    generation: Option<i64>,
    conditions: Vec<MetaCondition>,
    version: String,
    /// What the rest of the object leaves for the status.
    budget: spill::Budget,
    /// The object's metadata at `version` but its managedFields: a status
    /// PUT sends it back unchanged (see [`KubeStore::replace_session_status`]).
    rest: Arc<Value>,
}

fn seen_of(obj: &Session) -> Seen {
    Seen {
        budget: spill::Budget::beside(
            spill::stored_bytes(&obj.spec),
            spill::stored_bytes(&obj.metadata),
        ),
        status: status_json(obj),
        generation: obj.metadata.generation,
        conditions: obj
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default(),
        version: obj.resource_version().unwrap_or_default(),
        rest: Arc::new(rest_of(obj)),
    }
}

/// The archived chunks of the status the session was read from, when
/// `seen` is that very version (else none: a write over another version is
/// refused, and packs from scratch meanwhile).
fn archived_before(seen: &Seen, expected: &Version) -> Vec<ArchivedTurnsStatus> {
    if seen.version != expected.0 {
        return Vec::new();
    }
    seen.status
        .get("archivedTurns")
        .and_then(|chunks| serde_json::from_value(chunks.clone()).ok())
        .unwrap_or_default()
}

/// What a status PUT sends beside the status: `obj`'s metadata but its
/// managedFields (`ObjectMeta` holds every field of the API's, so it
/// goes back as it came). Not the spec: a status write resets it to the
/// stored one before the field manager compares, and the typed spec
/// would not carry fields of a newer CRD back.
fn rest_of(obj: &Session) -> Value {
    let mut metadata = serde_json::to_value(&obj.metadata).unwrap_or_default();
    if let Some(m) = metadata.as_object_mut() {
        m.remove("managedFields");
    }
    json!({
        "apiVersion": <Session as kube::Resource>::api_version(&()),
        "kind": <Session as kube::Resource>::kind(&()),
        "metadata": metadata,
    })
}

/// The newest copy of its session a store got, and the versions before it.
struct Newest {
    copy: Option<Session>,
    older: Vec<String>,
    /// When the API server last confirmed `copy`.
    confirmed: Instant,
}

impl Default for Newest {
    fn default() -> Self {
        Newest {
            copy: None,
            older: Vec::new(),
            confirmed: Instant::now(),
        }
    }
}

impl Newest {
    fn note(&mut self, obj: &Session, confirmed: Instant) {
        if let Some(version) = self.copy.take().and_then(|c| c.resource_version()) {
            self.older.push(version);
        }
        self.copy = Some(obj.clone());
        self.confirmed = confirmed;
    }
}

/// The engine's store ports over the API server, in one namespace.
#[derive(Clone)]
pub struct KubeStore {
    namespace: String,
    sessions: Api<Session>,
    continuations: Api<Continuation>,
    agents: Api<Agent>,
    /// The conditions each status write carries, as the driver reports them.
    report: Arc<dyn StatusReport>,
    seen: Arc<Mutex<HashMap<String, Seen>>>,
    /// Continuations listed in this step: the engine re-ensures every open
    /// deferred call each step, and a listed one needs no API call.
    listed: Arc<Mutex<HashMap<String, Continuation>>>,
    /// Whether `listed` holds every continuation the session owns: the
    /// step listed them, and each write since was noted in it.
    listed_all: Arc<AtomicBool>,
    cache: Arc<MemoryCache>,
    /// Write requests sent (creates and patches, refused ones too).
    writes: Arc<AtomicU32>,
    configmaps: Api<ConfigMap>,
    /// Spilled blobs read or written (immutable, so never stale).
    blobs: Arc<BlobCache>,
    /// The Session a watch handed in: the first load starts from it
    /// instead of reading it again; a load after a conflict reads.
    handed: Arc<Mutex<Option<HandedCopy>>>,
    /// The newest copy of the session this store read or wrote, for the
    /// next step ([`HandedSessions::hand_back`]).
    newest: Arc<Mutex<Newest>>,
    /// The newest version of each session this process saw, shared by the
    /// operator's steps (see [`KnownVersions`]).
    known: Arc<KnownVersions>,
    /// The Continuations the operator's watch delivered: a step lists a
    /// session's from it when it is new enough (see
    /// [`WatchedContinuations`]); without it, from the API server.
    watched: Option<Arc<WatchedContinuations>>,
    client: Client,
}

/// A Continuation result larger than this (as JSON) spills into blobs; a
/// person's result of up to this size needs no ConfigMap permission.
const CONTINUATION_INLINE_BYTES: usize = 256 * 1024;
/// The ConfigMap key holding a blob.
const BLOB_KEY: &str = "data.gz";

impl KubeStore {
    pub fn new(client: Client, namespace: &str) -> Self {
        KubeStore {
            namespace: namespace.to_string(),
            sessions: Api::namespaced(client.clone(), namespace),
            continuations: Api::namespaced(client.clone(), namespace),
            agents: Api::namespaced(client.clone(), namespace),
            configmaps: Api::namespaced(client.clone(), namespace),
            client,
            blobs: Default::default(),
            handed: Default::default(),
            newest: Default::default(),
            known: Default::default(),
            watched: None,
            report: Arc::new(StateConditions),
            seen: Default::default(),
            listed: Default::default(),
            listed_all: Default::default(),
            cache: Default::default(),
            writes: Default::default(),
        }
    }

    /// The store of the current kubeconfig context (or the pod's service
    /// account), in `namespace` or else the context's namespace.
    pub async fn from_kubeconfig(namespace: Option<&str>) -> anyhow::Result<Self> {
        let config = kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!("--store kube: no usable kubeconfig ({e}); set KUBECONFIG or log in to the cluster first")
        })?;
        let ns = namespace
            .map(str::to_string)
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = Client::try_from(config)
            .map_err(|e| anyhow::anyhow!("--store kube: cannot build a client: {e}"))?;
        Ok(KubeStore::new(client, &ns))
    }

    /// Who decides the conditions every status write carries (by default
    /// the state's own, [`StateConditions`]).
    pub fn with_report(mut self, report: Arc<dyn StatusReport>) -> Self {
        self.report = report;
        self
    }

    /// Starts the first load from `session`, as a watch delivered it,
    /// instead of reading it again, when it is the newest version this
    /// process saw of it (see [`KnownVersions`]); otherwise the load reads.
    pub fn starting_from(self, copy: Option<HandedCopy>) -> Self {
        let trusted = copy.filter(|c| self.known.trusts(&c.session));
        *self.handed.lock().expect("handed lock") = trusted;
        self
    }

    /// Shares the newest versions seen between stores (the operator keeps
    /// one per process); set it before [`Self::starting_from`].
    pub fn with_known_versions(mut self, known: Arc<KnownVersions>) -> Self {
        self.known = known;
        self
    }

    /// Lists a session's Continuations from the operator's watch when it
    /// is new enough (see [`WatchedContinuations`]).
    pub fn with_watched_continuations(mut self, watched: Arc<WatchedContinuations>) -> Self {
        self.watched = Some(watched);
        self
    }

    /// Shares the spilled blobs read and written between stores (the
    /// operator keeps one per process, bounded in bytes).
    pub fn with_blob_cache(mut self, blobs: Arc<BlobCache>) -> Self {
        self.blobs = blobs;
        self
    }

    /// Shares a cache between stores (the operator keeps one per process).
    pub fn with_cache(mut self, cache: Arc<MemoryCache>) -> Self {
        self.cache = cache;
        self
    }

    /// Write requests this store sent to the API server so far.
    pub fn api_writes(&self) -> u32 {
        self.writes.load(Ordering::Relaxed)
    }

    fn count_write(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// The client this store sends its requests through.
    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn sessions_api(&self) -> &Api<Session> {
        &self.sessions
    }

    pub fn continuations_api(&self) -> &Api<Continuation> {
        &self.continuations
    }

    pub fn agents_api(&self) -> &Api<Agent> {
        &self.agents
    }

    fn remember(&self, name: &str, seen: Seen) {
        self.known.note(&self.namespace, name, &seen.version);
        self.seen
            .lock()
            .expect("seen lock")
            .insert(name.into(), seen);
    }

    /// Keeps `obj`, as a read or write returned it (the API server
    /// confirmed it at `confirmed`), as what the next write starts from
    /// and as the newest copy this process has seen.
    fn note_copy(&self, name: &str, obj: &Session, confirmed: Instant) {
        self.remember(name, seen_of(obj));
        self.newest
            .lock()
            .expect("newest lock")
            .note(obj, confirmed);
    }

    /// What the last read or write showed of the session, or a fresh read.
    async fn seen_or_read(&self, id: &SessionId) -> StoreResult<Seen> {
        if let Some(seen) = self.seen(&id.0) {
            return Ok(seen);
        }
        let obj = self
            .get_session(id)
            .await?
            .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
        Ok(seen_of(&obj))
    }

    fn seen(&self, name: &str) -> Option<Seen> {
        self.seen.lock().expect("seen lock").get(name).cloned()
    }

    /// The engine's record of a Session object, spilled parts read back.
    pub async fn read_session(&self, obj: &Session) -> StoreResult<SessionRecord> {
        let mut obj = obj.clone();
        if let Some(status) = obj.status.as_mut() {
            let name = obj.metadata.name.clone().unwrap_or_default();
            let uid = obj.metadata.uid.clone().unwrap_or_default();
            legacy::upgrade(status).map_err(|e| StoreError::Corrupt {
                what: format!("session {name} (status)"),
                why: e.to_string(),
            })?;
            spill::unpack(status, |blob| self.fetch_blob(&uid, blob))
                .await
                .map_err(|why| StoreError::Corrupt {
                    what: format!("session {name} (spilled status)"),
                    why,
                })?;
        }
        session_record(&obj)
    }

    /// The user name the API server knows this client by.
    pub async fn identity(&self) -> StoreResult<String> {
        use k8s_openapi::api::authentication::v1::SelfSubjectReview;
        let api: Api<SelfSubjectReview> = Api::all(self.client.clone());
        let review = api
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await
            .map_err(|e| match backend(e) {
                // Away for now: a caller may try again.
                StoreError::Unavailable(why) => StoreError::Unavailable(format!(
                    "asking the API server who this client is: {why}"
                )),
                other => StoreError::Backend(format!(
                    "asking the API server who this client is: {other}"
                )),
            })?;
        review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username)
            .ok_or_else(|| {
                StoreError::Backend("the API server did not say who this client is".into())
            })
    }

    /// The session object, or `None`.
    pub async fn get_session(&self, id: &SessionId) -> StoreResult<Option<Session>> {
        self.sessions.get_opt(&id.0).await.map_err(backend)
    }

    async fn load_record(&self, id: &SessionId) -> StoreResult<Option<Versioned<SessionRecord>>> {
        let handed = self.handed.lock().expect("handed lock").take();
        let handed = handed.filter(|c| c.session.name_any() == id.0);
        let (obj, confirmed) = match handed {
            Some(copy) => (copy.session, copy.confirmed),
            None => match self.get_session(id).await? {
                Some(obj) => (obj, Instant::now()),
                None => return Ok(None),
            },
        };
        let record = self.read_session(&obj).await?;
        self.note_copy(&id.0, &obj, confirmed);
        Ok(Some(Versioned {
            value: record,
            version: version_of(&obj.metadata)?,
        }))
    }

    async fn save_record(
        &self,
        record: &SessionRecord,
        expected: &Version,
    ) -> StoreResult<Version> {
        let id = &record.state.id;
        let seen = self.seen_or_read(id).await?;
        let mut status = stored::session_status(&record.state);
        status.traceparent.clone_from(&record.trace);
        status.observed_generation = seen.generation;
        status.conditions = self.conditions_for(&record.state, &seen);
        let prefix = blob_prefix(&id.0, &record.uid);
        let blobs = spill::pack_over(
            &mut status,
            &prefix,
            seen.budget.target,
            &archived_before(&seen, expected),
        );
        let owner = SessionRef {
            id: id.clone(),
            namespace: self.namespace.clone(),
            uid: record.uid.clone(),
        };
        self.put_blobs(&owner, blobs).await?;
        let new = serde_json::to_value(&status).map_err(|e| StoreError::Backend(e.to_string()))?;
        seen.budget
            .admit(spill::stored_bytes(&new))
            .map_err(|why| StoreError::TooLarge {
                id: id.clone(),
                why,
            })?;
        let written = if seen.version == expected.0 {
            self.replace_session_status(&id.0, &seen.rest, new).await
        } else {
            let status = merge_patch(&seen.status, &new);
            self.patch_session_status(&id.0, &expected.0, status).await
        };
        match written {
            Ok(obj) => version_of(&obj.metadata),
            Err(kube::Error::Api(s)) if is_conflict(&s) => Err(StoreError::Conflict {
                id: id.clone(),
                expected: expected.clone(),
            }),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(StoreError::SessionNotFound(id.clone()))
            }
            Err(kube::Error::Api(s)) if too_large(&s) => Err(StoreError::TooLarge {
                id: id.clone(),
                why: format!("the API server answered {} {}", s.code, s.message),
            }),
            Err(kube::Error::Api(s)) if s.code == 422 => Err(StoreError::Refused {
                id: id.clone(),
                why: format!(
                    "the API server answered 422: {}",
                    crate::http::clip(&s.message, 1000)
                ),
            }),
            Err(e) => Err(backend(e)),
        }
    }

    /// The conditions the driver's report gives `state`, in the API's shape.
    fn conditions_for(&self, state: &SessionState, seen: &Seen) -> Vec<MetaCondition> {
        let previous: Vec<conditions::Condition> =
            seen.conditions.iter().filter_map(core_condition).collect();
        self.report
            .conditions(state, &previous, seen.generation, wall_now())
            .iter()
            .map(meta_condition)
            .collect()
    }

    /// Writes the conditions and `observedGeneration` when they differ
    /// from the stored ones: a step that changed no state writes no status,
    /// yet the driver's `Ready` or a new generation must show. `state` is
    /// the state the last step left (or the loaded one). Returns true when
    /// it wrote; a conflict (someone wrote meanwhile, which triggers
    /// another reconcile) is left alone.
    pub async fn settle(&self, id: &SessionId, state: &SessionState) -> StoreResult<bool> {
        let seen = self.seen_or_read(id).await?;
        let wanted = self.conditions_for(state, &seen);
        let stored_generation = seen
            .status
            .get("observedGeneration")
            .and_then(Value::as_i64);
        let same = wanted.len() == seen.conditions.len()
            && wanted.iter().all(|w| {
                seen.conditions
                    .iter()
                    .any(|c| c.type_ == w.type_ && same_condition(c, w))
            });
        if same && stored_generation == seen.generation {
            return Ok(false);
        }
        let status = json!({"conditions": wanted, "observedGeneration": seen.generation});
        match self
            .patch_session_status(&id.0, &seen.version, status)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if is_conflict(&s) => Ok(false),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(StoreError::SessionNotFound(id.clone()))
            }
            Err(e) => Err(backend(e)),
        }
    }

    /// A status merge patch of Session `name`, made only if the Session
    /// is still at `version` (what `status` was computed from); counted,
    /// and its answer kept as the newest copy this process has seen.
    async fn patch_session_status(
        &self,
        name: &str,
        version: &str,
        status: Value,
    ) -> Result<Session, kube::Error> {
        let body = json!({"metadata": {"resourceVersion": version}, "status": status});
        self.count_write();
        let obj = self
            .sessions
            .patch_status(name, &status_patch_params(), &Patch::Merge(&body))
            .await?;
        self.note_copy(name, &obj, Instant::now());
        Ok(obj)
    }

    /// Replaces Session `name`'s status with `status` (a PUT of the status
    /// subresource), only if the Session is still at the version of
    /// `rest` (its metadata, as this store last saw it). A PUT
    /// costs kube-apiserver about 30 % less CPU than the same status as a
    /// merge patch, which it must first apply to the stored object
    /// (`cluster_write_cost`). The API server keeps all but the status of
    /// the stored object, yet its field manager compares the body's
    /// metadata with the stored one: the body carries it unchanged, or
    /// the finalizers, labels and annotations it lacked would lose their
    /// owners. Counted, and its answer kept as the newest copy this
    /// process has seen.
    async fn replace_session_status(
        &self,
        name: &str,
        rest: &Value,
        status: Value,
    ) -> Result<Session, kube::Error> {
        use kube::Resource;
        let mut body = rest.clone();
        body["status"] = status;
        let params = status_post_params();
        let bytes = serde_json::to_vec(&body).map_err(kube::Error::SerdeError)?;
        let request = kube::core::Request::new(Session::url_path(&(), Some(&self.namespace)))
            .replace_subresource("status", name, &params, bytes)
            .map_err(kube::Error::BuildRequest)?;
        self.count_write();
        let obj: Session = self.client.request(request).await?;
        self.note_copy(name, &obj, Instant::now());
        Ok(obj)
    }

    /// The newest copy of the session this store read or wrote, once,
    /// with the versions it got before that one (all older) and when the
    /// API server last confirmed it.
    pub fn take_newest(&self) -> Option<(Session, Vec<String>, Instant)> {
        let mut newest = self.newest.lock().expect("newest lock");
        let copy = newest.copy.take()?;
        let older = std::mem::take(&mut newest.older);
        Some((copy, older, newest.confirmed))
    }

    /// Changes the Session's spec (pause, resume, retry): a merge patch of
    /// the named fields only, if the Session is still at `version` (what
    /// the change was computed from). The operator acts on it.
    pub async fn patch_spec(
        &self,
        id: &SessionId,
        version: &Version,
        patch: Value,
    ) -> StoreResult<Session> {
        self.count_write();
        let body = json!({"metadata": {"resourceVersion": version.0}, "spec": patch});
        match self
            .sessions
            .patch(&id.0, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(s) => Ok(s),
            Err(kube::Error::Api(s)) if is_conflict(&s) => Err(StoreError::Conflict {
                id: id.clone(),
                expected: version.clone(),
            }),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(StoreError::SessionNotFound(id.clone()))
            }
            Err(e) => Err(backend(e)),
        }
    }

    /// Every Session in the namespace, for `agents session list`.
    pub async fn list_sessions(&self) -> StoreResult<Vec<SessionSummary>> {
        let list = self
            .sessions
            .list(&ListParams::default())
            .await
            .map_err(backend)?;
        let mut out = Vec::new();
        for s in list.items {
            let name = s.name_any();
            let status = s.status.clone().unwrap_or_default();
            let phase = listed_phase(&name, &status);
            let updated = status
                .conditions
                .iter()
                .map(|c| convert::millis(&c.last_transition_time))
                .max()
                .or_else(|| s.metadata.creation_timestamp.as_ref().map(convert::millis))
                .unwrap_or_default();
            out.push(SessionSummary {
                id: SessionId(name),
                phase,
                paused: status.phase == SessionPhase::Paused || s.spec.paused,
                pending: status.pending_count as usize,
                updated_at: updated,
            });
        }
        out.sort_by(|a, b| a.id.0.cmp(&b.id.0));
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
