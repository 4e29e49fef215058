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
//! on stdout with a pointer (hash, length) in the termination message.
//! Exit 0 when it reported a result (an error result too); 64 when the
//! wrapper itself failed (its reason is then the termination message).

use crate::core::envelope::{CallEnvelope, ENVELOPE_VERSION};
use crate::core::ToolResult;
use crate::runner::wrapper_protocol::{
    failure_message, report, MAX_RESULT_BYTES, TERMINATION_LOG, WRAPPER_FAILED,
};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};

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
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(block.as_bytes()).and_then(|_| out.flush()) {
            return wrapper_failed(
                tl,
                &format!("agents tool-exec: cannot write the result to stdout: {e}"),
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
    use std::os::unix::process::ExitStatusExt;
    let Some((program, rest)) = command.split_first() else {
        return ToolResult::error("agents tool-exec got no command to run");
    };
    let mut streams = Vec::new();
    for (kind, num) in FORWARDED {
        match signal(*kind) {
            Ok(s) => streams.push((s, *num)),
            Err(e) => return ToolResult::error(format!("agents tool-exec: signal setup: {e}")),
        }
    }
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(rest)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        // Its own group: signals and the final kill reach its children too.
        .process_group(0);
    // The API server's address, which the kubelet puts in every container,
    // is of no use to a tool (it holds no credentials anyway).
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KUBERNETES_") {
            cmd.env_remove(&k);
        }
    }
    cmd.env("AGENTS_TOKEN", envelope.token.as_str())
        .env("AGENTS_ENVELOPE_VERSION", ENVELOPE_VERSION);
    let ooms_before = oom_kills();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return ToolResult::error(format!("cannot start the tool's command {program:?}: {e}"))
        }
    };
    let pgid = child.id().map(|p| p as i32);
    let input = serde_json::to_vec(envelope).expect("envelopes serialise");
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let write = async {
        // A tool may exit without reading its input; that is fine.
        let _ = stdin.write_all(&input).await;
        drop(stdin);
    };
    let read_out = async {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let mut overflow = false;
        loop {
            match stdout.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    // Keep draining past the cap so the tool never blocks.
                    let room = MAX_RESULT_BYTES.saturating_sub(buf.len());
                    overflow |= n > room;
                    buf.extend_from_slice(&chunk[..n.min(room)]);
                }
            }
        }
        (buf, overflow)
    };
    let read_err = async {
        let mut tail: Vec<u8> = Vec::new();
        let mut shown = 0usize;
        let mut last = b'\n';
        let mut chunk = vec![0u8; 16 * 1024];
        let mut err = std::io::stderr();
        loop {
            match stderr.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let data = &chunk[..n];
                    if shown < STDERR_SHOWN_BYTES {
                        let part = &data[..n.min(STDERR_SHOWN_BYTES - shown)];
                        let _ = err.write_all(part);
                        shown += part.len();
                        if let Some(b) = part.last() {
                            last = *b;
                        }
                        if shown == STDERR_SHOWN_BYTES {
                            let _ = err.write_all(
                                b"\n[agents tool-exec: the rest of the tool's stderr is not shown]\n",
                            );
                            last = b'\n';
                        }
                    }
                    tail.extend_from_slice(data);
                    if tail.len() > 2 * STDERR_TAIL_BYTES {
                        tail.drain(..tail.len() - STDERR_TAIL_BYTES);
                    }
                }
            }
        }
        // The result block on stdout must start on a line of its own.
        if last != b'\n' {
            let _ = err.write_all(b"\n");
        }
        let _ = err.flush();
        String::from_utf8_lossy(&tail).into_owned()
    };
    let wait = async {
        let mut forwarded: Option<i32> = None;
        let status = loop {
            let signals = futures::future::select_all(
                streams
                    .iter_mut()
                    .map(|(s, num)| Box::pin(async move { s.recv().await.map(|_| *num) })),
            );
            tokio::select! {
                status = child.wait() => break status,
                (sig, _, _) = signals => {
                    if let (Some(sig), Some(pgid)) = (sig, pgid) {
                        forwarded = Some(sig);
                        // SAFETY: kill(2) on the tool's own process group.
                        unsafe { libc::kill(-pgid, sig); }
                    }
                }
            }
        };
        // What the tool left behind ends with it, as it would with the
        // container; it would also hold the output pipes open.
        if let Some(pgid) = pgid {
            // SAFETY: as above.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
        (status, forwarded)
    };
    let readers = async { tokio::join!(write, read_out, read_err) };
    tokio::pin!(readers);
    tokio::pin!(wait);
    let mut drained = None;
    let (status, forwarded) = loop {
        tokio::select! {
            r = &mut readers, if drained.is_none() => drained = Some(r),
            w = &mut wait => break w,
        }
    };
    let (_, (out, overflow), err) =
        match drained {
            Some(r) => r,
            None => match tokio::time::timeout(DRAIN, readers).await {
                Ok(r) => r,
                Err(_) => return ToolResult::error(
                    "the tool exited, but a process it started in a new session kept its output \
                     open; its output is lost",
                ),
            },
        };
    let status = match status {
        Ok(s) => s,
        Err(e) => return ToolResult::error(format!("waiting for the tool {program:?}: {e}")),
    };
    let tail = |s: &str| -> String {
        let chars: Vec<char> = s.trim_end().chars().collect();
        chars[chars.len().saturating_sub(2000)..].iter().collect()
    };
    let with_tail = |msg: String| {
        let t = tail(&err);
        if t.is_empty() {
            ToolResult::error(msg)
        } else {
            ToolResult::error(format!("{msg}: {t}"))
        }
    };
    if let Some(sig) = status.signal() {
        if forwarded == Some(sig) {
            return with_tail(format!(
                "the tool was stopped by {}: its pod was terminated (its deadline passed or it was deleted)",
                signal_name(sig)
            ));
        }
        if sig == libc::SIGKILL && oom_kills() > ooms_before {
            return with_tail(format!(
                "the tool ran out of memory and was killed by the kernel (memory limit {})",
                memory_limit()
            ));
        }
        return with_tail(format!("the tool was killed by {}", signal_name(sig)));
    }
    if overflow {
        return ToolResult::error(format!(
            "the tool printed more than {MAX_RESULT_BYTES} bytes on stdout; a result may hold at most that"
        ));
    }
    let stdout = String::from_utf8_lossy(&out);
    crate::runner::interpret(envelope, status.success(), status.code(), &stdout, &err)
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
    use crate::core::envelope::ContextSnapshot;
    use crate::core::{AppliedPolicy, CallId, ContinuationToken, SessionId, ToolCall};
    use std::collections::BTreeMap;

    fn envelope() -> CallEnvelope {
        CallEnvelope::new(
            ContinuationToken("s-t1-c0".into()),
            ToolCall {
                model_call_id: "m".into(),
                name: "bash".into(),
                arguments: r#"{"x":"$(touch /tmp/pwned) 'q' \"dq\""}"#.into(),
            },
            ContextSnapshot {
                session: SessionId("s".into()),
                turn: 1,
                call_id: CallId::new(1, 0),
                agent: None,
                idempotency_key: "s/t1-c0".into(),
                params: BTreeMap::new(),
            },
            AppliedPolicy::default(),
        )
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
