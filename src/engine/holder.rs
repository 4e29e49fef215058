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
//!
//! The driver reads its identity and its host's processes from the OS and
//! hands them in (the values and ports of [`crate::ports::identity`]): the
//! engine reads nothing itself.

pub use crate::ports::{Fence, HostProcesses, OperatorIdentity, ProcessIdentity};
use std::collections::BTreeSet;
use std::sync::Arc;

/// True when a process of identity `earlier` is provably gone, judged by
/// the live process `me`, which sees its host's processes in `host`.
fn outlived(me: &OperatorIdentity, earlier: &OperatorIdentity, host: &dyn HostProcesses) -> bool {
    match (me, earlier) {
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
            OperatorIdentity::Process { host: mine, .. },
            OperatorIdentity::Process {
                host: their_host,
                pid,
                start,
            },
        ) if mine == their_host => host.start_of(*pid).as_deref() != Some(start.as_str()),
        _ => false,
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
    /// The processes of this driver's host (none: judges no process).
    host: Option<Arc<dyn HostProcesses>>,
}

impl PartialEq for Holder {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl Eq for Holder {}

impl Holder {
    /// The CLI process `me`, which sees its host's processes in `host`.
    pub fn cli(me: &ProcessIdentity, host: Arc<dyn HostProcesses>) -> Self {
        Holder {
            host: Some(host),
            ..Holder::named(&format!("cli/{}/{}/{}", me.host, me.pid, me.start))
        }
    }

    /// An operator replica without leader election.
    pub fn operator(identity: &OperatorIdentity, host: Arc<dyn HostProcesses>) -> Self {
        Holder {
            name: format!(
                "operator/{}/{}",
                identity.render(),
                uuid::Uuid::new_v4().simple()
            ),
            identity: Some(identity.clone()),
            generation: None,
            fence: None,
            host: Some(host),
        }
    }

    /// An operator replica that leads in Lease generation `generation`
    /// (its `leaseTransitions`); `fence` says whether it still leads.
    pub fn elected_operator(
        identity: &OperatorIdentity,
        generation: i64,
        fence: Arc<dyn Fence>,
        host: Arc<dyn HostProcesses>,
    ) -> Self {
        let base = Holder::operator(identity, host);
        Holder {
            name: format!("{}/g{generation}", base.name),
            generation: Some(generation),
            fence: Some(fence),
            ..base
        }
    }

    /// A named holder (tests): it judges no process dead.
    pub fn named(name: &str) -> Self {
        Holder {
            name: name.to_string(),
            identity: None,
            generation: None,
            fence: None,
            host: None,
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
                let (Some(host), Ok(pid)) = (&self.host, pid.parse::<u32>()) else {
                    return false;
                };
                *their_host == host.host() && host.start_of(pid).as_deref() != Some(*start)
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
        match (
            &self.identity,
            OperatorIdentity::parse(their_identity),
            &self.host,
        ) {
            (Some(me), Some(them), Some(host)) => outlived(me, &them, host.as_ref()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// A host whose process table the test writes: pid -> start.
    #[derive(Debug, Default)]
    struct Table(Mutex<BTreeMap<u32, String>>);

    impl Table {
        fn with(live: &[(u32, &str)]) -> Arc<Table> {
            let t = Table::default();
            for (pid, start) in live {
                t.start(*pid, start);
            }
            Arc::new(t)
        }
        fn start(&self, pid: u32, start: &str) {
            self.0.lock().unwrap().insert(pid, start.into());
        }
        fn end(&self, pid: u32) {
            self.0.lock().unwrap().remove(&pid);
        }
    }

    impl HostProcesses for Table {
        fn host(&self) -> String {
            "h1".into()
        }
        fn start_of(&self, pid: u32) -> Option<String> {
            self.0.lock().unwrap().get(&pid).cloned()
        }
    }

    fn process(host: &str, pid: u32, start: &str) -> ProcessIdentity {
        ProcessIdentity {
            host: host.into(),
            pid,
            start: start.into(),
        }
    }

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
        let table = Table::with(&[(10, "100"), (11, "200")]);
        let me = Holder::operator(&process("h1", 10, "100").into(), table.clone());
        let them = Holder::operator(&process("h1", 11, "200").into(), table.clone());
        assert_ne!(me.name(), them.name());
        assert!(!me.knows_dead(them.name()), "a live process is not dead");
        assert!(!them.knows_dead(me.name()));
        table.start(11, "300");
        assert!(me.knows_dead(them.name()), "its pid was reused: it is dead");
        table.end(11);
        assert!(me.knows_dead(them.name()), "its pid is gone: it is dead");
        // Another host's processes cannot be judged from here.
        let elsewhere = Holder::operator(&process("elsewhere", 11, "0").into(), table.clone());
        assert!(!me.knows_dead(elsewhere.name()));
    }

    #[test]
    fn identities_survive_their_rendering() {
        for identity in [pod("op-a", "u-1"), process("h1", 7, "42").into()] {
            assert_eq!(OperatorIdentity::parse(&identity.render()), Some(identity));
        }
    }

    #[test]
    fn a_pod_outlives_only_its_own_name() {
        let host = Table::with(&[]);
        let me = Holder::operator(&pod("op-a", "uid-2"), host.clone());
        let restarted = Holder::operator(&pod("op-a", "uid-2"), host.clone());
        let replaced = Holder::operator(&pod("op-a", "uid-1"), host.clone());
        let other = Holder::operator(&pod("op-b", "uid-3"), host);
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
        let host = Table::with(&[(10, "100")]);
        let elected = |name: &str, generation| {
            Holder::elected_operator(&pod(name, "u"), generation, Arc::new(Open), host.clone())
        };
        let leader = elected("op-b", 5);
        let earlier = elected("op-a", 4);
        let later = elected("op-a", 6);
        let unelected = Holder::operator(&pod("op-c", "u"), host.clone());
        assert!(leader.name().ends_with("/g5"));
        assert!(leader.knows_dead(earlier.name()));
        assert!(leader.knows_dead(unelected.name()));
        assert!(!leader.knows_dead(later.name()));
        assert!(
            !earlier.knows_dead(leader.name()),
            "an ex-leader voids nothing newer"
        );
        let cli = Holder::cli(&process("h1", 10, "100"), host.clone());
        assert!(!leader.knows_dead(cli.name()), "never a CLI's");
    }

    #[test]
    fn a_cli_holder_is_dead_when_its_process_is_gone() {
        let table = Table::with(&[(10, "100"), (11, "200")]);
        let me = Holder::cli(&process("h1", 10, "100"), table.clone());
        let alive = Holder::cli(&process("h1", 11, "200"), table.clone());
        assert_eq!(alive.name(), "cli/h1/11/200");
        assert!(!me.knows_dead(alive.name()), "a live process is alive");
        assert!(!me.knows_dead(me.name()));
        table.end(11);
        assert!(me.knows_dead(alive.name()));
        assert!(!me.knows_dead("cli/elsewhere/11/200"));
        assert!(
            !Holder::named("h").knows_dead(alive.name()),
            "a holder without a host judges no process"
        );
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
        let host = Table::with(&[]);
        assert!(Holder::cli(&process("h1", 1, "1"), host.clone())
            .may_act()
            .is_ok());
        let fenced = Holder::operator(&pod("a", "u"), host).with_fence(Arc::new(Shut));
        assert_eq!(fenced.may_act(), Err("lease lapsed".into()));
    }
}
