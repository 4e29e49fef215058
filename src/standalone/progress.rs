//! What a run shows as it unfolds: readable lines on a terminal, or one
//! JSON object per line (`-o json`).

use crate::core::{AgentTurn, SessionState, ToolResult, WaitingFor};
use serde::Serialize;

/// A call that waits, and the exact command that moves it on.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingCall {
    pub token: String,
    pub call: String,
    pub tool: String,
    pub waiting_for: Option<WaitingFor>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub command: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CallLine {
    pub call: String,
    pub tool: String,
    pub arguments: String,
    pub disposition: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Progress {
    #[serde(rename_all = "camelCase")]
    UserMessage {
        session: String,
        text: String,
    },
    #[serde(rename_all = "camelCase")]
    AgentTurn {
        session: String,
        turn: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        tool_calls: Vec<CallLine>,
    },
    #[serde(rename_all = "camelCase")]
    ToolResult {
        session: String,
        call: String,
        tool: String,
        result: ToolResult,
        /// How it ran: runSync, runAsync, process, cache, or who completed it.
        by: String,
    },
    #[serde(rename_all = "camelCase")]
    Deferred {
        session: String,
        call: String,
        tool: String,
        token: String,
        waiting_for: WaitingFor,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    #[serde(rename_all = "camelCase")]
    ModelError {
        session: String,
        error: String,
        retryable: bool,
    },
    #[serde(rename_all = "camelCase")]
    Yielded {
        session: String,
        pending: Vec<PendingCall>,
    },
    Finished {
        session: String,
        answer: String,
    },
    Failed {
        session: String,
        reason: String,
    },
    Paused {
        session: String,
    },
    Note {
        session: String,
        message: String,
    },
    /// A result written from outside was taken in, this long after it was
    /// written (the wake latency). For metrics; never printed.
    #[serde(rename_all = "camelCase")]
    Woke {
        session: String,
        token: String,
        waited_ms: u64,
    },
}

impl Progress {
    pub fn agent_turn(session: &str, turn: u32, t: &AgentTurn, state: &SessionState) -> Self {
        let tool_calls = t
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let tracked = state
                    .open
                    .iter()
                    .flat_map(|o| o.calls.iter())
                    .find(|tc| tc.id.turn == turn && tc.id.index == i as u32);
                CallLine {
                    call: format!("t{turn}-c{i}"),
                    tool: c.name.clone(),
                    arguments: c.arguments.clone(),
                    disposition: tracked
                        .map(|tc| {
                            // Refused before running: unknown tool, bad arguments.
                            if let Some(ToolResult::Error { message }) = &tc.result {
                                return format!("refused, the model is told: {message}");
                            }
                            let mut d = tc.policy.disposition.name().to_string();
                            if tc.policy.decorators.approval {
                                d.push_str(" +approval");
                            }
                            d
                        })
                        .unwrap_or_else(|| "refused".into()),
                }
            })
            .collect();
        Progress::AgentTurn {
            session: session.to_string(),
            turn,
            text: t.text.clone(),
            tool_calls,
        }
    }

    /// Prints this event as one line (text or JSON) on stdout. A closed
    /// stdout (`agents run ... | head -1`) is ignored: output never stops
    /// the engine.
    pub fn emit(&self, json: bool) {
        if matches!(self, Progress::Woke { .. }) {
            return;
        }
        if json {
            crate::cli::out::line(&serde_json::to_string(self).expect("progress serialises"));
        } else {
            crate::cli::out::line(&self.to_text());
        }
    }

    /// The terminal rendering.
    pub fn to_text(&self) -> String {
        match self {
            Progress::UserMessage { text, .. } => format!("user: {text}"),
            Progress::AgentTurn {
                turn,
                text,
                tool_calls,
                ..
            } => {
                let mut out = format!("agent (turn {turn}): {}", text.as_deref().unwrap_or(""));
                for c in tool_calls {
                    out.push_str(&format!(
                        "\n  call {} {}({})  -> {}",
                        c.call, c.tool, c.arguments, c.disposition
                    ));
                }
                out
            }
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
            Progress::Yielded { session, pending } => {
                let mut out = format!(
                    "session {session} yielded: {} call(s) wait. To complete them:",
                    pending.len()
                );
                let mut seen = Vec::new();
                for p in pending {
                    out.push_str(&format!(
                        "\n  {} {} ({})",
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
            Progress::Finished { session, answer } => {
                format!("session {session} succeeded.\nanswer: {answer}")
            }
            Progress::Failed { session, reason } => format!("session {session} failed: {reason}"),
            Progress::Paused { session } => format!(
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

pub fn waiting_for_text(w: WaitingFor) -> &'static str {
    match w {
        WaitingFor::Approval => "approval",
        WaitingFor::Background => "a background run",
        WaitingFor::Isolated => "an isolated run",
        WaitingFor::External => "an outside result",
    }
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
