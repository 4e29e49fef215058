//! Kubernetes Events from what a step did, so `kubectl describe session`
//! tells the story: model replies, calls deferred, results, yields, the end.
//! Tool results are summarised (tool, call, how it ran, ok or error), never
//! copied: a result may be large, and Events are for people.

use crate::core::ToolResult;
use crate::engine::events::{waiting_for_text, Progress};
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

/// Events go only where a person needs one: a wait, a failure, an ending.
/// Routine steps (a message taken, a model reply, a tool's success) are
/// in the status and the trace, and would cost the API server an object
/// each (issue: a flow of three calls wrote nine Events).
fn for_one(p: &Progress, wrote: bool) -> Option<Event> {
    Some(match p {
        Progress::UserMessage { .. } | Progress::AgentTurn { .. } => return None,
        Progress::ToolResult {
            call,
            tool,
            result: ToolResult::Error { message },
            by,
            ..
        } => event(
            EventType::Warning,
            "ResultArrived",
            &format!("TakeResult/{call}"),
            format!("{call} {tool} ({by}): error: {}", one_line(message)),
        ),
        Progress::ToolResult { .. } => return None,
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
        Progress::Paused {
            budget: Some(why), ..
        } => event(EventType::Warning, "BudgetExceeded", "Pause", one_line(why)),
        Progress::Paused { .. } => event(
            EventType::Normal,
            "Paused",
            "Pause",
            "paused by spec.paused; no model or tool call starts until it is false".into(),
        ),
        _ => return None,
    })
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

    #[test]
    fn routine_steps_make_no_event_and_failures_do() {
        let reply = Progress::AgentTurn {
            session: "s".into(),
            turn: 0,
            text: Some("thinking".into()),
            tool_calls: vec![],
            usage: Default::default(),
        };
        let result = |result: ToolResult| Progress::ToolResult {
            session: "s".into(),
            call: "t0-c0".into(),
            tool: "now".into(),
            result,
            by: crate::engine::Provenance::RunSync,
            model_call_id: "m0".into(),
            arguments: "{}".into(),
        };
        let routine = [
            Progress::UserMessage {
                session: "s".into(),
                text: "hi".into(),
            },
            reply,
            result(ToolResult::text("fine")),
        ];
        assert!(for_progress(&routine, true).is_empty());
        let failed = for_progress(&[result(ToolResult::error("no route"))], true);
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].type_, EventType::Warning);
        assert!(failed[0].note.as_ref().unwrap().contains("no route"));
    }
}
