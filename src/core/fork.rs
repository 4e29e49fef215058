//! Fork: a new session's state from the start of another's conversation.
//!
//! A fork at turn N takes the source's turns up to and including agent
//! turn N, and the results of that turn's calls that the source recorded.
//! Those results are history: the fork never runs them again. Calls of
//! turn N still open in the source (ready, running, waiting) start afresh
//! in the fork, under the fork's own keys. Nothing the source recorded
//! after turn N is carried over: later turns, later user messages, results
//! of later calls. The source is only read.

use super::call::CallState;
use super::conversation::{Turn, UserTurn};
use super::ids::SessionId;
use super::session::{PartialUserTurn, Phase, SessionState};
use super::TrackedToolCall;
use serde::{Deserialize, Serialize};

/// Where a fork came from: the source session, its unique id (a source
/// deleted and re-created under the same name is another session), and the
/// agent turn the fork starts after.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkedFrom {
    /// The source session's name.
    pub session: String,
    /// The source session's unique id when the fork was made.
    pub uid: String,
    /// The source's agent turn the fork starts after (1 is the first).
    pub turn: u32,
}

/// Why a fork cannot be made; nothing is written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ForkError {
    #[error(
        "session {session} has no agent turn {turn}: it has {turns} (turns are numbered from 1); \
         `agents session show {session}` lists them; give a turn between 1 and {turns}"
    )]
    NoSuchTurn {
        session: SessionId,
        turn: u32,
        turns: u32,
    },
}

/// The state of fork `id` of `source` (whose unique id is `source_uid`)
/// at agent turn `turn`.
pub fn fork_state(
    source: &SessionState,
    source_uid: &str,
    turn: u32,
    id: SessionId,
) -> Result<SessionState, ForkError> {
    let no_such_turn = || ForkError::NoSuchTurn {
        session: source.id.clone(),
        turn,
        turns: source.agent_turns,
    };
    let end = agent_turn_position(&source.turns, turn).ok_or_else(no_such_turn)?;
    let mut state = SessionState::new(id);
    state.turns = source.turns[..=end].to_vec();
    state.agent_turns = turn;
    state.forked_from = Some(ForkedFrom {
        session: source.id.0.clone(),
        uid: source_uid.to_string(),
        turn,
    });
    let Some(Turn::Agent(reply)) = state.turns.last() else {
        unreachable!("the prefix ends at an agent turn")
    };
    if reply.tool_calls.is_empty() {
        state.answer = Some(reply.text.clone().unwrap_or_default());
        state.phase = Phase::Succeeded;
    } else if let Some(results) = results_of(source, end) {
        state.turns.push(Turn::User(results));
        state.phase = Phase::AwaitingModel;
    } else {
        state.open = Some(open_calls_afresh(source, turn).ok_or_else(no_such_turn)?);
        state.phase = Phase::RunningTools;
    }
    state.usage = usage_of(&state.turns);
    state.tool_calls = calls_recorded(&state);
    Ok(state)
}

/// The index in `turns` of agent turn `turn` (1-based).
fn agent_turn_position(turns: &[Turn], turn: u32) -> Option<usize> {
    if turn == 0 {
        return None;
    }
    turns
        .iter()
        .enumerate()
        .filter(|(_, t)| matches!(t, Turn::Agent(_)))
        .nth(turn as usize - 1)
        .map(|(i, _)| i)
}

/// The results of the agent turn at `end`, as the source recorded them (the
/// user turn right after it), without a user message that joined them: a
/// message is after the fork point.
fn results_of(source: &SessionState, end: usize) -> Option<UserTurn> {
    match source.turns.get(end + 1) {
        Some(Turn::User(u)) if !u.tool_results.is_empty() => Some(UserTurn {
            message: None,
            tool_results: u.tool_results.clone(),
        }),
        _ => None,
    }
}

/// The source's open turn `turn`, its final calls kept as history and
/// every other call made new: planned afresh by the fork's own step.
fn open_calls_afresh(source: &SessionState, turn: u32) -> Option<PartialUserTurn> {
    let open = source.open.as_ref().filter(|o| o.turn == turn)?;
    let calls = open
        .calls
        .iter()
        .map(|c| {
            if c.state().is_final() {
                c.clone()
            } else {
                TrackedToolCall::new(c.id, c.call.clone(), c.policy.clone())
            }
        })
        .collect();
    Some(PartialUserTurn { turn, calls })
}

fn usage_of(turns: &[Turn]) -> super::TokenUsage {
    let mut usage = super::TokenUsage::default();
    for t in turns {
        if let Turn::Agent(a) = t {
            usage.add(a.usage);
        }
    }
    usage
}

/// Tool runs the history holds: what the fork's `limits.toolCalls` counts
/// on from.
fn calls_recorded(state: &SessionState) -> u32 {
    let closed: usize = state
        .turns
        .iter()
        .map(|t| match t {
            Turn::User(u) => u.tool_results.len(),
            Turn::Agent(_) => 0,
        })
        .sum();
    let open = state
        .open
        .iter()
        .flat_map(|o| o.calls.iter())
        .filter(|c| c.state() == CallState::Completed && c.attempts > 0)
        .count();
    (closed + open) as u32
}

#[cfg(test)]
mod tests;
