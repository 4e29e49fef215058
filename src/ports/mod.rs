//! The ports: the traits the engine step performs its actions through, and
//! the records they carry ([`records`]). The engine and the agent layer use
//! them; adapters (stores, runners, model and tool clients) implement them,
//! and import nothing of the engine's. Each driver provides them: `agents run` over SQLite, the process runner and the
//! terminal; the operator over the API server, Jobs and Kubernetes Events.
//!
//! Futures are boxed and `Send`, so a step can run inside a kube-runtime
//! reconcile (which needs `Send + 'static` futures) and ports can be trait
//! objects (one model client per Agent, chosen at run time).

use crate::core::call::TaskHandle;
use crate::core::envelope::CallEnvelope;
use crate::core::session::ContinuationSpec;
use crate::core::{
    AgentTurn, CacheKey, ContinuationToken, IsolationSpec, Millis, SessionId, ToolCall, ToolResult,
    ToolSchema, Turn,
};
pub mod admin;
pub mod identity;
pub mod records;
pub mod status;
pub mod trace;

pub use admin::{AdminPort, AgentDocuments, AgentSource, InputChange};
use futures::future::BoxFuture;
pub use identity::{Fence, HostProcesses, OperatorIdentity, ProcessIdentity};
pub use records::*;
pub use status::{StateConditions, StatusReport};
use std::time::Duration;
pub use trace::{ModelIdentity, NoTraces, StepTrace, TraceContext, TracePort};

/// The session's identity outside the process: children are adopted only
/// when they belong to this very session (same unique id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRef {
    pub id: SessionId,
    pub namespace: String,
    pub uid: String,
}

/// Where session state lives: load, and save with compare-and-swap.
pub trait SessionPort: Send + Sync {
    fn load<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Option<Versioned<SessionRecord>>>>;
    /// Saves if the stored version is still `expected`; otherwise
    /// `StoreError::Conflict`.
    fn save<'a>(
        &'a self,
        record: &'a SessionRecord,
        expected: &'a Version,
    ) -> BoxFuture<'a, StoreResult<Version>>;
}

/// Continuations: created or adopted by deterministic name; results and
/// decisions written once.
pub trait ContinuationPort: Send + Sync {
    fn ensure<'a>(
        &'a self,
        owner: &'a SessionRef,
        spec: &'a ContinuationSpec,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<ContinuationRecord>>;
    fn list_for<'a>(
        &'a self,
        owner: &'a SessionRef,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>>;
    fn complete<'a>(
        &'a self,
        token: &'a ContinuationToken,
        result: &'a ToolResult,
        by: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>>;
    fn decide<'a>(
        &'a self,
        token: &'a ContinuationToken,
        decision: &'a Decision,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>>;
}

/// A store that serves a step's sessions, continuations and cache.
pub trait StorePorts: SessionPort + ContinuationPort + CachePort {}

impl<T: SessionPort + ContinuationPort + CachePort> StorePorts for T {}

/// Results of calls with the `cache` decorator (keys carry their scope).
pub trait CachePort: Send + Sync {
    fn lookup<'a>(&'a self, key: &'a CacheKey) -> BoxFuture<'a, StoreResult<Option<ToolResult>>>;
    fn remember<'a>(
        &'a self,
        key: &'a CacheKey,
        result: &'a ToolResult,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<()>>;
}

/// What the model sees.
#[derive(Clone, Copy, Debug)]
pub struct ModelInput<'a> {
    pub system_prompt: &'a str,
    pub turns: &'a [Turn],
    pub tools: &'a [ToolSchema],
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelFailure {
    pub message: String,
    pub retryable: bool,
    pub retry_after: Option<Duration>,
}

pub trait ModelPort: Send + Sync {
    fn reply<'a>(&'a self, input: ModelInput<'a>)
        -> BoxFuture<'a, Result<AgentTurn, ModelFailure>>;

    /// Which model this is, for traces.
    fn identity(&self) -> ModelIdentity {
        ModelIdentity::default()
    }
}

/// How a tool run ended: with its result, or (an MCP server's answer)
/// with a task to poll for it.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolRun {
    Done(ToolResult),
    Task(TaskHandle),
}

/// What a poll of an MCP task found.
#[derive(Clone, Debug, PartialEq)]
pub enum TaskPoll {
    /// Still working; poll again after `poll_ms` (the server's latest
    /// word, or the handle's).
    Working,
    /// Not asked now (its interval has not passed) or not reached this
    /// once: what the task last said (a request for input) still stands.
    NoNews,
    /// Waits for answers to these requests (`inputRequests`, JSON).
    AsksForInput(String),
    /// Ended: the tool's result, or an error saying how the task failed,
    /// was cancelled or was lost.
    Ended(ToolResult),
}

/// Tools that run inside the step (`runSync`): builtins and HTTP.
pub trait ToolPort: Send + Sync {
    fn run<'a>(
        &'a self,
        call: &'a ToolCall,
        idempotency_key: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, ToolRun>;

    /// How the task `call` became is doing (`tasks/get`), after giving
    /// it `answers` (`inputResponses`, JSON) where there are some. Reads
    /// only, apart from the answers.
    fn poll_task<'a>(
        &'a self,
        call: &'a ToolCall,
        task: &'a TaskHandle,
        answers: Option<&'a str>,
    ) -> BoxFuture<'a, TaskPoll> {
        let _ = (task, answers);
        let name = call.name.clone();
        Box::pin(async move {
            TaskPoll::Ended(ToolResult::error(format!(
                "tool {name:?} cannot have tasks here"
            )))
        })
    }

    /// Who served `call`'s latest result when it was not run but had
    /// otherwise ([`REPLAY_RUNS`]: a replay's recording); `None`: it ran.
    fn served_by(&self, call: &ToolCall) -> Option<&'static str> {
        let _ = call;
        None
    }

    /// The task is no longer wanted (`tasks/cancel`); best effort.
    fn cancel_task<'a>(&'a self, call: &'a ToolCall, task: &'a TaskHandle) -> BoxFuture<'a, ()> {
        let _ = (call, task);
        Box::pin(async {})
    }
}

/// How a background or isolated attempt runs.
#[derive(Clone, Copy, Debug)]
pub enum RunKind<'a> {
    /// `runAsync`: in the driver's process, outside the step.
    Background,
    /// `runIsolated`: a Job in a cluster, a process standalone.
    Isolated(&'a IsolationSpec),
    /// A child Session (an `agent` tool): created if absent, adopted when
    /// this session owns it; finished when the child ends.
    SubAgent(&'a crate::core::session::subagent::ChildPlan),
}

#[derive(Clone, Debug, PartialEq)]
pub enum RunStatus {
    /// The attempt ended (inline, or it had ended before this call).
    Finished(ToolResult),
    /// Under way; its end makes the driver step again (a watch, a wake-up).
    InFlight,
    /// The attempt (an MCP tool's) was answered with a task: the call
    /// waits on it now.
    Task(TaskHandle),
}

/// Runs background and isolated attempts. `start` is idempotent per token
/// and attempt: a second call adopts the run under way (or reports how it
/// ended), so a restarted step never starts an attempt twice.
pub trait RunnerPort: Send + Sync {
    fn start<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, RunStatus>;

    /// The result of an attempt already under way, if it has ended; never
    /// starts anything (a paused session collects, it does not start). A
    /// runner that cannot tell says `InFlight`: the attempt is taken up
    /// again at resume.
    fn collect<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
    ) -> BoxFuture<'a, RunStatus> {
        let _ = (kind, envelope, attempt);
        Box::pin(async { RunStatus::InFlight })
    }

    /// The call's result is recorded: what the runner kept for it (a Job
    /// and its pod) may now go. Runs once at most; a failure is the
    /// runner's to log.
    fn release<'a>(&'a self, token: &'a ContinuationToken) -> BoxFuture<'a, ()> {
        let _ = token;
        Box::pin(async {})
    }

    /// A sub-agent call's result is recorded: its child, if still running
    /// (the call timed out), is stopped. Runs once at most.
    fn release_child<'a>(&'a self, token: &'a ContinuationToken) -> BoxFuture<'a, ()> {
        let _ = token;
        Box::pin(async {})
    }

    /// The final token usage of a sub-agent call's child that has ended
    /// (`None`: not known, nothing is added to the parent's usage).
    fn child_usage<'a>(
        &'a self,
        child: &'a crate::core::session::subagent::ChildPlan,
    ) -> BoxFuture<'a, Option<crate::core::TokenUsage>> {
        let _ = child;
        Box::pin(async { None })
    }

    /// How results of this runner are labelled in progress lines.
    fn label(&self, kind: RunKind<'_>) -> &'static str {
        match kind {
            RunKind::Background => "runAsync",
            RunKind::Isolated(_) => "isolated",
            RunKind::SubAgent(_) => SUB_AGENT_RUNS,
        }
    }
}

/// The label of results a child Session gave (every runner uses it).
pub const SUB_AGENT_RUNS: &str = "subAgent";

/// The label of results a replay served from its recording instead of
/// running the tool (`agents session replay`): traces mark them `replayed`.
pub const REPLAY_RUNS: &str = "replay";

/// Time. Tests use a manual clock and sleep no real time.
pub trait Clock: Send + Sync {
    fn now(&self) -> Millis;
    fn sleep_until(&self, at: Millis) -> BoxFuture<'_, ()>;
}

/// The wall clock and tokio's timer.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        Millis(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
        )
    }
    fn sleep_until(&self, at: Millis) -> BoxFuture<'_, ()> {
        let wait = (at.0 - self.now().0).max(0) as u64;
        Box::pin(tokio::time::sleep(Duration::from_millis(wait)))
    }
}

/// A clock that moves only when told to, or when someone sleeps.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: std::sync::atomic::AtomicI64,
}

impl ManualClock {
    pub fn at(t: Millis) -> Self {
        ManualClock {
            now: std::sync::atomic::AtomicI64::new(t.0),
        }
    }
    pub fn advance(&self, millis: i64) {
        self.now
            .fetch_add(millis, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        Millis(self.now.load(std::sync::atomic::Ordering::SeqCst))
    }
    fn sleep_until(&self, at: Millis) -> BoxFuture<'_, ()> {
        self.now
            .fetch_max(at.0, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async {})
    }
}
