//! The isolation contract shared by every runner (Job, process, external
//! worker): a call envelope in, a result envelope out. Versioned JSON; the
//! result must echo the call's token so a result can never land on the
//! wrong call.

use super::call::TrackedToolCall;
use super::conversation::{ToolCall, ToolResponse, ToolResult};
use super::ids::{CallId, ContinuationToken, SessionId};
use super::policy::AppliedPolicy;
use super::session::Scope;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const ENVELOPE_VERSION: &str = "agents-exe.io/envelope/v1";

/// The serialisable part of a call's context. Never holds secrets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContextSnapshot {
    pub session: SessionId,
    pub turn: u32,
    pub call_id: CallId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Tools get this as an idempotency key: it is stable across retries
    /// and restarts.
    pub idempotency_key: String,
    /// Non-secret parameters of the agent.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
    /// The sessions from the root of a sub-agent tree down to this one
    /// (agent, session, depth); empty outside a tree's children.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub call_stack: Vec<crate::core::session::subagent::StackEntry>,
}

impl ContextSnapshot {
    /// The snapshot for `call`. The idempotency key names the namespace,
    /// the session's unique id and the call, so two sessions named alike
    /// (in two namespaces, or one deleted and re-created) never share keys.
    pub fn for_call(
        session: &SessionId,
        scope: &Scope,
        call: &TrackedToolCall,
        agent: Option<&str>,
    ) -> Self {
        ContextSnapshot {
            session: session.clone(),
            turn: call.id.turn,
            call_id: call.id,
            agent: agent.map(str::to_string),
            idempotency_key: idempotency_key(session, scope, &call.id),
            params: BTreeMap::new(),
            call_stack: Vec::new(),
        }
    }
}

/// The idempotency key of call `call` of `session` in `scope`.
pub fn idempotency_key(session: &SessionId, scope: &Scope, call: &dyn std::fmt::Display) -> String {
    let ns = if scope.namespace.is_empty() {
        "-"
    } else {
        scope.namespace.as_str()
    };
    let uid = if scope.uid.is_empty() {
        session.0.as_str()
    } else {
        scope.uid.as_str()
    };
    format!("{ns}/{session}/{uid}/{call}")
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CallEnvelope {
    pub version: String,
    pub token: ContinuationToken,
    pub tool_call: ToolCall,
    pub context: ContextSnapshot,
    pub policy: AppliedPolicy,
}

impl CallEnvelope {
    pub fn new(
        token: ContinuationToken,
        tool_call: ToolCall,
        context: ContextSnapshot,
        policy: AppliedPolicy,
    ) -> Self {
        CallEnvelope {
            version: ENVELOPE_VERSION.to_string(),
            token,
            tool_call,
            context,
            policy,
        }
    }

    pub fn parse(text: &str) -> Result<Self, EnvelopeError> {
        let env: CallEnvelope =
            serde_json::from_str(text).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        check_version(&env.version)?;
        Ok(env)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ResultStatus {
    Success,
    Error,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResultEnvelope {
    pub version: String,
    pub token: ContinuationToken,
    pub status: ResultStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResponse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("the envelope is not valid JSON of the expected shape: {0}")]
    Malformed(String),
    #[error("unsupported envelope version {found:?}; this build speaks {ENVELOPE_VERSION:?}")]
    Version { found: String },
    #[error("the result echoes token {found:?} but the call's token is {expected:?}")]
    TokenMismatch { expected: String, found: String },
    #[error("a success envelope needs `result`, an error envelope needs `error`")]
    MissingPayload,
}

fn check_version(v: &str) -> Result<(), EnvelopeError> {
    if v == ENVELOPE_VERSION {
        Ok(())
    } else {
        Err(EnvelopeError::Version { found: v.into() })
    }
}

impl ResultEnvelope {
    pub fn from_result(token: ContinuationToken, result: &ToolResult) -> Self {
        let (status, result, error) = match result {
            ToolResult::Success { response } => {
                (ResultStatus::Success, Some(response.clone()), None)
            }
            ToolResult::Error { message } => (ResultStatus::Error, None, Some(message.clone())),
        };
        ResultEnvelope {
            version: ENVELOPE_VERSION.to_string(),
            token,
            status,
            result,
            error,
        }
    }

    /// Parses a runner's output and checks it answers `expected`.
    pub fn parse_for(
        text: &str,
        expected: &ContinuationToken,
    ) -> Result<ToolResult, EnvelopeError> {
        let env: ResultEnvelope = serde_json::from_str(text.trim())
            .map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        check_version(&env.version)?;
        if &env.token != expected {
            return Err(EnvelopeError::TokenMismatch {
                expected: expected.0.clone(),
                found: env.token.0,
            });
        }
        env.into_result()
    }

    pub fn into_result(self) -> Result<ToolResult, EnvelopeError> {
        match (self.status, self.result, self.error) {
            (ResultStatus::Success, Some(response), _) => Ok(ToolResult::Success { response }),
            (ResultStatus::Error, _, Some(message)) => Ok(ToolResult::Error { message }),
            _ => Err(EnvelopeError::MissingPayload),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::{Disposition, IsolationSpec};

    fn envelope() -> CallEnvelope {
        CallEnvelope::new(
            ContinuationToken("demo-t1-c2".into()),
            ToolCall {
                model_call_id: "call_abc".into(),
                name: "bash".into(),
                arguments: r#"{"cmd":"ls"}"#.into(),
            },
            ContextSnapshot {
                session: SessionId("demo".into()),
                turn: 1,
                call_id: CallId::new(1, 2),
                agent: Some("helper".into()),
                idempotency_key: "demo/t1-c2".into(),
                params: BTreeMap::new(),
                call_stack: Vec::new(),
            },
            AppliedPolicy {
                disposition: Disposition::RunIsolated {
                    spec: IsolationSpec {
                        image: "busybox:ci".into(),
                        ..Default::default()
                    },
                },
                ..Default::default()
            },
        )
    }

    #[test]
    fn call_envelope_round_trips_with_camel_case_fields() {
        let env = envelope();
        let text = serde_json::to_string(&env).unwrap();
        assert!(text.contains("\"toolCall\""), "{text}");
        assert!(text.contains("\"version\":\"agents-exe.io/envelope/v1\""));
        assert!(text.contains("\"mode\":\"runIsolated\""));
        assert_eq!(CallEnvelope::parse(&text).unwrap(), env);
    }

    #[test]
    fn result_envelope_round_trips_and_checks_the_token() {
        let token = ContinuationToken("demo-t1-c2".into());
        for result in [ToolResult::text("files"), ToolResult::error("exit 1")] {
            let text = serde_json::to_string(&ResultEnvelope::from_result(token.clone(), &result))
                .unwrap();
            assert_eq!(ResultEnvelope::parse_for(&text, &token).unwrap(), result);
            let other = ContinuationToken("demo-t1-c1".into());
            assert!(matches!(
                ResultEnvelope::parse_for(&text, &other),
                Err(EnvelopeError::TokenMismatch { .. })
            ));
        }
    }

    #[test]
    fn bad_result_envelopes_say_what_is_wrong() {
        let token = ContinuationToken("t".into());
        let e = ResultEnvelope::parse_for("not json", &token).unwrap_err();
        assert!(matches!(e, EnvelopeError::Malformed(_)));
        let e = ResultEnvelope::parse_for(
            r#"{"version":"v0","token":"t","status":"success","result":{"type":"text","content":"x"}}"#,
            &token,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("unsupported envelope version"),
            "{e}"
        );
        let e = ResultEnvelope::parse_for(
            r#"{"version":"agents-exe.io/envelope/v1","token":"t","status":"success"}"#,
            &token,
        )
        .unwrap_err();
        assert_eq!(e, EnvelopeError::MissingPayload);
    }
}
