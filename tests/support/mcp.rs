//! The real MCP server of the tests (tests/mcp/server.py, the official
//! Python SDK): its interpreter from the venv tests/mcp/install makes (once,
//! pinned), served over HTTP on loopback or named as a stdio command.
//! Standalone tests include this file with `#[path]`; cluster tests reach
//! it as `support::mcp`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The server script.
pub fn script() -> PathBuf {
    repo().join("tests/mcp/server.py")
}

/// The venv's python, made by tests/mcp/install if missing (it needs PyPI
/// once; later runs reuse the cache).
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let out = Command::new(repo().join("tests/mcp/install"))
                .stderr(Stdio::inherit())
                .output()
                .expect("tests/mcp/install runs");
            assert!(
                out.status.success(),
                "tests/mcp/install failed (it installs the MCP Python SDK into a venv)"
            );
            PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
        })
        .clone()
}

/// The argv that starts the server on stdio.
pub fn stdio_command() -> Vec<String> {
    vec![
        python().display().to_string(),
        script().display().to_string(),
        "stdio".into(),
    ]
}

/// A server on a loopback port, killed on drop.
pub struct McpServer {
    child: Child,
    pub port: u16,
    /// Where it logs every call (JSON lines), with its revision and headers.
    pub calls: PathBuf,
    log: PathBuf,
    /// Where the log went on once the readiness probe was answered: the
    /// probe's own session is not the test's traffic.
    log_from: usize,
}

impl McpServer {
    /// `server.py http` with `flags` (`--json`, `--legacy`), up and
    /// answering MCP requests.
    pub fn start(name: &str, flags: &[&str]) -> McpServer {
        Self::start_with_env(name, flags, &[])
    }

    /// [`McpServer::start`] with more environment variables for the server
    /// (`MCP_NOT_READY_MS`, `MCP_TASK_POLL_MS`).
    pub fn start_with_env(name: &str, flags: &[&str], env: &[(&str, &str)]) -> McpServer {
        // Files named by this process and a counter, not by the port: the
        // port is known only once the server has bound it.
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        let stem = format!("agents-mcp-{name}-{}-{n}", std::process::id());
        let dir = std::env::temp_dir();
        let calls = dir.join(format!("{stem}.calls"));
        let log = dir.join(format!("{stem}.log"));
        let port_file = dir.join(format!("{stem}.port"));
        let _ = std::fs::remove_file(&calls);
        let _ = std::fs::remove_file(&port_file);
        let child = Command::new(python())
            .arg(script())
            .args(["http", "--port", "0"])
            .args(flags)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("MCP_CALL_LOG", &calls)
            .env("MCP_PORT_FILE", &port_file)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("the MCP server starts");
        let mut server = McpServer {
            child,
            port: 0,
            calls,
            log,
            log_from: 0,
        };
        server.port = server.wait_for_its_port(&port_file, READY_WITHIN);
        let _ = std::fs::remove_file(&port_file);
        server.wait_until_it_answers(READY_WITHIN);
        // The probe's session is logged as it is made; wait (briefly) for
        // that line so it falls before the test's part of the log.
        let logged = Instant::now() + Duration::from_secs(1);
        while !server.log_text().contains("session ID") && Instant::now() < logged {
            std::thread::sleep(Duration::from_millis(20));
        }
        server.log_from = server.log_text().len();
        server
    }

    /// The port the server bound (it binds port 0 and writes the port it
    /// got to `port_file`, so no other process can hold it).
    fn wait_for_its_port(&mut self, port_file: &Path, within: Duration) -> u16 {
        let deadline = Instant::now() + within;
        loop {
            if let Some(port) = std::fs::read_to_string(port_file)
                .ok()
                .and_then(|text| text.trim().parse().ok())
            {
                return port;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the MCP server exited ({status}) before it bound a port: {}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the MCP server did not bind a port within {within:?}; its log: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Returns once the server answers an MCP `initialize` as this test
    /// server does: an open port alone may be a server still starting, or
    /// another process that took the port after it was chosen.
    fn wait_until_it_answers(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let last = match answers_initialize(self.port) {
                Ok(()) => return,
                Err(why) => why,
            };
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the MCP server on port {} exited ({status}) before it answered: {}",
                    self.port,
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the MCP server on port {} did not answer an MCP initialize request within \
                 {within:?} (last: {last}); its log: {}",
                self.port,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// The calls it served, in order.
    pub fn calls(&self) -> Vec<serde_json::Value> {
        read_calls(&self.calls)
    }

    /// What the server logged after it answered the readiness probe.
    pub fn log_text(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.get(self.log_from..).unwrap_or_default().to_string()
    }
}

/// How long a starting server may take to answer (the Python SDK's import
/// takes a few seconds on a loaded machine).
const READY_WITHIN: Duration = Duration::from_secs(30);

/// One MCP `initialize` POSTed to the server on `port`: `Ok` when the
/// answer is this test server's result, else what came back instead.
pub fn answers_initialize(port: u16) -> Result<(), String> {
    let body = r#"{"jsonrpc":"2.0","id":"ready","method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"tests-ready","version":"0"}}}"#;
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(1))
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let ours = answer.starts_with("HTTP/1.1 200")
        && answer.contains(r#""id":"ready""#)
        && answer.contains(r#""serverInfo":{"name":"agents-test-mcp""#);
    if ours {
        Ok(())
    } else {
        Err(format!(
            "{:?}",
            answer.chars().take(200).collect::<String>()
        ))
    }
}

/// The JSON lines of a call log.
pub fn read_calls(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.calls);
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}
