//! `agents tool-exec`: the wrapper around a tool's command inside a tool
//! Job's container (Argo's emissary pattern). The Job runner
//! (`runner::job`) puts this binary into the pod with an init container
//! (`agents tool-exec --install-to /agents-bin/agents`) and runs the tool
//! container as
//! `/agents-bin/agents tool-exec --envelope /agents-input/envelope.json -- CMD ARGS...`.
//!
//! It feeds the call envelope on the tool's stdin, reads the tool's stdout
//! (a result envelope echoing the token, or plain text: the process
//! runner's rules), its stderr (shown in the container log, its tail kept
//! for error results) and exit status, forwards SIGTERM and friends to the
//! tool's process group, and reports the result envelope: in the
//! termination message when it fits in 4096 bytes, else as a framed block
//! on stderr, after the tool's own stderr in the same pipe, with a pointer
//! (hash, length) in the termination message.
//! Exit 0 when it reported a result (an error result too); 64 when the
//! wrapper itself failed (its reason is then the termination message).
//!
//! The child-process harness is the runners' own (`runner::harness`); the
//! report is the protocol the Job runner reads (`runner::wrapper_protocol`).

use crate::core::envelope::CallEnvelope;
use crate::core::ToolResult;
use crate::runner::harness::{self, Ended, Exchange, Options, Sink};
use crate::runner::runner_vars;
use crate::runner::wrapper_protocol::{
    failure_message, report, MAX_RESULT_BYTES, TERMINATION_LOG, WRAPPER_FAILED,
};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

#[derive(Args, Debug, Clone)]
pub struct ToolExecArgs {
    /// The call envelope (JSON); in a tool Job a downward-API or ConfigMap file.
    #[arg(long, required_unless_present = "install_to")]
    pub envelope: Option<PathBuf>,
    /// Where the result (or a pointer to it in the log) is written.
    #[arg(long, default_value = TERMINATION_LOG)]
    pub termination_log: PathBuf,
    /// Copy this binary to PATH (mode 0755) and exit: what a tool Job's
    /// init container runs to share the wrapper with the tool container.
    #[arg(long, conflicts_with_all = ["envelope", "command"])]
    pub install_to: Option<PathBuf>,
    /// The tool's command and its arguments, after `--`.
    #[arg(last = true, required_unless_present = "install_to")]
    pub command: Vec<String>,
}

/// The tool's stderr shown in the container log, at most.
const STDERR_SHOWN_BYTES: usize = 1024 * 1024;
/// The tail of stderr kept for an error result.
const STDERR_TAIL_BYTES: usize = 64 * 1024;

pub fn run(args: ToolExecArgs) -> ExitCode {
    if let Some(target) = &args.install_to {
        return match install(target) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => wrapper_failed(
                &args.termination_log,
                &format!(
                    "agents tool-exec: cannot install the wrapper at {}: {e}",
                    target.display()
                ),
            ),
        };
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            return wrapper_failed(
                &args.termination_log,
                &format!("agents tool-exec: cannot start: {e}"),
            )
        }
    };
    runtime.block_on(wrap(args))
}

/// Copies the running binary: through a temporary name, so a reader never
/// sees half a file.
fn install(target: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let me = std::env::current_exe()?;
    let tmp = target.with_extension("tmp");
    std::fs::copy(&me, &tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, target)
}

fn wrapper_failed(termination_log: &Path, message: &str) -> ExitCode {
    eprintln!("{message}");
    let _ = std::fs::write(termination_log, failure_message(message));
    ExitCode::from(WRAPPER_FAILED)
}

async fn wrap(args: ToolExecArgs) -> ExitCode {
    let tl = &args.termination_log;
    let path = args.envelope.as_deref().expect("clap requires --envelope");
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            return wrapper_failed(
                tl,
                &format!(
                    "agents tool-exec: cannot read the envelope {}: {e}",
                    path.display()
                ),
            )
        }
    };
    let envelope = match CallEnvelope::parse(&text) {
        Ok(e) => e,
        Err(e) => {
            return wrapper_failed(
                tl,
                &format!("agents tool-exec: the envelope {}: {e}", path.display()),
            )
        }
    };
    let result = run_tool(&envelope, &args.command).await;
    let (message, block) = report(&envelope.token, &result);
    if let Some(block) = block {
        let mut out = std::io::stderr().lock();
        if let Err(e) = out.write_all(block.as_bytes()).and_then(|_| out.flush()) {
            return wrapper_failed(
                tl,
                &format!("agents tool-exec: cannot write the result to stderr: {e}"),
            );
        }
    }
    if let Err(e) = std::fs::write(tl, &message) {
        return wrapper_failed(
            tl,
            &format!(
                "agents tool-exec: cannot write the termination message {}: {e}",
                tl.display()
            ),
        );
    }
    ExitCode::SUCCESS
}

/// Signals passed on to the tool (the kubelet sends SIGTERM on deadline
/// or deletion).
const FORWARDED: &[(SignalKind, i32)] = &[
    (SignalKind::terminate(), libc::SIGTERM),
    (SignalKind::interrupt(), libc::SIGINT),
    (SignalKind::hangup(), libc::SIGHUP),
    (SignalKind::quit(), libc::SIGQUIT),
    (SignalKind::user_defined1(), libc::SIGUSR1),
    (SignalKind::user_defined2(), libc::SIGUSR2),
];

/// Runs the tool and turns what it did into the call's result.
pub async fn run_tool(envelope: &CallEnvelope, command: &[String]) -> ToolResult {
    let Some((program, rest)) = command.split_first() else {
        return ToolResult::error("agents tool-exec got no command to run");
    };
    let mut signals = match forwarded_signals() {
        Ok(s) => s,
        Err(e) => return ToolResult::error(format!("agents tool-exec: signal setup: {e}")),
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(rest);
    // The API server's address, which the kubelet puts in every container,
    // is of no use to a tool (it holds no credentials anyway).
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KUBERNETES_") {
            cmd.env_remove(&k);
        }
    }
    cmd.envs(runner_vars(envelope));
    let ooms_before = oom_kills();
    let tool = match harness::spawn(&mut cmd, Options::IN_POD) {
        Ok(t) => t,
        Err(e) => {
            return ToolResult::error(format!("cannot start the tool's command {program:?}: {e}"))
        }
    };
    let exchange = Exchange {
        envelope,
        stdout_cap: MAX_RESULT_BYTES,
        stderr: ShownTail::default(),
        signals: &mut signals,
        // The pod's deadline bounds the run.
        timeout: None,
        drain: Some(DRAIN),
    };
    match tool.exchange(exchange).await {
        Ok(ended) => judge(envelope, program, &ended, ooms_before),
        Err(_) => ToolResult::error(
            "the tool exited, but a process it started in a new session kept its output \
             open; its output is lost",
        ),
    }
}

/// The streams of the signals passed on to the tool.
fn forwarded_signals() -> std::io::Result<Vec<(Signal, i32)>> {
    FORWARDED
        .iter()
        .map(|(kind, num)| Ok((signal(*kind)?, *num)))
        .collect()
}

/// The call's result from how the tool ended.
fn judge(
    envelope: &CallEnvelope,
    program: &str,
    ended: &Ended<ShownTail>,
    ooms_before: u64,
) -> ToolResult {
    use std::os::unix::process::ExitStatusExt;
    let status = match &ended.status {
        Ok(s) => s,
        Err(e) => return ToolResult::error(format!("waiting for the tool {program:?}: {e}")),
    };
    let err = ended.stderr.text();
    if let Some(sig) = status.signal() {
        let message = if ended.forwarded == Some(sig) {
            format!(
                "the tool was stopped by {}: its pod was terminated (its deadline passed or it was deleted)",
                signal_name(sig)
            )
        } else if sig == libc::SIGKILL && oom_kills() > ooms_before {
            format!(
                "the tool ran out of memory and was killed by the kernel (memory limit {})",
                memory_limit()
            )
        } else {
            format!("the tool was killed by {}", signal_name(sig))
        };
        return harness::with_stderr_tail(message, &err);
    }
    if ended.stdout.overflow {
        return ToolResult::error(format!(
            "the tool printed more than {MAX_RESULT_BYTES} bytes on stdout; a result may hold at most that"
        ));
    }
    let stdout = ended.stdout.text();
    harness::interpret(envelope, status.success(), status.code(), &stdout, &err)
}

/// The tool's stderr: shown in the container log (up to
/// [`STDERR_SHOWN_BYTES`]), its tail kept for an error result.
struct ShownTail {
    tail: Vec<u8>,
    shown: usize,
    last: u8,
}

impl Default for ShownTail {
    fn default() -> Self {
        ShownTail {
            tail: Vec::new(),
            shown: 0,
            last: b'\n',
        }
    }
}

impl ShownTail {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.tail).into_owned()
    }
}

impl Sink for ShownTail {
    fn push(&mut self, data: &[u8]) {
        let mut err = std::io::stderr();
        if self.shown < STDERR_SHOWN_BYTES {
            let part = &data[..data.len().min(STDERR_SHOWN_BYTES - self.shown)];
            let _ = err.write_all(part);
            self.shown += part.len();
            if let Some(b) = part.last() {
                self.last = *b;
            }
            if self.shown == STDERR_SHOWN_BYTES {
                let _ = err.write_all(
                    b"\n[agents tool-exec: the rest of the tool's stderr is not shown]\n",
                );
                self.last = b'\n';
            }
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() > 2 * STDERR_TAIL_BYTES {
            self.tail.drain(..self.tail.len() - STDERR_TAIL_BYTES);
        }
    }

    fn finish(&mut self) {
        // The result block, written next on stderr, starts on a line of its own.
        let mut err = std::io::stderr();
        if self.last != b'\n' {
            let _ = err.write_all(b"\n");
        }
        let _ = err.flush();
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

/// OOM kills in the container's memory cgroup so far (cgroup v1 or v2),
/// 0 when unknown.
fn oom_kills() -> u64 {
    for (file, key) in [
        ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"),
        ("/sys/fs/cgroup/memory.events", "oom_kill"),
    ] {
        if let Ok(text) = std::fs::read_to_string(file) {
            for line in text.lines() {
                if let Some(n) = line.strip_prefix(key).map(str::trim) {
                    if let Ok(n) = n.parse() {
                        return n;
                    }
                }
            }
        }
    }
    0
}

fn memory_limit() -> String {
    for file in [
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory.max",
    ] {
        if let Ok(text) = std::fs::read_to_string(file) {
            let t = text.trim();
            return match t.parse::<u64>() {
                Ok(b) if b < (1 << 60) => format!("{} MiB", b / (1024 * 1024)),
                _ => t.to_string(),
            };
        }
    }
    "unknown".into()
}

/// Waits at most this long for the output once the tool is gone.
const DRAIN: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::fixtures;

    fn envelope() -> CallEnvelope {
        fixtures::envelope("s", r#"{"x":"$(touch /tmp/pwned) 'q' \"dq\""}"#)
    }

    fn sh(script: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), script.into()]
    }

    #[tokio::test]
    async fn the_envelope_arrives_on_stdin_and_plain_text_is_the_result() {
        let r = run_tool(&envelope(), &sh("cat")).await;
        let ToolResult::Success { response } = &r else {
            panic!("{r:?}")
        };
        assert_eq!(
            CallEnvelope::parse(&response.to_model_text()).unwrap(),
            envelope()
        );
    }

    #[tokio::test]
    async fn failures_name_the_status_and_the_stderr_tail() {
        let r = run_tool(&envelope(), &sh("echo boom >&2; exit 3")).await;
        assert_eq!(
            r,
            ToolResult::error("the tool ended with exit status 3: boom")
        );
        let r = run_tool(&envelope(), &sh("kill -9 $$")).await;
        assert!(
            matches!(&r, ToolResult::Error { message } if message.contains("SIGKILL")),
            "{r:?}"
        );
        let r = run_tool(&envelope(), &["/no/such/tool".to_string()]).await;
        assert!(
            matches!(&r, ToolResult::Error { message } if message.contains("/no/such/tool")),
            "{r:?}"
        );
    }
}
