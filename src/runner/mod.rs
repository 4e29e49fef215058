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
//! - The child gets a clean environment: `PATH` ([`SAFE_PATH`]), `HOME` (a
//!   scratch directory made for this run and removed after it), `LANG`,
//!   `AGENTS_TOKEN`, `AGENTS_ENVELOPE_VERSION`, plus exactly the variables
//!   its definition names ([`IsolationSpec::env`]). Nothing is inherited
//!   from the worker, whose environment holds the model's API key.
//! - The child runs in its own process group, which is killed on every way
//!   out of [`ProcessRunner::run`]: exit, timeout, error, or the future
//!   being dropped. If the worker itself is killed (SIGKILL leaves no way
//!   out), the kernel kills the child (`PR_SET_PDEATHSIG`). That signal
//!   follows the *thread* that spawned the child: `run` spawns from the
//!   thread polling it, which must live as long as the call. Tokio's
//!   runtime threads (current-thread or worker threads) do; do not call
//!   `run` from `spawn_blocking` or a short-lived thread, whose exit would
//!   kill the tool. The tool's own children do not inherit the signal;
//!   they die with the group on every exit path except a SIGKILLed worker.
//!
//! The child-process harness (envelope on stdin, capped reads, group kill,
//! timeout, reading the answer) is `harness`, shared with the container
//! runner and the Job's in-pod wrapper; what the wrapper reports, and how
//! the Job runner reads it, is [`wrapper_protocol`].

pub mod container;
#[cfg(test)]
pub(crate) mod fixtures;
pub(crate) mod harness;
pub mod job;
pub mod wrapper_protocol;

use crate::core::envelope::{CallEnvelope, ENVELOPE_VERSION};
use crate::core::{IsolationSpec, ToolResult};
use harness::{interpret, Captured, Ended, Exchange, Options, Stopped};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};
use tokio::process::Command;

/// `PATH` of every tool process: system directories only, never the
/// worker's own `PATH` (which may point into a user's home).
pub const SAFE_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Variables the runner sets itself; a definition cannot replace them.
const RESERVED: &[&str] = &["AGENTS_TOKEN", "AGENTS_ENVELOPE_VERSION"];

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
    /// Extra variables for every child, set by the program that embeds the
    /// runner (e.g. `PATH` in tests); never copied from its environment.
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
    /// The whole environment of a tool process (see the module docs).
    /// `lookup` reads the worker's environment, and is asked only for the
    /// secrets the definition names.
    pub fn tool_env(
        &self,
        envelope: &CallEnvelope,
        spec: &IsolationSpec,
        home: &Path,
        lookup: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> Result<Vec<(String, String)>, String> {
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), SAFE_PATH.into()),
            ("HOME".into(), home.display().to_string()),
            ("LANG".into(), "C.UTF-8".into()),
        ];
        for (k, v) in &self.env {
            set_var(&mut env, k, v.clone());
        }
        with_tool_vars(env, envelope, spec, lookup, false)
    }

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
        let home = match ScratchHome::create() {
            Ok(h) => h,
            Err(e) => return failed(started, format!("cannot create the tool's HOME: {e}")),
        };
        let env = match self.tool_env(envelope, spec, &home.0, &|k| std::env::var(k).ok()) {
            Ok(env) => env,
            Err(e) => return failed(started, e),
        };
        let mut cmd = Command::new(program);
        cmd.args(rest).env_clear().envs(env);
        // The group dies with the tool, on a timeout and when this future
        // is dropped mid-run; the tool dies with this thread.
        let tool = match harness::spawn(&mut cmd, Options::HOST_TOOL) {
            Ok(t) => t,
            Err(e) => return failed(started, format!("cannot start {program:?}: {e}")),
        };
        let ended = tool.exchange(exchange(envelope, timeout)).await;
        let outcome = ProcessOutcome::of(
            started,
            ended,
            || {
                format!(
                    "timed out after {}s; the process was killed",
                    timeout.as_secs_f64()
                )
            },
            |status, stdout, stderr| match status {
                Err(e) => ToolResult::error(format!("waiting for {program:?}: {e}")),
                Ok(s) => interpret(envelope, s.success(), s.code(), stdout, stderr),
            },
        );
        drop(home);
        outcome
    }
}

/// The conversation of the process and container runners: both outputs
/// captured up to [`MAX_CAPTURE_BYTES`], no signals to forward, `timeout`
/// for the whole run.
fn exchange(envelope: &CallEnvelope, timeout: Duration) -> Exchange<'_, Captured> {
    Exchange {
        envelope,
        stdout_cap: MAX_CAPTURE_BYTES,
        stderr: Captured::new(MAX_CAPTURE_BYTES),
        signals: &mut [],
        timeout: Some(timeout),
        drain: None,
    }
}

impl ProcessOutcome {
    /// The outcome of a run: `judge` reads the exit status and output of
    /// an ended child; a stopped one timed out (`timed_out` says how it
    /// was ended).
    fn of(
        started: Instant,
        ended: Result<Ended<Captured>, Stopped>,
        timed_out: impl FnOnce() -> String,
        judge: impl FnOnce(&std::io::Result<ExitStatus>, &str, &str) -> ToolResult,
    ) -> Self {
        match ended {
            Ok(ended) => {
                let (stdout, stderr) = (ended.stdout.text(), ended.stderr.text());
                ProcessOutcome {
                    result: judge(&ended.status, &stdout, &stderr),
                    exit_code: ended.exit_code(),
                    stdout,
                    stderr,
                    timed_out: false,
                    elapsed: started.elapsed(),
                }
            }
            Err(_) => ProcessOutcome {
                timed_out: true,
                ..failed(started, timed_out())
            },
        }
    }
}

/// Sets `name` in `env`, replacing an earlier value.
fn set_var(env: &mut Vec<(String, String)>, name: &str, value: String) {
    env.retain(|(k, _)| k != name);
    env.push((name.to_string(), value));
}

/// `Err` (the message for the model) when `name` may not be a tool's
/// variable: not a name (`strict`: also when it holds white space), or one
/// the runner sets itself.
fn check_var_name(name: &str, strict: bool) -> Result<(), String> {
    let invalid = name.is_empty()
        || name.contains(['=', '\0'])
        || (strict && name.chars().any(char::is_whitespace));
    if invalid {
        return Err(format!(
            "the tool's env has an invalid variable name {name:?}"
        ));
    }
    if RESERVED.contains(&name) {
        return Err(format!(
            "the tool's env sets {name}, which the runner sets itself; remove it"
        ));
    }
    Ok(())
}

/// `env` (the runner's fixed set), then the variables the tool's definition
/// names (values resolved by `lookup`, secrets included), then the
/// runner's own ([`runner_vars`]); a later variable replaces an earlier one
/// of the same name.
fn with_tool_vars(
    mut env: Vec<(String, String)>,
    envelope: &CallEnvelope,
    spec: &IsolationSpec,
    lookup: &(dyn Fn(&str) -> Option<String> + Sync),
    strict: bool,
) -> Result<Vec<(String, String)>, String> {
    for var in &spec.env {
        let name = &var.name;
        check_var_name(name, strict)?;
        let value = var
            .resolve(lookup)
            .map_err(|e| format!("the tool's env: {e}"))?;
        if value.contains('\0') {
            return Err(format!(
                "the tool's env: the value of {name} holds a NUL byte"
            ));
        }
        set_var(&mut env, name, value);
    }
    for (name, value) in runner_vars(envelope) {
        set_var(&mut env, name, value);
    }
    Ok(env)
}

/// The variables every runner gives a tool itself: the call's token and
/// the envelope version.
pub(crate) fn runner_vars(envelope: &CallEnvelope) -> [(&'static str, String); 2] {
    [
        ("AGENTS_TOKEN", envelope.token.as_str().to_string()),
        ("AGENTS_ENVELOPE_VERSION", ENVELOPE_VERSION.to_string()),
    ]
}

/// A private, empty `HOME` for one run, removed afterwards: a tool finds
/// no dotfiles or credentials of the worker's user there.
struct ScratchHome(PathBuf);

const HOME_PREFIX: &str = "agents-tool-home-";

impl ScratchHome {
    fn create() -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(sweep_stale_homes);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "{HOME_PREFIX}{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(ScratchHome(dir))
    }
}

/// A killed worker cannot remove its tools' HOMEs; the next runner in
/// this temp directory does, for every owner pid that no longer runs.
fn sweep_stale_homes() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(HOME_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<i32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            // Another user's leftovers fail to go (sticky /tmp); fine.
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Drop for ScratchHome {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
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

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::{secret_var, value_var};
    use std::collections::BTreeMap;

    fn envelope(args: &str) -> CallEnvelope {
        fixtures::envelope("s", args)
    }

    /// Runs `spec` for a call with no arguments.
    async fn run(spec: &IsolationSpec, timeout: Option<Duration>) -> ProcessOutcome {
        ProcessRunner::default()
            .run(&envelope("{}"), spec, timeout)
            .await
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
        let out = run(&sh(&good), None).await;
        assert_eq!(out.result, ToolResult::text("ok"));
        let wrong = good.replace("s-t1-c0", "other-t1-c0");
        let out = run(&sh(&wrong), None).await;
        assert!(
            matches!(&out.result, ToolResult::Error { message } if message.contains("token")),
            "{out:?}"
        );
    }

    #[tokio::test]
    async fn failures_carry_stderr_and_timeouts_kill_the_group() {
        let out = run(&sh("echo boom >&2; exit 3"), None).await;
        assert_eq!(
            out.result,
            ToolResult::error("the tool ended with exit status 3: boom")
        );
        let out = run(&sh("sleep 30 & sleep 30"), Some(Duration::from_millis(200))).await;
        assert!(out.timed_out);
        assert!(out.elapsed < Duration::from_secs(5), "{:?}", out.elapsed);
        let out = run(&IsolationSpec::default(), None).await;
        assert!(out.result.is_error());
    }

    /// Gone, or a zombie nobody reaped yet: either way it runs no more.
    pub(crate) fn is_dead(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            // "pid (comm) S ...": the state follows the last ')'.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        }
    }

    async fn read_pid(path: &Path) -> i32 {
        for _ in 0..200 {
            if let Ok(text) = std::fs::read_to_string(path) {
                if let Ok(pid) = text.trim().parse() {
                    return pid;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no pid in {}", path.display());
    }

    async fn dies_soon(pid: i32) -> bool {
        for _ in 0..200 {
            if is_dead(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn pid_file(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "agents-runner-{name}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        let _ = std::fs::remove_file(&p);
        p
    }

    /// `env` itself, no shell: the output is exactly the environment.
    fn print_env() -> IsolationSpec {
        IsolationSpec {
            command: vec!["env".into()],
            env: vec![value_var("GREETING", "hello there")],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_tool_sees_only_the_fixed_set_and_what_its_definition_names() {
        let out = run(&print_env(), None).await;
        let ToolResult::Success { response } = &out.result else {
            panic!("{out:?}")
        };
        let text = response.to_model_text();
        let vars: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(
            vars.keys().copied().collect::<Vec<_>>(),
            [
                "AGENTS_ENVELOPE_VERSION",
                "AGENTS_TOKEN",
                "GREETING",
                "HOME",
                "LANG",
                "PATH"
            ],
            "this test process has many more variables; none may leak:\n{text}"
        );
        assert_eq!(vars["GREETING"], "hello there");
        assert_eq!(vars["PATH"], SAFE_PATH);
        assert_eq!(vars["LANG"], "C.UTF-8");
        assert_eq!(vars["AGENTS_TOKEN"], "s-t1-c0");
        let home = Path::new(vars["HOME"]);
        assert!(home.starts_with(std::env::temp_dir()), "{home:?}");
        assert!(!home.exists(), "the scratch HOME is removed after the run");
    }

    #[tokio::test]
    async fn secrets_come_by_reference_and_the_runners_variables_stay() {
        // A secret comes only by reference, from the worker's environment.
        let with_secret = IsolationSpec {
            env: vec![secret_var("TOKEN", "gh", "token")],
            ..print_env()
        };
        let lookup = |k: &str| (k == "AGENTS_SECRET_GH_TOKEN").then(|| "s3cret".to_string());
        let env = ProcessRunner::default()
            .tool_env(&envelope("{}"), &with_secret, Path::new("/h"), &lookup)
            .unwrap();
        assert!(env.contains(&("TOKEN".into(), "s3cret".into())), "{env:?}");
        let missing = ProcessRunner::default()
            .tool_env(&envelope("{}"), &with_secret, Path::new("/h"), &|_| None)
            .unwrap_err();
        assert!(missing.contains("AGENTS_SECRET_GH_TOKEN"), "{missing}");
        // The runner's own variables cannot be replaced.
        let clash = IsolationSpec {
            env: vec![value_var("AGENTS_TOKEN", "other")],
            ..print_env()
        };
        let out = run(&clash, None).await;
        assert!(
            matches!(&out.result, ToolResult::Error { message } if message.contains("AGENTS_TOKEN")),
            "{out:?}"
        );
    }

    #[tokio::test]
    async fn children_left_behind_die_when_the_tool_exits() {
        let pid_path = pid_file("leftover");
        let script = format!("sleep 30 & echo $! > {}; echo done", pid_path.display());
        let out = run(&sh(&script), Some(Duration::from_secs(20))).await;
        // The background sleep holds stdout: without the group kill the
        // run would wait for it until the timeout.
        assert_eq!(out.result, ToolResult::text("done"), "{out:?}");
        assert!(out.elapsed < Duration::from_secs(5), "{:?}", out.elapsed);
        let pid = read_pid(&pid_path).await;
        assert!(dies_soon(pid).await, "pid {pid} outlived its tool");
        let _ = std::fs::remove_file(&pid_path);
    }

    #[tokio::test]
    async fn dropping_the_run_kills_the_whole_group() {
        let pid_path = pid_file("dropped");
        let script = format!("sleep 30 & echo $! > {}; wait", pid_path.display());
        let spec = sh(&script);
        let runner = ProcessRunner::default();
        let env = envelope("{}");
        tokio::select! {
            _ = runner.run(&env, &spec, None) => panic!("the tool should still run"),
            pid = read_pid(&pid_path) => {
                // Leaving the select drops the run future mid-run.
                let _ = pid;
            }
        }
        let pid = read_pid(&pid_path).await;
        assert!(dies_soon(pid).await, "pid {pid} outlived the dropped run");
        let _ = std::fs::remove_file(&pid_path);
    }

    #[test]
    fn homes_of_workers_that_no_longer_run_are_swept() {
        let mut done = std::process::Command::new("true").spawn().unwrap();
        let dead = done.id();
        done.wait().unwrap();
        let stale = std::env::temp_dir().join(format!("{HOME_PREFIX}{dead}-0-1"));
        let ours = std::env::temp_dir().join(format!("{HOME_PREFIX}{}-999-1", std::process::id()));
        for d in [&stale, &ours] {
            std::fs::create_dir_all(d.join(".config")).unwrap();
        }
        sweep_stale_homes();
        assert!(!stale.exists(), "{stale:?} belongs to a gone worker");
        assert!(ours.exists(), "a running worker's HOME stays");
        std::fs::remove_dir_all(&ours).unwrap();
    }
}
