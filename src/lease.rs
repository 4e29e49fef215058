//! Leader election on a `coordination.k8s.io/v1` Lease: of the operator's
//! replicas, one drives sessions and the others wait to take over.
//!
//! Built on kube-lease-manager (it creates the Lease, takes an expired one,
//! renews `grace` before expiry, clears the holder on release), plus a
//! watchdog this module adds: the library retries a failing renewal
//! forever and keeps reporting "leader" meanwhile, so a replica cut off from
//! the API server would go on acting after another one took over. The
//! watchdog reads the Lease back and steps down (the channel turns `false`)
//! once our last confirmed renewal is older than `duration - grace/2`,
//! before a standby may take the Lease at `duration`. Clock skew between
//! nodes must stay under `grace/2`.
//!
//! ```ignore
//! let election = LeaderElection::new(client, &pod_ns, "agents-operator", &pod_name,
//!     Duration::from_secs(15), Duration::from_secs(5)).await?;
//! election.elected().await;                  // standby until elected
//! run_controllers(/* stop on: */ election.lost()).await;
//! election.shutdown().await;                  // hand the Lease over at once
//! ```
//!
//! Takeover after a crash takes about `duration` plus up to a second (the
//! standby sleeps until the Lease expires, force-releases it, waits a random
//! 0.1–1 s, then takes it). After a graceful [`LeaderElection::shutdown`]
//! the Lease is free at once, but the standby notices only when it next
//! looks, at the old expiry at the latest.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// How often the watchdog looks again while a renewal it expects has not
/// shown up yet.
const RECHECK: Duration = Duration::from_millis(500);
/// The longest the watchdog waits for one read of the Lease.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long shutdown waits for the Lease to be released.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("leader election: {0}")]
    Settings(String),
    #[error(
        "leader election: cannot read or create Lease {namespace}/{name}: {source}. \
         The operator's service account needs get, create and patch on \
         leases.coordination.k8s.io in {namespace}"
    )]
    Setup {
        namespace: String,
        name: String,
        #[source]
        source: kube_lease_manager::LeaseManagerError,
    },
}

/// One contender for a Lease. `watch()` says whether it leads now; dropping
/// it (or [`LeaderElection::shutdown`]) releases the Lease if held.
#[derive(Debug)]
pub struct LeaderElection {
    identity: String,
    leading: watch::Receiver<bool>,
    fence: Arc<LeaseFence>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl LeaderElection {
    /// Joins the election for Lease `namespace/lease_name` as `identity`
    /// (unique per replica: the pod name). The Lease is created if missing.
    /// `duration`: how long a holder's Lease is valid after its last renewal
    /// (whole seconds); `grace`: how long before expiry the holder renews,
    /// also the tolerated clock skew (whole seconds, `0 < grace < duration`).
    pub async fn new(
        client: Client,
        namespace: &str,
        lease_name: &str,
        identity: &str,
        duration: Duration,
        grace: Duration,
    ) -> Result<LeaderElection, LeaseError> {
        check_settings(namespace, lease_name, identity, duration, grace)?;
        let manager = LeaseManagerBuilder::new(client.clone(), lease_name)
            .with_namespace(namespace)
            .with_identity(identity)
            .with_duration(duration.as_secs())
            .with_grace(grace.as_secs())
            .build()
            .await
            .map_err(|source| LeaseError::Setup {
                namespace: namespace.into(),
                name: lease_name.into(),
                source,
            })?;
        let (tx, leading) = watch::channel(false);
        let (stop, stopped) = oneshot::channel();
        let fence = Arc::new(LeaseFence {
            renewed: Mutex::new(None),
            valid_for: duration - grace,
        });
        let watchdog = Watchdog {
            fence: fence.clone(),
            api: Api::namespaced(client, namespace),
            lease_name: lease_name.into(),
            identity: identity.into(),
            duration,
            grace,
        };
        let task = tokio::spawn(async move {
            let (library, library_task) = manager.watch().await;
            watchdog.run(library, tx, stopped).await;
            // `library` was dropped by `run`: the library's task releases the
            // Lease if we hold it, then ends.
            match tokio::time::timeout(RELEASE_TIMEOUT, library_task).await {
                Ok(Ok(Ok(_))) => {}
                Ok(Ok(Err(e))) => {
                    tracing::warn!(error = %e, "leader election: releasing the Lease failed; it expires on its own")
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "leader election: the lease task failed"),
                Err(_) => tracing::warn!(
                    "leader election: releasing the Lease timed out; it expires on its own"
                ),
            }
        });
        Ok(LeaderElection {
            identity: identity.into(),
            leading,
            fence,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// `true` while this contender leads. It turns `false` when the Lease is
    /// lost (taken over, or not renewed in time); an operator should then
    /// stop acting at once (exiting is simplest) since another replica may
    /// take over after `grace/2`. It may turn `true` again later.
    pub fn watch(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    /// Resolves once this contender leads (at once if it does).
    pub async fn elected(&self) {
        let _ = self.watch().wait_for(|l| *l).await;
    }

    /// Resolves once this contender does not lead (at once if it does not):
    /// await it after [`LeaderElection::elected`] to learn of a loss.
    pub async fn lost(&self) {
        let _ = self.watch().wait_for(|l| !*l).await;
    }

    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The fence work is checked against: open while our last confirmed
    /// renewal is younger than `duration - grace`.
    pub fn fence(&self) -> Arc<LeaseFence> {
        self.fence.clone()
    }

    /// Stops contending and releases the Lease if held, so a standby can take
    /// it without waiting for it to expire. Returns once released (or after
    /// 5 s: the Lease then expires on its own).
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for LeaderElection {
    /// Releases in the background; use [`LeaderElection::shutdown`] to wait
    /// for it (a process that exits right after a drop may not release).
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn check_settings(
    namespace: &str,
    lease_name: &str,
    identity: &str,
    duration: Duration,
    grace: Duration,
) -> Result<(), LeaseError> {
    let bad = |m: String| Err(LeaseError::Settings(m));
    if namespace.is_empty() {
        return bad("the Lease namespace is empty (set POD_NAMESPACE)".into());
    }
    if lease_name.is_empty() || lease_name.len() > 253 {
        return bad(format!(
            "the Lease name {lease_name:?} must have 1 to 253 characters"
        ));
    }
    if identity.is_empty() {
        return bad("the identity is empty; use the pod name (POD_NAME)".into());
    }
    if duration.subsec_nanos() != 0 || grace.subsec_nanos() != 0 {
        return bad(format!(
            "lease duration ({duration:?}) and grace ({grace:?}) must be whole seconds"
        ));
    }
    if grace.is_zero() || grace >= duration {
        return bad(format!(
            "need 0 < grace < duration, got grace {}s and duration {}s",
            grace.as_secs(),
            duration.as_secs()
        ));
    }
    Ok(())
}

/// What the watchdog knows of the Lease while the library says we lead.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Confirmed {
    /// Not read back yet since the library reported leadership.
    No,
    /// We hold the Lease as renewed at this time (our own clock wrote it).
    RenewedAt(SystemTime),
}

/// Whether this replica may still start work, from the watchdog's last
/// confirmed renewal of the Lease (and the generation it holds it in).
/// Checked by the engine before every side effect, so a replica paused
/// past its Lease (SIGSTOP, a GC pause, a frozen node) starts nothing when
/// it wakes, even before its watchdog runs again.
#[derive(Debug)]
pub struct LeaseFence {
    /// (renewed at, leaseTransitions) while we hold it; `None` otherwise.
    renewed: Mutex<Option<(SystemTime, i64)>>,
    valid_for: Duration,
}

impl LeaseFence {
    /// A fence confirmed just now in generation `generation` (tests).
    pub fn confirmed_now(generation: i64, valid_for: Duration) -> Self {
        LeaseFence {
            renewed: Mutex::new(Some((SystemTime::now(), generation))),
            valid_for,
        }
    }

    /// The Lease generation (`leaseTransitions`) we hold it in, if we do.
    pub fn generation(&self) -> Option<i64> {
        self.renewed.lock().expect("fence").map(|(_, g)| g)
    }

    fn set(&self, value: Option<(SystemTime, i64)>) {
        *self.renewed.lock().expect("fence") = value;
    }

    fn check_at(&self, now: SystemTime) -> Result<(), String> {
        match *self.renewed.lock().expect("fence") {
            None => Err("this replica does not hold the leader Lease".into()),
            Some((at, _)) => match now.duration_since(at) {
                Ok(age) if age >= self.valid_for => Err(format!(
                    "the leader Lease was last renewed {:.1}s ago, past its {}s validity minus grace",
                    age.as_secs_f64(),
                    self.valid_for.as_secs()
                )),
                _ => Ok(()),
            },
        }
    }
}

impl crate::engine::holder::Fence for LeaseFence {
    fn check(&self) -> Result<(), String> {
        self.check_at(SystemTime::now())
    }
}

struct Watchdog {
    fence: Arc<LeaseFence>,
    api: Api<Lease>,
    lease_name: String,
    identity: String,
    duration: Duration,
    grace: Duration,
}

enum Reading {
    /// We hold it; renewed then, in this generation (`leaseTransitions`).
    Ours(SystemTime, i64),
    /// Someone else holds it, or nobody.
    NotOurs(Option<String>),
    /// Could not read it.
    Unknown(String),
}

impl Watchdog {
    async fn read(&self) -> Reading {
        match self.api.get(&self.lease_name).await {
            Err(e) => Reading::Unknown(e.to_string()),
            Ok(lease) => {
                let spec = lease.spec.unwrap_or_default();
                match (spec.holder_identity, spec.renew_time) {
                    (Some(h), Some(t)) if h == self.identity => Reading::Ours(
                        SystemTime::from(t.0),
                        spec.lease_transitions.unwrap_or(0).into(),
                    ),
                    (holder, _) => Reading::NotOurs(holder),
                }
            }
        }
    }

    /// Past this moment a renewal at `renewed` no longer makes us leader.
    fn deadline(&self, renewed: SystemTime) -> SystemTime {
        renewed + self.duration - self.grace / 2
    }

    /// Forwards the library's view to `tx`, vetoed by the watchdog, until
    /// `stopped` fires or the library's task ends.
    async fn run(
        self,
        mut library: watch::Receiver<bool>,
        tx: watch::Sender<bool>,
        mut stopped: oneshot::Receiver<()>,
    ) {
        let mut confirmed = Confirmed::No;
        // When to read the Lease back next (only while the library says we lead).
        let mut next_check = Instant::now();
        loop {
            let library_leads = *library.borrow_and_update();
            let leading = match (library_leads, confirmed) {
                (false, _) => false,
                (true, Confirmed::No) => false,
                (true, Confirmed::RenewedAt(at)) => SystemTime::now() < self.deadline(at),
            };
            self.announce(&tx, leading, library_leads);
            if !library_leads {
                confirmed = Confirmed::No;
            }
            if !leading {
                self.fence.set(None);
            }
            let check = async {
                if library_leads {
                    tokio::time::sleep_until(next_check.into()).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                _ = &mut stopped => break,
                _ = tx.closed() => break,
                changed = library.changed() => {
                    if changed.is_err() {
                        tracing::error!(identity = %self.identity, "leader election: the lease task ended; no longer contending");
                        break;
                    }
                    // Read the Lease back before claiming leadership.
                    next_check = Instant::now();
                }
                _ = check => {
                    next_check = self.check(&mut confirmed).await;
                }
            }
        }
        self.fence.set(None);
        tx.send_replace(false);
    }

    /// Publishes a change of leadership, saying why.
    fn announce(&self, tx: &watch::Sender<bool>, leading: bool, library_leads: bool) {
        if leading == *tx.borrow() {
            return;
        }
        if leading {
            tracing::info!(identity = %self.identity, lease = %self.lease_name, "leader election: leading");
        } else if library_leads {
            tracing::warn!(identity = %self.identity, lease = %self.lease_name,
                "leader election: the Lease was not renewed in time; stepping down");
        } else {
            tracing::warn!(identity = %self.identity, lease = %self.lease_name, "leader election: lost the Lease");
        }
        tx.send_replace(leading);
    }

    /// Reads the Lease back, updates what is confirmed and the fence, and
    /// says when to look next (at the deadline at the latest, to step down
    /// on time).
    async fn check(&self, confirmed: &mut Confirmed) -> Instant {
        let now = SystemTime::now();
        // A partition can make a read hang: never wait past the deadline.
        let budget = match *confirmed {
            Confirmed::RenewedAt(at) => self.deadline(at).duration_since(now).unwrap_or_default(),
            Confirmed::No => READ_TIMEOUT,
        }
        .clamp(Duration::from_millis(50), READ_TIMEOUT);
        let reading = match tokio::time::timeout(budget, self.read()).await {
            Ok(reading) => reading,
            Err(_) => Reading::Unknown(format!("no answer within {budget:?}")),
        };
        let mut next_check = match reading {
            Reading::Ours(renewed, generation) => {
                self.fence.set(Some((renewed, generation)));
                let fresh = match *confirmed {
                    Confirmed::RenewedAt(before) => renewed > before,
                    Confirmed::No => true,
                };
                *confirmed = Confirmed::RenewedAt(renewed);
                // The library renews `grace` before expiry: look just after
                // that, or again soon if it has not yet.
                let renew_due = renewed + self.duration - self.grace;
                let wait = if fresh {
                    renew_due.duration_since(now).unwrap_or_default() + RECHECK
                } else {
                    RECHECK
                };
                Instant::now() + wait.max(Duration::from_millis(100))
            }
            Reading::NotOurs(holder) => {
                tracing::warn!(identity = %self.identity, holder = ?holder,
                    "leader election: the Lease is not ours any more");
                *confirmed = Confirmed::RenewedAt(SystemTime::UNIX_EPOCH);
                self.fence.set(None);
                Instant::now() + RECHECK
            }
            Reading::Unknown(e) => {
                tracing::warn!(identity = %self.identity, error = %e,
                    "leader election: cannot read the Lease back");
                Instant::now() + RECHECK
            }
        };
        if let Confirmed::RenewedAt(at) = *confirmed {
            if let Ok(left) = self.deadline(at).duration_since(SystemTime::now()) {
                next_check = next_check.min(Instant::now() + left);
            }
        }
        next_check
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_closes_once_the_renewal_is_older_than_duration_minus_grace() {
        let fence = LeaseFence::confirmed_now(3, Duration::from_secs(10));
        let t0 = fence.renewed.lock().unwrap().unwrap().0;
        assert!(fence.check_at(t0 + Duration::from_secs(9)).is_ok());
        let err = fence.check_at(t0 + Duration::from_secs(11)).unwrap_err();
        assert!(err.contains("last renewed 11.0s ago"), "{err}");
        assert_eq!(fence.generation(), Some(3));
        fence.set(None);
        assert!(fence.check_at(t0).unwrap_err().contains("does not hold"));
    }

    #[test]
    fn settings_are_checked_with_clear_messages() {
        let s = Duration::from_secs;
        let err = |r: Result<(), LeaseError>| r.unwrap_err().to_string();
        assert!(check_settings("ns", "l", "me", s(15), s(5)).is_ok());
        assert!(err(check_settings("", "l", "me", s(15), s(5))).contains("POD_NAMESPACE"));
        assert!(err(check_settings("ns", "l", "", s(15), s(5))).contains("POD_NAME"));
        assert!(err(check_settings("ns", "", "me", s(15), s(5))).contains("1 to 253"));
        assert!(err(check_settings("ns", "l", "me", s(5), s(5))).contains("0 < grace < duration"));
        assert!(err(check_settings("ns", "l", "me", s(5), s(0))).contains("0 < grace < duration"));
        assert!(err(check_settings(
            "ns",
            "l",
            "me",
            Duration::from_millis(2500),
            s(1)
        ))
        .contains("whole seconds"));
    }
}
