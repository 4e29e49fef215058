//! Kubernetes Events from what a step did, so `kubectl describe session`
//! tells the story: model replies, calls deferred, results, yields, the end.
//! Tool results are summarised (tool, call, how it ran, ok or error), never
//! copied: a result may be large, and Events are for people.

use crate::core::ToolResult;
use crate::engine::events::{waiting_for_text, CallLine, Progress};
use crate::engine::StepOutcome;
use kube::runtime::events::{Event, EventType};

/// An Event note holds at most 1 kB.
const MAX_NOTE: usize = 1000;

fn note(s: String) -> Option<String> {
    if s.len() <= MAX_NOTE {
        return Some(s);
    }
    let mut cut = MAX_NOTE - 4;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    Some(format!("{} ...", &s[..cut]))
}

/// The recorder folds Events with the same reason and action into one
/// series that shows only the first note, so actions name their subject
/// (the turn, the call): each model reply and each result stays visible.
pub fn event(type_: EventType, reason: &str, action: &str, text: String) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: note(text),
        action: action.into(),
        secondary: None,
    }
}

/// The Events for the progress of one step. `wrote` says whether the step
/// changed the session: a step that merely looks at a finished (or paused)
/// session reports its end again, which is no transition.
pub fn for_progress(progress: &[Progress], wrote: bool) -> Vec<Event> {
    progress.iter().filter_map(|p| for_one(p, wrote)).collect()
}

fn for_one(p: &Progress, wrote: bool) -> Option<Event> {
    Some(match p {
        Progress::UserMessage { text, .. } => event(
            EventType::Normal,
            "MessageReceived",
            "TakeMessage",
            format!("user message: {}", one_line(text)),
        ),
        Progress::AgentTurn {
            turn,
            text,
            tool_calls,
            ..
        } => model_replied(*turn, text.as_deref(), tool_calls),
        Progress::ToolResult {
            call,
            tool,
            result,
            by,
            ..
        } => result_arrived(call, tool, result, by),
        Progress::Deferred {
            call,
            tool,
            token,
            waiting_for,
            reason,
            ..
        } => event(
            EventType::Normal,
            "CallDeferred",
            &format!("Defer/{call}"),
            format!(
                "{call} {tool} waits for {} (token {token}){}",
                waiting_for_text(*waiting_for),
                reason
                    .as_ref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
        ),
        Progress::ModelError {
            error, retryable, ..
        } => event(
            EventType::Warning,
            "ModelError",
            "CallModel",
            format!(
                "{}{}",
                one_line(error),
                if *retryable { " (will retry)" } else { "" }
            ),
        ),
        Progress::Note { message, .. } => {
            event(EventType::Normal, "Note", "Note", one_line(message))
        }
        ending if wrote => return for_ending(ending),
        _ => return None,
    })
}

/// A finish, failure or pause is reported only by the step that made it.
fn for_ending(p: &Progress) -> Option<Event> {
    Some(match p {
        Progress::Finished { answer, .. } => event(
            EventType::Normal,
            "Succeeded",
            "Finish",
            format!("final answer: {}", one_line(answer)),
        ),
        Progress::Failed { reason, .. } => {
            event(EventType::Warning, "Failed", "Finish", one_line(reason))
        }
        Progress::Paused { .. } => event(
            EventType::Normal,
            "Paused",
            "Pause",
            "paused by spec.paused; no model or tool call starts until it is false".into(),
        ),
        _ => return None,
    })
}

fn model_replied(turn: u32, text: Option<&str>, tool_calls: &[CallLine]) -> Event {
    let calls: Vec<String> = tool_calls
        .iter()
        .map(|c| format!("{} {} [{}]", c.call, c.tool, c.disposition))
        .collect();
    let mut s = format!("turn {turn}");
    if let Some(t) = text {
        s.push_str(&format!(": {}", one_line(t)));
    }
    if !calls.is_empty() {
        s.push_str(&format!("; calls: {}", calls.join(", ")));
    }
    event(
        EventType::Normal,
        "ModelReplied",
        &format!("CallModel/t{turn}"),
        s,
    )
}

fn result_arrived(
    call: &str,
    tool: &str,
    result: &ToolResult,
    by: &impl std::fmt::Display,
) -> Event {
    let (type_, outcome) = match result {
        ToolResult::Success { .. } => (EventType::Normal, "success".to_string()),
        ToolResult::Error { message } => {
            (EventType::Warning, format!("error: {}", one_line(message)))
        }
    };
    event(
        type_,
        "ResultArrived",
        &format!("TakeResult/{call}"),
        format!("{call} {tool} ({by}): {outcome}"),
    )
}

/// The Event for a step that left the session waiting, when it changed it.
pub fn for_outcome(outcome: &StepOutcome, wrote: bool) -> Option<Event> {
    match outcome {
        StepOutcome::Waiting { pending, .. } if wrote && !pending.is_empty() => {
            let tokens: Vec<&str> = pending.iter().map(|t| t.0.as_str()).collect();
            Some(event(
                EventType::Normal,
                "Yielded",
                "Yield",
                format!(
                    "{} call(s) wait: {}; `kubectl agents session pending` shows how to move each on",
                    tokens.len(),
                    tokens.join(", ")
                ),
            ))
        }
        _ => None,
    }
}

fn one_line(s: &str) -> String {
    let flat = s.replace('\n', " ");
    if flat.len() <= 300 {
        return flat;
    }
    let mut cut = 300;
    while !flat.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...", &flat[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_session_looked_at_again_is_no_event() {
        let p = vec![Progress::Finished {
            session: "s".into(),
            answer: "done".into(),
        }];
        assert!(for_progress(&p, false).is_empty());
        assert_eq!(for_progress(&p, true)[0].reason, "Succeeded");
    }

    #[test]
    fn notes_fit_the_event_limit() {
        let p = vec![Progress::Note {
            session: "s".into(),
            message: "x".repeat(5000),
        }];
        let e = &for_progress(&p, true)[0];
        assert!(e.note.as_ref().unwrap().len() <= MAX_NOTE);
    }
}
