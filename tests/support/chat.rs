//! What the OpenAI-compatible fake models of the sub-agent tests read
//! from a chat request and how they answer: the text of a message by
//! role, an assistant message that calls tools or says something, and
//! the reply that carries it with its usage.

use super::http::Response;
use serde_json::{json, Value};

/// The text of the first message with `role` (`system`, `user`, `tool`).
pub fn first_text(messages: &[Value], role: &str) -> Option<String> {
    messages
        .iter()
        .find(|m| m["role"] == role)
        .and_then(|m| m["content"].as_str())
        .map(str::to_string)
}

/// An assistant message making `tool_calls` (a JSON array).
pub fn calling(tool_calls: Value) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": tool_calls})
}

/// An assistant message that says `text`.
pub fn saying(text: impl Into<String>) -> Value {
    json!({"role": "assistant", "content": text.into()})
}

/// The chat-completions reply holding `message`, having used `prompt` and
/// `completion` tokens.
pub fn reply(message: Value, prompt: u64, completion: u64) -> Response {
    Response::json(
        200,
        json!({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})
        .to_string(),
    )
}
