//! This process and its host, as the OS tells them: the identity a driver
//! hands the engine's claim holder, and the [`HostProcesses`] port over
//! `/proc`. Both drivers (the operator, the CLI) read them here, so the
//! engine reads no environment and no file.

use crate::ports::{HostProcesses, OperatorIdentity, ProcessIdentity};
use std::path::Path;
use std::sync::Arc;

/// The host's processes, read from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcFs;

impl HostProcesses for ProcFs {
    fn host(&self) -> String {
        hostname()
    }

    fn start_of(&self, pid: u32) -> Option<String> {
        process_start(pid)
    }
}

/// The host's processes as a port for the holder.
pub fn processes() -> Arc<dyn HostProcesses> {
    Arc::new(ProcFs)
}

/// This very process: host, pid, start time.
pub fn this_process() -> ProcessIdentity {
    let pid = std::process::id();
    ProcessIdentity {
        host: hostname(),
        pid,
        start: process_start(pid).unwrap_or_default(),
    }
}

/// This operator's identity: the pod's when `POD_NAME` is set (the
/// downward API: `POD_NAMESPACE`, `POD_NAME`, `POD_UID`), else this
/// process's host, pid and start time.
pub fn operator_identity() -> OperatorIdentity {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    match env("POD_NAME") {
        Some(name) => OperatorIdentity::Pod {
            namespace: env("POD_NAMESPACE").unwrap_or_default(),
            name,
            uid: env("POD_UID").unwrap_or_default(),
        },
        None => this_process().into(),
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

/// Reads a file a person named (a definition, an export, a result) as
/// UTF-8, at most `most` bytes: a larger file, or an endless one like
/// `/dev/zero`, is an error naming the bound, not a CLI that takes the
/// machine's memory. Pipes are read too (`agents run -f <(...)`).
pub fn read_named_file(path: &Path, most: usize) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(most as u64 + 1).read_to_end(&mut bytes)?;
    if bytes.len() > most {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!(
                "it is larger than {} MiB, the most this command reads; \
                 is it the file you meant?",
                most >> 20
            ),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|e| Error::new(ErrorKind::InvalidData, format!("it is not UTF-8 text: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_file_is_read_up_to_its_bound() {
        let dir = std::env::temp_dir().join(format!("agents-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f.txt");
        std::fs::write(&file, "x".repeat(2 << 20)).unwrap();
        assert_eq!(read_named_file(&file, 2 << 20).unwrap().len(), 2 << 20);
        let over = read_named_file(&file, 1 << 20).unwrap_err().to_string();
        assert!(over.contains("larger than 1 MiB"), "{over}");
        let endless = read_named_file(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(
            endless.to_string().contains("larger than 1 MiB"),
            "{endless}"
        );
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        let binary = read_named_file(&file, 1 << 20).unwrap_err().to_string();
        assert!(binary.contains("not UTF-8"), "{binary}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_process_is_known_by_its_start_until_it_is_gone() {
        let me = this_process();
        assert_eq!(me.pid, std::process::id());
        assert!(!me.start.is_empty(), "this process has a start time");
        assert_eq!(ProcFs.start_of(me.pid), Some(me.start.clone()));
        assert_eq!(ProcFs.host(), me.host);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(ProcFs.start_of(pid), None, "a reaped child is gone");
    }

    #[test]
    fn outside_a_pod_the_operator_is_this_process() {
        // The test runner is not given POD_NAME.
        if std::env::var_os("POD_NAME").is_none() {
            assert_eq!(operator_identity(), this_process().into());
        }
    }
}
