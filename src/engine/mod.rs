//! One engine step, shared by every driver.
//!
//! A step: load the session and its continuations, feed what the outside
//! wrote (new user messages, pause, retry, results, decisions) into the
//! core as events, drain the core's actions performing each through the
//! [`ports`], checkpoint with compare-and-swap, and return a
//! [`StepOutcome`] with a wake-up time.
//!
//! # What a driver provides
//!
//! - the ports ([`Ports`]): session store, continuations, result cache,
//!   model, in-step tools, background/isolated runner, clock, observer;
//! - an [`AgentRuntime`]: the session config built from the agent, its system
//!   prompt and tool schemas;
//! - a [`Holder`] naming itself, and a [`Roles`] saying which work it runs.
//!
//! `agents run` loops over [`step`] (sleeping on `Busy`, stopping on
//! `Waiting`); the operator's reconcile is one call, requeued at the
//! outcome's time. Nothing else decides what a session does.
//!
//! # Exactly once
//!
//! The core claims work (holder and expiry) in the checkpoint that starts
//! it; the step performs a start only after that checkpoint committed. A
//! driver that loses the compare-and-swap reloads and sees the winner's
//! claim, so it leaves that work alone. Results it already obtained are
//! replayed onto the reloaded state, never lost.

pub mod events;
pub mod failure;
pub mod holder;
mod perform;
mod spans;
mod tasks;
pub use crate::ports;
use perform::*;

pub use holder::Holder;
pub use ports::*;

use crate::core::session::Outlook;
use crate::core::{
    Action, CallState, ContinuationToken, DriverRole, Event, Scope, Session, SessionConfig,
    SessionId, SessionState, ToolResult, ToolSchema, WaitingFor,
};
pub use events::{Progress, Provenance, Work};
pub use failure::{fail, step_failed, Failing, MAX_FAILED_STEPS};
use std::time::Duration;
use tracing::{debug, info, warn};

/// Reloads after a lost compare-and-swap before the step gives up.
const MAX_CONFLICTS: usize = 16;
/// How long a checkpoint waits for a store that is unavailable for now.
const CHECKPOINT_PATIENCE: Duration = Duration::from_secs(90);

/// Which kinds of work this driver starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Roles {
    /// Calls the model and runs `runSync` tools.
    pub model: bool,
    pub background: bool,
    pub isolated: bool,
}

impl Roles {
    pub const ALL: Roles = Roles {
        model: true,
        background: true,
        isolated: true,
    };
}

/// The agent as the engine needs it.
#[derive(Clone, Debug)]
pub struct AgentRuntime {
    pub config: SessionConfig,
    pub system_prompt: String,
    pub tools: Vec<ToolSchema>,
}

/// Receives what a step does, for a terminal, logs, Events or metrics.
pub trait Observer: Send + Sync {
    fn observe(&self, progress: &Progress);
    /// Work is about to begin (for observers that time it); most ignore it.
    fn began(&self, work: &Work<'_>) {
        let _ = work;
    }
}

impl<F: Fn(&Progress) + Send + Sync> Observer for F {
    fn observe(&self, progress: &Progress) {
        self(progress)
    }
}

#[derive(Clone, Copy)]
pub struct Ports<'a> {
    pub sessions: &'a dyn SessionPort,
    pub continuations: &'a dyn ContinuationPort,
    pub cache: &'a dyn CachePort,
    pub model: &'a dyn ModelPort,
    pub tools: &'a dyn ToolPort,
    pub runner: &'a dyn RunnerPort,
    pub clock: &'a dyn Clock,
    pub observer: &'a dyn Observer,
    /// Where the step's spans go ([`NoTraces`]: nowhere).
    pub tracer: &'a dyn TracePort,
}

impl<'a> Ports<'a> {
    /// A step's ports over one store (sessions, continuations and cache
    /// alike), on the wall clock: what both drivers run.
    pub fn over_store(
        store: &'a dyn StorePorts,
        model: &'a dyn ModelPort,
        tools: &'a dyn ToolPort,
        runner: &'a dyn RunnerPort,
        observer: &'a dyn Observer,
    ) -> Self {
        Ports {
            sessions: store,
            continuations: store,
            cache: store,
            model,
            tools,
            runner,
            clock: &SystemClock,
            observer,
            tracer: &NoTraces,
        }
    }

    /// The same ports, the step's spans going to `tracer`.
    pub fn traced(self, tracer: &'a dyn TracePort) -> Self {
        Ports { tracer, ..self }
    }
}

/// How a step ended: the core's [`Outlook`] once the actions are done.
/// `Busy { at }`: step again then; `Waiting { wake_at }`: only the outside
/// moves the session on (check deadlines at `wake_at`).
pub type StepOutcome = Outlook;

/// What a step returns: the outcome and the state it left.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub outcome: StepOutcome,
    pub state: SessionState,
    /// Checkpoints written by this step.
    pub writes: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("session {0} kept changing under this driver ({MAX_CONFLICTS} reloads); try again")]
    TooManyConflicts(SessionId),
    /// This driver may no longer start work (its Lease lapsed): the claim
    /// it committed stays, and the driver that leads now takes it over.
    #[error("not starting work on session {session}: {why}")]
    Fenced { session: SessionId, why: String },
}

/// One engine step on session `id`.
pub async fn step(
    ports: &Ports<'_>,
    id: &SessionId,
    agent: &AgentRuntime,
    holder: &Holder,
    roles: Roles,
) -> Result<StepReport, EngineError> {
    let recorder = spans::StepRecorder::new(ports, agent);
    let traced = Ports {
        observer: &recorder,
        ..*ports
    };
    let result = step_until_saved(&traced, &recorder, id, agent, holder, roles).await;
    recorder.finish(&result);
    result
}

/// The step, reloaded and replayed after each lost compare-and-swap.
async fn step_until_saved(
    ports: &Ports<'_>,
    recorder: &spans::StepRecorder<'_>,
    id: &SessionId,
    agent: &AgentRuntime,
    holder: &Holder,
    roles: Roles,
) -> Result<StepReport, EngineError> {
    let mut replay: Vec<Event> = Vec::new();
    for _ in 0..MAX_CONFLICTS {
        let once = step_once(ports, recorder, id, agent, holder, roles, &mut replay);
        match once.await {
            Err(EngineError::Store(StoreError::Conflict { .. })) => {
                debug!(session = %id, replay = replay.len(), "checkpoint conflict; reloading");
                continue;
            }
            other => return other,
        }
    }
    Err(EngineError::TooManyConflicts(id.clone()))
}

/// The events that bring the stored input (spec) into the core.
pub fn input_events(record: &SessionRecord, state: &SessionState) -> Vec<Event> {
    let mut events = Vec::new();
    if record.input.paused && !state.paused {
        events.push(Event::Pause);
    }
    if record.input.retry > state.retries_taken {
        events.push(Event::Retry);
    }
    let taken = state.messages_taken as usize;
    for text in record.input.messages.iter().skip(taken) {
        events.push(Event::UserMessage { text: text.clone() });
    }
    if !record.input.paused && state.paused {
        events.push(Event::Resume);
    }
    events
}

/// The session as the next step would see it (input and outside results
/// applied), computed without writing: for `show` and `pending`.
pub fn preview_state(
    record: &SessionRecord,
    continuations: &[ContinuationRecord],
    agent: &AgentRuntime,
    now: crate::core::Millis,
) -> SessionState {
    let mut config = agent.config.clone();
    config.driver = DriverRole {
        holder: String::new(),
        dead_holders: Default::default(),
        model: false,
        background: false,
        isolated: false,
    };
    let mut session = Session::restore_quiet(record.state.clone(), config);
    for event in input_events(record, session.state()) {
        session.handle(event, now).ok();
    }
    let quiet = |_: &Progress| {};
    let deferred: Vec<(ContinuationToken, Option<WaitingFor>)> = session
        .state()
        .pending()
        .into_iter()
        .filter_map(|c| c.token().cloned().map(|t| (t, c.waiting_for())))
        .chain(budget_wait(session.state()))
        .collect();
    for (token, waiting) in deferred {
        if let Some(rec) = continuations.iter().find(|r| r.token() == &token) {
            apply_record(&quiet, &mut session, rec, waiting, now, None);
        }
    }
    session.into_state()
}

fn session_ref(record: &SessionRecord) -> SessionRef {
    SessionRef {
        id: record.state.id.clone(),
        namespace: record.namespace.clone(),
        uid: record.uid.clone(),
    }
}

fn claim_holders(state: &SessionState) -> Vec<&str> {
    let mut out: Vec<&str> = state
        .model_attempt
        .claim()
        .iter()
        .map(|c| c.holder.as_str())
        .collect();
    for c in state.open.iter().flat_map(|o| o.calls.iter()) {
        out.extend(c.claim().map(|c| c.holder.as_str()));
    }
    out
}

struct Checkpointer<'p> {
    sessions: &'p dyn SessionPort,
    clock: &'p dyn Clock,
    record: SessionRecord,
    version: Version,
    writes: u32,
    /// The step span's `traceparent`, stored with every checkpoint.
    trace: Option<String>,
}

impl Checkpointer<'_> {
    async fn save(
        &mut self,
        state: &SessionState,
        now: crate::core::Millis,
    ) -> Result<bool, StoreError> {
        if &self.record.state == state {
            return Ok(false);
        }
        let mut next = self.record.clone();
        next.state = state.clone();
        next.updated_at = now;
        if self.trace.is_some() {
            next.trace.clone_from(&self.trace);
        }
        match self.save_patiently(&next).await {
            Err(StoreError::TooLarge { id, why }) => {
                let reason = format!(
                    "the session outgrew its store ({why}); the last step's work was not kept. Make results smaller (the truncate decorator, spec.maxResultBytes) or start a new session"
                );
                self.fail_unstorable(state, reason, now).await?;
                Err(StoreError::TooLarge { id, why })
            }
            // Refused again at every retry, with the step's work (a tool
            // run, a model reply) lost each time: the session fails once.
            Err(StoreError::Refused { id, why }) => {
                let reason = format!(
                    "the store refused the session's state ({why}); the last step's work was not kept. If the operator is newer than the CRDs, apply the CRDs of its release (kubectl apply -f crds/), then retry the session"
                );
                self.fail_unstorable(state, reason, now).await?;
                Err(StoreError::Refused { id, why })
            }
            saved => {
                self.version = saved?;
                self.record = next;
                self.writes += 1;
                Ok(true)
            }
        }
    }

    /// The step's state (`attempted`) cannot be stored, and never will be:
    /// the session as last stored ends `Failed`, saying why. The step's work
    /// is not kept, and no later step asks the model (or runs a tool) for it
    /// again, nor takes the same messages or retry again (they would outgrow
    /// it again, step after step).
    async fn fail_unstorable(
        &mut self,
        attempted: &SessionState,
        reason: String,
        now: crate::core::Millis,
    ) -> Result<(), StoreError> {
        let mut failed = self.record.clone();
        failed.state.messages_taken = attempted.messages_taken;
        failed.state.retries_taken = attempted.retries_taken;
        failed.state.fail(reason);
        failed.updated_at = now;
        self.version = self.save_patiently(&failed).await?;
        self.record = failed;
        self.writes += 1;
        Ok(())
    }

    /// A checkpoint may carry what cannot be had again for free (a model's
    /// reply): see [`patiently`]. The write is a compare-and-swap, so a
    /// retry after a write that did land but whose answer was lost comes
    /// back as a conflict, and the step replays.
    async fn save_patiently(&self, next: &SessionRecord) -> Result<Version, StoreError> {
        patiently(self.clock, "checkpoint", || {
            self.sessions.save(next, &self.version)
        })
        .await
    }
}

/// Runs a store request, waiting out a store that is briefly away (an API
/// server restart, etcd restarting, a throttle) for up to
/// [`CHECKPOINT_PATIENCE`], on the step's clock. Every store request of a
/// step that has started work goes through it: a step that gave up between
/// a tool run and its checkpoint would run that tool again.
async fn patiently<'f, T>(
    clock: &dyn Clock,
    what: &str,
    mut request: impl FnMut() -> futures::future::BoxFuture<'f, Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let deadline = clock.now().0 + CHECKPOINT_PATIENCE.as_millis() as i64;
    let mut pause = Duration::from_millis(200);
    loop {
        match request().await {
            Err(e) if e.is_transient() && clock.now().0 + (pause.as_millis() as i64) < deadline => {
                warn!(error = %e, retry_in = ?pause, "{what} not done; retrying");
                let now = clock.now();
                clock
                    .sleep_until(crate::core::Millis(now.0 + pause.as_millis() as i64))
                    .await;
                pause = (pause * 2).min(Duration::from_secs(3));
            }
            other => return other,
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn step_once(
    p: &Ports<'_>,
    recorder: &spans::StepRecorder<'_>,
    id: &SessionId,
    agent: &AgentRuntime,
    holder: &Holder,
    roles: Roles,
    replay: &mut Vec<Event>,
) -> Result<StepReport, EngineError> {
    let loaded = load_existing(p, id).await?;
    let record = loaded.value;
    let trace = recorder.begin(&record);
    let owner = session_ref(&record);
    let sid = id.0.clone();
    let now = p.clock.now();
    // Waits already reported by the step that began them.
    let known_waits: Vec<(ContinuationToken, Option<WaitingFor>)> = record
        .state
        .pending()
        .into_iter()
        .filter_map(|c| c.token().cloned().map(|t| (t, c.waiting_for())))
        .chain(budget_wait(&record.state))
        .collect();
    let config = driven_config(agent, holder, roles, &record);
    let mut session = Session::restore_quiet(record.state.clone(), config);
    take_in(p, &record, &owner, &mut session, replay, now).await?;
    let mut cp = Checkpointer {
        sessions: p.sessions,
        clock: p.clock,
        record,
        version: loaded.version,
        writes: 0,
        trace,
    };
    let ctx = StepContext {
        agent,
        holder,
        owner: &owner,
        sid: &sid,
        known_waits: &known_waits,
        trace: cp
            .trace
            .as_deref()
            .and_then(crate::ports::TraceContext::parse),
    };
    let mut looked_again = false;
    loop {
        drain(p, &ctx, &mut session, &mut cp, replay, &mut looked_again).await?;
        session.step_succeeded();
        let now = p.clock.now();
        let state = session.state().clone();
        cp.save(&state, now).await?;
        replay.clear();
        let outcome = session.outlook(now);
        // A result may have landed while we worked: take it and go on.
        if matches!(outcome, Outlook::Waiting { .. })
            && absorb(p, &owner, &mut session, now).await?
        {
            session.replan(now);
            continue;
        }
        let budget = session.state().budget_stop.as_ref();
        observe_outcome(
            p.observer,
            &sid,
            &outcome,
            budget.map(|b| b.message.clone()),
        );
        debug!(session = %sid, ?outcome, writes = cp.writes, "step done");
        return Ok(StepReport {
            outcome,
            state: session.into_state(),
            writes: cp.writes,
        });
    }
}

/// How long a step waits for its own background runs to end before it
/// records the wait.
const QUICK_RUN_MILLIS: i64 = 25;

/// Most background runs are quick: one that ends within moments of its
/// start is taken before the step records its wait, which saves that
/// checkpoint and the step that would come back for the result.
async fn collect_quick_runs(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    replay: &mut Vec<Event>,
) -> Result<(), EngineError> {
    let now = p.clock.now();
    p.clock
        .sleep_until(crate::core::Millis(now.0 + QUICK_RUN_MILLIS))
        .await;
    for collect in session.collects() {
        perform(p, ctx, session, collect, replay).await?;
    }
    Ok(())
}

/// True when every open call is a background run this driver holds (so a
/// second look collects them and asks nothing else of anyone).
fn only_own_background_runs_open(session: &Session) -> bool {
    let me = &session.config().driver.holder;
    let pending = session.state().pending();
    !pending.is_empty()
        && pending.iter().all(|c| {
            c.waiting_for() == Some(WaitingFor::Background)
                && c.claim().is_some_and(|claim| &claim.holder == me)
        })
}

/// The stored session. A state that breaks the core's invariants never
/// gets here: the store refuses it while loading (`core::call::flat`).
async fn load_existing(
    p: &Ports<'_>,
    id: &SessionId,
) -> Result<Versioned<SessionRecord>, EngineError> {
    let loaded = p
        .sessions
        .load(id)
        .await?
        .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
    Ok(loaded)
}

/// The agent's config as this driver runs it: keys scoped to the session,
/// claims named for `holder`, and only the work `roles` allows.
fn driven_config(
    agent: &AgentRuntime,
    holder: &Holder,
    roles: Roles,
    record: &SessionRecord,
) -> SessionConfig {
    let mut config = agent.config.clone();
    config.scope = Scope {
        namespace: record.namespace.clone(),
        uid: record.uid.clone(),
    };
    config.driver = DriverRole {
        holder: holder.name().to_string(),
        dead_holders: holder.dead_among(claim_holders(&record.state)),
        model: roles.model,
        background: roles.background,
        isolated: roles.isolated,
    };
    config
}

/// Feeds the core what happened since the last checkpoint: the user's
/// input, outside results and decisions, and the events of a step that
/// lost its compare-and-swap (replayed, never asked for again).
async fn take_in(
    p: &Ports<'_>,
    record: &SessionRecord,
    owner: &SessionRef,
    session: &mut Session,
    replay: &[Event],
    now: crate::core::Millis,
) -> Result<(), EngineError> {
    let sid = &record.state.id.0;
    for event in input_events(record, session.state()) {
        if let Event::UserMessage { text } = &event {
            p.observer.observe(&Progress::UserMessage {
                session: sid.clone(),
                text: text.clone(),
            });
        }
        refuse_logged(sid, "input", session.handle(event, now));
    }
    absorb(p, owner, session, now).await?;
    for event in replay.iter().cloned() {
        refuse_logged(sid, "replayed result", session.handle(event, now));
    }
    session.handle(Event::Tick, now).ok();
    session.replan(now);
    Ok(())
}

/// Performs the core's actions until it asks for none, checkpointing when
/// it says so.
async fn drain(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    cp: &mut Checkpointer<'_>,
    replay: &mut Vec<Event>,
    looked_again: &mut bool,
) -> Result<(), EngineError> {
    while let Some(action) = session.poll_action() {
        if !session.is_current(&action) {
            debug!(session = %ctx.sid, ?action, "skipping a start that is no longer current");
            continue;
        }
        if let Action::Checkpoint = action {
            if session.yields_next() && !*looked_again && only_own_background_runs_open(session) {
                *looked_again = true;
                collect_quick_runs(p, ctx, session, replay).await?;
            }
            let state = session.state().clone();
            cp.save(&state, p.clock.now()).await?;
            replay.clear();
            continue;
        }
        perform(p, ctx, session, action, replay).await?;
    }
    Ok(())
}

/// Tells the observer how the step left the session.
fn observe_outcome(observer: &dyn Observer, sid: &str, outcome: &Outlook, budget: Option<String>) {
    let session = sid.to_string();
    match outcome {
        Outlook::Succeeded { answer } => observer.observe(&Progress::Finished {
            session,
            answer: answer.clone(),
        }),
        Outlook::Failed { reason } => observer.observe(&Progress::Failed {
            session,
            reason: reason.clone(),
        }),
        Outlook::Paused => observer.observe(&Progress::Paused { session, budget }),
        _ => {}
    }
}

fn refuse_logged<T>(session: &str, what: &str, r: Result<T, crate::core::CoreError>) {
    if let Err(e) = r {
        warn!(session, what, reason = %e, "event refused");
    }
}

/// Feeds the core every decision and result that the continuation records
/// hold but the state does not: written by a user, a worker, a Job, or by
/// this driver just before a crash. True when anything changed.
async fn absorb(
    p: &Ports<'_>,
    owner: &SessionRef,
    session: &mut Session,
    now: crate::core::Millis,
) -> Result<bool, StoreError> {
    let open: Vec<(ContinuationToken, Option<WaitingFor>)> = session
        .state()
        .open
        .iter()
        .flat_map(|o| o.calls.iter())
        .filter(|c| c.state() == CallState::Deferred && c.has_continuation())
        .filter_map(|c| c.token().cloned().map(|t| (t, c.waiting_for())))
        .chain(budget_wait(session.state()))
        .collect();
    if open.is_empty() {
        return Ok(false);
    }
    let records = patiently(p.clock, "listing continuations", || {
        p.continuations.list_for(owner)
    })
    .await?;
    let before = session.state().clone();
    for (token, waiting) in open {
        let Some(rec) = records.iter().find(|r| r.token() == &token) else {
            continue;
        };
        let usage = recorded_child_usage(p, session, rec, waiting).await;
        apply_record(p.observer, session, rec, waiting, now, usage);
    }
    Ok(session.state() != &before)
}

/// The session's open question about a limit, as a wait.
fn budget_wait(state: &SessionState) -> Option<(ContinuationToken, Option<WaitingFor>)> {
    let ask = state.budget_ask.as_ref()?;
    Some((ask.token.clone(), Some(WaitingFor::Budget)))
}

/// Feeds the core a person's decision on the session's question about a
/// limit, with the raise they gave.
fn budget_decided(session: &mut Session, rec: &ContinuationRecord, now: crate::core::Millis) {
    let Some(dec) = &rec.decision else {
        return;
    };
    let decided = Event::BudgetDecided {
        token: rec.token().clone(),
        approved: dec.approved,
        by: dec.by.clone(),
        reason: dec.reason.clone(),
        raise: dec.raise.unwrap_or_default(),
    };
    let sid = session.state().id.0.clone();
    refuse_logged(&sid, "budget decision", session.handle(decided, now));
}

/// A child's answer recorded in its call's continuation before a crash:
/// the child's usage, read again, to be counted with the answer.
async fn recorded_child_usage(
    p: &Ports<'_>,
    session: &Session,
    rec: &ContinuationRecord,
    waiting: Option<WaitingFor>,
) -> Option<crate::core::TokenUsage> {
    if waiting != Some(WaitingFor::SubAgent) || rec.result.is_none() {
        return None;
    }
    let child = session.child_plan(rec.token())?;
    p.runner.child_usage(&child).await
}

/// Applies one continuation record's decision and result.
fn apply_record(
    observer: &dyn Observer,
    session: &mut Session,
    rec: &ContinuationRecord,
    waiting: Option<WaitingFor>,
    now: crate::core::Millis,
    child_usage: Option<crate::core::TokenUsage>,
) {
    if session.state().phase.is_final() {
        return;
    }
    let sid = session.state().id.0.clone();
    let token = rec.token().clone();
    if waiting == Some(WaitingFor::Budget) {
        budget_decided(session, rec, now);
        return;
    }
    if waiting == Some(WaitingFor::Approval) {
        if let Some(dec) = &rec.decision {
            refuse_logged(
                &sid,
                "decision",
                session.handle(
                    Event::Decide {
                        token: token.clone(),
                        approved: dec.approved,
                        by: dec.by.clone(),
                        reason: dec.reason.clone(),
                        arguments: dec.arguments.clone(),
                    },
                    now,
                ),
            );
        }
    }
    if let (Some(WaitingFor::Outcome), Some(dec)) = (waiting, &rec.decision) {
        // On a wait for an unknown outcome, an approval means "run it
        // again"; the core ignores one given to an earlier loss.
        if dec.approved {
            let again = Event::RunAgain {
                token: token.clone(),
                by: dec.by.clone(),
                decided_at: dec.at,
            };
            refuse_logged(&sid, "run-again answer", session.handle(again, now));
        }
    }
    let still_deferred = session.state().find_call(&token).is_some_and(|c| {
        c.state() == CallState::Deferred && c.waiting_for() != Some(WaitingFor::Approval)
    });
    if let (Some(result), true) = (&rec.result, still_deferred) {
        let by = rec.completed_by.clone().unwrap_or_default();
        let wake = Event::Wake {
            token: token.clone(),
            result: result.clone(),
            by: by.clone(),
        };
        let woke = session.handle(perform::with_child_usage(wake, child_usage), now);
        if woke.is_ok() {
            if let Some(at) = rec.completed_at {
                observer.observe(&Progress::Woke {
                    session: sid.clone(),
                    token: token.0.clone(),
                    waited_ms: (now.0 - at.0).max(0) as u64,
                });
            }
            observer.observe(&Progress::tool_result(
                &sid,
                &rec.spec.call_id,
                &rec.spec.tool_call,
                result,
                Provenance::Outside(by),
            ));
        } else {
            refuse_logged(&sid, "result", woke);
        }
    }
}

#[cfg(test)]
mod tests;
