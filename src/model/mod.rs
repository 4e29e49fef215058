//! Model adapters: turn the conversation into the model's next
//! [`AgentTurn`].
//!
//! - [`ScriptedModel`] replays the agent's scripted replies, one per agent
//!   turn; the reply depends only on how many agent turns the history holds,
//!   so a replay after a crash gives the same answer.
//! - [`OpenAiModel`] speaks the chat-completions wire format to any
//!   compatible endpoint.

use crate::core::{AgentTurn, TokenUsage, ToolCall, Turn};
use crate::tools::ToolDef;
use serde_json::{json, Value};
use std::fmt;
use std::time::Duration;

/// What the model sees.
#[derive(Clone, Copy, Debug)]
pub struct ModelRequest<'a> {
    pub system_prompt: &'a str,
    pub turns: &'a [Turn],
    pub tools: &'a [&'a ToolDef],
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ModelError {
    pub message: String,
    /// Worth trying again (rate limits, 5xx, network); the core backs off.
    pub retryable: bool,
}

/// One scripted reply: text, tool calls, or both.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScriptedReply {
    pub text: Option<String>,
    /// Tool name and JSON arguments.
    pub tool_calls: Vec<(String, Value)>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScriptedModel {
    pub replies: Vec<ScriptedReply>,
}

impl ScriptedModel {
    pub fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        let turn = req
            .turns
            .iter()
            .filter(|t| matches!(t, Turn::Agent(_)))
            .count();
        let Some(reply) = self.replies.get(turn) else {
            return Err(ModelError {
                message: format!(
                    "the scripted model has {} replies and none left for agent turn {}; add replies to spec.model.scripted.replies",
                    self.replies.len(),
                    turn + 1
                ),
                retryable: false,
            });
        };
        Ok(AgentTurn {
            text: reply.text.clone(),
            tool_calls: reply
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, (name, args))| ToolCall {
                    model_call_id: format!("call_{}_{i}", turn + 1),
                    name: name.clone(),
                    // A string is sent as is, so tests can feed malformed JSON.
                    arguments: match args {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    },
                })
                .collect(),
            usage: TokenUsage::default(),
        })
    }
}

/// A chat-completions client. The API key never appears in `Debug` output.
#[derive(Clone)]
pub struct OpenAiModel {
    pub base_url: String,
    pub model: String,
    api_key: Option<String>,
    http: reqwest::Client,
}

impl fmt::Debug for OpenAiModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiModel")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl OpenAiModel {
    pub fn new(base_url: &str, model: &str, api_key: Option<String>) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()
            .expect("a default HTTP client builds");
        OpenAiModel {
            base_url: base_url.trim_end_matches('/').to_string(),
            model: model.to_string(),
            api_key,
            http,
        }
    }

    /// The request body: system prompt, then the turns; tool results go
    /// right after the assistant message that asked for them, as the wire
    /// format requires.
    pub fn request_body(&self, req: &ModelRequest<'_>) -> Value {
        let mut messages = Vec::new();
        if !req.system_prompt.is_empty() {
            messages.push(json!({"role": "system", "content": req.system_prompt}));
        }
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
                }
                Turn::User(u) => {
                    for r in &u.tool_results {
                        messages.push(json!({
                            "role": "tool",
                            "tool_call_id": r.model_call_id,
                            "content": r.result.to_model_text(),
                        }));
                    }
                    if let Some(text) = &u.message {
                        messages.push(json!({"role": "user", "content": text}));
                    }
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

    pub async fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        let url = format!("{}/chat/completions", self.base_url);
        let mut request = self.http.post(&url).json(&self.request_body(req));
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(|e| ModelError {
            // Connection trouble is usually passing.
            message: format!("POST {url}: {}", without_url(&e)),
            retryable: true,
        })?;
        let status = response.status();
        let body = response.text().await.map_err(|e| ModelError {
            message: format!("reading the reply of {url}: {}", without_url(&e)),
            retryable: true,
        })?;
        if !status.is_success() {
            let snippet: String = body.chars().take(500).collect();
            return Err(ModelError {
                message: format!("{url} answered {status}: {snippet}"),
                retryable: status.as_u16() == 429 || status.is_server_error(),
            });
        }
        parse_completion(&body).map_err(|message| ModelError {
            message: format!("{url} sent a reply that is not a chat completion: {message}"),
            retryable: false,
        })
    }
}

fn without_url(e: &reqwest::Error) -> String {
    // The URL is already in our message; reqwest's would repeat it.
    let mut s = e.to_string();
    if let Some(u) = e.url() {
        s = s.replace(&format!(" ({u})"), "");
    }
    s
}

/// Parses a chat-completions response body.
pub fn parse_completion(body: &str) -> Result<AgentTurn, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let message = v
        .pointer("/choices/0/message")
        .ok_or("no choices[0].message")?;
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
                .ok_or(format!("tool_calls[{i}] has no function.name"))?;
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
    };
    Ok(AgentTurn {
        text,
        tool_calls,
        usage,
    })
}

/// The model an agent uses.
#[derive(Clone, Debug)]
pub enum ModelClient {
    Scripted(ScriptedModel),
    OpenAi(OpenAiModel),
}

impl ModelClient {
    pub async fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        match self {
            ModelClient::Scripted(m) => m.reply(req),
            ModelClient::OpenAi(m) => m.reply(req).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::conversation::ToolResultEntry;
    use crate::core::{CallId, ToolResult, UserTurn};

    #[test]
    fn scripted_replies_follow_the_agent_turn_count() {
        let m = ScriptedModel {
            replies: vec![
                ScriptedReply {
                    text: None,
                    tool_calls: vec![("echo".into(), json!({"text": "hi"}))],
                },
                ScriptedReply {
                    text: Some("done".into()),
                    tool_calls: vec![],
                },
            ],
        };
        let mut turns = vec![Turn::User(UserTurn {
            message: Some("go".into()),
            tool_results: vec![],
        })];
        let req = |turns: &[Turn]| {
            m.reply(&ModelRequest {
                system_prompt: "",
                turns,
                tools: &[],
            })
        };
        let first = req(&turns).unwrap();
        assert_eq!(first.tool_calls[0].arguments, r#"{"text":"hi"}"#);
        assert_eq!(req(&turns).unwrap(), first, "a replay gives the same reply");
        turns.push(Turn::Agent(first));
        assert_eq!(req(&turns).unwrap().text.as_deref(), Some("done"));
        turns.push(Turn::Agent(AgentTurn::default()));
        let err = req(&turns).unwrap_err();
        assert!(!err.retryable);
        assert!(err.message.contains("none left for agent turn 3"), "{err}");
    }

    #[test]
    fn the_wire_format_puts_tool_results_after_their_assistant_message() {
        let m = OpenAiModel::new("http://x/v1/", "m", Some("sk-secret".into()));
        assert!(!format!("{m:?}").contains("sk-secret"));
        let turns = vec![
            Turn::User(UserTurn {
                message: Some("q".into()),
                tool_results: vec![],
            }),
            Turn::Agent(AgentTurn {
                text: None,
                tool_calls: vec![ToolCall {
                    model_call_id: "c1".into(),
                    name: "echo".into(),
                    arguments: "{}".into(),
                }],
                usage: TokenUsage::default(),
            }),
            Turn::User(UserTurn {
                message: None,
                tool_results: vec![ToolResultEntry {
                    call_id: CallId::new(1, 0),
                    model_call_id: "c1".into(),
                    tool: "echo".into(),
                    token: None,
                    result: ToolResult::text("r"),
                    truncate_bytes: None,
                }],
            }),
        ];
        let body = m.request_body(&ModelRequest {
            system_prompt: "be brief",
            turns: &turns,
            tools: &[],
        });
        let roles: Vec<&str> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(body["messages"][3]["tool_call_id"], "c1");
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
        assert!(parse_completion(r#"{"error":"x"}"#).is_err());
    }
}
