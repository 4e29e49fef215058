//! `runIsolated` calls under the operator: each attempt is one hardened Job
//! (wrapper from the agents image, the tool's own image); the result comes
//! back through the kubelet and wakes the session by watch. The operator is
//! SIGKILLed while the Job runs and restarted: one Job, one run, the
//! session succeeds. Retries of a failing tool are the policy's, each
//! attempt its own Job.

use crate::support;

use std::path::Path;
use std::time::Instant;
use support::launcher::Operator;
use support::{kubectl, kubectl_ok, TestNamespace, BUSYBOX_IMAGE};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn operator(ns: &str, kubeconfig: &Path, image: &str, tag: &str) -> Operator {
    Operator::start(
        BIN,
        &format!("{ns}-{tag}"),
        kubeconfig,
        &["-n", ns, "--agents-image", image],
        &[],
    )
}

fn manifests() -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: iso}}
spec:
  messages: ["count the lines"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: slow_count, arguments: {{lines: 3}}}}
              - {{name: flaky, arguments: {{}}}}
          - text: done counting
    tools:
      - name: slow_count
        container:
          image: {BUSYBOX_IMAGE}
          command: ["/bin/sh", "-c", "sleep 6; echo counted 3 lines"]
      - name: flaky
        container:
          image: {BUSYBOX_IMAGE}
          command: ["/bin/sh", "-c", "echo flaky failure >&2; exit 4"]
    policy:
      default: runIsolated
      rules:
        - {{tool: flaky, disposition: runIsolated, retries: 1}}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolated_calls_run_as_jobs_across_an_operator_crash() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let Some(image) = support::agents_image() else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "iso").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let mut op = operator(&ns.name, &kubeconfig, &image, "1");
    let started = Instant::now();
    support::apply(&ns.name, &manifests());
    // Wait for the slow tool's Job to exist, then kill the operator under it.
    let mut seen_job = false;
    for _ in 0..60 {
        let jobs = kubectl_ok(["get", "jobs", "-n", &ns.name, "-o", "name"]);
        if jobs.contains("iso-t1-c0") {
            seen_job = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    assert!(seen_job, "a Job for iso-t1-c0 appeared");
    op.kill();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let _op = operator(&ns.name, &kubeconfig, &image, "2");
    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/iso",
        "--timeout=180s",
    ]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        kubectl_ok(["get", "session", "iso", "-n", &ns.name, "-o", "yaml"])
    );
    eprintln!("isolated session succeeded in {:?}", started.elapsed());
    // One Job for the slow call across the crash; two for the flaky one
    // (its retry is the policy's, a new attempt).
    let jobs = kubectl_ok(["get", "jobs", "-n", &ns.name, "-o", "json"]);
    let jobs: serde_json::Value = serde_json::from_str(&jobs).unwrap();
    let by_token = |t: &str| {
        jobs["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|j| j["metadata"]["labels"]["agents-exe.io/continuation"] == t)
            .count()
    };
    assert_eq!(by_token("iso-t1-c0"), 1, "one Job across the crash");
    assert_eq!(by_token("iso-t1-c1"), 2, "a failed attempt and its retry");
    let status = kubectl_ok(["get", "session", "iso", "-n", &ns.name, "-o", "json"]);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let results = status["status"]["state"]["turns"][2]["toolResults"].clone();
    assert_eq!(
        results[0]["result"]["response"]["content"], "counted 3 lines",
        "{results}"
    );
    let err = results[1]["result"]["message"].as_str().unwrap_or_default();
    assert!(
        err.contains("exit status 4") && err.contains("flaky failure"),
        "the model hears why the tool failed: {err}"
    );
    assert_eq!(results[1]["result"]["status"], "error", "{results}");
}

/// A Job that ends while its session is paused has its result recorded
/// then (its pod could be gone by resume time), its Job gets its TTL only
/// once the result is recorded, and resuming runs nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ends_while_paused_has_its_result_kept() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let Some(image) = support::agents_image() else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "isopause").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _op = operator(&ns.name, &kubeconfig, &image, "pause");
    let manifest = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: held}}
spec:
  messages: ["count"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: slow, arguments: {{}}}}]
          - text: counted while paused
    tools:
      - name: slow
        container:
          image: {BUSYBOX_IMAGE}
          command: ["/bin/sh", "-c", "sleep 6; echo slow result"]
    policy:
      default: runIsolated
"#
    );
    support::apply(&ns.name, &manifest);
    let job_of = || {
        let jobs = kubectl_ok([
            "get",
            "jobs",
            "-n",
            &ns.name,
            "-l",
            "agents-exe.io/continuation=held-t1-c0",
            "-o",
            "json",
        ]);
        let jobs: serde_json::Value = serde_json::from_str(&jobs).unwrap();
        jobs["items"].as_array().unwrap().clone()
    };
    let mut jobs = Vec::new();
    for _ in 0..120 {
        jobs = job_of();
        if !jobs.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    assert_eq!(jobs.len(), 1, "the call's Job appeared");
    assert!(
        jobs[0]["spec"]["ttlSecondsAfterFinished"].is_null(),
        "a running Job has no TTL: {}",
        jobs[0]["spec"]
    );
    kubectl_ok([
        "patch",
        "session",
        "held",
        "-n",
        &ns.name,
        "--type=merge",
        "-p",
        r#"{"spec":{"paused":true}}"#,
    ]);
    // The Job ends (6 s) while paused; its result lands in the Continuation.
    let mut outcome = String::new();
    for _ in 0..90 {
        outcome = kubectl_ok([
            "get",
            "continuation",
            "held-t1-c0",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.status.outcome.result.response.content}",
        ]);
        if !outcome.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    assert_eq!(
        outcome.trim(),
        "slow result",
        "the result was recorded while paused"
    );
    let session = kubectl_ok(["get", "session", "held", "-n", &ns.name, "-o", "json"]);
    let session: serde_json::Value = serde_json::from_str(&session).unwrap();
    assert_eq!(session["spec"]["paused"], true, "still paused");
    assert_ne!(
        session["status"]["phase"], "Succeeded",
        "paused: no model turn"
    );
    let mut ttl = serde_json::Value::Null;
    for _ in 0..20 {
        ttl = job_of()[0]["spec"]["ttlSecondsAfterFinished"].clone();
        if !ttl.is_null() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    assert_eq!(
        ttl, 3600,
        "the Job gets its TTL once its result is recorded"
    );
    kubectl_ok([
        "patch",
        "session",
        "held",
        "-n",
        &ns.name,
        "--type=merge",
        "-p",
        r#"{"spec":{"paused":false}}"#,
    ]);
    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/held",
        "--timeout=60s",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(job_of().len(), 1, "resuming ran nothing again");
}

/// The Jobs of the namespace as JSON items.
fn jobs_of(ns: &str) -> Vec<serde_json::Value> {
    let jobs = kubectl_ok(["get", "jobs", "-n", ns, "-o", "json"]);
    let jobs: serde_json::Value = serde_json::from_str(&jobs).unwrap();
    jobs["items"].as_array().cloned().unwrap_or_default()
}

/// A namespace whose ResourceQuota allows one Job: of two isolated calls,
/// the second's Job is refused (403, exceeded quota). That is a wait, not
/// the tool's failure: the session says so in a QuotaExceeded Event, and
/// once the first Job is gone the second is created and both calls
/// succeed. (Before, the refusal became the call's error result, called
/// an RBAC problem.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_resource_quota_holds_a_job_until_there_is_room() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let Some(image) = support::agents_image() else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "quota").await;
    support::apply(
        &ns.name,
        r#"
apiVersion: v1
kind: ResourceQuota
metadata: {name: one-job}
spec: {hard: {count/jobs.batch: "1"}}
"#,
    );
    let kubeconfig = support::kubeconfig_path().unwrap();
    let _op = operator(&ns.name, &kubeconfig, &image, "q");
    support::apply(
        &ns.name,
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: quota}}
spec:
  messages: ["both"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: first, arguments: {{}}}}
              - {{name: second, arguments: {{}}}}
          - text: both ran
    tools:
      - name: first
        container: {{image: {BUSYBOX_IMAGE}, command: ["/bin/sh", "-c", "echo one"]}}
      - name: second
        container: {{image: {BUSYBOX_IMAGE}, command: ["/bin/sh", "-c", "echo two"]}}
    policy: {{default: runIsolated}}
"#
        ),
    );
    // One Job runs to its end; the other call waits for room.
    let mut done = None;
    for _ in 0..240 {
        let jobs = jobs_of(&ns.name);
        assert!(jobs.len() <= 1, "the quota holds one Job: {jobs:?}");
        done = jobs
            .iter()
            .find(|j| j["status"]["succeeded"] == 1)
            .map(|j| j["metadata"]["name"].as_str().unwrap().to_string());
        if done.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let done = done.expect("the first Job completed");
    let events = || {
        kubectl_ok([
            "get",
            "events",
            "-n",
            &ns.name,
            "--field-selector",
            "reason=QuotaExceeded,involvedObject.name=quota",
            "-o",
            "jsonpath={.items[*].note}{.items[*].message}",
        ])
    };
    let mut said = String::new();
    for _ in 0..60 {
        said = events();
        if !said.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    assert!(
        said.contains("waits for room in the namespace's ResourceQuota")
            && said.contains("exceeded quota"),
        "a QuotaExceeded Event says why the call waits: {said:?}"
    );
    // Room again: the held call's Job is created on the next look.
    kubectl_ok(["delete", "job", &done, "-n", &ns.name, "--wait=true"]);
    let out = kubectl([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/quota",
        "--timeout=120s",
    ]);
    let status = kubectl_ok(["get", "session", "quota", "-n", &ns.name, "-o", "json"]);
    assert!(
        out.status.success(),
        "{}\n{status}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let results = &status["status"]["state"]["turns"][2]["toolResults"];
    for (i, text) in [(0, "one"), (1, "two")] {
        assert_eq!(results[i]["result"]["status"], "success", "{results}");
        assert_eq!(
            results[i]["result"]["response"]["content"], text,
            "{results}"
        );
    }
}
