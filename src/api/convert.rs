//! Where CRD types and core types meet, besides the agent's spec
//! ([`super::agent_map`]) and the session's stored state
//! ([`super::stored`]): times, tool results and the Continuation.

pub use super::agent_map::{
    applied_policy, applied_policy_status, env_var, policy, session_config,
};
use super::continuation::{
    ContextSnapshotSpec, ContinuationSpec as ContinuationSpecApi, ContinuationStatus,
};
use crate::core::envelope::ContextSnapshot;
use crate::core::session::ContinuationSpec;
use crate::core::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;

/// A spec or status that cannot be mapped, naming the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConvertError {
    pub field: String,
    pub message: String,
}

pub(crate) fn err(field: impl Into<String>, message: impl Into<String>) -> ConvertError {
    ConvertError {
        field: field.into(),
        message: message.into(),
    }
}

pub fn time(m: Millis) -> Time {
    // Past the calendar's end is its last moment, never 1970 (a huge
    // timeout read back as 1970 would fire at once).
    let end = if m.0 < 0 {
        Timestamp::MIN
    } else {
        Timestamp::MAX
    };
    Time(Timestamp::from_millisecond(m.0).unwrap_or(end))
}

pub fn millis(t: &Time) -> Millis {
    Millis(t.0.as_millisecond())
}

/// [`time`], to the microsecond (a `MicroTime` keeps the fraction).
pub fn micro_time(m: Millis) -> MicroTime {
    MicroTime(time(m).0)
}

pub fn micro_millis(t: &MicroTime) -> Millis {
    Millis(t.0.as_millisecond())
}

fn call_id(s: &str, field: &str) -> Result<CallId, ConvertError> {
    s.parse().map_err(|e: String| err(field, e))
}

pub fn result_value(r: &ToolResult) -> serde_json::Value {
    serde_json::to_value(r).expect("results serialise")
}

/// Parses a result as stored in a status (or typed by a user).
pub fn tool_result(v: &serde_json::Value, field: &str) -> Result<ToolResult, ConvertError> {
    serde_json::from_value(v.clone()).map_err(|e| {
        err(
            field,
            format!("not a tool result ({e}); expected {{\"status\":\"success\",\"response\":{{\"type\":\"text\",\"content\":\"...\"}}}} or {{\"status\":\"error\",\"message\":\"...\"}}"),
        )
    })
}

/// The immutable part of a core continuation: the Continuation's spec.
/// What changes after creation goes to the status ([`set_continuation_wait`]).
pub fn continuation_spec(c: &ContinuationSpec) -> ContinuationSpecApi {
    ContinuationSpecApi {
        session: c.session.0.clone(),
        turn: c.call_id.turn,
        call_id: c.call_id.to_string(),
        tool_call: c.tool_call.clone(),
        policy: applied_policy_status(&c.policy),
        context: ContextSnapshotSpec {
            session: c.context.session.0.clone(),
            turn: c.context.turn,
            call_id: c.context.call_id.to_string(),
            agent: c.context.agent.clone(),
            idempotency_key: c.context.idempotency_key.clone(),
            params: c.context.params.clone(),
        },
        cache_key: c.cache_key.as_ref().map(|k| k.to_string()),
    }
}

/// Writes what the call waits for now (`waitingFor`, `reason`,
/// `expiresAt`) into a Continuation's status; the other status fields are
/// left alone.
pub fn set_continuation_wait(status: &mut ContinuationStatus, c: &ContinuationSpec) {
    status.waiting_for = Some(c.waiting_for);
    status.reason = c.reason.clone();
    status.expires_at = c.expires_at.map(time);
}

/// The core's continuation from a Continuation's spec and status. Before
/// the operator first wrote the status (a crash between create and the
/// status write), the wait is derived from the spec: approval while the
/// policy asks for one and no decision is recorded, else the disposition's
/// runner.
pub fn core_continuation_spec(
    token: &ContinuationToken,
    c: &ContinuationSpecApi,
    status: Option<&ContinuationStatus>,
) -> Result<ContinuationSpec, ConvertError> {
    let cache_key = match &c.cache_key {
        None => None,
        Some(k) => {
            let (tool, sha) = k
                .rsplit_once(':')
                .ok_or_else(|| err("spec.cacheKey", "expected tool:sha256"))?;
            Some(CacheKey {
                tool: tool.to_string(),
                arguments_sha256: sha.to_string(),
            })
        }
    };
    let policy = applied_policy(&c.policy);
    let waiting_for = match status.and_then(|s| s.waiting_for) {
        Some(w) => w,
        None if policy.decorators.approval
            && status.and_then(|s| s.decision.as_ref()).is_none() =>
        {
            WaitingFor::Approval
        }
        None => match policy.disposition {
            Disposition::RunAsync => WaitingFor::Background,
            Disposition::RunIsolated { .. } => WaitingFor::Isolated,
            Disposition::RunSync | Disposition::Defer { .. } => WaitingFor::External,
            Disposition::SubAgent { .. } => WaitingFor::SubAgent,
        },
    };
    Ok(ContinuationSpec {
        token: token.clone(),
        session: SessionId(c.session.clone()),
        call_id: call_id(&c.call_id, "spec.callId")?,
        tool_call: c.tool_call.clone(),
        policy,
        waiting_for,
        reason: status.and_then(|s| s.reason.clone()),
        context: ContextSnapshot {
            session: SessionId(c.context.session.clone()),
            turn: c.context.turn,
            call_id: call_id(&c.context.call_id, "spec.context.callId")?,
            agent: c.context.agent.clone(),
            idempotency_key: c.context.idempotency_key.clone(),
            params: c.context.params.clone(),
            call_stack: Vec::new(),
        },
        cache_key,
        expires_at: status.and_then(|s| s.expires_at.as_ref()).map(millis),
    })
}

#[cfg(test)]
mod tests;
