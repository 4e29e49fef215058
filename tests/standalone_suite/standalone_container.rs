//! Container tools standalone (issue 12): a tool with an image runs in
//! podman or docker, hardened like the Job's pod, and never on the host.
//!
//! The tests that run containers need an engine that runs images here: the
//! test cluster's busybox archive, built if missing and loaded into the
//! engine's storage by `support::podman_busybox`. Without an engine they are
//! skipped with a message, or fail under AGENTS_REQUIRE_CLUSTER=1. The tests
//! of "no engine" always run.

use crate::support;

use agents::core::envelope::{CallEnvelope, ContextSnapshot};
use agents::core::policy::EnvVarSpec;
use agents::core::{
    AppliedPolicy, CallId, ContinuationToken, IsolationSpec, SessionId, ToolCall, ToolResult,
};
use agents::runner::container::{container_name, ContainerRunner, Engine};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use support::engine_cmd;
use support::scratch::*;

const IMAGE: &str = support::BUSYBOX_IMAGE;

/// The engine the runner picks, once busybox is loaded and runs (the
/// support helper builds and loads the image; nothing from an earlier run
/// or another test is needed); `None` (with the reason printed) when this
/// machine cannot run containers, a failure under AGENTS_REQUIRE_CLUSTER=1.
fn engine() -> Option<Engine> {
    support::podman_busybox_or_skip()
}

/// Containers of that exact name, running or not.
fn containers_named(engine: &Engine, name: &str) -> Vec<String> {
    let out = engine_cmd(
        engine,
        &[
            "ps",
            "-a",
            "--filter",
            &format!("name=^{name}$"),
            "--format",
            "{{.Names}}",
        ],
    );
    assert!(out.status.success(), "ps: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}{}x{nanos}", std::process::id())
}

fn envelope(token: &str) -> CallEnvelope {
    CallEnvelope::new(
        ContinuationToken(token.into()),
        ToolCall {
            model_call_id: "m".into(),
            name: "probe".into(),
            arguments: r#"{"note":"$(touch /tmp/pwned)"}"#.into(),
        },
        ContextSnapshot {
            session: SessionId("s".into()),
            turn: 1,
            call_id: CallId::new(1, 0),
            agent: None,
            idempotency_key: "s/t1-c0".into(),
            params: BTreeMap::new(),
            call_stack: Vec::new(),
        },
        AppliedPolicy::default(),
    )
}

fn sh(script: &str) -> IsolationSpec {
    IsolationSpec {
        image: IMAGE.into(),
        command: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

fn text(result: &ToolResult) -> String {
    match result {
        ToolResult::Success { response } => response.to_model_text(),
        other => panic!("expected success, got {other:?}"),
    }
}

#[tokio::test]
async fn the_envelope_arrives_on_stdin_and_stdout_is_the_result() {
    let Some(_) = engine() else { return };
    let env = envelope(&unique("stdin-t1-c"));
    let out = ContainerRunner::default()
        .run(&env, &sh("cat"), 1, Duration::from_secs(60))
        .await;
    let echoed = CallEnvelope::parse(&text(&out.result)).expect("the envelope came back");
    assert_eq!(echoed, env);
}

/// A tool that never reads its stdin and exits at once: podman's attach
/// drops such a container's output in a few runs out of a hundred (podman
/// 4.3), so the runner reads the container's log instead. 40 runs, each of
/// which must return its output and stderr, and leave no container.
#[tokio::test]
async fn a_tool_that_ignores_its_stdin_and_exits_at_once_still_returns_its_output() {
    let Some(engine) = engine() else { return };
    let runner = ContainerRunner::default();
    let mut lost = Vec::new();
    for i in 0..40 {
        let token = unique(&format!("quick{i}-t1-c"));
        let env = envelope(&token);
        let out = runner
            .run(
                &env,
                &sh("echo quick-ok; echo also-err >&2"),
                1,
                Duration::from_secs(60),
            )
            .await;
        let got = match &out.result {
            ToolResult::Success { response } => response.to_model_text(),
            other => format!("{other:?}"),
        };
        if got.trim() != "quick-ok" || !out.stderr.contains("also-err") {
            lost.push((i, got, out.stderr.clone()));
        }
        assert!(
            containers_named(&engine, &container_name(&token, 1)).is_empty(),
            "run {i} left its container"
        );
    }
    assert!(lost.is_empty(), "runs that lost their output: {lost:?}");
}

#[tokio::test]
async fn the_container_is_hardened() {
    let Some(_) = engine() else { return };
    let host_file = std::env::temp_dir().join(unique("agents-host-file-"));
    std::fs::write(&host_file, "host secret").unwrap();
    let script = format!(
        "cat >/dev/null; echo uid=$(id -u); \
         echo ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ,); \
         if touch /rootfs-probe 2>/dev/null; then echo root=writable; else echo root=readonly; fi; \
         if touch /tmp/ok; then echo tmp=writable; fi; \
         if test -e {host}; then echo host=visible; else echo host=hidden; fi; \
         if wget -q -T 3 -O- http://10.0.2.2/ 2>/dev/null; then echo net=yes; else echo net=no; fi",
        host = host_file.display()
    );
    let out = ContainerRunner::default()
        .run(
            &envelope(&unique("hard-t1-c")),
            &sh(&script),
            1,
            Duration::from_secs(60),
        )
        .await;
    let t = text(&out.result);
    std::fs::remove_file(&host_file).unwrap();
    for want in [
        "uid=65532",
        "ifaces=lo,",
        "root=readonly",
        "tmp=writable",
        "host=hidden",
        "net=no",
    ] {
        assert!(t.lines().any(|l| l == want), "{want:?} not in:\n{t}");
    }
}

#[tokio::test]
async fn the_tool_gets_only_the_variables_it_names() {
    let Some(_) = engine() else { return };
    // `env` itself, no shell: the output is exactly the environment.
    let spec = IsolationSpec {
        image: IMAGE.into(),
        command: vec!["env".into()],
        env: vec![EnvVarSpec {
            name: "GREETING".into(),
            value: Some("hello there".into()),
            ..Default::default()
        }],
        ..Default::default()
    };
    let token = unique("env-t1-c");
    let out = ContainerRunner::default()
        .run(&envelope(&token), &spec, 1, Duration::from_secs(60))
        .await;
    let t = text(&out.result);
    let vars: BTreeMap<&str, &str> = t.lines().filter_map(|l| l.split_once('=')).collect();
    // The engine adds PATH, HOSTNAME, TERM and `container`; nothing of
    // this test process's environment (CARGO_*, HOME=/root, ...) arrives.
    let allowed = [
        "AGENTS_ENVELOPE_VERSION",
        "AGENTS_TOKEN",
        "GREETING",
        "HOME",
        "HOSTNAME",
        "LANG",
        "PATH",
        "TERM",
        "container",
    ];
    for k in vars.keys() {
        assert!(allowed.contains(k), "{k} reached the tool:\n{t}");
    }
    assert_eq!(vars["GREETING"], "hello there");
    assert_eq!(vars["AGENTS_TOKEN"], token);
    assert_eq!(vars["HOME"], "/tmp");
}

#[tokio::test]
async fn a_timeout_removes_the_container() {
    let Some(engine) = engine() else { return };
    let token = unique("slow-t1-c");
    let started = Instant::now();
    let out = ContainerRunner::default()
        .run(
            &envelope(&token),
            &sh("sleep 300"),
            1,
            Duration::from_secs(3),
        )
        .await;
    assert!(out.timed_out, "{out:?}");
    assert!(
        matches!(&out.result, ToolResult::Error { message } if message.contains("timed out")),
        "{out:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    let name = container_name(&token, 1);
    assert_eq!(containers_named(&engine, &name), Vec::<String>::new());
}

#[tokio::test]
async fn a_leftover_container_of_a_killed_worker_is_removed_before_the_attempt() {
    let Some(engine) = engine() else { return };
    let token = unique("left-t1-c");
    let name = container_name(&token, 1);
    // What a SIGKILLed worker leaves: its container, still running.
    let started = engine_cmd(
        &engine,
        &[
            "run",
            "-d",
            "--name",
            &name,
            "--pull=never",
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:4096",
            "--ulimit",
            "nproc=1024:2048",
            IMAGE,
            "sleep",
            "300",
        ],
    );
    assert!(started.status.success(), "{started:?}");
    assert_eq!(
        containers_named(&engine, &name),
        std::slice::from_ref(&name)
    );
    let out = ContainerRunner::default()
        .run(
            &envelope(&token),
            &sh("cat >/dev/null; echo fresh"),
            1,
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(text(&out.result), "fresh");
    // The old run is gone too: exactly one run of the attempt remained.
    assert_eq!(containers_named(&engine, &name), Vec::<String>::new());
}

#[tokio::test]
async fn a_missing_image_is_an_error_that_says_to_load_it() {
    let Some(_) = engine() else { return };
    let spec = IsolationSpec {
        image: "agents.local/no-such-image:never".into(),
        command: vec!["true".into()],
        ..Default::default()
    };
    let out = ContainerRunner::default()
        .run(
            &envelope(&unique("noimg-t1-c")),
            &spec,
            1,
            Duration::from_secs(60),
        )
        .await;
    assert!(
        matches!(&out.result, ToolResult::Error { message } if message.contains("never pulled")),
        "{out:?}"
    );
}

#[tokio::test]
async fn without_an_engine_the_call_fails_and_nothing_runs_on_the_host() {
    let marker = std::env::temp_dir().join(unique("agents-host-run-"));
    let spec = IsolationSpec {
        image: IMAGE.into(),
        command: vec!["/bin/touch".into(), marker.display().to_string()],
        ..Default::default()
    };
    for choice in ["none", "/nonexistent/podman", "rkt"] {
        let out = ContainerRunner::with_engine(Some(choice.into()))
            .run(
                &envelope(&unique("none-t1-c")),
                &spec,
                1,
                Duration::from_secs(10),
            )
            .await;
        let ToolResult::Error { message } = &out.result else {
            panic!("{choice}: {out:?}")
        };
        assert!(
            message.contains("Install podman or docker")
                && message.contains("remove `image`")
                && message.contains(IMAGE),
            "{choice}: {message}"
        );
        assert!(!marker.exists(), "{choice}: the tool ran on the host");
    }
}

/// The CLI worker, with a PATH that holds no engine: the stored result is
/// the clear error, and the command did not run on the host.
#[test]
fn run_isolated_without_an_engine_on_path_stores_the_error() {
    let s = Scratch::new("noengine");
    let marker = s.path("ran-on-host");
    let yaml = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: boxed}}
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
          image: {IMAGE}
          command: ["/bin/touch", "{}"]
"#,
        marker.display()
    );
    let file = s.write("s.yaml", &yaml);
    s.run(&["run", "-f", file.to_str().unwrap()]).ok();
    let empty = s.path("empty-bin");
    std::fs::create_dir_all(&empty).unwrap();
    let out = s
        .cmd(&["session", "run-isolated", "boxed"])
        .env("PATH", &empty)
        .env_remove("AGENTS_CONTAINER_ENGINE")
        .output()
        .unwrap();
    let worker = Run::from(out, &["session", "run-isolated", "boxed"]);
    let printed = worker.ok();
    assert!(printed.contains("probe [container]"), "{printed}");
    let shown = s.run(&["session", "show", "boxed", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(shown.ok()).unwrap();
    let result = v["continuations"][0]["result"].to_string();
    assert!(
        result.contains("no container engine") && result.contains("Install podman or docker"),
        "{result}"
    );
    assert!(!marker.exists(), "the tool ran on the host");
}

/// The same flow with an engine: the worker runs the call in a container
/// and the model's next turn sees its output; the worker's keys stay out.
#[test]
fn run_isolated_runs_an_image_tool_in_a_container() {
    let Some(_) = engine() else { return };
    let s = Scratch::new("boxed");
    let name = unique("boxed");
    let yaml = format!(
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
          image: {IMAGE}
          command: ["/bin/sh", "-c", "cat >/dev/null; echo in-box uid=$(id -u); env"]
"#
    );
    let file = s.write("s.yaml", &yaml);
    s.run(&["run", "-f", file.to_str().unwrap()]).ok();
    let out = s
        .cmd(&["session", "run-isolated", &name])
        .env("OPENAI_API_KEY", "sk-must-not-leak")
        .output()
        .unwrap();
    let worker = Run::from(out, &["session", "run-isolated", &name]);
    assert!(
        worker.ok().contains("probe [container]"),
        "{}",
        worker.stdout
    );
    let shown = s.run(&["session", "show", &name, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(shown.ok()).unwrap();
    let result = v["continuations"][0]["result"].to_string();
    assert!(result.contains("in-box uid=65532"), "{result}");
    assert!(!result.contains("sk-must-not-leak"), "{result}");
    let resumed = s.run(&["session", "resume", &name]);
    assert!(resumed.ok().contains("succeeded"), "{}", resumed.stdout);
}

/// A worker SIGKILLed mid-run leaves its container behind (the engine's
/// monitor keeps it); the next worker removes it before its own attempt,
/// so the call has exactly one run going and one result.
#[test]
fn a_worker_killed_mid_run_leaves_one_run_of_the_call() {
    let Some(engine) = engine() else { return };
    let s = Scratch::new("killed");
    let name = unique("killed");
    let yaml = format!(
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
          image: {IMAGE}
          command: ["/bin/sh", "-c", "cat >/dev/null; sleep 5; echo finished"]
"#
    );
    let file = s.write("s.yaml", &yaml);
    s.run(&["run", "-f", file.to_str().unwrap()]).ok();
    let mut worker = s.spawn(&["session", "run-isolated", &name]);
    let prefix = format!("agents-{name}-t1-c0-a");
    let running = |engine: &Engine| -> Vec<String> {
        let out = engine_cmd(
            engine,
            &[
                "ps",
                "-a",
                "--filter",
                &format!("name=^{prefix}"),
                "--format",
                "{{.Names}}",
            ],
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while running(&engine).is_empty() {
        assert!(Instant::now() < deadline, "the container never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    // SIGKILL: no way out for the worker, its container stays.
    worker.kill().unwrap();
    worker.wait().unwrap();
    let left = running(&engine);
    assert_eq!(left.len(), 1, "{left:?}");
    let again = s.run(&["session", "run-isolated", &name]);
    assert!(again.ok().contains("probe [container]"), "{}", again.stdout);
    let shown = s.run(&["session", "show", &name, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(shown.ok()).unwrap();
    let result = v["continuations"][0]["result"].to_string();
    assert!(result.contains("finished"), "{result}");
    assert_eq!(
        running(&engine),
        Vec::<String>::new(),
        "a container remains"
    );
}

/// What the hardening refuses is the tool's failure, and it reaches the
/// session as an error result (so the model's next turn sees it).
#[test]
fn refused_writes_and_network_are_errors_the_model_sees() {
    let Some(_) = engine() else { return };
    for (what, script, needle) in [
        (
            "root",
            "cat >/dev/null; echo x > /etc/agents-probe",
            "Read-only file system",
        ),
        (
            "net",
            "cat >/dev/null; wget -q -T 3 -O- http://10.0.2.2/",
            "exit status",
        ),
    ] {
        let s = Scratch::new("refused");
        let name = unique(&format!("refused-{what}"));
        let yaml = format!(
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
          image: {IMAGE}
          command: ["/bin/sh", "-c", {script:?}]
"#
        );
        let file = s.write("s.yaml", &yaml);
        s.run(&["run", "-f", file.to_str().unwrap()]).ok();
        s.run(&["session", "run-isolated", &name]).ok();
        let shown = s.run(&["session", "show", &name, "-o", "json"]);
        let v: serde_json::Value = serde_json::from_str(shown.ok()).unwrap();
        let result = v["continuations"][0]["result"].to_string();
        assert!(
            result.contains("error") && result.contains(needle),
            "{what}: {result}"
        );
        let resumed = s.run(&["session", "resume", &name]);
        assert!(resumed.ok().contains("succeeded"), "{}", resumed.stdout);
    }
}
