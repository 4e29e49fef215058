//! A scratch directory per test (removed on drop, kept when the test
//! fails) and the built `agents` binary run in it as a user would run it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub const AGENTS: &str = env!("CARGO_BIN_EXE_agents");

/// A fresh directory under the system temp dir, removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    pub fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = std::env::temp_dir().join(format!(
            "agents-{name}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch { dir }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.path(rel);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// `agents ARGS` in this directory (so the default store is `./agents.db`).
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(AGENTS);
        c.args(args)
            .current_dir(&self.dir)
            .env_remove("AGENTS_STORE")
            .env("USER", "tester")
            .stdin(Stdio::null());
        c
    }

    pub fn run(&self, args: &[&str]) -> Run {
        let out = self.cmd(args).output().expect("agents runs");
        Run::from(out, args)
    }

    pub fn spawn(&self, args: &[&str]) -> Child {
        self.cmd(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("agents starts")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub args: String,
}

impl Run {
    pub fn from(out: Output, args: &[&str]) -> Self {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            args: args.join(" "),
        }
    }

    /// Asserts exit 0 and returns stdout.
    #[track_caller]
    pub fn ok(&self) -> &str {
        assert_eq!(
            self.code, 0,
            "`agents {}` failed:\n--- stdout\n{}\n--- stderr\n{}",
            self.args, self.stdout, self.stderr
        );
        &self.stdout
    }

    #[track_caller]
    pub fn fails_with(&self, needle: &str) -> &str {
        assert_ne!(
            self.code, 0,
            "`agents {}` should fail:\n{}",
            self.args, self.stdout
        );
        assert!(
            self.stderr.contains(needle),
            "`agents {}`: stderr lacks {needle:?}:\n{}",
            self.args,
            self.stderr
        );
        &self.stderr
    }
}

pub fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}
