//! The process runner: runs a `runIsolated` call as a local child process,
//! speaking the same contract as the Job runner.
//!
//! - The call envelope (JSON) goes to the child's stdin.
//! - The child answers on stdout: a result envelope (which must echo the
//!   token), or plain text, taken as a successful text result when the exit
//!   status is 0. A non-zero exit is an error result carrying the tail of
//!   stderr.
//! - The command is exec'd with its argv as configured by the agent author;
//!   nothing the model wrote is ever put on a command line or through a
//!   shell: the model's arguments travel only inside the envelope.
//! - A timeout kills the child's whole process group.

use crate::core::envelope::{CallEnvelope, ResultEnvelope, ENVELOPE_VERSION};
use crate::core::{IsolationSpec, ToolResult};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// Output beyond this is cut, so a chatty tool cannot exhaust memory.
pub const MAX_CAPTURE_BYTES: usize = 4 * 1024 * 1024;
/// Used when the policy sets no timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// What one run produced, for logs and `-o json`; `result` goes to the core.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessOutcome {
    pub result: ToolResult,
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    pub elapsed: Duration,
}

#[derive(Clone, Debug)]
pub struct ProcessRunner {
    /// Extra environment for every child (e.g. `PATH` in tests).
    pub env: Vec<(String, String)>,
    pub default_timeout: Duration,
}

impl Default for ProcessRunner {
    fn default() -> Self {
        ProcessRunner {
            env: Vec::new(),
            default_timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl ProcessRunner {
    pub async fn run(
        &self,
        envelope: &CallEnvelope,
        spec: &IsolationSpec,
        timeout: Option<Duration>,
    ) -> ProcessOutcome {
        let started = Instant::now();
        let timeout = timeout.unwrap_or(self.default_timeout);
        let argv: Vec<&String> = spec.command.iter().chain(spec.args.iter()).collect();
        let Some((program, rest)) = argv.split_first() else {
            return failed(
                started,
                "the isolated tool has no command; set tools[].container.command",
            );
        };
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("AGENTS_TOKEN", envelope.token.as_str())
            .env("AGENTS_ENVELOPE_VERSION", ENVELOPE_VERSION)
            .kill_on_drop(true)
            // Its own process group, so a timeout also ends grandchildren.
            .process_group(0);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return failed(started, format!("cannot start {program:?}: {e}")),
        };
        let pid = child.id();
        let input = serde_json::to_vec(envelope).expect("envelopes serialise");
        let mut stdin = child.stdin.take().expect("piped");
        let mut stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let io = async {
            // A tool may exit without reading its input; that is fine.
            let write = async {
                let _ = stdin.write_all(&input).await;
                drop(stdin);
            };
            let (_, out, err) =
                tokio::join!(write, read_capped(&mut stdout), read_capped(&mut stderr));
            let status = child.wait().await;
            (out, err, status)
        };
        match tokio::time::timeout(timeout, io).await {
            Ok((stdout, stderr, status)) => {
                let exit_code = status.as_ref().ok().and_then(|s| s.code());
                let result = match status {
                    Err(e) => ToolResult::error(format!("waiting for {program:?}: {e}")),
                    Ok(s) => interpret(envelope, s.success(), exit_code, &stdout, &stderr),
                };
                ProcessOutcome {
                    result,
                    exit_code,
                    stdout,
                    stderr,
                    timed_out: false,
                    elapsed: started.elapsed(),
                }
            }
            Err(_) => {
                if let Some(pid) = pid {
                    // SAFETY: kill(2) with a negative pid signals the group
                    // we created above; no memory is involved.
                    unsafe {
                        libc::kill(-(pid as i32), libc::SIGKILL);
                    }
                }
                ProcessOutcome {
                    result: ToolResult::error(format!(
                        "timed out after {}s; the process was killed",
                        timeout.as_secs_f64()
                    )),
                    exit_code: None,
                    stdout: String::new(),
                    stderr: String::new(),
                    timed_out: true,
                    elapsed: started.elapsed(),
                }
            }
        }
    }
}

fn failed(started: Instant, message: impl Into<String>) -> ProcessOutcome {
    ProcessOutcome {
        result: ToolResult::error(message),
        exit_code: None,
        stdout: String::new(),
        stderr: String::new(),
        timed_out: false,
        elapsed: started.elapsed(),
    }
}

async fn read_capped(r: &mut (impl AsyncReadExt + Unpin)) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                // Keep draining past the cap so the child never blocks on a full pipe.
                let room = MAX_CAPTURE_BYTES.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

fn looks_like_result_envelope(text: &str) -> bool {
    text.starts_with('{')
        && serde_json::from_str::<serde_json::Value>(text)
            .is_ok_and(|v| v.get("version").is_some() && v.get("status").is_some())
}

/// Turns what the child printed into the call's result.
fn interpret(
    envelope: &CallEnvelope,
    success: bool,
    exit_code: Option<i32>,
    stdout: &str,
    stderr: &str,
) -> ToolResult {
    let trimmed = stdout.trim();
    // Something that claims to be a result envelope must be a valid one
    // for this token; anything else is the tool's plain output.
    if looks_like_result_envelope(trimmed) {
        return ResultEnvelope::parse_for(trimmed, &envelope.token)
            .unwrap_or_else(|e| ToolResult::error(format!("the tool's result envelope: {e}")));
    }
    if success {
        return ToolResult::text(stdout.trim_end().to_string());
    }
    let tail: String = {
        let chars: Vec<char> = stderr.trim_end().chars().collect();
        chars[chars.len().saturating_sub(2000)..].iter().collect()
    };
    let code = exit_code.map_or("a signal".to_string(), |c| format!("exit status {c}"));
    if tail.is_empty() {
        ToolResult::error(format!("the tool ended with {code}"))
    } else {
        ToolResult::error(format!("the tool ended with {code}: {tail}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::envelope::ContextSnapshot;
    use crate::core::{AppliedPolicy, CallId, ContinuationToken, SessionId, ToolCall};
    use std::collections::BTreeMap;

    fn envelope(args: &str) -> CallEnvelope {
        CallEnvelope::new(
            ContinuationToken("s-t1-c0".into()),
            ToolCall {
                model_call_id: "m".into(),
                name: "bash".into(),
                arguments: args.into(),
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

    fn sh(script: &str) -> IsolationSpec {
        IsolationSpec {
            command: vec!["sh".into(), "-c".into(), script.into()],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_envelope_arrives_on_stdin_and_plain_stdout_is_the_result() {
        let out = ProcessRunner::default()
            .run(
                &envelope(r#"{"x":"$(touch /tmp/pwned)"}"#),
                &sh("cat"),
                None,
            )
            .await;
        let ToolResult::Success { response } = &out.result else {
            panic!("{out:?}")
        };
        let echoed: CallEnvelope = CallEnvelope::parse(&response.to_model_text()).unwrap();
        assert_eq!(echoed, envelope(r#"{"x":"$(touch /tmp/pwned)"}"#));
    }

    #[tokio::test]
    async fn a_result_envelope_must_echo_the_token() {
        let good = format!(
            r#"echo '{{"version":"{ENVELOPE_VERSION}","token":"s-t1-c0","status":"success","result":{{"type":"text","content":"ok"}}}}'"#
        );
        let out = ProcessRunner::default()
            .run(&envelope("{}"), &sh(&good), None)
            .await;
        assert_eq!(out.result, ToolResult::text("ok"));
        let wrong = good.replace("s-t1-c0", "other-t1-c0");
        let out = ProcessRunner::default()
            .run(&envelope("{}"), &sh(&wrong), None)
            .await;
        assert!(
            matches!(&out.result, ToolResult::Error { message } if message.contains("token")),
            "{out:?}"
        );
    }

    #[tokio::test]
    async fn failures_carry_stderr_and_timeouts_kill_the_group() {
        let out = ProcessRunner::default()
            .run(&envelope("{}"), &sh("echo boom >&2; exit 3"), None)
            .await;
        assert_eq!(
            out.result,
            ToolResult::error("the tool ended with exit status 3: boom")
        );
        let out = ProcessRunner::default()
            .run(
                &envelope("{}"),
                &sh("sleep 30 & sleep 30"),
                Some(Duration::from_millis(200)),
            )
            .await;
        assert!(out.timed_out);
        assert!(out.elapsed < Duration::from_secs(5), "{:?}", out.elapsed);
        let out = ProcessRunner::default()
            .run(&envelope("{}"), &IsolationSpec::default(), None)
            .await;
        assert!(out.result.is_error());
    }
}
