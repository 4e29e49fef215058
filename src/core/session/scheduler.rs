//! The scheduler: moves ready calls on according to their policy, plans
//! the model call, and settles the session when nothing is left.

use super::calls::{ensure_action, result_entry, run_action, take_attempt};
use super::{subagent, task, Action, Phase, Session};
use crate::core::budget::{Spend, Work};
use crate::core::call::{CallState, Claim, TrackedToolCall, WaitingFor};
use crate::core::conversation::{Turn, UserTurn};
use crate::core::ids::ContinuationToken;
use crate::core::policy::Disposition;
use crate::core::time::Millis;

impl Session {
    /// Moves every ready call on according to its policy.
    pub(super) fn dispatch(&mut self, now: Millis) {
        let budget = &self.budget();
        let mut spend = Spend {
            usage: self.state.usage,
            tool_calls: self.state.tool_calls,
        };
        let (mut stop, mut counted) = (None, false);
        let ready = self
            .state
            .open
            .iter_mut()
            .flat_map(|o| o.calls.iter_mut())
            .filter(|c| c.state() == CallState::Ready);
        for call in ready {
            let token = ContinuationToken::for_call(&self.state.id, call.id);
            let needs_approval = call.policy.decorators.approval && call.approval().is_none();
            let timeout = match &call.policy.decorators.approval_policy {
                Some(p) if needs_approval && p.timeout_seconds.is_some() => p.timeout_seconds,
                _ => call.policy.decorators.timeout_seconds,
            };
            let deadline = timeout.map(|s| now.plus_secs(s).ceil_to_second());
            let waiting = if needs_approval {
                Some(WaitingFor::Approval)
            } else {
                match call.policy.disposition {
                    Disposition::RunSync => None,
                    Disposition::RunAsync => Some(WaitingFor::Background),
                    Disposition::RunIsolated { .. } => Some(WaitingFor::Isolated),
                    Disposition::Defer { .. } => Some(WaitingFor::External),
                    Disposition::SubAgent { .. } => Some(WaitingFor::SubAgent),
                }
            };
            // A run (not an approval wait) spends a tool call: it starts
            // only within the budget; the calls after it stay ready.
            if waiting != Some(WaitingFor::Approval) {
                stop = budget.stops(&spend, Work::ToolRun);
                if stop.is_some() {
                    break;
                }
                spend.tool_calls += 1;
                counted = true;
            }
            match waiting {
                None => call.start().expect("ready calls may start"),
                Some(w) => {
                    call.defer(token, w, deadline)
                        .expect("ready calls may defer");
                    call.mark_started(now);
                }
            }
        }
        self.state.tool_calls = spend.tool_calls;
        self.budget_checked(stop, counted);
        self.start_due(now, true);
    }

    /// Emits the actions that start (or continue) the work the state
    /// implies and this driver may do: continuations for deferred calls,
    /// tool runs, background and isolated attempts. A start first takes a
    /// claim, written by the `Checkpoint` queued before it. `ensure`
    /// re-issues `EnsureContinuation` for every open deferred call (after a
    /// restart or a new turn); a tick only starts work that came due.
    pub(super) fn start_due(&mut self, now: Millis, ensure: bool) {
        if self.state.paused || self.state.phase.is_final() {
            return;
        }
        // A lost attempt of a tool that is not idempotent is never
        // started again on its own: its rule is applied first.
        self.settle_unknown_outcomes(now);
        if self.state.paused || self.state.phase.is_final() {
            return;
        }
        // Per call, in call order: its continuation, then its start.
        let (mut planned, mut starts) = self.plan_calls(now, ensure);
        if let Some(call_model) = self.plan_model(now, ensure) {
            starts = true;
            planned.push(call_model);
        }
        // The claims are committed before any start is performed.
        if starts && self.actions.back() != Some(&Action::Checkpoint) {
            self.push(Action::Checkpoint);
        }
        for mut a in planned {
            self.bound_child(&mut a);
            self.push(a);
        }
    }

    /// The open calls' continuations (when `ensure`) and the starts this
    /// driver may make, with their claims taken; and whether any starts.
    pub(super) fn plan_calls(&mut self, now: Millis, ensure: bool) -> (Vec<Action>, bool) {
        let (mut planned, mut starts) = (Vec::new(), false);
        let id = &self.state.id;
        let config = &self.config;
        let Some(open) = self.state.open.as_mut() else {
            return (planned, starts);
        };
        let mut children = subagent::running_children(&open.calls);
        for call in open.calls.iter_mut() {
            if call.state() == CallState::Deferred && ensure && call.has_continuation() {
                planned.extend(ensure_action(id, config, call));
            }
            let secs = call
                .policy
                .decorators
                .timeout_seconds
                .unwrap_or(config.default_tool_timeout_secs);
            // Past `maxChildren` a new child waits its turn (unclaimed).
            let new_child = subagent::is_new_child(call);
            let turn_waits = new_child && children >= config.lineage.max_children;
            let may_run = config.driver.runs(call) && !turn_waits;
            let Some(attempt) = call.attempt_mut().filter(|_| may_run) else {
                continue;
            };
            let Some(taken) = take_attempt(attempt, &config.driver, secs, ensure, now) else {
                continue;
            };
            if taken.retry {
                call.attempts += 1;
            }
            call.mark_started(now);
            if new_child {
                children += 1;
            }
            let run = run_action(id, config, call);
            starts |= !run.is_empty();
            planned.extend(run);
        }
        planned.extend(self.task_polls());
        (planned, starts)
    }

    /// A poll of every MCP task this driver watches.
    pub(super) fn task_polls(&self) -> Vec<Action> {
        self.state
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| self.config.driver.runs(c))
            .filter_map(|c| task::poll_action(self, c))
            .collect()
    }

    /// True when the next action records a wait (the checkpoint before a
    /// `Yield`).
    pub fn yields_next(&self) -> bool {
        matches!(self.actions.front(), Some(Action::Yield { .. }))
    }

    /// While paused: a `Collect` for every attempt this driver runs that may
    /// be under way (none retries; nothing new starts).
    pub(super) fn plan_collects(&mut self) {
        for a in self.collects().into_iter().chain(self.task_polls()) {
            self.push(a);
        }
    }

    /// A `Collect` for every attempt this driver runs that may be under
    /// way: no claim is taken or renewed, nothing new starts.
    pub fn collects(&self) -> Vec<Action> {
        self.state
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .filter(|c| {
                c.state() == CallState::Deferred
                    && c.retry_at().is_none()
                    && self.config.driver.runs(c)
            })
            .flat_map(|c| run_action(&self.state.id, &self.config, c))
            .filter_map(|a| match a {
                Action::RunInBackground {
                    envelope, attempt, ..
                } => Some(Action::Collect {
                    envelope,
                    isolated: None,
                    child: None,
                    attempt,
                }),
                Action::StartSubAgent {
                    envelope,
                    child,
                    attempt,
                } => Some(Action::Collect {
                    envelope,
                    isolated: None,
                    child: Some(child),
                    attempt,
                }),
                Action::LaunchIsolated {
                    envelope,
                    spec,
                    attempt,
                } => Some(Action::Collect {
                    envelope,
                    isolated: Some(spec),
                    child: None,
                    attempt,
                }),
                _ => None,
            })
            .collect()
    }

    /// The model call this driver may start now, with its claim taken.
    pub(super) fn plan_model(&mut self, now: Millis, ensure: bool) -> Option<Action> {
        let role = &self.config.driver;
        if self.state.phase != Phase::AwaitingModel || !role.model {
            return None;
        }
        // A call already queued is under way: never two.
        let queued = self
            .actions
            .iter()
            .any(|a| matches!(a, Action::CallModel { .. }));
        if queued {
            return None;
        }
        if self.budget_turn_taken || !self.shared_budgets_checked() {
            return None;
        }
        let stop = self.budget().stops(&self.spend(), Work::ModelCall);
        if !self.budget_checked(stop, true) {
            return None;
        }
        let secs = self.config.model_timeout_secs;
        let role = &self.config.driver;
        take_attempt(&mut self.state.model_attempt, role, secs, ensure, now)?;
        Some(Action::CallModel {
            turn: self.state.agent_turns + 1,
        })
    }

    /// Re-derives the actions the stored state implies (after a restart, a
    /// resume, or outside results were fed in). Result and cache writes
    /// already queued stay; every other action is planned again. Every
    /// action is idempotent for the driver.
    pub fn replan(&mut self, now: Millis) {
        self.actions.retain(|a| {
            matches!(
                a,
                Action::RecordResult { .. } | Action::StoreCache { .. } | Action::CancelTask { .. }
            )
        });
        if self.state.phase.is_final() {
            return;
        }
        if self.state.paused {
            self.plan_collects();
            return;
        }
        self.ensure_budget_question();
        self.dispatch(now);
        self.settle(now);
        if self.state.phase == Phase::Waiting
            && !self
                .actions
                .iter()
                .any(|a| matches!(a, Action::Yield { .. }))
        {
            self.push_yield();
        }
    }

    /// Closes the open turn when every call is final, and keeps `phase`
    /// true to the state.
    pub(super) fn settle(&mut self, now: Millis) {
        if self.state.phase.is_final() && self.state.open.is_none() {
            return;
        }
        let Some(open) = self.state.open.as_mut() else {
            return;
        };
        // Every path that ends a call settles at the same `now`.
        for call in open.calls.iter_mut() {
            call.mark_finished(now);
        }
        if open.calls.iter().all(|c| c.state().is_final()) {
            let open = self.state.open.take().expect("checked");
            let tool_results = open.calls.into_iter().map(result_entry).collect();
            self.state.turns.push(Turn::User(UserTurn {
                message: None,
                tool_results,
            }));
            self.flush_inbox();
            if self.state.phase.is_final() {
                return;
            }
            self.push(Action::Checkpoint);
            self.await_model(now);
            return;
        }
        // Phase follows the call states alone (a status reader derives it
        // the same way); what this driver still runs is the outlook's.
        let busy = open
            .calls
            .iter()
            .any(|c| matches!(c.state(), CallState::Ready | CallState::Running));
        let before = self.state.phase;
        if before.is_final() {
            return;
        }
        self.state.phase = if busy {
            Phase::RunningTools
        } else {
            Phase::Waiting
        };
        if self.state.phase == Phase::Waiting && before != Phase::Waiting {
            self.push_yield();
        }
    }

    pub(super) fn blocked(&self, claim: &Claim, now: Millis) -> bool {
        claim.blocks(
            &self.config.driver.holder,
            &self.config.driver.dead_holders,
            now,
        )
    }

    pub(super) fn push_yield(&mut self) {
        let pending = self
            .state
            .pending()
            .into_iter()
            .filter_map(|c| c.token().cloned())
            .collect();
        self.push(Action::Checkpoint);
        self.push(Action::Yield { pending });
    }

    pub(super) fn await_model(&mut self, now: Millis) {
        if let Some(max) = self.config.limits.max_turns {
            if self.state.agent_turns >= max {
                self.fail(format!(
                    "the session reached its limit of {max} model turns; raise spec.limits.maxTurns to go on"
                ));
                return;
            }
        }
        self.state.phase = Phase::AwaitingModel;
        self.start_due(now, false);
    }

    pub(super) fn fail(&mut self, reason: String) {
        self.state.fail(reason.clone());
        self.push(Action::Checkpoint);
        self.push(Action::Failed { reason });
    }

    /// Messages that arrived while the session was busy, each as its own
    /// user turn, in order.
    pub(super) fn flush_inbox(&mut self) {
        for message in std::mem::take(&mut self.state.inbox) {
            self.state.turns.push(Turn::User(UserTurn {
                message: Some(message),
                tool_results: Vec::new(),
            }));
        }
    }

    pub(super) fn open_call_mut(
        &mut self,
        pred: impl Fn(&TrackedToolCall) -> bool,
    ) -> Option<&mut TrackedToolCall> {
        self.state
            .open
            .as_mut()
            .and_then(|o| o.calls.iter_mut().find(|c| pred(c)))
    }

    pub(super) fn push(&mut self, action: Action) {
        self.actions.push_back(action);
    }

    /// Queues a result write ahead of every queued checkpoint: a stored
    /// state never holds a result that its continuation lacks.
    pub(super) fn push_result(&mut self, action: Action) {
        match self
            .actions
            .iter()
            .position(|a| matches!(a, Action::Checkpoint))
        {
            Some(i) => self.actions.insert(i, action),
            None => self.actions.push_back(action),
        }
    }
}
