//! The session state machine: events in, actions out.
//!
//! A [`Session`] pairs the durable [`SessionState`] (what the store keeps)
//! with the agent's [`SessionConfig`] and a queue of [`Action`]s. Drivers
//! follow one loop, quinn-style:
//!
//! 1. `Session::restore(state, config, now)` after loading (it re-derives
//!    the actions the state implies, so a crash anywhere is recoverable);
//! 2. drain [`Session::poll_action`] and perform each action, feeding the
//!    outcome back with [`Session::handle`];
//! 3. on [`Action::Checkpoint`] persist the state before going on (the
//!    agent turn is stored before any of its tool calls runs);
//! 4. when the queue is empty, persist and sleep until
//!    [`Session::poll_timeout`] or the next outside event.

use super::call::{CallState, TrackedToolCall, WaitingFor};
use super::conversation::ToolResult;
use super::ids::{ContinuationToken, SessionId};
use super::time::Millis;
use calls::wake_time;
pub use spend::{BudgetAsk, BUDGET_TOOL};
use std::collections::VecDeque;

mod calls;
mod decisions;
mod model;
mod outcome;
mod protocol;
mod results;
mod scheduler;
mod spend;
mod state;
pub mod subagent;
mod task;
mod truncate;
pub use outcome::{reason as unknown_outcome_reason, tool_rule, OnUnknownOutcome};
pub use protocol::{Action, ContinuationSpec, CoreError, Event, Handled, WakeOutcome};
pub use state::{
    DriverRole, Limits, PartialUserTurn, Phase, Scope, SessionConfig, SessionState, ToolInfo,
    DEFAULT_MAX_CALLS_PER_REPLY,
};
pub use task::{next_poll, MAX_POLL_MS, MIN_POLL_MS, TASK_BY};
pub use truncate::{truncate, MAX_ERROR_BYTES};

/// How many times a failing model call is retried before the session fails
/// (the default of `spec.model.maxRetries`).
pub const MODEL_RETRIES: u32 = 4;
/// Default model call timeout (`spec.model.timeoutSeconds`).
pub const MODEL_TIMEOUT_SECS: u64 = 60;
/// A tool without a `timeout` decorator is stopped after this long, so a
/// claim on it always expires.
pub const DEFAULT_TOOL_TIMEOUT_SECS: u64 = 300;
/// Added to a claim beyond the work's own timeout: the holder has stopped
/// the work by then.
pub const CLAIM_GRACE_MILLIS: i64 = 15_000;
/// Default largest result kept (`spec.maxResultBytes`): 8 MiB.
pub const MAX_RESULT_BYTES: usize = 8 << 20;

#[derive(Clone, Debug)]
pub struct Session {
    state: SessionState,
    config: SessionConfig,
    actions: VecDeque<Action>,
    /// This step started a model call under namespace Budgets: the next
    /// waits for a new step, after the driver has counted this one's
    /// usage and sees the Budgets as they are now.
    budget_turn_taken: bool,
}

impl Session {
    pub fn new(id: SessionId, config: SessionConfig) -> Self {
        Session {
            state: SessionState::new(id),
            config,
            actions: VecDeque::new(),
            budget_turn_taken: false,
        }
    }

    /// Rebuilds a session from stored state and re-derives what it still
    /// has to do (at-least-once for steps that were under way).
    pub fn restore(state: SessionState, config: SessionConfig, now: Millis) -> Self {
        let mut s = Session::restore_quiet(state, config);
        s.replan(now);
        s
    }

    /// Rebuilds a session without planning any work: a driver first feeds
    /// it what the outside wrote, then calls [`Session::replan`].
    pub fn restore_quiet(state: SessionState, config: SessionConfig) -> Self {
        Session {
            state,
            config,
            actions: VecDeque::new(),
            budget_turn_taken: false,
        }
    }

    pub fn state(&self) -> &SessionState {
        &self.state
    }

    /// A driver's step ended well: failures in a row count from zero again.
    pub fn step_succeeded(&mut self) {
        self.state.failed_steps = 0;
    }

    pub fn into_state(self) -> SessionState {
        self.state
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When the core next needs a `Tick`: retries, timeouts, the deadline,
    /// and claims of other drivers that expire.
    pub fn poll_timeout(&self) -> Option<Millis> {
        if self.state.phase.is_final() {
            return None;
        }
        let mut times: Vec<Millis> = Vec::new();
        times.extend(self.config.limits.deadline);
        let paused = self.state.paused;
        if !paused && self.state.phase == Phase::AwaitingModel && self.config.driver.model {
            times.extend(wake_time(&self.state.model_attempt));
        }
        for c in self.state.open.iter().flat_map(|o| o.calls.iter()) {
            times.extend(c.deadline());
            if !paused && self.config.driver.runs(c) {
                times.extend(c.attempt().and_then(wake_time));
            }
        }
        times.into_iter().min()
    }

    /// What the session waits for once the action queue is empty: the
    /// driver's outcome, decided here and nowhere else.
    pub fn outlook(&self, now: Millis) -> Outlook {
        if let Some(settled) = self.settled_outlook() {
            return settled;
        }
        let Timers {
            own,
            mut deadlines,
            in_flight_here,
        } = self.timers(now);
        let pending = self.waited_on();
        if let Some(at) = own.iter().min().copied() {
            if !in_flight_here {
                // A deadline before our own work is looked at on time.
                let at = deadlines.iter().copied().fold(at, Millis::min);
                return Outlook::Busy { at };
            }
            deadlines.push(at);
        }
        Outlook::Waiting {
            pending,
            wake_at: deadlines.into_iter().min(),
        }
    }

    /// The outlook that needs no timers: finished, paused or idle.
    fn settled_outlook(&self) -> Option<Outlook> {
        match self.state.phase {
            Phase::Succeeded => Some(Outlook::Succeeded {
                answer: self.state.answer.clone().unwrap_or_default(),
            }),
            Phase::Failed => Some(Outlook::Failed {
                reason: self.state.failure.clone().unwrap_or_default(),
            }),
            _ if self.state.paused || self.state.budget_stop.is_some() => Some(Outlook::Paused),
            // Woken by the Budget's change or the end of its period.
            Phase::AwaitingModel if self.state.budget_exhausted.is_some() => Some(Outlook::Paused),
            Phase::Idle => Some(Outlook::Idle),
            _ => None,
        }
    }

    /// This driver's own due work and the times to look again, over the
    /// model and every open call.
    fn timers(&self, now: Millis) -> Timers {
        let mut timers = Timers::default();
        if self.state.phase == Phase::AwaitingModel && self.config.driver.model {
            let model = &self.state.model_attempt;
            timers.own.extend(model.retry_at());
            if self.budget_turn_taken && model.claim().is_none() {
                // The next turn, in the next step, after the count.
                timers.own.push(now);
            }
            timers.own.extend(
                model
                    .claim()
                    .filter(|c| self.blocked(c, now))
                    .map(|c| c.until),
            );
        }
        timers.deadlines.extend(self.config.limits.deadline);
        for c in self.state.open.iter().flat_map(|o| o.calls.iter()) {
            self.add_call_timers(c, now, &mut timers);
        }
        timers
    }

    /// Adds one open call's deadline, and, where this driver runs it, its
    /// poll, retry or claim.
    fn add_call_timers(&self, c: &TrackedToolCall, now: Millis, timers: &mut Timers) {
        timers.deadlines.extend(c.deadline());
        if let Some(task) = c.task().filter(|_| self.config.driver.runs(c)) {
            // Our poll: due work while the task works; while it asks
            // for input, a look now and then beside the person's answer.
            if c.waiting_for() == Some(WaitingFor::McpTask) {
                match c.task_asks() {
                    None => timers.own.push(next_poll(task, now)),
                    Some(_) => timers.deadlines.push(next_poll(task, now)),
                }
            }
            return;
        }
        if self.config.driver.runs(c) {
            timers.own.extend(c.retry_at());
            match c.claim() {
                Some(claim) if self.blocked(claim, now) => timers.own.push(claim.until),
                // Ours and under way elsewhere in this process (a
                // background task, a Job): its end wakes us; the claim's
                // expiry is the fallback.
                Some(claim) => {
                    timers.in_flight_here = true;
                    timers.deadlines.push(claim.until);
                }
                None => {}
            }
        }
    }

    /// The tokens the session waits on from outside or from work under way.
    fn waited_on(&self) -> Vec<ContinuationToken> {
        self.state
            .pending()
            .into_iter()
            .filter(|c| {
                !self.config.driver.runs(c) || c.claim().is_some() || c.task_asks().is_some()
            })
            .filter_map(|c| c.token().cloned())
            .chain(self.state.budget_ask.iter().map(|a| a.token.clone()))
            .collect()
    }

    pub fn handle(&mut self, event: Event, now: Millis) -> Result<Handled, CoreError> {
        if comes_from_outside(&event) && self.state.phase.is_final() {
            // A finished session takes no results or decisions: they stay
            // in their continuations, and a retry takes them then.
            return Ok(Handled::Wake(WakeOutcome::Unknown));
        }
        match event {
            Event::UserMessage { text } => self.on_user_message(text, now).map(|_| Handled::Done),
            Event::ModelReplied { turn } => {
                // Under namespace Budgets, one turn a step: the driver
                // counts it before the next one is checked.
                self.budget_turn_taken = !self.config.shared_budgets.is_empty();
                self.on_model_reply(turn, now).map(|_| Handled::Done)
            }
            Event::ModelFailed {
                error,
                retryable,
                retry_after_ms,
            } => {
                self.on_model_failed(error, retryable, retry_after_ms, now);
                Ok(Handled::Done)
            }
            Event::ToolFinished {
                call,
                result,
                from_cache,
            } => self
                .on_tool_finished(call, result, from_cache, now)
                .map(|_| Handled::Done),
            Event::AttemptFinished {
                token,
                attempt,
                result,
            } => self
                .on_attempt_finished(&token, attempt, result, now)
                .map(Handled::Wake),
            Event::TaskCreated {
                call,
                attempt,
                task,
            } => self
                .on_task_created(call, attempt, task, now)
                .map(|_| Handled::Done),
            Event::TaskAsks { token, asks } => {
                self.on_task_asks(&token, asks);
                Ok(Handled::Done)
            }
            Event::TaskEnded { token, result } => {
                self.on_task_ended(&token, result, now).map(Handled::Wake)
            }
            Event::Wake { token, result, by } => {
                self.on_wake(&token, result, &by, now).map(Handled::Wake)
            }
            Event::RunAgain {
                token, decided_at, ..
            } => self
                .on_run_again(&token, decided_at, now)
                .map(Handled::Wake),
            Event::Decide {
                token,
                approved,
                by,
                reason,
                arguments,
            } => self
                .on_decide(&token, (approved, by, reason, arguments), now)
                .map(Handled::Wake),
            Event::BudgetDecided {
                token,
                approved,
                by,
                reason,
                raise,
            } => Ok(Handled::Wake(self.on_budget_decided(
                &token,
                (approved, by, reason),
                raise,
                now,
            ))),
            Event::Tick => {
                self.on_tick(now);
                Ok(Handled::Done)
            }
            Event::Pause => {
                self.on_pause();
                Ok(Handled::Done)
            }
            Event::Resume => {
                self.on_resume(now);
                Ok(Handled::Done)
            }
            Event::Retry => self.on_retry(now).map(|_| Handled::Done),
            Event::ChildAnswered { answer, usage } => self.take_child_answer(*answer, usage, now),
        }
    }

    /// Wakes several tokens at once; each gets its own outcome, and one
    /// refused token does not stop the others.
    pub fn wake_many(
        &mut self,
        results: Vec<(ContinuationToken, ToolResult)>,
        by: &str,
        now: Millis,
    ) -> Vec<(ContinuationToken, Result<WakeOutcome, CoreError>)> {
        results
            .into_iter()
            .map(|(token, result)| {
                let outcome = self.on_wake(&token, result, by, now);
                (token, outcome)
            })
            .collect()
    }

    /// True when `action` still matches the state: a queued start whose
    /// call was answered meanwhile (from the cache, from outside) is stale.
    pub fn is_current(&self, action: &Action) -> bool {
        let deferred_attempt = |token: &ContinuationToken, attempt: u32| {
            self.state.find_call(token).is_some_and(|c| {
                c.state() == CallState::Deferred && c.attempts == attempt && c.retry_at().is_none()
            })
        };
        match action {
            Action::CallModel { .. } => {
                self.state.phase == Phase::AwaitingModel && !self.state.paused
            }
            Action::RunTool { call, .. } => self
                .state
                .open
                .iter()
                .flat_map(|o| o.calls.iter())
                .any(|c| {
                    c.id == *call && c.state() == CallState::Running && c.retry_at().is_none()
                }),
            Action::RunInBackground {
                envelope, attempt, ..
            } => deferred_attempt(&envelope.token, *attempt),
            Action::LaunchIsolated {
                envelope, attempt, ..
            }
            | Action::StartSubAgent {
                envelope, attempt, ..
            }
            | Action::Collect {
                envelope, attempt, ..
            } => deferred_attempt(&envelope.token, *attempt),
            Action::PollTask { envelope, task, .. } => {
                self.state.find_call(&envelope.token).is_some_and(|c| {
                    c.waiting_for() == Some(WaitingFor::McpTask) && c.task() == Some(task)
                })
            }
            _ => true,
        }
    }
}

/// What the session waits for when the queue is empty (see [`Session::outlook`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Outlook {
    Succeeded {
        answer: String,
    },
    Failed {
        reason: String,
    },
    Paused,
    /// No user message yet.
    Idle,
    /// This driver has work due at `at` (a retry, a backoff, a claim of
    /// another driver that expires): sleep, then `Tick`.
    Busy {
        at: Millis,
    },
    /// Only the outside (or work under way elsewhere) moves the session;
    /// `wake_at` is the earliest deadline to check.
    Waiting {
        pending: Vec<ContinuationToken>,
        wake_at: Option<Millis>,
    },
}

/// What [`Session::outlook`] gathers from the model and the open calls.
#[derive(Default)]
struct Timers {
    /// Work this driver will do itself later: a retry or backoff, or work
    /// another driver holds that falls to us when its claim expires.
    own: Vec<Millis>,
    /// Times to look again while only others move the session.
    deadlines: Vec<Millis>,
    /// Some work of ours is under way in this process; its end wakes us.
    in_flight_here: bool,
}

/// Results and decisions from outside the core, which a finished session
/// no longer takes.
fn comes_from_outside(event: &Event) -> bool {
    matches!(
        event,
        Event::AttemptFinished { .. }
            | Event::Wake { .. }
            | Event::Decide { .. }
            | Event::BudgetDecided { .. }
            | Event::RunAgain { .. }
            | Event::TaskAsks { .. }
            | Event::TaskEnded { .. }
    )
}
