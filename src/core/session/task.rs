//! Calls that became MCP tasks (`io.modelcontextprotocol/tasks`): a run
//! whose server answered with a task handle waits on the task; the driver
//! that runs tools polls it at the server's interval (no write while it
//! works), shows a request for input to people, and takes the final
//! result once.

use super::calls::{call_envelope, ensure_action, result_limit};
use super::{truncate, Action, CoreError, Session, WakeOutcome};
use crate::core::call::{CallState, TaskHandle, TrackedToolCall, WaitingFor};
use crate::core::conversation::ToolResult;
use crate::core::envelope::CallEnvelope;
use crate::core::ids::{CallId, ContinuationToken};
use crate::core::time::Millis;

pub use crate::core::acceptance::TASK_BY;

/// The poll interval used at least, and at most: a server asking for a
/// poll every millisecond is polled every second, one asking for an hour
/// every minute (a restart, a lost reply, are found out within it).
pub const MIN_POLL_MS: u64 = 1_000;
pub const MAX_POLL_MS: u64 = 60_000;

/// When a task asked to be polled at `poll_ms` is polled next after `now`.
pub fn next_poll(task: &TaskHandle, now: Millis) -> Millis {
    Millis(now.0 + task.poll_ms.clamp(MIN_POLL_MS, MAX_POLL_MS) as i64)
}

impl Session {
    /// A run of call `id` (its attempt `attempt`) was answered with a task
    /// handle: the call waits on the task, with a continuation that shows it.
    pub(super) fn on_task_created(
        &mut self,
        id: CallId,
        attempt: u32,
        task: TaskHandle,
        now: Millis,
    ) -> Result<(), CoreError> {
        let token = ContinuationToken::for_call(&self.state.id, id);
        let call = self
            .open_call_mut(|c| c.id == id && c.attempts == attempt && !c.state().is_final())
            .ok_or(CoreError::UnknownCall { call: id })?;
        let deadline = call
            .policy
            .decorators
            .timeout_seconds
            .map(|s| now.plus_secs(s).ceil_to_second());
        call.become_task(token, task, deadline)?;
        let call = call.clone();
        if let Some(ensure) = ensure_action(&self.state.id, &self.config, &call) {
            self.push(ensure);
        }
        self.settle(now);
        Ok(())
    }

    /// The task behind `token` asks for input (`asks`, JSON), or works
    /// again (`None`).
    pub(super) fn on_task_asks(&mut self, token: &ContinuationToken, asks: Option<String>) {
        if let Some(call) = self.open_call_mut(|c| c.token() == Some(token)) {
            call.set_task_asks(asks);
        }
    }

    /// The task behind `token` ended with `result` (the tool's result, or
    /// an error saying how the task failed or was cancelled).
    pub(super) fn on_task_ended(
        &mut self,
        token: &ContinuationToken,
        result: ToolResult,
        now: Millis,
    ) -> Result<WakeOutcome, CoreError> {
        let limit = self.config.max_result_bytes;
        let Some(call) = self.open_call_mut(|c| c.token() == Some(token)) else {
            return Ok(WakeOutcome::Unknown);
        };
        if call.state().is_final() {
            return Ok(WakeOutcome::AlreadyCompleted);
        }
        if call.waiting_for() != Some(WaitingFor::McpTask) {
            return Err(CoreError::NotWaiting {
                token: token.clone(),
                state: call.state(),
                what: "its MCP task's result",
            });
        }
        // A task's error result is the tool's answer, told to the model
        // as a result; the server ran it, so nothing is retried.
        let result = truncate(result, Some(result_limit(call, limit)));
        call.finish(CallState::Completed, result.clone(), TASK_BY)?;
        self.push_result(Action::RecordResult {
            token: token.clone(),
            result,
            by: TASK_BY.into(),
        });
        self.settle(now);
        Ok(WakeOutcome::Applied)
    }
}

/// The poll of `call`'s task, if it waits on one.
pub(super) fn poll_action(session: &Session, call: &TrackedToolCall) -> Option<Action> {
    let (task, envelope) = task_envelope(session, call)?;
    Some(Action::PollTask {
        envelope,
        task,
        asks: call.task_asks().map(str::to_string),
    })
}

/// The cancellation of the task `call` waited on (it timed out).
pub(super) fn cancel_action(session: &Session, call: &TrackedToolCall) -> Option<Action> {
    let task = call.task()?.clone();
    let envelope = call_envelope(&session.state.id, &session.config, call)?;
    Some(Action::CancelTask { envelope, task })
}

fn task_envelope(session: &Session, call: &TrackedToolCall) -> Option<(TaskHandle, CallEnvelope)> {
    if call.waiting_for() != Some(WaitingFor::McpTask) {
        return None;
    }
    let envelope = call_envelope(&session.state.id, &session.config, call)?;
    Some((call.task()?.clone(), envelope))
}
