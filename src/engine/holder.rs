//! Who holds a claim, and whether that holder is known to be dead.
//!
//! Holder names carry what a later driver needs to judge them:
//! - `cli/<host>/<pid>/<start-time>`: a CLI process. On the same host, a
//!   holder whose process is gone (or whose pid was reused, seen by the
//!   start time) is dead; its claims are void at once.
//! - `operator/<identity>/<instance>`: an operator replica (identity: the
//!   pod name). An earlier instance of my own identity is dead: I am its
//!   restart. Another replica's claims stand until they expire.

use std::collections::BTreeSet;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    name: String,
    /// An operator that won leader election: every other operator replica
    /// stopped leading before it got the Lease (and exits on losing it),
    /// so their claims are void.
    elected: bool,
}

impl Holder {
    /// This CLI process.
    pub fn cli() -> Self {
        let pid = std::process::id();
        Holder {
            name: format!(
                "cli/{}/{pid}/{}",
                hostname(),
                process_start(pid).unwrap_or_default()
            ),
            elected: false,
        }
    }

    /// An operator replica; `identity` is stable across its restarts.
    pub fn operator(identity: &str) -> Self {
        Holder {
            name: format!("operator/{identity}/{}", uuid::Uuid::new_v4().simple()),
            elected: false,
        }
    }

    /// An operator replica that holds the leader Lease.
    pub fn elected_operator(identity: &str) -> Self {
        Holder {
            elected: true,
            ..Holder::operator(identity)
        }
    }

    /// A named holder (tests).
    pub fn named(name: &str) -> Self {
        Holder {
            name: name.to_string(),
            elected: false,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// True when `other` (a holder name found on a claim) is known dead.
    pub fn knows_dead(&self, other: &str) -> bool {
        if other == self.name {
            return false;
        }
        let mine: Vec<&str> = self.name.split('/').collect();
        let theirs: Vec<&str> = other.split('/').collect();
        match (mine.as_slice(), theirs.as_slice()) {
            (["operator", me, _], ["operator", them, _]) => self.elected || me == them,
            (["cli", host, ..], ["cli", their_host, pid, start]) if host == their_host => {
                match pid.parse::<u32>() {
                    Ok(pid) => process_start(pid).as_deref() != Some(*start),
                    Err(_) => false,
                }
            }
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
fn process_start(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; fields after it follow ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_earlier_instance_of_my_identity_is_dead_another_replica_is_not() {
        let me = Holder::operator("pod-a");
        let earlier = Holder::operator("pod-a");
        let other = Holder::operator("pod-b");
        assert!(me.knows_dead(earlier.name()));
        assert!(!me.knows_dead(other.name()));
        assert!(!me.knows_dead(me.name()));
        // The elected leader voids every other replica's claims (they
        // stopped leading first); never a CLI's.
        let leader = Holder::elected_operator("pod-b");
        assert!(leader.knows_dead(me.name()));
        assert!(!leader.knows_dead(Holder::cli().name()));
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
        // Another host's processes cannot be judged from here.
        assert!(!me.knows_dead(&format!("cli/elsewhere/{pid}/{start}")));
    }
}
