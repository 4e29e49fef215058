//! Health of the operator's links to the API server: watches that
//! re-establish themselves and report to /healthz, and a probe that lists
//! one Session every few seconds.

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource};
use std::time::Duration;
use tracing::warn;

use crate::api::Session;

/// How long the API server may hold a watch open before it ends it (the
/// client's idle timeout is this plus a margin).
const WATCH_TIMEOUT_SECS: u32 = 240;
/// The longest pause between two attempts of one watch.
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often the API probe lists one Session, and how long it waits.
const API_PROBE_PERIOD: Duration = Duration::from_secs(5);
const API_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
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
pub(super) fn tracked_watch<K>(
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

/// Readiness and a health signal independent of watch traffic: lists one
/// Session every few seconds through the operator's own client. Ready once
/// it first answers (reachable, and RBAC lets this replica read what it
/// watches); its failures count against the stall bound.
pub(super) async fn api_probe(probe: Api<Session>, health: crate::observe::Health, name: String) {
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
