//! An agent's spec as the core runs it: the session config, the policy,
//! and the policy recorded on a Continuation (its API form and back).

use super::agent::{
    AgentSpec, ApprovalPolicySpec, ApprovalSetting, ApproversSpec, ContainerTool, DecoratorsSpec,
    DispositionMode, EnvVar, EnvVarSource, OnTimeoutMode, PolicySpec, SecretKeyRef, ToolSpec,
};
use super::convert::{err, ConvertError};
use super::session::{AppliedDecoratorsStatus, AppliedPolicyStatus, LimitsSpec};
use crate::core::policy::{AppliedPolicy, ApprovalPolicy, Decorators, OnTimeout, Rule};
use crate::core::policy::{EnvVarSpec, SecretKeyRef as CoreSecretKeyRef};
use crate::core::session::tool_rule;
use crate::core::session::ToolInfo;
use crate::core::*;
use std::collections::BTreeMap;

const DEFAULT_DEFER_REASON: &str = "waiting for an outside party";

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
            tool.agent.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(err(
                at,
                "a tool needs exactly one of builtin, http, container, mcp, agent",
            ));
        }
        let name = super::agent::tool_name(tool);
        if !names.insert(name) {
            return Err(err(
                format!("{at}.name"),
                format!("tool name {name:?} is used twice"),
            ));
        }
        unknown_outcome_is_meaningful(tool, &at)?;
        if let Some(agent) = &tool.agent {
            crate::core::ids::validate_name("agent tool's Agent", &agent.agent_ref)
                .map_err(|e| err(format!("{at}.agent.ref"), e))?;
            let info = ToolInfo {
                container: None,
                sub_agent: Some(agent.agent_ref.clone()),
                unknown_outcome: tool_rule(tool.idempotent, None, tool.on_unknown_outcome),
            };
            tools.insert(name.to_string(), info);
            continue;
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
        let unknown_outcome = tool_rule(tool.idempotent, None, tool.on_unknown_outcome);
        let info = ToolInfo {
            container,
            sub_agent: None,
            unknown_outcome,
        };
        tools.insert(tool.name.clone(), info);
    }
    Ok(tools)
}

/// `onUnknownOutcome` says what happens to a tool that is not
/// idempotent: on any other tool it would do nothing, so it is refused
/// rather than ignored. (An MCP server's tools may be marked not
/// idempotent by the server, so there it needs only `idempotent` unset.)
fn unknown_outcome_is_meaningful(tool: &ToolSpec, at: &str) -> Result<(), ConvertError> {
    let Some(rule) = tool.on_unknown_outcome else {
        return Ok(());
    };
    let idempotent = match tool.idempotent {
        Some(i) => i,
        None => tool.mcp.is_none(),
    };
    if idempotent {
        return Err(err(
            format!("{at}.onUnknownOutcome"),
            format!(
                "onUnknownOutcome: {} applies only to a tool that is not idempotent, and tool {:?} is (idempotent is {}); set idempotent: false, or remove onUnknownOutcome",
                rule.name(),
                tool.name,
                if tool.idempotent.is_some() { "true" } else { "unset, which means true" },
            ),
        ));
    }
    Ok(())
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
            sub_agent: info.sub_agent.as_deref(),
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
    let pricing = agent
        .model
        .pricing
        .as_ref()
        .map(|p| super::budget::pricing(p, &format!("{field}.model.pricing")))
        .transpose()?;
    let budget = super::budget::budget(limits, pricing.as_ref())?;
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
        .filter(|t| t.mcp.is_none() && t.agent.is_none())
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
        budget,
        pricing,
        ..SessionConfig::default()
    })
}

pub fn policy(spec: &PolicySpec, field: &str) -> Result<Policy, ConvertError> {
    check_approvals(spec, field)?;
    if spec.default == DispositionMode::SubAgent {
        return Err(err(
            format!("{field}.default"),
            "subAgent is the mode of an `agent` tool, not a policy choice; add a tool with `agent: {ref: NAME}` instead",
        ));
    }
    if let Some(i) = spec
        .rules
        .iter()
        .position(|r| r.disposition == DispositionMode::SubAgent)
    {
        return Err(err(
            format!("{field}.rules[{i}].disposition"),
            "subAgent is the mode of an `agent` tool, not a policy choice; add a tool with `agent: {ref: NAME}` instead",
        ));
    }
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
        // Refused in rules by `policy`; an applied one names its agent.
        DispositionMode::SubAgent => Disposition::SubAgent {
            agent: String::new(),
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
        Disposition::SubAgent { .. } => (DispositionMode::SubAgent, None, None),
    };
    let agent = match &p.disposition {
        Disposition::SubAgent { agent } => Some(agent.clone()),
        _ => None,
    };
    AppliedPolicyStatus {
        disposition,
        reason,
        isolation,
        agent,
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
            DispositionMode::SubAgent => Disposition::SubAgent {
                agent: s.agent.clone().unwrap_or_default(),
            },
            other => disposition(other, None, None),
        },
        decorators: applied_decorators(&s.decorators),
        rule: s.rule.map(|r| r as usize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Session;

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
                sub_agent: None,
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
}
