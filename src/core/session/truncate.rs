//! Cutting results and error messages to their bounds.

use crate::core::conversation::{ToolResponse, ToolResult};

/// Most bytes of an error message a result keeps. Errors are never
/// spilled, so a tool (or a completer) that answers with a huge error must
/// not grow the session past its budget.
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// Applies the `truncate` decorator; error messages are cut to
/// [`MAX_ERROR_BYTES`] whatever it says.
pub fn truncate(result: ToolResult, max: Option<usize>) -> ToolResult {
    match result {
        ToolResult::Success { response } if max.is_some_and(|m| response.size() > m) => {
            let text = response.to_model_text();
            ToolResult::ok(ToolResponse::text(cut_to(&text, max.unwrap_or(usize::MAX))))
        }
        ToolResult::Error { message } if message.len() > MAX_ERROR_BYTES => {
            ToolResult::error(cut_to(&message, MAX_ERROR_BYTES))
        }
        other => other,
    }
}

/// `text` cut to at most `max` bytes (on a character boundary), saying so.
fn cut_to(text: &str, max: usize) -> String {
    let mut cut = max.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}\n[truncated: showing {} of {} bytes]",
        &text[..cut],
        cut,
        text.len()
    )
}
