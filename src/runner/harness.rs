//! The child-process harness every runner shares: the process runner
//! ([`super::ProcessRunner`]), the container runner (whose child is the
//! engine's client) and the Job's in-pod wrapper (`agents tool-exec`).
//!
//! - [`spawn`] starts the child with piped stdio, in its own process group,
//!   killed when its handle is dropped; optionally it also dies with the
//!   thread that spawned it ([`Options::die_with_thread`]).
//! - [`Tool::exchange`] writes the call envelope on the child's stdin (a
//!   tool may exit without reading it), reads stdout up to a cap (draining
//!   past it, so the child never blocks on a full pipe) and stderr into a
//!   [`Sink`], forwards signals to the group, waits for the exit, and then
//!   kills the group when asked to ([`Options::kill_group`]): children the
//!   tool left behind die with it and stop holding its output open.
//! - [`interpret`] turns what the child printed into the call's result, so
//!   every runner reads a tool's answer the same way.
//!
//! What differs between the runners stays with them: the command and its
//! environment, the timeout, the sink for stderr, and the words of their
//! error results.

use crate::core::envelope::{CallEnvelope, ResultEnvelope};
use crate::core::{ContinuationToken, ToolResult};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::signal::unix::Signal;

/// How a child is started and ended: the parts that differ between runners.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Options {
    /// SIGKILL the child's whole process group when it exits, and when the
    /// run is left any other way (a timeout, the future dropped).
    pub kill_group: bool,
    /// The child gets SIGKILL when the thread that spawned it ends
    /// (`PR_SET_PDEATHSIG`, Linux only).
    pub die_with_thread: bool,
}

impl Options {
    /// A tool on the worker's machine (the process runner): its group dies
    /// with it, and it dies with the worker's thread.
    pub const HOST_TOOL: Options = Options {
        kill_group: true,
        die_with_thread: true,
    };
    /// A container engine's client (the container runner): the container
    /// is not in the client's group (the runner removes it); the client
    /// dies with the worker's thread.
    pub const ENGINE_CLIENT: Options = Options {
        kill_group: false,
        die_with_thread: true,
    };
    /// The tool in a Job's pod (the wrapper): the pod is the sandbox, and
    /// what the tool leaves behind ends with it, as with the container.
    pub const IN_POD: Options = Options {
        kill_group: true,
        die_with_thread: false,
    };
}

/// A started child: piped stdio, its own process group.
pub(crate) struct Tool {
    child: Child,
    group: GroupKill,
}

/// Starts `cmd` (its program, arguments and environment set by the caller)
/// as a tool process.
pub(crate) fn spawn(cmd: &mut Command, options: Options) -> std::io::Result<Tool> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        // Its own process group: signals, a timeout and the final kill
        // reach its children too.
        .process_group(0);
    if options.die_with_thread {
        die_with_this_thread(cmd);
    }
    let child = cmd.spawn()?;
    let group = GroupKill {
        pgid: child.id().map(|p| p as i32),
        armed: options.kill_group,
    };
    Ok(Tool { child, group })
}

/// One conversation with a tool process.
pub(crate) struct Exchange<'a, E> {
    /// Written on the child's stdin, which is then closed.
    pub envelope: &'a CallEnvelope,
    /// Stdout beyond this is cut (and [`Captured::overflow`] set).
    pub stdout_cap: usize,
    /// Where stderr goes.
    pub stderr: E,
    /// Signals received by this process, each forwarded to the child's
    /// group (its number beside it); none for the runners.
    pub signals: &'a mut [(Signal, i32)],
    /// The whole run; on expiry the child (and, with
    /// [`Options::kill_group`], its group) is killed.
    pub timeout: Option<Duration>,
    /// How long the output may stay open once the child has exited; `None`:
    /// as long as the timeout allows.
    pub drain: Option<Duration>,
}

/// What a child did.
pub(crate) struct Ended<E> {
    pub stdout: Captured,
    pub stderr: E,
    pub status: std::io::Result<ExitStatus>,
    /// The signal last forwarded to the child, if any.
    pub forwarded: Option<i32>,
}

impl<E> Ended<E> {
    pub fn exit_code(&self) -> Option<i32> {
        self.status.as_ref().ok().and_then(|s| s.code())
    }
}

/// Why an exchange gave no [`Ended`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stopped {
    /// [`Exchange::timeout`] passed; the child was killed.
    TimedOut,
    /// The child exited, but something still held its output open past
    /// [`Exchange::drain`].
    OutputHeld,
}

impl Tool {
    /// Runs the conversation (see the module docs). The child is killed
    /// however this is left; its group too with [`Options::kill_group`].
    pub async fn exchange<E: Sink>(mut self, ex: Exchange<'_, E>) -> Result<Ended<E>, Stopped> {
        let timeout = ex.timeout;
        let run = self.converse(ex);
        let ended = match timeout {
            None => run.await,
            Some(t) => tokio::time::timeout(t, run)
                .await
                .unwrap_or(Err(Stopped::TimedOut)),
        };
        if ended.is_err() {
            let _ = self.child.start_kill();
            self.group.kill();
        }
        ended
    }

    async fn converse<E: Sink>(&mut self, ex: Exchange<'_, E>) -> Result<Ended<E>, Stopped> {
        let input = serde_json::to_vec(ex.envelope).expect("envelopes serialise");
        let mut stdin = self.child.stdin.take().expect("piped");
        let mut stdout = self.child.stdout.take().expect("piped");
        let mut stderr = self.child.stderr.take().expect("piped");
        let write = async {
            // A tool may exit without reading its input; that is fine.
            let _ = stdin.write_all(&input).await;
            drop(stdin);
        };
        let readers = async {
            let (_, out, err) = tokio::join!(
                write,
                pump(&mut stdout, Captured::new(ex.stdout_cap)),
                pump(&mut stderr, ex.stderr)
            );
            (out, err)
        };
        let wait = wait(&mut self.child, &mut self.group, ex.signals);
        tokio::pin!(readers);
        tokio::pin!(wait);
        let mut drained = None;
        let (status, forwarded) = loop {
            tokio::select! {
                r = &mut readers, if drained.is_none() => drained = Some(r),
                w = &mut wait => break w,
            }
        };
        let (stdout, stderr) = match (drained, ex.drain) {
            (Some(r), _) => r,
            (None, None) => readers.await,
            (None, Some(d)) => tokio::time::timeout(d, readers)
                .await
                .map_err(|_| Stopped::OutputHeld)?,
        };
        Ok(Ended {
            stdout,
            stderr,
            status,
            forwarded,
        })
    }
}

/// Waits for the child's exit, forwarding `signals` to its group until
/// then; then kills the group when armed (children it left behind die
/// with it, as in a Job's pod; they would also hold the output open).
async fn wait(
    child: &mut Child,
    group: &mut GroupKill,
    signals: &mut [(Signal, i32)],
) -> (std::io::Result<ExitStatus>, Option<i32>) {
    let mut forwarded = None;
    let status = loop {
        if signals.is_empty() {
            break child.wait().await;
        }
        let incoming = futures::future::select_all(
            signals
                .iter_mut()
                .map(|(s, num)| Box::pin(async move { s.recv().await.map(|_| *num) })),
        );
        tokio::select! {
            status = child.wait() => break status,
            (sig, _, _) = incoming => {
                if let (Some(sig), Some(pgid)) = (sig, group.pgid) {
                    forwarded = Some(sig);
                    signal_group(pgid, sig);
                }
            }
        }
    };
    group.kill();
    (status, forwarded)
}

/// Where a child's output goes, chunk by chunk.
pub(crate) trait Sink {
    fn push(&mut self, data: &[u8]);
    /// At the end of the output.
    fn finish(&mut self) {}
}

/// The head of an output, up to a cap.
#[derive(Clone, Debug, Default)]
pub(crate) struct Captured {
    cap: usize,
    pub bytes: Vec<u8>,
    /// More came than the cap.
    pub overflow: bool,
}

impl Captured {
    pub fn new(cap: usize) -> Self {
        Captured {
            cap,
            ..Default::default()
        }
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

impl Sink for Captured {
    fn push(&mut self, data: &[u8]) {
        let room = self.cap.saturating_sub(self.bytes.len());
        self.overflow |= data.len() > room;
        self.bytes.extend_from_slice(&data[..data.len().min(room)]);
    }
}

/// Reads `r` to its end into `sink`; past any cap the sink keeps, the
/// reading goes on, so the child never blocks on a full pipe.
async fn pump<S: Sink>(r: &mut (impl AsyncRead + Unpin), mut sink: S) -> S {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => sink.push(&chunk[..n]),
        }
    }
    sink.finish();
    sink
}

/// SIGKILLs a process group when dropped (or at [`GroupKill::kill`]), if
/// armed.
struct GroupKill {
    pgid: Option<i32>,
    armed: bool,
}

impl GroupKill {
    fn kill(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pgid) = self.pgid.take() {
            signal_group(pgid, libc::SIGKILL);
        }
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        self.kill();
    }
}

fn signal_group(pgid: i32, sig: i32) {
    // SAFETY: kill(2) with a negative pid signals the group created at
    // spawn; no memory is involved.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// The child gets SIGKILL when the thread that spawned it ends: a worker
/// killed with SIGKILL takes its tool along instead of leaving it running
/// under pid 1 while another worker runs the same call.
#[cfg(target_os = "linux")]
fn die_with_this_thread(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (prctl, getppid), touching no memory
    // shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The worker may have died before prctl took effect.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_this_thread(_: &mut Command) {}

/// The result a tool's output claims to be: `Some` when `text` looks like
/// a result envelope (JSON with a version and a status), which must then
/// be a valid one for `token`; `None` for anything else.
pub(crate) fn claimed_result(text: &str, token: &ContinuationToken) -> Option<ToolResult> {
    let claims = text.starts_with('{')
        && serde_json::from_str::<serde_json::Value>(text)
            .is_ok_and(|v| v.get("version").is_some() && v.get("status").is_some());
    claims.then(|| parse_result(text, token))
}

/// A result envelope for `token`, or an error result saying what is wrong
/// with it.
pub(crate) fn parse_result(text: &str, token: &ContinuationToken) -> ToolResult {
    ResultEnvelope::parse_for(text, token)
        .unwrap_or_else(|e| ToolResult::error(format!("the tool's result envelope: {e}")))
}

/// Turns what the child printed into the call's result (every runner and
/// the Job's wrapper use it, so they agree).
pub(crate) fn interpret(
    envelope: &CallEnvelope,
    success: bool,
    exit_code: Option<i32>,
    stdout: &str,
    stderr: &str,
) -> ToolResult {
    // Something that claims to be a result envelope must be a valid one
    // for this token; anything else is the tool's plain output.
    if let Some(result) = claimed_result(stdout.trim(), &envelope.token) {
        return result;
    }
    if success {
        return ToolResult::text(stdout.trim_end().to_string());
    }
    let code = exit_code.map_or("a signal".to_string(), |c| format!("exit status {c}"));
    with_stderr_tail(format!("the tool ended with {code}"), stderr)
}

/// An error result: `message`, then the tail of `stderr` when there is one.
pub(crate) fn with_stderr_tail(message: String, stderr: &str) -> ToolResult {
    let chars: Vec<char> = stderr.trim_end().chars().collect();
    let tail: String = chars[chars.len().saturating_sub(2000)..].iter().collect();
    if tail.is_empty() {
        ToolResult::error(message)
    } else {
        ToolResult::error(format!("{message}: {tail}"))
    }
}
