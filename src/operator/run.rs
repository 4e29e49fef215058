//! The run loop: the API clients, leader election, one controller set per
//! watched namespace with its triggers, and the loops beside it (the API
//! probe, the sweep of deleted sessions' runs, the resync).

use super::api_requests::CountLayer;
use super::background::Background;
use super::health::{api, api_probe, tracked_watch};
use super::{agents, failure, reconcile, Context, Options};
use crate::api::{Agent, Budget, Continuation, Session};
use crate::engine::holder::OperatorIdentity;
use crate::engine::Holder;
use futures::{StreamExt, TryStreamExt};
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// Requests that get no answer within this long fail (and are retried),
/// instead of hanging on a dead connection.
const API_READ_TIMEOUT: Duration = Duration::from_secs(30);

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
    let metrics = Arc::new(crate::observe::Metrics::new());
    let clients = clients(opts.api_rate, &metrics).await?;
    let client = clients.requests.clone();
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

async fn clients(
    rate: Option<ApiRate>,
    metrics: &Arc<crate::observe::Metrics>,
) -> anyhow::Result<Clients> {
    let mut config = kube::Config::infer().await.map_err(|e| {
        anyhow::anyhow!("no usable cluster connection ({e}); set KUBECONFIG or run in a pod with a service account")
    })?;
    // A SYN into the void fails fast, and is retried with backoff.
    config.connect_timeout = Some(Duration::from_secs(5));
    let count = CountLayer(metrics.clone());
    let watches = client_over(config.clone(), None, &count)?;
    config.read_timeout = Some(API_READ_TIMEOUT);
    config.reset_reader_on_write = true;
    let requests = client_over(config, rate, &count)?;
    Ok(Clients { requests, watches })
}

/// A client that waits and retries when the API server says it is busy
/// (429 from Priority and Fairness, 503, 504; after `Retry-After` when
/// given), paced by `rate` when one is set. Only bodies held whole are
/// resent, so nothing is half-sent twice. Every attempt is counted.
fn client_over(
    config: kube::Config,
    rate: Option<ApiRate>,
    count: &CountLayer,
) -> anyhow::Result<Client> {
    use tower::{buffer::BufferLayer, limit::RateLimitLayer, retry::RetryLayer};
    let retry = RetryLayer::new(kube::client::retry::RetryPolicy::new(
        Duration::from_millis(100),
        Duration::from_secs(10),
        8,
        true,
    )?);
    let base = kube::client::ClientBuilder::try_from(config)?.with_layer(count);
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
    let (budgets_seen, budgets_writer) = kube::runtime::reflector::store::<Budget>();
    let ctx_handed = crate::store::kube::HandedSessions::default();
    let session_events = tracked_watch(
        api::<Session>(&watching, ns),
        watcher::Config::default(),
        &health,
        format!("watch sessions/{scope}"),
    )
    .map_ok({
        let handed = ctx_handed.clone();
        move |event| {
            // A deleted session's copy would wait for a step that never comes.
            match &event {
                watcher::Event::Delete(s) => handed.forget(s),
                watcher::Event::Apply(s) | watcher::Event::InitApply(s) => handed.hand_in(s),
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
            event.modify(keep_what_reconcile_reads)
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
    context.budgets = budgets_seen;
    let ctx = Arc::new(context);
    if ctx.jobs.is_none() {
        info!("no --agents-image: runIsolated calls wait for an outside worker (agents session run-isolated --store kube)");
    }
    spawn_loops(&client, ns, &opts, &health, &sessions, background, wake_tx);
    tokio::spawn(count_phases_loop(sessions.clone(), ctx.metrics.clone()));
    let controller_guard = health.register_loop(&format!("sessions/{scope}"));
    let wakes =
        futures::stream::unfold(
            wake_rx,
            |mut rx| async move { rx.recv().await.map(|r| (r, rx)) },
        );
    let agents = agents::controller(&watching, ns, ctx.clone(), &health);
    let budgets = budgets_controller(&client, &watching, ns, &health, &sessions);
    let watched = Watched {
        agents: agents_writer,
        budgets: budgets_writer,
        continuations: ctx.continuations.clone(),
    };
    let sessions_controller = with_triggers(controller, &watching, ns, &health, &sessions, watched)
        .reconcile_on(wakes)
        .with_config(controller::Config::default().concurrency(opts.max_concurrent_reconciles))
        .shutdown_on_signal()
        .run(reconcile::reconcile, failure::error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(session = %obj, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile not done"),
            }
        });
    futures::join!(sessions_controller, agents, budgets);
    drop(controller_guard);
    info!("operator stopped");
    Ok(())
}

/// The Budget controller: periods, deleted sessions folded, conditions.
fn budgets_controller(
    client: &Client,
    watching: &Client,
    ns: Option<&str>,
    health: &crate::observe::Health,
    sessions: &Store<Session>,
) -> impl std::future::Future<Output = ()> {
    let scope = ns.unwrap_or("all");
    let ctx = Arc::new(super::budget_status::BudgetContext {
        client: client.clone(),
        sessions: sessions.clone(),
    });
    let (store, writer) = kube::runtime::reflector::store::<Budget>();
    let events = tracked_watch(
        api::<Budget>(watching, ns),
        watcher::Config::default(),
        health,
        format!("watch budgets/{scope}"),
    )
    .reflect(writer)
    .applied_objects();
    Controller::for_stream(events, store)
        .shutdown_on_signal()
        .run(
            super::budget_status::reconcile,
            |_, e, _| {
                debug!(error = %e, "budget reconcile not done");
                controller::Action::requeue(Duration::from_secs(5))
            },
            ctx,
        )
        .for_each(|_| async {})
}

/// What the trigger watches keep for the reconciles beside waking them.
struct Watched {
    agents: kube::runtime::reflector::store::Writer<Agent>,
    budgets: kube::runtime::reflector::store::Writer<Budget>,
    /// Taken in before the wake, so the woken step finds what woke it.
    continuations: Arc<crate::store::kube::WatchedContinuations>,
}

/// What else steps a session: its Continuations (a result written), the
/// Agent it names (created or fixed), a Budget that holds it (raised,
/// started over), and its tool Jobs and their pods.
fn with_triggers(
    controller: Controller<Session>,
    watching: &Client,
    ns: Option<&str>,
    health: &crate::observe::Health,
    sessions: &Store<Session>,
    watched: Watched,
) -> Controller<Session> {
    let scope = ns.unwrap_or("all");
    let by_agent = sessions.clone();
    let by_budget = sessions.clone();
    let job_selector = watcher::Config::default().labels(crate::runner::job::TOOL_JOB_SELECTOR);
    controller
        .owns_stream(
            tracked_watch(
                api::<Continuation>(watching, ns),
                watcher::Config::default(),
                health,
                format!("watch continuations/{scope}"),
            )
            .inspect_ok(move |event| watched.continuations.apply(event))
            .touched_objects(),
        )
        // A sub-agent's child changing (ended, deleted) steps its parent,
        // found through the child's ownerReference.
        .owns_stream(
            tracked_watch(
                api::<Session>(watching, ns),
                watcher::Config::default().labels(super::children::LABEL_PARENT),
                health,
                format!("watch child sessions/{scope}"),
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
            .reflect(watched.agents)
            .touched_objects(),
            move |agent: Agent| sessions_using(&by_agent, &agent),
        )
        .watches_stream(
            tracked_watch(
                api::<Budget>(watching, ns),
                watcher::Config::default(),
                health,
                format!("watch budgets for sessions/{scope}"),
            )
            .reflect(watched.budgets)
            .touched_objects(),
            move |budget: Budget| super::budgets::sessions_waiting_on(&by_budget, &budget),
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

/// How often `agents_sessions{phase}` is set from the watch's cache.
const PHASE_COUNT_EVERY: Duration = Duration::from_secs(10);

/// Keeps `agents_sessions{phase}` true to the watch's cache: every phase
/// is set each round, zeros included, so a phase emptied reads 0.
async fn count_phases_loop(sessions: Store<Session>, metrics: Arc<crate::observe::Metrics>) {
    use crate::api::session::SessionPhase;
    let mut tick = tokio::time::interval(PHASE_COUNT_EVERY);
    loop {
        tick.tick().await;
        let mut counts = std::collections::BTreeMap::<String, i64>::new();
        for phase in [
            SessionPhase::Pending,
            SessionPhase::AwaitingModel,
            SessionPhase::Running,
            SessionPhase::Waiting,
            SessionPhase::Paused,
            SessionPhase::Succeeded,
            SessionPhase::Failed,
        ] {
            counts.insert(format!("{phase:?}"), 0);
        }
        for session in sessions.state() {
            let phase = session.status.as_ref().map(|s| s.phase).unwrap_or_default();
            *counts.entry(format!("{phase:?}")).or_default() += 1;
        }
        for (phase, count) in counts {
            metrics.set_sessions(&phase, count);
        }
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
/// from the whole object, handed to it beside this cache (or reads it), so
/// the conversation (`status.state`, messages), the managed fields and
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
pub(super) fn is_final(session: &Session) -> bool {
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
