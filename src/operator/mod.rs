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

pub mod agents;
pub mod background;
pub mod event_sink;
pub mod events;
pub mod notify;
mod report;
pub mod slots;
mod task_cancel;

use crate::agent::{AgentModel, AgentTools, Definition, NoSecrets};
use crate::api::agent::ModelProvider;
use crate::api::{Agent, Continuation, Session};
use crate::core::conditions::Status;
use crate::core::SessionId;
use crate::engine::holder::OperatorIdentity;
use crate::engine::Progress;
use crate::engine::{
    self, AgentRuntime, Clock, EngineError, Holder, Ports, Roles, StepOutcome, SystemClock,
};
use crate::model::ModelClient;
use crate::store::kube::{KubeStore, MemoryCache};
use crate::store::StoreError;
use crate::tools::Toolbox;
use background::{Background, SessionRunner};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource, ResourceExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{debug, info, warn};

/// The name the operator reports Events and writes as.
pub const CONTROLLER_NAME: &str = "agents-exe-operator";

/// Recheck of a session whose agent or Secret is missing (the Agent watch
/// wakes it sooner; Secrets are not watched: `get` is all we may do).
const NOT_READY_RECHECK: Duration = Duration::from_secs(15);
/// Steps of one session that may fail in a row (for a reason of its own)
/// before the session is failed: a failure repeats a counted number of
/// times, never for ever.
const MAX_FAILED_RECONCILES: u32 = 8;
/// Sessions whose consecutive failures are counted at once.
const MAX_TRACKED_FAILURES: usize = 10_000;
/// Requests that get no answer within this long fail (and are retried),
/// instead of hanging on a dead connection.
const API_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the API server may hold a watch open before it ends it (the
/// client's idle timeout is this plus a margin).
const WATCH_TIMEOUT_SECS: u32 = 240;
/// The longest pause between two attempts of one watch.
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often the API probe lists one Session, and how long it waits.
const API_PROBE_PERIOD: Duration = Duration::from_secs(5);
const API_PROBE_TIMEOUT: Duration = Duration::from_secs(10);
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
    /// Where Events go: a bounded queue, written off the reconcile path.
    pub events: event_sink::EventSink,
    pub background: Arc<Background>,
    pub cache: Arc<MemoryCache>,
    /// The Job runner for isolated calls (per namespace via `with_namespace`).
    pub jobs: Option<crate::runner::job::JobRunner>,
    pub metrics: Arc<crate::observe::Metrics>,
    pub options: Options,
    /// Failed reconciles in a row, per session, for the backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Waits already announced as Events (a session's go when it finishes).
    announced: Mutex<report::Announced>,
    /// Connections to MCP servers and their listings, shared by the Agent
    /// and Session reconciles and the background runs.
    pub mcp: Arc<crate::tools::mcp::McpPool>,
    /// Reconcile slots per namespace.
    slots: Arc<slots::NamespaceSlots>,
    /// Sessions as the watch delivered them, whole, for their next step.
    handed: crate::store::kube::HandedSessions,
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
            failures: Mutex::new(HashMap::new()),
            announced: Mutex::default(),
            mcp: Arc::default(),
            slots: slots::NamespaceSlots::new(per_namespace(opts, ns).into()),
            handed: Default::default(),
        }
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

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the API server: {0}")]
    Kube(#[from] kube::Error),
    #[error("session {0} has no namespace")]
    NoNamespace(String),
}

impl Error {
    /// An error that says something about this session, not about the API
    /// server being away, a lost race or the fence: repeated, it fails the
    /// session.
    fn counts_against_the_session(&self) -> bool {
        !self.is_transient()
            && !matches!(
                self,
                Error::Engine(EngineError::TooManyConflicts(_))
                    | Error::Engine(EngineError::Fenced { .. })
                    | Error::Engine(EngineError::Store(StoreError::Conflict { .. }))
                    | Error::Store(StoreError::Conflict { .. })
            )
    }

    /// The API server (or its etcd) is away or throttling for now.
    fn is_transient(&self) -> bool {
        match self {
            Error::Store(e) | Error::Engine(EngineError::Store(e)) => e.is_transient(),
            Error::Kube(kube::Error::Api(s)) => s.code == 429 || s.code >= 500,
            Error::Kube(_) => true,
            _ => false,
        }
    }

    /// Errors that retrying soon will not fix (stored data that cannot be
    /// read, a session that no longer fits its object: retrying would ask
    /// the model again); everything else (API errors, conflicts) is retried
    /// with backoff.
    fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::Store(
                StoreError::Corrupt { .. }
                    | StoreError::TooLarge { .. }
                    | StoreError::Refused { .. }
            ) | Error::Engine(EngineError::Store(
                StoreError::Corrupt { .. }
                    | StoreError::TooLarge { .. }
                    | StoreError::Refused { .. }
            )) | Error::NoNamespace(_)
        )
    }
}

/// The name this replica takes in the leader Lease: the pod name in a pod
/// (unique in its namespace, where the Lease lives), else what makes this
/// process distinct (host, pid, start time).
pub fn lease_identity(identity: &OperatorIdentity) -> String {
    match identity {
        OperatorIdentity::Pod { name, .. } => name.clone(),
        other => other.render(),
    }
}

/// Runs the controllers until SIGINT/SIGTERM: serves /metrics, /healthz
/// and /readyz, and with leader election reconciles only while leading
/// (the process exits when it loses the Lease; the fence stops it from
/// starting work before that, and its claims keep its work from running
/// twice).
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let clients = clients(opts.api_rate).await?;
    let client = clients.requests.clone();
    let metrics = Arc::new(crate::observe::Metrics::new());
    let health = crate::observe::Health::new();
    health.set_stall_bound(opts.stall_bound);
    let server = crate::observe::MetricsServer::bind(opts.metrics_addr)
        .await
        .map_err(|e| anyhow::anyhow!("--metrics-addr {}: {e}", opts.metrics_addr))?;
    info!(addr = %server.local_addr()?, "serving /metrics, /healthz, /readyz");
    tokio::spawn(server.run(metrics.clone(), health.clone()));
    let (identity, host) = (crate::host::operator_identity(), crate::host::processes());
    let Some(lease) = opts.leader_election.clone() else {
        metrics.set_leader(true);
        let holder = Holder::operator(&identity, host);
        return run_controllers(clients, opts, metrics, health, holder).await;
    };
    // A standby is ready (it serves nothing but must not block a rollout).
    health.set_ready(true);
    let lease_ns = std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| client.default_namespace().to_string());
    let election = crate::lease::LeaderElection::new(
        client.clone(),
        &lease_ns,
        &lease.name,
        &lease_identity(&identity),
        lease.duration,
        lease.grace,
    )
    .await?;
    let mut leading = election.watch();
    let m = metrics.clone();
    tokio::spawn(async move {
        loop {
            m.set_leader(*leading.borrow());
            if leading.changed().await.is_err() {
                break;
            }
        }
    });
    info!(lease = %lease.name, namespace = %lease_ns, "waiting to lead");
    tokio::select! {
        _ = election.elected() => {}
        _ = tokio::signal::ctrl_c() => { election.shutdown().await; return Ok(()); }
    }
    let fence = election.fence();
    let generation = fence.generation().unwrap_or_default();
    info!(lease = %lease.name, generation, "leading");
    let holder = Holder::elected_operator(&identity, generation, fence, host);
    let lost = tokio::select! {
        r = run_controllers(clients, opts, metrics, health, holder) => { r?; false }
        _ = election.lost() => true,
    };
    if lost {
        // Work under way keeps its claims; the next leader (a later
        // generation) voids them at once. Exiting ends every task.
        warn!("lost the lease; exiting");
        std::process::exit(1);
    }
    election.shutdown().await;
    Ok(())
}

/// The operator's two API clients, from KUBECONFIG or the pod's service
/// account: one for requests, one for watches.
#[derive(Clone)]
pub struct Clients {
    /// Reads and writes: a request that gets no answer (a dead peer,
    /// dropped packets) fails after 30 s instead of holding
    /// a reconcile for the kernel's TCP timeout (about 15 minutes).
    pub requests: Client,
    /// Watches: no read timeout (a quiet watch is not a dead one); the
    /// watcher's own idle timeout ends a watch that went silent.
    pub watches: Client,
}

/// A client-side pace: at most `burst` requests at once, `qps` a second on
/// average.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiRate {
    pub qps: u32,
    pub burst: u32,
}

async fn clients(rate: Option<ApiRate>) -> anyhow::Result<Clients> {
    let mut config = kube::Config::infer().await.map_err(|e| {
        anyhow::anyhow!("no usable cluster connection ({e}); set KUBECONFIG or run in a pod with a service account")
    })?;
    // A SYN into the void fails fast, and is retried with backoff.
    config.connect_timeout = Some(Duration::from_secs(5));
    let watches = client_over(config.clone(), None)?;
    config.read_timeout = Some(API_READ_TIMEOUT);
    config.reset_reader_on_write = true;
    let requests = client_over(config, rate)?;
    Ok(Clients { requests, watches })
}

/// A client that waits and retries when the API server says it is busy
/// (429 from Priority and Fairness, 503, 504; after `Retry-After` when
/// given), paced by `rate` when one is set. Only bodies held whole are
/// resent, so nothing is half-sent twice.
fn client_over(config: kube::Config, rate: Option<ApiRate>) -> anyhow::Result<Client> {
    use tower::{buffer::BufferLayer, limit::RateLimitLayer, retry::RetryLayer};
    let retry = RetryLayer::new(kube::client::retry::RetryPolicy::new(
        Duration::from_millis(100),
        Duration::from_secs(10),
        8,
        true,
    )?);
    let base = kube::client::ClientBuilder::try_from(config)?;
    Ok(match rate {
        Some(ApiRate { qps, burst }) => {
            let window = Duration::from_secs_f64(f64::from(burst) / f64::from(qps.max(1)));
            base.with_layer(&RateLimitLayer::new(u64::from(burst), window))
                .with_layer(&BufferLayer::new(1024))
                .with_layer(&retry)
                .build()
        }
        None => base
            .with_layer(&BufferLayer::new(1024))
            .with_layer(&retry)
            .build(),
    })
}

/// One controller set per watched namespace (or one for all).
async fn run_controllers(
    clients: Clients,
    opts: Options,
    metrics: Arc<crate::observe::Metrics>,
    health: crate::observe::Health,
    holder: Holder,
) -> anyhow::Result<()> {
    let scopes: Vec<Option<String>> = if opts.namespaces.is_empty() {
        vec![None]
    } else {
        opts.namespaces.iter().cloned().map(Some).collect()
    };
    let runs = scopes.into_iter().map(|ns| {
        run_with(
            clients.clone(),
            ns,
            opts.clone(),
            metrics.clone(),
            health.clone(),
            holder.clone(),
        )
    });
    for r in futures::future::join_all(runs).await {
        r?;
    }
    Ok(())
}

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    <K as Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A watch of `api` that re-establishes itself with its own backoff
/// (re-listing when its resource version is gone), reports every event and
/// error to `health` under `name`, and passes on events only.
///
/// Errors never reach the controller. kube-runtime pauses its whole merged
/// trigger stream (every watch, and the wake-ups) for a backoff that grows
/// with each error of any watch; while paused, requests that other watches
/// had begun are not polled, so the API server drops their TLS handshakes
/// (10 s) and they fail too at the next wake-up. After an API server
/// restart that loop never reset: the operator stalled for good.
fn tracked_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    health: &crate::observe::Health,
    name: String,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let health = health.clone();
    watcher(api, config.timeout(WATCH_TIMEOUT_SECS))
        .backoff(WatchBackoff::default())
        .inspect(move |event| match event {
            Ok(_) => health.link_ok(&name),
            Err(e) => {
                warn!(watch = %name, error = %e, "watch failed; re-establishing with backoff");
                health.link_failed(&name, &e.to_string());
            }
        })
        .filter(|event| futures::future::ready(event.is_ok()))
}

/// Backoff between attempts of one watch: 250 ms doubling to 5 s, with
/// jitter, reset by any event. Short, so a watch is back within seconds of
/// its API server; each watch retries on its own.
#[derive(Debug, Default)]
struct WatchBackoff {
    failures: u32,
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let full = Duration::from_millis(250u64 << self.failures.min(5)).min(WATCH_BACKOFF_MAX);
        self.failures = self.failures.saturating_add(1);
        // Half to all of it, so watches that failed together retry apart.
        let jitter = uuid::Uuid::new_v4().as_bytes()[0] as u32;
        Some(full / 2 + full / 2 * jitter / 255)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.failures = 0;
    }
}

pub async fn run_with(
    clients: Clients,
    namespace: Option<String>,
    opts: Options,
    metrics: Arc<crate::observe::Metrics>,
    health: crate::observe::Health,
    holder: Holder,
) -> anyhow::Result<()> {
    let ns = namespace.as_deref();
    let scope = ns.unwrap_or("all").to_string();
    let (client, watching) = (clients.requests, clients.watches);
    info!(
        holder = holder.name(),
        namespace = ns.unwrap_or("(all)"),
        "operator starting"
    );
    let (sessions, writer) = kube::runtime::reflector::store::<Session>();
    let (agents_seen, agents_writer) = kube::runtime::reflector::store::<Agent>();
    let ctx_handed = crate::store::kube::HandedSessions::default();
    let session_events = tracked_watch(
        api::<Session>(&watching, ns),
        watcher::Config::default(),
        &health,
        format!("watch sessions/{scope}"),
    )
    .modify({
        let handed = ctx_handed.clone();
        move |s| {
            handed.hand_in(s);
            keep_what_reconcile_reads(s)
        }
    })
    .reflect(writer)
    .applied_objects();
    let controller = Controller::for_stream(session_events, sessions.clone());
    let (wake_tx, wake_rx) = tokio::sync::mpsc::unbounded_channel::<ObjectRef<Session>>();
    let background = Arc::new(Background::new(
        wake_tx.clone(),
        opts.max_background_runs_per_namespace.into(),
    ));
    let mut context = Context::new(
        &client,
        ns,
        &opts,
        holder.clone(),
        background.clone(),
        metrics,
        agents_seen,
    );
    context.handed = ctx_handed;
    let ctx = Arc::new(context);
    if ctx.jobs.is_none() {
        info!("no --agents-image: runIsolated calls wait for an outside worker (agents session run-isolated --store kube)");
    }
    spawn_loops(&client, ns, &opts, &health, &sessions, background, wake_tx);
    let controller_guard = health.register_loop(&format!("sessions/{scope}"));
    let wakes =
        futures::stream::unfold(
            wake_rx,
            |mut rx| async move { rx.recv().await.map(|r| (r, rx)) },
        );
    let agents = agents::controller(&watching, ns, ctx.clone(), &health);
    let sessions_controller =
        with_triggers(controller, &watching, ns, &health, &sessions, agents_writer)
            .reconcile_on(wakes)
            .with_config(controller::Config::default().concurrency(opts.max_concurrent_reconciles))
            .shutdown_on_signal()
            .run(reconcile, error_policy, ctx)
            .for_each(|res| async move {
                match res {
                    Ok((obj, _)) => debug!(session = %obj, "reconciled"),
                    Err(e) => debug!(error = %e, "reconcile not done"),
                }
            });
    futures::join!(sessions_controller, agents);
    drop(controller_guard);
    info!("operator stopped");
    Ok(())
}

/// What else steps a session: its Continuations (a result written), the
/// Agent it names (created or fixed), and its tool Jobs and their pods.
fn with_triggers(
    controller: Controller<Session>,
    watching: &Client,
    ns: Option<&str>,
    health: &crate::observe::Health,
    sessions: &Store<Session>,
    agents_writer: kube::runtime::reflector::store::Writer<Agent>,
) -> Controller<Session> {
    let scope = ns.unwrap_or("all");
    let by_agent = sessions.clone();
    let job_selector = watcher::Config::default().labels(crate::runner::job::TOOL_JOB_SELECTOR);
    controller
        .owns_stream(
            tracked_watch(
                api::<Continuation>(watching, ns),
                watcher::Config::default(),
                health,
                format!("watch continuations/{scope}"),
            )
            .touched_objects(),
        )
        .watches_stream(
            tracked_watch(
                api::<Agent>(watching, ns),
                watcher::Config::default(),
                health,
                format!("watch agents/{scope}"),
            )
            .reflect(agents_writer)
            .touched_objects(),
            move |agent: Agent| sessions_using(&by_agent, &agent),
        )
        // A tool Job or its pod changing (done, failed, stuck on its
        // image) steps its session: the result is read at once.
        .watches_stream(
            tracked_watch(
                api::<k8s_openapi::api::batch::v1::Job>(watching, ns),
                job_selector.clone(),
                health,
                format!("watch jobs/{scope}"),
            )
            .touched_objects(),
            |job| session_of_tool(&job),
        )
        .watches_stream(
            tracked_watch(
                api::<k8s_openapi::api::core::v1::Pod>(watching, ns),
                job_selector,
                health,
                format!("watch pods/{scope}"),
            )
            .touched_objects(),
            |pod| session_of_tool(&pod),
        )
}

/// The loops beside the controller: the API probe, the sweep of deleted
/// sessions' runs, and the resync.
fn spawn_loops(
    client: &Client,
    ns: Option<&str>,
    opts: &Options,
    health: &crate::observe::Health,
    sessions: &Store<Session>,
    background: Arc<Background>,
    wake_tx: tokio::sync::mpsc::UnboundedSender<ObjectRef<Session>>,
) {
    let scope = ns.unwrap_or("all").to_string();
    tokio::spawn(api_probe(
        api::<Session>(client, ns),
        health.clone(),
        format!("list sessions/{scope}"),
    ));
    let sweep_guard = health.register_loop("sweep");
    let swept = sessions.clone();
    tokio::spawn(async move {
        let _guard = sweep_guard;
        sweep_loop(background, swept).await
    });
    let resync_guard = health.register_loop(&format!("resync/{scope}"));
    let resynced = sessions.clone();
    let (period, rate) = (opts.resync, opts.resync_rate);
    let resync_tx = wake_tx.clone();
    tokio::spawn(async move {
        let _guard = resync_guard;
        resync_loop(resynced, resync_tx, period, rate).await
    });
}

/// Readiness and a health signal independent of watch traffic: lists one
/// Session every few seconds through the operator's own client. Ready once
/// it first answers (reachable, and RBAC lets this replica read what it
/// watches); its failures count against the stall bound.
async fn api_probe(probe: Api<Session>, health: crate::observe::Health, name: String) {
    loop {
        let listed = tokio::time::timeout(
            API_PROBE_TIMEOUT,
            probe.list_metadata(&kube::api::ListParams::default().limit(1)),
        )
        .await;
        match listed {
            Ok(Ok(_)) => {
                health.set_ready(true);
                health.link_ok(&name);
            }
            Ok(Err(e)) => {
                warn!(error = %e, "cannot list sessions");
                health.link_failed(&name, &e.to_string());
            }
            Err(_) => {
                warn!("listing sessions got no answer within {API_PROBE_TIMEOUT:?}");
                health.link_failed(&name, "no answer");
            }
        }
        tokio::time::sleep(API_PROBE_PERIOD).await;
    }
}

/// The safety net under the watches: every session that is not final is
/// reconciled at least once per `period`, at most `rate` a second, so a
/// missed event strands nothing. A step that finds nothing to do writes
/// nothing.
async fn resync_loop(
    sessions: Store<Session>,
    wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<Session>>,
    period: Duration,
    rate: u32,
) {
    let pace = Duration::from_secs(1) / rate.max(1);
    loop {
        tokio::time::sleep(period).await;
        let due: Vec<ObjectRef<Session>> = sessions
            .state()
            .iter()
            .filter(|s| !is_final(s))
            .map(|s| ObjectRef::from_obj(s.as_ref()))
            .collect();
        debug!(sessions = due.len(), "resync");
        for session in due {
            if wake.send(session).is_err() {
                return;
            }
            tokio::time::sleep(pace).await;
        }
    }
}

/// What the operator keeps of each watched Session: its identity, how it
/// names its agent, its phase, conditions and counters. A step starts
/// from the whole object, handed to it beside this cache, so the
/// conversation (`status.state`, messages), the managed fields and
/// kubectl's last-applied copy are dropped here as they arrive: memory
/// grows with the number of sessions, not their length.
fn keep_what_reconcile_reads(session: &mut Session) {
    session.metadata.managed_fields = None;
    if let Some(notes) = session.metadata.annotations.as_mut() {
        notes.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    session.spec.messages = Vec::new();
    if let Some(status) = session.status.take() {
        session.status = Some(crate::api::SessionStatus {
            phase: status.phase,
            conditions: status.conditions,
            observed_generation: status.observed_generation,
            retries_taken: status.retries_taken,
            ..Default::default()
        });
    }
}

/// Succeeded or Failed: nothing moves it on but an edit, which the watch
/// delivers.
fn is_final(session: &Session) -> bool {
    use crate::api::session::SessionPhase;
    session
        .status
        .as_ref()
        .is_some_and(|s| matches!(s.phase, SessionPhase::Succeeded | SessionPhase::Failed))
}

async fn sweep_loop(background: Arc<Background>, sessions: Store<Session>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        background.sweep(&sessions);
    }
}

/// The session a tool Job or pod runs for (its annotation).
fn session_of_tool<K: Resource<DynamicType = ()>>(obj: &K) -> Option<ObjectRef<Session>> {
    let meta = obj.meta();
    let session = meta
        .annotations
        .as_ref()?
        .get(crate::runner::job::ANNOTATION_SESSION)?;
    Some(ObjectRef::new(session).within(meta.namespace.as_deref()?))
}

/// The sessions that refer to `agent` by name.
fn sessions_using(sessions: &Store<Session>, agent: &Agent) -> Vec<ObjectRef<Session>> {
    let name = agent.name_any();
    let ns = agent.namespace();
    sessions
        .state()
        .iter()
        .filter(|s| s.namespace() == ns)
        .filter(|s| s.spec.agent_ref.as_ref().is_some_and(|r| r.name == name))
        .map(|s| ObjectRef::from_obj(s.as_ref()))
        .collect()
}

/// Why a session cannot run now: its `Ready=False` condition.
struct NotReady {
    reason: &'static str,
    message: String,
    recheck: Duration,
}

/// The agent of a session, ready to run.
struct Resolved {
    runtime: AgentRuntime,
    model: ModelClient,
    tools: Arc<Toolbox>,
    agent_name: String,
    /// Where waits for a person are announced.
    notify: Option<notify::Target>,
    /// What listing the agent's MCP servers found.
    mcp: Vec<crate::tools::mcp::ServerListing>,
}

async fn resolve(ctx: &Context, session: &Session, ns: &str) -> Result<Resolved, NotReady> {
    use crate::agent::Unresolved;
    let name = session.name_any();
    let lookup = agents::WatchedAgents {
        seen: &ctx.agents,
        api: crate::store::kube_admin::ClusterAgents(Api::namespaced(ctx.client.clone(), ns)),
        namespace: ns,
    };
    let place = format!("in namespace {ns}; the session waits until it is created");
    let definition = crate::agent::definition(&name, &session.spec, &lookup, &place)
        .await
        .map_err(|e| {
            let (reason, recheck) = match &e {
                Unresolved::Ambiguous { .. } => ("InvalidSpec", INVALID_RECHECK),
                Unresolved::Missing { .. } => ("AgentNotFound", NOT_READY_RECHECK * 4),
                Unresolved::Unreadable { .. } => ("AgentUnreadable", NOT_READY_RECHECK),
            };
            NotReady {
                reason,
                message: e.to_string(),
                recheck,
            }
        })?;
    let created = session
        .metadata
        .creation_timestamp
        .as_ref()
        .map(crate::api::convert::millis)
        .unwrap_or_default();
    prepare(ctx, ns, definition, created).await
}

/// The agent `spec` made runnable for a session: config, model client (its
/// key read from the Secret it names), tools. The Agent controller runs the
/// same checks to report an Agent's own `Ready`.
async fn prepare(
    ctx: &Context,
    ns: &str,
    definition: Definition,
    created: crate::core::Millis,
) -> Result<Resolved, NotReady> {
    let (spec, agent_name) = (&definition.agent, definition.agent_name.clone());
    // The model's key is read below from the session namespace's Secret;
    // never from this process's environment.
    let mut agent = definition
        .build(created, &NoSecrets)
        .map_err(|message| NotReady {
            reason: "InvalidAgent",
            message,
            recheck: INVALID_RECHECK,
        })?;
    agent.config.default_tool_timeout_secs = ctx.options.default_tool_timeout_secs;
    agent.config.limits.max_calls_per_reply = Some(ctx.options.max_calls_per_reply);
    let model_timeout = match (spec.model.timeout_seconds, ctx.options.model_timeout_secs) {
        (None, Some(default)) => default,
        _ => spec.model.timeout_seconds().into(),
    };
    agent.config.model_timeout_secs = model_timeout;
    let model = match spec.model.provider {
        ModelProvider::Scripted => agent.model.clone(),
        ModelProvider::Openai | ModelProvider::Anthropic => {
            remote_model(ctx, ns, spec, model_timeout).await?
        }
    };
    let (agent, mcp) = ready_tools(ctx, ns, agent).await?;
    let runtime = AgentRuntime {
        config: agent.config.clone(),
        system_prompt: agent.system_prompt.clone(),
        tools: agent.toolbox.schemas(),
    };
    Ok(Resolved {
        runtime,
        model,
        tools: Arc::new(agent.toolbox),
        agent_name: agent_name.unwrap_or_else(|| "(inline)".into()),
        notify: notify::target(spec, ctx.options.notify_webhook_url.as_deref()),
        mcp,
    })
}

/// The remote model client of `spec`, held to the operator's list of
/// model URLs; its key read from the session namespace's Secret, and only
/// once the URL is known to be allowed.
async fn remote_model(
    ctx: &Context,
    ns: &str,
    spec: &crate::api::AgentSpec,
    timeout_secs: u64,
) -> Result<ModelClient, NotReady> {
    let timeout = Duration::from_secs(timeout_secs);
    let client = crate::agent::model_client(&spec.model, &NoSecrets, timeout)
        .map_err(|message| NotReady {
            reason: "InvalidAgent",
            message,
            recheck: INVALID_RECHECK,
        })?
        .with_allowed_urls(ctx.options.model_allowed_urls.clone());
    if let Some(why) = client.url_not_allowed() {
        return Err(NotReady {
            reason: MODEL_URL_NOT_ALLOWED,
            message: format!("{}: {why}", spec.model.base_url_field()),
            recheck: INVALID_RECHECK,
        });
    }
    let key = match spec.model.api_key_secret_ref() {
        None => None,
        Some((r, what)) => Some(read_secret(ctx, ns, &r.name, &r.key, what).await?),
    };
    Ok(client.with_api_key(key))
}

/// The agent's tools made ready to run here: their Secrets read (and
/// those of tool Jobs checked usable), the operator's allow-list, the
/// shared MCP connections, and the MCP servers' tools listed and joined.
async fn ready_tools(
    ctx: &Context,
    ns: &str,
    mut agent: crate::agent::RunnableAgent,
) -> Result<
    (
        crate::agent::RunnableAgent,
        Vec<crate::tools::mcp::ServerListing>,
    ),
    NotReady,
> {
    // Header secrets of http tools and MCP servers come from Secrets in
    // the session's namespace, never from the operator's own environment.
    let mut secrets = std::collections::BTreeMap::new();
    for r in agent.toolbox.secret_refs() {
        let value = read_secret(ctx, ns, &r.name, &r.key, "a tool's header").await?;
        secrets.insert(r.env_name(), value);
    }
    // Secrets of tool Jobs are read by the kubelet, not by us: they must
    // be usable all the same, before any Job names them.
    for r in agent.tool_secrets() {
        usable_secret(ctx, ns, &r.name, "a tool's env").await?;
    }
    agent.toolbox = agent
        .toolbox
        .with_secrets(secrets)
        .with_allowed_urls(ctx.options.http_tool_allowed_urls.clone())
        .with_mcp_pool(ctx.mcp.clone());
    // MCP servers are listed here (a listing is reused for a minute); their
    // tools join the toolbox, the config and what the model is offered.
    agent.with_mcp_tools(false).await.map_err(|e| NotReady {
        reason: e.reason(),
        message: e.to_string(),
        recheck: if e.reason() == "McpServerUnavailable" {
            NOT_READY_RECHECK
        } else {
            INVALID_RECHECK
        },
    })
}

/// The reason of an Agent's `Ready=False` when one of its http tools calls
/// a URL the operator's allow-list does not hold. Sessions of the agent
/// still run; each call of that tool fails with an error result.
pub const HTTP_TOOL_URL_NOT_ALLOWED: &str = "HttpToolUrlNotAllowed";

/// The reason of an Agent's (and its sessions') `Ready=False` when its
/// model's URL is off the operator's list: no request goes to it, and its
/// sessions wait until the Agent or the list changes.
pub const MODEL_URL_NOT_ALLOWED: &str = "ModelUrlNotAllowed";

/// The label that makes a Secret usable by the agents of its namespace
/// (unless the operator runs with `--secrets-need-label=false`).
pub const USABLE_BY_AGENTS: &str = "agents-exe.io/usable-by-agents";

/// Secret `name`, if agents may use it. With the label check on, a missing
/// Secret and an unlabelled one read the same (`SecretNotUsable`): whoever
/// writes an Agent learns nothing of Secrets they were not given.
async fn usable_secret(
    ctx: &Context,
    ns: &str,
    name: &str,
    named_by: &str,
) -> Result<Secret, NotReady> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let labelled = |s: &Secret| {
        s.labels()
            .get(USABLE_BY_AGENTS)
            .is_some_and(|v| v == "true")
    };
    let need_label = ctx.options.secrets_need_label;
    match secrets.get_opt(name).await {
        Ok(Some(s)) if !need_label || labelled(&s) => Ok(s),
        Ok(_) if need_label => Err(NotReady {
            reason: "SecretNotUsable",
            message: format!(
                "Secret {name:?} ({named_by}) is not usable by agents in namespace {ns}: a Secret is usable when it exists and carries the label {USABLE_BY_AGENTS}=true (kubectl -n {ns} label secret {name} {USABLE_BY_AGENTS}=true)"
            ),
            recheck: NOT_READY_RECHECK,
        }),
        Ok(_) => Err(NotReady {
            reason: "SecretNotFound",
            message: format!(
                "Secret {name:?} ({named_by}) does not exist in namespace {ns}; create it, e.g. kubectl -n {ns} create secret generic {name} --from-literal=KEY=..."
            ),
            recheck: NOT_READY_RECHECK,
        }),
        Err(e) => Err(NotReady {
            reason: "SecretUnreadable",
            message: format!("Secret {name:?} in namespace {ns} cannot be read: {}", kube_reason(&e)),
            recheck: NOT_READY_RECHECK,
        }),
    }
}

/// The value of key `key` of Secret `name`, if agents may use it. Never
/// logged.
async fn read_secret(
    ctx: &Context,
    ns: &str,
    name: &str,
    key: &str,
    named_by: &str,
) -> Result<String, NotReady> {
    let secret = usable_secret(ctx, ns, name, named_by).await?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_string())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|s| s.trim().to_string())
        });
    match value {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(NotReady {
            reason: "SecretKeyNotFound",
            message: format!(
                "Secret {name:?} in namespace {ns} has no (non-empty) key {key:?}, which {named_by} names"
            ),
            recheck: NOT_READY_RECHECK,
        }),
    }
}

fn kube_reason(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}", s.code, s.message),
        other => other.to_string(),
    }
}

/// One reconcile, as a pipeline: dereference and validate the agent (a
/// session that cannot run gets `Ready=False`), one engine step, then the
/// report (conditions, Events, metrics) and the requeue.
async fn reconcile(session: Arc<Session>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let result = reconcile_timed(session, ctx.clone()).await;
    ctx.metrics.reconcile_duration(started.elapsed());
    result
}

async fn reconcile_timed(session: Arc<Session>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = session.name_any();
    let ns = session
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    let Some(_slot) = ctx.slots.take(&ns) else {
        ctx.metrics.namespace_at_cap();
        return Ok(Action::requeue(namespace_busy_recheck(&name)));
    };
    if session.metadata.deletion_timestamp.is_some() {
        // Its continuations go by garbage collection; its runs by the
        // sweep; its MCP tasks are cancelled here.
        task_cancel::cancel_then_release(&ctx, &session, &ns).await?;
        return Ok(Action::await_change());
    }
    let ttl = session
        .spec
        .ttl_seconds_after_finished
        .or(ctx.options.finished_session_ttl_seconds);
    if let Some(wait) = retention_wait(&session, ttl, SystemClock.now()) {
        return retain_or_delete(&ctx, &session, &ns, wait).await;
    }
    let store = KubeStore::new(ctx.client.clone(), &ns)
        .with_cache(ctx.cache.clone())
        .starting_from(ctx.handed.take(&ns, &name));
    let resolved = match resolve(&ctx, &session, &ns).await {
        Ok(r) => r,
        Err(not_ready) => return report_not_ready(&ctx, &session, store, not_ready).await,
    };
    let store = store.with_report(Arc::new(report::SessionConditions {
        ready: report::ready(
            Status::True,
            "AgentResolved",
            format!("agent {} resolved and valid", resolved.agent_name),
        ),
    }));
    let uses_mcp = !resolved.mcp.is_empty();
    let held = match task_cancel::hold_before_step(&ctx, &session, &ns, uses_mcp).await? {
        task_cancel::Hold::Step { held } => held,
        task_cancel::Hold::Going => return Ok(Action::await_change()),
    };
    let (step, progress, quota) = step_session(&ctx, &session, &ns, &store, &resolved).await?;
    let id = SessionId(name.clone());
    let settled = store.settle(&id, &step.state).await?;
    task_cancel::keep_finalizer(&ctx, &session, &ns, &step.state, uses_mcp, held).await?;
    ctx.background
        .prune(&session.uid().unwrap_or_default(), &step.state);
    ctx.failures
        .lock()
        .expect("failures")
        .remove(&format!("{ns}/{name}"));
    report_step(&ctx, &session, &step, progress);
    let quota_retry = quota.map(|why| held_by_quota(&ctx, &session, why));
    // Waits for a person are announced once each (a marker in the
    // Continuation's status); a failed POST is retried after a backoff.
    let retry_notify = match (&resolved.notify, &step.outcome) {
        (Some(target), StepOutcome::Waiting { .. } | StepOutcome::Busy { .. }) => {
            notify::after_step(&ctx, &session, &ns, target, store.owned_continuations()).await
        }
        _ => None,
    };
    info!(
        session = %format!("{ns}/{name}"),
        outcome = report::outcome_name(&step.outcome),
        writes = step.writes,
        api_writes = store.api_writes(),
        wrote = step.writes > 0 || settled,
        "step"
    );
    let look_again = [retry_notify, quota_retry].into_iter().flatten().min();
    Ok(report::requeue(
        &step.outcome,
        ttl,
        look_again,
        SystemClock.now(),
    ))
}

/// When a session whose namespace holds all its slots is looked at again:
/// in one to two seconds, spread by its name so they do not come back at
/// once.
fn namespace_busy_recheck(name: &str) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    Duration::from_millis(1_000 + h.finish() % 1_000)
}

/// How long until a finished session is due for deletion under `ttl`
/// seconds (zero: now); `None` while it is not finished, is kept, or was
/// asked to retry.
fn retention_wait(
    session: &Session,
    ttl: Option<u64>,
    now: crate::core::Millis,
) -> Option<Duration> {
    let ttl = ttl?;
    let status = session.status.as_ref()?;
    if session.spec.retry.unwrap_or(0) > status.retries_taken {
        return None;
    }
    let finished = status
        .conditions
        .iter()
        .filter(|c| (c.type_ == "Succeeded" || c.type_ == "Failed") && c.status == "True")
        .map(|c| crate::api::convert::millis(&c.last_transition_time))
        .max()?;
    let due = finished.plus_secs(ttl);
    Some(Duration::from_millis((due.0 - now.0).max(0) as u64))
}

/// Deletes a finished session whose time has come (this very one: its
/// UID is the precondition), or looks again when it comes.
async fn retain_or_delete(
    ctx: &Context,
    session: &Session,
    ns: &str,
    wait: Duration,
) -> Result<Action, Error> {
    if !wait.is_zero() {
        return Ok(Action::requeue(wait));
    }
    let api: Api<Session> = Api::namespaced(ctx.client.clone(), ns);
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: session.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(&session.name_any(), &params).await {
        Ok(_) => {
            info!(session = %format!("{ns}/{}", session.name_any()), "finished session deleted (ttlSecondsAfterFinished)");
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(e) => return Err(Error::Kube(e)),
    }
    Ok(Action::await_change())
}

/// A session whose agent cannot run now: its `Ready=False` condition (and
/// an Event when that is news), and a recheck.
async fn report_not_ready(
    ctx: &Context,
    session: &Session,
    store: KubeStore,
    not_ready: NotReady,
) -> Result<Action, Error> {
    let id = SessionId(session.name_any());
    let key = format!(
        "{}/{}",
        session.namespace().unwrap_or_default(),
        session.name_any()
    );
    let store = store.with_report(Arc::new(report::SessionConditions {
        ready: report::ready(Status::False, not_ready.reason, not_ready.message.clone()),
    }));
    // Read fresh: the conditions follow the stored state.
    let Some(loaded) = crate::ports::SessionPort::load(&store, &id).await? else {
        return Ok(Action::await_change());
    };
    if store.settle(&id, &loaded.value.state).await? {
        warn!(session = %key, reason = not_ready.reason, message = %not_ready.message, "session not ready");
        let event = kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: not_ready.reason.into(),
            note: Some(not_ready.message),
            action: "ResolveAgent".into(),
            secondary: None,
        };
        publish(ctx, &session.object_ref(&()), event);
    }
    ctx.failures.lock().expect("failures").remove(&key);
    Ok(Action::requeue(not_ready.recheck))
}

/// A call's Job waits for the namespace's ResourceQuota: said in a
/// Warning Event (repeats fold into its series), and looked at again soon.
fn held_by_quota(ctx: &Context, session: &Session, why: String) -> Duration {
    let event = events::event(
        kube::runtime::events::EventType::Warning,
        "QuotaExceeded",
        "CreateJob",
        format!(
            "an isolated call waits for room in the namespace's ResourceQuota, tried again every {} s until the call's timeout: {why}",
            crate::runner::job::QUOTA_RETRY.as_secs()
        ),
    );
    publish(ctx, &session.object_ref(&()), event);
    crate::runner::job::QUOTA_RETRY
}

/// The engine step over the cluster's ports; returns its report, what it
/// observed, and why a ResourceQuota held a call's Job, if one did.
async fn step_session(
    ctx: &Context,
    session: &Session,
    ns: &str,
    store: &KubeStore,
    resolved: &Resolved,
) -> Result<(engine::StepReport, Vec<Progress>, Option<String>), Error> {
    let progress: Mutex<Vec<Progress>> = Mutex::new(Vec::new());
    let observer = |p: &Progress| progress.lock().expect("progress").push(p.clone());
    let model = AgentModel(&resolved.model);
    let tools = AgentTools(&resolved.tools);
    let runner = SessionRunner {
        background: ctx.background.clone(),
        session: ObjectRef::from_obj(session),
        uid: session.uid().unwrap_or_default(),
        tools: resolved.tools.clone(),
        jobs: ctx.jobs.as_ref().map(|j| j.with_namespace(ns)),
    };
    let ports = Ports::over_store(store, &model, &tools, &runner, &observer)
        .traced(crate::telemetry::tracer());
    let roles = Roles {
        model: true,
        background: true,
        isolated: ctx.jobs.is_some(),
    };
    let id = SessionId(session.name_any());
    let report = engine::step(&ports, &id, &resolved.runtime, &ctx.holder, roles).await?;
    let quota = runner.jobs.as_ref().and_then(|j| j.held_by_quota());
    Ok((report, progress.into_inner().expect("progress"), quota))
}

/// Metrics and Events for what a step did; a wait already announced is not
/// announced again (every step re-ensures open continuations).
fn report_step(
    ctx: &Context,
    session: &Session,
    step: &engine::StepReport,
    progress: Vec<Progress>,
) {
    let uid = session.uid().unwrap_or_default();
    let progress = ctx
        .announced
        .lock()
        .expect("announced")
        .news(&uid, progress);
    ctx.metrics.reconciled(true);
    for p in &progress {
        report::count(&ctx.metrics, p);
    }
    let reference = session.object_ref(&());
    for e in report::step_events(&progress, &step.outcome, step.writes > 0) {
        publish(ctx, &reference, e);
    }
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

/// Ends a session that cannot go on as `Failed`, saying why: through the
/// core's state when it can be read and written, else by its phase alone.
/// A session already final is left as it is. The spec's messages and
/// retry count as seen: taking them again would only fail again (a new
/// message or retry restarts the session).
async fn fail_session(ctx: Arc<Context>, session: Arc<Session>, reason: String) {
    let (Some(ns), name) = (session.namespace(), session.name_any()) else {
        return;
    };
    let store = KubeStore::new(ctx.client.clone(), &ns);
    let id = SessionId(name.clone());
    let failed_by_the_core = match crate::ports::SessionPort::load(&store, &id).await {
        Ok(Some(loaded)) if loaded.value.state.phase.is_final() => return,
        Ok(Some(loaded)) => {
            let mut record = loaded.value;
            record.state.messages_taken = record.input.messages.len() as u32;
            record.state.retries_taken = record.input.retry;
            record.state.fail(reason.clone());
            record.updated_at = SystemClock.now();
            crate::ports::SessionPort::save(&store, &record, &loaded.version)
                .await
                .is_ok()
        }
        _ => false,
    };
    if !failed_by_the_core {
        let api: Api<Session> = Api::namespaced(ctx.client.clone(), &ns);
        if let Err(e) = fail_by_phase(&api, &name, &reason).await {
            warn!(session = %format!("{ns}/{name}"), error = %e, "could not mark the session Failed");
            return;
        }
    }
    let event = kube::runtime::events::Event {
        type_: kube::runtime::events::EventType::Warning,
        reason: "SessionFailed".into(),
        note: Some(reason.chars().take(900).collect()),
        action: "Reconcile".into(),
        secondary: None,
    };
    publish(&ctx, &session.object_ref(&()), event);
}

/// Marks the session `Failed` in its status alone, with its spec's
/// messages and retry seen when the spec can be read (afresh: the watched
/// copy keeps no messages).
async fn fail_by_phase(api: &Api<Session>, name: &str, reason: &str) -> Result<(), kube::Error> {
    let mut status = serde_json::json!({"phase": "Failed", "failure": reason});
    if let Ok(session) = api.get(name).await {
        status["messagesSeen"] = session.spec.messages.len().into();
        status["retriesSeen"] = session.spec.retry.unwrap_or(0).into();
    }
    let body = serde_json::json!({ "status": status });
    api.patch_status(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&body),
    )
    .await
    .map(|_| ())
}

fn error_policy(session: Arc<Session>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconciled(false);
    ctx.metrics.reconcile_error(match error {
        Error::Engine(EngineError::TooManyConflicts(_)) => "conflicts",
        Error::Engine(EngineError::Fenced { .. }) => "fenced",
        Error::Engine(EngineError::Store(_)) | Error::Store(_) => "store",
        Error::Kube(_) => "api",
        Error::NoNamespace(_) => "spec",
    });
    let key = format!(
        "{}/{}",
        session.namespace().unwrap_or_default(),
        session.name_any()
    );
    if error.is_permanent() {
        warn!(session = %key, error = %error, "reconcile failed; the session fails");
        tokio::spawn(fail_session(
            ctx.clone(),
            session.clone(),
            error.to_string(),
        ));
        publish(
            &ctx,
            &session.object_ref(&()),
            kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Warning,
                reason: "ReconcileFailed".into(),
                note: Some(error.to_string().chars().take(900).collect()),
                action: "Reconcile".into(),
                secondary: None,
            },
        );
        return Action::requeue(INVALID_RECHECK);
    }
    let n = {
        let mut failures = ctx.failures.lock().expect("failures");
        // Entries of sessions deleted while failing are never removed by a
        // success: bound the map (a lost count only restarts a backoff).
        if failures.len() >= MAX_TRACKED_FAILURES && !failures.contains_key(&key) {
            failures.clear();
        }
        let n = failures.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    };
    if n >= MAX_FAILED_RECONCILES && error.counts_against_the_session() {
        warn!(session = %key, error = %error, attempts = n, "reconcile failed too often; the session fails");
        ctx.failures.lock().expect("failures").remove(&key);
        let reason = format!("{n} steps in a row failed; the last: {error}");
        tokio::spawn(fail_session(ctx.clone(), session.clone(), reason));
        return Action::requeue(Duration::from_secs(5));
    }
    // While the API server is away, look again every few seconds: the
    // session resumes within seconds of its return, not a minute later.
    let cap = if error.is_transient() {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(60)
    };
    let backoff = Duration::from_millis(250u64.saturating_mul(1 << n.min(8))).min(cap);
    if matches!(
        error,
        Error::Engine(EngineError::Store(StoreError::Conflict { .. }))
            | Error::Store(StoreError::Conflict { .. })
    ) {
        debug!(session = %key, attempt = n, ?backoff, "conflict; retrying");
    } else {
        warn!(session = %key, error = %error, attempt = n, ?backoff, "reconcile failed; retrying");
    }
    Action::requeue(backoff)
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

    #[test]
    fn sessions_put_off_come_back_spread_over_a_second() {
        let waits: std::collections::BTreeSet<Duration> = (0..50)
            .map(|i| namespace_busy_recheck(&format!("s{i}")))
            .collect();
        assert!(waits.len() > 10, "spread: {waits:?}");
        assert!(waits
            .iter()
            .all(|w| *w >= Duration::from_secs(1) && *w < Duration::from_secs(2)));
    }
}
