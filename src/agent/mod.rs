//! The agent layer: an Agent spec made runnable (the core's config, a
//! model client, the toolbox, the system prompt), and the model and tool
//! ports over it. Every driver builds its agents here: `agents run` and the
//! CLI from YAML files and the store, the operator from the API server.
//!
//! Secrets the agent names come only from the [`SecretSource`] the driver
//! passes: the environment standalone, nothing in the operator (which reads
//! the session namespace's Secrets itself). Never the operator's own
//! environment.

use crate::api::agent::{ModelProvider, ToolSpec};
use crate::api::{convert, AgentSpec, SessionSpec};
use crate::core::{AgentTurn, Millis, SessionConfig, SessionId, ToolCall, ToolResult};
use crate::model::{ModelClient, ModelRequest, OpenAiModel, ScriptedModel, ScriptedReply};
use crate::ports::{ModelFailure, ModelInput, ModelPort, ToolPort};
use crate::tools::{ToolDef, ToolKind, Toolbox};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Where the secrets an agent names (`{name, key}`) are read from.
pub trait SecretSource {
    fn secret(&self, name: &str, key: &str) -> Option<String>;
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
        let config = convert::session_config(
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
        let model = model_client(&self.agent, secrets)?;
        let toolbox = Toolbox::new(self.agent.tools.iter().map(tool_def).collect())
            .map_err(|e| e.to_string())?;
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

fn model_client(agent: &AgentSpec, secrets: &dyn SecretSource) -> Result<ModelClient, String> {
    match agent.model.provider {
        ModelProvider::Scripted => {
            let s = agent
                .model
                .scripted
                .as_ref()
                .ok_or("spec.model.provider is scripted but spec.model.scripted is missing")?;
            Ok(ModelClient::Scripted(ScriptedModel {
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
            }))
        }
        ModelProvider::Openai => {
            let o = agent
                .model
                .openai
                .as_ref()
                .ok_or("spec.model.provider is openai but spec.model.openai is missing")?;
            let key = o
                .api_key_secret_ref
                .as_ref()
                .and_then(|r| secrets.secret(&r.name, &r.key));
            Ok(ModelClient::OpenAi(OpenAiModel::new(
                &o.base_url,
                &o.model,
                key,
                std::time::Duration::from_secs(agent.model.timeout_seconds().into()),
            )))
        }
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
}

/// The in-step tools port over the agent's toolbox.
pub struct AgentTools<'a>(pub &'a Toolbox);

impl ToolPort for AgentTools<'_> {
    fn run<'a>(
        &'a self,
        call: &'a ToolCall,
        idempotency_key: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, ToolResult> {
        Box::pin(self.0.run(call, idempotency_key, Some(timeout)))
    }
}
