//! Model adapters: turn the conversation into the model's next
//! [`AgentTurn`].
//!
//! - [`ScriptedModel`] replays the agent's scripted replies, one per agent
//!   turn, so a replay after a crash gives the same answer.
//! - [`OpenAiModel`] speaks the chat-completions wire format to any
//!   compatible endpoint (Azure OpenAI among them).
//! - [`AnthropicModel`] speaks Anthropic's Messages API.
//!
//! An adapter makes one attempt per call and classifies a failure
//! ([`ModelError::retryable`], [`ModelError::retry_after`]); the core owns
//! retries and backoff, so there is one retry implementation. Adapters see
//! only core data: the turns and the tools' [`ToolSchema`]s.

mod anthropic;
mod endpoint;
mod openai;
mod scripted;

pub use anthropic::{
    parse_message, AnthropicMessage, AnthropicModel, ANTHROPIC_VERSION, DEFAULT_ANTHROPIC_BASE_URL,
    DEFAULT_MAX_TOKENS,
};
pub use endpoint::{parse_retry_after, DEFAULT_TIMEOUT, MAX_MODEL_REPLY_BYTES, MAX_RETRY_AFTER};
pub use openai::{parse_completion, OpenAiModel};
pub use scripted::{ScriptedModel, ScriptedReply};

use crate::core::{AgentTurn, ToolSchema, Turn};
use crate::http::allow::AllowedUrls;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// What the model sees.
#[derive(Clone, Copy, Debug)]
pub struct ModelRequest<'a> {
    pub system_prompt: &'a str,
    pub turns: &'a [Turn],
    pub tools: &'a [ToolSchema],
}

/// Why a model call failed. The message never holds the API key.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ModelError {
    /// What went wrong, for the user and for the session's status.
    pub message: String,
    /// Worth trying again (rate limits, 5xx, network trouble, timeouts, a
    /// reply that is not a completion); the core backs off and retries
    /// within its limit.
    pub retryable: bool,
    /// How long the endpoint asked us to wait (`Retry-After`), capped at
    /// [`MAX_RETRY_AFTER`]; the core waits at least this long.
    pub retry_after: Option<Duration>,
}

impl ModelError {
    /// A failure worth trying again.
    pub fn retryable(message: impl Into<String>) -> Self {
        ModelError {
            message: message.into(),
            retryable: true,
            retry_after: None,
        }
    }

    /// A failure that trying again would only repeat.
    pub fn permanent(message: impl Into<String>) -> Self {
        ModelError {
            message: message.into(),
            retryable: false,
            retry_after: None,
        }
    }
}

/// The model an agent uses.
#[derive(Clone, Debug)]
pub enum ModelClient {
    Scripted(ScriptedModel),
    OpenAi(OpenAiModel),
    Anthropic(AnthropicModel),
}

impl ModelClient {
    /// One attempt at the model's next turn. The future is `Send`, so a
    /// driver can run it inside a kube-runtime reconcile (which needs
    /// `Send + 'static`: own the client and the turns in the future).
    // Spelled out rather than `async fn` so `Send` is a checked promise,
    // not an inference a later change could silently drop.
    #[allow(clippy::manual_async_fn)]
    pub fn reply<'a>(
        &'a self,
        req: &'a ModelRequest<'a>,
    ) -> impl Future<Output = Result<AgentTurn, ModelError>> + Send + 'a {
        async move {
            match self {
                ModelClient::Scripted(m) => m.reply(req),
                ModelClient::OpenAi(m) => m.reply(req).await,
                ModelClient::Anthropic(m) => m.reply(req).await,
            }
        }
    }

    /// Held to the operator's list of model URLs (a scripted model calls
    /// none).
    pub fn with_allowed_urls(self, allowed: Option<Arc<AllowedUrls>>) -> Self {
        match self {
            ModelClient::Scripted(_) => self,
            ModelClient::OpenAi(m) => ModelClient::OpenAi(m.with_allowed_urls(allowed)),
            ModelClient::Anthropic(m) => ModelClient::Anthropic(m.with_allowed_urls(allowed)),
        }
    }

    /// With the API key `key` (an empty one counts as none).
    pub fn with_api_key(self, key: Option<String>) -> Self {
        match self {
            ModelClient::Scripted(_) => self,
            ModelClient::OpenAi(m) => ModelClient::OpenAi(m.with_api_key(key)),
            ModelClient::Anthropic(m) => ModelClient::Anthropic(m.with_api_key(key)),
        }
    }

    /// Why the operator's list refuses the URL this client calls, if it does.
    pub fn url_not_allowed(&self) -> Option<String> {
        match self {
            ModelClient::Scripted(_) => None,
            ModelClient::OpenAi(m) => m.url_not_allowed(),
            ModelClient::Anthropic(m) => m.url_not_allowed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::UserTurn;

    fn assert_send<T: Send>(_: &T) {}
    fn assert_send_static<T: Send + 'static>(_: &T) {}

    #[test]
    fn reply_futures_are_send_and_fit_a_static_task() {
        let client = ModelClient::OpenAi(OpenAiModel::new(
            "http://127.0.0.1:9/v1",
            "m",
            Some("k".into()),
            Duration::from_secs(1),
        ));
        let turns = vec![Turn::User(UserTurn::default())];
        let tools = vec![ToolSchema {
            name: "echo".into(),
            description: String::new(),
            parameters: None,
        }];
        let req = ModelRequest {
            system_prompt: "",
            turns: &turns,
            tools: &tools,
        };
        assert_send(&client.reply(&req));
        if let ModelClient::OpenAi(m) = &client {
            assert_send(&m.reply(&req));
        }
        let anthropic =
            AnthropicModel::new("http://127.0.0.1:9", "m", 1, None, Duration::from_secs(1));
        assert_send(&anthropic.reply(&req));
        // The shape of an operator reconcile: everything owned by the task.
        let client = Arc::new(client);
        let task = async move {
            let req = ModelRequest {
                system_prompt: "",
                turns: &turns,
                tools: &tools,
            };
            client.reply(&req).await
        };
        assert_send_static(&task);
    }
}
