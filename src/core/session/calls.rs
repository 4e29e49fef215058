//! Pure helpers for one tracked call: the actions that run it or wait
//! for it, its timeouts, claims and retries, and its result entry.

use super::{
    outcome, subagent, Action, ContinuationSpec, DriverRole, SessionConfig, CLAIM_GRACE_MILLIS,
};
use crate::core::cache::{cache_key, CacheKey, CacheScope};
use crate::core::call::{
    Approval, Attempt, CallStage, CallState, Claim, TrackedToolCall, Wait, WaitingFor,
};
use crate::core::conversation::{ToolResponse, ToolResult, ToolResultEntry};
use crate::core::envelope::{CallEnvelope, ContextSnapshot};
use crate::core::ids::SessionId;
use crate::core::policy::{retry_backoff_millis, Disposition};
use crate::core::time::Millis;

/// The continuation a deferred call needs.
pub(super) fn ensure_action(
    session: &SessionId,
    config: &SessionConfig,
    call: &TrackedToolCall,
) -> Option<Action> {
    let (Some(token), Some(waiting_for)) = (call.token().cloned(), call.waiting_for()) else {
        return None;
    };
    let reason = match (&call.policy.disposition, waiting_for) {
        (_, WaitingFor::Approval) => Some("waiting for approval".to_string()),
        (_, WaitingFor::McpTask) => call
            .task()
            .map(|t| format!("waiting for MCP task {}", t.id)),
        (_, WaitingFor::Outcome) => outcome::reason(call, config.default_tool_timeout_secs),
        (Disposition::Defer { reason }, _) => Some(reason.clone()),
        _ => None,
    };
    let context = ContextSnapshot::for_call(session, &config.scope, call, config.agent.as_deref());
    Some(Action::EnsureContinuation(ContinuationSpec {
        token,
        session: session.clone(),
        call_id: call.id,
        tool_call: call.call.clone(),
        policy: call.policy.clone(),
        waiting_for,
        reason,
        context,
        cache_key: cache_key_for(config, call),
        expires_at: call.deadline(),
    }))
}

pub(super) fn cache_key_for(config: &SessionConfig, call: &TrackedToolCall) -> Option<CacheKey> {
    let scope = CacheScope {
        namespace: config.scope.namespace.clone(),
        fingerprints: config.tool_fingerprints.clone(),
    };
    call.policy
        .decorators
        .cache
        .then(|| cache_key(&call.call, config.context_has_secrets, &scope))
        .flatten()
}

/// The envelope a deferred call is run (or its MCP task asked about)
/// under; `None` before it has a token.
pub(super) fn call_envelope(
    session: &SessionId,
    config: &SessionConfig,
    call: &TrackedToolCall,
) -> Option<CallEnvelope> {
    let token = call.token()?.clone();
    let mut context =
        ContextSnapshot::for_call(session, &config.scope, call, config.agent.as_deref());
    context.call_stack = subagent::call_stack(config, session);
    Some(CallEnvelope::new(
        token,
        call.effective_call(),
        context,
        call.policy.clone(),
    ))
}

/// The action that starts `call`'s current attempt.
pub(super) fn run_action(
    session: &SessionId,
    config: &SessionConfig,
    call: &TrackedToolCall,
) -> Vec<Action> {
    let cache = cache_key_for(config, call);
    match call.stage() {
        CallStage::Running(_) => vec![Action::RunTool {
            call: call.id,
            tool_call: call.effective_call(),
            idempotency_key: ContextSnapshot::for_call(
                session,
                &config.scope,
                call,
                config.agent.as_deref(),
            )
            .idempotency_key,
            timeout_seconds: Some(
                call.policy
                    .decorators
                    .timeout_seconds
                    .unwrap_or(config.default_tool_timeout_secs),
            ),
            cache_key: cache,
            attempt: call.attempts,
        }],
        CallStage::Deferred { wait, .. } => {
            let Some(envelope) = call_envelope(session, config, call) else {
                return Vec::new();
            };
            match (wait, &call.policy.disposition) {
                (Wait::Background(_), _) => vec![Action::RunInBackground {
                    envelope,
                    attempt: call.attempts,
                    cache_key: cache,
                }],
                (Wait::SubAgent(_), Disposition::SubAgent { agent }) => {
                    vec![Action::StartSubAgent {
                        child: subagent::plan(session, config, call, agent),
                        envelope,
                        attempt: call.attempts,
                    }]
                }
                (Wait::Isolated(_), Disposition::RunIsolated { spec }) => {
                    vec![Action::LaunchIsolated {
                        envelope,
                        spec: spec.clone(),
                        attempt: call.attempts,
                    }]
                }
                _ => Vec::new(),
            }
        }
        _ => Vec::new(),
    }
}

/// Ends a deferred call whose wait passed its deadline, and returns the
/// result write for its continuation. Only a wait has a deadline: a
/// running tool is stopped by its own timeout.
pub(super) fn time_out(call: &mut TrackedToolCall, now: Millis) -> Option<Action> {
    let CallStage::Deferred {
        wait,
        deadline: Some(deadline),
    } = call.stage()
    else {
        return None;
    };
    if now < *deadline {
        return None;
    }
    // A run of ours that outlived its time failed; a wait on a person or
    // an outside party completes, and the model is told.
    let (what, to) = match wait {
        Wait::Approval => ("an approval", CallState::Completed),
        Wait::External => ("an outside result", CallState::Completed),
        Wait::Background(_) | Wait::Isolated(_) => ("the tool", CallState::Failed),
        // The model is told; the driver stops the child when the result
        // is recorded.
        Wait::SubAgent(_) => ("the sub-agent", CallState::Completed),
        Wait::McpTask { .. } => ("its MCP task", CallState::Completed),
        // Never given a deadline: the person decides in their own time.
        Wait::Outcome { .. } => ("a person", CallState::Completed),
    };
    let secs = call.policy.decorators.timeout_seconds.unwrap_or(0);
    let result = ToolResult::error(format!("timed out after {secs}s waiting for {what}"));
    call.finish(to, result.clone(), "agents").ok()?;
    if !call.has_continuation() {
        return None;
    }
    Some(Action::RecordResult {
        token: call.token()?.clone(),
        result,
        by: "agents".into(),
    })
}

/// The most bytes a call's result may keep: its `truncate` decorator
/// within the agent's limit.
pub(super) fn result_limit(call: &TrackedToolCall, agent_limit: usize) -> usize {
    call.policy
        .decorators
        .truncate_bytes
        .map_or(agent_limit, |t| t.min(agent_limit))
}

/// An approver's edit is allowed by the call's policy and is a JSON object.
/// The result the model hears for a call an approver edited: what ran, then
/// what came back.
pub(super) fn with_edit_note(result: ToolResult, approval: Option<&Approval>) -> ToolResult {
    let Some((by, args)) = approval.and_then(|a| a.arguments.as_ref().map(|x| (&a.by, x))) else {
        return result;
    };
    let note = format!("{by} edited the arguments before the call ran; it ran with {args}");
    match result {
        ToolResult::Success { response } => ToolResult::ok(ToolResponse::Mixed {
            parts: vec![ToolResponse::text(note), response],
        }),
        ToolResult::Error { message } => ToolResult::error(format!("{note}\n{message}")),
    }
}

/// What taking an attempt did: `retry` when a failed attempt comes round.
pub(super) struct Taken {
    pub(super) retry: bool,
}

/// The claim rule, written once for tool calls and the model call. Work
/// that is due starts unless someone alive holds it; a tick restarts only
/// work nobody holds, while a restore or a new dispatch (`ensure`)
/// re-issues our own starts too (runners adopt what is under way). A start
/// takes a claim for `secs`, except that our own live claim stands as it
/// is, so re-issuing work under way writes nothing.
pub(super) fn take_attempt(
    attempt: &mut Attempt,
    role: &DriverRole,
    secs: u64,
    ensure: bool,
    now: Millis,
) -> Option<Taken> {
    let claim = match attempt {
        Attempt::RetryAt(at) if now < *at => return None,
        Attempt::RetryAt(_) | Attempt::Unclaimed => None,
        Attempt::Claimed(c) => Some(&*c),
    };
    let ours = claim.is_some_and(|c| c.holder == role.holder);
    let blocked = claim.is_some_and(|c| c.blocks(&role.holder, &role.dead_holders, now));
    if blocked || (!ensure && ours) {
        return None;
    }
    let live_own = ours && claim.is_some_and(|c| c.until > now);
    let retry = matches!(attempt, Attempt::RetryAt(_));
    if !live_own {
        *attempt = Attempt::Claimed(new_claim(&role.holder, secs, now));
    }
    Some(Taken { retry })
}

/// When a driver must look at an attempt again: its retry, or the expiry
/// of its claim.
pub(super) fn wake_time(attempt: &Attempt) -> Option<Millis> {
    attempt
        .retry_at()
        .or_else(|| attempt.claim().map(|c| c.until))
}

/// When the attempt that failed as attempt number `attempts` is retried.
pub(super) fn retry_time(attempts: u32, now: Millis) -> Millis {
    now.plus_millis(retry_backoff_millis(attempts))
        .ceil_to_second()
}

/// A closed call as the user turn records it.
pub(super) fn result_entry(c: TrackedToolCall) -> ToolResultEntry {
    let note_on = c.approval().cloned();
    let token = c.token().cloned();
    let truncate_bytes = c.policy.decorators.truncate_bytes;
    let (call_id, call) = (c.id, c.call.clone());
    let (started_at, finished_at) = (c.started_at, c.finished_at);
    let outcome = c.into_outcome().expect("final calls hold a result");
    ToolResultEntry {
        call_id,
        model_call_id: call.model_call_id,
        tool: call.name,
        token,
        result: with_edit_note(outcome.result, note_on.as_ref()),
        truncate_bytes,
        started_at,
        finished_at,
    }
}

/// A claim by `holder` for work that may take `secs`, with a grace. Kept
/// to the millisecond (the state stores milliseconds): the attempt's start
/// is then known exactly from it, which tells a person's "run again" to
/// this lost attempt from one given to an earlier loss.
pub(super) fn new_claim(holder: &str, secs: u64, now: Millis) -> Claim {
    Claim {
        holder: holder.to_string(),
        until: now.plus_secs(secs).plus_millis(CLAIM_GRACE_MILLIS as u64),
    }
}
