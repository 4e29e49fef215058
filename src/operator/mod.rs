//! `agents operator`: the cluster driver of the engine.
//!
//! A kube-runtime `Controller` for `Session`s that owns their
//! `Continuation`s (a result written to one reconciles its Session at
//! once) and watches `Agent`s (a session waiting for its agent proceeds
//! when it appears). One reconcile is a pipeline:
//!
//! 1. dereference (I/O): the agent (`spec.agentRef` in the same namespace,
//!    or the inline `spec.agent`), its model client (the OpenAI key from the
//!    Secret the Agent names) and tools;
//! 2. validate (pure, in [`crate::agent`]): a missing or invalid agent is
//!    the operator's `Ready=False` condition with a reason, and a recheck;
//! 3. one [`engine::step`] over the [`KubeStore`] with the roles model,
//!    background and (with the Job runner) isolated;
//! 4. report (pure, [`report`]): the conditions with their transition
//!    times, the Events, the metrics and the requeue;
//! 5. apply status: the store writes the report's conditions with each
//!    status write of the step, and once more only when they changed.
//!
//! `runAsync` attempts run as tasks in this process ([`background`]); the
//! end of one reconciles its Session through `Controller::reconcile_on`.
//!
//! One file per job: [`run`] (the controllers and the loops beside them),
//! [`health`] (watches that heal, the API probe), [`resolve`] (dereference
//! and validate), [`reconcile`] (the stages of one reconcile), [`retention`]
//! (finished sessions deleted), [`failure`] (a reconcile that failed).

pub mod agents;
pub mod api_requests;
pub mod background;
mod budget_status;
mod budgets;
pub mod children;
pub mod event_sink;
pub mod events;
mod failure;
mod fork;
mod health;
pub mod notify;
mod reconcile;
mod report;
mod resolve;
mod retention;
mod run;
pub mod slots;
mod task_cancel;

use crate::api::Agent;
use crate::engine::Holder;
use crate::store::kube::MemoryCache;
use background::Background;
use kube::runtime::reflector::Store;
use kube::Client;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use failure::Error;
use health::{api, tracked_watch};
use resolve::{prepare, read_secret, resolve, NotReady};
pub use resolve::{HTTP_TOOL_URL_NOT_ALLOWED, MODEL_URL_NOT_ALLOWED, USABLE_BY_AGENTS};
use run::is_final;
pub use run::{lease_identity, run, run_with, ApiRate, Clients};

/// The name the operator reports Events and writes as.
pub const CONTROLLER_NAME: &str = "agents-exe-operator";

/// Recheck of a session whose spec is invalid: it changes only by an edit,
/// which the watch delivers.
const INVALID_RECHECK: Duration = Duration::from_secs(300);

#[derive(Clone, Debug)]
pub struct Options {
    /// Watch only these namespaces (all when empty).
    pub namespaces: Vec<String>,
    /// The agents image, for the init container that brings the wrapper
    /// into tool Jobs. Without it isolated calls wait for an outside
    /// worker (`agents session run-isolated --store kube`).
    pub agents_image: Option<String>,
    /// How tool Jobs are built (limits, service account, allowed images).
    pub job_defaults: crate::runner::job::JobDefaults,
    /// Deadline of a tool call without a `timeout` decorator.
    pub default_tool_timeout_secs: u64,
    /// Model call timeout for agents that set none.
    pub model_timeout_secs: Option<u64>,
    /// Reconcile only while holding this Lease (replicas > 1).
    pub leader_election: Option<LeaseOptions>,
    /// Where /metrics, /healthz and /readyz are served.
    pub metrics_addr: std::net::SocketAddr,
    /// Every session that is not final is reconciled at least this often.
    pub resync: Duration,
    /// At most this many resync reconciles a second.
    pub resync_rate: u32,
    /// /healthz and /readyz fail once a watch or the API probe has failed
    /// for longer than this.
    pub stall_bound: Duration,
    /// Reconciles running at once (0: unbounded).
    pub max_concurrent_reconciles: u16,
    /// Reconciles of one namespace at once (`None`: three quarters of
    /// `max_concurrent_reconciles`).
    pub max_reconciles_per_namespace: Option<u16>,
    /// `runAsync` runs of one namespace executing at once.
    pub max_background_runs_per_namespace: u16,
    /// A client-side pace for API requests; `None`: none.
    pub api_rate: Option<ApiRate>,
    /// How fast Events are written (`--event-qps`, `--event-burst`).
    pub event_pace: event_sink::EventPace,
    /// Most tool calls one model reply may ask for.
    pub max_calls_per_reply: u32,
    /// Agents may use only Secrets labelled [`USABLE_BY_AGENTS`].
    pub secrets_need_label: bool,
    /// Finished sessions without `spec.ttlSecondsAfterFinished` are deleted
    /// this many seconds after they finish; `None` keeps them.
    pub finished_session_ttl_seconds: Option<u64>,
    /// The URLs http tools may call (`--http-tool-allowed-urls`); `None`:
    /// any. A call to another fails with an error result; an Agent with
    /// such a tool is `Ready=False` ([`HTTP_TOOL_URL_NOT_ALLOWED`]).
    pub http_tool_allowed_urls: Option<Arc<crate::http::allow::AllowedUrls>>,
    /// The URLs OpenAI-compatible models may be called at
    /// (`--model-allowed-urls`); `None`: any. An Agent whose model is
    /// elsewhere is not ready ([`MODEL_URL_NOT_ALLOWED`]).
    pub model_allowed_urls: Option<Arc<crate::http::allow::AllowedUrls>>,
    /// Where waits for a person are announced for agents without a
    /// `notify.webhook` (`--notify-webhook-url`); `None`: nowhere.
    pub notify_webhook_url: Option<String>,
    /// The page where people decide and complete calls
    /// (`--approvals-page-url`): the `link` of notifications.
    pub approvals_page_url: Option<String>,
    /// The deepest a sub-agent tree may grow, whatever an Agent's
    /// `maxDepth` says (`--max-sub-agent-depth`).
    pub max_sub_agent_depth: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            namespaces: Vec::new(),
            agents_image: None,
            job_defaults: Default::default(),
            default_tool_timeout_secs: crate::core::session::DEFAULT_TOOL_TIMEOUT_SECS,
            model_timeout_secs: None,
            leader_election: None,
            metrics_addr: ([127, 0, 0, 1], 0).into(),
            resync: Duration::from_secs(300),
            resync_rate: 50,
            stall_bound: Duration::from_secs(60),
            max_concurrent_reconciles: 16,
            max_reconciles_per_namespace: None,
            max_background_runs_per_namespace: 32,
            api_rate: None,
            event_pace: Default::default(),
            max_calls_per_reply: crate::core::session::DEFAULT_MAX_CALLS_PER_REPLY,
            secrets_need_label: true,
            finished_session_ttl_seconds: None,
            http_tool_allowed_urls: None,
            model_allowed_urls: None,
            notify_webhook_url: None,
            approvals_page_url: None,
            max_sub_agent_depth: 8,
        }
    }
}

#[derive(Clone, Debug)]
pub struct LeaseOptions {
    pub name: String,
    pub duration: Duration,
    pub grace: Duration,
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub holder: Holder,
    /// The Agents of the watched namespaces, as the watch last saw them.
    agents: Store<Agent>,
    /// The Budgets of the watched namespaces, as the watch last saw them.
    budgets: Store<crate::api::Budget>,
    /// Where Events go: a bounded queue, written off the reconcile path.
    pub events: event_sink::EventSink,
    pub background: Arc<Background>,
    pub cache: Arc<MemoryCache>,
    /// The Job runner for isolated calls (per namespace via `with_namespace`).
    pub jobs: Option<crate::runner::job::JobRunner>,
    pub metrics: Arc<crate::observe::Metrics>,
    pub options: Options,
    /// Failed reconciles in a row, per session, for the backoff (the
    /// count that fails a session is kept in its status).
    failures: failure::Backoffs,
    /// Waits already announced as Events (a session's go when it finishes).
    announced: Mutex<report::Announced>,
    /// Connections to MCP servers and their listings, shared by the Agent
    /// and Session reconciles and the background runs.
    pub mcp: Arc<crate::tools::mcp::McpPool>,
    /// Reconcile slots per namespace.
    slots: Arc<slots::NamespaceSlots>,
    /// Sessions as the watch delivered them, whole, for their next step.
    handed: crate::store::kube::HandedSessions,
    /// The newest version of each session this process saw: a handed copy
    /// older than it is not used.
    known: Arc<crate::store::kube::KnownVersions>,
    /// Spilled blobs (archived turns, large results) read or written,
    /// immutable, bounded in bytes.
    blobs: Arc<crate::store::kube::BlobCache>,
    /// The Continuations the watch delivered: a step lists a session's
    /// from here when the watch is new enough for them.
    continuations: Arc<crate::store::kube::WatchedContinuations>,
}

impl Context {
    fn new(
        client: &Client,
        ns: Option<&str>,
        opts: &Options,
        holder: Holder,
        background: Arc<Background>,
        metrics: Arc<crate::observe::Metrics>,
        agents: Store<Agent>,
    ) -> Context {
        Context {
            client: client.clone(),
            holder,
            agents,
            budgets: kube::runtime::reflector::store::<crate::api::Budget>().0,
            events: event_sink::EventSink::start(
                client.clone(),
                CONTROLLER_NAME,
                lease_identity(&crate::host::operator_identity()),
                opts.event_pace,
                metrics.clone(),
            ),
            background,
            cache: Arc::new(MemoryCache::default()),
            jobs: opts.agents_image.as_ref().map(|image| {
                crate::runner::job::JobRunner::new(
                    client.clone(),
                    ns.unwrap_or("default"),
                    image,
                    opts.job_defaults.clone(),
                )
            }),
            metrics,
            options: opts.clone(),
            failures: failure::Backoffs::default(),
            announced: Mutex::default(),
            mcp: Arc::default(),
            slots: slots::NamespaceSlots::new(per_namespace(opts, ns).into()),
            handed: Default::default(),
            known: Default::default(),
            blobs: Arc::new(crate::store::kube::BlobCache::with_bound(
                crate::store::kube::SHARED_BLOB_BYTES,
            )),
            continuations: Default::default(),
        }
    }

    /// The store every session write of this process goes through: it
    /// shares the result cache and notes each version it reads or writes.
    fn store(&self, ns: &str) -> crate::store::kube::KubeStore {
        self.store_over(&self.client, ns)
    }

    /// [`Self::store`] sending its requests through `client` (one that
    /// counts a reconcile's requests).
    fn store_over(&self, client: &Client, ns: &str) -> crate::store::kube::KubeStore {
        crate::store::kube::KubeStore::new(client.clone(), ns)
            .with_cache(self.cache.clone())
            .with_known_versions(self.known.clone())
            .with_blob_cache(self.blobs.clone())
            .with_watched_continuations(self.continuations.clone())
    }
}

/// Reconciles one namespace may run at once: as asked, else three
/// quarters of all (at least one). A controller of one namespace
/// (`scope`) shares its reconciles with no other: all of them.
fn per_namespace(opts: &Options, scope: Option<&str>) -> u16 {
    if scope.is_some() {
        return opts.max_concurrent_reconciles;
    }
    opts.max_reconciles_per_namespace
        .unwrap_or(opts.max_concurrent_reconciles.saturating_mul(3) / 4)
        .max(1)
}
/// Hands an Event to the writer; never waits (Events are for people, and
/// one that cannot be written must not stop a session).
fn publish(
    ctx: &Context,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    event: kube::runtime::events::Event,
) {
    ctx.events.publish(event, reference.clone());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_gets_three_quarters_of_a_shared_pool_and_all_of_its_own() {
        let mut opts = Options::default();
        assert_eq!(per_namespace(&opts, None), 12);
        assert_eq!(per_namespace(&opts, Some("team-a")), 16);
        opts.max_reconciles_per_namespace = Some(2);
        assert_eq!(per_namespace(&opts, None), 2);
        opts.max_reconciles_per_namespace = None;
        opts.max_concurrent_reconciles = 1;
        assert_eq!(per_namespace(&opts, None), 1, "never none");
    }
}
