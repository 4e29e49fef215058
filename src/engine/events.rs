//! What a step does, as typed events: the engine's only output besides
//! its writes. Drivers render them: terminal lines and JSON in
//! `standalone`, Kubernetes Events and metrics in `operator`. Nothing below
//! the drivers prints.

use crate::core::{AgentTurn, SessionState, TokenUsage, ToolCall, ToolResult, WaitingFor};
use serde::Serialize;

/// Where a tool result came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// Ran inside the step (`runSync`).
    RunSync,
    /// Served from the result cache.
    Cache,
    /// A background or isolated attempt, by the runner of this label
    /// (`runAsync`, `job`, `process`, ...).
    Runner(&'static str),
    /// Written from outside the engine (a person, a worker), under this name:
    /// whatever the name says, it is never counted as the engine's own.
    Outside(String),
}

impl Provenance {
    pub fn label(&self) -> &str {
        match self {
            Provenance::RunSync => "runSync",
            Provenance::Cache => "cache",
            Provenance::Runner(label) => label,
            Provenance::Outside(by) => by,
        }
    }
}

impl std::fmt::Display for Provenance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Serialised as its label, as `-o json` has always shown it.
impl Serialize for Provenance {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.label())
    }
}

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
    /// Where it waits in a tree of sub-agents: the sessions from the root
    /// down to the waiting one; empty for the session's own calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub path: Vec<String>,
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
        /// What the reply reported (for traces; not shown).
        #[serde(skip)]
        usage: TokenUsage,
    },
    #[serde(rename_all = "camelCase")]
    ToolResult {
        session: String,
        call: String,
        tool: String,
        result: ToolResult,
        /// How it ran, or who completed it.
        by: Provenance,
        /// The model's own id for the call (for traces; not shown).
        #[serde(skip)]
        model_call_id: String,
        /// The call's arguments (for traces, when content is recorded).
        #[serde(skip)]
        arguments: String,
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
        /// Set when a limit holds the session (`onExceed: pause`): the
        /// limit, the spend and how to go on.
        budget: Option<String>,
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
                            if let Some(ToolResult::Error { message }) = tc.result() {
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
            usage: t.usage,
        }
    }

    /// A tool result of `call`, reported with the call as the model made it.
    pub fn tool_result(
        session: &str,
        call: &dyn std::fmt::Display,
        tool_call: &ToolCall,
        result: &ToolResult,
        by: Provenance,
    ) -> Self {
        Progress::ToolResult {
            session: session.to_string(),
            call: call.to_string(),
            tool: tool_call.name.clone(),
            result: result.clone(),
            by,
            model_call_id: tool_call.model_call_id.clone(),
            arguments: tool_call.arguments.clone(),
        }
    }
}

/// Work with an effect outside that is about to begin: observers that
/// time it (traces) take its start from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work<'a> {
    ModelCall { turn: u32 },
    Tool { call: &'a str },
}

pub fn waiting_for_text(w: WaitingFor) -> &'static str {
    match w {
        WaitingFor::Approval => "approval",
        WaitingFor::Background => "a background run",
        WaitingFor::Isolated => "an isolated run",
        WaitingFor::External => "an outside result",
        WaitingFor::McpTask => "an MCP task",
        WaitingFor::SubAgent => "a sub-agent",
        WaitingFor::Outcome => "a person to tell an unknown outcome",
        WaitingFor::Budget => "a person to raise a limit",
    }
}
