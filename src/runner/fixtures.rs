//! Test fixtures shared by the runners' tests and the Job wrapper's.

use crate::core::envelope::{CallEnvelope, ContextSnapshot};
use crate::core::policy::{EnvVarSpec, SecretKeyRef};
use crate::core::{AppliedPolicy, CallId, ContinuationToken, IsolationSpec, SessionId, ToolCall};
use std::collections::BTreeMap;

/// The first call of turn 1 of `session` (token `<session>-t1-c0`), a
/// `bash` call with `args`.
pub(crate) fn envelope(session: &str, args: &str) -> CallEnvelope {
    CallEnvelope::new(
        ContinuationToken(format!("{session}-t1-c0")),
        ToolCall {
            model_call_id: "m".into(),
            name: "bash".into(),
            arguments: args.into(),
        },
        ContextSnapshot {
            session: SessionId(session.into()),
            turn: 1,
            call_id: CallId::new(1, 0),
            agent: None,
            idempotency_key: format!("{session}/t1-c0"),
            params: BTreeMap::new(),
            call_stack: Vec::new(),
        },
        AppliedPolicy::default(),
    )
}

/// A variable with a plain value.
pub(crate) fn value_var(name: &str, value: &str) -> EnvVarSpec {
    EnvVarSpec {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

/// A variable from the key `key` of the Secret `secret`.
pub(crate) fn secret_var(name: &str, secret: &str, key: &str) -> EnvVarSpec {
    EnvVarSpec {
        name: name.into(),
        secret: Some(SecretKeyRef {
            name: secret.into(),
            key: key.into(),
        }),
        ..Default::default()
    }
}

/// A tool with an image, a 64Mi memory limit, the plain variable `plain`
/// and `TOKEN` from the Secret `gh` (key `token`).
pub(crate) fn image_tool(
    image: &str,
    command: &[&str],
    args: &[&str],
    plain: (&str, &str),
) -> IsolationSpec {
    IsolationSpec {
        image: image.into(),
        command: command.iter().map(|s| s.to_string()).collect(),
        args: args.iter().map(|s| s.to_string()).collect(),
        limits: [("memory".to_string(), "64Mi".to_string())].into(),
        env: vec![
            value_var(plain.0, plain.1),
            secret_var("TOKEN", "gh", "token"),
        ],
    }
}
