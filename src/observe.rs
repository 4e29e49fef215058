//! What the operator tells the outside about itself: Prometheus metrics
//! (OpenMetrics text on `/metrics`), liveness (`/healthz`) and readiness
//! (`/readyz`), served over plain HTTP/1 by hyper.
//!
//! ```ignore
//! let metrics = Arc::new(Metrics::new());
//! let health = Health::new();
//! let server = MetricsServer::bind("0.0.0.0:8080".parse()?).await?;   // fails now if the port is taken
//! tokio::spawn(server.run(metrics.clone(), health.clone()));
//! let _alive = health.register_loop("session-controller");  // /healthz fails once this is dropped
//! store.wait_until_ready().await?; health.set_ready(true);  // /readyz: caches synced
//! metrics.reconciled(true);
//! ```
//!
//! Exported names (prefix `agents`; prometheus-client appends `_total` to
//! counters and the unit to the histogram):
//!
//! | name | type | labels |
//! |---|---|---|
//! | `agents_reconciles_total` | counter | `result` = `ok` \| `error` |
//! | `agents_reconcile_errors_total` | counter | `kind` |
//! | `agents_tool_calls_total` | counter | `disposition`, `outcome` = `completed` \| `failed` \| `deferred` |
//! | `agents_model_calls_total` | counter | `outcome` = `ok` \| `error` |
//! | `agents_wake_latency_seconds` | histogram | (result written → session stepped) |
//! | `agents_reconcile_duration_seconds` | histogram | (one Session reconcile, start to end) |
//! | `agents_sessions` | gauge | `phase` |
//! | `agents_leader` | gauge | 1 while this replica holds the Lease |
//! | `agents_events_dropped_total` | counter | (Events not written) |
//! | `agents_namespace_at_cap_total` | counter | (reconciles put off: their namespace held all its slots) |
//! | `agents_api_requests_total` | counter | `verb`, `resource` (every request to the API server, each attempt) |
//! | `agents_wake_requests_before_write` | histogram | (API requests of a step that took in an outside result, before its first write) |

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

/// The `Content-Type` of `/metrics` (prometheus-client writes OpenMetrics 1.0).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Tool call outcomes, the values of the `outcome` label of `tool_calls`.
pub const TOOL_COMPLETED: &str = "completed";
pub const TOOL_FAILED: &str = "failed";
pub const TOOL_DEFERRED: &str = "deferred";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabels {
    disposition: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// Most distinct (namespace, agent, model) sets of the spend counters;
/// the next ones count under agent and model `other`.
pub const SPEND_LABEL_SETS: usize = 200;

/// Who spent: the session's namespace, its agent and the model.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SpendLabels {
    namespace: String,
    agent: String,
    model: String,
}

/// An API request as the API server names it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiRequestLabels {
    verb: String,
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

/// The operator's metrics. Cheap to update from any task (atomics behind
/// the families); share it as `Arc<Metrics>`.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ResultLabel, Counter>,
    reconcile_errors: Family<KindLabel, Counter>,
    tool_calls: Family<ToolLabels, Counter>,
    model_calls: Family<OutcomeLabel, Counter>,
    tokens: Family<SpendLabels, Counter>,
    cost_micros: Family<SpendLabels, Counter>,
    wake_latency: Histogram,
    reconcile_duration: Histogram,
    sessions: Family<PhaseLabel, Gauge>,
    leader: Gauge<i64, AtomicI64>,
    events_dropped: Counter,
    namespace_at_cap: Counter,
    /// The (namespace, agent, model) sets the spend counters have, bounded
    /// by [`SPEND_LABEL_SETS`]: tenants choose agent and model names.
    spend_label_sets: std::sync::Mutex<std::collections::HashSet<SpendLabels>>,
    api_requests: Family<ApiRequestLabels, Counter>,
    wake_requests: Histogram,
}

/// A counter registered under `name`.
fn counter(registry: &mut Registry, name: &str, help: &str) -> Counter {
    let counter = Counter::default();
    registry.register(name, help, counter.clone());
    counter
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("agents");
        let reconciles = Family::<ResultLabel, Counter>::default();
        registry.register(
            "reconciles",
            "Reconciliations of Sessions, by result (ok or error)",
            reconciles.clone(),
        );
        let reconcile_errors = Family::<KindLabel, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Failed reconciliations, by kind of error",
            reconcile_errors.clone(),
        );
        let tool_calls = Family::<ToolLabels, Counter>::default();
        registry.register(
            "tool_calls",
            "Tool calls, by policy disposition and outcome (completed, failed, deferred)",
            tool_calls.clone(),
        );
        let model_calls = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "model_calls",
            "Model requests, by outcome (ok or error)",
            model_calls.clone(),
        );
        let tokens = Family::<SpendLabels, Counter>::default();
        registry.register(
            "model_tokens",
            "Prompt and completion tokens the model reported, by namespace, agent and model",
            tokens.clone(),
        );
        let cost_micros = Family::<SpendLabels, Counter>::default();
        registry.register(
            "model_cost_micros",
            "What the model turns cost under their agent's spec.model.pricing, in millionths of its currency, by namespace, agent and model",
            cost_micros.clone(),
        );
        // 5 ms .. about 41 s: a watch-driven wake is milliseconds, a wake
        // that waited for a requeue or a busy operator is seconds.
        let wake_latency = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        registry.register_with_unit(
            "wake_latency",
            "Time from a call's result being written to the next step of its session",
            Unit::Seconds,
            wake_latency.clone(),
        );
        // 1 ms .. about 16 s: a step that writes nothing is milliseconds, one
        // that waits on a model or a runSync tool takes what they take.
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register_with_unit(
            "reconcile_duration",
            "Time one Session reconcile took, model and runSync tool calls included",
            Unit::Seconds,
            reconcile_duration.clone(),
        );
        let sessions = Family::<PhaseLabel, Gauge>::default();
        registry.register(
            "sessions",
            "Sessions this operator sees, by phase",
            sessions.clone(),
        );
        let leader = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease, else 0",
            leader.clone(),
        );
        let events_dropped = counter(
            &mut registry,
            "events_dropped",
            "Kubernetes Events not written: the queue was full (a burst) or the API server refused them",
        );
        let namespace_at_cap = counter(
            &mut registry,
            "namespace_at_cap",
            "Reconciles put off because their namespace held all the reconciles it may hold at once",
        );
        let api_requests = Family::<ApiRequestLabels, Counter>::default();
        registry.register(
            "api_requests",
            "Requests to the API server, by verb and resource as the API server names them (each attempt of a retried one)",
            api_requests.clone(),
        );
        // Whole requests: a wake should need at most one before it writes.
        let wake_requests = Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0]);
        registry.register(
            "wake_requests_before_write",
            "API requests a reconcile that took in an outside result (a person's, a worker's, a Job's) sent before its first write",
            wake_requests.clone(),
        );
        Metrics {
            registry,
            api_requests,
            wake_requests,
            reconciles,
            reconcile_errors,
            tool_calls,
            model_calls,
            tokens,
            cost_micros,
            wake_latency,
            reconcile_duration,
            sessions,
            leader,
            events_dropped,
            namespace_at_cap,
            spend_label_sets: Default::default(),
        }
    }

    /// One reconciliation finished, successfully or not.
    pub fn reconciled(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.reconciles.get_or_create(&ResultLabel { result }).inc();
    }

    /// One reconciliation failed with an error of this kind (a short,
    /// bounded name such as `conflict`, `api`, `invalid-agent`; never a
    /// message, which would make a new series per error).
    pub fn reconcile_error(&self, kind: &str) {
        self.reconcile_errors
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }

    /// A tool call reached an outcome: `disposition` as in the policy
    /// (`runSync`, `runAsync`, `runIsolated`, `defer`), `outcome` one of
    /// [`TOOL_COMPLETED`], [`TOOL_FAILED`], [`TOOL_DEFERRED`].
    pub fn tool_call(&self, disposition: &str, outcome: &str) {
        self.tool_calls
            .get_or_create(&ToolLabels {
                disposition: disposition.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// A model request finished.
    pub fn model_call(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.model_calls
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// What one model turn of a session in `namespace` spent.
    pub fn spent(
        &self,
        namespace: &str,
        agent: &str,
        model: &str,
        usage: &crate::core::TokenUsage,
    ) {
        let labels = self.bounded_spend_labels(SpendLabels {
            namespace: namespace.into(),
            agent: agent.into(),
            model: model.into(),
        });
        self.tokens.get_or_create(&labels).inc_by(usage.total());
        self.cost_micros
            .get_or_create(&labels)
            .inc_by(usage.cost_micros);
    }

    /// `labels`, or past [`SPEND_LABEL_SETS`] distinct sets, the same
    /// namespace with agent and model `other`: the series stay bounded
    /// whatever names tenants choose.
    fn bounded_spend_labels(&self, labels: SpendLabels) -> SpendLabels {
        let mut seen = self.spend_label_sets.lock().expect("label sets");
        if seen.contains(&labels) {
            return labels;
        }
        if seen.len() < SPEND_LABEL_SETS {
            seen.insert(labels.clone());
            return labels;
        }
        SpendLabels {
            agent: "other".into(),
            model: "other".into(),
            ..labels
        }
    }

    /// Time from a call's result being written to its session's next step.
    pub fn wake_latency(&self, latency: Duration) {
        self.wake_latency.observe(latency.as_secs_f64());
    }

    /// Time one Session reconcile took.
    pub fn reconcile_duration(&self, took: Duration) {
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    /// How many sessions are in `phase` now (set from the controller's
    /// cache; phases not set again keep their last value, so set every
    /// known phase, zeros included).
    pub fn set_sessions(&self, phase: &str, count: i64) {
        self.sessions
            .get_or_create(&PhaseLabel {
                phase: phase.into(),
            })
            .set(count);
    }

    /// A reconcile was put off: its namespace held all its slots.
    pub fn namespace_at_cap(&self) {
        self.namespace_at_cap.inc();
    }

    /// One request was sent to the API server.
    pub fn api_request(&self, verb: &str, resource: &str) {
        self.api_requests
            .get_or_create(&ApiRequestLabels {
                verb: verb.into(),
                resource: resource.into(),
            })
            .inc();
    }

    /// A reconcile took in an outside result after sending `requests`
    /// requests, before its first write.
    pub fn wake_requests_before_write(&self, requests: usize) {
        self.wake_requests.observe(requests as f64);
    }

    /// One Kubernetes Event was not written.
    pub fn event_dropped(&self) {
        self.events_dropped.inc();
    }

    /// Whether this replica leads now.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// The OpenMetrics text of every metric (what `/metrics` serves).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("encode metrics into a String");
        out
    }
}

/// Liveness and readiness, set by the operator's loops and read by the
/// probes. Clones share state.
#[derive(Clone, Default)]
pub struct Health {
    inner: Arc<HealthInner>,
}

#[derive(Default)]
struct HealthInner {
    ready: AtomicBool,
    /// Every registered loop by name: true while it runs.
    loops: Mutex<BTreeMap<String, bool>>,
    /// Every link to the API server (a watch, the API probe) by name: since
    /// when it has failed without a success in between, with its last error.
    links: Mutex<BTreeMap<String, Option<(Instant, String)>>>,
    /// How long a link may fail before the probes fail (none: never).
    stall_bound: Mutex<Option<Duration>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("ready", &self.is_ready())
            .field("live", &self.liveness())
            .finish()
    }
}

/// Marks a loop alive until dropped: hold it inside the loop's task, so a
/// loop that returns, panics or is aborted makes `/healthz` fail and the
/// kubelet restart the pod.
#[must_use = "the loop counts as stopped as soon as its guard is dropped"]
#[derive(Debug)]
pub struct LoopGuard {
    health: Health,
    name: String,
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        if let Ok(mut loops) = self.health.inner.loops.lock() {
            loops.insert(self.name.clone(), false);
        }
    }
}

impl Health {
    pub fn new() -> Self {
        Self::default()
    }

    /// Readiness: set once the controllers' caches have synced. Not tied to
    /// leadership: a standby is Ready too, or a rolling update that waits
    /// for the new pod to be Ready before stopping the leader never ends.
    /// A standby that starts no controllers (so syncs no cache) sets it
    /// once started; one that keeps warm caches sets it once they synced.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
    }

    /// Registers a loop (a controller, the lease task, ...) as alive until
    /// the returned guard is dropped. Registering a name again revives it.
    pub fn register_loop(&self, name: &str) -> LoopGuard {
        self.inner
            .loops
            .lock()
            .expect("health lock")
            .insert(name.to_string(), true);
        LoopGuard {
            health: self.clone(),
            name: name.to_string(),
        }
    }

    /// Links (watches, the API probe) failing for longer than `bound` make
    /// `/healthz` and `/readyz` fail, so the kubelet restarts a stuck process.
    pub fn set_stall_bound(&self, bound: Duration) {
        *self.inner.stall_bound.lock().expect("health lock") = Some(bound);
    }

    /// A link to the API server worked (an event, a list, an answer).
    pub fn link_ok(&self, name: &str) {
        let mut links = self.inner.links.lock().expect("health lock");
        match links.get_mut(name) {
            Some(state) if state.is_none() => {}
            Some(state) => {
                tracing::info!(link = name, "the API server answers again");
                *state = None;
            }
            None => {
                links.insert(name.to_string(), None);
            }
        }
    }

    /// A link to the API server failed; it counts as failing from the first
    /// failure after its last success.
    pub fn link_failed(&self, name: &str, error: &str) {
        let mut links = self.inner.links.lock().expect("health lock");
        let state = links.entry(name.to_string()).or_insert(None);
        match state {
            Some((_, last)) => *last = error.to_string(),
            None => *state = Some((Instant::now(), error.to_string())),
        }
    }

    /// The links failing for longer than the stall bound, with their error.
    fn stalled(&self) -> Vec<String> {
        let Some(bound) = *self.inner.stall_bound.lock().expect("health lock") else {
            return Vec::new();
        };
        let links = self.inner.links.lock().expect("health lock");
        links
            .iter()
            .filter_map(|(name, state)| {
                let (since, error) = state.as_ref()?;
                let failing = since.elapsed();
                (failing > bound).then(|| {
                    format!(
                        "{name} failing for {}s (bound {}s): {error}",
                        failing.as_secs(),
                        bound.as_secs()
                    )
                })
            })
            .collect()
    }

    /// `Ok` while every registered loop runs and no link to the API server
    /// has failed for longer than the stall bound; else what is wrong.
    pub fn liveness(&self) -> Result<(), Vec<String>> {
        let loops = self.inner.loops.lock().expect("health lock");
        let mut wrong: Vec<String> = loops
            .iter()
            .filter(|(_, alive)| !**alive)
            .map(|(name, _)| format!("stopped: {name}"))
            .collect();
        drop(loops);
        wrong.extend(self.stalled());
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong)
        }
    }

    /// `Ok` when ready and no link has stalled; else why not.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.is_ready() {
            return Err("the controller caches have not synced yet".into());
        }
        let stalled = self.stalled();
        if stalled.is_empty() {
            Ok(())
        } else {
            Err(stalled.join("; "))
        }
    }
}

/// The metrics and probe endpoint, bound but not yet serving: bind first
/// so a taken port fails at startup, then spawn [`MetricsServer::run`].
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
}

impl MetricsServer {
    pub async fn bind(addr: SocketAddr) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot listen for /metrics on {addr}: {e} (choose another --metrics-addr)"
                ),
            )
        })?;
        Ok(MetricsServer { listener })
    }

    /// The bound address (the real port when bound to port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` until the future is
    /// dropped. Accept errors (out of file descriptors, ...) are logged and
    /// retried, so this returns only if the listener breaks for good.
    pub async fn run(self, metrics: Arc<Metrics>, health: Health) -> io::Result<()> {
        loop {
            let (stream, _peer) = match self.listener.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics server: accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            let health = health.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let response = route(&req, &metrics, &health);
                    async move { Ok::<_, Infallible>(response) }
                });
                // A client that never finishes its headers does not hold a
                // task forever.
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "metrics server: connection ended with an error");
                }
            });
        }
    }
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` on it until
/// dropped. Use [`MetricsServer::bind`] to learn a bind error before
/// spawning, or the port when binding port 0.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>, health: Health) -> io::Result<()> {
    MetricsServer::bind(addr).await?.run(metrics, health).await
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn route(req: &Request<Incoming>, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut response = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are served here\n",
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match req.uri().path() {
        "/metrics" => {
            let mut response = text(StatusCode::OK, metrics.encode());
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE),
            );
            response
        }
        "/healthz" => match health.liveness() {
            Ok(()) => text(StatusCode::OK, "ok\n"),
            Err(wrong) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("unhealthy: {}\n", wrong.join("; ")),
            ),
        },
        "/readyz" => match health.readiness() {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        other => text(
            StatusCode::NOT_FOUND,
            format!("no such path {other}; try /metrics, /healthz or /readyz\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spend_label_sets_are_capped_and_the_rest_fold_into_other() {
        let metrics = Metrics::new();
        let usage = crate::core::TokenUsage {
            prompt_tokens: 10,
            ..Default::default()
        };
        for i in 0..SPEND_LABEL_SETS + 50 {
            metrics.spent("ns", &format!("agent-{i}"), "m", &usage);
        }
        // A set seen before the cap keeps its own series.
        metrics.spent("ns", "agent-0", "m", &usage);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).unwrap();
        let series = text
            .lines()
            .filter(|l| l.starts_with("agents_model_tokens_total{"))
            .count();
        assert_eq!(series, SPEND_LABEL_SETS + 1, "200 own sets and `other`");
        assert!(
            text.contains(
                r#"agents_model_tokens_total{namespace="ns",agent="other",model="other"} 500"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"agent="agent-0",model="m"} 20"#));
    }

    async fn start() -> (SocketAddr, Arc<Metrics>, Health) {
        let metrics = Arc::new(Metrics::new());
        let health = Health::new();
        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.local_addr().unwrap();
        tokio::spawn(server.run(metrics.clone(), health.clone()));
        (addr, metrics, health)
    }

    /// (status, content type, body) of one request.
    async fn request(
        addr: SocketAddr,
        method: reqwest::Method,
        path: &str,
    ) -> (u16, String, String) {
        let response = reqwest::Client::new()
            .request(method, format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, content_type, response.text().await.unwrap())
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
        request(addr, reqwest::Method::GET, path).await
    }

    #[tokio::test]
    async fn metrics_are_served_as_openmetrics_with_every_series_recorded() {
        let (addr, metrics, _health) = start().await;
        metrics.reconciled(true);
        metrics.reconciled(true);
        metrics.reconciled(false);
        metrics.reconcile_error("conflict");
        metrics.tool_call("runSync", TOOL_COMPLETED);
        metrics.tool_call("defer", TOOL_DEFERRED);
        metrics.tool_call("defer", TOOL_DEFERRED);
        metrics.tool_call("runIsolated", TOOL_FAILED);
        metrics.model_call(true);
        metrics.model_call(false);
        metrics.wake_latency(Duration::from_millis(30));
        metrics.wake_latency(Duration::from_secs(2));
        metrics.set_sessions("Running", 3);
        metrics.set_leader(true);

        let (status, content_type, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert_eq!(content_type, OPENMETRICS_CONTENT_TYPE);
        for line in [
            "# TYPE agents_reconciles counter",
            r#"agents_reconciles_total{result="ok"} 2"#,
            r#"agents_reconciles_total{result="error"} 1"#,
            r#"agents_reconcile_errors_total{kind="conflict"} 1"#,
            r#"agents_tool_calls_total{disposition="runSync",outcome="completed"} 1"#,
            r#"agents_tool_calls_total{disposition="defer",outcome="deferred"} 2"#,
            r#"agents_tool_calls_total{disposition="runIsolated",outcome="failed"} 1"#,
            r#"agents_model_calls_total{outcome="ok"} 1"#,
            r#"agents_model_calls_total{outcome="error"} 1"#,
            "# TYPE agents_wake_latency_seconds histogram",
            "# UNIT agents_wake_latency_seconds seconds",
            "agents_wake_latency_seconds_count 2",
            // 30 ms lands in the 0.04 bucket and above, 2 s from 2.56 on.
            r#"agents_wake_latency_seconds_bucket{le="0.02"} 0"#,
            r#"agents_wake_latency_seconds_bucket{le="0.04"} 1"#,
            r#"agents_wake_latency_seconds_bucket{le="2.56"} 2"#,
            r#"agents_wake_latency_seconds_bucket{le="+Inf"} 2"#,
            r#"agents_sessions{phase="Running"} 3"#,
            "agents_leader 1",
            "# EOF",
        ] {
            assert!(
                body.lines().any(|l| l == line),
                "missing line {line:?} in:\n{body}"
            );
        }
        let sum: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix("agents_wake_latency_seconds_sum "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - 2.03).abs() < 1e-9, "{sum}");
        // No counter name may end in _total before the suffix is appended.
        assert!(!body.contains("_total_total"), "{body}");
    }

    #[tokio::test]
    async fn healthz_fails_once_a_registered_loop_stops() {
        let (addr, _metrics, health) = start().await;
        assert_eq!(get(addr, "/healthz").await.0, 200, "no loop yet: alive");
        let controller = health.register_loop("session-controller");
        let lease = health.register_loop("leader-election");
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!((status, body.as_str()), (200, "ok\n"));

        // A loop whose task panics drops its guard while unwinding.
        let task = tokio::spawn(async move {
            let _lease = lease;
            panic!("lease loop died");
        });
        assert!(task.await.is_err());
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert_eq!(body, "unhealthy: stopped: leader-election\n");

        drop(controller);
        let (_, _, body) = get(addr, "/healthz").await;
        assert_eq!(
            body,
            "unhealthy: stopped: leader-election; stopped: session-controller\n"
        );

        let _again = health.register_loop("leader-election");
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!(
            (status, body.as_str()),
            (503, "unhealthy: stopped: session-controller\n")
        );
    }

    #[tokio::test]
    async fn probes_fail_while_a_link_fails_past_the_bound_and_pass_once_it_recovers() {
        let (addr, _metrics, health) = start().await;
        health.set_ready(true);
        health.set_stall_bound(Duration::from_millis(200));
        health.link_ok("watch sessions");
        health.link_failed("watch sessions", "client error (Connect)");
        // Within the bound: a blip is no reason to restart.
        assert_eq!(get(addr, "/healthz").await.0, 200);
        assert_eq!(get(addr, "/readyz").await.0, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
        health.link_failed("watch sessions", "client error (SendRequest)");
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert!(
            body.contains("watch sessions failing for") && body.contains("(SendRequest)"),
            "{body}"
        );
        let (status, _, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert!(body.contains("watch sessions failing"), "{body}");
        health.link_ok("watch sessions");
        assert_eq!(get(addr, "/healthz").await.0, 200);
        assert_eq!(get(addr, "/readyz").await.0, 200);
        // The failure clock starts again at the next failure.
        health.link_failed("watch sessions", "again");
        assert_eq!(get(addr, "/healthz").await.0, 200);
    }

    #[tokio::test]
    async fn readyz_follows_the_ready_flag_only() {
        let (addr, metrics, health) = start().await;
        let (status, _, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert!(body.contains("caches have not synced"), "{body}");

        health.set_ready(true);
        // Readiness is not tied to leadership: a standby is ready too.
        metrics.set_leader(false);
        let (status, _, body) = get(addr, "/readyz").await;
        assert_eq!((status, body.as_str()), (200, "ready\n"));

        health.set_ready(false);
        assert_eq!(get(addr, "/readyz").await.0, 503);
    }

    #[tokio::test]
    async fn other_paths_and_methods_are_refused_clearly() {
        let (addr, _metrics, _health) = start().await;
        let (status, _, body) = get(addr, "/nope").await;
        assert_eq!(status, 404);
        assert!(body.contains("/metrics, /healthz or /readyz"), "{body}");

        let (status, _, body) = request(addr, reqwest::Method::POST, "/metrics").await;
        assert_eq!(status, 405);
        assert!(body.contains("only GET and HEAD"), "{body}");

        let (status, _, body) = request(addr, reqwest::Method::HEAD, "/healthz").await;
        assert_eq!((status, body.as_str()), (200, ""));
    }

    #[tokio::test]
    async fn a_raw_http1_request_gets_a_complete_response() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (addr, _metrics, health) = start().await;
        health.set_ready(true);
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        assert!(reply.ends_with("\r\n\r\nready\n"), "{reply}");
    }

    #[tokio::test]
    async fn binding_a_taken_port_names_the_address() {
        let first = MetricsServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = first.local_addr().unwrap();
        let err = MetricsServer::bind(addr).await.unwrap_err();
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        assert!(err.to_string().contains("--metrics-addr"), "{err}");
        let err = serve(addr, Arc::new(Metrics::new()), Health::new())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
    }
}
