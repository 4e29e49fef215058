//! The agent layer: an Agent spec made runnable (the core's config, a
//! model client, the toolbox, the system prompt), and the model and tool
//! ports over it. Every driver builds its agents here: `agents run` and the
//! CLI from YAML files and the store, the operator from the API server.
//!
//! Secrets the agent names come only from the [`SecretSource`] the driver
//! passes: the environment standalone, nothing in the operator (which reads
//! the session namespace's Secrets itself). Never the operator's own
//! environment.

use crate::api::agent::{ModelProvider, ModelSpec, ToolSpec};
use crate::api::{convert, AgentSpec, SessionSpec};
use crate::core::call::TaskHandle;
use crate::core::policy::SecretKeyRef;
use crate::core::{AgentTurn, Disposition, Millis, SessionConfig, SessionId, ToolCall};
use crate::model::{
    AnthropicModel, ModelClient, ModelRequest, OpenAiModel, ScriptedModel, ScriptedReply,
    DEFAULT_ANTHROPIC_BASE_URL, DEFAULT_MAX_TOKENS,
};
use crate::ports::{
    AgentDocuments, AgentSource, ModelFailure, ModelIdentity, ModelInput, ModelPort, TaskPoll,
    ToolPort, ToolRun,
};
use crate::tools::{ToolDef, ToolKind, Toolbox};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::time::Duration;

pub mod mcp;
pub mod subagents;

/// Where a session's named agent (`spec.agentRef`) is found: a YAML file,
/// the operator's watch of the API server.
pub trait AgentLookup: Send + Sync {
    /// The Agent's spec, `Ok(None)` when there is no such Agent, or why it
    /// cannot be read.
    fn agent<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<AgentSpec>, String>>;
}

/// A store's Agents, read from the documents it hands through its port.
struct FromDocuments<'a>(&'a dyn AgentDocuments);

impl AgentLookup for FromDocuments<'_> {
    fn agent<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<AgentSpec>, String>> {
        Box::pin(async move {
            match self.0.agent_document(name).await? {
                Some(doc) => serde_json::from_value(doc)
                    .map(Some)
                    .map_err(|e| format!("its spec is not an Agent's: {e}")),
                None => Ok(None),
            }
        })
    }
}

/// Where the secrets an agent names (`{name, key}`) are read from.
pub trait SecretSource {
    fn secret(&self, name: &str, key: &str) -> Option<String>;

    /// The API key of a `provider` model, from the Secret key the spec
    /// names; by default that secret.
    fn model_key(&self, name: &str, key: &str, provider: ModelProvider) -> Option<String> {
        let _ = provider;
        self.secret(name, key)
    }
}

/// Why a session's agent cannot be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unresolved {
    /// Neither or both of `spec.agent` and `spec.agentRef`.
    #[error("session {session}: set exactly one of spec.agentRef and spec.agent")]
    Ambiguous { session: String },
    #[error("session {session} refers to agent {name:?} (spec.agentRef), which is not {place}")]
    Missing {
        session: String,
        name: String,
        place: String,
    },
    #[error("session {session}: agent {name:?} cannot be read: {error}")]
    Unreadable {
        session: String,
        name: String,
        error: String,
    },
}

/// The agent a session runs, by the one rule every driver follows: exactly
/// one of an inline `spec.agent` and a `spec.agentRef` that `lookup` finds.
/// `place` says where a missing Agent was looked for (for the message).
pub async fn definition(
    session: &str,
    spec: &SessionSpec,
    lookup: &dyn AgentLookup,
    place: &str,
) -> Result<Definition, Unresolved> {
    let (agent_name, mut agent) = match (&spec.agent, &spec.agent_ref) {
        (Some(inline), None) => (None, inline.clone()),
        (None, Some(r)) => match lookup.agent(&r.name).await {
            Ok(Some(found)) => (Some(r.name.clone()), found),
            Ok(None) => {
                return Err(Unresolved::Missing {
                    session: session.into(),
                    name: r.name.clone(),
                    place: place.into(),
                })
            }
            Err(error) => {
                return Err(Unresolved::Unreadable {
                    session: session.into(),
                    name: r.name.clone(),
                    error,
                })
            }
        },
        _ => {
            return Err(Unresolved::Ambiguous {
                session: session.into(),
            })
        }
    };
    subagents::describe_agent_tools(&mut agent, lookup).await;
    Ok(Definition {
        session: session.into(),
        agent_name,
        agent,
        spec: spec.clone(),
    })
}

/// The agent of a stored session, from where its store says it comes from:
/// the definition stored beside it, or (in a cluster) its spec by the rule
/// of [`definition`].
pub async fn stored(session: &str, source: AgentSource, place: &str) -> Result<Definition, String> {
    match source {
        AgentSource::Stored(json) => serde_json::from_value(json)
            .map_err(|e| format!("session {session}: its stored definition cannot be read: {e}")),
        AgentSource::Cluster { spec, agents } => {
            let spec: SessionSpec = serde_json::from_value(spec)
                .map_err(|e| format!("session {session}: its spec cannot be read: {e}"))?;
            definition(session, &spec, &FromDocuments(agents.as_ref()), place)
                .await
                .map_err(|e| e.to_string())
        }
    }
}

/// No secrets: a driver that resolves them itself (the operator).
pub struct NoSecrets;

impl SecretSource for NoSecrets {
    fn secret(&self, _: &str, _: &str) -> Option<String> {
        None
    }
}

/// What a stored session was started from: kept in the store so any later
/// process (`resume`, a worker) rebuilds the same agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Definition {
    pub session: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_name: Option<String>,
    pub agent: AgentSpec,
    pub spec: SessionSpec,
}

/// An agent ready to run.
#[derive(Clone, Debug)]
pub struct RunnableAgent {
    pub config: SessionConfig,
    pub model: ModelClient,
    pub toolbox: Toolbox,
    pub system_prompt: String,
}

impl RunnableAgent {
    /// Every Secret key the agent's tools name (http headers, the env of
    /// container tools and of `runIsolated` rules), each once: what a
    /// cluster driver must check is usable before anything runs.
    pub fn tool_secrets(&self) -> Vec<SecretKeyRef> {
        let isolated = self
            .config
            .tools
            .values()
            .filter_map(|t| t.container.as_ref())
            .chain(
                self.config
                    .policy
                    .rules
                    .iter()
                    .filter_map(|r| match &r.disposition {
                        Disposition::RunIsolated { spec } => Some(spec),
                        _ => None,
                    }),
            )
            .chain(match &self.config.policy.default {
                Disposition::RunIsolated { spec } => Some(spec),
                _ => None,
            })
            .flat_map(|spec| spec.env.iter().filter_map(|e| e.secret.clone()));
        let mut all: Vec<SecretKeyRef> = self
            .toolbox
            .secret_refs()
            .into_iter()
            .chain(isolated)
            .collect();
        all.sort_by(|a, b| (&a.name, &a.key).cmp(&(&b.name, &b.key)));
        all.dedup();
        all
    }
}

impl Definition {
    pub fn session_id(&self) -> SessionId {
        SessionId(self.session.clone())
    }

    /// The runnable agent; `created_at` anchors the session deadline.
    /// Secrets the agent names (the model's API key) come from `secrets`
    /// and nowhere else.
    pub fn build(
        &self,
        created_at: Millis,
        secrets: &dyn SecretSource,
    ) -> Result<RunnableAgent, String> {
        let mut config = convert::session_config(
            self.agent_name.as_deref(),
            &self.agent,
            self.spec.limits.as_ref(),
            created_at,
            if self.agent_name.is_some() {
                "agent.spec"
            } else {
                "spec.agent"
            },
        )
        .map_err(|e| e.to_string())?;
        subagents::apply(
            &mut config,
            &self.agent,
            self.spec.parent.as_ref(),
            u32::MAX,
        );
        let timeout = Duration::from_secs(self.agent.model.timeout_seconds().into());
        let model = model_client(&self.agent.model, secrets, timeout)?;
        let field = if self.agent_name.is_some() {
            "agent.spec"
        } else {
            "spec.agent"
        };
        let toolbox = Toolbox::new(
            self.agent
                .tools
                .iter()
                .filter(|t| t.mcp.is_none())
                .map(tool_def)
                .collect(),
        )
        .and_then(|t| t.with_mcp_servers(mcp::servers(&self.agent.tools)))
        .map_err(|e| format!("{field}.tools: {e}"))?;
        Ok(RunnableAgent {
            config,
            model,
            toolbox,
            system_prompt: self.agent.system_prompt.clone(),
        })
    }
}

/// A tool of the agent spec as the in-step tools run it.
pub fn tool_def(t: &ToolSpec) -> ToolDef {
    if t.agent.is_some() {
        return subagents::tool_def(t);
    }
    let kind = if let Some(b) = &t.builtin {
        ToolKind::Builtin {
            function: b.function.clone(),
        }
    } else if let Some(h) = &t.http {
        ToolKind::Http {
            url: h.url.clone(),
            headers: h.headers.iter().map(crate::api::convert::env_var).collect(),
        }
    } else {
        ToolKind::Container
    };
    ToolDef {
        name: t.name.clone(),
        description: t.description.clone(),
        parameters: t.parameters.clone(),
        kind,
    }
}

/// The model client of `spec`: its key from `secrets` (read only for the
/// provider the spec names), each request bounded by `timeout`.
pub fn model_client(
    spec: &ModelSpec,
    secrets: &dyn SecretSource,
    timeout: Duration,
) -> Result<ModelClient, String> {
    let missing = |p: &str| format!("spec.model.provider is {p} but spec.model.{p} is missing");
    let sections = [
        spec.openai.is_some(),
        spec.anthropic.is_some(),
        spec.scripted.is_some(),
    ];
    if sections.iter().filter(|set| **set).count() > 1 {
        return Err("spec.model: set only the section matching spec.model.provider (openai, anthropic or scripted)".into());
    }
    let key = spec
        .api_key_secret_ref()
        .and_then(|(r, _)| secrets.model_key(&r.name, &r.key, spec.provider));
    match spec.provider {
        ModelProvider::Scripted => {
            let s = spec.scripted.as_ref().ok_or_else(|| missing("scripted"))?;
            Ok(ModelClient::Scripted(scripted_model(s)))
        }
        ModelProvider::Openai => {
            let o = spec.openai.as_ref().ok_or_else(|| missing("openai"))?;
            let client = OpenAiModel::new(&o.base_url, &o.model, key, timeout);
            Ok(ModelClient::OpenAi(match &o.azure {
                Some(azure) => client.azure(azure.api_version.as_deref()),
                None => client,
            }))
        }
        ModelProvider::Anthropic => {
            let a = spec
                .anthropic
                .as_ref()
                .ok_or_else(|| missing("anthropic"))?;
            Ok(ModelClient::Anthropic(AnthropicModel::new(
                a.base_url.as_deref().unwrap_or(DEFAULT_ANTHROPIC_BASE_URL),
                &a.model,
                a.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
                key,
                timeout,
            )))
        }
    }
}

fn scripted_model(s: &crate::api::agent::ScriptedModel) -> ScriptedModel {
    ScriptedModel {
        replies: s
            .replies
            .iter()
            .map(|r| ScriptedReply {
                text: r.text.clone(),
                tool_calls: r
                    .tool_calls
                    .iter()
                    .map(|c| (c.name.clone(), c.arguments.clone()))
                    .collect(),
            })
            .collect(),
    }
}

/// The model port over the agent's client.
pub struct AgentModel<'a>(pub &'a ModelClient);

impl ModelPort for AgentModel<'_> {
    fn reply<'a>(
        &'a self,
        input: ModelInput<'a>,
    ) -> BoxFuture<'a, Result<AgentTurn, ModelFailure>> {
        Box::pin(async move {
            self.0
                .reply(&ModelRequest {
                    system_prompt: input.system_prompt,
                    turns: input.turns,
                    tools: input.tools,
                })
                .await
                .map_err(|e| ModelFailure {
                    message: e.message,
                    retryable: e.retryable,
                    retry_after: e.retry_after,
                })
        })
    }

    fn identity(&self) -> ModelIdentity {
        match self.0 {
            ModelClient::Scripted(_) => ModelIdentity {
                provider: "agents.scripted".into(),
                model: "scripted".into(),
            },
            ModelClient::OpenAi(m) => ModelIdentity {
                provider: "openai".into(),
                model: m.model.clone(),
            },
            ModelClient::Anthropic(m) => ModelIdentity {
                provider: "anthropic".into(),
                model: m.model.clone(),
            },
        }
    }
}

/// The in-step tools port over the agent's toolbox.
pub struct AgentTools<'a>(pub &'a Toolbox);

impl ToolPort for AgentTools<'_> {
    fn run<'a>(
        &'a self,
        call: &'a ToolCall,
        idempotency_key: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, ToolRun> {
        Box::pin(self.0.start(call, idempotency_key, Some(timeout)))
    }

    fn poll_task<'a>(
        &'a self,
        call: &'a ToolCall,
        task: &'a TaskHandle,
        answers: Option<&'a str>,
    ) -> BoxFuture<'a, TaskPoll> {
        Box::pin(self.0.poll_task(call, task, answers))
    }

    fn cancel_task<'a>(&'a self, call: &'a ToolCall, task: &'a TaskHandle) -> BoxFuture<'a, ()> {
        Box::pin(self.0.cancel_task(call, task))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::session::AgentRef;

    struct One(Result<Option<AgentSpec>, String>);
    impl AgentLookup for One {
        fn agent<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Option<AgentSpec>, String>> {
            let answer = self.0.clone();
            Box::pin(async move { answer })
        }
    }

    fn agent() -> AgentSpec {
        serde_json::from_value(serde_json::json!({
            "model": {"provider": "scripted", "scripted": {"replies": [{"text": "hi"}]}}
        }))
        .unwrap()
    }

    fn spec(inline: bool, named: bool) -> SessionSpec {
        serde_json::from_value(serde_json::json!({"messages": ["hi"]}))
            .map(|mut s: SessionSpec| {
                s.agent = inline.then(agent);
                s.agent_ref = named.then(|| AgentRef { name: "a".into() });
                s
            })
            .unwrap()
    }

    #[tokio::test]
    async fn exactly_one_of_agent_and_agent_ref_one_rule_for_every_driver() {
        let found = One(Ok(Some(agent())));
        let d = definition("s", &spec(true, false), &found, "here")
            .await
            .unwrap();
        assert_eq!(d.agent_name, None);
        let d = definition("s", &spec(false, true), &found, "here")
            .await
            .unwrap();
        assert_eq!(d.agent_name.as_deref(), Some("a"));
        for (inline, named) in [(true, true), (false, false)] {
            let e = definition("s", &spec(inline, named), &found, "here")
                .await
                .unwrap_err();
            assert_eq!(
                e,
                Unresolved::Ambiguous {
                    session: "s".into()
                }
            );
            assert!(e
                .to_string()
                .contains("set exactly one of spec.agentRef and spec.agent"));
        }
        let e = definition("s", &spec(false, true), &One(Ok(None)), "in this file")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("which is not in this file"), "{e}");
        let e = definition("s", &spec(false, true), &One(Err("403".into())), "x")
            .await
            .unwrap_err();
        assert!(matches!(e, Unresolved::Unreadable { .. }), "{e}");
    }
}
