//! The Anthropic Messages API client (`POST {baseUrl}/v1/messages`): the
//! wire format here, the bounded HTTP attempt and its classification
//! (429 and 529 retryable with `retry-after`) in `super::endpoint`.
//!
//! The mapping:
//! - the system prompt is the top-level `system` field, not a message;
//! - an agent turn is one `assistant` message: a `text` block, then one
//!   `tool_use` block per call (its `input` is the arguments' JSON object);
//! - a user turn is one `user` message: first one `tool_result` block per
//!   result, in the order the model issued the calls (the API requires
//!   them first, each naming a `tool_use` of the message before), then the
//!   user's text;
//! - empty messages are left out and neighbours of one role merged, so
//!   roles alternate as the API requires;
//! - the reply's `stop_reason` decides: `end_turn`, `tool_use` and
//!   `stop_sequence` are a turn; `max_tokens` (the reply was cut, perhaps
//!   inside a call's arguments), `refusal` and a full context window fail
//!   the call with what to change, without retrying (it would be cut, or
//!   refused, again at the same price);
//! - usage: the prompt tokens are `input_tokens` plus the tokens written to
//!   and read from the prompt cache (`cache_creation_input_tokens`,
//!   `cache_read_input_tokens`), as OpenAI counts cached tokens in its
//!   `prompt_tokens`.

use super::endpoint::{Endpoint, KeyHeader, Wire, QUOTE_BYTES};
use super::{ModelError, ModelRequest};
use crate::core::{AgentTurn, TokenUsage, ToolCall, Turn, UserTurn};
use crate::http::allow::AllowedUrls;
use crate::http::clip;
use serde_json::{json, Map, Value};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The API version every request names (`anthropic-version`).
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Where the API is, for an agent that names no `baseUrl`.
pub const DEFAULT_ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com";

/// Output tokens a reply may have, for an agent that sets no `maxTokens`
/// (the API requires the field): what every current model can give.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

const WIRE: Wire = Wire {
    section: "spec.model.anthropic",
    reply: "a message",
};

/// A Messages API client. The API key never appears in `Debug` output or
/// in error messages.
#[derive(Clone)]
pub struct AnthropicModel {
    /// The API root, `https://api.anthropic.com`; requests go to
    /// `{base_url}/v1/messages`.
    pub base_url: String,
    pub model: String,
    /// The `max_tokens` of each request.
    pub max_tokens: u32,
    endpoint: Endpoint,
}

impl fmt::Debug for AnthropicModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnthropicModel")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("max_tokens", &self.max_tokens)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl AnthropicModel {
    /// `timeout` bounds each request. An empty key counts as no key.
    pub fn new(
        base_url: &str,
        model: &str,
        max_tokens: u32,
        api_key: Option<String>,
        timeout: Duration,
    ) -> Self {
        AnthropicModel {
            base_url: base_url.trim_end_matches('/').to_string(),
            model: model.to_string(),
            max_tokens,
            endpoint: Endpoint::new(api_key, timeout),
        }
    }

    /// The client held to the operator's list of model URLs (as
    /// [`super::OpenAiModel::with_allowed_urls`]).
    pub fn with_allowed_urls(mut self, allowed: Option<Arc<AllowedUrls>>) -> Self {
        self.endpoint = self.endpoint.with_allowed_urls(allowed);
        self
    }

    /// The client with the API key `key` (an empty one counts as none).
    pub fn with_api_key(mut self, key: Option<String>) -> Self {
        self.endpoint = self.endpoint.with_api_key(key);
        self
    }

    /// The URL each request goes to.
    pub fn url(&self) -> String {
        format!("{}/v1/messages", self.base_url)
    }

    /// Why the operator's list refuses this client's URL, if it does.
    pub fn url_not_allowed(&self) -> Option<String> {
        self.endpoint.not_allowed(&self.url())
    }

    /// The request body; see the module doc for the mapping.
    pub fn request_body(&self, req: &ModelRequest<'_>) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": messages(req.turns),
        });
        if !req.system_prompt.is_empty() {
            body["system"] = json!(req.system_prompt);
        }
        if !req.tools.is_empty() {
            body["tools"] = req
                .tools
                .iter()
                .map(|t| {
                    let mut tool = json!({
                        "name": t.name,
                        "input_schema": t.parameters.clone()
                            .unwrap_or_else(|| json!({"type": "object"})),
                    });
                    if !t.description.is_empty() {
                        tool["description"] = json!(t.description);
                    }
                    tool
                })
                .collect();
        }
        body
    }

    /// One attempt; see `super::endpoint` for how failures are classified.
    pub async fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        if let Some(why) = self.url_not_allowed() {
            return Err(ModelError::permanent(format!(
                "{why}; check {}.baseUrl",
                WIRE.section
            )));
        }
        let body = self.request_body(req);
        let headers = [("anthropic-version", ANTHROPIC_VERSION)];
        let message = self
            .endpoint
            .post(
                &self.url(),
                KeyHeader::Named("x-api-key"),
                &headers,
                &body,
                WIRE,
                parse_message,
            )
            .await?;
        message.into_turn(self.max_tokens)
    }
}

/// The wire messages of the conversation, roles alternating.
fn messages(turns: &[Turn]) -> Vec<Value> {
    let mut out: Vec<(&str, Vec<Value>)> = Vec::new();
    let mut asked: &[ToolCall] = &[];
    for turn in turns {
        let (role, blocks) = match turn {
            Turn::Agent(a) => {
                asked = &a.tool_calls;
                ("assistant", assistant_blocks(a))
            }
            Turn::User(u) => {
                let blocks = user_blocks(u, asked);
                asked = &[];
                ("user", blocks)
            }
        };
        match out.last_mut() {
            _ if blocks.is_empty() => {}
            Some((last, existing)) if *last == role => existing.extend(blocks),
            _ => out.push((role, blocks)),
        }
    }
    out.into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect()
}

fn assistant_blocks(turn: &AgentTurn) -> Vec<Value> {
    let text = turn.text.as_deref().filter(|t| !t.is_empty());
    let calls = turn.tool_calls.iter().map(|c| {
        json!({"type": "tool_use", "id": c.model_call_id, "name": c.name, "input": tool_input(c)})
    });
    text.map(|t| json!({"type": "text", "text": t}))
        .into_iter()
        .chain(calls)
        .collect()
}

/// A call's arguments as the object `input` must be. Arguments the model
/// wrote are one; any others (a malformed call kept as written) go as
/// `{"arguments": ...}` rather than be lost.
fn tool_input(call: &ToolCall) -> Value {
    match serde_json::from_str::<Value>(&call.arguments) {
        Ok(object @ Value::Object(_)) => object,
        _ if call.arguments.trim().is_empty() => json!({}),
        _ => json!({"arguments": call.arguments}),
    }
}

/// The blocks of one user turn: its tool results in the order the model
/// issued the calls (`asked`), then the user's text.
fn user_blocks(turn: &UserTurn, asked: &[ToolCall]) -> Vec<Value> {
    let position = |id: &str| {
        asked
            .iter()
            .position(|c| c.model_call_id == id)
            .unwrap_or(usize::MAX)
    };
    let mut results: Vec<_> = turn.tool_results.iter().collect();
    // Stable, so results for calls not in `asked` keep their order, last.
    results.sort_by_key(|r| position(&r.model_call_id));
    let mut blocks: Vec<Value> = results
        .into_iter()
        .map(|r| {
            let mut block = json!({
                "type": "tool_result",
                "tool_use_id": r.model_call_id,
                "content": r.result.to_model_text(),
            });
            if r.result.is_error() {
                block["is_error"] = json!(true);
            }
            block
        })
        .collect();
    blocks.extend(
        turn.message
            .as_deref()
            .filter(|m| !m.is_empty())
            .map(|m| json!({"type": "text", "text": m})),
    );
    blocks
}

/// A reply of the Messages API, read.
#[derive(Clone, Debug, PartialEq)]
pub struct AnthropicMessage {
    pub turn: AgentTurn,
    /// `end_turn`, `tool_use`, `max_tokens`, ...; none if the reply has none.
    pub stop_reason: Option<String>,
    /// Input tokens written to the prompt cache.
    pub cache_creation_input_tokens: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read_input_tokens: u64,
}

impl AnthropicMessage {
    /// The turn, unless `stop_reason` says the reply is not one to act on.
    /// `max_tokens` is the request's, for the message.
    pub fn into_turn(self, max_tokens: u32) -> Result<AgentTurn, ModelError> {
        let why = match self.stop_reason.as_deref() {
            Some("max_tokens") => format!(
                "stopped at max_tokens ({max_tokens} output tokens) before its reply was \
                 complete (a tool call's arguments may be cut); raise \
                 {}.maxTokens, then retry the session",
                WIRE.section
            ),
            Some("model_context_window_exceeded") => "stopped because the conversation \
                 filled the model's context window; start a new session, or use a model \
                 with a larger window"
                .to_string(),
            Some("refusal") => "declined to answer (stop_reason refusal)".to_string(),
            _ => return Ok(self.turn),
        };
        Err(ModelError::permanent(format!(
            "the model {why}; it is not asked again, since it would stop the same way"
        )))
    }
}

/// Parses a Messages API response body; the error says what is missing
/// or wrong.
pub fn parse_message(body: &str) -> Result<AnthropicMessage, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("the body is not JSON ({e})"))?;
    let content = match v.get("content") {
        Some(Value::Array(c)) => c,
        Some(_) => return Err("`content` is not an array".into()),
        None => {
            return Err(match v.pointer("/error/message").and_then(Value::as_str) {
                Some(m) => format!(
                    "the body holds an error instead of `content`: {}",
                    clip(m, QUOTE_BYTES)
                ),
                None => "the body has no `content`".into(),
            })
        }
    };
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for (i, block) in content.iter().enumerate() {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(block.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_use") => tool_calls.push(tool_call(block, i)?),
            // Thinking and server-tool blocks carry nothing to act on here.
            Some(_) => {}
            None => return Err(format!("`content[{i}]` has no `type`")),
        }
    }
    let usage = |field: &str| {
        v.get("usage")
            .and_then(|u| u.get(field))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let (cache_creation, cache_read) = (
        usage("cache_creation_input_tokens"),
        usage("cache_read_input_tokens"),
    );
    Ok(AnthropicMessage {
        turn: AgentTurn {
            text: Some(text).filter(|t| !t.is_empty()),
            tool_calls,
            usage: TokenUsage {
                prompt_tokens: usage("input_tokens") + cache_creation + cache_read,
                completion_tokens: usage("output_tokens"),
                cached_prompt_tokens: cache_read,
                cost_micros: 0,
            },
            ..Default::default()
        },
        stop_reason: v
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
        cache_creation_input_tokens: cache_creation,
        cache_read_input_tokens: cache_read,
    })
}

/// A `tool_use` block as a call; its `input` kept as the JSON text the
/// core parses.
fn tool_call(block: &Value, i: usize) -> Result<ToolCall, String> {
    let field = |name: &str| {
        block
            .get(name)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .ok_or(format!("`content[{i}]` (tool_use) has no `{name}`"))
    };
    let input = match block.get("input") {
        Some(v) => v.clone(),
        None => Value::Object(Map::new()),
    };
    Ok(ToolCall {
        model_call_id: field("id")?.to_string(),
        name: field("name")?.to_string(),
        arguments: input.to_string(),
    })
}

#[cfg(test)]
mod tests;
