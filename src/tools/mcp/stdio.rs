//! A server as a child process, speaking newline-delimited JSON-RPC on
//! stdin and stdout (standalone only). The child lives as long as its
//! connection, one request at a time, under the clean-environment rule of
//! process tools: `PATH` (system directories), `HOME` (a scratch directory
//! of its own, removed with it), `LANG`, and exactly the variables its entry
//! names. Nothing is inherited from this process, whose environment holds
//! the model's API key. It is killed with the connection, and with this
//! process (`PR_SET_PDEATHSIG`).

use super::{rpc_error, McpError, Reply, MAX_MESSAGE_BYTES};
use crate::core::policy::EnvVarSpec;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// `PATH` of the child: system directories only (as process tools get).
pub const SAFE_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// Variables the client sets itself.
const RESERVED: &[&str] = &["PATH", "HOME", "LANG"];
/// The end of stderr quoted when the child fails.
const STDERR_TAIL: usize = 2048;

pub struct StdioEndpoint {
    command: Vec<String>,
    env: Vec<(String, String)>,
    io: tokio::sync::Mutex<Option<Io>>,
}

struct Io {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<Vec<u8>>>,
    home: PathBuf,
}

impl Drop for Io {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.home);
    }
}

/// The entry's variables with their values, and the key of a connection
/// with exactly these (a hash, never the values).
pub(crate) fn resolve_env(
    command: &[String],
    env: &[EnvVarSpec],
    lookup: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<(String, Vec<(String, String)>), McpError> {
    let mut out = Vec::new();
    let mut hash = Sha256::new();
    for e in env {
        if RESERVED.contains(&e.name.as_str()) {
            return Err(McpError::Transport(format!(
                "env {:?} is set by the runtime itself; remove it",
                e.name
            )));
        }
        let value = e
            .resolve(lookup)
            .map_err(|err| McpError::Transport(format!("env {err}")))?;
        hash.update(e.name.as_bytes());
        hash.update([0]);
        hash.update(value.as_bytes());
        hash.update([0]);
        out.push((e.name.clone(), value));
    }
    let digest: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((format!("stdio {} {digest}", command.join("\u{0}")), out))
}

impl StdioEndpoint {
    pub(crate) fn spawn(command: &[String], env: Vec<(String, String)>) -> Result<Self, McpError> {
        if command.is_empty() {
            return Err(McpError::Transport("the command is empty".into()));
        }
        Ok(StdioEndpoint {
            command: command.to_vec(),
            env,
            io: tokio::sync::Mutex::new(None),
        })
    }

    fn start(&self) -> Result<Io, McpError> {
        let home = std::env::temp_dir().join(format!("agents-mcp-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&home)
            .map_err(|e| McpError::Transport(format!("making {}: {e}", home.display())))?;
        let mut cmd = tokio::process::Command::new(&self.command[0]);
        cmd.args(&self.command[1..])
            .env_clear()
            .env("PATH", SAFE_PATH)
            .env("HOME", &home)
            .env("LANG", "C.UTF-8")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&home)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; nothing else runs in the child.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            let _ = std::fs::remove_dir_all(&home);
            McpError::Transport(format!("starting {:?} failed: {e}", self.command[0]))
        })?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut err = child.stderr.take().expect("piped stderr");
        let tail = stderr.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                let mut t = tail.lock().expect("stderr tail");
                t.extend_from_slice(&buf[..n]);
                let over = t.len().saturating_sub(STDERR_TAIL);
                t.drain(..over);
            }
        });
        Ok(Io {
            child,
            stdin,
            stdout,
            stderr,
            home,
        })
    }

    /// Writes `message`; reads lines until the response to its id. A child
    /// found dead before anything is written is started again, and the
    /// connection told its session is gone (nothing was sent).
    pub(crate) async fn send(&self, message: &Value) -> Result<Reply, McpError> {
        let mut guard = self.io.lock().await;
        let restarted = match guard.as_mut() {
            Some(io) => !matches!(io.child.try_wait(), Ok(None)),
            None => false,
        };
        if restarted || guard.is_none() {
            *guard = Some(self.start()?);
            if restarted {
                return Err(McpError::SessionGone);
            }
        }
        let io = guard.as_mut().expect("started");
        let result = exchange(io, message).await;
        if let Err(e) = &result {
            let tail =
                String::from_utf8_lossy(&io.stderr.lock().expect("stderr tail")).into_owned();
            let e = match e {
                McpError::Transport(t) if !tail.trim().is_empty() => {
                    McpError::Transport(format!("{t}; its stderr ends: {}", tail.trim()))
                }
                other => other.clone(),
            };
            if matches!(e, McpError::Transport(_)) {
                *guard = None;
            }
            return Err(e);
        }
        result
    }
}

async fn exchange(io: &mut Io, message: &Value) -> Result<Reply, McpError> {
    let mut line = serde_json::to_vec(message).expect("JSON");
    line.push(b'\n');
    let died = |e: std::io::Error| McpError::Transport(format!("the server process is gone: {e}"));
    io.stdin.write_all(&line).await.map_err(died)?;
    io.stdin.flush().await.map_err(died)?;
    let Some(id) = message.get("id") else {
        return Ok(Reply {
            message: None,
            session: None,
        });
    };
    loop {
        let Some(line) = read_line(&mut io.stdout, MAX_MESSAGE_BYTES).await? else {
            return Err(McpError::Transport(
                "the server process closed its stdout without answering".into(),
            ));
        };
        let Ok(incoming) = serde_json::from_slice::<Value>(&line) else {
            continue;
        };
        if incoming.get("id") == Some(id) && incoming.get("method").is_none() {
            if let Some(error) = incoming.get("error") {
                return Err(rpc_error(error));
            }
            return Ok(Reply {
                message: Some(incoming),
                session: None,
            });
        }
        // A request of the server's own (ping, roots, sampling): answered
        // so it does not wait; only ping is served.
        if let (Some(rid), Some(method)) = (incoming.get("id"), incoming.get("method")) {
            let answer = if method == "ping" {
                json!({"jsonrpc": "2.0", "id": rid, "result": {}})
            } else {
                json!({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "not supported by this client"}})
            };
            let mut out = serde_json::to_vec(&answer).expect("JSON");
            out.push(b'\n');
            io.stdin.write_all(&out).await.map_err(died)?;
        }
    }
}

/// One line of at most `cap` bytes (without its newline); `None` at the
/// end of the stream. A longer line fails: reading stops there.
async fn read_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    cap: usize,
) -> Result<Option<Vec<u8>>, McpError> {
    let mut line = Vec::new();
    loop {
        let buf = r
            .fill_buf()
            .await
            .map_err(|e| McpError::Transport(format!("reading the server's stdout failed: {e}")))?;
        if buf.is_empty() {
            return Ok((!line.is_empty()).then_some(line));
        }
        let (take, end) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i, true),
            None => (buf.len(), false),
        };
        if line.len() + take > cap {
            return Err(McpError::Transport(
                crate::http::TooLarge::Streamed.describe("an MCP server's message", cap),
            ));
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take + usize::from(end));
        if end {
            return Ok(Some(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_bounded() {
        let mut r: &[u8] = b"{\"a\":1}\n0123456789abcdef\n";
        assert_eq!(read_line(&mut r, 10).await.unwrap().unwrap(), b"{\"a\":1}");
        assert!(read_line(&mut r, 10).await.is_err());
    }
}
