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
use crate::api::session::{SessionPhase, SessionSpec, SessionStatus};
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
use tracing::{debug, warn};

mod blob_cache;
mod handed;
pub use blob_cache::{BlobCache, SHARED_BLOB_BYTES};
pub use handed::{HandedSessions, KnownVersions};

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
    handed: Arc<Mutex<Option<Session>>>,
    /// The newest version of each session this process saw, shared by the
    /// operator's steps (see [`KnownVersions`]).
    known: Arc<KnownVersions>,
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
            known: Default::default(),
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
    pub fn starting_from(self, session: Option<Session>) -> Self {
        let trusted = session.filter(|s| self.known.trusts(s));
        *self.handed.lock().expect("handed lock") = trusted;
        self
    }

    /// Shares the newest versions seen between stores (the operator keeps
    /// one per process); set it before [`Self::starting_from`].
    pub fn with_known_versions(mut self, known: Arc<KnownVersions>) -> Self {
        self.known = known;
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

    /// A Continuation as the engine's record, a spilled result read back.
    /// The continuation with its spilled result read back. A result that
    /// cannot be read (a bad spill marker, missing or oversized blobs) is
    /// the writer's mistake: that call fails with an error saying so, and
    /// the session carries on.
    async fn read_continuation(&self, c: &Continuation) -> StoreResult<ContinuationRecord> {
        let mut c = c.clone();
        let uid = controller_uid(&c).unwrap_or_default();
        if let Some(outcome) = c.status.as_mut().and_then(|s| s.outcome.as_mut()) {
            let unpacked =
                spill::unpack_result(&mut outcome.result, |blob| self.fetch_blob(&uid, blob));
            if let Err(why) = unpacked.await {
                outcome.result = convert::result_value(&malformed(&outcome.completed_by, &why));
            }
        }
        continuation_record(&c)
    }

    /// A blob of the session with `uid`: a ConfigMap it owns, so a marker
    /// cannot pull another session's data (or any other ConfigMap) in.
    async fn fetch_blob(&self, uid: &str, name: String) -> Result<Vec<u8>, String> {
        let key = blob_key(uid, &name);
        if let Some(b) = self.blobs.get(&key) {
            return Ok(b.to_vec());
        }
        let cm = self
            .configmaps
            .get_opt(&name)
            .await
            .map_err(|e| format!("reading ConfigMap {name}: {e}"))?
            .ok_or_else(|| format!("ConfigMap {name} holding spilled data is missing"))?;
        let owned = cm.owner_references().iter().any(|o| o.uid == uid);
        if uid.is_empty() || !owned {
            return Err(format!(
                "ConfigMap {name} is not this session's (it is not owned by session uid {uid}); \
                 spilled data is read only from the session's own blobs"
            ));
        }
        let data = cm
            .binary_data
            .and_then(|mut d| d.remove(BLOB_KEY))
            .ok_or_else(|| format!("ConfigMap {name} has no {BLOB_KEY}"))?
            .0;
        self.blobs.insert(key, Arc::new(data.clone()));
        Ok(data)
    }

    /// Creates the blobs not known to exist: immutable ConfigMaps owned by
    /// the session (garbage collected with it). Names derive from content,
    /// so an existing one already holds these bytes.
    async fn put_blobs(&self, owner: &SessionRef, blobs: Vec<Blob>) -> StoreResult<()> {
        for blob in blobs {
            let key = blob_key(&owner.uid, &blob.name);
            if self.blobs.contains(&key) {
                continue;
            }
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(blob.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    labels: Some(BTreeMap::from([(
                        SESSION_LABEL.to_string(),
                        owner.id.0.clone(),
                    )])),
                    owner_references: Some(vec![owner_reference(owner)]),
                    ..ObjectMeta::default()
                },
                binary_data: Some(BTreeMap::from([(
                    BLOB_KEY.to_string(),
                    ByteString(blob.data.clone()),
                )])),
                immutable: Some(true),
                ..ConfigMap::default()
            };
            self.count_write();
            match self.configmaps.create(&PostParams::default(), &cm).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_already_exists() => {}
                Err(e) if exceeded_quota(&e).is_some() => {
                    return Err(quota_held(format!("the ConfigMap {}", blob.name), &e))
                }
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    return Err(StoreError::Backend(format!(
                        "a result or conversation too large for its object must go into a ConfigMap, and this account may not create ConfigMaps in {}: {}",
                        self.namespace, s.message
                    )))
                }
                Err(e) => return Err(backend(e)),
            }
            self.blobs.insert(key, Arc::new(blob.data));
        }
        Ok(())
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
        let handed = handed.filter(|s| s.name_any() == id.0);
        let obj = match handed {
            Some(obj) => obj,
            None => match self.get_session(id).await? {
                Some(obj) => obj,
                None => return Ok(None),
            },
        };
        let record = self.read_session(&obj).await?;
        self.remember(&id.0, seen_of(&obj));
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
        let seen = match self.seen(&id.0) {
            Some(s) => s,
            None => {
                let obj = self
                    .get_session(id)
                    .await?
                    .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
                seen_of(&obj)
            }
        };
        let mut status = stored::session_status(&record.state);
        status.traceparent.clone_from(&record.trace);
        status.observed_generation = seen.generation;
        status.conditions = self.conditions_for(&record.state, &seen);
        let prefix = blob_prefix(&id.0, &record.uid);
        let blobs = spill::pack(&mut status, &prefix, seen.budget.target);
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
        let body = json!({
            "metadata": {"resourceVersion": expected.0},
            "status": merge_patch(&seen.status, &new),
        });
        self.count_write();
        match self
            .sessions
            .patch_status(&id.0, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(obj) => {
                self.remember(&id.0, seen_of(&obj));
                version_of(&obj.metadata)
            }
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
        let seen = match self.seen(&id.0) {
            Some(s) => s,
            None => {
                let obj = self
                    .get_session(id)
                    .await?
                    .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
                seen_of(&obj)
            }
        };
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
        let body = json!({
            "metadata": {"resourceVersion": seen.version},
            "status": {"conditions": wanted, "observedGeneration": seen.generation},
        });
        self.count_write();
        match self
            .sessions
            .patch_status(&id.0, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(obj) => {
                self.remember(&id.0, seen_of(&obj));
                Ok(true)
            }
            Err(kube::Error::Api(s)) if is_conflict(&s) => Ok(false),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(StoreError::SessionNotFound(id.clone()))
            }
            Err(e) => Err(backend(e)),
        }
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

    /// The continuation named `token` in this namespace.
    pub async fn get_continuation(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>> {
        match self
            .continuations
            .get_opt(&token.0)
            .await
            .map_err(backend)?
        {
            None => Ok(None),
            Some(c) => self.read_continuation(&c).await.map(Some),
        }
    }

    /// The continuations of the live session `id` (its current UID), in
    /// call order.
    pub async fn session_continuations(
        &self,
        id: &SessionId,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        let obj = self
            .get_session(id)
            .await?
            .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
        let owner = SessionRef {
            id: id.clone(),
            namespace: self.namespace.clone(),
            uid: obj.uid().unwrap_or_default(),
        };
        self.list_owned(&owner).await
    }

    /// The continuations labelled with session `name`, whatever their
    /// owner: for hints, where only continuations may be readable.
    pub async fn labelled_continuations(
        &self,
        name: &SessionId,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        let list = self
            .continuations
            .list(&ListParams::default().labels(&format!("{SESSION_LABEL}={}", name.0)))
            .await
            .map_err(backend)?;
        let mut out = Vec::new();
        for c in &list.items {
            out.push(self.read_continuation(c).await?);
        }
        Ok(out)
    }

    async fn list_owned(&self, owner: &SessionRef) -> StoreResult<Vec<ContinuationRecord>> {
        let list = self
            .continuations
            .list(&ListParams::default().labels(&format!("{SESSION_LABEL}={}", owner.id.0)))
            .await
            .map_err(backend)?;
        let mut out = Vec::new();
        let mut listed = HashMap::new();
        for c in list.items {
            if controller_uid(&c).as_deref() != Some(owner.uid.as_str()) {
                continue;
            }
            out.push(self.read_continuation(&c).await?);
            listed.insert(c.name_any(), c);
        }
        *self.listed.lock().expect("listed lock") = listed;
        self.listed_all.store(true, Ordering::SeqCst);
        out.sort_by_key(|r| (r.spec.call_id.turn, r.spec.call_id.index));
        Ok(out)
    }

    async fn ensure_continuation(
        &self,
        owner: &SessionRef,
        spec: &ContinuationSpec,
        _now: Millis,
    ) -> StoreResult<ContinuationRecord> {
        let name = &spec.token.0;
        // The engine re-ensures every open deferred call each step: one
        // listed in this step needs no call; else read before creating (a
        // refused create is still a write).
        let listed = self.listed.lock().expect("listed lock").get(name).cloned();
        let known = match listed {
            Some(c) => Some(c),
            None => self.continuations.get_opt(name).await.map_err(backend)?,
        };
        let existing = match known {
            Some(c) => self.adopt(c, owner)?,
            None => self.create_continuation(owner, spec).await?,
        };
        self.set_wait(existing, spec).await
    }

    /// Creates the continuation, or adopts the one a racing driver created.
    async fn create_continuation(
        &self,
        owner: &SessionRef,
        spec: &ContinuationSpec,
    ) -> StoreResult<Continuation> {
        let name = &spec.token.0;
        let object = Continuation {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([(
                    SESSION_LABEL.to_string(),
                    owner.id.0.clone(),
                )])),
                owner_references: Some(vec![owner_reference(owner)]),
                ..Default::default()
            },
            spec: convert::continuation_spec(spec),
            status: None,
        };
        self.count_write();
        match self
            .continuations
            .create(&PostParams::default(), &object)
            .await
        {
            Ok(created) => {
                debug!(token = %name, session = %owner.id, "continuation created");
                Ok(created)
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() || s.code == 409 => {
                let current = self
                    .continuations
                    .get_opt(name)
                    .await
                    .map_err(backend)?
                    .ok_or_else(|| {
                        StoreError::Backend(format!(
                            "continuation {name} was deleted while being adopted; try again"
                        ))
                    })?;
                self.adopt(current, owner)
            }
            Err(e) if exceeded_quota(&e).is_some() => {
                Err(quota_held(format!("the Continuation {name}"), &e))
            }
            Err(e) => Err(backend(e)),
        }
    }

    /// What the call waits for now lives in status: set it when it differs
    /// (a new object, or an approved call now waiting for its runner), and
    /// read the continuation back.
    async fn set_wait(
        &self,
        existing: Continuation,
        spec: &ContinuationSpec,
    ) -> StoreResult<ContinuationRecord> {
        let name = &spec.token.0;
        let status = existing.status.clone().unwrap_or_default();
        let mut wanted = status.clone();
        convert::set_continuation_wait(&mut wanted, spec);
        let same = existing.status.is_some()
            && wanted.waiting_for == status.waiting_for
            && wanted.reason == status.reason
            && wanted.expires_at == status.expires_at;
        if status.outcome.is_some() || same {
            self.note_listed(&existing);
            return self.read_continuation(&existing).await;
        }
        let body = json!({
            "status": {
                "state": "Pending",
                "waitingFor": wanted.waiting_for,
                "reason": wanted.reason,
                "expiresAt": wanted.expires_at,
            }
        });
        self.count_write();
        match self
            .continuations
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(updated) => {
                self.note_listed(&updated);
                return self.read_continuation(&updated).await;
            }
            // Completed meanwhile (the CEL rules refuse `Pending` next to an
            // outcome): the stored object is what counts.
            Err(kube::Error::Api(s)) if s.code == 422 || is_conflict(&s) => {
                debug!(token = %name, reason = %s.message, "wait fields not written; reading back");
            }
            Err(e) => return Err(backend(e)),
        }
        let current = self
            .continuations
            .get_opt(name)
            .await
            .map_err(backend)?
            .ok_or_else(|| StoreError::UnknownToken(spec.token.clone()))?;
        self.note_listed(&current);
        self.read_continuation(&current).await
    }

    /// Notes a continuation's newest version in this step's listing.
    fn note_listed(&self, c: &Continuation) {
        self.listed
            .lock()
            .expect("listed lock")
            .insert(c.name_any(), c.clone());
    }

    /// Every continuation the session owns, as this step last saw or wrote
    /// them; `None` when the step did not list them. A continuation given an
    /// outcome in this step is left out: nothing waits on it any more.
    pub fn owned_continuations(&self) -> Option<Vec<Continuation>> {
        if !self.listed_all.load(Ordering::SeqCst) {
            return None;
        }
        let listed = self.listed.lock().expect("listed lock");
        Some(listed.values().cloned().collect())
    }

    /// `c` if its controller owner is this very session (same UID).
    fn adopt(&self, c: Continuation, owner: &SessionRef) -> StoreResult<Continuation> {
        let theirs = controller_uid(&c);
        if theirs.as_deref() == Some(owner.uid.as_str()) {
            return Ok(c);
        }
        Err(StoreError::Backend(format!(
            "continuation {} exists but is not this session's (its controller owner has uid {}; session {} has uid {}), so it is not adopted. A session re-created under the same name waits until the old one's continuations are garbage-collected; delete {} if it stays",
            c.name_any(),
            theirs.unwrap_or_else(|| "none".into()),
            owner.id,
            owner.uid,
            c.name_any()
        )))
    }

    async fn complete_continuation(
        &self,
        token: &ContinuationToken,
        result: &ToolResult,
        by: &str,
        now: Millis,
    ) -> StoreResult<WriteOnce> {
        let judge = |rec: &ContinuationRecord| acceptance::result(&rec.held(), result, by);
        let status = |obj: Continuation, rec: ContinuationRecord| async move {
            let mut value = convert::result_value(result);
            if serde_json::to_vec(&value).map_or(0, |v| v.len()) > CONTINUATION_INLINE_BYTES {
                let owner = SessionRef {
                    id: rec.spec.session.clone(),
                    namespace: self.namespace.clone(),
                    uid: controller_uid(&obj).unwrap_or_default(),
                };
                let prefix = blob_prefix(&owner.id.0, &owner.uid);
                let blobs = spill::pack_result(&prefix, &mut value);
                self.put_blobs(&owner, blobs).await?;
            }
            Ok(json!({
                "state": "Completed",
                "outcome": {
                    "result": value,
                    "completedBy": by,
                    "completedAt": convert::micro_time(now),
                }
            }))
        };
        self.write_once(token, "its result", judge, status).await
    }

    async fn decide_continuation(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<WriteOnce> {
        if let Some(at) = self.own_vote(token, decision).await? {
            return Ok(WriteOnce::AlreadySame {
                by: decision.by.clone(),
                at,
            });
        }
        let judge = |rec: &ContinuationRecord| acceptance::decision(&rec.held(), decision.approved);
        let entry = json!({
            "approved": decision.approved,
            "by": decision.by,
            "reason": decision.reason,
            "decidedAt": convert::time(decision.at),
            "arguments": decision.arguments,
        });
        let status = |obj: Continuation, rec: ContinuationRecord| {
            let entry = entry.clone();
            async move {
                if rec.spec.policy.decorators.approval_policy.is_none() {
                    return Ok(json!({ "decision": entry }));
                }
                let votes = obj.status.map(|s| s.decisions).unwrap_or_default();
                if votes.iter().any(|v| v.by == decision.by) {
                    return Err(StoreError::NotAccepting {
                        token: token.clone(),
                        why: format!(
                            "{} has already decided this call; the policy needs different people",
                            decision.by
                        ),
                    });
                }
                let mut list = serde_json::to_value(&votes).unwrap_or_default();
                if let Some(a) = list.as_array_mut() {
                    a.push(entry);
                }
                Ok(json!({ "decisions": list }))
            }
        };
        self.write_once(token, "its decision", judge, status).await
    }

    /// When this person already cast this same vote on a call decided by
    /// a quorum: a repeat (a CLI trying again after an answer it lost) is
    /// harmless, and tells the time of the vote that counts.
    async fn own_vote(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<Option<Millis>> {
        let Some(obj) = self
            .continuations
            .get_opt(&token.0)
            .await
            .map_err(backend)?
        else {
            return Ok(None);
        };
        let votes = obj.status.map(|s| s.decisions).unwrap_or_default();
        Ok(votes
            .iter()
            .find(|v| v.by == decision.by && v.approved == decision.approved)
            .map(|v| convert::millis(&v.decided_at)))
    }

    /// Writes the answers to an MCP task's request for input (replacing
    /// any earlier ones; the server takes only outstanding keys).
    pub async fn answer_continuation(
        &self,
        token: &ContinuationToken,
        answers: &str,
        by: &str,
        now: Millis,
    ) -> StoreResult<()> {
        let body = json!({"status": {"answers": {
            "inputResponses": answers,
            "by": by,
            "answeredAt": convert::time(now),
        }}});
        self.count_write();
        match self
            .continuations
            .patch_status(&token.0, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(StoreError::UnknownToken(token.clone()))
            }
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 403 => {
                Err(StoreError::NotAccepting {
                    token: token.clone(),
                    why: format!("the API server refused the answers: {}", s.message),
                })
            }
            Err(e) => Err(backend(e)),
        }
    }

    /// One write-once write: read the continuation, ask the rules
    /// (`judge`), and patch the `status` part over the version read. A lost
    /// race re-reads; the CRD's rules refusing it (422) are judged again on
    /// what is stored now.
    async fn write_once<J, S, F>(
        &self,
        token: &ContinuationToken,
        what: &str,
        judge: J,
        status: S,
    ) -> StoreResult<WriteOnce>
    where
        J: Fn(&ContinuationRecord) -> Verdict,
        S: Fn(Continuation, ContinuationRecord) -> F,
        F: std::future::Future<Output = StoreResult<Value>>,
    {
        for _ in 0..MAX_RETRIES {
            let Some(obj) = self
                .continuations
                .get_opt(&token.0)
                .await
                .map_err(backend)?
            else {
                return Err(StoreError::UnknownToken(token.clone()));
            };
            let rec = self.read_continuation(&obj).await?;
            let verdict = judge(&rec);
            if verdict != Verdict::Write {
                return WriteOnce::judged(token, verdict);
            }
            let version = obj.resource_version();
            let body = json!({
                "metadata": {"resourceVersion": version},
                "status": status(obj, rec).await?,
            });
            self.count_write();
            self.listed.lock().expect("listed lock").remove(&token.0);
            match self
                .continuations
                .patch_status(&token.0, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => return Ok(WriteOnce::Recorded),
                Err(kube::Error::Api(s)) if is_conflict(&s) => continue,
                Err(kube::Error::Api(s)) if s.code == 422 => {
                    let rec = self
                        .get_continuation(token)
                        .await?
                        .ok_or_else(|| StoreError::UnknownToken(token.clone()))?;
                    return match judge(&rec) {
                        Verdict::Write => Err(StoreError::NotAccepting {
                            token: token.clone(),
                            why: format!("the API server refused {what}: {}", s.message),
                        }),
                        verdict => WriteOnce::judged(token, verdict),
                    };
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    return Err(StoreError::UnknownToken(token.clone()))
                }
                Err(e) => return Err(backend(e)),
            }
        }
        Err(StoreError::Backend(format!(
            "{token} kept changing while {what} was written ({MAX_RETRIES} tries); try again"
        )))
    }
}

fn wall_now() -> Millis {
    use crate::ports::Clock;
    SystemClock.now()
}

/// The API server (or etcd behind it) refusing an object for its size.
fn too_large(s: &kube::core::Status) -> bool {
    s.code == 413 || s.message.to_ascii_lowercase().contains("too large")
}

/// A 409 that is not "already exists": a stale `resourceVersion`. kube-core
/// matches only `reason`, which may be empty, so the code counts too.
fn is_conflict(s: &kube::core::Status) -> bool {
    s.is_conflict() || (s.code == 409 && !s.is_already_exists())
}

/// A create that a ResourceQuota refused for now: a wait (see
/// [`StoreError::QuotaExceeded`]).
fn quota_held(what: String, e: &kube::Error) -> StoreError {
    StoreError::QuotaExceeded {
        what,
        message: exceeded_quota(e).unwrap_or_default().to_string(),
    }
}

fn backend(e: kube::Error) -> StoreError {
    match e {
        // Throttled (API priority and fairness) or the server (or its etcd)
        // failing for now: the same request may succeed in a moment.
        // An API server just started refuses requests its admission
        // policies cannot judge yet (403 "not yet ready to handle request").
        kube::Error::Api(s)
            if s.code == 429
                || s.code >= 500
                || (s.code == 403 && s.message.contains("not yet ready to handle request")) =>
        {
            StoreError::Unavailable(format!(
                "the API server answered {} {}: {}",
                s.code, s.reason, s.message
            ))
        }
        kube::Error::Api(s) => StoreError::Backend(format!(
            "the API server answered {} {}: {}",
            s.code, s.reason, s.message
        )),
        other => StoreError::Unavailable(format!("cannot reach the API server: {other}")),
    }
}

pub(super) fn version_of(meta: &ObjectMeta) -> StoreResult<Version> {
    meta.resource_version
        .clone()
        .map(Version)
        .ok_or_else(|| StoreError::Backend("object without a resourceVersion".into()))
}

fn status_json(obj: &Session) -> Value {
    obj.status
        .as_ref()
        .map(|s| serde_json::to_value(s).unwrap_or(Value::Null))
        .unwrap_or(Value::Null)
}

/// An RFC 7386 merge patch that turns `old` into `new`: keys `new` drops
/// are set to null (a plain merge would keep them: a closed turn's
/// `openTurn` would stay), objects are patched key by key, the rest replaced.
pub fn merge_patch(old: &Value, new: &Value) -> Value {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = serde_json::Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) if ov == nv => {}
                    Some(ov) => {
                        out.insert(k.clone(), merge_patch(ov, nv));
                    }
                    None => {
                        out.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            Value::Object(out)
        }
        _ => new.clone(),
    }
}

/// A Session object as the engine's record.
pub fn session_record(obj: &Session) -> StoreResult<SessionRecord> {
    let name = obj.name_any();
    let id = SessionId(name.clone());
    let state = match &obj.status {
        None => SessionState::new(id.clone()),
        Some(status) => stored::session_state(&id, status).map_err(|e| StoreError::Corrupt {
            what: format!("session {name} (status)"),
            why: e.to_string(),
        })?,
    };
    let created = obj
        .metadata
        .creation_timestamp
        .as_ref()
        .map(convert::millis)
        .unwrap_or_default();
    Ok(SessionRecord {
        state,
        input: session_input(&obj.spec),
        namespace: obj.namespace().unwrap_or_default(),
        uid: obj.uid().unwrap_or_default(),
        definition: serde_json::to_value(&obj.spec).unwrap_or(Value::Null),
        created_at: created,
        updated_at: created,
        trace: obj.status.as_ref().and_then(|s| s.traceparent.clone()),
    })
}

/// The phase of a status as stored: spilled results do not parse as
/// results, so the shown phase stands in where the turns cannot be read.
fn listed_phase(name: &str, status: &SessionStatus) -> crate::core::Phase {
    use crate::api::session::SessionPhase as Shown;
    use crate::core::Phase;
    if let Ok(state) = stored::session_state(&SessionId(name.into()), status) {
        return state.phase;
    }
    match status.phase {
        Shown::Succeeded => Phase::Succeeded,
        Shown::Failed => Phase::Failed,
        Shown::AwaitingModel => Phase::AwaitingModel,
        Shown::Running => Phase::RunningTools,
        Shown::Waiting => Phase::Waiting,
        Shown::Pending | Shown::Paused => Phase::Idle,
    }
}

pub(crate) fn session_input(spec: &SessionSpec) -> SessionInput {
    SessionInput {
        messages: spec.messages.clone(),
        paused: spec.paused,
        retry: spec.retry.unwrap_or(0),
    }
}

/// The UID of the object's controller owner.
/// Blob names start with the session's name and the head of its UID: a
/// session re-created under its name never meets the old one's blobs.
fn blob_prefix(session: &str, uid: &str) -> String {
    let head: String = uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    format!("{session}-{}", head.to_ascii_lowercase())
}

/// The cache key of a blob: blobs are shared only within their session.
fn blob_key(uid: &str, name: &str) -> String {
    format!("{uid}/{name}")
}

/// The decision the votes of an approval policy add up to, if any yet.
fn tally(votes: &[crate::api::continuation::DecisionStatus], quorum: u32) -> Option<Decision> {
    let votes: Vec<acceptance::Vote<'_>> = votes
        .iter()
        .map(|d| acceptance::Vote {
            approved: d.approved,
            by: &d.by,
            reason: d.reason.as_deref(),
            at: convert::millis(&d.decided_at),
            arguments: d.arguments.as_deref(),
        })
        .collect();
    acceptance::tally(&votes, quorum).map(|t| Decision {
        approved: t.approved,
        by: t.by,
        reason: t.reason,
        at: t.at,
        arguments: t.arguments,
    })
}

fn controller_uid(c: &Continuation) -> Option<String> {
    c.owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
}

fn owner_reference(owner: &SessionRef) -> OwnerReference {
    OwnerReference {
        api_version: Session::api_version(&()).into_owned(),
        kind: Session::kind(&()).into_owned(),
        name: owner.id.0.clone(),
        uid: owner.uid.clone(),
        controller: Some(true),
        // Setting it needs `sessions/finalizers` permission; garbage
        // collection works without it.
        block_owner_deletion: None,
    }
}

/// A Continuation object as the engine's record.
pub fn continuation_record(c: &Continuation) -> StoreResult<ContinuationRecord> {
    let name = c.name_any();
    let token = ContinuationToken(name.clone());
    let corrupt = |why: String| StoreError::Corrupt {
        what: format!("continuation {name}"),
        why,
    };
    let spec = convert::core_continuation_spec(&token, &c.spec, c.status.as_ref())
        .map_err(|e| corrupt(e.to_string()))?;
    let status = c.status.clone().unwrap_or_default();
    let (result, completed_by, completed_at) = match &status.outcome {
        None => (None, None, None),
        Some(o) => (
            Some(
                convert::tool_result(&o.result, "status.outcome.result")
                    .unwrap_or_else(|e| malformed(&o.completed_by, &e.to_string())),
            ),
            Some(o.completed_by.clone()),
            Some(convert::micro_millis(&o.completed_at)),
        ),
    };
    let decision = match &spec.policy.decorators.approval_policy {
        Some(policy) if !status.decisions.is_empty() => tally(&status.decisions, policy.quorum),
        _ => status.decision.as_ref().map(|d| Decision {
            approved: d.approved,
            by: d.by.clone(),
            reason: d.reason.clone(),
            at: convert::millis(&d.decided_at),
            arguments: d.arguments.clone(),
        }),
    };
    Ok(ContinuationRecord {
        spec,
        result,
        completed_by,
        completed_at,
        decision,
        answers: status.answers.as_ref().map(|a| a.input_responses.clone()),
        created_at: c
            .metadata
            .creation_timestamp
            .as_ref()
            .map(convert::millis)
            .unwrap_or_default(),
    })
}

/// The error a call gets for a result its writer got wrong.
fn malformed(by: &str, why: &str) -> ToolResult {
    ToolResult::error(format!("the result written by {by} was malformed: {why}"))
}

/// A core condition as `metav1.Condition`.
pub fn meta_condition(c: &conditions::Condition) -> MetaCondition {
    MetaCondition {
        type_: c.type_.clone(),
        status: c.status.as_str().to_string(),
        reason: c.reason.clone(),
        message: c.message.clone(),
        last_transition_time: convert::time(c.last_transition),
        observed_generation: c.observed_generation,
    }
}

pub fn core_condition(c: &MetaCondition) -> Option<conditions::Condition> {
    let status = match c.status.as_str() {
        "True" => CondStatus::True,
        "False" => CondStatus::False,
        "Unknown" => CondStatus::Unknown,
        _ => return None,
    };
    let mut out = conditions::Condition::new(&c.type_, status, &c.reason, c.message.clone());
    out.last_transition = convert::millis(&c.last_transition_time);
    out.observed_generation = c.observed_generation;
    Some(out)
}

fn same_condition(a: &MetaCondition, b: &MetaCondition) -> bool {
    a.status == b.status
        && a.reason == b.reason
        && a.message == b.message
        && a.observed_generation == b.observed_generation
}

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

/// Cached results in this process's memory. Keys carry their scope (the
/// namespace and the tool's fingerprint), so sharing one cache between
/// sessions of different namespaces shares nothing across them.
#[derive(Debug, Default)]
pub struct MemoryCache {
    entries: Mutex<CacheEntries>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_status_lists_with_its_phase() {
        use crate::core::conversation::{AgentTurn, ToolResultEntry, UserTurn};
        use crate::core::{CallId, Turn};
        let mut state = SessionState::new(SessionId("s".into()));
        state.turns.push(Turn::User(UserTurn {
            message: None,
            tool_results: vec![ToolResultEntry {
                call_id: CallId::new(1, 0),
                model_call_id: "m".into(),
                tool: "dump".into(),
                token: None,
                result: ToolResult::text("x".repeat(spill::INLINE_RESULT_BYTES * 2)),
                truncate_bytes: None,
            }],
        }));
        state.turns.push(Turn::Agent(AgentTurn::default()));
        state.phase = crate::core::Phase::Succeeded;
        let mut status = stored::session_status(&state);
        assert!(!spill::pack(&mut status, "s", spill::STATUS_BUDGET_BYTES).is_empty());
        let unread = stored::session_state(&SessionId("s".into()), &status);
        assert!(unread.is_err(), "a spilled result reads as no result");
        assert_eq!(listed_phase("s", &status), crate::core::Phase::Succeeded);
    }

    #[tokio::test]
    async fn the_memory_cache_is_bounded_in_bytes() {
        let cache = MemoryCache::default();
        let key = |i: usize| CacheKey {
            tool: "t".into(),
            arguments_sha256: format!("{i:064x}"),
        };
        let big = ToolResult::text("x".repeat(CACHE_ENTRY_BYTES + 1));
        cache.remember(&key(0), &big, Millis(0)).await.unwrap();
        assert_eq!(
            cache.lookup(&key(0)).await.unwrap(),
            None,
            "too big to keep"
        );
        let part = ToolResult::text("y".repeat(CACHE_ENTRY_BYTES));
        for i in 1..=16 {
            cache.remember(&key(i), &part, Millis(0)).await.unwrap();
        }
        let held = cache.entries.lock().unwrap().bytes;
        assert!(held <= CACHE_BYTES, "{held} bytes held");
        assert_eq!(cache.lookup(&key(16)).await.unwrap(), Some(part));
    }

    #[test]
    fn merge_patch_removes_what_the_new_status_drops() {
        let old = json!({"phase": "Waiting", "openTurn": {"turn": 1, "calls": [1, 2]}, "answer": null, "usage": {"a": 1, "b": 2}});
        let new = json!({"phase": "Succeeded", "answer": "done", "usage": {"a": 1, "b": 3}});
        let patch = merge_patch(&old, &new);
        assert_eq!(
            patch,
            json!({"phase": "Succeeded", "openTurn": null, "answer": "done", "usage": {"b": 3}})
        );
        // Applying it gives `new` (RFC 7386).
        let mut applied = old.clone();
        apply(&mut applied, &patch);
        assert_eq!(applied.as_object().unwrap().get("openTurn"), None);
        assert_eq!(applied["usage"], json!({"a": 1, "b": 3}));
    }

    fn apply(target: &mut Value, patch: &Value) {
        match patch {
            Value::Object(p) => {
                if !target.is_object() {
                    *target = json!({});
                }
                let t = target.as_object_mut().unwrap();
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        apply(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
            other => *target = other.clone(),
        }
    }

    /// A Session as the operator wrote it before the state moved into
    /// `status.state` (tests/fixtures: its spilled blobs beside it, and the
    /// core state it was written from).
    #[tokio::test]
    async fn a_status_in_the_earlier_form_loads_as_the_state_it_was_written_from() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let read = |name: &str| std::fs::read_to_string(fixtures.join(name)).unwrap();
        let expected: SessionState =
            serde_json::from_str(&read("legacy-session-state.json")).unwrap();
        let blobs: BTreeMap<String, ByteString> =
            serde_json::from_str(&read("legacy-session-blobs.json")).unwrap();
        for file in ["legacy-session.json", "legacy-session-archived.json"] {
            let obj: Session = serde_json::from_str(&read(file)).unwrap();
            loads_as(&obj, &blobs, &expected).await;
        }
    }

    async fn loads_as(
        obj: &Session,
        blobs: &BTreeMap<String, ByteString>,
        expected: &SessionState,
    ) {
        let old = obj.status.clone().unwrap();
        assert!(old.state.is_none() && old.earlier.contains_key("openTurn"));
        let mut status = old.clone();
        legacy::upgrade(&mut status).unwrap();
        spill::unpack(&mut status, |name| {
            let data = blobs.get(&name).map(|b| b.0.clone());
            async move { data.ok_or_else(|| format!("no blob {name}")) }
        })
        .await
        .unwrap();
        let state = stored::session_state(&SessionId(obj.name_any()), &status).unwrap();
        assert_eq!(&state, expected);
        // The next write removes every field of the earlier form.
        let new = serde_json::to_value(stored::session_status(&state)).unwrap();
        let patch = merge_patch(&serde_json::to_value(&old).unwrap(), &new);
        for key in old.earlier.keys() {
            assert_eq!(patch.get(key), Some(&Value::Null), "{key} stays");
        }
    }

    #[test]
    fn a_quota_is_a_wait_and_a_server_not_ready_is_away() {
        let forbidden = |message: &str| {
            kube::Error::Api(
                kube::core::Status::failure(message, "Forbidden")
                    .with_code(403)
                    .boxed(),
            )
        };
        let full = forbidden("continuations.agents-exe.io \"s-t1-c0\" is forbidden: exceeded quota: q, requested: count/continuations.agents-exe.io=1, used: count/continuations.agents-exe.io=0, limited: count/continuations.agents-exe.io=0");
        let held = quota_held("the Continuation s-t1-c0".into(), &full);
        assert!(held.is_quota() && !held.is_transient(), "{held}");
        assert!(
            held.to_string().contains("limited: count/continuations"),
            "{held}"
        );
        let starting = backend(forbidden("not yet ready to handle request"));
        assert!(starting.is_transient(), "{starting}");
        let rbac = backend(forbidden(
            "User \"x\" cannot patch resource \"continuations/status\"",
        ));
        assert!(!rbac.is_transient() && !rbac.is_quota(), "{rbac}");
    }

    #[test]
    fn conditions_round_trip_through_metav1() {
        let mut c = conditions::Condition::new("Ready", CondStatus::False, "AgentNotFound", "x");
        c.last_transition = Millis(1_700_000_000_000);
        c.observed_generation = Some(3);
        assert_eq!(core_condition(&meta_condition(&c)), Some(c));
    }
}
