//! Statuses written before the state moved into `status.state`: the
//! turns, the open turn and the counters sat in the status itself, times
//! as RFC 3339 and the policy in its API form. [`upgrade`] rewrites such a
//! status into today's form; the next status write removes the old fields.
//! Turns (in the status and in archived chunks) were already stored as the
//! core writes them.

use super::convert::{applied_policy, millis, ConvertError};
use super::session::{AppliedPolicyStatus, SessionPhase, SessionStatus};
use crate::core::{SessionId, SessionState};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{json, Map, Value};

/// The core's state from a status in the earlier form.
pub fn session_state(id: &SessionId, status: &SessionStatus) -> Result<SessionState, ConvertError> {
    let mut status = status.clone();
    upgrade(&mut status)?;
    super::stored::session_state(id, &status)
}

/// Rewrites an earlier status (one without `state`) into today's form.
pub fn upgrade(status: &mut SessionStatus) -> Result<(), ConvertError> {
    if status.state.is_some() {
        return Ok(());
    }
    let old = &status.earlier;
    let get = |key: &str| old.get(key).cloned().unwrap_or(Value::Null);
    let open = match old.get("openTurn") {
        Some(Value::Object(o)) => json!({"turn": o["turn"], "calls": calls(&o["calls"])?}),
        _ => Value::Null,
    };
    let mut doc = json!({
        "phase": phase(status, &open, old.get("turns").is_some()),
        "paused": get("paused").as_bool().unwrap_or(false),
        "turns": get("turns").as_array().cloned().unwrap_or_default(),
        "open": open,
        "inbox": get("inbox").as_array().cloned().unwrap_or_default(),
        "modelAttempts": get("modelAttempts").as_u64().unwrap_or(0),
        "modelRetryAt": time(&get("modelRetryAt"), "status.modelRetryAt")?,
        "modelClaim": claim(&get("modelClaim"), "status.modelClaim")?,
        "messagesTaken": get("messagesSeen").as_u64().unwrap_or(0),
    });
    let fields = doc.as_object_mut().expect("an object");
    fields.retain(|_, v| !v.is_null());
    status.retries_taken = get("retriesSeen").as_u64().unwrap_or(0) as u32;
    status.state = Some(doc);
    Ok(())
}

/// The core's phase: shown as is, except under `Paused`, where the open
/// calls (or the turns) tell.
fn phase(status: &SessionStatus, open: &Value, has_turns: bool) -> &'static str {
    let running = |c: &Value| matches!(c["state"].as_str(), Some("Ready" | "Running"));
    match status.phase {
        SessionPhase::Succeeded => "Succeeded",
        SessionPhase::Failed => "Failed",
        SessionPhase::Pending => "Idle",
        SessionPhase::AwaitingModel => "AwaitingModel",
        SessionPhase::Running => "RunningTools",
        SessionPhase::Waiting => "Waiting",
        SessionPhase::Paused => match open["calls"].as_array() {
            Some(calls) if calls.iter().any(running) => "RunningTools",
            Some(_) => "Waiting",
            None if !has_turns && status.archived_turns.is_empty() => "Idle",
            None => "AwaitingModel",
        },
    }
}

/// The open turn's calls in the core's flat form.
fn calls(old: &Value) -> Result<Value, ConvertError> {
    let mut out = Vec::new();
    for (i, call) in old.as_array().into_iter().flatten().enumerate() {
        let at = format!("status.openTurn.calls[{i}]");
        let mut c: Map<String, Value> = call.as_object().cloned().unwrap_or_default();
        c.remove("job");
        for key in ["deadline", "retryAt"] {
            if let Some(t) = c.get(key) {
                let m = time(t, &format!("{at}.{key}"))?;
                c.insert(key.into(), m);
            }
        }
        if let Some(claimed) = c.get("claim") {
            let m = claim(claimed, &format!("{at}.claim"))?;
            c.insert("claim".into(), m);
        }
        let policy: AppliedPolicyStatus = serde_json::from_value(c["policy"].clone())
            .map_err(|e| bad(&format!("{at}.policy"), e))?;
        let policy = serde_json::to_value(applied_policy(&policy)).expect("policies serialise");
        c.insert("policy".into(), policy);
        out.push(Value::Object(c));
    }
    Ok(Value::Array(out))
}

/// A claim with its `until` in milliseconds.
fn claim(old: &Value, field: &str) -> Result<Value, ConvertError> {
    if old.is_null() {
        return Ok(Value::Null);
    }
    let until = time(&old["until"], &format!("{field}.until"))?;
    Ok(json!({"holder": old["holder"], "until": until}))
}

/// An RFC 3339 time as milliseconds since the epoch.
fn time(old: &Value, field: &str) -> Result<Value, ConvertError> {
    if old.is_null() {
        return Ok(Value::Null);
    }
    let t: Time = serde_json::from_value(old.clone()).map_err(|e| bad(field, e))?;
    Ok(json!(millis(&t).0))
}

fn bad(field: &str, e: serde_json::Error) -> ConvertError {
    ConvertError {
        field: field.into(),
        message: format!("unreadable in the earlier status form: {e}"),
    }
}
