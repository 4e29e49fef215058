//! What a run shows as it unfolds: the engine's events rendered as
//! readable lines on a terminal, or one JSON object per line (`-o json`).

use crate::core::WaitingFor;
pub use crate::engine::events::{waiting_for_text, CallLine, PendingCall, Progress};

/// The terminal's rendering of an engine event.
pub trait Render {
    /// Prints this event as one line (text or JSON) on stdout. A closed
    /// stdout (`agents run ... | head -1`) is ignored: output never stops
    /// the engine.
    fn emit(&self, json: bool);
    /// The terminal rendering.
    fn to_text(&self) -> String;
}

impl Render for Progress {
    fn emit(&self, json: bool) {
        if matches!(self, Progress::Woke { .. }) {
            return;
        }
        if json {
            crate::standalone::out::line(
                &serde_json::to_string(self).expect("progress serialises"),
            );
        } else {
            crate::standalone::out::line(&self.to_text());
        }
    }

    fn to_text(&self) -> String {
        match self {
            Progress::UserMessage { text, .. } => format!("user: {text}"),
            Progress::AgentTurn {
                turn,
                text,
                tool_calls,
                ..
            } => agent_turn_text(*turn, text.as_deref(), tool_calls),
            Progress::ToolResult {
                call,
                tool,
                result,
                by,
                ..
            } => {
                let text = one_line(&result.to_model_text(), 200);
                format!("  result {call} {tool} [{by}]: {text}")
            }
            Progress::Deferred {
                call,
                tool,
                token,
                waiting_for,
                reason,
                ..
            } => {
                let why = match (waiting_for, reason) {
                    (WaitingFor::Approval, _) | (_, None) => String::new(),
                    (_, Some(r)) => format!(": {r}"),
                };
                format!(
                    "  waits  {call} {tool} for {}{why}  (token {token})",
                    waiting_for_text(*waiting_for)
                )
            }
            Progress::ModelError {
                error, retryable, ..
            } => format!(
                "model error{}: {error}",
                if *retryable { " (will retry)" } else { "" }
            ),
            Progress::Yielded { session, pending } => yielded_text(session, pending),
            Progress::Finished { session, answer } => {
                format!("session {session} succeeded.\nanswer: {answer}")
            }
            Progress::Failed { session, reason } => format!("session {session} failed: {reason}"),
            Progress::Paused {
                session,
                budget: Some(why),
            } => format!("session {session} is held: {why}"),
            Progress::Paused { session, .. } => format!(
                "session {session} is paused; `agents session resume {}` goes on",
                shell_quote(session)
            ),
            Progress::Note { message, .. } => format!("note: {message}"),
            Progress::Woke {
                token, waited_ms, ..
            } => {
                format!("woke on {token} after {waited_ms} ms")
            }
        }
    }
}

fn agent_turn_text(turn: u32, text: Option<&str>, tool_calls: &[CallLine]) -> String {
    let mut out = format!("agent (turn {turn}): {}", text.unwrap_or(""));
    for c in tool_calls {
        out.push_str(&format!(
            "\n  call {} {}({})  -> {}",
            c.call, c.tool, c.arguments, c.disposition
        ));
    }
    out
}

/// What waits, and the commands that move it on, each command once.
fn yielded_text(session: &str, pending: &[PendingCall]) -> String {
    let mut out = format!(
        "session {session} yielded: {} call(s) wait. To complete them:",
        pending.len()
    );
    let mut seen = Vec::new();
    for p in pending {
        let within = if p.path.is_empty() {
            String::new()
        } else {
            format!(" in {}", p.path.join(" > "))
        };
        out.push_str(&format!(
            "\n  {} {} ({}){within}",
            p.token,
            p.tool,
            p.waiting_for.map(waiting_for_text).unwrap_or("?")
        ));
    }
    for p in pending {
        if !seen.contains(&p.command) {
            out.push_str(&format!("\n  $ {}", p.command));
            seen.push(p.command.clone());
        }
    }
    out.push_str(&format!(
        "\nthen: agents session resume {}",
        shell_quote(session)
    ));
    out
}

/// Quotes `s` for a POSIX shell, so a printed command can be copied and
/// run as is: bare when it holds only characters no shell treats
/// specially, else in single quotes with each `'` written as `'\''`.
pub fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn one_line(s: &str, max: usize) -> String {
    let flat = s.replace('\n', " ⏎ ");
    if flat.chars().count() <= max {
        flat
    } else {
        format!("{}…", flat.chars().take(max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_leaves_plain_words_and_quotes_the_rest() {
        assert_eq!(shell_quote("demo-t1-c0"), "demo-t1-c0");
        assert_eq!(shell_quote("sqlite:./a/agents.db"), "sqlite:./a/agents.db");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(
            shell_quote("x;touch PWNED;$(touch PWNED2)"),
            "'x;touch PWNED;$(touch PWNED2)'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn a_shell_reads_back_exactly_what_was_quoted() {
        for s in [
            "plain",
            "a b",
            "it's",
            "$(touch x)`y`",
            "'",
            "\\n\"\\",
            "~*?[]{}!#&|<>",
        ] {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(s)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), s);
        }
    }

    #[test]
    fn printed_resume_commands_are_quoted() {
        let p = Progress::Paused {
            session: "a b".into(),
            budget: None,
        };
        assert!(
            p.to_text().contains("agents session resume 'a b'"),
            "{}",
            p.to_text()
        );
        let y = Progress::Yielded {
            session: "a;b".into(),
            pending: vec![],
        };
        assert!(
            y.to_text().ends_with("agents session resume 'a;b'"),
            "{}",
            y.to_text()
        );
    }
}
