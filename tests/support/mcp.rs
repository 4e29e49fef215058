//! The real MCP server of the tests (tests/mcp/server.py, the official
//! Python SDK): its interpreter from the venv tests/mcp/install makes (once,
//! pinned), served over HTTP on loopback or named as a stdio command.
//! Standalone tests include this file with `#[path]`; cluster tests reach
//! it as `support::mcp`.
#![allow(dead_code)]

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
}

impl McpServer {
    /// `server.py http` with `flags` (`--json`, `--legacy`), up and listening.
    pub fn start(name: &str, flags: &[&str]) -> McpServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir();
        let calls = dir.join(format!("agents-mcp-{name}-{port}.calls"));
        let log = dir.join(format!("agents-mcp-{name}-{port}.log"));
        let _ = std::fs::remove_file(&calls);
        let child = Command::new(python())
            .arg(script())
            .args(["http", "--port", &port.to_string()])
            .args(flags)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("MCP_CALL_LOG", &calls)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("the MCP server starts");
        let server = McpServer {
            child,
            port,
            calls,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the MCP server did not listen on {port}: {}",
                std::fs::read_to_string(&server.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// The calls it served, in order.
    pub fn calls(&self) -> Vec<serde_json::Value> {
        read_calls(&self.calls)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
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
