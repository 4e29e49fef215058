//! The Job runner: runs a `runIsolated` attempt as a hardened Kubernetes Job,
//! speaking the same contract as the process runner (call envelope in,
//! result envelope or plain text out).
//!
//! # The pod
//!
//! - An init container from the agents image copies the static `agents`
//!   binary into an `emptyDir` at [`WRAPPER_DIR`]; the tool container runs
//!   the user's image with its command wrapped:
//!   `/agents-bin/agents tool-exec --envelope /agents-input/envelope.json -- CMD ARGS...`
//!   (Argo's emissary pattern), so a tool image needs none of our code.
//! - The envelope reaches the pod as a file: a downward-API volume item of
//!   the pod annotation [`ANNOTATION_ENVELOPE`], or, when larger than
//!   [`ANNOTATION_ENVELOPE_LIMIT`], an owned immutable ConfigMap. The
//!   model's arguments never appear in the command, args or env.
//! - The wrapper (`agents tool-exec`) reports the result envelope in the
//!   termination message when it fits, otherwise as a framed block in the
//!   container log while the termination message holds a [`ResultInLog`]
//!   pointer with its SHA-256: the protocol in [`super::wrapper_protocol`],
//!   beside this runner, which reads it.
//! - Hardened: no service-account token, a service account with no
//!   permissions, non-root, read-only root (a small `emptyDir` at `/tmp`),
//!   no privilege escalation, all capabilities dropped, `RuntimeDefault`
//!   seccomp, requests and limits, no service links, only the env vars the
//!   tool definition names (secrets as `secretKeyRef`). It passes the
//!   `restricted` Pod Security Standard.
//!
//! # The Job
//!
//! One per attempt, named by [`job_name`] (token and attempt), owned by the
//! Continuation named by the token (controller reference, its uid checked
//! on adoption), labelled [`LABEL_CONTINUATION`], [`LABEL_ATTEMPT`] and
//! [`LABEL_ROLE`]`=tool` (select them with [`TOOL_JOB_SELECTOR`]),
//! `backoffLimit: 0` (retries are the engine's decorator),
//! `activeDeadlineSeconds` from the timeout. No `ttlSecondsAfterFinished`
//! at first: a finished Job holds the result until it is recorded, however
//! long the session is paused or the operator is away. Once the result is
//! recorded, [`JobRunner::release`] gives the call's Jobs their TTL.
//!
//! [`JobRunner::start`] creates the Job or adopts the one that exists, and
//! reports how it ended. Every way a pod can fail becomes an error result
//! saying what happened; a pod stuck on its image (not present, not
//! pullable) or its configuration (a missing Secret) is given up after
//! [`JobDefaults::stuck_grace`]: the runner records why on the Job
//! ([`ANNOTATION_FAILURE`]) and ends it, so every later call reports the
//! same error.
//!
//! API errors that may pass (the server unreachable, a conflict, throttling)
//! give `InFlight`: nothing was decided, call again later. So does a
//! namespace's ResourceQuota refusing the Job (or its envelope ConfigMap):
//! the runner remembers why ([`JobRunner::held_by_quota`]) so that its
//! driver says so and asks again soon ([`QUOTA_RETRY`]), until the call's
//! timeout. Errors that will not pass (forbidden, invalid) give an error
//! result naming the fix.

use super::check_var_name;
use super::wrapper_protocol::{result_from_log, sha256_hex, ResultInLog, TERMINATION_LOG};
use crate::api::quota::exceeded_quota;
use crate::api::Continuation;
use crate::core::envelope::CallEnvelope;
use crate::core::{ContinuationToken, IsolationSpec, ToolResult};
use crate::ports::{RunKind, RunStatus, RunnerPort};
use futures::future::BoxFuture;
pub use judge::{judge, Verdict};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The reading side of the wrapper's protocol, which this runner uses.
pub use super::wrapper_protocol::{read_message, unframe, Message};

mod judge;
mod pod;

/// Label on Jobs and their pods: the token of the call (the Continuation's name).
pub const LABEL_CONTINUATION: &str = "agents-exe.io/continuation";
/// Label on Jobs and their pods: the attempt number (1, 2, ...).
pub const LABEL_ATTEMPT: &str = "agents-exe.io/attempt";
/// Label on Jobs and their pods; its value is [`ROLE_TOOL`]. The chart's
/// egress-deny NetworkPolicy selects tool pods by it.
pub const LABEL_ROLE: &str = "agents-exe.io/role";
pub const ROLE_TOOL: &str = "tool";
/// Selects every tool Job (and tool pod) of the runner: for a watch.
pub const TOOL_JOB_SELECTOR: &str = "agents-exe.io/role=tool";
/// Annotation on Jobs: the full token (labels are limited to 63 characters).
pub const ANNOTATION_TOKEN: &str = "agents-exe.io/token";
/// The session a tool Job (and its pod) runs for: the operator maps Job and
/// pod events back to it (an annotation: names may exceed a label's 63).
pub const ANNOTATION_SESSION: &str = "agents-exe.io/session";
/// Pod annotation holding the call envelope (read through the downward API).
pub const ANNOTATION_ENVELOPE: &str = "agents-exe.io/envelope";
/// Annotation on a Job the runner gave up on (stuck pod): the error result.
pub const ANNOTATION_FAILURE: &str = "agents-exe.io/failure";

/// The tool container's name (its termination message and log carry the result).
pub const TOOL_CONTAINER: &str = "tool";
/// The init container that installs the wrapper.
pub const INSTALL_CONTAINER: &str = "agents-wrapper";
/// Where the wrapper binary is shared (an `emptyDir`, read-only in the tool container).
pub const WRAPPER_DIR: &str = "/agents-bin";
pub const WRAPPER_PATH: &str = "/agents-bin/agents";
/// Where the envelope file is mounted.
pub const INPUT_DIR: &str = "/agents-input";
pub const ENVELOPE_FILE: &str = "envelope.json";
pub const ENVELOPE_PATH: &str = "/agents-input/envelope.json";

/// Envelopes up to this size travel in a pod annotation (all annotations of
/// an object share 256 KiB); larger ones in an owned, immutable ConfigMap.
pub const ANNOTATION_ENVELOPE_LIMIT: usize = 200 * 1024;
/// A ConfigMap holds at most 1 MiB; envelopes beyond this are refused.
pub const CONFIGMAP_ENVELOPE_LIMIT: usize = 1000 * 1024;
/// A Job name for the attempt: a DNS label (the Job controller puts it in
/// a pod label, so at most 63 characters), stable for (token, attempt) and
/// distinct across them.
pub fn job_name(token: &ContinuationToken, attempt: u32) -> String {
    let hash = &sha256_hex(format!("{token}/{attempt}").as_bytes())[..10];
    let tail = format!("-a{attempt}-{hash}");
    let clean: String = token
        .as_str()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let keep = 63 - tail.len();
    let prefix: String = clean.chars().take(keep).collect();
    let prefix = prefix.trim_matches('-');
    let prefix = if prefix.is_empty() { "tool" } else { prefix };
    format!("{prefix}{tail}")
}

/// A label value for the token: the token itself when it is one (tokens are
/// DNS labels), else a hash of it.
pub fn token_label(token: &ContinuationToken) -> String {
    let t = token.as_str();
    let valid = !t.is_empty()
        && t.len() <= 63
        && t.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && t.starts_with(|c: char| c.is_ascii_alphanumeric())
        && t.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        t.to_string()
    } else {
        format!("h-{}", &sha256_hex(t.as_bytes())[..40])
    }
}

/// The call a tool Job runs for: its token (annotation) and attempt (label).
pub fn attempt_of(job: &Job) -> Option<(ContinuationToken, u32)> {
    let token = job.metadata.annotations.as_ref()?.get(ANNOTATION_TOKEN)?;
    let attempt = job
        .metadata
        .labels
        .as_ref()?
        .get(LABEL_ATTEMPT)?
        .parse()
        .ok()?;
    Some((ContinuationToken(token.clone()), attempt))
}

/// Every tool Job of a namespace (for the watch that wakes sessions when
/// their Jobs end: watch Jobs with [`TOOL_JOB_SELECTOR`], map each event
/// with [`attempt_of`]).
pub async fn list_tool_jobs(client: &Client, namespace: &str) -> kube::Result<Vec<Job>> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    Ok(jobs
        .list(&ListParams::default().labels(TOOL_JOB_SELECTOR))
        .await?
        .items)
}

/// Settings of the operator (all have defaults).
#[derive(Clone, Debug)]
pub struct JobDefaults {
    /// The pods' service account: one with no permissions (its token is not
    /// mounted anyway).
    pub service_account: String,
    /// User and group the containers run as (non-root).
    pub run_as_user: i64,
    /// Limits of the tool container, per resource, where the tool sets none.
    pub limits: BTreeMap<String, String>,
    /// Requests of the tool container, where the tool sets no limit for the
    /// resource (a limit the tool sets is also its request).
    pub requests: BTreeMap<String, String>,
    /// Finished Jobs (and their pods) are deleted this long after their
    /// call's result is recorded (kept for `kubectl logs`).
    pub ttl_seconds_after_finished: i32,
    /// How long a pod may wait on a missing or unpullable image or a bad
    /// configuration (a missing Secret) before the call fails.
    pub stuck_grace: Duration,
    /// Time between SIGTERM and SIGKILL when a Job is stopped.
    pub termination_grace_seconds: i64,
    /// Size of the tool's writable `/tmp`.
    pub tmp_size_limit: String,
    /// Pull policy of the agents (wrapper) image and the tool images.
    pub agents_image_pull_policy: String,
    pub tool_image_pull_policy: String,
    /// Glob patterns (`*`, `?`, `[abc]`) a tool's image must match; `None`
    /// allows any image. A call whose image matches none fails with an
    /// error result and no Job is created.
    pub allowed_images: Option<Vec<String>>,
}

impl Default for JobDefaults {
    fn default() -> Self {
        JobDefaults {
            service_account: "default".into(),
            run_as_user: 65532,
            limits: [("cpu", "500m"), ("memory", "256Mi")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            requests: [("cpu", "100m"), ("memory", "64Mi")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ttl_seconds_after_finished: 3600,
            stuck_grace: Duration::from_secs(60),
            termination_grace_seconds: 10,
            tmp_size_limit: "64Mi".into(),
            agents_image_pull_policy: "IfNotPresent".into(),
            tool_image_pull_policy: "IfNotPresent".into(),
            allowed_images: None,
        }
    }
}

/// Where the envelope goes into the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvelopeSource {
    /// In the pod annotation [`ANNOTATION_ENVELOPE`] (this JSON).
    Annotation(String),
    /// In the ConfigMap of this name, key [`ENVELOPE_FILE`].
    ConfigMap(String),
}

/// The Continuation that owns the Job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub name: String,
    pub uid: String,
}

#[derive(Clone)]
pub struct JobRunner {
    client: Client,
    namespace: String,
    agents_image: String,
    defaults: JobDefaults,
    /// The last ResourceQuota refusal this runner met (one per namespace).
    held: Arc<Mutex<Option<String>>>,
}

/// How soon a call whose Job a ResourceQuota refused is tried again.
pub const QUOTA_RETRY: Duration = Duration::from_secs(10);

/// Why `start` did not decide: an API error that may pass.
enum Step<T> {
    Go(T),
    Done(RunStatus),
}

fn api_failure(what: &str, e: kube::Error) -> RunStatus {
    match &e {
        // A quota that will not pass by waiting ("failed quota: ... must
        // specify limits.cpu"): the namespace's rule, not RBAC.
        kube::Error::Api(s) if s.code == 403 && s.message.contains("quota") => {
            RunStatus::Finished(ToolResult::error(format!(
                "{what}: the namespace's ResourceQuota refuses it: {}",
                s.message
            )))
        }
        kube::Error::Api(s) if s.code == 403 => RunStatus::Finished(ToolResult::error(format!(
            "{what}: forbidden: {}; the operator's service account needs the RBAC rules of the chart \
             (jobs, pods, pods/log, configmaps, continuations)",
            s.message
        ))),
        kube::Error::Api(s) if s.code == 422 || s.code == 400 => RunStatus::Finished(
            ToolResult::error(format!("{what}: the API server refused it: {}", s.message)),
        ),
        _ => {
            tracing::warn!(error = %e, "{what}: will try again");
            RunStatus::InFlight
        }
    }
}

impl JobRunner {
    pub fn new(
        client: Client,
        namespace: impl Into<String>,
        agents_image: impl Into<String>,
        defaults: JobDefaults,
    ) -> Self {
        JobRunner {
            client,
            namespace: namespace.into(),
            agents_image: agents_image.into(),
            defaults,
            held: Default::default(),
        }
    }

    /// Why a ResourceQuota refused a Job of this runner, if one did: the
    /// call waits, and is tried again (see [`QUOTA_RETRY`]).
    pub fn held_by_quota(&self) -> Option<String> {
        self.held.lock().expect("held").clone()
    }

    /// A create failed: a quota's refusal is a wait, remembered; anything
    /// else is judged by [`api_failure`].
    fn create_failed(&self, what: &str, e: kube::Error) -> RunStatus {
        let Some(message) = exceeded_quota(&e) else {
            return api_failure(what, e);
        };
        tracing::warn!(namespace = %self.namespace, error = %message, "{what}: the namespace's ResourceQuota is full; the call waits and is tried again");
        *self.held.lock().expect("held") = Some(format!("{what}: {message}"));
        RunStatus::InFlight
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The same runner for another namespace (cheap: the client is shared).
    pub fn with_namespace(&self, namespace: impl Into<String>) -> JobRunner {
        JobRunner {
            namespace: namespace.into(),
            held: Default::default(),
            ..self.clone()
        }
    }

    /// `Err` with the message for the model when the image is not allowed.
    /// Patterns match the image as written and in its full form
    /// (`busybox` is `docker.io/library/busybox:latest`); `*` stops at `/`,
    /// so `ghcr.io/acme/*` allows `ghcr.io/acme/tool:v1` and not
    /// `ghcr.io/acme/../evil` or `ghcr.io/acme/x/y`. A lone `*` allows any.
    pub fn check_image(&self, image: &str) -> Result<(), String> {
        let Some(patterns) = &self.defaults.allowed_images else {
            return Ok(());
        };
        let allowed = image_allowed(patterns, image);
        if allowed {
            Ok(())
        } else {
            Err(format!(
                "the tool image {image:?} is not allowed here: the operator runs only images \
                 matching {}; ask its administrator to allow it, or use an allowed image",
                if patterns.is_empty() {
                    "nothing (the allow-list is empty)".to_string()
                } else {
                    patterns.join(", ")
                }
            ))
        }
    }

    /// The owning Continuation, or the status to report without it.
    async fn owner(&self, token: &ContinuationToken) -> Step<Owner> {
        let api: Api<Continuation> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.get_opt(token.as_str()).await {
            Ok(Some(c)) => match c.metadata.uid {
                Some(uid) => Step::Go(Owner {
                    name: token.0.clone(),
                    uid,
                }),
                None => Step::Done(RunStatus::InFlight),
            },
            Ok(None) => Step::Done(RunStatus::Finished(ToolResult::error(format!(
                "the call's Continuation {token} does not exist in namespace {}: each tool Job is \
                 owned by the Continuation of its call",
                self.namespace
            )))),
            Err(e) => Step::Done(api_failure(
                &format!("reading Continuation {}/{token}", self.namespace),
                e,
            )),
        }
    }

    /// Creates the attempt's Job, or adopts the one that exists, and
    /// reports how it stands.
    pub async fn start_isolated(
        &self,
        spec: &IsolationSpec,
        envelope: &CallEnvelope,
        attempt: u32,
        timeout: Duration,
    ) -> RunStatus {
        let token = &envelope.token;
        if let Err(e) = self.check_image(&spec.image) {
            return RunStatus::Finished(ToolResult::error(e));
        }
        let owner = match self.owner(token).await {
            Step::Go(o) => o,
            Step::Done(s) => return s,
        };
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        let name = job_name(token, attempt);
        match jobs.get_opt(&name).await {
            Ok(Some(job)) => return self.status_of(&job, token, &owner).await,
            Ok(None) => {}
            Err(e) => return api_failure(&format!("reading Job {name}"), e),
        }
        let source = match self.envelope_source(envelope, &name, &owner).await {
            Step::Go(s) => s,
            Step::Done(s) => return s,
        };
        let job = match self.build_job(envelope, spec, attempt, timeout, &owner, &source) {
            Ok(j) => j,
            Err(e) => return RunStatus::Finished(ToolResult::error(e)),
        };
        match jobs.create(&PostParams::default(), &job).await {
            Ok(_) => {
                tracing::info!(job = %name, token = %token, attempt, "tool Job created");
                RunStatus::InFlight
            }
            Err(kube::Error::Api(s)) if s.code == 409 => match jobs.get_opt(&name).await {
                Ok(Some(job)) => self.status_of(&job, token, &owner).await,
                Ok(None) => RunStatus::InFlight,
                Err(e) => api_failure(&format!("reading Job {name}"), e),
            },
            Err(e) => self.create_failed(&format!("creating Job {name}"), e),
        }
    }

    /// Where the envelope goes: a pod annotation when it fits, else an
    /// owned ConfigMap (created here); too large for either is an error.
    async fn envelope_source(
        &self,
        envelope: &CallEnvelope,
        name: &str,
        owner: &Owner,
    ) -> Step<EnvelopeSource> {
        let text = serde_json::to_string(envelope).expect("envelopes serialise");
        if text.len() <= ANNOTATION_ENVELOPE_LIMIT {
            Step::Go(EnvelopeSource::Annotation(text))
        } else if text.len() <= CONFIGMAP_ENVELOPE_LIMIT {
            self.envelope_configmap(name, owner, text).await
        } else {
            Step::Done(RunStatus::Finished(ToolResult::error(format!(
                "the call's envelope is {} bytes; an isolated call takes at most {CONFIGMAP_ENVELOPE_LIMIT} \
                 (the arguments are too large)",
                text.len()
            ))))
        }
    }

    /// The attempt's Job as it stands, if it exists; creates nothing.
    pub async fn collect_isolated(&self, token: &ContinuationToken, attempt: u32) -> RunStatus {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        let name = job_name(token, attempt);
        let job = match jobs.get_opt(&name).await {
            Ok(Some(job)) => job,
            Ok(None) => return RunStatus::InFlight,
            Err(e) => return api_failure(&format!("reading Job {name}"), e),
        };
        match self.owner(token).await {
            Step::Go(owner) => self.status_of(&job, token, &owner).await,
            Step::Done(_) => RunStatus::InFlight,
        }
    }

    /// The call's result is recorded: its Jobs (every attempt) get their
    /// TTL and go with their pods once it passes.
    pub async fn release_jobs(&self, token: &ContinuationToken) {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        let selector = format!(
            "{LABEL_CONTINUATION}={},{TOOL_JOB_SELECTOR}",
            token_label(token)
        );
        let listed = match jobs.list(&ListParams::default().labels(&selector)).await {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!(%token, error = %e, "listing the call's Jobs to release them; they stay until the session goes");
                return;
            }
        };
        let ttl =
            json!({"spec": {"ttlSecondsAfterFinished": self.defaults.ttl_seconds_after_finished}});
        for job in listed.iter().filter(|j| {
            j.spec
                .as_ref()
                .is_some_and(|s| s.ttl_seconds_after_finished.is_none())
        }) {
            let name = job.metadata.name.clone().unwrap_or_default();
            if let Err(e) = jobs
                .patch(&name, &PatchParams::default(), &Patch::Merge(&ttl))
                .await
            {
                tracing::warn!(job = %name, error = %e, "giving the Job its TTL; it stays until the session goes");
            }
        }
    }

    async fn envelope_configmap(
        &self,
        name: &str,
        owner: &Owner,
        text: String,
    ) -> Step<EnvelopeSource> {
        let cm = self.envelope_configmap_object(name, owner, text);
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.create(&PostParams::default(), &cm).await {
            // Same name, same content: the name is derived from the attempt.
            Ok(_) => Step::Go(EnvelopeSource::ConfigMap(name.to_string())),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                Step::Go(EnvelopeSource::ConfigMap(name.to_string()))
            }
            Err(e) => Step::Done(self.create_failed(&format!("creating ConfigMap {name}"), e)),
        }
    }

    /// The attempt's result if its Job has ended, without creating anything.
    pub async fn result_of(&self, token: &ContinuationToken, attempt: u32) -> Option<ToolResult> {
        let owner = match self.owner(token).await {
            Step::Go(o) => o,
            Step::Done(RunStatus::Finished(r)) => return Some(r),
            Step::Done(RunStatus::InFlight | RunStatus::Task(_)) => return None,
        };
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        match jobs.get_opt(&job_name(token, attempt)).await {
            Ok(Some(job)) => match self.status_of(&job, token, &owner).await {
                RunStatus::Finished(r) => Some(r),
                RunStatus::InFlight | RunStatus::Task(_) => None,
            },
            _ => None,
        }
    }

    /// How an existing Job stands.
    async fn status_of(&self, job: &Job, token: &ContinuationToken, owner: &Owner) -> RunStatus {
        let name = job.metadata.name.clone().unwrap_or_default();
        let ours = job
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|r| r.controller == Some(true) && r.uid == owner.uid);
        if !ours {
            // A Job of an earlier Continuation with the same name (a session
            // deleted and re-created): the garbage collector removes it;
            // its deletion event brings the caller back.
            tracing::warn!(job = %name, "a Job of another Continuation has this name; waiting for its removal");
            return RunStatus::InFlight;
        }
        if let Some(msg) = job
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_FAILURE))
        {
            return RunStatus::Finished(ToolResult::error(msg.clone()));
        }
        let pods = match self.pods_of(job).await {
            Ok(p) => p,
            Err(e) => return api_failure(&format!("listing the pods of Job {name}"), e),
        };
        match judge(job, &pods, token, now_seconds(), self.defaults.stuck_grace) {
            Verdict::Running => RunStatus::InFlight,
            Verdict::Done(r) => RunStatus::Finished(r),
            Verdict::ReadLog { pod, pointer } => self.logged_result(&pod, token, &pointer).await,
            Verdict::Stuck(message) => self.give_up(&name, message).await,
        }
    }

    /// The result the tool framed in its pod's log, read only as far as
    /// its announced size needs.
    async fn logged_result(
        &self,
        pod: &str,
        token: &ContinuationToken,
        pointer: &ResultInLog,
    ) -> RunStatus {
        if pointer.bytes > MAX_LOGGED_RESULT_BYTES {
            return RunStatus::Finished(ToolResult::error(format!(
                "the tool's result is announced as {} bytes; at most {MAX_LOGGED_RESULT_BYTES} are read from its log",
                pointer.bytes
            )));
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.logs(pod, &log_window(pointer.bytes)).await {
            Ok(log) => RunStatus::Finished(result_from_log(&log, token, pointer)),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                RunStatus::Finished(ToolResult::error(format!(
                    "the tool's result was in the log of pod {pod}, which is gone: {}",
                    s.message
                )))
            }
            Err(e) => api_failure(&format!("reading the log of pod {pod}"), e),
        }
    }

    async fn pods_of(&self, job: &Job) -> kube::Result<Vec<Pod>> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let selector = match job.metadata.uid.as_deref() {
            Some(uid) => format!("batch.kubernetes.io/controller-uid={uid}"),
            None => format!(
                "batch.kubernetes.io/job-name={}",
                job.metadata.name.as_deref().unwrap_or_default()
            ),
        };
        Ok(api
            .list(&ListParams::default().labels(&selector))
            .await?
            .items)
    }

    /// Records why the attempt failed on its Job and ends the Job (a
    /// deadline of 1 s makes the Job controller stop it), so the answer
    /// stays the same for every later call. One write.
    async fn give_up(&self, name: &str, message: String) -> RunStatus {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.namespace);
        let patch = json!({
            "metadata": {"annotations": {ANNOTATION_FAILURE: message}},
            "spec": {"activeDeadlineSeconds": 1},
        });
        match jobs
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::info!(job = %name, %message, "tool Job given up");
                RunStatus::Finished(ToolResult::error(message))
            }
            Err(e) => api_failure(&format!("recording the failure on Job {name}"), e),
        }
    }
}

fn now_seconds() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

/// The most bytes of result a tool's log may carry (the largest result a
/// session keeps, with room): the log is read only this far.
pub const MAX_LOGGED_RESULT_BYTES: usize = 24 * 1024 * 1024;

/// The end of the tool container's log where a result of `bytes` is
/// framed (the wrapper writes it last), bounded in lines and bytes: a tool
/// that writes gigabytes to its log is never read whole.
fn log_window(bytes: usize) -> LogParams {
    // The block's lines (each at least a line's bytes less a character),
    // its begin and end lines, and a few more (the kubelet may split).
    let lines = bytes.div_ceil(super::wrapper_protocol::FRAME_LINE_BYTES - 3) + 4;
    LogParams {
        container: Some(TOOL_CONTAINER.into()),
        tail_lines: Some(lines as i64),
        limit_bytes: Some((bytes * 2 + 64 * 1024) as i64),
        ..Default::default()
    }
}

impl RunnerPort for JobRunner {
    fn start<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, RunStatus> {
        Box::pin(async move {
            match kind {
                RunKind::Isolated(spec) => {
                    self.start_isolated(spec, envelope, attempt, timeout).await
                }
                RunKind::Background | RunKind::SubAgent(_) => {
                    RunStatus::Finished(ToolResult::error(
                        "the Job runner runs isolated calls only; runAsync calls and sub-agents run in the operator",
                    ))
                }
            }
        })
    }

    fn collect<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
    ) -> BoxFuture<'a, RunStatus> {
        Box::pin(async move {
            match kind {
                RunKind::Isolated(_) => self.collect_isolated(&envelope.token, attempt).await,
                RunKind::Background | RunKind::SubAgent(_) => RunStatus::InFlight,
            }
        })
    }

    fn release<'a>(&'a self, token: &'a ContinuationToken) -> BoxFuture<'a, ()> {
        Box::pin(self.release_jobs(token))
    }
}

/// Whether `image` matches one of the allow-list's glob patterns.
fn image_allowed(patterns: &[String], image: &str) -> bool {
    let options = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: false,
    };
    let full = full_image_reference(image);
    patterns.iter().any(|p| {
        p == "*"
            || glob::Pattern::new(p).is_ok_and(|p| {
                !image.contains("..")
                    && (p.matches_with(image, options) || p.matches_with(&full, options))
            })
    })
}

/// `busybox` as `docker.io/library/busybox:latest`, `acme/tool` as
/// `docker.io/acme/tool:latest`, the registry host in lower case: the
/// reference a container runtime pulls.
fn full_image_reference(image: &str) -> String {
    let (first, rest) = image.split_once('/').unwrap_or(("", image));
    let is_host = first.contains('.') || first.contains(':') || first == "localhost";
    let named = match (first.is_empty(), is_host) {
        (true, _) => format!("docker.io/library/{rest}"),
        (false, true) => format!("{}/{rest}", first.to_ascii_lowercase()),
        (false, false) => format!("docker.io/{image}"),
    };
    let last = named.rsplit('/').next().unwrap_or_default();
    if last.contains(':') || last.contains('@') {
        named
    } else {
        format!("{named}:latest")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::fixtures;

    pub(super) fn token() -> ContinuationToken {
        ContinuationToken("demo-t1-c0".into())
    }

    pub(super) fn envelope(args: &str) -> CallEnvelope {
        fixtures::envelope("demo", args)
    }

    #[test]
    fn the_log_is_read_only_as_far_as_the_result_needs() {
        let p = log_window(40_000);
        assert_eq!(p.tail_lines, Some(14));
        assert_eq!(p.limit_bytes, Some(80_000 + 64 * 1024));
        let most = log_window(MAX_LOGGED_RESULT_BYTES);
        assert!(most.limit_bytes.unwrap() < 64 * 1024 * 1024);
    }

    #[test]
    fn job_names_are_labels_stable_and_distinct() {
        let t = token();
        assert_eq!(job_name(&t, 1), job_name(&t, 1));
        assert_ne!(job_name(&t, 1), job_name(&t, 2));
        assert!(job_name(&t, 1).starts_with("demo-t1-c0-a1-"));
        let long = ContinuationToken(format!("{}-t1-c0", "x".repeat(80)));
        let other = ContinuationToken(format!("{}-t1-c1", "x".repeat(80)));
        for t in [&long, &other] {
            let n = job_name(t, 12);
            assert!(n.len() <= 63, "{n}");
            assert!(n
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
        }
        assert_ne!(job_name(&long, 1), job_name(&other, 1));
        assert_eq!(token_label(&t), "demo-t1-c0");
        assert!(token_label(&ContinuationToken("Bad/Token".into())).starts_with("h-"));
    }

    pub(super) async fn runner() -> JobRunner {
        // Building a Job needs no server; a client pointing nowhere will do.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        JobRunner::new(
            Client::try_from(config).unwrap(),
            "ns",
            "agents.local/agents:test",
            JobDefaults::default(),
        )
    }

    #[tokio::test]
    async fn only_allowed_images_run() {
        let r = runner().await;
        assert!(r.check_image("anything:1").is_ok(), "no list: any image");
        let r = JobRunner::new(
            r.client.clone(),
            "ns",
            "agents:1",
            JobDefaults {
                allowed_images: Some(vec!["agents.local/*".into(), "ghcr.io/acme/tool:v?".into()]),
                ..JobDefaults::default()
            },
        );
        assert!(r.check_image("agents.local/busybox:ci").is_ok());
        assert!(r.check_image("ghcr.io/acme/tool:v1").is_ok());
        // `*` does not cross a `/`, and `..` never passes.
        for refused in ["agents.local/evil/busybox:ci", "agents.local/../busybox:ci"] {
            assert!(r.check_image(refused).is_err(), "{refused}");
        }
        let e = r.check_image("docker.io/library/alpine:3").unwrap_err();
        assert!(
            e.contains("not allowed") && e.contains("agents.local/*"),
            "{e}"
        );
        assert_eq!(r.with_namespace("other").namespace(), "other");
    }

    #[test]
    fn a_quotas_refusal_is_told_apart_from_rbacs() {
        let forbidden = |message: &str| {
            kube::Error::Api(
                kube::core::Status::failure(message, "Forbidden")
                    .with_code(403)
                    .boxed(),
            )
        };
        let quota = forbidden(
            "jobs.batch \"q-t1-c1-a0\" is forbidden: exceeded quota: one-job, requested: \
             count/jobs.batch=1, used: count/jobs.batch=1, limited: count/jobs.batch=1",
        );
        assert!(exceeded_quota(&quota).is_some_and(|m| m.contains("limited: count/jobs.batch=1")));
        let rbac = forbidden("jobs.batch is forbidden: User \"x\" cannot create resource \"jobs\"");
        assert_eq!(exceeded_quota(&rbac), None);
        let counting = forbidden(
            "jobs.batch \"j\" is forbidden: status unknown for quota: one-job, resources: count/jobs.batch",
        );
        assert!(exceeded_quota(&counting).is_some());
        // A quota that waiting will not satisfy is an error result, named
        // as the quota's, not RBAC's.
        let unmet = forbidden("pods \"p\" is forbidden: failed quota: q: must specify limits.cpu");
        assert_eq!(exceeded_quota(&unmet), None);
        let RunStatus::Finished(ToolResult::Error { message }) =
            api_failure("creating Job j", unmet)
        else {
            panic!("an error result")
        };
        assert!(
            message.contains("the namespace's ResourceQuota refuses it: pods"),
            "{message}"
        );
        let RunStatus::Finished(ToolResult::Error { message }) =
            api_failure("creating Job j", rbac)
        else {
            panic!("an error result")
        };
        assert!(message.contains("RBAC rules"), "{message}");
        let invalid = kube::Error::Api(
            kube::core::Status::failure("exceeded quota", "Invalid")
                .with_code(422)
                .boxed(),
        );
        assert_eq!(exceeded_quota(&invalid), None);
    }

    #[test]
    fn images_are_compared_in_full() {
        let list = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            full_image_reference("busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            full_image_reference("acme/tool:v2"),
            "docker.io/acme/tool:v2"
        );
        assert_eq!(
            full_image_reference("GHCR.io/acme/t@sha256:ab"),
            "ghcr.io/acme/t@sha256:ab"
        );
        assert!(image_allowed(&list(&["docker.io/library/*"]), "busybox"));
        assert!(!image_allowed(
            &list(&["docker.io/library/*"]),
            "acme/busybox"
        ));
        assert!(image_allowed(&list(&["*"]), "any/thing/at:all"));
        assert!(!image_allowed(
            &list(&["ghcr.io/acme/*"]),
            "ghcr.io/acme/x/y:1"
        ));
    }
}
