//! Events leave the reconcile through a bounded queue. A step hands its
//! Events over and goes on; one task writes them at a paced rate.
//!
//! Events are for people and best effort, as in client-go's broadcaster:
//! under a burst of sessions they never slow a step, never take more than
//! `--event-qps` of the API server, and what does not fit in the queue is
//! dropped and counted (`agents_events_dropped_total`). Repeats of one
//! Event (same object, type, reason and action within six minutes) patch
//! the first one's series instead of making new objects; that memory is
//! bounded too (kube's own `Recorder` keeps every Event of the last six
//! minutes and scans them all on each publish).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tracing::debug;

/// Events waiting to be written; more are dropped (client-go's queue
/// holds 1000 too).
pub const QUEUE: usize = 1000;
/// Repeats are folded into a series within this time (as kube and
/// client-go do).
const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// Events remembered for folding repeats; the oldest go first.
const REMEMBERED: usize = 4096;

/// How fast Events are written: `qps` a second on average, `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventPace {
    pub qps: u32,
    pub burst: u32,
}

impl Default for EventPace {
    fn default() -> Self {
        EventPace {
            qps: 25,
            burst: 100,
        }
    }
}

struct Queued {
    event: Event,
    regarding: ObjectReference,
}

/// Where reconciles hand their Events. Cloning shares the queue.
#[derive(Clone)]
pub struct EventSink {
    tx: mpsc::Sender<Queued>,
    metrics: Arc<crate::observe::Metrics>,
}

impl EventSink {
    /// Starts the writer task; it ends when every sink is dropped.
    pub fn start(
        client: Client,
        controller: &str,
        instance: String,
        pace: EventPace,
        metrics: Arc<crate::observe::Metrics>,
    ) -> EventSink {
        let (tx, rx) = mpsc::channel(QUEUE);
        let writer = Writer {
            client,
            controller: controller.to_string(),
            instance,
            series: Series::default(),
            metrics: metrics.clone(),
        };
        tokio::spawn(writer.run(rx, pace));
        EventSink { tx, metrics }
    }

    /// Queues one Event about `regarding`; never waits. A full queue drops it.
    pub fn publish(&self, event: Event, regarding: ObjectReference) {
        match self.tx.try_send(Queued { event, regarding }) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(q)) => {
                self.metrics.event_dropped();
                debug!(reason = %q.event.reason, "event queue full; event dropped");
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

struct Writer {
    client: Client,
    controller: String,
    instance: String,
    series: Series,
    metrics: Arc<crate::observe::Metrics>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Queued>, pace: EventPace) {
        let mut bucket = Bucket::new(pace);
        while let Some(q) = rx.recv().await {
            if let Some(wait) = bucket.take(Instant::now()) {
                tokio::time::sleep(wait).await;
            }
            if let Err(e) = self.write(q).await {
                // Refused (the namespace going away, RBAC): no retry.
                self.metrics.event_dropped();
                debug!(error = %e, "event not written");
            }
        }
    }

    async fn write(&mut self, q: Queued) -> Result<(), kube::Error> {
        let ns = q.regarding.namespace.clone().unwrap_or("default".into());
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &ns);
        let key = SeriesKey::of(&q.event, &q.regarding);
        let now = Instant::now();
        if let Some((name, count)) = self.series.repeat(&key, now) {
            let body = serde_json::json!({"series": EventSeries {
                count,
                last_observed_time: MicroTime(Timestamp::now()),
            }});
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => return Ok(()),
                // Gone (its TTL, or deleted): write it anew below.
                Err(kube::Error::Api(s)) if s.code == 404 => self.series.forget(&key),
                Err(e) => return Err(e),
            }
        }
        let event = self.generate(&q.event, q.regarding);
        let created = api.create(&PostParams::default(), &event).await?;
        self.series
            .remember(key, created.metadata.name.unwrap_or_default(), now);
        Ok(())
    }

    fn generate(&self, ev: &Event, regarding: ObjectReference) -> K8sEvent {
        let now = Timestamp::now();
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or(&self.controller),
            now.as_nanosecond()
        );
        K8sEvent {
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            event_time: Some(MicroTime(now)),
            note: ev.note.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(name),
                ..Default::default()
            },
            regarding: Some(regarding),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(match ev.type_ {
                EventType::Normal => "Normal".into(),
                EventType::Warning => "Warning".into(),
            }),
            related: ev.secondary.clone(),
            ..Default::default()
        }
    }
}

/// A token bucket: `take` says how long to wait before the next write.
struct Bucket {
    per_token: Duration,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(pace: EventPace) -> Bucket {
        let qps = pace.qps.max(1) as f64;
        let burst = pace.burst.max(1) as f64;
        Bucket {
            per_token: Duration::from_secs_f64(1.0 / qps),
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    fn take(&mut self, now: Instant) -> Option<Duration> {
        let earned =
            now.saturating_duration_since(self.at).as_secs_f64() / self.per_token.as_secs_f64();
        self.tokens = (self.tokens + earned).min(self.burst);
        self.at = now;
        self.tokens -= 1.0;
        (self.tokens < 0.0).then(|| self.per_token.mul_f64(-self.tokens))
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct SeriesKey {
    uid: String,
    type_: &'static str,
    reason: String,
    action: String,
}

impl SeriesKey {
    fn of(ev: &Event, regarding: &ObjectReference) -> SeriesKey {
        SeriesKey {
            uid: regarding
                .uid
                .clone()
                .or_else(|| regarding.name.clone())
                .unwrap_or_default(),
            type_: match ev.type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            },
            reason: ev.reason.clone(),
            action: ev.action.clone(),
        }
    }
}

/// The Events written lately, to fold repeats: at most [`REMEMBERED`],
/// each for [`SERIES_WINDOW`] after it was written.
#[derive(Default)]
struct Series {
    by_key: HashMap<SeriesKey, (String, i32, Instant)>,
    order: VecDeque<(SeriesKey, Instant)>,
}

impl Series {
    /// The name of the Event this one repeats and the series' new count.
    fn repeat(&mut self, key: &SeriesKey, now: Instant) -> Option<(String, i32)> {
        self.expire(now);
        let (name, count, _) = self.by_key.get_mut(key)?;
        *count += 1;
        Some((name.clone(), *count))
    }

    fn remember(&mut self, key: SeriesKey, name: String, now: Instant) {
        self.expire(now);
        while self.by_key.len() >= REMEMBERED || self.order.len() >= 2 * REMEMBERED {
            let Some((old, at)) = self.order.pop_front() else {
                break;
            };
            self.drop_entry(&old, at);
        }
        self.order.push_back((key.clone(), now));
        self.by_key.insert(key, (name, 1, now));
    }

    fn forget(&mut self, key: &SeriesKey) {
        self.by_key.remove(key);
    }

    fn expire(&mut self, now: Instant) {
        while let Some((key, at)) = self.order.front() {
            if now.saturating_duration_since(*at) < SERIES_WINDOW {
                break;
            }
            let (key, at) = (key.clone(), *at);
            self.drop_entry(&key, at);
            self.order.pop_front();
        }
    }

    /// Drops `key` if it is the entry written at `at`: a key forgotten and
    /// written again has a newer one.
    fn drop_entry(&mut self, key: &SeriesKey, at: Instant) {
        if self.by_key.get(key).is_some_and(|(_, _, t)| *t == at) {
            self.by_key.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: usize) -> SeriesKey {
        SeriesKey {
            uid: format!("uid-{n}"),
            type_: "Normal",
            reason: "R".into(),
            action: "A".into(),
        }
    }

    #[test]
    fn the_bucket_lets_a_burst_through_then_paces() {
        let mut b = Bucket::new(EventPace { qps: 10, burst: 3 });
        let t = b.at;
        assert_eq!(b.take(t), None);
        assert_eq!(b.take(t), None);
        assert_eq!(b.take(t), None);
        let wait = b.take(t).expect("the fourth waits");
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
        // Later the bucket is full again, never fuller.
        let later = t + Duration::from_secs(5);
        for _ in 0..3 {
            assert_eq!(b.take(later), None);
        }
        assert!(b.take(later).is_some());
    }

    #[test]
    fn a_repeat_within_the_window_is_a_series_and_an_old_one_is_new() {
        let mut s = Series::default();
        let t = Instant::now();
        s.remember(key(1), "ev-1".into(), t);
        assert_eq!(s.repeat(&key(1), t), Some(("ev-1".into(), 2)));
        assert_eq!(s.repeat(&key(1), t), Some(("ev-1".into(), 3)));
        assert_eq!(s.repeat(&key(2), t), None);
        assert_eq!(s.repeat(&key(1), t + SERIES_WINDOW), None);
    }

    #[test]
    fn what_is_remembered_is_bounded_oldest_first() {
        let mut s = Series::default();
        let t = Instant::now();
        for n in 0..REMEMBERED + 10 {
            s.remember(key(n), format!("ev-{n}"), t);
        }
        assert_eq!(s.by_key.len(), REMEMBERED);
        assert!(s.order.len() <= REMEMBERED + 10);
        assert_eq!(s.repeat(&key(0), t), None);
        assert!(s.repeat(&key(REMEMBERED + 9), t).is_some());
    }
}
