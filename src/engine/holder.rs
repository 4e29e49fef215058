//! Who holds a claim, whether that holder is known to be dead, and whether
//! this driver may still start work (its fence).
//!
//! Holder names carry what a later driver needs to judge them:
//! - `cli/<host>/<pid>/<start-time>`: a CLI process. On the same host, a
//!   holder whose process is gone (or whose pid was reused, seen by the
//!   start time) is dead; its claims are void at once.
//! - `operator/<identity>/<instance>[/g<generation>]`: an operator replica.
//!   The identity says what makes it distinct from every other live
//!   process ([`OperatorIdentity`]); the generation is the Lease's
//!   `leaseTransitions` when it won leader election. An earlier instance of
//!   my own identity is dead only when that is provable (same host and a
//!   gone pid; the same pod name, which a live pod holds only once). A
//!   leader voids the claims of every earlier generation (they stopped
//!   leading before it got the Lease) and never those of a later one.

use std::collections::BTreeSet;
use std::sync::Arc;

/// Tells whether this driver may still start side effects. The operator's
/// leader election is one; a driver without one is always allowed.
pub trait Fence: Send + Sync + std::fmt::Debug {
    /// `Ok` while this driver may start work; `Err(why)` once it may not
    /// (for example, its Lease was not renewed in time).
    fn check(&self) -> Result<(), String>;
}

/// What makes an operator process distinct from every other live one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OperatorIdentity {
    /// In a pod (`POD_NAMESPACE`, `POD_NAME`, `POD_UID` from the downward
    /// API). One operator runs per pod, and a pod name is held by one live
    /// pod at a time: a name now held by another pod UID, or a restart in
    /// the same pod, means the earlier process is gone.
    Pod {
        namespace: String,
        name: String,
        uid: String,
    },
    /// A plain process: host, pid and the process's start time.
    Process {
        host: String,
        pid: u32,
        start: String,
    },
}

impl OperatorIdentity {
    /// This process's identity: the pod's when `POD_NAME` is set, else the
    /// host, pid and start time.
    pub fn current() -> Self {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        match env("POD_NAME") {
            Some(name) => OperatorIdentity::Pod {
                namespace: env("POD_NAMESPACE").unwrap_or_default(),
                name,
                uid: env("POD_UID").unwrap_or_default(),
            },
            None => {
                let pid = std::process::id();
                OperatorIdentity::Process {
                    host: hostname(),
                    pid,
                    start: process_start(pid).unwrap_or_default(),
                }
            }
        }
    }

    /// The identity as written into holder names (no `/`).
    pub fn render(&self) -> String {
        let clean = |s: &str| s.replace(['/', ':'], "_");
        match self {
            OperatorIdentity::Pod {
                namespace,
                name,
                uid,
            } => format!("pod:{}:{}:{}", clean(namespace), clean(name), clean(uid)),
            OperatorIdentity::Process { host, pid, start } => {
                format!("proc:{}:{pid}:{}", clean(host), clean(start))
            }
        }
    }

    fn parse(s: &str) -> Option<Self> {
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["pod", ns, name, uid] => Some(OperatorIdentity::Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
                uid: uid.to_string(),
            }),
            ["proc", host, pid, start] => Some(OperatorIdentity::Process {
                host: host.to_string(),
                pid: pid.parse().ok()?,
                start: start.to_string(),
            }),
            _ => None,
        }
    }

    /// True when a process of identity `earlier` is provably gone, judged
    /// by this live process.
    fn outlived(&self, earlier: &OperatorIdentity) -> bool {
        match (self, earlier) {
            (
                OperatorIdentity::Pod {
                    namespace, name, ..
                },
                OperatorIdentity::Pod {
                    namespace: their_ns,
                    name: their_name,
                    ..
                },
            ) => namespace == their_ns && name == their_name,
            (
                OperatorIdentity::Process { host, .. },
                OperatorIdentity::Process {
                    host: their_host,
                    pid,
                    start,
                },
            ) if host == their_host => process_start(*pid).as_deref() != Some(start.as_str()),
            _ => false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Holder {
    name: String,
    /// The operator's identity (none for a CLI).
    identity: Option<OperatorIdentity>,
    /// The Lease generation this operator leads in, if elected.
    generation: Option<i64>,
    fence: Option<Arc<dyn Fence>>,
}

impl PartialEq for Holder {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl Eq for Holder {}

impl Holder {
    /// This CLI process.
    pub fn cli() -> Self {
        let pid = std::process::id();
        Holder::named(&format!(
            "cli/{}/{pid}/{}",
            hostname(),
            process_start(pid).unwrap_or_default()
        ))
    }

    /// An operator replica without leader election.
    pub fn operator(identity: &OperatorIdentity) -> Self {
        Holder {
            name: format!(
                "operator/{}/{}",
                identity.render(),
                uuid::Uuid::new_v4().simple()
            ),
            identity: Some(identity.clone()),
            generation: None,
            fence: None,
        }
    }

    /// An operator replica that leads in Lease generation `generation`
    /// (its `leaseTransitions`); `fence` says whether it still leads.
    pub fn elected_operator(
        identity: &OperatorIdentity,
        generation: i64,
        fence: Arc<dyn Fence>,
    ) -> Self {
        let base = Holder::operator(identity);
        Holder {
            name: format!("{}/g{generation}", base.name),
            generation: Some(generation),
            fence: Some(fence),
            ..base
        }
    }

    /// A named holder (tests, the CLI).
    pub fn named(name: &str) -> Self {
        Holder {
            name: name.to_string(),
            identity: None,
            generation: None,
            fence: None,
        }
    }

    /// The same holder, allowed to start work only while `fence` allows.
    pub fn with_fence(self, fence: Arc<dyn Fence>) -> Self {
        Holder {
            fence: Some(fence),
            ..self
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `Ok` while this holder may start side effects.
    pub fn may_act(&self) -> Result<(), String> {
        match &self.fence {
            Some(f) => f.check(),
            None => Ok(()),
        }
    }

    /// True when `other` (a holder name found on a claim) is known dead.
    pub fn knows_dead(&self, other: &str) -> bool {
        if other == self.name {
            return false;
        }
        let theirs: Vec<&str> = other.split('/').collect();
        match theirs.as_slice() {
            ["operator", identity, _instance, rest @ ..] => {
                let their_generation = match rest {
                    [] => None,
                    [g] => g.strip_prefix('g').and_then(|g| g.parse::<i64>().ok()),
                    _ => return false,
                };
                self.outlives_operator(identity, their_generation)
            }
            ["cli", their_host, pid, start] => {
                *their_host == hostname()
                    && match pid.parse::<u32>() {
                        Ok(pid) => process_start(pid).as_deref() != Some(*start),
                        Err(_) => false,
                    }
            }
            _ => false,
        }
    }

    fn outlives_operator(&self, their_identity: &str, their_generation: Option<i64>) -> bool {
        if let Some(mine) = self.generation {
            // Every replica of an earlier generation stopped leading before
            // this one got the Lease (fenced: it starts nothing after).
            match their_generation {
                Some(theirs) if theirs >= mine => return false,
                _ => return true,
            }
        }
        match (&self.identity, OperatorIdentity::parse(their_identity)) {
            (Some(me), Some(them)) => me.outlived(&them),
            _ => false,
        }
    }

    /// The dead holders among `holders`.
    pub fn dead_among<'a>(&self, holders: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
        holders
            .into_iter()
            .filter(|h| self.knows_dead(h))
            .map(str::to_string)
            .collect()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// The process's start time in clock ticks since boot (field 22 of
/// /proc/PID/stat), which tells a reused pid from the original process.
pub fn process_start(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; fields after it follow ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, uid: &str) -> OperatorIdentity {
        OperatorIdentity::Pod {
            namespace: "agents".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[derive(Debug)]
    struct Open;
    impl Fence for Open {
        fn check(&self) -> Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn two_live_processes_on_one_host_never_void_each_other() {
        // Both identities from this host: one is this very process, the
        // other a live child. Neither is "my earlier instance".
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let other = OperatorIdentity::Process {
            host: hostname(),
            pid: child.id(),
            start: process_start(child.id()).unwrap(),
        };
        let me = Holder::operator(&OperatorIdentity::current());
        let them = Holder::operator(&other);
        assert_ne!(
            OperatorIdentity::current().render(),
            other.render(),
            "distinct processes have distinct identities"
        );
        assert!(!me.knows_dead(them.name()), "a live process is not dead");
        assert!(!them.knows_dead(me.name()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(me.knows_dead(them.name()), "its pid is gone: it is dead");
        // Another host's processes cannot be judged from here.
        let elsewhere = OperatorIdentity::Process {
            host: "elsewhere".into(),
            pid: 1,
            start: "0".into(),
        };
        assert!(!me.knows_dead(Holder::operator(&elsewhere).name()));
    }

    #[test]
    fn a_pod_outlives_only_its_own_name() {
        let me = Holder::operator(&pod("op-a", "uid-2"));
        let restarted = Holder::operator(&pod("op-a", "uid-2"));
        let replaced = Holder::operator(&pod("op-a", "uid-1"));
        let other = Holder::operator(&pod("op-b", "uid-3"));
        assert!(me.knows_dead(restarted.name()), "a container restart");
        assert!(me.knows_dead(replaced.name()), "the name is mine now");
        assert!(!me.knows_dead(other.name()), "another replica");
        assert!(!me.knows_dead(me.name()));
        // The legacy `operator/<name>/<instance>` form is never judged dead
        // by identity: its claims lapse.
        assert!(!me.knows_dead("operator/op-a/abc"));
    }

    #[test]
    fn a_leader_voids_earlier_generations_and_never_later_ones() {
        let leader = Holder::elected_operator(&pod("op-b", "u"), 5, Arc::new(Open));
        let earlier = Holder::elected_operator(&pod("op-a", "u"), 4, Arc::new(Open));
        let later = Holder::elected_operator(&pod("op-a", "u"), 6, Arc::new(Open));
        let unelected = Holder::operator(&pod("op-c", "u"));
        assert!(leader.name().ends_with("/g5"));
        assert!(leader.knows_dead(earlier.name()));
        assert!(leader.knows_dead(unelected.name()));
        assert!(!leader.knows_dead(later.name()));
        assert!(
            !earlier.knows_dead(leader.name()),
            "an ex-leader voids nothing newer"
        );
        assert!(!leader.knows_dead(Holder::cli().name()), "never a CLI's");
    }

    #[test]
    fn a_cli_holder_is_dead_when_its_process_is_gone() {
        let me = Holder::cli();
        let alive = Holder::cli();
        assert!(!me.knows_dead(alive.name()), "this very process is alive");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = process_start(pid).unwrap_or_default();
        child.wait().unwrap();
        let gone = format!("cli/{}/{pid}/{start}", hostname());
        assert!(me.knows_dead(&gone));
        assert!(!me.knows_dead(&format!("cli/elsewhere/{pid}/{start}")));
    }

    #[test]
    fn a_fence_gates_work() {
        #[derive(Debug)]
        struct Shut;
        impl Fence for Shut {
            fn check(&self) -> Result<(), String> {
                Err("lease lapsed".into())
            }
        }
        assert!(Holder::cli().may_act().is_ok());
        let fenced = Holder::operator(&pod("a", "u")).with_fence(Arc::new(Shut));
        assert_eq!(fenced.may_act(), Err("lease lapsed".into()));
    }
}
