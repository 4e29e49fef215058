//! Conditions, computed purely from the state, in the shape of
//! `metav1.Condition`, so `kubectl wait --for=condition=Succeeded` works.
//!
//! | type | True when | reasons |
//! |---|---|---|
//! | `Succeeded` | the model gave its final answer | `Answered`; False: `Failed`; Unknown: `InProgress` |
//! | `Failed` | the session stopped on an error | `Failed`; False: `NotFailed` |
//! | `Waiting` | every open call waits on the outside, or a namespace Budget is spent | `BudgetExhausted`, `AwaitingApproval`, `AwaitingExternal`, `AwaitingJob`, `AwaitingBackground`; False: `NotWaiting` |
//! | `Paused` | `spec.paused` holds the session, or a limit (`onExceed: pause`) | `PausedBySpec`, `BudgetExceeded`; False: `NotPaused` |
//!
//! A driver adds its own (the operator's `Ready`: the agent resolved and is
//! valid) and stamps each with `observedGeneration` and a
//! `lastTransitionTime` that changes only when the status does ([`merge`]).

use super::call::WaitingFor;
use super::session::{Phase, SessionState};
use super::time::Millis;

/// `True`, `False` or `Unknown`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    True,
    False,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::True => "True",
            Status::False => "False",
            Status::Unknown => "Unknown",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub type_: String,
    pub status: Status,
    pub reason: String,
    pub message: String,
    /// Set by [`merge`].
    pub last_transition: Millis,
    pub observed_generation: Option<i64>,
}

impl Condition {
    pub fn new(type_: &str, status: Status, reason: &str, message: impl Into<String>) -> Self {
        let mut message: String = message.into();
        // metav1.Condition allows 32768 bytes.
        if message.len() > 32_000 {
            let mut cut = 32_000;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [...]");
        }
        Condition {
            type_: type_.to_string(),
            status,
            reason: reason.to_string(),
            message,
            last_transition: Millis(0),
            observed_generation: None,
        }
    }
}

/// The session's conditions as its state implies them.
pub fn of(state: &SessionState) -> Vec<Condition> {
    use Status::*;
    let failure = || state.failure.clone().unwrap_or_default();
    let in_progress = |why: &str| Condition::new("Succeeded", Unknown, "InProgress", why);
    let succeeded = match state.phase {
        Phase::Succeeded => Condition::new(
            "Succeeded",
            True,
            "Answered",
            "the model gave its final answer",
        ),
        Phase::Failed => Condition::new("Succeeded", False, "Failed", failure()),
        Phase::Idle => in_progress("no user message yet"),
        Phase::AwaitingModel => in_progress("the model is being asked"),
        Phase::RunningTools => in_progress("tool calls are running"),
        Phase::Waiting => in_progress("calls wait on the outside"),
    };
    let failed = match state.phase {
        Phase::Failed => Condition::new("Failed", True, "Failed", failure()),
        _ => Condition::new("Failed", False, "NotFailed", ""),
    };
    let waiting = if let Some(ask) = &state.budget_ask {
        Condition::new(
            "Waiting",
            True,
            "AwaitingBudget",
            format!("{} asks a person: {}", ask.token, ask.stop.message),
        )
    } else if let Some(spent) = state
        .budget_exhausted
        .as_ref()
        .filter(|_| !state.phase.is_final())
    {
        Condition::new("Waiting", True, "BudgetExhausted", spent.message.clone())
    } else if state.phase == Phase::Waiting {
        waiting(state)
    } else {
        Condition::new("Waiting", False, "NotWaiting", "")
    };
    let paused = if let Some(stop) = state.budget_stop.as_ref().filter(|_| !state.paused) {
        Condition::new("Paused", True, "BudgetExceeded", stop.message.clone())
    } else if state.paused {
        Condition::new(
            "Paused",
            True,
            "PausedBySpec",
            "no model or tool call starts until spec.paused is false",
        )
    } else {
        Condition::new("Paused", False, "NotPaused", "")
    };
    vec![succeeded, failed, waiting, paused]
}

/// What most needs a person first, and each wait's condition reason.
const WAITS: [(WaitingFor, &str); 7] = [
    (WaitingFor::Approval, "AwaitingApproval"),
    (WaitingFor::Outcome, "AwaitingOutcome"),
    (WaitingFor::External, "AwaitingExternal"),
    (WaitingFor::McpTask, "AwaitingMcpTask"),
    (WaitingFor::Isolated, "AwaitingJob"),
    (WaitingFor::Background, "AwaitingBackground"),
    (WaitingFor::SubAgent, "AwaitingSubAgent"),
];

/// What the open calls wait for that most needs a person (approvals
/// first); `None` when no call waits.
pub fn most_needed_wait(state: &SessionState) -> Option<WaitingFor> {
    let pending = state.pending();
    WAITS
        .iter()
        .map(|(w, _)| *w)
        .find(|w| pending.iter().any(|c| c.waiting_for() == Some(*w)))
}

/// `Waiting=True`, its reason naming what most needs a person (approvals
/// first), its message every waiting call's token.
fn waiting(state: &SessionState) -> Condition {
    let pending = state.pending();
    let reason = most_needed_wait(state)
        .and_then(|w| WAITS.iter().find(|(x, _)| *x == w))
        .map(|(_, r)| *r)
        .unwrap_or("AwaitingExternal");
    let tokens: Vec<String> = pending
        .iter()
        .filter_map(|c| {
            let what = match c.waiting_for() {
                Some(WaitingFor::Approval) => "approval",
                Some(WaitingFor::External) => "outside result",
                Some(WaitingFor::Isolated) => "isolated run",
                Some(WaitingFor::Background) => "background run",
                Some(WaitingFor::McpTask) if c.task_asks().is_some() => "MCP task asking for input",
                Some(WaitingFor::McpTask) => "MCP task",
                Some(WaitingFor::SubAgent) => "sub-agent",
                Some(WaitingFor::Outcome) => "a person to tell an unknown outcome",
                Some(WaitingFor::Budget) => "a person to raise a limit",
                None => "?",
            };
            c.token().map(|t| format!("{t} ({}, {what})", c.call.name))
        })
        .collect();
    Condition::new(
        "Waiting",
        Status::True,
        reason,
        format!("{} call(s) wait: {}", tokens.len(), tokens.join(", ")),
    )
}

/// Stamps `next` with `generation` and a transition time: kept from
/// `previous` when that condition's status is unchanged, else `now`.
pub fn merge(
    previous: &[Condition],
    mut next: Vec<Condition>,
    generation: Option<i64>,
    now: Millis,
) -> Vec<Condition> {
    for c in next.iter_mut() {
        c.observed_generation = generation;
        c.last_transition = match previous.iter().find(|p| p.type_ == c.type_) {
            Some(p) if p.status == c.status => p.last_transition,
            _ => now,
        };
    }
    next
}

/// The conditions to store: `next` stamped by [`merge`], then `previous`
/// conditions of other types (another writer's), kept as they are. The
/// Session and the Agent controllers both write their conditions this way.
pub fn settle(
    previous: &[Condition],
    next: Vec<Condition>,
    generation: Option<i64>,
    now: Millis,
) -> Vec<Condition> {
    let mut out = merge(previous, next, generation, now);
    for p in previous {
        if !out.iter().any(|o| o.type_ == p.type_) {
            out.push(p.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ids::SessionId;

    #[test]
    fn transition_time_moves_only_when_the_status_does() {
        let mut state = SessionState::new(SessionId("s".into()));
        state.phase = Phase::AwaitingModel;
        let first = merge(&[], of(&state), Some(1), Millis(1000));
        let again = merge(&first, of(&state), Some(2), Millis(5000));
        let succeeded =
            |cs: &[Condition]| cs.iter().find(|c| c.type_ == "Succeeded").cloned().unwrap();
        assert_eq!(succeeded(&again).last_transition, Millis(1000));
        assert_eq!(succeeded(&again).observed_generation, Some(2));
        state.phase = Phase::Succeeded;
        let done = merge(&again, of(&state), Some(2), Millis(9000));
        assert_eq!(succeeded(&done).status, Status::True);
        assert_eq!(succeeded(&done).last_transition, Millis(9000));
        assert_eq!(succeeded(&done).reason, "Answered");
    }

    #[test]
    fn failed_and_paused_show_in_their_own_conditions() {
        let mut state = SessionState::new(SessionId("s".into()));
        state.phase = Phase::Failed;
        state.failure = Some("the model call failed after 5 attempt(s): 503".into());
        state.paused = true;
        let cs = of(&state);
        let get = |t: &str| cs.iter().find(|c| c.type_ == t).unwrap();
        assert_eq!(get("Failed").status, Status::True);
        assert!(get("Failed").message.contains("503"));
        assert_eq!(get("Succeeded").status, Status::False);
        assert_eq!(get("Paused").status, Status::True);
        assert_eq!(get("Waiting").status, Status::False);
    }
}
