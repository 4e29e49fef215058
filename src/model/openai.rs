//! The OpenAI-compatible chat-completions client: the wire format here,
//! the bounded HTTP attempt and its classification in `super::endpoint`.

use super::endpoint::{Endpoint, KeyHeader, Wire, QUOTE_BYTES};
use super::{ModelError, ModelRequest};
use crate::core::{AgentTurn, TokenUsage, ToolCall, Turn, UserTurn};
use crate::http::allow::AllowedUrls;
use crate::http::clip;
use serde_json::{json, Value};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

const WIRE: Wire = Wire {
    section: "spec.model.openai",
    reply: "a chat completion",
};

/// A chat-completions client. The API key never appears in `Debug` output
/// or in error messages.
#[derive(Clone)]
pub struct OpenAiModel {
    pub base_url: String,
    pub model: String,
    endpoint: Endpoint,
    /// How the key is sent: `Authorization: Bearer`, or Azure's `api-key`.
    key_header: KeyHeader,
    /// Azure's `api-version` query parameter.
    api_version: Option<String>,
}

impl fmt::Debug for OpenAiModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiModel")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("endpoint", &self.endpoint)
            .field("key_header", &self.key_header)
            .field("api_version", &self.api_version)
            .finish()
    }
}

impl OpenAiModel {
    /// `base_url` is the API root (`https://api.openai.com/v1`); `timeout`
    /// bounds each request. An empty key counts as no key.
    pub fn new(base_url: &str, model: &str, api_key: Option<String>, timeout: Duration) -> Self {
        OpenAiModel {
            base_url: base_url.trim_end_matches('/').to_string(),
            model: model.to_string(),
            endpoint: Endpoint::new(api_key, timeout),
            key_header: KeyHeader::Bearer,
            api_version: None,
        }
    }

    /// The client as Azure OpenAI wants it: the key in the `api-key`
    /// header, and `api_version` (if any) as the `api-version` query.
    pub fn azure(mut self, api_version: Option<&str>) -> Self {
        self.key_header = KeyHeader::Named("api-key");
        self.api_version = api_version.map(str::to_string);
        self
    }

    /// The client held to the operator's list of model URLs: an endpoint
    /// off the list is never sent a request (nor the key), and a redirect
    /// is followed only to a listed URL of the same origin.
    pub fn with_allowed_urls(mut self, allowed: Option<Arc<AllowedUrls>>) -> Self {
        self.endpoint = self.endpoint.with_allowed_urls(allowed);
        self
    }

    /// The client with the API key `key` (an empty one counts as none).
    pub fn with_api_key(mut self, key: Option<String>) -> Self {
        self.endpoint = self.endpoint.with_api_key(key);
        self
    }

    /// How long one request may take, from connecting to the last byte.
    pub fn timeout(&self) -> Duration {
        self.endpoint.timeout
    }

    /// The URL each request goes to.
    pub fn url(&self) -> String {
        let url = format!("{}/chat/completions", self.base_url);
        match &self.api_version {
            Some(version) => {
                let query: String = form_urlencoded::Serializer::new(String::new())
                    .append_pair("api-version", version)
                    .finish();
                format!("{url}?{query}")
            }
            None => url,
        }
    }

    /// Why the operator's list refuses this client's URL, if it does.
    pub fn url_not_allowed(&self) -> Option<String> {
        self.endpoint.not_allowed(&self.url())
    }

    /// The request body: system prompt, then the turns; tool results go
    /// right after the assistant message that asked for them, as the wire
    /// format requires.
    pub fn request_body(&self, req: &ModelRequest<'_>) -> Value {
        let mut messages = Vec::new();
        if !req.system_prompt.is_empty() {
            messages.push(json!({"role": "system", "content": req.system_prompt}));
        }
        let mut asked: &[ToolCall] = &[];
        for turn in req.turns {
            match turn {
                Turn::Agent(a) => {
                    let mut m = json!({"role": "assistant", "content": a.text});
                    if !a.tool_calls.is_empty() {
                        m["tool_calls"] = a
                            .tool_calls
                            .iter()
                            .map(|c| {
                                json!({
                                    "id": c.model_call_id,
                                    "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments},
                                })
                            })
                            .collect();
                    }
                    messages.push(m);
                    asked = &a.tool_calls;
                }
                Turn::User(u) => {
                    messages.extend(user_turn_messages(u, asked));
                    asked = &[];
                }
            }
        }
        let mut body = json!({"model": self.model, "messages": messages});
        if !req.tools.is_empty() {
            body["tools"] = req
                .tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": t.description,
                            "parameters": t.parameters.clone()
                                .unwrap_or_else(|| json!({"type": "object"})),
                        }
                    })
                })
                .collect();
        }
        body
    }

    /// One attempt; see `super::endpoint` for how failures are classified.
    pub async fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        if let Some(why) = self.url_not_allowed() {
            return Err(ModelError::permanent(format!(
                "{why}; check spec.model.openai.baseUrl"
            )));
        }
        let body = self.request_body(req);
        self.endpoint
            .post(
                &self.url(),
                self.key_header,
                &[],
                &body,
                WIRE,
                parse_completion,
            )
            .await
    }
}

/// The user's messages in a turn, in order. The one place that knows how
/// a [`UserTurn`] holds them.
fn user_messages(turn: &UserTurn) -> impl Iterator<Item = &str> {
    turn.message.as_deref().into_iter()
}

/// The wire messages of one user turn: first its tool results, which must
/// directly follow the assistant message that asked for them, in the order
/// the model issued the calls (`asked`); then each user message as its own
/// `user` message, in order.
fn user_turn_messages(turn: &UserTurn, asked: &[ToolCall]) -> Vec<Value> {
    let position = |id: &str| {
        asked
            .iter()
            .position(|c| c.model_call_id == id)
            .unwrap_or(usize::MAX)
    };
    let mut results: Vec<_> = turn.tool_results.iter().collect();
    // Stable, so results for calls not in `asked` keep their order, last.
    results.sort_by_key(|r| position(&r.model_call_id));
    let mut messages: Vec<Value> = results
        .into_iter()
        .map(|r| {
            json!({
                "role": "tool",
                "tool_call_id": r.model_call_id,
                "content": r.result.to_model_text(),
            })
        })
        .collect();
    messages.extend(user_messages(turn).map(|text| json!({"role": "user", "content": text})));
    messages
}

/// Parses a chat-completions response body; the error says what is
/// missing or wrong.
pub fn parse_completion(body: &str) -> Result<AgentTurn, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("the body is not JSON ({e})"))?;
    let choices = match v.get("choices") {
        Some(Value::Array(c)) => c,
        Some(_) => return Err("`choices` is not an array".into()),
        None => {
            return Err(match v.get("error") {
                Some(e) => format!(
                    "the body holds an error instead of `choices`: {}",
                    e.get("message").and_then(Value::as_str).map_or_else(
                        || clip(&e.to_string(), QUOTE_BYTES).to_string(),
                        |m| clip(m, QUOTE_BYTES).to_string()
                    )
                ),
                None => "the body has no `choices`".into(),
            })
        }
    };
    let first = choices.first().ok_or("`choices` is empty")?;
    let message = match first.get("message") {
        Some(m @ Value::Object(_)) => m,
        _ => return Err("`choices[0]` has no `message` object".into()),
    };
    let text = message
        .get("content")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    let mut tool_calls = Vec::new();
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        for (i, c) in calls.iter().enumerate() {
            let name = c
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or(format!(
                    "`choices[0].message.tool_calls[{i}]` has no `function.name`"
                ))?;
            // Kept as written, even when malformed: the core tells the model.
            let arguments = match c.pointer("/function/arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            tool_calls.push(ToolCall {
                model_call_id: c
                    .get("id")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("call_{i}")),
                name: name.to_string(),
                arguments,
            });
        }
    }
    let usage = TokenUsage {
        prompt_tokens: v
            .pointer("/usage/prompt_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        completion_tokens: v
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        cached_prompt_tokens: v
            .pointer("/usage/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        cost_micros: 0,
    };
    Ok(AgentTurn {
        text,
        tool_calls,
        usage,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::conversation::ToolResultEntry;
    use crate::core::{CallId, ToolResult, ToolSchema};

    fn model() -> OpenAiModel {
        OpenAiModel::new(
            "http://x/v1/",
            "m",
            Some("sk-secret".into()),
            Duration::from_secs(5),
        )
    }

    fn call(id: &str) -> ToolCall {
        ToolCall {
            model_call_id: id.into(),
            name: "echo".into(),
            arguments: "{}".into(),
        }
    }

    fn result(index: u32, id: &str) -> ToolResultEntry {
        ToolResultEntry {
            call_id: CallId::new(1, index),
            model_call_id: id.into(),
            tool: "echo".into(),
            token: None,
            result: ToolResult::text(format!("r-{id}")),
            truncate_bytes: None,
            started_at: None,
            finished_at: None,
        }
    }

    #[test]
    fn the_wire_format_puts_tool_results_after_their_assistant_message_in_call_order() {
        let m = model();
        assert!(!format!("{m:?}").contains("sk-secret"));
        let turns = vec![
            Turn::User(UserTurn {
                message: Some("q".into()),
                tool_results: vec![],
            }),
            Turn::Agent(AgentTurn {
                text: None,
                tool_calls: vec![call("c1"), call("c2"), call("c3")],
                usage: TokenUsage::default(),
                ..Default::default()
            }),
            // Delivered out of order: the wire order is the model's.
            Turn::User(UserTurn {
                message: Some("and then?".into()),
                tool_results: vec![result(2, "c3"), result(0, "c1"), result(1, "c2")],
            }),
        ];
        let tools = [ToolSchema {
            name: "echo".into(),
            description: "Echoes.".into(),
            parameters: None,
        }];
        let body = m.request_body(&ModelRequest {
            system_prompt: "be brief",
            turns: &turns,
            tools: &tools,
        });
        let messages = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "assistant",
                "tool",
                "tool",
                "tool",
                "user"
            ]
        );
        let ids: Vec<&str> = messages[3..6]
            .iter()
            .map(|m| m["tool_call_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["c1", "c2", "c3"]);
        assert_eq!(messages[3]["content"], "r-c1");
        assert_eq!(messages[6]["content"], "and then?");
        assert_eq!(body["tools"][0]["function"]["name"], "echo");
        assert_eq!(body["tools"][0]["function"]["description"], "Echoes.");
        assert_eq!(
            body["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
    }

    #[test]
    fn completions_parse_and_keep_malformed_arguments() {
        let turn = parse_completion(
            r#"{"choices":[{"message":{"content":null,"tool_calls":[
                {"id":"a","type":"function","function":{"name":"echo","arguments":"{oops"}}]}}],
               "usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
        )
        .unwrap();
        assert_eq!(turn.tool_calls[0].arguments, "{oops");
        assert_eq!(turn.usage.total(), 5);
    }

    #[test]
    fn a_body_that_is_not_a_completion_says_what_is_wrong() {
        let err = |body: &str| parse_completion(body).unwrap_err();
        assert!(
            err("<html>").starts_with("the body is not JSON"),
            "{}",
            err("<html>")
        );
        assert_eq!(err(r#"{"choices":[]}"#), "`choices` is empty");
        assert_eq!(err(r#"{"id":"x"}"#), "the body has no `choices`");
        assert_eq!(
            err(r#"{"choices":[{"finish_reason":"stop"}]}"#),
            "`choices[0]` has no `message` object"
        );
        assert_eq!(
            err(r#"{"error":{"message":"overloaded"}}"#),
            "the body holds an error instead of `choices`: overloaded"
        );
        assert!(
            err(r#"{"choices":[{"message":{"tool_calls":[{"id":"a"}]}}]}"#)
                .contains("tool_calls[0]` has no `function.name`")
        );
    }

    #[test]
    fn azure_sends_the_api_version_query_and_keeps_the_key_out_of_debug() {
        let m = OpenAiModel::new(
            "https://r.openai.azure.com/openai/deployments/gpt/",
            "gpt",
            Some("sk-secret".into()),
            Duration::from_secs(5),
        );
        assert_eq!(
            m.url(),
            "https://r.openai.azure.com/openai/deployments/gpt/chat/completions"
        );
        let azure = m.clone().azure(Some("2024-10-21"));
        assert_eq!(
            azure.url(),
            "https://r.openai.azure.com/openai/deployments/gpt/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(azure.key_header, KeyHeader::Named("api-key"));
        assert!(!format!("{azure:?}").contains("sk-secret"));
        let v1 = m.azure(None);
        assert!(v1.url().ends_with("/chat/completions"), "{}", v1.url());
        assert_eq!(
            OpenAiModel::new("http://x", "m", None, Duration::from_secs(1))
                .azure(Some("a b&c"))
                .url(),
            "http://x/chat/completions?api-version=a+b%26c"
        );
    }
}
