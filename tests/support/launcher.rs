//! The operator as a child process: its own loopback metrics port, a log
//! file (kept when the test fails), a clean environment (only what the
//! test passes), killed on drop.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A free loopback port for a child process to bind, handed out once per
/// test process and taken below the kernel's ephemeral range (32768 up):
/// a port from `bind(0)`, released for the child, could be handed again to
/// the next test that asks, or taken by an outgoing connection, before the
/// child binds it, and two tests would then share one server.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    const SPAN: u32 = 22_000;
    // Each process starts at its own place, so test binaries run side by
    // side do not walk the same ports.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FIRST}..{}", FIRST + SPAN);
}

pub struct Operator {
    pub child: Child,
    pub metrics: u16,
    pub log: PathBuf,
}

impl Operator {
    /// `agents operator ARGS` with KUBECONFIG, RUST_LOG, and `env` only.
    pub fn start(
        bin: &str,
        name: &str,
        kubeconfig: &Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> Operator {
        assert_scoped_beside_others(args);
        let metrics = free_port();
        let log = std::env::temp_dir().join(format!("agents-operator-{name}.log"));
        let mut cmd = Command::new(bin);
        cmd.arg("operator")
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            .args(args)
            .env_clear()
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .env("NO_PROXY", "")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Operator {
            child: cmd.spawn().unwrap(),
            metrics,
            log,
        }
    }

    /// An operator of `bin` watching namespace `ns` only, on the test
    /// cluster, its log named by `ns` and `tag`.
    #[allow(dead_code)]
    pub fn watching(bin: &str, ns: &str, tag: &str) -> Operator {
        let kubeconfig = super::kubeconfig_path().expect("the test cluster's kubeconfig");
        let name = format!("{ns}-{tag}");
        Operator::start(bin, &name, &kubeconfig, &["-n", ns], &[])
    }

    /// GET `path` on the metrics port: (status, body).
    pub fn probe(&self, path: &str) -> (u16, String) {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.metrics)) else {
            return (0, "not listening".into());
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        );
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        (code, body)
    }

    /// SIGKILL, by PID (`Child::kill` sends SIGKILL on Unix), and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

/// Tests in `cluster_suite` run side by side: an operator there that
/// served every namespace would step the other tests' sessions with its
/// own flags. Such tests belong in `cluster_exclusive`.
fn assert_scoped_beside_others(args: &[&str]) {
    let binary = std::env::current_exe().unwrap_or_default();
    let shared = binary
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("cluster_suite"));
    let scoped = args
        .iter()
        .any(|a| matches!(*a, "-n" | "--namespace") || a.starts_with("--namespace="));
    assert!(
        !shared || scoped,
        "an operator started in cluster_suite must watch its test's namespaces (-n NS): \
         one watching all of them steps the other tests' sessions; move the test to \
         cluster_exclusive if it needs all namespaces"
    );
}

impl Drop for Operator {
    /// Kills the operator; its log stays only when the test failed, to be
    /// read (a passing run leaves nothing in the temporary directory).
    fn drop(&mut self) {
        self.kill();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}
