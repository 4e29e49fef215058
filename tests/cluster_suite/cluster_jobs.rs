//! Isolated calls as Kubernetes Jobs (`runner::job`), and the wrapper the
//! Jobs run (`agents tool-exec`).
//!
//! The wrapper tests run the real binary locally. The Job tests run on the
//! test cluster (skipped without one unless AGENTS_REQUIRE_CLUSTER=1) with
//! the agents image that `tests/cluster/agents-image` built from the
//! Dockerfile and imported (`support::agents_image`: AGENTS_TEST_AGENTS_IMAGE
//! when `make test` set it, else the script runs for this checkout).

use crate::support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agents::api::Continuation;
use agents::core::envelope::{CallEnvelope, ContextSnapshot, ResultEnvelope};
use agents::core::policy::{EnvVarSpec, SecretKeyRef};
use agents::core::{
    AppliedPolicy, CallId, ContinuationToken, IsolationSpec, SessionId, ToolCall, ToolResult,
};
use agents::engine::ports::{RunKind, RunStatus, RunnerPort};
use agents::runner::job::{
    self, JobDefaults, JobRunner, Message, ANNOTATION_ENVELOPE, ANNOTATION_FAILURE,
    LABEL_CONTINUATION, TOOL_CONTAINER,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;
use support::{TestNamespace, BUSYBOX_IMAGE};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn token(name: &str) -> ContinuationToken {
    ContinuationToken(format!("{name}-t1-c0"))
}

fn envelope(token: &ContinuationToken, arguments: &str) -> CallEnvelope {
    CallEnvelope::new(
        token.clone(),
        ToolCall {
            model_call_id: "call_1".into(),
            name: "tool".into(),
            arguments: arguments.into(),
        },
        ContextSnapshot {
            session: SessionId("s".into()),
            turn: 1,
            call_id: CallId::new(1, 0),
            agent: None,
            idempotency_key: format!("ns/s/uid/{token}"),
            params: BTreeMap::new(),
            call_stack: Vec::new(),
        },
        AppliedPolicy::default(),
    )
}

fn sh(image: &str, script: &str) -> IsolationSpec {
    IsolationSpec {
        image: image.into(),
        command: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

fn text_of(r: &ToolResult) -> String {
    match r {
        ToolResult::Success { response } => response.to_model_text(),
        ToolResult::Error { message } => panic!("expected success, got error: {message}"),
    }
}

fn error_of(r: &ToolResult) -> String {
    match r {
        ToolResult::Error { message } => message.clone(),
        ToolResult::Success { response } => {
            panic!(
                "expected an error, got success: {}",
                response.to_model_text()
            )
        }
    }
}

// ---------------------------------------------------------------------------
// The wrapper, locally: the same binary the pods run.

/// A scratch directory for one run of the wrapper.
struct Scratch(support::scratch::Scratch);

impl Scratch {
    fn new(name: &str) -> Scratch {
        Scratch(support::scratch::Scratch::new(&format!("tool-exec-{name}")))
    }
    fn envelope(&self, env: &CallEnvelope) -> PathBuf {
        self.0
            .write("envelope.json", &serde_json::to_string(env).unwrap())
    }
    fn termination_log(&self) -> PathBuf {
        self.0.path("termination-log")
    }
    fn wrap(&self, env: &CallEnvelope, tool: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(["tool-exec", "--envelope"])
            .arg(self.envelope(env))
            .arg("--termination-log")
            .arg(self.termination_log())
            .arg("--")
            .args(tool);
        c
    }
    fn message(&self) -> String {
        std::fs::read_to_string(self.termination_log()).unwrap()
    }
}

#[test]
fn wrapper_reports_small_results_in_the_termination_message() {
    let s = Scratch::new("small");
    let t = token("w");
    let env = envelope(&t, r#"{"cmd":"$(rm -rf /)","q":"it's \"quoted\""}"#);
    // `cat` echoes the envelope: it arrived on stdin, intact.
    let out = s.wrap(&env, &["cat"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stdout.is_empty(),
        "nothing on stdout for a small result"
    );
    let result = ResultEnvelope::parse_for(&s.message(), &t).unwrap();
    assert_eq!(CallEnvelope::parse(&text_of(&result)).unwrap(), env);
    // stderr is shown (for `kubectl logs`), ending with a newline.
    let out = s
        .wrap(&env, &["/bin/sh", "-c", "printf note >&2; echo ok"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stderr), "note\n");
    assert_eq!(
        ResultEnvelope::parse_for(&s.message(), &t).unwrap(),
        ToolResult::text("ok")
    );
}

#[test]
fn wrapper_puts_large_results_in_a_framed_log_block() {
    let s = Scratch::new("large");
    let t = token("w");
    let out = s
        .wrap(
            &envelope(&t, "{}"),
            &[
                "/bin/sh",
                "-c",
                "head -c 20000 /dev/zero | tr '\\0' x; printf 'no newline' >&2",
            ],
        )
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let Message::InLog(p) = job::read_message(&s.message(), &t) else {
        panic!("expected a pointer, got {}", s.message())
    };
    // The block follows the tool's stderr in the same pipe, so it is the
    // log's last lines whatever order the runtime reads the pipes in.
    assert!(out.stdout.is_empty(), "nothing on stdout: {:?}", out.stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.starts_with("no newline\n"),
        "{}",
        &log[..log.len().min(200)]
    );
    let last = log.trim_end().lines().last().unwrap_or_default();
    assert_eq!(
        last,
        format!("----- end agents result {t} -----"),
        "the block ends the log"
    );
    let json = job::unframe(&log, &t, &p.sha256, p.bytes).unwrap();
    assert_eq!(
        ResultEnvelope::parse_for(&json, &t).unwrap(),
        ToolResult::text("x".repeat(20_000))
    );
}

#[test]
fn wrapper_turns_failures_into_error_results_and_exits_zero() {
    let s = Scratch::new("fail");
    let t = token("w");
    let env = envelope(&t, "{}");
    let out = s
        .wrap(&env, &["/bin/sh", "-c", "echo boom >&2; exit 3"])
        .output()
        .unwrap();
    assert!(out.status.success(), "an error result is still a report");
    assert_eq!(
        ResultEnvelope::parse_for(&s.message(), &t).unwrap(),
        ToolResult::error("the tool ended with exit status 3: boom")
    );
    let out = s.wrap(&env, &["/no/such/tool"]).output().unwrap();
    assert!(out.status.success());
    let e = error_of(&ResultEnvelope::parse_for(&s.message(), &t).unwrap());
    assert!(
        e.contains("cannot start") && e.contains("/no/such/tool"),
        "{e}"
    );
    // The wrapper's own failure: exit 64, the reason as the message.
    let out = Command::new(BIN)
        .args(["tool-exec", "--envelope", "/nonexistent/envelope.json"])
        .arg("--termination-log")
        .arg(s.termination_log())
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(
        s.message().contains("cannot read the envelope"),
        "{}",
        s.message()
    );
}

#[test]
fn wrapper_sets_the_token_and_drops_the_api_servers_address() {
    let s = Scratch::new("env");
    let t = token("w");
    let out = s
        .wrap(&envelope(&t, "{}"), &["env"])
        .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
        .env("KUBERNETES_PORT", "tcp://10.96.0.1:443")
        .env("KEPT", "yes")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = text_of(&ResultEnvelope::parse_for(&s.message(), &t).unwrap());
    assert!(text.contains("AGENTS_TOKEN=w-t1-c0"), "{text}");
    assert!(text.contains("AGENTS_ENVELOPE_VERSION=agents-exe.io/envelope/v1"));
    assert!(text.contains("KEPT=yes"), "the image's env stays: {text}");
    assert!(!text.contains("KUBERNETES_"), "{text}");
}

#[test]
fn wrapper_forwards_sigterm_to_the_tool_and_reports_it() {
    let s = Scratch::new("term");
    let t = token("w");
    let mut child = s
        .wrap(
            &envelope(&t, "{}"),
            &["/bin/sh", "-c", "echo started >&2; sleep 30 & wait"],
        )
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let mut first = [0u8; 8];
    std::io::Read::read_exact(&mut err, &mut first).unwrap();
    let started = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the tool (and its sleep) should end at once"
    );
    assert!(status.success(), "{status:?}");
    let e = error_of(&ResultEnvelope::parse_for(&s.message(), &t).unwrap());
    assert!(e.contains("SIGTERM") && e.contains("terminated"), "{e}");
}

#[test]
fn wrapper_installs_itself() {
    let s = Scratch::new("install");
    let target = s.0.path("agents");
    let out = Command::new(BIN)
        .args(["tool-exec", "--install-to"])
        .arg(&target)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read(&target).unwrap(), std::fs::read(BIN).unwrap());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
        0o755
    );
}

// ---------------------------------------------------------------------------
// Jobs on the test cluster.

struct Fixture {
    client: Client,
    ns: TestNamespace,
    image: String,
}

impl Fixture {
    async fn new(prefix: &str) -> Option<Fixture> {
        let client = support::cluster().await?;
        let image = support::agents_image()?;
        support::install_crds(&client).await;
        let ns = TestNamespace::create(&client, prefix).await;
        Some(Fixture { client, ns, image })
    }

    fn runner(&self, defaults: JobDefaults) -> JobRunner {
        JobRunner::new(
            self.client.clone(),
            self.ns.name.clone(),
            self.image.clone(),
            defaults,
        )
    }

    /// The call's Continuation, which owns its Jobs.
    async fn continuation(&self, token: &ContinuationToken) -> Continuation {
        let c: Continuation = serde_json::from_value(json!({
            "apiVersion": "agents-exe.io/v1alpha1",
            "kind": "Continuation",
            "metadata": {"name": token.as_str()},
            "spec": {
                "session": "s",
                "turn": 1,
                "callId": "t1-c0",
                "toolCall": {"modelCallId": "call_1", "name": "tool", "arguments": "{}"},
                "policy": {"disposition": "runIsolated"},
                "context": {"session": "s", "turn": 1, "callId": "t1-c0", "idempotencyKey": "k"},
            },
        }))
        .unwrap();
        Api::<Continuation>::namespaced(self.client.clone(), &self.ns.name)
            .create(&PostParams::default(), &c)
            .await
            .unwrap()
    }

    async fn jobs_of(&self, token: &ContinuationToken) -> Vec<Job> {
        Api::<Job>::namespaced(self.client.clone(), &self.ns.name)
            .list(&ListParams::default().labels(&format!("{LABEL_CONTINUATION}={token}")))
            .await
            .unwrap()
            .items
    }

    async fn pods_of(&self, job: &str) -> Vec<Pod> {
        Api::<Pod>::namespaced(self.client.clone(), &self.ns.name)
            .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
            .await
            .unwrap()
            .items
    }

    async fn pod_of(&self, job: &str) -> Pod {
        let pods = self.pods_of(job).await;
        assert_eq!(pods.len(), 1, "one pod for Job {job}");
        pods.into_iter().next().unwrap()
    }
}

/// Calls `start` until the attempt has ended, as a driver woken by the Job
/// watch would.
async fn run_to_end(
    runner: &JobRunner,
    spec: &IsolationSpec,
    env: &CallEnvelope,
    attempt: u32,
    timeout: Duration,
) -> (ToolResult, Duration) {
    let started = Instant::now();
    loop {
        match runner
            .start(RunKind::Isolated(spec), env, attempt, timeout)
            .await
        {
            RunStatus::Finished(r) => return (r, started.elapsed()),
            RunStatus::InFlight => {}
            RunStatus::Task(t) => panic!("a Job never becomes an MCP task ({})", t.id),
        }
        assert!(
            started.elapsed() < timeout + Duration::from_secs(120),
            "the Job for {} did not end",
            env.token
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn terminated_message(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == TOOL_CONTAINER))
        .and_then(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
        .unwrap_or_default()
}

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_busybox_tool_reads_the_envelope_and_its_text_comes_back() {
    let Some(f) = Fixture::new("jobs-plain").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    let t = token("plain");
    f.continuation(&t).await;
    let args = r#"{"cmd":"$(rm -rf /)","q":"it's \"quoted\" `x`"}"#;
    let env = envelope(&t, args);
    // The tool reads the envelope from stdin and echoes it back.
    let spec = sh(BUSYBOX_IMAGE, "cat");
    let (result, took) = run_to_end(&runner, &spec, &env, 1, MINUTE).await;
    println!("one Job round trip (create to result): {took:?}");
    assert_eq!(CallEnvelope::parse(&text_of(&result)).unwrap(), env);

    // It came back through the termination message.
    let jobs = f.jobs_of(&t).await;
    assert_eq!(jobs.len(), 1);
    let job = &jobs[0];
    let name = job.metadata.name.clone().unwrap();
    let pod = f.pod_of(&name).await;
    let msg = terminated_message(&pod);
    assert_eq!(job::read_message(&msg, &t), Message::Result(result.clone()));

    // The arguments are nowhere in the pod's command, args or env; only in
    // the annotation the downward API reads.
    let ps =
        serde_json::to_value(job.spec.as_ref().unwrap().template.spec.as_ref().unwrap()).unwrap();
    for c in ps["containers"]
        .as_array()
        .unwrap()
        .iter()
        .chain(ps["initContainers"].as_array().unwrap())
    {
        for field in ["command", "args", "env", "envFrom"] {
            let text = c[field].to_string();
            assert!(
                !text.contains("rm -rf") && !text.contains("quoted"),
                "{field}: {text}"
            );
        }
    }
    let annotation = &job
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .as_ref()
        .unwrap()[ANNOTATION_ENVELOPE];
    assert_eq!(CallEnvelope::parse(annotation).unwrap(), env);
    // Owned by its Continuation, labelled for the watch.
    let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("Continuation", t.as_str(), Some(true))
    );
    assert_eq!(job::attempt_of(job), Some((t.clone(), 1)));
    let listed = job::list_tool_jobs(&f.client, &f.ns.name).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(runner.result_of(&t, 1).await, Some(result));
}

#[tokio::test]
async fn results_of_every_size_come_back_intact() {
    let Some(f) = Fixture::new("jobs-sizes").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    // 100 B and 3 KiB fit the termination message; 20 KB, 100 KiB and
    // 5 MiB go through the log.
    let sizes = [100usize, 3 * 1024, 20_000, 100 * 1024, 5 * 1024 * 1024];
    let mut calls = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let t = ContinuationToken(format!("size-t1-c{i}"));
        f.continuation(&t).await;
        calls.push((t, *size));
    }
    let runs = calls.iter().map(|(t, size)| {
        let runner = &runner;
        async move {
            let env = envelope(t, "{}");
            let spec = sh(
                BUSYBOX_IMAGE,
                &format!("head -c {size} /dev/zero | tr '\\0' y"),
            );
            run_to_end(runner, &spec, &env, 1, MINUTE).await
        }
    });
    let results = futures::future::join_all(runs).await;
    for ((t, size), (result, took)) in calls.iter().zip(results) {
        let text = text_of(&result);
        assert_eq!(text.len(), *size, "{t}");
        assert!(text.bytes().all(|b| b == b'y'), "{t}");
        let job = &f.jobs_of(t).await[0];
        let pod = f.pod_of(job.metadata.name.as_deref().unwrap()).await;
        let via_log = matches!(
            job::read_message(&terminated_message(&pod), t),
            Message::InLog(_)
        );
        assert_eq!(via_log, *size > 4000, "{size} bytes via the log: {via_log}");
        println!("{size} bytes: {took:?} (via the log: {via_log})");
    }
}

/// A tool that floods its log before answering: the runner reads only the
/// end of the log where the result is framed, and the result is intact.
#[tokio::test]
async fn a_result_after_a_flood_of_log_lines_comes_back() {
    let Some(f) = Fixture::new("jobs-flood").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    let t = ContinuationToken("flood-t1-c0".into());
    f.continuation(&t).await;
    let env = envelope(&t, "{}");
    // 4 MiB of stderr in 64-byte lines, then a 40 KB result.
    let spec = sh(
        BUSYBOX_IMAGE,
        "head -c 4194304 /dev/zero | tr '\\0' x | fold -w 63 >&2; head -c 40000 /dev/zero | tr '\\0' y",
    );
    let (result, took) = run_to_end(&runner, &spec, &env, 1, MINUTE).await;
    let text = text_of(&result);
    assert_eq!(text.len(), 40_000, "{}", &text[..text.len().min(300)]);
    assert!(text.bytes().all(|b| b == b'y'));
    println!("after 4 MiB of log: {took:?}");
}

#[tokio::test]
async fn failures_become_clear_error_results() {
    let Some(f) = Fixture::new("jobs-fail").await else {
        return;
    };
    let runner = f.runner(JobDefaults {
        stuck_grace: Duration::from_secs(5),
        ..JobDefaults::default()
    });
    let exit = token("exit");
    let deadline = token("deadline");
    let oom = token("oom");
    let missing = token("missing");
    let never = token("never");
    let secret = token("secret");
    for t in [&exit, &deadline, &oom, &missing, &never, &secret] {
        f.continuation(t).await;
    }
    let exit_spec = sh(BUSYBOX_IMAGE, "echo starting; echo boom >&2; exit 3");
    let deadline_spec = sh(BUSYBOX_IMAGE, "sleep 120");
    let mut oom_spec = sh(
        BUSYBOX_IMAGE,
        "exec dd if=/dev/zero of=/dev/null bs=128M count=1",
    );
    oom_spec.limits.insert("memory".into(), "32Mi".into());
    let missing_spec = sh("agents.local/no-such-image:1", "true");
    let never_spec = sh("agents.local/no-such-image:2", "true");
    let mut secret_spec = sh(BUSYBOX_IMAGE, "true");
    secret_spec.env.push(EnvVarSpec {
        name: "TOKEN".into(),
        secret: Some(SecretKeyRef {
            name: "no-such-secret".into(),
            key: "k".into(),
        }),
        ..Default::default()
    });
    let never_runner = f.runner(JobDefaults {
        tool_image_pull_policy: "Never".into(),
        ..JobDefaults::default()
    });
    let e_exit = envelope(&exit, "{}");
    let e_deadline = envelope(&deadline, "{}");
    let e_oom = envelope(&oom, "{}");
    let e_missing = envelope(&missing, "{}");
    let e_never = envelope(&never, "{}");
    let e_secret = envelope(&secret, "{}");
    let (r_exit, r_deadline, r_oom, r_missing, r_never, r_secret) = tokio::join!(
        run_to_end(&runner, &exit_spec, &e_exit, 1, MINUTE),
        run_to_end(
            &runner,
            &deadline_spec,
            &e_deadline,
            1,
            Duration::from_secs(5)
        ),
        run_to_end(&runner, &oom_spec, &e_oom, 1, MINUTE),
        run_to_end(&runner, &missing_spec, &e_missing, 1, MINUTE),
        run_to_end(&never_runner, &never_spec, &e_never, 1, MINUTE),
        run_to_end(&runner, &secret_spec, &e_secret, 1, MINUTE),
    );
    assert_eq!(
        r_exit.0,
        ToolResult::error("the tool ended with exit status 3: boom")
    );
    let e = error_of(&r_deadline.0);
    assert!(
        e.contains("timeout of 5 s") && e.contains("deadline passed"),
        "{e}"
    );
    let e = error_of(&r_oom.0);
    assert!(e.contains("out of memory"), "{e}");
    let e = error_of(&r_missing.0);
    assert!(
        e.contains("agents.local/no-such-image:1") && e.contains("Err"),
        "{e}"
    );
    let e = error_of(&r_never.0);
    assert!(e.contains("ErrImageNeverPull"), "{e}");
    let e = error_of(&r_secret.0);
    assert!(
        e.contains("CreateContainerConfigError") && e.contains("no-such-secret"),
        "{e}"
    );
    for (what, (r, took)) in [
        ("exit 3", &r_exit),
        ("deadline 5 s", &r_deadline),
        ("OOM", &r_oom),
        ("image not pullable (grace 5 s)", &r_missing),
        ("image never pulled", &r_never),
        ("missing Secret (grace 5 s)", &r_secret),
    ] {
        println!("{what}: after {took:?}: {}", error_of(r));
    }
    // A stuck Job is ended and keeps its verdict for every later call.
    let jobs = f.jobs_of(&missing).await;
    assert_eq!(jobs.len(), 1);
    let annotations = jobs[0].metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations.get(ANNOTATION_FAILURE),
        Some(&error_of(&r_missing.0))
    );
    assert_eq!(
        jobs[0].spec.as_ref().unwrap().active_deadline_seconds,
        Some(1)
    );
    let again = run_to_end(&runner, &missing_spec, &e_missing, 1, MINUTE).await;
    assert_eq!(again.0, r_missing.0);
    // Each call ran one Job.
    for t in [&exit, &deadline, &oom, &missing, &never, &secret] {
        assert_eq!(f.jobs_of(t).await.len(), 1, "{t}");
    }
}

#[tokio::test]
async fn start_is_idempotent_across_calls_and_restarts() {
    let Some(f) = Fixture::new("jobs-once").await else {
        return;
    };
    let t = token("once");
    f.continuation(&t).await;
    let env = envelope(&t, "{}");
    // A tool that tells how often it ran: it cannot, across pods, so the
    // proof is the number of Jobs and pods.
    let spec = sh(BUSYBOX_IMAGE, "sleep 2; echo done");
    let first = f.runner(JobDefaults::default());
    let timeout = MINUTE;
    assert_eq!(
        first
            .start(RunKind::Isolated(&spec), &env, 1, timeout)
            .await,
        RunStatus::InFlight
    );
    assert_eq!(
        first
            .start(RunKind::Isolated(&spec), &env, 1, timeout)
            .await,
        RunStatus::InFlight
    );
    // As after an operator restart: a new runner, same call.
    let second = f.runner(JobDefaults::default());
    let (result, _) = run_to_end(&second, &spec, &env, 1, timeout).await;
    assert_eq!(result, ToolResult::text("done"));
    let (again, _) = run_to_end(&first, &spec, &env, 1, timeout).await;
    assert_eq!(again, result);
    assert_eq!(f.jobs_of(&t).await.len(), 1, "one Job for one attempt");
    // A second attempt is a second Job.
    let (third, _) = run_to_end(&second, &spec, &env, 2, timeout).await;
    assert_eq!(third, result);
    let jobs = f.jobs_of(&t).await;
    assert_eq!(jobs.len(), 2);
    let mut attempts: Vec<u32> = jobs
        .iter()
        .filter_map(|j| job::attempt_of(j).map(|a| a.1))
        .collect();
    attempts.sort();
    assert_eq!(attempts, [1, 2]);
    // Five runners racing on one new attempt: one Job.
    let raced = token("raced");
    f.continuation(&raced).await;
    let runners: Vec<JobRunner> = (0..5).map(|_| f.runner(JobDefaults::default())).collect();
    let env_raced = envelope(&raced, "{}");
    let starts = runners
        .iter()
        .map(|r| r.start(RunKind::Isolated(&spec), &env_raced, 1, timeout));
    for s in futures::future::join_all(starts).await {
        assert_eq!(s, RunStatus::InFlight);
    }
    assert_eq!(
        f.jobs_of(&raced).await.len(),
        1,
        "one Job for five racing starts"
    );
    // Background calls are not the Job runner's.
    let r = first.start(RunKind::Background, &env, 1, timeout).await;
    assert!(matches!(r, RunStatus::Finished(ToolResult::Error { .. })));
    // No Continuation, no Job.
    let orphan = token("orphan");
    let r = first
        .start(
            RunKind::Isolated(&spec),
            &envelope(&orphan, "{}"),
            1,
            timeout,
        )
        .await;
    let RunStatus::Finished(r) = r else {
        panic!("{r:?}")
    };
    assert!(error_of(&r).contains("does not exist"));
    assert!(f.jobs_of(&orphan).await.is_empty());
}

#[tokio::test]
async fn tool_pods_pass_the_restricted_standard_and_hold_nothing() {
    let Some(f) = Fixture::new("jobs-restricted").await else {
        return;
    };
    let namespaces: Api<Namespace> = Api::all(f.client.clone());
    namespaces
        .patch(
            &f.ns.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest",
            }}})),
        )
        .await
        .unwrap();
    // The label is enforced: a plain pod is refused.
    let plain: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": BUSYBOX_IMAGE, "command": ["true"]}]},
    }))
    .unwrap();
    let refused = Api::<Pod>::namespaced(f.client.clone(), &f.ns.name)
        .create(&PostParams::default(), &plain)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("restricted"),
        "expected a PodSecurity refusal: {refused}"
    );

    let secrets: Api<Secret> = Api::namespaced(f.client.clone(), &f.ns.name);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "gh"},
        "stringData": {"token": "s3cret"},
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();

    let runner = f.runner(JobDefaults::default());
    let t_env = token("env");
    let t_fs = token("fs");
    f.continuation(&t_env).await;
    f.continuation(&t_fs).await;
    // `env` itself, no shell: its output is exactly the environment.
    let env_spec = IsolationSpec {
        image: BUSYBOX_IMAGE.into(),
        command: vec!["env".into()],
        env: vec![
            EnvVarSpec {
                name: "MODE".into(),
                value: Some("fast".into()),
                ..Default::default()
            },
            EnvVarSpec {
                name: "GH_TOKEN".into(),
                secret: Some(SecretKeyRef {
                    name: "gh".into(),
                    key: "token".into(),
                }),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    let fs_spec = sh(
        BUSYBOX_IMAGE,
        "ls /var/run/secrets/kubernetes.io/serviceaccount 2>/dev/null && echo token-present; \
         touch /probe 2>/dev/null && echo root-writable || echo root-read-only; \
         touch /tmp/probe && echo tmp-writable; id -u; \
         cat /proc/self/status | grep CapEff",
    );
    let e_env = envelope(&t_env, "{}");
    let e_fs = envelope(&t_fs, "{}");
    let (r_env, r_fs) = tokio::join!(
        run_to_end(&runner, &env_spec, &e_env, 1, MINUTE),
        run_to_end(&runner, &fs_spec, &e_fs, 1, MINUTE),
    );
    let text = text_of(&r_env.0);
    let vars: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(
        vars.keys().copied().collect::<Vec<_>>(),
        [
            "AGENTS_ENVELOPE_VERSION",
            "AGENTS_TOKEN",
            "GH_TOKEN",
            "HOME",
            "HOSTNAME",
            "MODE",
            "PATH",
        ],
        "the tool sees the image's PATH, the runtime's HOSTNAME and what the runner and \
         its definition name, nothing else:\n{text}"
    );
    assert_eq!(vars["MODE"], "fast");
    assert_eq!(vars["GH_TOKEN"], "s3cret");
    assert_eq!(vars["HOME"], "/tmp");
    assert_eq!(vars["AGENTS_TOKEN"], t_env.as_str());
    let text = text_of(&r_fs.0);
    assert!(!text.contains("token-present"), "{text}");
    assert!(text.contains("root-read-only"), "{text}");
    assert!(text.contains("tmp-writable"), "{text}");
    assert!(text.contains("65532"), "{text}");
    assert!(
        text.contains("CapEff:\t0000000000000000"),
        "no capabilities: {text}"
    );
    // The secret's value is nowhere in the Job: only a reference.
    let job = &f.jobs_of(&t_env).await[0];
    assert!(!serde_json::to_string(job).unwrap().contains("s3cret"));
}

#[tokio::test]
async fn the_wrapper_runs_in_an_image_with_nothing_but_a_static_binary() {
    let Some(f) = Fixture::new("jobs-scratch").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    let t = token("scratch");
    f.continuation(&t).await;
    // The agents image is FROM scratch with one static binary: no shell,
    // no libc, no /tmp. Used as a tool image, the wrapper still works.
    let spec = IsolationSpec {
        image: f.image.clone(),
        command: vec!["/agents".into(), "--version".into()],
        ..Default::default()
    };
    let (result, _) = run_to_end(&runner, &spec, &envelope(&t, "{}"), 1, MINUTE).await;
    assert!(text_of(&result).starts_with("agents "), "{result:?}");
}

#[tokio::test]
async fn a_deleted_pod_is_an_error_result() {
    let Some(f) = Fixture::new("jobs-deleted").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    let t = token("deleted");
    f.continuation(&t).await;
    let env = envelope(&t, "{}");
    let spec = sh(BUSYBOX_IMAGE, "echo running; sleep 120");
    assert_eq!(
        runner
            .start(RunKind::Isolated(&spec), &env, 1, MINUTE)
            .await,
        RunStatus::InFlight
    );
    let pods: Api<Pod> = Api::namespaced(f.client.clone(), &f.ns.name);
    let name = job::job_name(&t, 1);
    let pod = support::wait_until(MINUTE, "the tool running", || async {
        let pod = f.pods_of(&name).await.into_iter().next()?;
        let running = pod
            .status
            .as_ref()?
            .container_statuses
            .as_ref()?
            .iter()
            .any(|c| {
                c.name == TOOL_CONTAINER && c.state.as_ref().is_some_and(|s| s.running.is_some())
            });
        running.then_some(pod)
    })
    .await;
    pods.delete(
        pod.metadata.name.as_deref().unwrap(),
        &kube::api::DeleteParams::default(),
    )
    .await
    .unwrap();
    let (result, took) = run_to_end(&runner, &spec, &env, 1, MINUTE).await;
    let e = error_of(&result);
    println!("pod deleted: after {took:?}: {e}");
    assert!(e.contains("deleted") || e.contains("terminated"), "{e}");
    assert_eq!(f.jobs_of(&t).await.len(), 1);
}

#[tokio::test]
async fn a_large_envelope_travels_in_an_owned_immutable_configmap() {
    let Some(f) = Fixture::new("jobs-bigenv").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    let t = token("bigenv");
    let owner = f.continuation(&t).await;
    // 300 KiB of arguments: more than the annotations of a pod may hold.
    let args = serde_json::to_string(&json!({"blob": "q".repeat(300 * 1024)})).unwrap();
    let env = envelope(&t, &args);
    let spec = sh(BUSYBOX_IMAGE, "wc -c");
    let (result, _) = run_to_end(&runner, &spec, &env, 1, MINUTE).await;
    let sent = serde_json::to_vec(&env).unwrap().len();
    assert_eq!(text_of(&result).trim(), sent.to_string());
    let name = job::job_name(&t, 1);
    let cm = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(f.client.clone(), &f.ns.name)
        .get(&name)
        .await
        .unwrap();
    assert_eq!(cm.immutable, Some(true));
    assert_eq!(
        cm.metadata.owner_references.as_ref().unwrap()[0].uid,
        owner.metadata.uid.unwrap()
    );
    let job = &f.jobs_of(&t).await[0];
    let template = job
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap();
    assert!(template
        .annotations
        .as_ref()
        .is_none_or(|a| !a.contains_key(ANNOTATION_ENVELOPE)));
}

/// The chart's helm binary, built by tests/cluster/build.
fn helm() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(support::BINARY_CACHE)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("helm-"))
        .map(|e| e.path().join("helm"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

#[tokio::test]
async fn the_charts_egress_deny_policy_selects_tool_pods() {
    let Some(f) = Fixture::new("jobs-netpol").await else {
        return;
    };
    let Some(helm) = helm() else {
        assert!(
            !support::cluster_required(),
            "no helm under {}",
            support::BINARY_CACHE
        );
        eprintln!("skipped: no helm");
        return;
    };
    let out = Command::new(helm)
        .args(["template", "agents"])
        .arg(support::repo_root().join("charts/agents"))
        .args([
            "--namespace",
            &f.ns.name,
            "--show-only",
            "templates/tool-networkpolicy.yaml",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let scratch = support::scratch::Scratch::new("netpol");
    let file = scratch.write("netpol.yaml", &String::from_utf8(out.stdout).unwrap());
    support::kubectl_ok(["apply", "-f", file.to_str().unwrap()]);
    let policy = support::kubectl_ok([
        "get",
        "networkpolicy",
        "agents-tool-egress-deny",
        "-n",
        &f.ns.name,
        "-o",
        "json",
    ]);
    let policy: serde_json::Value = serde_json::from_str(&policy).unwrap();
    // No egress rule: all egress denied (an empty list is dropped by the server).
    assert!(
        policy["spec"]["egress"].is_null() || policy["spec"]["egress"] == json!([]),
        "{policy}"
    );
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    // Its selector matches the pods the Job runner makes.
    let selector = &policy["spec"]["podSelector"]["matchLabels"];
    let selector: Vec<String> = selector
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap()))
        .collect();
    let runner = f.runner(JobDefaults::default());
    let t = token("netpol");
    f.continuation(&t).await;
    let (result, _) = run_to_end(
        &runner,
        &sh(BUSYBOX_IMAGE, "echo hi"),
        &envelope(&t, "{}"),
        1,
        MINUTE,
    )
    .await;
    assert_eq!(result, ToolResult::text("hi"));
    let selected = Api::<Pod>::namespaced(f.client.clone(), &f.ns.name)
        .list(&ListParams::default().labels(&selector.join(",")))
        .await
        .unwrap()
        .items;
    assert_eq!(selected.len(), 1, "the policy selects the tool pod");
}

#[tokio::test]
async fn a_disallowed_image_fails_clearly_and_creates_no_job() {
    let Some(f) = Fixture::new("jobs-allow").await else {
        return;
    };
    let runner = f.runner(JobDefaults {
        allowed_images: Some(vec!["agents.local/*".into()]),
        ..JobDefaults::default()
    });
    let t = token("allow");
    f.continuation(&t).await;
    let spec = sh("docker.io/library/alpine:3", "true");
    let r = runner
        .start(RunKind::Isolated(&spec), &envelope(&t, "{}"), 1, MINUTE)
        .await;
    let RunStatus::Finished(r) = r else {
        panic!("{r:?}")
    };
    let e = error_of(&r);
    assert!(e.contains("not allowed") && e.contains("alpine"), "{e}");
    assert!(
        f.jobs_of(&t).await.is_empty(),
        "no Job for a disallowed image"
    );
    // An allowed image runs.
    let (ok, _) = run_to_end(
        &runner,
        &sh(BUSYBOX_IMAGE, "echo fine"),
        &envelope(&t, "{}"),
        1,
        MINUTE,
    )
    .await;
    assert_eq!(ok, ToolResult::text("fine"));
}

/// Not part of the suite (it takes a minute or two): latency of one
/// isolated call through the Job runner, create to result, 20 in a row.
/// `cargo test --test cluster_suite cluster_jobs:: -- --ignored --nocapture latency`
#[tokio::test]
#[ignore]
async fn latency_of_twenty_isolated_calls() {
    let Some(f) = Fixture::new("jobs-latency").await else {
        return;
    };
    let runner = f.runner(JobDefaults::default());
    let mut took = Vec::new();
    for i in 0..20 {
        let t = ContinuationToken(format!("lat-t1-c{i}"));
        f.continuation(&t).await;
        let (r, d) = run_to_end(
            &runner,
            &sh(BUSYBOX_IMAGE, "cat >/dev/null; echo ok"),
            &envelope(&t, "{}"),
            1,
            MINUTE,
        )
        .await;
        assert_eq!(r, ToolResult::text("ok"));
        took.push(d);
    }
    took.sort();
    println!(
        "Job round trip over 20 calls (polling every 250 ms): p50 {:?}, p95 {:?}, max {:?}",
        took[9], took[18], took[19]
    );
}
