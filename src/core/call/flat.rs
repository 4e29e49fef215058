//! The flat form of a tracked call: one optional field per datum, as the
//! stores have always written it (SQLite's JSON, the Session status). The
//! core never works on it; loading turns it into a [`TrackedToolCall`] and
//! refuses a combination no sequence of events produces (a hand edit, or a
//! bug), naming the call and the problem.

use super::{
    Approval, Attempt, CallStage, CallState, Claim, Outcome, TaskHandle, TrackedToolCall, Wait,
    WaitingFor,
};
use crate::core::conversation::{ToolCall, ToolResult};
use crate::core::ids::{CallId, ContinuationToken};
use crate::core::policy::AppliedPolicy;
use crate::core::time::Millis;
use serde::{Deserialize, Serialize};

/// One tool call of the open turn, as stored: one field per datum.
// The field order is the stored JSON's: keep it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FlatCall {
    /// Our call id, `t<turn>-c<index>`.
    pub id: CallId,
    /// The call as the model issued it.
    pub call: ToolCall,
    /// Ready, Running, Deferred, Completed or Failed.
    pub state: CallState,
    /// The policy decision: how the call runs, and under which decorators.
    pub policy: AppliedPolicy,
    /// The continuation token (`agents session complete TOKEN`), once the
    /// call waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<ContinuationToken>,
    /// What a deferred call waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingFor>,
    /// The approval decision, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Approval>,
    /// The result, once final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResult>,
    /// Who supplied the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_by: Option<String>,
    /// Executions started (retries count here).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempts: u32,
    /// When the current wait gives up (milliseconds since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Millis>,
    /// When a failed attempt is retried (milliseconds since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<Millis>,
    /// The driver running the current attempt, and until when its claim holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
    /// The MCP task the call became.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskHandle>,
    /// What the MCP task asks for (JSON), while it waits for input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_asks: Option<String>,
    /// When the call started: its first attempt's claim, or its first
    /// wait (milliseconds since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Millis>,
    /// When the call became final (milliseconds since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Millis>,
}

/// A stored call that cannot be loaded, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("tool call {call} ({tool}) {problem}")]
pub struct InvalidCall {
    pub call: CallId,
    pub tool: String,
    pub problem: &'static str,
}

impl From<TrackedToolCall> for FlatCall {
    fn from(c: TrackedToolCall) -> Self {
        let state = c.state();
        let (waiting_for, deadline) = (c.waiting_for(), c.deadline());
        let task_asks = c.task_asks().map(str::to_string);
        let (claim, retry_at) = match c.lost_attempt() {
            // The claim of the attempt whose outcome a person is asked for.
            Some(lost) => (Some(lost.clone()), None),
            None => c.attempt().cloned().unwrap_or_default().into_parts(),
        };
        let (result, completed_by) = match c.stage.into_outcome() {
            Some(o) => (Some(o.result), Some(o.by)),
            None => (None, None),
        };
        FlatCall {
            id: c.id,
            call: c.call,
            state,
            policy: c.policy,
            token: c.token,
            waiting_for,
            approval: c.approval,
            result,
            completed_by,
            attempts: c.attempts,
            deadline,
            retry_at,
            claim,
            task: c.task,
            task_asks,
            started_at: c.started_at,
            finished_at: c.finished_at,
        }
    }
}

impl TryFrom<FlatCall> for TrackedToolCall {
    type Error = InvalidCall;

    fn try_from(f: FlatCall) -> Result<Self, InvalidCall> {
        let stage = stage(&f).map_err(|problem| InvalidCall {
            call: f.id,
            tool: f.call.name.clone(),
            problem,
        })?;
        Ok(TrackedToolCall {
            id: f.id,
            call: f.call,
            policy: f.policy,
            attempts: f.attempts,
            token: f.token,
            approval: f.approval,
            task: f.task,
            stage,
            started_at: f.started_at,
            finished_at: f.finished_at,
        })
    }
}

/// The stage the flat fields describe, or what is wrong with them.
fn stage(f: &FlatCall) -> Result<CallStage, &'static str> {
    let attempt = Attempt::from_parts(f.claim.clone(), f.retry_at)?;
    let outcome = match (f.result.clone(), f.completed_by.clone()) {
        (Some(result), Some(by)) => Some(Outcome { result, by }),
        (None, None) => None,
        (Some(_), None) => return Err("holds a result but says nobody supplied it"),
        (None, Some(_)) => return Err("names who completed it but holds no result"),
    };
    if f.state != CallState::Deferred {
        if f.waiting_for.is_some() {
            return Err("waits for something but is not Deferred");
        }
        if f.deadline.is_some() {
            return Err("has a deadline but is not Deferred");
        }
    }
    if f.task_asks.is_some() && f.waiting_for != Some(WaitingFor::McpTask) {
        return Err("holds an MCP task's request for input but waits on no task");
    }
    if !f.state.is_final() && outcome.is_some() {
        return Err("holds a result but is not final");
    }
    match f.state {
        CallState::Ready if attempt == Attempt::Unclaimed => Ok(CallStage::Ready),
        CallState::Ready => Err("is Ready but claimed or waiting to retry"),
        CallState::Running => Ok(CallStage::Running(attempt)),
        CallState::Deferred => deferred(f, attempt),
        CallState::Completed | CallState::Failed => {
            if attempt != Attempt::Unclaimed {
                return Err("is final but still claimed or waiting to retry");
            }
            let outcome = outcome.ok_or("is final but holds no result")?;
            Ok(match f.state {
                CallState::Completed => CallStage::Completed(outcome),
                _ => CallStage::Failed(outcome),
            })
        }
    }
}

fn deferred(f: &FlatCall, attempt: Attempt) -> Result<CallStage, &'static str> {
    if f.token.is_none() {
        return Err("is Deferred but has no token");
    }
    let kind = f
        .waiting_for
        .ok_or("is Deferred but says nothing about what it waits for")?;
    let wait = match (kind, attempt) {
        (WaitingFor::Background, a) => Wait::Background(a),
        (WaitingFor::Isolated, a) => Wait::Isolated(a),
        (WaitingFor::SubAgent, a) => Wait::SubAgent(a),
        (WaitingFor::Outcome, Attempt::Claimed(lost)) => Wait::Outcome { lost },
        (WaitingFor::Outcome, _) => {
            return Err("waits for a person to tell an unknown outcome but names no attempt")
        }
        (_, Attempt::Claimed(_) | Attempt::RetryAt(_)) => {
            return Err("is claimed or waiting to retry but waits on no run of ours")
        }
        (WaitingFor::Approval, _) if f.approval.is_some() => {
            return Err("waits for an approval it already has")
        }
        (WaitingFor::McpTask, _) if f.task.is_none() => {
            return Err("waits for an MCP task but holds no task id")
        }
        (WaitingFor::McpTask, Attempt::Unclaimed) => Wait::McpTask {
            asks: f.task_asks.clone(),
        },
        (other, Attempt::Unclaimed) => Wait::new(other),
    };
    Ok(CallStage::Deferred {
        wait,
        deadline: f.deadline,
    })
}

/// The model call's attempt as `SessionState` stores it: two optional
/// fields beside the others (`modelRetryAt`, `modelClaim`).
pub mod model_attempt {
    use super::{Attempt, Claim, Millis};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize, schemars::JsonSchema)]
    #[serde(rename_all = "camelCase")]
    pub struct Fields {
        /// When the failed model call is tried again (milliseconds since
        /// the Unix epoch).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model_retry_at: Option<Millis>,
        /// The driver whose model call is under way, and until when its
        /// claim holds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model_claim: Option<Claim>,
    }

    pub fn serialize<S: Serializer>(a: &Attempt, s: S) -> Result<S::Ok, S::Error> {
        let (model_claim, model_retry_at) = a.clone().into_parts();
        Fields {
            model_retry_at,
            model_claim,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Attempt, D::Error> {
        let f = Fields::deserialize(d)?;
        Attempt::from_parts(f.model_claim, f.model_retry_at)
            .map_err(|why| serde::de::Error::custom(format!("the model call {why}")))
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A call as the stores write it, with `extra` fields over it.
    fn stored(extra: serde_json::Value) -> serde_json::Value {
        let mut v = json!({
            "id": "t1-c0",
            "call": {"modelCallId": "m", "name": "search", "arguments": "{}"},
            "state": "Ready",
            "policy": serde_json::to_value(AppliedPolicy::default()).unwrap(),
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    fn load(extra: serde_json::Value) -> Result<TrackedToolCall, String> {
        serde_json::from_value(stored(extra)).map_err(|e| e.to_string())
    }

    #[test]
    fn every_valid_stored_shape_loads_and_writes_back_byte_for_byte() {
        // As the stores wrote calls before the core had stages: fields in
        // declaration order, empty ones left out.
        let head =
            r#"{"id":"t1-c0","call":{"modelCallId":"m","name":"search","arguments":"{}"},"state":"#;
        let policy = r#""policy":{"disposition":{"mode":"runSync"},"decorators":{}}"#;
        let shapes = [
            r#""Ready",P,"attempts":0}"#,
            r#""Running",P,"attempts":1,"claim":{"holder":"a","until":9}}"#,
            r#""Running",P,"attempts":1,"retryAt":7}"#,
            r#""Deferred",P,"token":"s-t1-c0","waitingFor":"approval","attempts":0,"deadline":5}"#,
            r#""Deferred",P,"token":"s-t1-c0","waitingFor":"isolated","attempts":2,"claim":{"holder":"a","until":9}}"#,
            r#""Running",P,"token":"s-t1-c0","approval":{"approved":true,"by":"ann","arguments":"{}"},"attempts":1}"#,
            r#""Completed",P,"token":"s-t1-c0","result":{"status":"success","response":{"type":"text","content":"x"}},"completedBy":"bob","attempts":0}"#,
            r#""Failed",P,"result":{"status":"error","message":"boom"},"completedBy":"agents","attempts":3}"#,
        ];
        for shape in shapes {
            let text = format!("{head}{}", shape.replace('P', policy));
            let call: TrackedToolCall =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            // No attempt yet is said by leaving `attempts` out.
            let written = text
                .replace(r#","attempts":0}"#, "}")
                .replace(r#","attempts":0,"#, ",");
            assert_eq!(serde_json::to_string(&call).unwrap(), written);
            let reloaded: TrackedToolCall = serde_json::from_str(&written).unwrap();
            assert_eq!(reloaded, call, "{written}");
        }
    }

    #[test]
    fn impossible_stored_combinations_are_refused_by_name() {
        let refused = [
            (
                json!({"state": "Completed"}),
                "tool call t1-c0 (search) is final but holds no result",
            ),
            (
                json!({"state": "Completed", "result": {"status": "error", "message": "x"}}),
                "holds a result but says nobody supplied it",
            ),
            (
                json!({"state": "Deferred", "waitingFor": "external"}),
                "is Deferred but has no token",
            ),
            (
                json!({"state": "Deferred", "token": "s-t1-c0"}),
                "says nothing about what it waits for",
            ),
            (
                json!({"state": "Running", "waitingFor": "external"}),
                "waits for something but is not Deferred",
            ),
            (
                json!({"state": "Running", "retryAt": 3, "claim": {"holder": "a", "until": 9}}),
                "is both claimed and waiting to retry",
            ),
            (
                json!({"state": "Deferred", "token": "s-t1-c0", "waitingFor": "external",
                       "claim": {"holder": "a", "until": 9}}),
                "waits on no run of ours",
            ),
            (
                json!({"state": "Deferred", "token": "s-t1-c0", "waitingFor": "approval",
                       "approval": {"approved": false, "by": "ann"}}),
                "waits for an approval it already has",
            ),
            (
                json!({"state": "Failed", "completedBy": "agents", "retryAt": 3,
                       "result": {"status": "error", "message": "x"}}),
                "is final but still claimed or waiting to retry",
            ),
            (
                json!({"state": "Ready", "deadline": 3}),
                "has a deadline but is not Deferred",
            ),
        ];
        for (extra, why) in refused {
            let err = load(extra.clone()).expect_err(&extra.to_string());
            assert!(err.contains(why), "{extra}: {err}");
        }
    }

    #[test]
    fn the_model_attempt_keeps_its_two_stored_fields() {
        use crate::core::{SessionId, SessionState};
        let mut state = SessionState::new(SessionId("s".into()));
        state.model_attempt = Attempt::RetryAt(Millis(7));
        let text = serde_json::to_string(&state).unwrap();
        assert!(
            text.contains(r#""usage":{"promptTokens":0,"completionTokens":0},"modelRetryAt":7}"#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<SessionState>(&text).unwrap(), state);
        state.model_attempt = Attempt::Claimed(Claim {
            holder: "a".into(),
            until: Millis(9),
        });
        let text = serde_json::to_string(&state).unwrap();
        assert!(
            text.contains(r#""completionTokens":0},"modelClaim":{"holder":"a","until":9}}"#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<SessionState>(&text).unwrap(), state);
    }

    #[test]
    fn a_bad_model_attempt_is_refused_on_load() {
        #[derive(Debug, Deserialize)]
        struct Holder {
            #[serde(flatten, with = "model_attempt")]
            #[allow(dead_code)]
            attempt: Attempt,
        }
        let both = json!({"modelRetryAt": 3, "modelClaim": {"holder": "a", "until": 9}});
        let err = serde_json::from_value::<Holder>(both).unwrap_err();
        assert!(
            err.to_string().contains("the model call is both claimed"),
            "{err}"
        );
    }
}
