//! The standalone driver: the engine's ports over SQLite, the process
//! runner and the terminal, and the loop that steps a session until it
//! succeeds, fails, yields or is paused. Engine logic lives in
//! [`crate::engine`]; this file only adapts and loops.

use super::children::{self, ChildRunner};
use super::progress::{shell_quote, PendingCall, Progress};
use crate::agent::{AgentModel, AgentTools, RunnableAgent};
use crate::core::envelope::CallEnvelope;
use crate::core::session::DEFAULT_TOOL_TIMEOUT_SECS;
use crate::core::{Disposition, Millis, SessionId, SessionState, WaitingFor};
use crate::engine::{
    self, AgentRuntime, Clock, EngineError, Holder, Ports, Roles, RunKind, RunStatus, RunnerPort,
    SessionPort, StepOutcome, SystemClock,
};
use crate::ports::{AdminPort, ToolRun};
use crate::runner::container::ContainerRunner;
use crate::runner::ProcessRunner;
use crate::store::{ContinuationRecord, SessionRecord, StoreError};
use crate::tools::Toolbox;
use futures::future::BoxFuture;
use std::time::Duration;

pub fn now() -> Millis {
    SystemClock.now()
}

/// How a drive ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Succeeded {
        answer: String,
    },
    Failed {
        reason: String,
    },
    /// Every open call waits on the outside.
    Yielded {
        pending: Vec<PendingCall>,
    },
    Paused,
    /// Nothing to do (no user message yet).
    Idle,
}

#[derive(Clone, Debug, Default)]
pub struct DriveOptions {
    /// Which work this process starts (a worker: isolated runs only).
    pub roles: Option<Roles>,
    pub runner: ProcessRunner,
    /// Isolated tools with an image run here, never on the host.
    pub container: ContainerRunner,
    /// Shown in hints: the `--store` flag that reaches this store.
    pub store_flag: String,
    /// The sessions above a child driven in this process, its parent
    /// last: a pause of any of them pauses it too (between its steps), and
    /// their resume resumes it. A child's own pause is its own.
    pub held_by: Vec<SessionId>,
}

pub type DriveError = EngineError;

/// Background calls run inline with the agent's tools; isolated calls run
/// in a container when the tool has an image (never silently on the host),
/// as local processes otherwise. All finish before `start` returns.
struct LocalRunner<'a> {
    tools: &'a Toolbox,
    process: &'a ProcessRunner,
    container: &'a ContainerRunner,
    /// Sub-agent calls: child sessions in the same store, driven here.
    children: ChildRunner<'a>,
}

impl RunnerPort for LocalRunner<'_> {
    fn start<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, RunStatus> {
        Box::pin(async move {
            let result = match kind {
                RunKind::Background => {
                    let run = self
                        .tools
                        .start(
                            &envelope.tool_call,
                            &envelope.context.idempotency_key,
                            Some(timeout),
                        )
                        .await;
                    match run {
                        ToolRun::Done(result) => result,
                        ToolRun::Task(task) => return RunStatus::Task(task),
                    }
                }
                RunKind::Isolated(spec) if !spec.image.is_empty() => {
                    self.container
                        .run(envelope, spec, attempt, timeout)
                        .await
                        .result
                }
                RunKind::Isolated(spec) => {
                    self.process.run(envelope, spec, Some(timeout)).await.result
                }
                // Only a `timeout` decorator bounds a child: a child is no
                // tool run, and has no default time.
                RunKind::SubAgent(child) => {
                    let bound = envelope.policy.decorators.timeout_seconds.map(|_| timeout);
                    return self.children.start(child, bound).await;
                }
            };
            RunStatus::Finished(result)
        })
    }

    fn collect<'a>(
        &'a self,
        kind: RunKind<'a>,
        _envelope: &'a CallEnvelope,
        _attempt: u32,
    ) -> BoxFuture<'a, RunStatus> {
        match kind {
            RunKind::SubAgent(child) => self.children.collect(child),
            // Runs of this process end before `start` returns.
            _ => Box::pin(async { RunStatus::InFlight }),
        }
    }

    fn release_child<'a>(&'a self, token: &'a crate::core::ContinuationToken) -> BoxFuture<'a, ()> {
        self.children.release(token)
    }

    fn child_usage<'a>(
        &'a self,
        child: &'a crate::core::session::subagent::ChildPlan,
    ) -> BoxFuture<'a, Option<crate::core::TokenUsage>> {
        self.children.usage(child)
    }

    fn label(&self, kind: RunKind<'_>) -> &'static str {
        match kind {
            RunKind::Background => "runAsync",
            RunKind::Isolated(spec) if !spec.image.is_empty() => "container",
            RunKind::Isolated(_) => "process",
            RunKind::SubAgent(_) => crate::ports::SUB_AGENT_RUNS,
        }
    }
}

/// The agent as the engine needs it.
pub fn runtime(agent: &RunnableAgent) -> AgentRuntime {
    AgentRuntime {
        config: agent.config.clone(),
        system_prompt: agent.system_prompt.clone(),
        tools: agent.toolbox.schemas(),
    }
}

/// Steps the session, and the sub-agent sessions under it, until it
/// succeeds, fails, yields or is paused. A yield lists the waits of the
/// whole tree, each with its path from this session.
pub async fn drive(
    store: &dyn AdminPort,
    agent: &RunnableAgent,
    id: &SessionId,
    opts: &DriveOptions,
    report: &(dyn Fn(&Progress) + Send + Sync),
) -> Result<Outcome, DriveError> {
    let outcome = drive_session(store, agent, id, opts, report).await?;
    let Outcome::Yielded { mut pending } = outcome else {
        return Ok(outcome);
    };
    let roles = opts.roles.unwrap_or(Roles::ALL);
    pending.extend(children::waits_below(store, id, opts, roles).await?);
    report(&Progress::Yielded {
        session: id.0.clone(),
        pending: pending.clone(),
    });
    Ok(Outcome::Yielded { pending })
}

/// Steps one session until it succeeds, fails, yields or is paused (its
/// sub-agent calls drive their children on the way). Waits (without
/// writing) while another driver holds work, and sleeps through its own
/// retries' backoff. A yield is returned, not reported.
pub fn drive_session<'a>(
    store: &'a dyn AdminPort,
    agent: &'a RunnableAgent,
    id: &'a SessionId,
    opts: &'a DriveOptions,
    report: &'a (dyn Fn(&Progress) + Send + Sync),
) -> BoxFuture<'a, Result<Outcome, DriveError>> {
    Box::pin(drive_loop(store, agent, id, opts, report))
}

/// How soon a wait's deadline must be for `agents run` to wait for it
/// rather than yield: the rounding of a deadline to whole seconds.
const DEADLINE_GRACE_MS: i64 = 1_000;

async fn drive_loop(
    store: &dyn AdminPort,
    agent: &RunnableAgent,
    id: &SessionId,
    opts: &DriveOptions,
    report: &(dyn Fn(&Progress) + Send + Sync),
) -> Result<Outcome, DriveError> {
    let holder = cli_holder();
    let roles = opts.roles.unwrap_or(Roles::ALL);
    let rt = runtime(agent);
    let clock = SystemClock;
    let (mut woken_at, mut pause_seen) = (None, false);
    loop {
        if held_by_a_pause(store, &opts.held_by).await? {
            return Ok(Outcome::Paused);
        }
        let step = match local_step(store, agent, &rt, id, opts, &holder, roles, report).await {
            Ok(step) => step,
            Err(error) => return counted(store, id, error).await,
        };
        match step.outcome {
            StepOutcome::Succeeded { answer } => return Ok(Outcome::Succeeded { answer }),
            StepOutcome::Failed { reason } => return Ok(Outcome::Failed { reason }),
            StepOutcome::Paused => return Ok(Outcome::Paused),
            StepOutcome::Idle => return Ok(Outcome::Idle),
            StepOutcome::Busy { at } => {
                // Another driver's claim may end early (its work done):
                // look again at least every second; a look costs no write.
                let soon = Millis(clock.now().0 + 1000);
                clock.sleep_until(at.min(soon)).await;
            }
            // A sub-agent call that waited its turn (`maxChildren`) may
            // start now that a child of this process has ended (children
            // start with the model's role).
            StepOutcome::Waiting { .. }
                if roles.model && children::turn_is_free(&step.state, agent) => {}
            // A wait whose deadline has passed or is about to (a sub-agent
            // call stopped by its timeout in this process; deadlines are
            // kept in whole seconds, so the drive's bound can end just
            // before it): the next step, at the deadline, ends it and tells
            // the model. Once per deadline, so nothing loops.
            StepOutcome::Waiting {
                wake_at: Some(at), ..
            } if woken_at != Some(at)
                && at.0 <= clock.now().0 + DEADLINE_GRACE_MS
                && is_a_calls_deadline(&step.state, at) =>
            {
                woken_at = Some(at);
                clock.sleep_until(at).await;
            }
            // Paused while the step ran (its children stopped for it):
            // one more step records the pause and says so.
            StepOutcome::Waiting { .. }
                if !pause_seen && held_by_a_pause(store, std::slice::from_ref(id)).await? =>
            {
                pause_seen = true;
            }
            StepOutcome::Waiting { .. } => {
                let pending = pending_calls(&step.state, opts, roles);
                return Ok(Outcome::Yielded { pending });
            }
        }
    }
}

/// Whether `at` is the deadline of one of the open turn's calls (not a
/// retry's or a poll's time, which a later step moves on).
fn is_a_calls_deadline(state: &crate::core::SessionState, at: crate::core::Millis) -> bool {
    let calls = state.open.iter().flat_map(|o| o.calls.iter());
    calls.into_iter().any(|c| c.deadline() == Some(at))
}

/// Whether a session above this one (see [`DriveOptions::held_by`]) is
/// paused.
async fn held_by_a_pause(store: &dyn AdminPort, above: &[SessionId]) -> Result<bool, DriveError> {
    for id in above {
        let record = SessionPort::load(store, id).await?;
        if record.is_some_and(|r| r.value.input.paused) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// This CLI process as a claim holder: it judges the claims of other
/// processes on its host by their pids and start times.
fn cli_holder() -> Holder {
    Holder::cli(&crate::host::this_process(), crate::host::processes())
}

/// A step that failed for a reason of the session's own is counted in its
/// state, as the operator counts it: the eighth in a row (over every run
/// of it) fails the session.
async fn counted(
    store: &dyn AdminPort,
    id: &SessionId,
    error: DriveError,
) -> Result<Outcome, DriveError> {
    if !error.counts_against_the_session() {
        return Err(error);
    }
    match engine::step_failed(store, &SystemClock, id, &error.to_string()).await {
        Ok(engine::Failing::Failed { reason }) => Ok(Outcome::Failed { reason }),
        _ => Err(error),
    }
}

/// One engine step over the local ports (the store, the agent's model and
/// tools, the process and container runners, the wall clock).
#[allow(clippy::too_many_arguments)]
async fn local_step(
    store: &dyn AdminPort,
    agent: &RunnableAgent,
    rt: &AgentRuntime,
    id: &SessionId,
    opts: &DriveOptions,
    holder: &Holder,
    roles: Roles,
    report: &(dyn Fn(&Progress) + Send + Sync),
) -> Result<engine::StepReport, DriveError> {
    let model = AgentModel(&agent.model);
    let tools = AgentTools(&agent.toolbox);
    let runner = LocalRunner {
        tools: &agent.toolbox,
        process: &opts.runner,
        container: &opts.container,
        children: ChildRunner {
            store,
            parent: id,
            opts,
            report,
        },
    };
    let ports = Ports::over_store(store, &model, &tools, &runner, &report)
        .traced(crate::telemetry::tracer());
    engine::step(&ports, id, rt, holder, roles).await
}

/// Runs one step that starts no work: it takes in what the record's input
/// says (messages, pause, resume, retry) and checkpoints.
pub async fn sync_input(
    store: &dyn AdminPort,
    agent: &RunnableAgent,
    id: &SessionId,
) -> Result<SessionState, DriveError> {
    let none = Roles {
        model: false,
        background: false,
        isolated: false,
    };
    let quiet = |_: &Progress| {};
    let rt = runtime(agent);
    let opts = DriveOptions::default();
    let step = local_step(store, agent, &rt, id, &opts, &cli_holder(), none, &quiet).await?;
    Ok(step.state)
}

/// The session as the next step will see it (outside results applied),
/// without writing anything: for `show` and `pending` on a read-only store.
pub async fn preview(
    store: &dyn AdminPort,
    agent: &RunnableAgent,
    id: &SessionId,
) -> Result<SessionState, StoreError> {
    let loaded = SessionPort::load(store, id)
        .await?
        .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
    let owner = crate::engine::SessionRef {
        id: id.clone(),
        namespace: loaded.value.namespace.clone(),
        uid: loaded.value.uid.clone(),
    };
    let records = store.list_for(&owner).await?;
    Ok(engine::preview_state(
        &loaded.value,
        &records,
        &runtime(agent),
        now(),
    ))
}

/// The session's identity for its continuations.
pub fn owner_of(record: &SessionRecord) -> crate::engine::SessionRef {
    crate::engine::SessionRef {
        id: record.state.id.clone(),
        namespace: record.namespace.clone(),
        uid: record.uid.clone(),
    }
}

/// The open calls that wait on someone else, with the command that moves
/// each on.
pub fn pending_calls(state: &SessionState, opts: &DriveOptions, roles: Roles) -> Vec<PendingCall> {
    let sid = &state.id;
    let flag = if opts.store_flag.is_empty() {
        String::new()
    } else {
        format!(" {}", opts.store_flag)
    };
    state
        .pending()
        .into_iter()
        .filter(|c| !(roles.isolated && c.waiting_for() == Some(WaitingFor::Isolated)))
        // A child session's own waits are listed instead (`waits_below`).
        .filter(|c| c.waiting_for() != Some(WaitingFor::SubAgent))
        .filter_map(|c| {
            let token = c.token().cloned()?;
            // Names are checked, but a printed command is always quoted.
            let (token_q, sid_q) = (shell_quote(&token.0), shell_quote(&sid.0));
            let command = match (c.waiting_for(), &c.policy.disposition) {
                (Some(WaitingFor::Approval), _) => format!(
                    "agents session approve {token_q}{flag}   (or: agents session deny {token_q} --reason ...{flag})"
                ),
                (Some(WaitingFor::Isolated), Disposition::RunIsolated { .. }) => {
                    format!("agents session run-isolated {sid_q}{flag}")
                }
                // A background run cut off by a crash runs again on resume.
                (Some(WaitingFor::Background), _) => {
                    format!("agents session resume {sid_q}{flag}")
                }
                (Some(WaitingFor::McpTask), _) if c.task_asks().is_some() => format!(
                    "agents session answer {token_q} '<inputResponses JSON>'{flag}"
                ),
                (Some(WaitingFor::McpTask), _) => {
                    format!("agents session resume {sid_q}{flag}")
                }
                (Some(WaitingFor::Outcome), _) => format!(
                    "agents session complete {token_q} --text RESULT{flag}   (or, once you know it did not take effect: agents session run-again {token_q}{flag})"
                ),
                _ => format!("agents session complete {token_q} --text RESULT{flag}"),
            };
            Some(PendingCall {
                token: token.0,
                call: c.id.to_string(),
                tool: c.call.name.clone(),
                waiting_for: c.waiting_for(),
                reason: match (&c.policy.disposition, c.task_asks()) {
                    (_, Some(asks)) => Some(format!("the MCP task asks: {asks}")),
                    _ if c.lost_attempt().is_some() => {
                        crate::core::session::unknown_outcome_reason(c, DEFAULT_TOOL_TIMEOUT_SECS)
                    }
                    (Disposition::Defer { reason }, _) => Some(reason.clone()),
                    _ => None,
                },
                command,
                path: Vec::new(),
            })
        })
        .chain(budget_question(state, &flag))
        .collect()
}

/// The session's open question about its budget, and how to answer it.
fn budget_question(state: &SessionState, flag: &str) -> Option<PendingCall> {
    let ask = state.budget_ask.as_ref()?;
    let token_q = shell_quote(&ask.token.0);
    let limit = match ask.stop.limit {
        crate::core::budget::LimitKind::Tokens => "tokens",
        crate::core::budget::LimitKind::Cost => "cost",
        crate::core::budget::LimitKind::ToolCalls => "toolCalls",
    };
    Some(PendingCall {
        token: ask.token.0.clone(),
        call: "-".into(),
        tool: crate::core::session::BUDGET_TOOL.into(),
        waiting_for: Some(WaitingFor::Budget),
        reason: Some(ask.stop.message.clone()),
        command: format!(
            "agents session approve {token_q} --raise {limit}=N{flag}   (or: agents session deny {token_q} --reason ...{flag})"
        ),
        path: Vec::new(),
    })
}

/// The continuations an isolated worker could run.
pub fn isolated_work(records: &[ContinuationRecord]) -> Vec<&ContinuationRecord> {
    records
        .iter()
        .filter(|r| !r.is_completed() && r.spec.waiting_for == WaitingFor::Isolated)
        .collect()
}
