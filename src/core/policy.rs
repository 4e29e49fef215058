//! The tool-call policy: a pure decision, per call, of how it runs.
//!
//! Rules match tool names by glob; the first match wins; with no match the
//! default applies (itself `runSync` unless the agent says otherwise).
//! Decorators wrap the disposition: `approval` waits for a decision first,
//! `timeout` bounds the wait or run, `retries` re-runs failures with backoff,
//! `cache` reuses results for identical arguments, `truncate` caps result size.

use super::conversation::ToolCall;
use super::ids::SessionId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where a container-backed call runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IsolationSpec {
    /// Container image (Job runner). Empty for the process runner.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub image: String,
    /// Command to run; the envelope arrives on stdin, the result goes to stdout.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Arguments to the command.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Resource limits, e.g. `{"cpu": "500m", "memory": "128Mi"}`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
    /// The only variables the tool gets besides the runner's fixed few:
    /// a tool never inherits the worker's environment (API keys live there).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVarSpec>,
}

/// A variable (or an `http` tool's header) named by a tool's definition:
/// a literal value, or a Secret key the user opts into. Only the
/// reference is stored; the value is read when the tool starts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvVarSpec {
    /// The variable's name.
    pub name: String,
    /// A literal, non-secret value (it is stored with the session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// A Secret key; standalone it is read from the worker's environment
    /// variable [`SecretKeyRef::env_name`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretKeyRef>,
}

/// A key of a Secret: in a cluster the Secret object, standalone the
/// environment variable `AGENTS_SECRET_<NAME>_<KEY>` of the worker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// The Secret's name.
    pub name: String,
    /// The key in the Secret.
    pub key: String,
}

impl SecretKeyRef {
    /// `{name: llm, key: api-key}` is `AGENTS_SECRET_LLM_API_KEY`.
    pub fn env_name(&self) -> String {
        let clean = |s: &str| {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_uppercase()
                    } else {
                        '_'
                    }
                })
                .collect::<String>()
        };
        format!("AGENTS_SECRET_{}_{}", clean(&self.name), clean(&self.key))
    }
}

impl EnvVarSpec {
    /// The value, reading a secret through `lookup` (the worker's
    /// environment); the error names what is missing and how to fix it.
    pub fn resolve(&self, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
        match (&self.value, &self.secret) {
            (Some(v), None) => Ok(v.clone()),
            (None, Some(r)) => lookup(&r.env_name()).ok_or_else(|| {
                format!(
                    "{:?} takes its value from secret {}/{}, read from the environment variable {} of the worker, which is not set; export it where the worker runs",
                    self.name,
                    r.name,
                    r.key,
                    r.env_name()
                )
            }),
            _ => Err(format!(
                "{:?} needs exactly one of value and secret",
                self.name
            )),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "mode", rename_all = "camelCase")]
pub enum Disposition {
    /// Run now, inside the step.
    #[default]
    RunSync,
    /// Run in the background; the session yields until it is done.
    RunAsync,
    /// Run in isolation (a Job in a cluster, a child process standalone).
    RunIsolated {
        /// Where it runs.
        spec: IsolationSpec,
    },
    /// Wait for an outside party to supply the result.
    Defer {
        /// Why it waits.
        reason: String,
    },
    /// Run as a child Session of another Agent (an `agent` tool); set by
    /// the tool's kind, never by a rule.
    SubAgent {
        /// The Agent the child runs.
        agent: String,
    },
}

impl Disposition {
    pub fn name(&self) -> &'static str {
        match self {
            Disposition::RunSync => "runSync",
            Disposition::RunAsync => "runAsync",
            Disposition::RunIsolated { .. } => "runIsolated",
            Disposition::Defer { .. } => "defer",
            Disposition::SubAgent { .. } => "subAgent",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Decorators {
    /// Wait for an approve/deny decision before running.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approval: bool,
    /// Who may decide, how many must agree, and what a timeout does; `None`
    /// with `approval`: any one person the cluster's RBAC lets decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_policy: Option<ApprovalPolicy>,
    /// Give up after this many seconds (run time, or wait time when deferred).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Extra attempts after a failure, with exponential backoff.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retries: u32,
    /// Reuse a result for the same tool and arguments.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache: bool,
    /// Cap results at this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate_bytes: Option<usize>,
}

/// Named approvers, a quorum and a timeout for an approval.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalPolicy {
    /// User names that may decide; with no groups or service accounts
    /// either, anyone RBAC lets write decisions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub users: Vec<String>,
    /// Groups whose members may decide.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    /// Service accounts that may decide: `name` (the call's namespace) or
    /// `namespace/name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<String>,
    /// Different people who must approve; one denial is enough to deny.
    pub quorum: u32,
    /// How long the call waits for the quorum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// What the timeout does.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Whether an approver may replace the arguments.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_edit: bool,
}

/// What happens when nobody reached a verdict in time.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum OnTimeout {
    /// The call is denied; the model is told nobody decided.
    #[default]
    Deny,
    /// The call runs as if approved.
    Approve,
    /// The session fails.
    Fail,
}

impl OnTimeout {
    pub fn name(self) -> &'static str {
        match self {
            OnTimeout::Deny => "deny",
            OnTimeout::Approve => "approve",
            OnTimeout::Fail => "fail",
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    /// Glob over tool names: `*`, `?`, `[abc]`.
    pub tool: String,
    pub disposition: Disposition,
    #[serde(default)]
    pub decorators: Decorators,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    #[serde(default)]
    pub default: Disposition,
    #[serde(default)]
    pub default_decorators: Decorators,
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// The decision recorded on a call: what it ran as and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedPolicy {
    /// How the call runs: `{mode: runSync | runAsync | runIsolated | defer}`,
    /// with `spec` (runIsolated) or `reason` (defer).
    pub disposition: Disposition,
    /// The decorators the call runs under.
    #[serde(default)]
    pub decorators: Decorators,
    /// Index of the matching rule; `None` when the default applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<usize>,
}

/// What the policy may look at besides the call itself.
#[derive(Clone, Debug, Default)]
pub struct PolicyContext<'a> {
    pub session: Option<&'a SessionId>,
    /// The tool's own container, when the tool is a container tool: such a
    /// tool can only run isolated, and fills in a rule's missing image.
    pub tool_container: Option<&'a IsolationSpec>,
    /// The Agent an `agent` tool calls: such a call always runs as a
    /// child Session; a rule adds only its decorators (approval, timeout,
    /// retries).
    pub sub_agent: Option<&'a str>,
}

/// A policy whose globs failed to parse, naming the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("policy rule {index} has an invalid tool pattern {pattern:?}: {message}")]
pub struct PolicyError {
    pub index: usize,
    pub pattern: String,
    pub message: String,
}

impl Policy {
    /// Checks every pattern; call when loading an agent so errors surface early.
    pub fn validate(&self) -> Result<(), PolicyError> {
        for (index, rule) in self.rules.iter().enumerate() {
            glob::Pattern::new(&rule.tool).map_err(|e| PolicyError {
                index,
                pattern: rule.tool.clone(),
                message: e.to_string(),
            })?;
        }
        Ok(())
    }

    /// Pure: the same policy, context and call always give the same answer.
    /// Invalid patterns never match (validate first to report them).
    pub fn classify(&self, ctx: &PolicyContext<'_>, call: &ToolCall) -> AppliedPolicy {
        let matched = self.rules.iter().enumerate().find(|(_, r)| {
            glob::Pattern::new(&r.tool)
                .map(|p| p.matches(&call.name))
                .unwrap_or(false)
        });
        let mut applied = match matched {
            Some((i, rule)) => AppliedPolicy {
                disposition: rule.disposition.clone(),
                decorators: rule.decorators.clone(),
                rule: Some(i),
            },
            None => AppliedPolicy {
                disposition: self.default.clone(),
                decorators: self.default_decorators.clone(),
                rule: None,
            },
        };
        if let Some(container) = ctx.tool_container {
            applied.disposition = match applied.disposition {
                Disposition::RunSync | Disposition::RunAsync => Disposition::RunIsolated {
                    spec: container.clone(),
                },
                Disposition::RunIsolated { spec } => Disposition::RunIsolated {
                    spec: merge_spec(spec, container),
                },
                defer => defer,
            };
        }
        if let Some(agent) = ctx.sub_agent {
            applied.disposition = Disposition::SubAgent {
                agent: agent.to_string(),
            };
        }
        applied
    }
}

fn merge_spec(mut rule: IsolationSpec, tool: &IsolationSpec) -> IsolationSpec {
    if rule.image.is_empty() {
        rule.image = tool.image.clone();
    }
    if rule.command.is_empty() {
        rule.command = tool.command.clone();
        if rule.args.is_empty() {
            rule.args = tool.args.clone();
        }
    }
    for (k, v) in &tool.limits {
        rule.limits.entry(k.clone()).or_insert_with(|| v.clone());
    }
    for var in &tool.env {
        if !rule.env.iter().any(|r| r.name == var.name) {
            rule.env.push(var.clone());
        }
    }
    rule
}

/// Backoff before retry `attempt` (1-based): 1 s, 2 s, 4 s, ... capped at 5 min.
pub fn retry_backoff_millis(attempt: u32) -> u64 {
    let exp = attempt.saturating_sub(1).min(20);
    (1000u64 << exp).min(300_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str) -> ToolCall {
        ToolCall {
            model_call_id: format!("id-{name}"),
            name: name.into(),
            arguments: "{}".into(),
        }
    }

    fn policy() -> Policy {
        Policy {
            default: Disposition::RunSync,
            default_decorators: Decorators::default(),
            rules: vec![
                Rule {
                    tool: "search_*".into(),
                    disposition: Disposition::RunAsync,
                    decorators: Decorators {
                        cache: true,
                        ..Default::default()
                    },
                },
                Rule {
                    tool: "bash".into(),
                    disposition: Disposition::RunIsolated {
                        spec: IsolationSpec {
                            image: "busybox:ci".into(),
                            ..Default::default()
                        },
                    },
                    decorators: Decorators {
                        timeout_seconds: Some(30),
                        retries: 2,
                        ..Default::default()
                    },
                },
                Rule {
                    tool: "send_*".into(),
                    disposition: Disposition::Defer {
                        reason: "a human sends mail".into(),
                    },
                    decorators: Decorators {
                        approval: true,
                        ..Default::default()
                    },
                },
                Rule {
                    tool: "search_web".into(),
                    disposition: Disposition::RunSync,
                    decorators: Decorators::default(),
                },
            ],
        }
    }

    #[test]
    fn first_matching_rule_wins_and_default_is_run_sync() {
        let p = policy();
        let ctx = PolicyContext::default();
        // search_web matches rule 0 before the later exact rule 3.
        let a = p.classify(&ctx, &call("search_web"));
        assert_eq!(a.disposition, Disposition::RunAsync);
        assert_eq!(a.rule, Some(0));
        assert!(a.decorators.cache);
        let b = p.classify(&ctx, &call("bash"));
        assert_eq!(b.disposition.name(), "runIsolated");
        assert_eq!(b.decorators.retries, 2);
        assert_eq!(b.decorators.timeout_seconds, Some(30));
        let c = p.classify(&ctx, &call("send_email"));
        assert_eq!(
            c.disposition,
            Disposition::Defer {
                reason: "a human sends mail".into()
            }
        );
        assert!(c.decorators.approval);
        let d = p.classify(&ctx, &call("get_time"));
        assert_eq!(d.disposition, Disposition::RunSync);
        assert_eq!(d.rule, None);
        assert_eq!(
            Policy::default().classify(&ctx, &call("x")).disposition,
            Disposition::RunSync
        );
    }

    #[test]
    fn container_tools_always_run_isolated_with_their_image() {
        let container = IsolationSpec {
            image: "tools/ls:1".into(),
            command: vec!["/bin/ls".into()],
            ..Default::default()
        };
        let ctx = PolicyContext {
            session: None,
            tool_container: Some(&container),
            sub_agent: None,
        };
        let a = Policy::default().classify(&ctx, &call("ls"));
        assert_eq!(
            a.disposition,
            Disposition::RunIsolated {
                spec: container.clone()
            }
        );
        let mut p = Policy::default();
        p.rules.push(Rule {
            tool: "l?".into(),
            disposition: Disposition::RunIsolated {
                spec: IsolationSpec {
                    limits: [("memory".to_string(), "64Mi".to_string())].into(),
                    ..Default::default()
                },
            },
            decorators: Decorators::default(),
        });
        let Disposition::RunIsolated { spec } = p.classify(&ctx, &call("ls")).disposition else {
            panic!("expected isolated")
        };
        assert_eq!(spec.image, "tools/ls:1");
        assert_eq!(spec.command, vec!["/bin/ls".to_string()]);
        assert_eq!(spec.limits["memory"], "64Mi");
    }

    #[test]
    fn env_values_are_literal_or_an_opted_in_secret() {
        let lookup = |k: &str| (k == "AGENTS_SECRET_GH_API_TOKEN").then(|| "s3cret".to_string());
        let lit = EnvVarSpec {
            name: "MODE".into(),
            value: Some("fast".into()),
            ..Default::default()
        };
        assert_eq!(lit.resolve(&lookup), Ok("fast".into()));
        let secret = EnvVarSpec {
            name: "TOKEN".into(),
            secret: Some(SecretKeyRef {
                name: "gh".into(),
                key: "api-token".into(),
            }),
            ..Default::default()
        };
        assert_eq!(secret.resolve(&lookup), Ok("s3cret".into()));
        let missing = EnvVarSpec {
            secret: Some(SecretKeyRef {
                name: "other".into(),
                key: "k".into(),
            }),
            ..secret.clone()
        };
        let e = missing.resolve(&lookup).unwrap_err();
        assert!(
            e.contains("AGENTS_SECRET_OTHER_K") && e.contains("not set"),
            "{e}"
        );
        let neither = EnvVarSpec {
            name: "X".into(),
            ..Default::default()
        };
        assert!(neither.resolve(&lookup).is_err());
    }

    #[test]
    fn invalid_glob_is_reported_with_its_rule() {
        let mut p = Policy::default();
        p.rules.push(Rule {
            tool: "[abc".into(),
            disposition: Disposition::RunAsync,
            decorators: Decorators::default(),
        });
        let err = p.validate().unwrap_err();
        assert_eq!(err.index, 0);
        assert!(err.to_string().contains("\"[abc\""), "{err}");
    }

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(retry_backoff_millis(1), 1000);
        assert_eq!(retry_backoff_millis(2), 2000);
        assert_eq!(retry_backoff_millis(3), 4000);
        assert_eq!(retry_backoff_millis(40), 300_000);
    }
}
