//! The tracked tool call and its state machine.
//!
//! ```text
//! Ready    -> Running | Deferred | Completed
//! Running  -> Completed | Failed
//! Deferred -> Ready | Completed | Failed
//! Completed, Failed: final
//! ```
//! One move stays outside the table: a run (in the step, or a background
//! attempt) whose MCP server answered with a task handle becomes a wait on
//! that task ([`TrackedToolCall::become_task`]), from Running or from a
//! background wait.
//! `Completed` may carry an error result (a denied approval, a timeout, a
//! malformed call): the model is told. `Failed` is a call that ran (here,
//! in the background or isolated) and failed after its retries; the seed's
//! `Deferred -> Failed` is added because background and isolated attempts
//! run while their call stays deferred (its continuation is the handle).
//!
//! A call's per-state data lives in its [`CallStage`], the rustls way: a
//! claim or a pending retry only where a driver runs an attempt, what a
//! call waits for only while deferred, a result only once final. The flat
//! shape the stores have always written is [`flat::FlatCall`]; loading one
//! that no sequence of events can produce is refused, naming the problem.

pub mod flat;

use super::conversation::{ToolCall, ToolResult};
use super::ids::{CallId, ContinuationToken};
use super::policy::AppliedPolicy;
use super::time::Millis;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The name of a [`CallStage`], as status, errors and the transition
/// table use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum CallState {
    /// Classified, not started.
    Ready,
    /// Running here.
    Running,
    /// Waiting on a continuation.
    Deferred,
    /// Final, with a result (which may be an error).
    Completed,
    /// Final: ran and failed.
    Failed,
}

impl CallState {
    pub fn is_final(self) -> bool {
        matches!(self, CallState::Completed | CallState::Failed)
    }

    pub fn can_move_to(self, to: CallState) -> bool {
        use CallState::*;
        matches!(
            (self, to),
            (Ready, Running)
                | (Ready, Deferred)
                | (Ready, Completed)
                | (Running, Completed)
                | (Running, Failed)
                | (Deferred, Ready)
                | (Deferred, Completed)
                | (Deferred, Failed)
        )
    }
}

impl fmt::Display for CallState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A refused state change, naming the call, its state and the attempted move.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("tool call {call} ({tool}) cannot move from {from} to {to}")]
pub struct TransitionError {
    pub call: CallId,
    pub tool: String,
    pub from: CallState,
    pub to: CallState,
}

/// Why a deferred call waits, so users can tell from `status` what it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum WaitingFor {
    /// An approve/deny decision.
    Approval,
    /// The operator's own background execution (`runAsync`).
    Background,
    /// An isolated run (a Job, or a process for an external worker).
    Isolated,
    /// An outside party (`defer`).
    External,
    /// A task of an MCP server (the `io.modelcontextprotocol/tasks`
    /// extension), polled by the driver until it ends.
    McpTask,
    /// A child Session (an `agent` tool): its final answer is the result.
    SubAgent,
    /// A person: an attempt of a tool that is not idempotent was claimed
    /// by a driver that is gone, and nobody knows whether it took effect
    /// (`onUnknownOutcome: ask`). They give the real result, or say "run
    /// it again".
    Outcome,
    /// A person: the session reached a limit (`onExceed: ask`); they
    /// approve with a raised limit, or deny. The session waits, not a call.
    Budget,
}

/// A task an MCP server made of a `tools/call`: its id, and how often the
/// server asks to be polled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskHandle {
    /// The task's id, as the server gave it.
    pub id: String,
    /// How often the server asked to be polled, in milliseconds.
    pub poll_ms: u64,
}

/// A driver's committed claim on work with side effects (a model call, a
/// tool run, a background or isolated attempt). It is written with the
/// same checkpoint that starts the work; another driver leaves claimed work
/// alone until `until`, or until the driver reports the holder dead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    /// The driver holding the claim (an operator replica or a CLI process).
    pub holder: String,
    /// When the claim lapses if the holder has not finished (milliseconds
    /// since the Unix epoch).
    pub until: Millis,
}

impl Claim {
    /// True when this claim keeps `me` from starting the work at `now`.
    pub fn blocks(&self, me: &str, dead: &std::collections::BTreeSet<String>, now: Millis) -> bool {
        self.holder != me && self.until > now && !dead.contains(&self.holder)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Approval {
    /// The decision.
    pub approved: bool,
    /// Who decided.
    pub by: String,
    /// Why, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Arguments an approver put in place of the model's (`allowEdit`);
    /// the call runs with these, and the model's stay in `call`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// The current attempt of work a driver runs itself (a `runSync` run, a
/// background or isolated attempt, the model call): free to start, held by
/// a driver, or resting until a retry is due. A failed attempt releases its
/// claim, so a claim and a pending retry never come together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Attempt {
    #[default]
    Unclaimed,
    Claimed(Claim),
    RetryAt(Millis),
}

impl Attempt {
    pub fn claim(&self) -> Option<&Claim> {
        match self {
            Attempt::Claimed(c) => Some(c),
            _ => None,
        }
    }

    pub fn retry_at(&self) -> Option<Millis> {
        match self {
            Attempt::RetryAt(t) => Some(*t),
            _ => None,
        }
    }

    /// Drops `holder`'s claim: the work is started afresh later (a pause).
    pub fn release(&mut self, holder: &str) {
        if self.claim().is_some_and(|c| c.holder == holder) {
            *self = Attempt::Unclaimed;
        }
    }

    /// From the two optional fields a store keeps; both at once is refused.
    pub fn from_parts(
        claim: Option<Claim>,
        retry_at: Option<Millis>,
    ) -> Result<Self, &'static str> {
        match (claim, retry_at) {
            (Some(_), Some(_)) => Err("is both claimed and waiting to retry"),
            (Some(c), None) => Ok(Attempt::Claimed(c)),
            (None, Some(t)) => Ok(Attempt::RetryAt(t)),
            (None, None) => Ok(Attempt::Unclaimed),
        }
    }

    pub fn into_parts(self) -> (Option<Claim>, Option<Millis>) {
        match self {
            Attempt::Unclaimed => (None, None),
            Attempt::Claimed(c) => (Some(c), None),
            Attempt::RetryAt(t) => (None, Some(t)),
        }
    }
}

/// What a deferred call waits for; the waits a driver runs carry their
/// attempt, the others (a decision, an outside party) have none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Wait {
    Approval,
    External,
    Background(Attempt),
    Isolated(Attempt),
    /// A child Session; the attempt's claim is taken before the child is
    /// made, and a retry makes a new child.
    SubAgent(Attempt),
    /// The call's MCP task (its handle is the call's [`TrackedToolCall::task`]);
    /// `asks` is the server's open request for input, as JSON, while the
    /// task is `input_required`.
    McpTask {
        asks: Option<String>,
    },
    /// A person says what came of the attempt `lost` claimed (its holder
    /// is gone); it is kept to show who ran it and when.
    Outcome {
        lost: Claim,
    },
}

impl Wait {
    pub fn new(kind: WaitingFor) -> Self {
        match kind {
            WaitingFor::Approval => Wait::Approval,
            WaitingFor::External => Wait::External,
            WaitingFor::Background => Wait::Background(Attempt::Unclaimed),
            WaitingFor::Isolated => Wait::Isolated(Attempt::Unclaimed),
            WaitingFor::McpTask => Wait::McpTask { asks: None },
            WaitingFor::SubAgent => Wait::SubAgent(Attempt::Unclaimed),
            // The session waits for a budget decision, never a call.
            WaitingFor::Budget => Wait::External,
            // Made only by `TrackedToolCall::lose_outcome`, which has the claim.
            WaitingFor::Outcome => Wait::Outcome {
                lost: Claim {
                    holder: String::new(),
                    until: Millis(0),
                },
            },
        }
    }

    pub fn kind(&self) -> WaitingFor {
        match self {
            Wait::Approval => WaitingFor::Approval,
            Wait::External => WaitingFor::External,
            Wait::Background(_) => WaitingFor::Background,
            Wait::Isolated(_) => WaitingFor::Isolated,
            Wait::McpTask { .. } => WaitingFor::McpTask,
            Wait::SubAgent(_) => WaitingFor::SubAgent,
            Wait::Outcome { .. } => WaitingFor::Outcome,
        }
    }

    pub fn attempt(&self) -> Option<&Attempt> {
        match self {
            Wait::Background(a) | Wait::Isolated(a) | Wait::SubAgent(a) => Some(a),
            Wait::Approval | Wait::External | Wait::McpTask { .. } | Wait::Outcome { .. } => None,
        }
    }

    fn attempt_mut(&mut self) -> Option<&mut Attempt> {
        match self {
            Wait::Background(a) | Wait::Isolated(a) | Wait::SubAgent(a) => Some(a),
            Wait::Approval | Wait::External | Wait::McpTask { .. } | Wait::Outcome { .. } => None,
        }
    }
}

/// A final call's result and who supplied it (a user, a worker,
/// `agents`, `cache`).
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub result: ToolResult,
    pub by: String,
}

/// Where a call is, carrying exactly the data that state has.
#[derive(Clone, Debug, PartialEq)]
pub enum CallStage {
    /// Classified; the scheduler starts or defers it next.
    Ready,
    /// Runs in the reconcile step (`runSync`).
    Running(Attempt),
    /// Waits on its continuation; `deadline` is when the wait gives up
    /// (the `timeout` decorator, or the approval's own timeout).
    Deferred {
        wait: Wait,
        deadline: Option<Millis>,
    },
    Completed(Outcome),
    Failed(Outcome),
}

impl CallStage {
    pub fn state(&self) -> CallState {
        match self {
            CallStage::Ready => CallState::Ready,
            CallStage::Running(_) => CallState::Running,
            CallStage::Deferred { .. } => CallState::Deferred,
            CallStage::Completed(_) => CallState::Completed,
            CallStage::Failed(_) => CallState::Failed,
        }
    }

    pub fn outcome(&self) -> Option<&Outcome> {
        match self {
            CallStage::Completed(o) | CallStage::Failed(o) => Some(o),
            _ => None,
        }
    }

    pub fn into_outcome(self) -> Option<Outcome> {
        match self {
            CallStage::Completed(o) | CallStage::Failed(o) => Some(o),
            _ => None,
        }
    }
}

/// One tool call of the open turn. The data that spans states stays here:
/// the continuation token, which a call keeps from its first deferral on
/// (an approved call runs under it; a closed turn answers repeated wakes
/// with it), and the approval, which outlives the wait it ended. Fields
/// that hold an invariant are private and change only through the
/// transition methods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "flat::FlatCall", into = "flat::FlatCall")]
pub struct TrackedToolCall {
    pub id: CallId,
    pub call: ToolCall,
    pub policy: AppliedPolicy,
    /// Executions started so far (retries count here).
    pub attempts: u32,
    token: Option<ContinuationToken>,
    approval: Option<Approval>,
    /// The MCP task the call became, kept once it ends (like the token).
    task: Option<TaskHandle>,
    stage: CallStage,
    /// When the call started: its first attempt's claim, or its first
    /// wait. Kept for people (the console's timeline), never decided on.
    pub started_at: Option<Millis>,
    /// When the call became final.
    pub finished_at: Option<Millis>,
}

/// Stored in its flat form, so its schema is the flat form's.
impl schemars::JsonSchema for TrackedToolCall {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        flat::FlatCall::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        flat::FlatCall::json_schema(generator)
    }
}

impl TrackedToolCall {
    pub fn new(id: CallId, call: ToolCall, policy: AppliedPolicy) -> Self {
        TrackedToolCall {
            id,
            call,
            policy,
            attempts: 0,
            token: None,
            approval: None,
            task: None,
            stage: CallStage::Ready,
            started_at: None,
            finished_at: None,
        }
    }

    /// Notes `now` as the call's start, unless it started before.
    pub fn mark_started(&mut self, now: Millis) {
        self.started_at.get_or_insert(now);
    }

    /// Notes `now` as when the call became final, if it is final and not
    /// noted yet.
    pub fn mark_finished(&mut self, now: Millis) {
        if self.state().is_final() {
            self.finished_at.get_or_insert(now);
        }
    }

    /// The call as it runs: the model's, with an approver's edited
    /// arguments in place where there are some.
    pub fn effective_call(&self) -> ToolCall {
        let mut call = self.call.clone();
        if let Some(edited) = self.approval.as_ref().and_then(|a| a.arguments.clone()) {
            call.arguments = edited;
        }
        call
    }

    pub fn stage(&self) -> &CallStage {
        &self.stage
    }

    pub fn state(&self) -> CallState {
        self.stage.state()
    }

    pub fn token(&self) -> Option<&ContinuationToken> {
        self.token.as_ref()
    }

    pub fn approval(&self) -> Option<&Approval> {
        self.approval.as_ref()
    }

    /// True when the call waits on an MCP task whose deadline has passed.
    pub fn task_is_due_to_time_out(&self, now: Millis) -> bool {
        matches!(
            &self.stage,
            CallStage::Deferred { wait: Wait::McpTask { .. }, deadline: Some(d) } if now >= *d
        )
    }

    /// The MCP task the call became, if it did.
    pub fn task(&self) -> Option<&TaskHandle> {
        self.task.as_ref()
    }

    /// The open request for input of the call's MCP task, while it waits
    /// for one.
    pub fn task_asks(&self) -> Option<&str> {
        match &self.stage {
            CallStage::Deferred {
                wait: Wait::McpTask { asks },
                ..
            } => asks.as_deref(),
            _ => None,
        }
    }

    /// What the call waits for; `None` unless it is deferred.
    pub fn waiting_for(&self) -> Option<WaitingFor> {
        match &self.stage {
            CallStage::Deferred { wait, .. } => Some(wait.kind()),
            _ => None,
        }
    }

    /// Whether the call is (or was) recorded as a continuation: every
    /// deferred call is, except a `runAsync` call no one had to approve.
    /// The driver whose claim the session holds runs that one and records
    /// its result with the session's own checkpoint, so it costs no
    /// continuation writes; a crash before that re-runs it under the same
    /// idempotency key, as a crash before any result would.
    pub fn has_continuation(&self) -> bool {
        // A task outlives the process that made it: its continuation holds
        // the handle for anyone to see (and the deletion that cancels it).
        // So does a wait for a person to tell an unknown outcome.
        self.task.is_some()
            || self.lost_attempt().is_some()
            || !matches!(
                self.policy.disposition,
                super::policy::Disposition::RunAsync
            )
            || self.policy.decorators.approval
    }

    pub fn deadline(&self) -> Option<Millis> {
        match &self.stage {
            CallStage::Deferred { deadline, .. } => *deadline,
            _ => None,
        }
    }

    pub fn result(&self) -> Option<&ToolResult> {
        self.stage.outcome().map(|o| &o.result)
    }

    /// The final result and who supplied it, taken out of a closed call.
    pub fn into_outcome(self) -> Option<Outcome> {
        self.stage.into_outcome()
    }

    pub fn completed_by(&self) -> Option<&str> {
        self.stage.outcome().map(|o| o.by.as_str())
    }

    /// The attempt a driver runs for this call (running, or deferred to
    /// the background or an isolated run); `None` for the other states.
    pub fn attempt(&self) -> Option<&Attempt> {
        match &self.stage {
            CallStage::Running(a) => Some(a),
            CallStage::Deferred { wait, .. } => wait.attempt(),
            _ => None,
        }
    }

    pub fn attempt_mut(&mut self) -> Option<&mut Attempt> {
        match &mut self.stage {
            CallStage::Running(a) => Some(a),
            CallStage::Deferred { wait, .. } => wait.attempt_mut(),
            _ => None,
        }
    }

    pub fn claim(&self) -> Option<&Claim> {
        self.attempt().and_then(Attempt::claim)
    }

    pub fn retry_at(&self) -> Option<Millis> {
        self.attempt().and_then(Attempt::retry_at)
    }

    /// Ready -> Running: the first attempt, not yet claimed.
    pub fn start(&mut self) -> Result<(), TransitionError> {
        self.allow(CallState::Running)?;
        self.attempts += 1;
        self.stage = CallStage::Running(Attempt::Unclaimed);
        Ok(())
    }

    /// Ready -> Deferred under `token`. A wait this product runs itself
    /// (background, isolated) begins its first attempt.
    pub fn defer(
        &mut self,
        token: ContinuationToken,
        waiting_for: WaitingFor,
        deadline: Option<Millis>,
    ) -> Result<(), TransitionError> {
        self.allow(CallState::Deferred)?;
        if matches!(
            waiting_for,
            WaitingFor::Background | WaitingFor::Isolated | WaitingFor::SubAgent
        ) {
            self.attempts += 1;
        }
        self.token = Some(token);
        self.stage = CallStage::Deferred {
            wait: Wait::new(waiting_for),
            deadline,
        };
        Ok(())
    }

    /// A call waiting for approval is approved by `by`: it is Ready to
    /// run, with the approver's edited `arguments` where there are some.
    pub fn approve(
        &mut self,
        by: String,
        reason: Option<String>,
        arguments: Option<String>,
    ) -> Result<(), TransitionError> {
        self.allow_decision(CallState::Ready)?;
        self.approval = Some(Approval {
            approved: true,
            by,
            reason,
            arguments,
        });
        self.stage = CallStage::Ready;
        Ok(())
    }

    /// A call waiting for approval is denied by `by`: it completes with
    /// `result`, which tells the model.
    pub fn deny(
        &mut self,
        by: String,
        reason: Option<String>,
        result: ToolResult,
    ) -> Result<(), TransitionError> {
        self.allow_decision(CallState::Completed)?;
        self.approval = Some(Approval {
            approved: false,
            by: by.clone(),
            reason,
            arguments: None,
        });
        self.stage = CallStage::Completed(Outcome { result, by });
        Ok(())
    }

    /// Records the final result; `to` is `Completed` or `Failed`, and the
    /// state must allow the move.
    pub fn finish(
        &mut self,
        to: CallState,
        result: ToolResult,
        by: &str,
    ) -> Result<(), TransitionError> {
        self.allow(to)?;
        let outcome = Outcome {
            result,
            by: by.to_string(),
        };
        self.stage = match to {
            CallState::Completed => CallStage::Completed(outcome),
            CallState::Failed => CallStage::Failed(outcome),
            _ => return Err(self.refused(to)),
        };
        Ok(())
    }

    /// A run whose server answered with a task handle waits on the task
    /// under `token`: from Running (in the step) or a background wait.
    /// `deadline` is kept from the wait, else given.
    pub fn become_task(
        &mut self,
        token: ContinuationToken,
        task: TaskHandle,
        deadline: Option<Millis>,
    ) -> Result<(), TransitionError> {
        let deadline = match &self.stage {
            CallStage::Running(_) => deadline,
            CallStage::Deferred {
                wait: Wait::Background(_),
                deadline: kept,
            } => kept.or(deadline),
            _ => return Err(self.refused(CallState::Deferred)),
        };
        self.token = Some(token);
        self.task = Some(task);
        self.stage = CallStage::Deferred {
            wait: Wait::McpTask { asks: None },
            deadline,
        };
        Ok(())
    }

    /// The attempt that `lost` claimed has no result and its holder is
    /// gone: the call waits for a person to say what came of it, under
    /// `token` (from Running, or a background or isolated wait). Like
    /// `become_task`, a move outside the table: no new attempt starts.
    pub fn lose_outcome(
        &mut self,
        token: ContinuationToken,
        lost: Claim,
    ) -> Result<(), TransitionError> {
        match &self.stage {
            CallStage::Running(_)
            | CallStage::Deferred {
                wait: Wait::Background(_) | Wait::Isolated(_),
                ..
            } => {}
            _ => return Err(self.refused(CallState::Deferred)),
        }
        self.token = Some(token);
        self.stage = CallStage::Deferred {
            wait: Wait::Outcome { lost },
            deadline: None,
        };
        Ok(())
    }

    /// The attempt whose outcome is unknown, while a person is asked.
    pub fn lost_attempt(&self) -> Option<&Claim> {
        match &self.stage {
            CallStage::Deferred {
                wait: Wait::Outcome { lost },
                ..
            } => Some(lost),
            _ => None,
        }
    }

    /// A person answered "run it again": the call is Ready, and runs
    /// per its policy under the same idempotency key.
    pub fn run_again(&mut self) -> Result<(), TransitionError> {
        if self.lost_attempt().is_none() {
            return Err(self.refused(CallState::Ready));
        }
        self.stage = CallStage::Ready;
        Ok(())
    }

    /// The call's MCP task asks for input (`asks`, JSON), or no longer
    /// does (`None`); true when that changed.
    pub fn set_task_asks(&mut self, new: Option<String>) -> bool {
        match &mut self.stage {
            CallStage::Deferred {
                wait: Wait::McpTask { asks },
                ..
            } if *asks != new => {
                *asks = new;
                true
            }
            _ => false,
        }
    }

    /// The failed attempt is retried at `at`; its claim is released.
    pub fn schedule_retry(&mut self, at: Millis) {
        if let Some(attempt) = self.attempt_mut() {
            *attempt = Attempt::RetryAt(at);
        }
    }

    fn allow(&self, to: CallState) -> Result<(), TransitionError> {
        if self.state().can_move_to(to) {
            Ok(())
        } else {
            Err(self.refused(to))
        }
    }

    /// A decision ends only a wait for one.
    fn allow_decision(&self, to: CallState) -> Result<(), TransitionError> {
        match self.stage {
            CallStage::Deferred {
                wait: Wait::Approval,
                ..
            } => Ok(()),
            _ => Err(self.refused(to)),
        }
    }

    fn refused(&self, to: CallState) -> TransitionError {
        TransitionError {
            call: self.id,
            tool: self.call.name.clone(),
            from: self.state(),
            to,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CallState::*;

    fn search() -> TrackedToolCall {
        TrackedToolCall::new(
            CallId::new(1, 0),
            ToolCall {
                model_call_id: "m".into(),
                name: "search".into(),
                arguments: "{}".into(),
            },
            AppliedPolicy::default(),
        )
    }

    #[test]
    fn only_the_documented_transitions_are_legal() {
        let all = [Ready, Running, Deferred, Completed, Failed];
        let legal = [
            (Ready, Running),
            (Ready, Deferred),
            (Ready, Completed),
            (Running, Completed),
            (Running, Failed),
            (Deferred, Ready),
            (Deferred, Completed),
            (Deferred, Failed),
        ];
        for from in all {
            for to in all {
                assert_eq!(
                    from.can_move_to(to),
                    legal.contains(&(from, to)),
                    "{from}->{to}"
                );
            }
        }
    }

    #[test]
    fn illegal_transition_names_call_state_and_move() {
        let mut c = search();
        c.finish(Completed, ToolResult::text("x"), "test").unwrap();
        let err = c.start().unwrap_err();
        assert_eq!(
            err.to_string(),
            "tool call t1-c0 (search) cannot move from Completed to Running"
        );
        assert_eq!(c.state(), Completed);
        assert_eq!(c.result(), Some(&ToolResult::text("x")));
    }

    #[test]
    fn only_a_call_waiting_for_approval_takes_a_decision() {
        let mut c = search();
        let token = ContinuationToken("s-t1-c0".into());
        c.defer(token, WaitingFor::External, None).unwrap();
        assert!(c.approve("ann".into(), None, None).is_err());
        assert_eq!(c.approval(), None);
        let mut c = search();
        c.defer(
            ContinuationToken("s-t1-c0".into()),
            WaitingFor::Approval,
            None,
        )
        .unwrap();
        c.approve("ann".into(), None, None).unwrap();
        assert_eq!(c.state(), Ready);
        // The token outlives the wait: the approved call runs under it.
        assert!(c.token().is_some());
    }

    #[test]
    fn a_retry_releases_the_claim() {
        let mut c = search();
        c.defer(
            ContinuationToken("s-t1-c0".into()),
            WaitingFor::Isolated,
            None,
        )
        .unwrap();
        assert_eq!(c.attempts, 1);
        *c.attempt_mut().unwrap() = Attempt::Claimed(Claim {
            holder: "a".into(),
            until: Millis(5),
        });
        c.schedule_retry(Millis(9));
        assert_eq!((c.claim(), c.retry_at()), (None, Some(Millis(9))));
        c.finish(Failed, ToolResult::error("boom"), "agents")
            .unwrap();
        assert_eq!(
            (c.attempt(), c.deadline(), c.waiting_for()),
            (None, None, None)
        );
    }
}
