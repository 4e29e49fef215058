//! Who a driver is and what it can see of its host: the values and ports
//! the engine's claim holder ([`crate::engine::holder`]) judges other
//! holders by. The driver reads them from the OS (`crate::host`) and hands
//! them in, so the engine itself reads no environment and no `/proc`.

use std::fmt::Debug;

/// Tells whether this driver may still start side effects. The operator's
/// leader election is one; a driver without one is always allowed.
pub trait Fence: Send + Sync + Debug {
    /// `Ok` while this driver may start work; `Err(why)` once it may not
    /// (for example, its Lease was not renewed in time).
    fn check(&self) -> Result<(), String>;
}

/// The processes of the host a driver runs on: how it tells a holder on
/// its own host that died (or whose pid was reused) from a live one.
pub trait HostProcesses: Send + Sync + Debug {
    /// This host's name, as holder names carry it.
    fn host(&self) -> String;
    /// When process `pid` started (an opaque value, compared for
    /// equality), or `None` when there is no such process.
    fn start_of(&self, pid: u32) -> Option<String>;
}

/// One process, told apart from every other process of its host, then or
/// later: its host, pid and start time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub host: String,
    pub pid: u32,
    pub start: String,
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

    /// The identity [`render`](Self::render) wrote, or `None`.
    pub fn parse(s: &str) -> Option<Self> {
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
}

impl From<ProcessIdentity> for OperatorIdentity {
    fn from(p: ProcessIdentity) -> Self {
        OperatorIdentity::Process {
            host: p.host,
            pid: p.pid,
            start: p.start,
        }
    }
}
