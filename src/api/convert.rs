//! The one place where CRD types and core types meet. Every mapping here
//! is lossless for what the core keeps; round trips are tested.

use super::agent::{
    AgentSpec, ApprovalPolicySpec, ApprovalSetting, ApproversSpec, ContainerTool, DecoratorsSpec,
    DispositionMode, EnvVar, EnvVarSource, OnTimeoutMode, PolicySpec, SecretKeyRef,
};
use super::continuation::{
    ContextSnapshotSpec, ContinuationSpec as ContinuationSpecApi, ContinuationStatus,
};
use super::session::{
    AppliedDecoratorsStatus, AppliedPolicyStatus, ApprovalStatus, CallStateName, ClaimStatus,
    LimitsSpec, OpenTurnStatus, Role, SessionPhase, SessionStatus, ToolCallStatus,
    ToolResultStatus, TrackedCallStatus, TurnStatus, UsageStatus, WaitingForName,
};
use crate::core::call::flat::FlatCall;
use crate::core::call::{Approval, TrackedToolCall};
use crate::core::conversation::ToolResultEntry;
use crate::core::envelope::ContextSnapshot;
use crate::core::policy::{AppliedPolicy, ApprovalPolicy, Decorators, OnTimeout, Rule};
use crate::core::policy::{EnvVarSpec, SecretKeyRef as CoreSecretKeyRef};
use crate::core::session::{ContinuationSpec, PartialUserTurn, ToolInfo};
use crate::core::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeMap;

/// A spec or status that cannot be mapped, naming the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConvertError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConvertError {
    ConvertError {
        field: field.into(),
        message: message.into(),
    }
}

const DEFAULT_DEFER_REASON: &str = "waiting for an outside party";

// ---- agent -> session config ------------------------------------------

/// The agent's tools by name; each has exactly one kind and a name of its own.
fn tool_infos(agent: &AgentSpec, field: &str) -> Result<BTreeMap<String, ToolInfo>, ConvertError> {
    let mut tools = BTreeMap::new();
    let mut names = std::collections::BTreeSet::new();
    for (i, tool) in agent.tools.iter().enumerate() {
        let at = format!("{field}.tools[{i}]");
        let kinds = [
            tool.builtin.is_some(),
            tool.http.is_some(),
            tool.container.is_some(),
            tool.mcp.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(err(
                at,
                "a tool needs exactly one of builtin, http, container, mcp",
            ));
        }
        if !names.insert(tool.name.as_str()) {
            return Err(err(
                format!("{at}.name"),
                format!("tool name {:?} is used twice", tool.name),
            ));
        }
        if let Some(mcp) = &tool.mcp {
            // The server's tools join when it is listed (the agent layer).
            if mcp.url.is_some() == mcp.command.is_some() {
                return Err(err(
                    format!("{at}.mcp"),
                    "an mcp server needs exactly one of url and command",
                ));
            }
            if tool.parameters.is_some() {
                return Err(err(
                    format!("{at}.parameters"),
                    "an mcp server's tools bring their own input schemas; remove parameters",
                ));
            }
            continue;
        }
        let container = tool.container.as_ref().map(isolation_spec);
        tools.insert(tool.name.clone(), ToolInfo { container });
    }
    Ok(tools)
}

/// Every tool that would run isolated must know where (an image or a
/// command, from its rule or its own container).
fn every_isolated_tool_has_a_place(
    policy: &Policy,
    tools: &BTreeMap<String, ToolInfo>,
    field: &str,
) -> Result<(), ConvertError> {
    for (name, info) in tools {
        let probe = ToolCall {
            model_call_id: String::new(),
            name: name.clone(),
            arguments: "{}".into(),
        };
        let ctx = policy::PolicyContext {
            session: None,
            tool_container: info.container.as_ref(),
        };
        let applied = policy.classify(&ctx, &probe);
        if let Disposition::RunIsolated { spec } = &applied.disposition {
            if spec.image.is_empty() && spec.command.is_empty() {
                let rule = applied
                    .rule
                    .map(|r| format!("{field}.policy.rules[{r}].isolation"))
                    .unwrap_or_else(|| format!("{field}.policy.rules"));
                return Err(err(
                    rule,
                    format!("tool {name:?} runs isolated but neither its rule nor the tool names an image or command; add `isolation: {{image: ...}}` to the rule or make it a container tool"),
                ));
            }
        }
    }
    Ok(())
}

/// The core's configuration for a session run by `agent`.
pub fn session_config(
    agent_name: Option<&str>,
    agent: &AgentSpec,
    limits: Option<&LimitsSpec>,
    created_at: Millis,
    field: &str,
) -> Result<SessionConfig, ConvertError> {
    let policy = policy(&agent.policy, &format!("{field}.policy"))?;
    let tools = tool_infos(agent, field)?;
    every_isolated_tool_has_a_place(&policy, &tools, field)?;
    // A tool fed a secret (an env var or a header from a Secret) may give
    // answers that depend on it: such results are never cached.
    let context_has_secrets = agent.tools.iter().any(|t| {
        let secret = |e: &EnvVar| e.value_from.is_some();
        t.container
            .as_ref()
            .is_some_and(|c| c.env.iter().any(secret))
            || t.http
                .as_ref()
                .is_some_and(|h| h.headers.iter().any(secret))
            || t.mcp
                .as_ref()
                .is_some_and(|m| m.headers.iter().chain(&m.env).any(secret))
    }) || agent.policy.rules.iter().any(|r| {
        r.isolation
            .as_ref()
            .is_some_and(|c| c.env.iter().any(|e| e.value_from.is_some()))
    });
    // What runs for each tool: a changed definition never reuses results
    // cached for the old one.
    let tool_fingerprints = agent
        .tools
        .iter()
        .filter(|t| t.mcp.is_none())
        .map(|t| {
            let what = serde_json::json!({
                "builtin": t.builtin, "http": t.http, "container": t.container,
            });
            (t.name.clone(), crate::core::cache::fingerprint(&what))
        })
        .collect();
    Ok(SessionConfig {
        agent: agent_name.map(str::to_string),
        policy,
        tools,
        limits: Limits {
            max_turns: limits.and_then(|l| l.max_turns),
            deadline: limits
                .and_then(|l| l.deadline_seconds)
                .map(|s| created_at.plus_secs(s)),
            max_calls_per_reply: None,
        },
        context_has_secrets,
        tool_fingerprints,
        model_timeout_secs: agent.model.timeout_seconds() as u64,
        model_retries: agent.model.max_retries(),
        max_result_bytes: usize::try_from(agent.max_result_bytes()).unwrap_or(usize::MAX),
        ..SessionConfig::default()
    })
}

pub fn policy(spec: &PolicySpec, field: &str) -> Result<Policy, ConvertError> {
    check_approvals(spec, field)?;
    let p = Policy {
        default: disposition(spec.default, None, None),
        default_decorators: spec
            .default_decorators
            .as_ref()
            .map(decorators)
            .unwrap_or_default(),
        rules: spec
            .rules
            .iter()
            .map(|r| Rule {
                tool: r.tool.clone(),
                disposition: disposition(r.disposition, r.reason.as_deref(), r.isolation.as_ref()),
                decorators: decorators(&r.decorators()),
            })
            .collect(),
    };
    p.validate().map_err(|e| {
        err(
            format!("{field}.rules[{}].tool", e.index),
            format!("invalid glob {:?}: {}", e.pattern, e.message),
        )
    })?;
    Ok(p)
}

fn disposition(
    mode: DispositionMode,
    reason: Option<&str>,
    isolation: Option<&ContainerTool>,
) -> Disposition {
    match mode {
        DispositionMode::RunSync => Disposition::RunSync,
        DispositionMode::RunAsync => Disposition::RunAsync,
        DispositionMode::RunIsolated => Disposition::RunIsolated {
            spec: isolation.map(isolation_spec).unwrap_or_default(),
        },
        DispositionMode::Defer => Disposition::Defer {
            reason: reason.unwrap_or(DEFAULT_DEFER_REASON).to_string(),
        },
    }
}

fn isolation_spec(c: &ContainerTool) -> IsolationSpec {
    IsolationSpec {
        image: c.image.clone(),
        command: c.command.clone(),
        args: c.args.clone(),
        limits: c.limits.clone(),
        env: c.env.iter().map(env_var).collect(),
    }
}

/// An API `EnvVar` as the runners take it.
pub fn env_var(e: &EnvVar) -> EnvVarSpec {
    EnvVarSpec {
        name: e.name.clone(),
        value: e.value.clone(),
        secret: e.value_from.as_ref().map(|f| CoreSecretKeyRef {
            name: f.secret_key_ref.name.clone(),
            key: f.secret_key_ref.key.clone(),
        }),
    }
}

fn api_env_var(e: &EnvVarSpec) -> EnvVar {
    EnvVar {
        name: e.name.clone(),
        value: e.value.clone(),
        value_from: e.secret.as_ref().map(|s| EnvVarSource {
            secret_key_ref: SecretKeyRef {
                name: s.name.clone(),
                key: s.key.clone(),
            },
        }),
    }
}

fn container_tool(s: &IsolationSpec) -> ContainerTool {
    ContainerTool {
        image: s.image.clone(),
        command: s.command.clone(),
        args: s.args.clone(),
        limits: s.limits.clone(),
        env: s.env.iter().map(api_env_var).collect(),
    }
}

fn decorators(d: &DecoratorsSpec) -> Decorators {
    let (approval, approval_policy) = match &d.approval {
        ApprovalSetting::Any(on) => (*on, None),
        ApprovalSetting::Policy(p) => (true, Some(approval_policy(p))),
        // Refused by `check_approvals`; never a call without its approval.
        ApprovalSetting::Invalid { .. } => (true, None),
    };
    Decorators {
        approval,
        approval_policy,
        timeout_seconds: d.timeout_seconds,
        retries: d.retries.unwrap_or(0),
        cache: d.cache,
        truncate_bytes: d.truncate_bytes.map(|b| b as usize),
    }
}

/// Every `approval` is `true`, `false` or a well-formed policy object.
fn check_approvals(spec: &PolicySpec, field: &str) -> Result<(), ConvertError> {
    let settings = spec
        .default_decorators
        .iter()
        .map(|d| (format!("{field}.defaultDecorators.approval"), &d.approval))
        .chain(
            spec.rules
                .iter()
                .enumerate()
                .map(|(i, r)| (format!("{field}.rules[{i}].approval"), &r.approval)),
        );
    for (path, setting) in settings {
        if let ApprovalSetting::Invalid { why, .. } = setting {
            return Err(err(path, why.clone()));
        }
    }
    Ok(())
}

fn approval_policy(p: &ApprovalPolicySpec) -> ApprovalPolicy {
    let approvers = p.approvers.clone().unwrap_or_default();
    ApprovalPolicy {
        users: approvers.users,
        groups: approvers.groups,
        service_accounts: approvers.service_accounts,
        quorum: p.quorum.unwrap_or(1).max(1),
        timeout_seconds: p.timeout_seconds,
        on_timeout: match p.on_timeout.unwrap_or_default() {
            OnTimeoutMode::Deny => OnTimeout::Deny,
            OnTimeoutMode::Approve => OnTimeout::Approve,
            OnTimeoutMode::Fail => OnTimeout::Fail,
        },
        allow_edit: p.allow_edit,
    }
}

fn approval_policy_spec(p: &ApprovalPolicy) -> ApprovalPolicySpec {
    let named = !(p.users.is_empty() && p.groups.is_empty() && p.service_accounts.is_empty());
    ApprovalPolicySpec {
        approvers: named.then(|| ApproversSpec {
            users: p.users.clone(),
            groups: p.groups.clone(),
            service_accounts: p.service_accounts.clone(),
        }),
        quorum: Some(p.quorum),
        timeout_seconds: p.timeout_seconds,
        on_timeout: Some(match p.on_timeout {
            OnTimeout::Deny => OnTimeoutMode::Deny,
            OnTimeout::Approve => OnTimeoutMode::Approve,
            OnTimeout::Fail => OnTimeoutMode::Fail,
        }),
        allow_edit: p.allow_edit,
    }
}

fn applied_decorators_status(d: &Decorators) -> AppliedDecoratorsStatus {
    AppliedDecoratorsStatus {
        approval: d.approval,
        approval_policy: d.approval_policy.as_ref().map(approval_policy_spec),
        timeout_seconds: d.timeout_seconds,
        retries: (d.retries > 0).then_some(d.retries),
        cache: d.cache,
        truncate_bytes: d.truncate_bytes.map(|b| b as u64),
    }
}

fn applied_decorators(d: &AppliedDecoratorsStatus) -> Decorators {
    Decorators {
        approval: d.approval,
        approval_policy: d.approval_policy.as_ref().map(approval_policy),
        timeout_seconds: d.timeout_seconds,
        retries: d.retries.unwrap_or(0),
        cache: d.cache,
        truncate_bytes: d.truncate_bytes.map(|b| b as usize),
    }
}

pub fn applied_policy_status(p: &AppliedPolicy) -> AppliedPolicyStatus {
    let (disposition, reason, isolation) = match &p.disposition {
        Disposition::RunSync => (DispositionMode::RunSync, None, None),
        Disposition::RunAsync => (DispositionMode::RunAsync, None, None),
        Disposition::RunIsolated { spec } => (
            DispositionMode::RunIsolated,
            None,
            Some(container_tool(spec)),
        ),
        Disposition::Defer { reason } => (DispositionMode::Defer, Some(reason.clone()), None),
    };
    AppliedPolicyStatus {
        disposition,
        reason,
        isolation,
        rule: p.rule.map(|r| r as u32),
        decorators: applied_decorators_status(&p.decorators),
    }
}

pub fn applied_policy(s: &AppliedPolicyStatus) -> AppliedPolicy {
    AppliedPolicy {
        disposition: match s.disposition {
            DispositionMode::RunIsolated => Disposition::RunIsolated {
                spec: s.isolation.as_ref().map(isolation_spec).unwrap_or_default(),
            },
            DispositionMode::Defer => Disposition::Defer {
                reason: s.reason.clone().unwrap_or_default(),
            },
            other => disposition(other, None, None),
        },
        decorators: applied_decorators(&s.decorators),
        rule: s.rule.map(|r| r as usize),
    }
}

// ---- time ----------------------------------------------------------------

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

// ---- session state <-> status ----------------------------------------------

/// The status for `state`. Fields the core does not keep (conditions,
/// observedGeneration, messagesSeen) are left at their defaults for the
/// driver to fill.
pub fn session_status(state: &SessionState) -> SessionStatus {
    let pending = state.pending().len() as u32;
    SessionStatus {
        phase: session_phase(state),
        conditions: Vec::new(),
        observed_generation: None,
        paused: state.paused,
        messages_seen: state.messages_taken,
        retries_seen: state.retries_taken,
        agent_turns: state.agent_turns,
        pending_count: pending,
        usage: usage_status(state.usage),
        answer: state.answer.clone(),
        failure: state.failure.clone(),
        archived_turns: Vec::new(),
        turns: state.turns.iter().map(turn_status).collect(),
        open_turn: state.open.as_ref().map(|o| OpenTurnStatus {
            turn: o.turn,
            calls: o.calls.iter().map(tracked_call_status).collect(),
        }),
        inbox: state.inbox.clone(),
        model_attempts: state.model_attempts,
        failed_steps: state.failed_steps,
        model_retry_at: state.model_attempt.retry_at().map(time),
        model_claim: state.model_attempt.claim().map(claim_status),
        traceparent: None,
    }
}

pub fn session_phase(state: &SessionState) -> SessionPhase {
    match state.phase {
        Phase::Succeeded => SessionPhase::Succeeded,
        Phase::Failed => SessionPhase::Failed,
        _ if state.paused => SessionPhase::Paused,
        Phase::Idle => SessionPhase::Pending,
        Phase::AwaitingModel => SessionPhase::AwaitingModel,
        Phase::RunningTools => SessionPhase::Running,
        Phase::Waiting => SessionPhase::Waiting,
    }
}

/// Rebuilds the core state from a status written by [`session_status`].
pub fn session_state(id: &SessionId, status: &SessionStatus) -> Result<SessionState, ConvertError> {
    let turns = status
        .turns
        .iter()
        .enumerate()
        .map(|(i, t)| turn(t, &format!("status.turns[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let open = match &status.open_turn {
        None => None,
        Some(o) => Some(PartialUserTurn {
            turn: o.turn,
            calls: o
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| tracked_call(c, &format!("status.openTurn.calls[{i}]")))
                .collect::<Result<Vec<_>, _>>()?,
        }),
    };
    let model_attempt = Attempt::from_parts(
        status.model_claim.as_ref().map(claim),
        status.model_retry_at.as_ref().map(millis),
    )
    .map_err(|why| err("status.modelClaim", format!("the model call {why}")))?;
    let mut state = SessionState {
        id: id.clone(),
        phase: Phase::Idle,
        paused: status.paused,
        turns,
        open,
        inbox: status.inbox.clone(),
        agent_turns: status.agent_turns,
        usage: TokenUsage {
            prompt_tokens: status.usage.prompt_tokens,
            completion_tokens: status.usage.completion_tokens,
        },
        answer: status.answer.clone(),
        failure: status.failure.clone(),
        model_attempts: status.model_attempts,
        model_attempt,
        messages_taken: status.messages_seen,
        retries_taken: status.retries_seen,
        failed_steps: status.failed_steps,
    };
    state.phase = derive_phase(&state, status.phase);
    Ok(state)
}

/// The core phase is implied by the turns; only the paused flag hides it
/// in the status phase.
fn derive_phase(state: &SessionState, shown: SessionPhase) -> Phase {
    match shown {
        SessionPhase::Succeeded => return Phase::Succeeded,
        SessionPhase::Failed => return Phase::Failed,
        _ => {}
    }
    if let Some(open) = &state.open {
        return if open
            .calls
            .iter()
            .any(|c| matches!(c.state(), CallState::Ready | CallState::Running))
        {
            Phase::RunningTools
        } else {
            Phase::Waiting
        };
    }
    match state.turns.last() {
        None => Phase::Idle,
        Some(Turn::User(_)) => Phase::AwaitingModel,
        Some(Turn::Agent(_)) => Phase::Succeeded,
    }
}

fn usage_status(u: TokenUsage) -> UsageStatus {
    UsageStatus {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
    }
}

fn tool_call_status(c: &ToolCall) -> ToolCallStatus {
    ToolCallStatus {
        model_call_id: c.model_call_id.clone(),
        name: c.name.clone(),
        arguments: c.arguments.clone(),
    }
}

pub fn tool_call(c: &ToolCallStatus) -> ToolCall {
    ToolCall {
        model_call_id: c.model_call_id.clone(),
        name: c.name.clone(),
        arguments: c.arguments.clone(),
    }
}

fn turn_status(t: &Turn) -> TurnStatus {
    match t {
        Turn::User(u) => TurnStatus {
            role: Role::User,
            message: u.message.clone(),
            text: None,
            tool_calls: Vec::new(),
            tool_results: u
                .tool_results
                .iter()
                .map(|r| ToolResultStatus {
                    call_id: r.call_id.to_string(),
                    model_call_id: r.model_call_id.clone(),
                    tool: r.tool.clone(),
                    token: r.token.as_ref().map(|t| t.0.clone()),
                    result: result_value(&r.result),
                    truncate_bytes: r.truncate_bytes.map(|b| b as u64),
                })
                .collect(),
            usage: None,
        },
        Turn::Agent(a) => TurnStatus {
            role: Role::Agent,
            message: None,
            text: a.text.clone(),
            tool_calls: a.tool_calls.iter().map(tool_call_status).collect(),
            tool_results: Vec::new(),
            usage: Some(usage_status(a.usage)),
        },
    }
}

fn turn(t: &TurnStatus, field: &str) -> Result<Turn, ConvertError> {
    Ok(match t.role {
        Role::User => Turn::User(UserTurn {
            message: t.message.clone(),
            tool_results: t
                .tool_results
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let at = format!("{field}.toolResults[{i}]");
                    Ok(ToolResultEntry {
                        call_id: call_id(&r.call_id, &format!("{at}.callId"))?,
                        model_call_id: r.model_call_id.clone(),
                        tool: r.tool.clone(),
                        token: r.token.clone().map(ContinuationToken),
                        result: tool_result(&r.result, &format!("{at}.result"))?,
                        truncate_bytes: r.truncate_bytes.map(|b| b as usize),
                    })
                })
                .collect::<Result<Vec<_>, ConvertError>>()?,
        }),
        Role::Agent => Turn::Agent(AgentTurn {
            text: t.text.clone(),
            tool_calls: t.tool_calls.iter().map(tool_call).collect(),
            usage: t
                .usage
                .map(|u| TokenUsage {
                    prompt_tokens: u.prompt_tokens,
                    completion_tokens: u.completion_tokens,
                })
                .unwrap_or_default(),
        }),
    })
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

fn call_state_name(s: CallState) -> CallStateName {
    match s {
        CallState::Ready => CallStateName::Ready,
        CallState::Running => CallStateName::Running,
        CallState::Deferred => CallStateName::Deferred,
        CallState::Completed => CallStateName::Completed,
        CallState::Failed => CallStateName::Failed,
    }
}

fn call_state(s: CallStateName) -> CallState {
    match s {
        CallStateName::Ready => CallState::Ready,
        CallStateName::Running => CallState::Running,
        CallStateName::Deferred => CallState::Deferred,
        CallStateName::Completed => CallState::Completed,
        CallStateName::Failed => CallState::Failed,
    }
}

pub fn waiting_for_name(w: WaitingFor) -> WaitingForName {
    match w {
        WaitingFor::Approval => WaitingForName::Approval,
        WaitingFor::Background => WaitingForName::Background,
        WaitingFor::Isolated => WaitingForName::Isolated,
        WaitingFor::External => WaitingForName::External,
        WaitingFor::McpTask => WaitingForName::McpTask,
    }
}

pub fn waiting_for(w: WaitingForName) -> WaitingFor {
    match w {
        WaitingForName::Approval => WaitingFor::Approval,
        WaitingForName::Background => WaitingFor::Background,
        WaitingForName::Isolated => WaitingFor::Isolated,
        WaitingForName::External => WaitingFor::External,
        WaitingForName::McpTask => WaitingFor::McpTask,
    }
}

/// The status form of a call: the core's flat form, field for field.
fn tracked_call_status(c: &TrackedToolCall) -> TrackedCallStatus {
    let f = FlatCall::from(c.clone());
    TrackedCallStatus {
        id: f.id.to_string(),
        call: tool_call_status(&f.call),
        state: call_state_name(f.state),
        policy: applied_policy_status(&f.policy),
        token: f.token.map(|t| t.0),
        waiting_for: f.waiting_for.map(waiting_for_name),
        approval: f.approval.map(|a| ApprovalStatus {
            approved: a.approved,
            by: a.by,
            reason: a.reason,
            arguments: a.arguments,
        }),
        result: f.result.as_ref().map(result_value),
        completed_by: f.completed_by,
        attempts: f.attempts,
        deadline: f.deadline.map(time),
        retry_at: f.retry_at.map(time),
        claim: f.claim.as_ref().map(claim_status),
        job: None,
        task: f.task.map(|t| crate::api::session::TaskStatus {
            id: t.id,
            poll_ms: t.poll_ms,
        }),
        task_asks: f.task_asks,
    }
}

/// A call from its status; a combination no sequence of events produces
/// is refused, naming the field and the problem.
fn tracked_call(c: &TrackedCallStatus, field: &str) -> Result<TrackedToolCall, ConvertError> {
    let flat = FlatCall {
        id: call_id(&c.id, &format!("{field}.id"))?,
        call: tool_call(&c.call),
        state: call_state(c.state),
        policy: applied_policy(&c.policy),
        token: c.token.clone().map(ContinuationToken),
        waiting_for: c.waiting_for.map(waiting_for),
        approval: c.approval.as_ref().map(|a| Approval {
            approved: a.approved,
            by: a.by.clone(),
            reason: a.reason.clone(),
            arguments: a.arguments.clone(),
        }),
        result: c
            .result
            .as_ref()
            .map(|r| tool_result(r, &format!("{field}.result")))
            .transpose()?,
        completed_by: c.completed_by.clone(),
        attempts: c.attempts,
        deadline: c.deadline.as_ref().map(millis),
        retry_at: c.retry_at.as_ref().map(millis),
        claim: c.claim.as_ref().map(claim),
        task: c.task.as_ref().map(|t| crate::core::call::TaskHandle {
            id: t.id.clone(),
            poll_ms: t.poll_ms,
        }),
        task_asks: c.task_asks.clone(),
    };
    TrackedToolCall::try_from(flat).map_err(|why| err(field, why.to_string()))
}

fn claim_status(c: &Claim) -> ClaimStatus {
    ClaimStatus {
        holder: c.holder.clone(),
        until: time(c.until),
    }
}

fn claim(c: &ClaimStatus) -> Claim {
    Claim {
        holder: c.holder.clone(),
        until: millis(&c.until),
    }
}

// ---- continuations --------------------------------------------------------

/// The immutable part of a core continuation: the Continuation's spec.
/// What changes after creation goes to the status ([`set_continuation_wait`]).
pub fn continuation_spec(c: &ContinuationSpec) -> ContinuationSpecApi {
    ContinuationSpecApi {
        session: c.session.0.clone(),
        turn: c.call_id.turn,
        call_id: c.call_id.to_string(),
        tool_call: tool_call_status(&c.tool_call),
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
    status.waiting_for = Some(waiting_for_name(c.waiting_for));
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
        Some(w) => waiting_for(w),
        None if policy.decorators.approval
            && status.and_then(|s| s.decision.as_ref()).is_none() =>
        {
            WaitingFor::Approval
        }
        None => match policy.disposition {
            Disposition::RunAsync => WaitingFor::Background,
            Disposition::RunIsolated { .. } => WaitingFor::Isolated,
            Disposition::RunSync | Disposition::Defer { .. } => WaitingFor::External,
        },
    };
    Ok(ContinuationSpec {
        token: token.clone(),
        session: SessionId(c.session.clone()),
        call_id: call_id(&c.call_id, "spec.callId")?,
        tool_call: tool_call(&c.tool_call),
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
        },
        cache_key,
        expires_at: status.and_then(|s| s.expires_at.as_ref()).map(millis),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Session;

    #[test]
    fn a_status_call_no_event_can_produce_is_refused_naming_the_field() {
        let mut state = SessionState::new(SessionId("s".into()));
        let mut call = TrackedToolCall::new(
            CallId::new(1, 0),
            ToolCall {
                model_call_id: "m".into(),
                name: "search".into(),
                arguments: "{}".into(),
            },
            AppliedPolicy::default(),
        );
        call.start().unwrap();
        state.open = Some(PartialUserTurn {
            turn: 1,
            calls: vec![call],
        });
        state.phase = Phase::RunningTools;
        let mut status = session_status(&state);
        assert_eq!(session_state(&state.id, &status), Ok(state.clone()));
        status.open_turn.as_mut().unwrap().calls[0].state = CallStateName::Completed;
        let refused = session_state(&state.id, &status).unwrap_err();
        assert_eq!(refused.field, "status.openTurn.calls[0]");
        assert_eq!(
            refused.message,
            "tool call t1-c0 (search) is final but holds no result"
        );
    }

    fn quickstart() -> Session {
        let text = include_str!("../../examples/quickstart.yaml");
        serde_norway::from_str(text).expect("the quickstart parses")
    }

    #[test]
    fn quickstart_maps_to_a_session_config() {
        let s = quickstart();
        let agent = s.spec.agent.as_ref().unwrap();
        let cfg = session_config(None, agent, None, Millis(0), "spec.agent").unwrap();
        assert_eq!(cfg.tools.len(), 3);
        assert!(cfg.tools["disk_usage"].container.is_some());
        let classify = |name: &str| {
            let call = ToolCall {
                model_call_id: "x".into(),
                name: name.into(),
                arguments: "{}".into(),
            };
            let ctx = policy::PolicyContext {
                session: None,
                tool_container: cfg.tools[name].container.as_ref(),
            };
            cfg.policy.classify(&ctx, &call).disposition
        };
        assert_eq!(classify("lookup"), Disposition::RunSync);
        assert_eq!(
            classify("send_email"),
            Disposition::Defer {
                reason: "a person sends emails".into()
            }
        );
        match classify("disk_usage") {
            // A plain command: the quickstart runs with only this binary.
            Disposition::RunIsolated { spec } => {
                assert!(
                    spec.image.is_empty() && !spec.command.is_empty(),
                    "{spec:?}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_specs_name_the_field_and_the_fix() {
        let mut agent = quickstart().spec.agent.unwrap();
        agent.policy.rules[0].tool = "[oops".into();
        let e = session_config(None, &agent, None, Millis(0), "spec.agent").unwrap_err();
        assert_eq!(e.field, "spec.agent.policy.rules[0].tool");

        let mut agent = quickstart().spec.agent.unwrap();
        agent.policy.rules[0].disposition = DispositionMode::RunIsolated;
        let e = session_config(None, &agent, None, Millis(0), "spec.agent").unwrap_err();
        assert!(e.to_string().contains("runs isolated but neither"), "{e}");

        let mut agent = quickstart().spec.agent.unwrap();
        agent.tools[1].name = "lookup".into();
        let e = session_config(None, &agent, None, Millis(0), "spec.agent").unwrap_err();
        assert!(e.to_string().contains("used twice"), "{e}");

        // An mcp entry: its tools join when listed, not here; it brings no
        // parameters of its own, and needs exactly one of url and command.
        let mut agent = quickstart().spec.agent.unwrap();
        let mut server = agent.tools[0].clone();
        (server.name, server.builtin, server.http, server.container) =
            ("srv".into(), None, None, None);
        server.parameters = None;
        server.mcp = Some(crate::api::agent::McpServerSpec {
            url: Some("http://127.0.0.1:1/mcp".into()),
            ..Default::default()
        });
        agent.tools.push(server.clone());
        let cfg = session_config(None, &agent, None, Millis(0), "spec.agent").unwrap();
        assert!(!cfg.tools.contains_key("srv"));
        let last = agent.tools.len() - 1;
        agent.tools[last].parameters = Some(serde_json::json!({"type": "object"}));
        let e = session_config(None, &agent, None, Millis(0), "spec.agent").unwrap_err();
        assert_eq!(e.field, format!("spec.agent.tools[{last}].parameters"));
        agent.tools[last].parameters = None;
        agent.tools[last].mcp.as_mut().unwrap().command = Some(vec!["x".into()]);
        let e = session_config(None, &agent, None, Millis(0), "spec.agent").unwrap_err();
        assert!(
            e.to_string().contains("exactly one of url and command"),
            "{e}"
        );

        let unknown_field =
            include_str!("../../examples/quickstart.yaml").replace("messages:", "mesages:");
        let e = serde_norway::from_str::<Session>(&unknown_field).unwrap_err();
        assert!(e.to_string().contains("messages"), "{e}");
    }

    #[test]
    fn continuation_spec_round_trips() {
        let spec = ContinuationSpec {
            token: ContinuationToken("s-t1-c0".into()),
            session: SessionId("s".into()),
            call_id: CallId::new(1, 0),
            tool_call: ToolCall {
                model_call_id: "m".into(),
                name: "bash".into(),
                arguments: "{}".into(),
            },
            policy: AppliedPolicy {
                disposition: Disposition::RunIsolated {
                    spec: IsolationSpec {
                        image: "busybox:ci".into(),
                        ..Default::default()
                    },
                },
                decorators: Decorators {
                    retries: 2,
                    cache: true,
                    ..Default::default()
                },
                rule: Some(1),
            },
            waiting_for: WaitingFor::Isolated,
            reason: None,
            context: ContextSnapshot {
                session: SessionId("s".into()),
                turn: 1,
                call_id: CallId::new(1, 0),
                agent: Some("a".into()),
                idempotency_key: "s/t1-c0".into(),
                params: [("region".to_string(), "eu".to_string())].into(),
            },
            cache_key: Some(CacheKey {
                tool: "bash".into(),
                arguments_sha256: "ab".repeat(32),
            }),
            expires_at: Some(Millis(1_700_000_000_000)),
        };
        let api = continuation_spec(&spec);
        let mut status = ContinuationStatus::default();
        set_continuation_wait(&mut status, &spec);
        let json = serde_json::to_string(&(api, status)).unwrap();
        let (back, status): (ContinuationSpecApi, ContinuationStatus) =
            serde_json::from_str(&json).unwrap();
        assert_eq!(
            core_continuation_spec(&spec.token, &back, Some(&status)).unwrap(),
            spec
        );
        // Without a status yet, the wait follows from the spec.
        let derived = core_continuation_spec(&spec.token, &back, None).unwrap();
        assert_eq!(derived.waiting_for, WaitingFor::Isolated);
        let mut approval = back.clone();
        approval.policy.decorators.approval = true;
        let derived = core_continuation_spec(&spec.token, &approval, None).unwrap();
        assert_eq!(derived.waiting_for, WaitingFor::Approval);
    }
}
