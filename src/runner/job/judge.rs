//! What a tool Job and its pods say (pure): running, done with a result
//! or an error that says what happened, the result in a pod's log, or
//! stuck on something that will not come by itself.

use super::{read_message, Message, ResultInLog, INSTALL_CONTAINER, TOOL_CONTAINER};
use crate::core::{ContinuationToken, ToolResult};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStatus, Pod};
use std::time::Duration;

/// What a Job and its pods say.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Running,
    Done(ToolResult),
    /// The result is in this pod's log.
    ReadLog {
        pod: String,
        pointer: ResultInLog,
    },
    /// A pod waits on something that will not come by itself.
    Stuck(String),
}

fn condition<'a>(job: &'a Job, kind: &str) -> Option<(&'a str, &'a str)> {
    job.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind && c.status == "True")
        .map(|c| {
            (
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or(""),
            )
        })
}

fn container<'a>(pod: &'a Pod, name: &str, init: bool) -> Option<&'a ContainerStatus> {
    let status = pod.status.as_ref()?;
    let list = if init {
        status.init_container_statuses.as_ref()
    } else {
        status.container_statuses.as_ref()
    };
    list?.iter().find(|c| c.name == name)
}

fn memory_limit(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == TOOL_CONTAINER))
        .and_then(|c| c.resources.as_ref()?.limits.as_ref()?.get("memory"))
        .map(|q| q.0.clone())
        .unwrap_or_else(|| "unset".into())
}

/// Waiting reasons that end the call: the first set at once (they never
/// resolve without someone changing the cluster), the second after the
/// grace (a registry hiccup, a Secret being created).
const STUCK_AT_ONCE: &[&str] = &["ErrImageNeverPull", "InvalidImageName"];
const STUCK_AFTER_GRACE: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "RegistryUnavailable",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Reads the state of a Job and its pods (pure; `now` in Unix seconds).
pub fn judge(
    job: &Job,
    pods: &[Pod],
    token: &ContinuationToken,
    now: i64,
    grace: Duration,
) -> Verdict {
    let complete =
        condition(job, "Complete").is_some() || condition(job, "SuccessCriteriaMet").is_some();
    let failed = condition(job, "Failed").or_else(|| condition(job, "FailureTarget"));
    // The pod whose tool container ended (there is at most one: backoffLimit 0).
    let ended = pods.iter().find_map(|p| {
        let c = container(p, TOOL_CONTAINER, false)?;
        let t = c.state.as_ref()?.terminated.as_ref()?;
        Some((p, t))
    });
    if complete {
        let Some((pod, t)) = ended else {
            return Verdict::Done(ToolResult::error(
                "the tool's Job completed but its pod is gone, so its result cannot be read \
                 (was it deleted, or did the Job's ttlSecondsAfterFinished pass?)",
            ));
        };
        return from_terminated(pod, t, token, None);
    }
    if let Some((reason, message)) = failed {
        return judge_failed(job, pods, ended, token, (reason, message));
    }
    // The tool reported before the Job controller noticed: the result is
    // final (restartPolicy Never), no need to wait for the Job's condition.
    if let Some((pod, t)) = ended {
        if !matches!(
            read_message(t.message.as_deref().unwrap_or(""), token),
            Message::Other(_)
        ) {
            return from_terminated(pod, t, token, None);
        }
    }
    // Running: is a pod stuck on something that will not come?
    match pods.iter().find_map(|pod| stuck(pod, now, grace)) {
        Some(why) => Verdict::Stuck(why),
        None => Verdict::Running,
    }
}

/// A failed Job: its deadline, the tool's own ending, or its pod's failure.
fn judge_failed(
    job: &Job,
    pods: &[Pod],
    ended: Option<(&Pod, &ContainerStateTerminated)>,
    token: &ContinuationToken,
    (reason, message): (&str, &str),
) -> Verdict {
    if reason == "DeadlineExceeded" {
        let secs = job
            .spec
            .as_ref()
            .and_then(|s| s.active_deadline_seconds)
            .unwrap_or_default();
        return Verdict::Done(ToolResult::error(format!(
            "the tool did not finish within its timeout of {secs} s: the deadline passed and \
             its Job was stopped (DeadlineExceeded)"
        )));
    }
    if let Some((pod, t)) = ended {
        return from_terminated(pod, t, token, Some((reason, message)));
    }
    if let Some(why) = pods.iter().find_map(pod_failure) {
        return Verdict::Done(ToolResult::error(why));
    }
    Verdict::Done(ToolResult::error(format!(
        "the tool's pod failed or was deleted before it reported a result (Job failed: \
         {reason}: {message})"
    )))
}

/// Why `pod` will not start: a container waiting on what will not come (a
/// missing image, a bad config), at once or past the grace.
fn stuck(pod: &Pod, now: i64, grace: Duration) -> Option<String> {
    let age = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| now - t.0.as_second())
        .unwrap_or(0);
    let statuses = pod.status.iter().flat_map(|s| {
        s.init_container_statuses
            .iter()
            .flatten()
            .chain(s.container_statuses.iter().flatten())
    });
    for c in statuses {
        let Some(w) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) else {
            continue;
        };
        let reason = w.reason.as_deref().unwrap_or("");
        let now_fatal = STUCK_AT_ONCE.contains(&reason);
        let late = STUCK_AFTER_GRACE.contains(&reason) && age >= grace.as_secs() as i64;
        if !(now_fatal || late) {
            continue;
        }
        let config = reason.starts_with("CreateContainer") || reason == "RunContainerError";
        let what = match (c.name == TOOL_CONTAINER, config) {
            (true, false) => format!("the tool's image {}", c.image),
            (true, true) => "the tool's container".to_string(),
            (false, false) => format!("the agents (wrapper) image {}", c.image),
            (false, true) => "the wrapper's init container".to_string(),
        };
        let detail = w.message.as_deref().unwrap_or("");
        let hint = if config {
            "check the Secrets and keys the tool's env names"
        } else {
            "check the image name, and that the node has it or can pull it (imagePullSecrets)"
        };
        return Some(format!(
            "the tool's pod could not start: {what}: {reason}: {detail} ({hint})"
        ));
    }
    None
}

/// What a failed pod without a finished tool container says.
fn pod_failure(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if let Some(t) = container(pod, INSTALL_CONTAINER, true)
        .and_then(|c| c.state.as_ref()?.terminated.as_ref())
        .filter(|t| t.exit_code != 0)
    {
        return Some(format!(
            "installing the tool wrapper failed (exit code {}, {}): {}",
            t.exit_code,
            t.reason.as_deref().unwrap_or(""),
            t.message.as_deref().unwrap_or("").trim()
        ));
    }
    if status.reason.as_deref() == Some("Evicted") {
        return Some(format!(
            "the tool's pod was evicted: {}",
            status.message.as_deref().unwrap_or("")
        ));
    }
    let disrupted = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True");
    if let Some(c) = disrupted {
        return Some(format!(
            "the tool's pod was stopped before it reported a result ({}: {})",
            c.reason.as_deref().unwrap_or(""),
            c.message.as_deref().unwrap_or("")
        ));
    }
    None
}

fn from_terminated(
    pod: &Pod,
    t: &ContainerStateTerminated,
    token: &ContinuationToken,
    job_failed: Option<(&str, &str)>,
) -> Verdict {
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let message = t.message.as_deref().unwrap_or("");
    // An evicted or disrupted pod in a failed Job: that is what happened,
    // whatever the wrapper said when it got SIGTERM.
    if job_failed.is_some() {
        if let Some(p) = pod_failure(pod) {
            return Verdict::Done(ToolResult::error(p));
        }
    }
    match read_message(message, token) {
        Message::Result(r) => return Verdict::Done(r),
        Message::InLog(pointer) => {
            return Verdict::ReadLog {
                pod: pod_name,
                pointer,
            }
        }
        Message::Other(_) => {}
    }
    let reason = t.reason.as_deref().unwrap_or("");
    if reason == "OOMKilled" {
        return Verdict::Done(ToolResult::error(format!(
            "the tool ran out of memory and was killed (OOMKilled; memory limit {})",
            memory_limit(pod)
        )));
    }
    let text = message.trim();
    let mut out = if t.exit_code == 0 {
        "the tool's wrapper ended without reporting a result".to_string()
    } else {
        format!(
            "the tool's wrapper failed with exit code {}{}",
            t.exit_code,
            if reason.is_empty() {
                String::new()
            } else {
                format!(" ({reason})")
            }
        )
    };
    if !text.is_empty() {
        out.push_str(": ");
        out.push_str(text);
    }
    if let Some((r, m)) = job_failed {
        if text.is_empty() {
            out.push_str(&format!(" (Job failed: {r}: {m})"));
        }
    }
    Verdict::Done(ToolResult::error(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::job::tests::token;
    use crate::runner::wrapper_protocol::report;
    use serde_json::json;

    fn job_with(conditions: serde_json::Value) -> Job {
        serde_json::from_value(json!({
            "metadata": {"name": "j"},
            "spec": {"activeDeadlineSeconds": 7, "template": {}},
            "status": {"conditions": conditions},
        }))
        .unwrap()
    }

    fn pod_with(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"containers": [{"name": "tool", "resources": {"limits": {"memory": "32Mi"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    fn t0() -> i64 {
        "2026-01-01T00:00:00Z"
            .parse::<k8s_openapi::jiff::Timestamp>()
            .unwrap()
            .as_second()
    }

    fn terminated(reason: &str, code: i32, message: &str) -> serde_json::Value {
        json!({"containerStatuses": [{"name": "tool", "image": "img", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": code, "reason": reason, "message": message}}}]})
    }

    /// How long a pod may wait for a reason that is not fatal.
    const GRACE: Duration = Duration::from_secs(30);

    fn condition(ty: &str, reason: &str) -> serde_json::Value {
        json!([{"type": ty, "status": "True", "reason": reason, "message": "msg"}])
    }

    fn failed_job() -> Job {
        job_with(condition("Failed", "BackoffLimitExceeded"))
    }

    #[test]
    fn a_reported_result_is_taken_with_or_before_the_jobs_completion() {
        let (t, g) = (token(), GRACE);
        let (msg, _) = report(&t, &ToolResult::text("ok"));
        let done = job_with(condition("Complete", ""));
        let ok_pod = pod_with(terminated("Completed", 0, &msg));
        assert_eq!(
            judge(&done, std::slice::from_ref(&ok_pod), &t, t0(), g),
            Verdict::Done(ToolResult::text("ok"))
        );
        // Reported before the Job controller marked the Job complete.
        let running = job_with(json!([]));
        assert_eq!(
            judge(&running, &[ok_pod], &t, t0(), g),
            Verdict::Done(ToolResult::text("ok"))
        );
    }

    #[test]
    fn a_failed_wrapper_without_a_result_waits_for_the_jobs_verdict() {
        let (t, g) = (token(), GRACE);
        let running = job_with(json!([]));
        let wrapper_failed = pod_with(terminated("Error", 64, "cannot read"));
        assert_eq!(
            judge(&running, &[wrapper_failed], &t, t0(), g),
            Verdict::Running,
            "without a result, wait for the Job's verdict"
        );
    }

    #[test]
    fn a_complete_job_whose_pod_is_gone_is_an_error() {
        let (t, g) = (token(), GRACE);
        let done = job_with(condition("Complete", ""));
        let v = judge(&done, &[], &t, t0(), g);
        assert!(
            matches!(v, Verdict::Done(ToolResult::Error { message }) if message.contains("pod is gone"))
        );
    }

    #[test]
    fn a_job_past_its_deadline_names_the_timeout() {
        let (t, g) = (token(), GRACE);
        let deadline = job_with(condition("Failed", "DeadlineExceeded"));
        let v = judge(&deadline, &[], &t, t0(), g);
        assert!(
            matches!(&v, Verdict::Done(ToolResult::Error { message }) if message.contains("timeout of 7 s") && message.contains("deadline")),
            "{v:?}"
        );
    }

    #[test]
    fn a_failed_job_names_out_of_memory_the_wrappers_exit_or_a_deleted_pod() {
        let (t, g) = (token(), GRACE);
        let failed = failed_job();
        let oom = pod_with(terminated("OOMKilled", 137, ""));
        let v = judge(&failed, &[oom], &t, t0(), g);
        assert!(
            matches!(&v, Verdict::Done(ToolResult::Error { message }) if message.contains("out of memory") && message.contains("32Mi")),
            "{v:?}"
        );
        let wrapper = pod_with(terminated(
            "Error",
            64,
            "agents tool-exec: cannot read the envelope",
        ));
        let v = judge(&failed, &[wrapper], &t, t0(), g);
        assert!(
            matches!(&v, Verdict::Done(ToolResult::Error { message }) if message.contains("exit code 64") && message.contains("cannot read the envelope")),
            "{v:?}"
        );
        let v = judge(&failed, &[], &t, t0(), g);
        assert!(
            matches!(&v, Verdict::Done(ToolResult::Error { message }) if message.contains("deleted")),
            "{v:?}"
        );
    }

    #[test]
    fn an_evicted_pod_is_an_error_even_after_it_reported() {
        let (t, g) = (token(), GRACE);
        let failed = failed_job();
        let evicted =
            pod_with(json!({"phase": "Failed", "reason": "Evicted", "message": "low on memory"}));
        let v = judge(&failed, &[evicted], &t, t0(), g);
        assert!(
            matches!(&v, Verdict::Done(ToolResult::Error { message }) if message.contains("evicted: low on memory")),
            "{v:?}"
        );
        let (sigterm, _) = report(&t, &ToolResult::error("the tool was stopped by SIGTERM"));
        let mut evicted_after_report = pod_with(terminated("Completed", 0, &sigterm));
        let status = evicted_after_report.status.as_mut().unwrap();
        status.reason = Some("Evicted".into());
        status.message = Some("disk pressure".into());
        let v = judge(&failed, &[evicted_after_report], &t, t0(), g);
        assert!(
            matches!(&v, Verdict::Done(ToolResult::Error { message }) if message.contains("evicted: disk pressure")),
            "{v:?}"
        );
    }

    #[test]
    fn a_waiting_pod_is_stuck_at_once_for_a_fatal_reason_and_after_the_grace_otherwise() {
        let (t, g) = (token(), GRACE);
        let running = job_with(json!([]));
        let waiting = |reason: &str| {
            pod_with(
                json!({"containerStatuses": [{"name": "tool", "image": "nope:1", "imageID": "",
                "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": "details"}}}]}),
            )
        };
        assert!(matches!(
            judge(&running, &[waiting("ErrImageNeverPull")], &t, t0() + 1, g),
            Verdict::Stuck(m) if m.contains("nope:1") && m.contains("ErrImageNeverPull")
        ));
        assert_eq!(
            judge(&running, &[waiting("ImagePullBackOff")], &t, t0() + 5, g),
            Verdict::Running
        );
        assert!(matches!(
            judge(&running, &[waiting("ImagePullBackOff")], &t, t0() + 31, g),
            Verdict::Stuck(_)
        ));
        assert_eq!(
            judge(&running, &[waiting("ContainerCreating")], &t, t0() + 999, g),
            Verdict::Running
        );
    }
}
