//! The conversation: turns, tool calls as the model issued them, and tool
//! responses as they go back to the model.

use super::ids::{CallId, ContinuationToken};
use super::time::Millis;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A tool call exactly as the model issued it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    /// The model's own id for this call (OpenAI `tool_calls[].id`), echoed
    /// back to the model with the result.
    pub model_call_id: String,
    /// The tool's name.
    pub name: String,
    /// Arguments as the model wrote them: a JSON text that should hold an
    /// object, but models sometimes produce malformed JSON.
    pub arguments: String,
}

impl ToolCall {
    /// The arguments as a JSON object, or a message the model can act on.
    pub fn parsed_arguments(&self) -> Result<serde_json::Map<String, Value>, String> {
        let text = if self.arguments.trim().is_empty() {
            "{}"
        } else {
            self.arguments.as_str()
        };
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => Ok(map),
            Ok(other) => Err(format!(
                "arguments for tool {:?} must be a JSON object, got {}",
                self.name,
                json_kind(&other)
            )),
            Err(e) => Err(format!(
                "arguments for tool {:?} are not valid JSON ({e}); send a JSON object",
                self.name
            )),
        }
    }
}

/// What kind of JSON value `v` is, for an error message.
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What a tool answered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ToolResponse {
    Text {
        content: String,
    },
    Json {
        content: Value,
    },
    #[serde(rename_all = "camelCase")]
    Media {
        mime_type: String,
        base64_data: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filename: Option<String>,
    },
    Mixed {
        parts: Vec<ToolResponse>,
    },
}

impl ToolResponse {
    pub fn text(s: impl Into<String>) -> Self {
        ToolResponse::Text { content: s.into() }
    }

    /// The response as the text a chat model receives.
    pub fn to_model_text(&self) -> String {
        match self {
            ToolResponse::Text { content } => content.clone(),
            ToolResponse::Json { content } => content.to_string(),
            ToolResponse::Media {
                mime_type,
                filename,
                base64_data,
            } => format!(
                "[media {mime_type}{}, {} base64 bytes]",
                filename
                    .as_deref()
                    .map(|f| format!(" {f}"))
                    .unwrap_or_default(),
                base64_data.len()
            ),
            ToolResponse::Mixed { parts } => parts
                .iter()
                .map(ToolResponse::to_model_text)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    /// Approximate size in bytes, used by the `truncate` decorator.
    pub fn size(&self) -> usize {
        match self {
            ToolResponse::Text { content } => content.len(),
            ToolResponse::Json { content } => content.to_string().len(),
            ToolResponse::Media { base64_data, .. } => base64_data.len(),
            ToolResponse::Mixed { parts } => parts.iter().map(ToolResponse::size).sum(),
        }
    }
}

/// The outcome of one call: a response, or an error the model is told about.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "status", rename_all = "camelCase")]
pub enum ToolResult {
    /// The tool answered.
    Success {
        /// What the tool answered.
        response: ToolResponse,
    },
    /// The call failed; the model is told why.
    Error {
        /// The error, as the model is told it.
        message: String,
    },
}

/// Free-form: a response may nest responses (`mixed`), which a schema
/// cannot spell out without recursion.
impl schemars::JsonSchema for ToolResponse {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ToolResponse".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "description": "What the tool answered: `{type: text, content}`, `{type: json, content}`, `{type: media, mimeType, base64Data}` or `{type: mixed, parts}`."
        })
    }
}

impl ToolResult {
    pub fn ok(response: ToolResponse) -> Self {
        ToolResult::Success { response }
    }
    pub fn text(s: impl Into<String>) -> Self {
        ToolResult::ok(ToolResponse::text(s))
    }
    pub fn error(message: impl Into<String>) -> Self {
        ToolResult::Error {
            message: message.into(),
        }
    }
    pub fn is_error(&self) -> bool {
        matches!(self, ToolResult::Error { .. })
    }
    /// The text sent to the model as the tool message.
    pub fn to_model_text(&self) -> String {
        match self {
            ToolResult::Success { response } => response.to_model_text(),
            ToolResult::Error { message } => format!("error: {message}"),
        }
    }
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    /// Tokens sent to the model.
    pub prompt_tokens: u64,
    /// Tokens the model produced.
    pub completion_tokens: u64,
    /// Of the prompt tokens, those the provider served from its prompt
    /// cache (priced at `pricing.cachedInputPerMTok`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached_prompt_tokens: u64,
    /// What the tokens cost under the agent's `spec.model.pricing`, in
    /// micro-units of its currency (1000000 is one unit); 0 without pricing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cost_micros: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl TokenUsage {
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
    pub fn is_none(&self) -> bool {
        *self == TokenUsage::default()
    }
    /// `self` less `other`, each count at least 0.
    pub fn less(&self, other: &TokenUsage) -> TokenUsage {
        TokenUsage {
            prompt_tokens: self.prompt_tokens.saturating_sub(other.prompt_tokens),
            completion_tokens: self
                .completion_tokens
                .saturating_sub(other.completion_tokens),
            cached_prompt_tokens: self
                .cached_prompt_tokens
                .saturating_sub(other.cached_prompt_tokens),
            cost_micros: self.cost_micros.saturating_sub(other.cost_micros),
        }
    }
    pub fn add(&mut self, other: TokenUsage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
        self.cost_micros = self.cost_micros.saturating_add(other.cost_micros);
    }
}

/// What the model answered in one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentTurn {
    /// The model's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The model's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Tokens this model turn used (absent when the provider reported
    /// none).
    #[serde(default, skip_serializing_if = "TokenUsage::is_none")]
    pub usage: TokenUsage,
    /// When the model was asked for this reply: the start of the model
    /// call's claim (milliseconds since the Unix epoch). Set by the core;
    /// absent in turns stored before it kept times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asked_at: Option<Millis>,
    /// When the reply was recorded (milliseconds since the Unix epoch).
    /// Set by the core; absent in turns stored before it kept times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replied_at: Option<Millis>,
}

/// One tool result as it goes back to the model, in the model's call order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolResultEntry {
    /// Our call id, `t<turn>-c<index>`.
    pub call_id: CallId,
    /// The model's call id.
    pub model_call_id: String,
    /// The tool's name.
    pub tool: String,
    /// The continuation token, for calls that waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<ContinuationToken>,
    /// `{status: success, response: {...}}` or `{status: error, message}`.
    pub result: ToolResult,
    /// The `truncate` limit the result was cut to, so a repeated delivery
    /// of the same full result is recognised as the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate_bytes: Option<usize>,
    /// When the call started (milliseconds since the Unix epoch): its first
    /// attempt's claim, or its first wait. Absent for a call refused before
    /// it started, and in results stored before the core kept times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Millis>,
    /// When its result was recorded (milliseconds since the Unix epoch).
    /// Absent in results stored before the core kept times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Millis>,
}

/// A user turn: a message from the user, tool results, or both.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UserTurn {
    /// The user's message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Tool results, in the model's call order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_results: Vec<ToolResultEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "role", rename_all = "camelCase")]
pub enum Turn {
    /// The user's message and/or tool results.
    User(UserTurn),
    /// The model's reply.
    Agent(AgentTurn),
}

/// A tool as the model is told about it: name, description and the JSON
/// Schema of its arguments. Core data, so model adapters need no runner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolSchema {
    pub name: String,
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// The most messages a Session's `spec.messages` holds. The Session CRD's
/// schema (`maxItems`) carries the same number: a test compares them.
pub const MAX_USER_MESSAGES: usize = 500;

/// The most characters (Unicode scalar values, as the API server counts a
/// schema's `maxLength`) one message of `spec.messages` holds.
pub const MAX_USER_MESSAGE_CHARS: usize = 32768;

/// Checks `messages` against the Session CRD's bounds, so a driver with no
/// API server in front of it (standalone) refuses what a cluster would: an
/// error names the first message out of bounds, by its index, and the limit.
pub fn check_user_messages(messages: &[String]) -> Result<(), String> {
    if messages.len() > MAX_USER_MESSAGES {
        return Err(format!(
            "spec.messages holds {} messages, more than the {MAX_USER_MESSAGES} a Session may \
             hold (as in a cluster); start a new session with a summary of this one",
            messages.len()
        ));
    }
    for (i, message) in messages.iter().enumerate() {
        // Counting stops past the limit: a huge message costs no more.
        if message.chars().take(MAX_USER_MESSAGE_CHARS + 1).count() > MAX_USER_MESSAGE_CHARS {
            return Err(format!(
                "spec.messages[{i}] is longer than {MAX_USER_MESSAGE_CHARS} characters, the most \
                 one message may hold (as in a cluster); shorten it, or split it over several \
                 messages"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod message_bounds {
    use super::*;

    #[test]
    fn messages_within_the_bounds_pass_and_the_first_past_them_is_named() {
        let at_limit = "é".repeat(MAX_USER_MESSAGE_CHARS);
        let ok = vec![at_limit.clone(); MAX_USER_MESSAGES];
        assert_eq!(check_user_messages(&ok), Ok(()));
        let mut long = vec!["hi".to_string(), at_limit.clone(), at_limit + "x"];
        let e = check_user_messages(&long).unwrap_err();
        assert!(
            e.starts_with("spec.messages[2] is longer than 32768"),
            "{e}"
        );
        long.truncate(1);
        let many = vec!["hi".to_string(); MAX_USER_MESSAGES + 1];
        let e = check_user_messages(&many).unwrap_err();
        assert!(e.contains("holds 501 messages, more than the 500"), "{e}");
    }
}

#[cfg(test)]
mod stored_times {
    use super::*;

    #[test]
    fn turns_stored_before_the_core_kept_times_load_and_write_back_as_they_were() {
        let reply =
            r#"{"role":"agent","text":"hi","usage":{"promptTokens":1,"completionTokens":2}}"#;
        let result = r#"{"role":"user","toolResults":[{"callId":"t1-c0","modelCallId":"m","tool":"x","result":{"status":"success","response":{"type":"text","content":"ok"}}}]}"#;
        for old in [reply, result] {
            let turn: Turn = serde_json::from_str(old).unwrap_or_else(|e| panic!("{old}: {e}"));
            assert_eq!(serde_json::to_string(&turn).unwrap(), old);
        }
        let Turn::Agent(a) = serde_json::from_str(reply).unwrap() else {
            panic!("a reply")
        };
        assert_eq!((a.asked_at, a.replied_at), (None, None));
        let Turn::User(u) = serde_json::from_str(result).unwrap() else {
            panic!("a result")
        };
        let r = &u.tool_results[0];
        assert_eq!((r.started_at, r.finished_at), (None, None));
    }
}
