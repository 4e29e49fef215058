//! The stored shape of `status.state`: each datum once, the shape before
//! still loading, and the states the tests measure status writes with.

use super::*;
use crate::core::{Action, AgentTurn, CallId, Event, Millis, Scope, Session, SessionConfig};
use crate::core::{TokenUsage, ToolCall, ToolResult};

const NOW: Millis = Millis(1_700_000_000_000);
const NAME: &str = "weather-watch-81";
const UID: &str = "6d0f1c2a-93be-4f55-a7e1-0c5b9d2e8f31";

/// Runs the session's actions: the states it checkpointed go to `out`,
/// the tool runs it asked for are returned.
fn drain(s: &mut Session, out: &mut Vec<SessionState>) -> Vec<CallId> {
    let mut runs = Vec::new();
    while let Some(action) = s.poll_action() {
        match action {
            Action::Checkpoint => out.push(s.state().clone()),
            Action::RunTool { call, .. } => runs.push(call),
            _ => {}
        }
    }
    runs
}

fn weather(model_call_id: &str, city: &str) -> ToolCall {
    ToolCall {
        model_call_id: model_call_id.into(),
        name: "weather".into(),
        arguments: format!(r#"{{"city":"{city}","units":"metric"}}"#),
    }
}

fn reply(calls: Vec<ToolCall>, text: Option<&str>, prompt_tokens: u64) -> Event {
    Event::ModelReplied {
        turn: AgentTurn {
            text: text.map(str::to_string),
            tool_calls: calls,
            usage: TokenUsage {
                prompt_tokens,
                completion_tokens: 40,
                ..TokenUsage::default()
            },
            ..AgentTurn::default()
        },
    }
}

fn started() -> (Session, Vec<SessionState>) {
    let config = SessionConfig {
        scope: Scope {
            namespace: "team-a".into(),
            uid: UID.into(),
        },
        ..SessionConfig::default()
    };
    let mut s = Session::new(SessionId(NAME.into()), config);
    let mut out = Vec::new();
    let message = "What is the weather in Paris and in Rome?".to_string();
    s.handle(Event::UserMessage { text: message }, NOW).unwrap();
    drain(&mut s, &mut out);
    (s, out)
}

/// Runs `calls` as the model's reply and answers each with its city's
/// weather; the states checkpointed go to `out`.
fn tool_turn(s: &mut Session, out: &mut Vec<SessionState>, calls: Vec<ToolCall>) {
    s.handle(reply(calls, None, 120), NOW).unwrap();
    for call in drain(s, out) {
        let result = ToolResult::text(format!("{call}: 18 degrees, clear"));
        let finished = Event::ToolFinished {
            call,
            result,
            from_cache: false,
        };
        s.handle(finished, NOW).unwrap();
    }
    drain(s, out);
}

/// Every state a flow session is checkpointed in (the shape the cluster
/// benchmark runs): a message, a reply with two tool calls run in the
/// step, their results, the answer.
pub(crate) fn flow_checkpoints() -> Vec<SessionState> {
    let (mut s, mut out) = started();
    let calls = vec![
        weather("call_8fJ2kQ", "Paris"),
        weather("call_3nR7wZ", "Rome"),
    ];
    tool_turn(&mut s, &mut out, calls);
    s.handle(reply(Vec::new(), Some("Paris 18, Rome 18."), 200), NOW)
        .unwrap();
    drain(&mut s, &mut out);
    out
}

/// A session after one turn of two calls, whose second reply's three
/// calls are open: the first done, two still running.
fn open_turn_state() -> SessionState {
    let (mut s, mut out) = started();
    let calls = vec![
        weather("call_8fJ2kQ", "Paris"),
        weather("call_3nR7wZ", "Rome"),
    ];
    tool_turn(&mut s, &mut out, calls);
    let calls = vec![
        weather("call_Oslo71", "Oslo-7190"),
        weather("call_Lima52", "Lima-5264"),
        weather("call_Baku33", "Baku-3318"),
    ];
    s.handle(reply(calls, None, 300), NOW).unwrap();
    let runs = drain(&mut s, &mut out);
    let finished = Event::ToolFinished {
        call: runs[0],
        result: ToolResult::text("Oslo: 3 degrees, snow"),
        from_cache: false,
    };
    s.handle(finished, NOW).unwrap();
    drain(&mut s, &mut out);
    s.into_state()
}

/// The status text, as the API server would be sent it.
fn stored_text(state: &SessionState) -> String {
    serde_json::to_string(&session_status(state)).unwrap()
}

fn occurrences(text: &str, part: &str) -> usize {
    text.matches(part).count()
}

#[test]
fn each_call_is_stored_once_and_the_session_s_ids_not_in_the_state() {
    let state = open_turn_state();
    assert_eq!(state.open.as_ref().map(|o| o.calls.len()), Some(3));
    let text = stored_text(&state);
    let every_call = state.turns.iter().filter_map(|t| match t {
        crate::core::Turn::Agent(a) => Some(a.tool_calls.clone()),
        _ => None,
    });
    for call in every_call.flatten() {
        // As the arguments appear inside the stored JSON: escaped.
        let quoted = serde_json::to_string(&call.arguments).unwrap();
        let arguments = &quoted[1..quoted.len() - 1];
        assert_eq!(occurrences(&text, arguments), 1, "{arguments} in {text}");
        let id = format!("\"{}\"", call.model_call_id);
        assert_eq!(occurrences(&text, &id), 1, "{id} in {text}");
    }
    let stored = serde_json::to_string(&session_status(&state).state).unwrap();
    for id in [NAME, UID] {
        assert!(!stored.contains(id), "{id} in status.state: {stored}");
    }
    assert_eq!(session_state(&state.id, &session_status(&state)), Ok(state));
}

#[test]
fn every_state_of_a_flow_round_trips() {
    for state in flow_checkpoints().into_iter().chain([open_turn_state()]) {
        let status = session_status(&state);
        assert_eq!(session_state(&state.id, &status), Ok(state));
    }
}

/// The shape main wrote before: `tests/fixtures/session-status-repeats.json`
/// holds the status of [`open_turn_state`] as commit 0209b2a wrote it.
fn status_in_the_shape_before() -> SessionStatus {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/session-status-repeats.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_status_in_the_shape_before_loads_and_is_written_back_without_repeats() {
    let before = status_in_the_shape_before();
    let open = &before.state.as_ref().unwrap()["open"]["calls"];
    assert!(
        open[0].get("call").is_some(),
        "the fixture repeats the calls"
    );
    let id = SessionId(NAME.into());
    let loaded = session_state(&id, &before).unwrap();
    assert_eq!(loaded, open_turn_state());
    let after = session_status(&loaded);
    let doc = after.state.as_ref().unwrap();
    for (i, call) in doc["open"]["calls"].as_array().unwrap().iter().enumerate() {
        assert!(call.get("call").is_none(), "open call {i} is stored twice");
    }
    assert_eq!(session_state(&id, &after), Ok(loaded));
    // Nothing else changed shape: putting the repeats back gives main's,
    // less the fields that held their default (false, 0).
    let mut whole = doc.clone();
    repeats::restore_repeats(&mut whole).unwrap();
    assert_eq!(Some(whole), before.state.map(without_defaults));
}

/// `state` without the fields the core no longer stores at their default.
fn without_defaults(mut state: serde_json::Value) -> serde_json::Value {
    let top = state.as_object_mut().unwrap();
    for key in ["paused", "modelAttempts", "messagesTaken", "retriesTaken"] {
        if matches!(&top.get(key), Some(v) if *v == false || *v == 0) {
            top.remove(key);
        }
    }
    for call in state["open"]["calls"].as_array_mut().into_iter().flatten() {
        if call["attempts"] == 0 {
            call.as_object_mut().unwrap().remove("attempts");
        }
    }
    state
}

/// The status as main wrote it, for comparing bytes: the repeats put back.
pub(crate) fn status_with_repeats(state: &SessionState) -> SessionStatus {
    let mut status = session_status(state);
    let doc = status.state.as_mut().unwrap();
    doc["answer"] = serde_json::json!(state.answer);
    repeats::restore_repeats(doc).unwrap();
    doc.as_object_mut().unwrap().remove("answer");
    status
}

#[test]
fn the_final_reply_keeps_its_text_once_as_the_answer() {
    let finished = flow_checkpoints().pop().unwrap();
    let answer = finished
        .answer
        .clone()
        .expect("the flow ends with an answer");
    let status = session_status(&finished);
    let stored = serde_json::to_string(&status).unwrap();
    assert_eq!(stored.matches(&answer).count(), 1, "{stored}");
    assert_eq!(status.answer.as_deref(), Some(answer.as_str()));
    assert_eq!(session_state(&finished.id, &status), Ok(finished.clone()));

    // A reply whose text is not the answer (none is today) keeps it.
    let mut other = finished;
    other.answer = Some("something else".into());
    let status = session_status(&other);
    assert!(serde_json::to_string(&status).unwrap().contains(&answer));
    assert_eq!(session_state(&other.id, &status), Ok(other));
}

#[test]
fn a_call_left_out_whose_reply_is_gone_is_refused_naming_where() {
    let state = open_turn_state();
    let mut status = session_status(&state);
    let doc = status.state.as_mut().unwrap();
    doc["turns"].as_array_mut().unwrap().pop();
    let refused = session_state(&state.id, &status).unwrap_err();
    assert_eq!(refused.field, "status.state.open.calls[0]");
    assert!(
        refused.message.contains("names no tool call"),
        "{}",
        refused.message
    );
}
