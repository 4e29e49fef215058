//! Standalone mode as a new user would break it (issue 11): tool
//! environments, killed workers, closed pipes, read-only stores, names.

use crate::support;

use agents::core::envelope::{CallEnvelope, ContextSnapshot};
use agents::core::policy::{EnvVarSpec, SecretKeyRef};
use agents::core::{
    AppliedPolicy, CallId, ContinuationToken, IsolationSpec, SessionId, ToolCall, ToolResult,
};
use agents::runner::ProcessRunner;
use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::scratch::*;

const LLM_KEY: &str = "sk-llm-key-must-not-leak";
const OPENAI_KEY: &str = "sk-openai-key-must-not-leak";

/// A session whose one call runs isolated with `command`, left for
/// `agents session run-isolated`.
fn isolated_session(name: &str, command: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: {name}}}
spec:
  messages: ["go"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: probe, arguments: {{}}}}]
          - text: done
    tools:
      - name: probe
        container:
          command: ["/bin/sh", "-c", {command:?}]
"#
    )
}

fn stored_result(s: &Scratch, session: &str) -> String {
    let shown = s.run(&["session", "show", session, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(shown.ok()).unwrap();
    v["continuations"][0]["result"].to_string()
}

// ---- 1. a tool's environment --------------------------------------------

#[test]
fn an_isolated_tool_never_sees_the_workers_api_keys() {
    let s = Scratch::new("env");
    let file = s.write("s.yaml", &isolated_session("envy", "env"));
    s.run(&["run", "-f", file.to_str().unwrap()]).ok();
    let worker = s
        .cmd(&["session", "run-isolated", "envy"])
        .env("AGENTS_SECRET_LLM_API_KEY", LLM_KEY)
        .env("OPENAI_API_KEY", OPENAI_KEY)
        .output()
        .unwrap();
    let worker = Run::from(worker, &["session", "run-isolated", "envy"]);
    worker.ok();
    let result = stored_result(&s, "envy");
    assert!(result.contains("AGENTS_TOKEN=envy-t1-c0"), "{result}");
    assert!(result.contains("LANG=C.UTF-8"), "{result}");
    for leaked in [
        LLM_KEY,
        OPENAI_KEY,
        "AGENTS_SECRET_",
        "OPENAI_API_KEY",
        "CARGO_",
    ] {
        assert!(
            !result.contains(leaked),
            "{leaked} reached the tool: {result}"
        );
    }
    assert!(!worker.stdout.contains(LLM_KEY) && !worker.stdout.contains(OPENAI_KEY));
}

const PROBE_VAR: &str = "AGENTS_HARDENING_ENV_PROBE";

/// Runs in a child copy of this test binary whose environment holds the
/// keys (see the test below); a no-op in a normal test run.
#[tokio::test]
async fn env_probe_child() {
    if std::env::var_os(PROBE_VAR).is_none() {
        return;
    }
    let envelope = CallEnvelope::new(
        ContinuationToken("p-t1-c0".into()),
        ToolCall {
            model_call_id: "m".into(),
            name: "probe".into(),
            arguments: "{}".into(),
        },
        ContextSnapshot {
            session: SessionId("p".into()),
            turn: 1,
            call_id: CallId::new(1, 0),
            agent: None,
            idempotency_key: "p/t1-c0".into(),
            params: BTreeMap::new(),
            call_stack: Vec::new(),
        },
        AppliedPolicy::default(),
    );
    let spec = IsolationSpec {
        command: vec!["env".into()],
        env: vec![
            EnvVarSpec {
                name: "GREETING".into(),
                value: Some("hello".into()),
                ..Default::default()
            },
            EnvVarSpec {
                name: "TOOL_TOKEN".into(),
                secret: Some(SecretKeyRef {
                    name: "tool".into(),
                    key: "token".into(),
                }),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    let out = ProcessRunner::default().run(&envelope, &spec, None).await;
    let ToolResult::Success { response } = &out.result else {
        panic!("{out:?}")
    };
    println!("PROBE-BEGIN\n{}\nPROBE-END", response.to_model_text());
}

#[test]
fn a_tool_gets_exactly_the_variables_and_secrets_its_definition_names() {
    // The keys sit in the environment of the process that runs the tool.
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            // The test's full name in the standalone_suite binary.
            "standalone_hardening::env_probe_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PROBE_VAR, "1")
        .env("AGENTS_SECRET_LLM_API_KEY", LLM_KEY)
        .env("OPENAI_API_KEY", OPENAI_KEY)
        .env("AGENTS_SECRET_TOOL_TOKEN", "tool-secret")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env = stdout
        .split_once("PROBE-BEGIN\n")
        .and_then(|(_, rest)| rest.split_once("\nPROBE-END"))
        .map(|(env, _)| env)
        .unwrap_or_else(|| panic!("no probe output: {stdout}"));
    let mut names: Vec<&str> = env
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k)
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "AGENTS_ENVELOPE_VERSION",
            "AGENTS_TOKEN",
            "GREETING",
            "HOME",
            "LANG",
            "PATH",
            "TOOL_TOKEN"
        ],
        "{env}"
    );
    assert!(
        env.contains("GREETING=hello\n") && env.contains("TOOL_TOKEN=tool-secret"),
        "{env}"
    );
    assert!(!env.contains(LLM_KEY) && !env.contains(OPENAI_KEY), "{env}");
}

// ---- 2. a tool dies with its worker ---------------------------------------

/// Running, not a zombie waiting to be reaped.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

fn wait_for_pid(path: &std::path::Path) -> i32 {
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return pid;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the tool never wrote {}", path.display());
}

#[test]
fn a_sigkilled_worker_takes_its_tool_along() {
    let s = Scratch::new("pdeathsig");
    let pid_file = s.path("tool.pid");
    let script = format!("echo $$ > {}; exec sleep 60", pid_file.display());
    let file = s.write("s.yaml", &isolated_session("sleepy", &script));
    s.run(&["run", "-f", file.to_str().unwrap()]).ok();
    let mut worker = s.spawn(&["session", "run-isolated", "sleepy"]);
    let tool = wait_for_pid(&pid_file);
    assert!(alive(tool));
    // SAFETY: signals the worker this test started, by its pid.
    unsafe {
        libc::kill(worker.id() as i32, libc::SIGKILL);
    }
    worker.wait().unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    while alive(tool) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let survived = alive(tool);
    if survived {
        // Do not leave it behind (it was started through this test).
        unsafe {
            libc::kill(tool, libc::SIGKILL);
        }
    }
    assert!(!survived, "tool pid {tool} outlived its SIGKILLed worker");
}

// ---- 3. closed pipes ---------------------------------------------------------

/// A pipe whose reading end is already closed: every write gets EPIPE,
/// as with `| head -1` once head has exited.
fn closed_pipe() -> Stdio {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills two fds that we then own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    unsafe {
        drop(OwnedFd::from_raw_fd(fds[0]));
        Stdio::from(OwnedFd::from_raw_fd(fds[1]))
    }
}

#[track_caller]
fn assert_quiet_exit(run: &std::process::Output, code: i32, what: &str) {
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "{what}: {stderr}"
    );
    assert_eq!(run.status.code(), Some(code), "{what}: {stderr}");
}

#[test]
fn a_closed_stdout_or_stderr_never_panics() {
    let s = Scratch::new("pipe");
    let out = s.cmd(&["crds"]).stdout(closed_pipe()).output().unwrap();
    assert_quiet_exit(&out, 0, "agents crds | head -0");
    for args in [&["--help"][..], &["--version"], &["session", "--help"]] {
        let out = s.cmd(args).stdout(closed_pipe()).output().unwrap();
        assert_quiet_exit(&out, 0, &args.join(" "));
    }
    // Errors go to stderr; a closed one must not turn exit 1 into a panic.
    let out = s
        .cmd(&["session", "show", "nope"])
        .stderr(closed_pipe())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn run_show_and_resume_survive_a_closed_stdout() {
    let s = Scratch::new("pipe-run");
    let file = s.write("s.yaml", &isolated_session("piped", "echo ok"));
    let f = file.to_str().unwrap();
    let out = s
        .cmd(&["run", "-f", f])
        .stdout(closed_pipe())
        .output()
        .unwrap();
    assert_quiet_exit(&out, 0, "agents run | head");
    // The drive went on to the end although nobody read its output.
    s.run(&["session", "run-isolated", "piped"]).ok();
    for args in [
        &["session", "resume", "piped"][..],
        &["session", "show", "piped"],
        &["session", "list"],
        &["session", "pending", "piped"],
    ] {
        let out = s.cmd(args).stdout(closed_pipe()).output().unwrap();
        assert_quiet_exit(&out, 0, &args.join(" "));
    }
    assert!(s
        .run(&["session", "show", "piped"])
        .ok()
        .contains("Succeeded"));
}

// ---- 4. a read-only store ---------------------------------------------------

/// `agents ARGS` as a user without write access: `nobody` when the tests
/// run as root (root passes every mode bit), else this user.
/// The binary is copied into the scratch directory first: `nobody` may
/// not reach the build directory (e.g. under /root).
fn as_reader(s: &Scratch, args: &[&str]) -> Run {
    let agents = s.path("agents-bin");
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    let mut cmd = if root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&agents);
        c
    } else {
        Command::new(&agents)
    };
    cmd.args(args)
        .current_dir(&s.dir)
        .env_remove("AGENTS_STORE")
        .stdin(Stdio::null());
    let out = cmd
        .output()
        .expect("agents runs (as root this test needs setpriv, from util-linux)");
    Run::from(out, args)
}

fn chmod(path: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn read_only_store_case(dir_mode: u32, file_mode: u32) {
    let s = Scratch::new("readonly");
    let file = s.write("s.yaml", &isolated_session("ro", "echo ok"));
    s.run(&["run", "-f", file.to_str().unwrap()]).ok();
    std::fs::copy(AGENTS, s.path("agents-bin")).unwrap();
    chmod(&s.path("agents.db"), file_mode);
    chmod(&s.dir, dir_mode);
    let list = as_reader(&s, &["session", "list"]);
    assert!(list.ok().contains("ro "), "{}", list.stdout);
    let show = as_reader(&s, &["session", "show", "ro"]);
    assert!(show.ok().contains("session ro: Waiting"), "{}", show.stdout);
    as_reader(&s, &["session", "pending", "ro"]).ok();
    as_reader(&s, &["session", "pause", "ro"]).fails_with("is read-only for this user");
    as_reader(
        &s,
        &[
            "session", "complete", "ro-t1-c0", "--text", "x", "--by", "x",
        ],
    )
    .fails_with("is read-only for this user");
    // Nothing was created beside the store.
    let names: Vec<_> = std::fs::read_dir(&s.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.ends_with("-shm") || n.ends_with("-wal")),
        "{names:?}"
    );
    chmod(&s.dir, 0o755);
}

#[test]
fn a_store_file_without_write_access_can_be_read() {
    // The directory is writable by anyone; the file by nobody.
    read_only_store_case(0o777, 0o444);
}

#[test]
fn a_store_in_a_directory_without_write_access_can_be_read() {
    // The file is writable by anyone; its directory by nobody.
    read_only_store_case(0o555, 0o666);
}

// ---- 5. names ------------------------------------------------------------------

#[test]
fn bad_names_are_refused_before_anything_runs() {
    let s = Scratch::new("names");
    let evil = "x;touch PWNED;$(touch PWNED2)/../../y";
    let yaml =
        isolated_session("placeholder", "echo ok").replace("placeholder", &format!("'{evil}'"));
    let file = s.write("s.yaml", &yaml);
    let err = s.run(&["run", "-f", file.to_str().unwrap()]);
    let msg = err.fails_with("metadata.name");
    assert!(
        msg.contains(&format!("{evil:?}")) && msg.contains("DNS-1123"),
        "{msg}"
    );
    assert!(!s.path("agents.db").exists(), "nothing is stored");
    for args in [
        &["session", "show", evil][..],
        &["session", "resume", "Upper"],
        &["session", "approve", "a b"],
        &["session", "complete", "x;y", "--text", "t"],
    ] {
        s.run(args).fails_with("DNS-1123");
    }
    assert!(!s.path("PWNED").exists() && !s.path("PWNED2").exists());
    s.run(&[
        "session", "complete", "ok-t1-c0", "--text", "t", "--by", "agents",
    ])
    .fails_with("reserved");
}

// ---- 6. deep nesting -----------------------------------------------------------

/// A Session whose agent's `params` nest `deep`ly.
fn nested_session(params: &str) -> String {
    format!(
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: deep}}\nspec:\n  \
         messages: [go]\n  agent:\n    model: {{provider: scripted}}\n    params:\n{params}\n"
    )
}

#[test]
fn a_file_nested_100000_deep_is_refused_at_once_saying_why() {
    let s = Scratch::new("deep");
    let n = 100_000;
    let flow = format!("      {}{}", "[".repeat(n), "]".repeat(n));
    let dashes = format!("      {}x", "- ".repeat(n));
    // Indentation costs a file its square: fewer levels, still far too many.
    let indented: String = (0..3_000)
        .map(|i| format!("{}k:\n", " ".repeat(6 + i)))
        .collect();
    let json = format!(
        r#"{{"apiVersion": "agents-exe.io/v1alpha1", "kind": "Session", "metadata": {{"name": "deep"}},
            "spec": {{"messages": ["go"], "agent": {{"params": {}1{}}}}}}}"#,
        r#"{"a": "#.repeat(n),
        "}".repeat(n)
    );
    for (name, text) in [
        ("flow.yaml", nested_session(&flow)),
        ("dashes.yaml", nested_session(&dashes)),
        ("indented.yaml", nested_session(&indented)),
        ("deep.json", json),
    ] {
        let file = s.write(name, &text);
        let started = Instant::now();
        let run = s.run(&["run", "-f", file.to_str().unwrap()]);
        let took = started.elapsed();
        let msg = run.fails_with("nested more than 128 levels deep");
        assert!(msg.contains(name) && msg.contains("Flatten it"), "{msg}");
        assert!(
            took < Duration::from_secs(1),
            "{name}: refused after {took:?}"
        );
        assert!(!s.path("agents.db").exists(), "{name}: nothing is stored");
    }
}

// ---- 5. files a person names are read up to a bound --------------------------

/// A definition, an export or a result file is read up to a bound: an
/// endless file is refused at the bound, naming it, and nothing is written.
#[test]
fn an_endless_file_is_refused_at_its_bound() {
    let s = Scratch::new("endless");
    for (args, bound) in [
        (&["run", "-f", "/dev/zero"][..], "larger than 64 MiB"),
        (
            &["session", "import", "-f", "/dev/zero"],
            "larger than 256 MiB",
        ),
        (
            &["session", "replay", "/dev/zero"],
            "neither an export file",
        ),
        (
            &["session", "complete", "x-t1-c0", "/dev/zero"],
            "larger than 16 MiB",
        ),
    ] {
        s.run(args).fails_with(bound);
    }
    let listed = s.run(&["session", "list"]);
    assert!(!listed.ok().contains("x-t1"), "{}", listed.stdout);
}
