//! What `status.state` leaves out because the state already holds it: a
//! reply's tool calls are stored once, in the reply (`turns[].toolCalls`).
//! An open call's `call`, and a tool result's `modelCallId` and `tool`,
//! repeat the tool call their id names (`t<turn>-c<index>`: the index-th
//! call of the turn-th reply in `turns`): they are left out when equal to
//! it, and put back on load. A value that differs (none does today) is
//! kept, so loading gives back what was stored. Replies are counted in the
//! whole list of turns, archived ones put back: a status read without its
//! archived turns (for its phase only) may name the wrong reply.
//!
//! The final reply's text is the answer, which the status keeps for people
//! (`status.answer`): the reply leaves its text out when the two are equal,
//! and gets it back from the answer on load.

use super::ConvertError;
use crate::core::CallId;
use serde_json::{Map, Value};

/// Removes from `doc` (the core's state as JSON) each repeat of the
/// reply's tool calls, and the final reply's text when it is `answer`.
pub(super) fn drop_repeats(doc: &mut Value, answer: Option<&str>) {
    if let Some(reply) = final_reply(doc) {
        let text = reply.get("text").and_then(Value::as_str);
        if text.is_some_and(|t| !t.is_empty() && Some(t) == answer) {
            object_mut(reply).remove("text");
        }
    }
    let mut replies = Vec::new();
    for turn in array_mut(doc, "turns") {
        if take_reply(turn, &mut replies) {
            continue;
        }
        for result in array_mut(turn, "toolResults") {
            let Some(call) = issued(&replies, result.get("callId")) else {
                continue;
            };
            let same = |k: &str, r: &str| call.get(k).is_some() && call.get(k) == result.get(r);
            if same("modelCallId", "modelCallId") && same("name", "tool") {
                let fields = object_mut(result);
                fields.remove("modelCallId");
                fields.remove("tool");
            }
        }
    }
    for call in open_calls(doc) {
        if issued(&replies, call.get("id")).is_some_and(|c| Some(c) == call.get("call")) {
            object_mut(call).remove("call");
        }
    }
}

/// Puts back what [`drop_repeats`] left out; a value left out whose reply
/// is not in `doc` is refused, naming where.
pub(super) fn restore_repeats(doc: &mut Value) -> Result<(), ConvertError> {
    let answer = doc
        .get("answer")
        .and_then(Value::as_str)
        .map(str::to_string);
    if let (Some(reply), Some(answer)) = (final_reply(doc), answer) {
        let fields = object_mut(reply);
        if !answer.is_empty() && !fields.contains_key("text") {
            fields.insert("text".into(), answer.into());
        }
    }
    let mut replies = Vec::new();
    for (t, turn) in array_mut(doc, "turns").enumerate() {
        if take_reply(turn, &mut replies) {
            continue;
        }
        for (i, result) in array_mut(turn, "toolResults").enumerate() {
            let fields = object_mut(result);
            if fields.contains_key("modelCallId") && fields.contains_key("tool") {
                continue;
            }
            let at = format!("status.state.turns[{t}].toolResults[{i}]");
            let call = issued_or_refuse(&replies, fields.get("callId"), &at)?;
            let (id, name) = (call["modelCallId"].clone(), call["name"].clone());
            fields.entry("modelCallId").or_insert(id);
            fields.entry("tool").or_insert(name);
        }
    }
    for (i, call) in open_calls(doc).enumerate() {
        let fields = object_mut(call);
        if !fields.contains_key("call") {
            let at = format!("status.state.open.calls[{i}]");
            let issued = issued_or_refuse(&replies, fields.get("id"), &at)?;
            fields.insert("call".into(), issued.clone());
        }
    }
    Ok(())
}

/// The last turn, when it is a reply without tool calls: the one whose
/// text became the answer.
fn final_reply(doc: &mut Value) -> Option<&mut Value> {
    let last = doc.get_mut("turns")?.as_array_mut()?.last_mut()?;
    let is_reply = last.get("role").and_then(Value::as_str) == Some("agent");
    let calls = last.get("toolCalls").and_then(Value::as_array);
    (is_reply && last.is_object() && calls.is_none_or(Vec::is_empty)).then_some(last)
}

/// Notes an agent turn's tool calls as the next reply's; true for an
/// agent turn.
fn take_reply(turn: &Value, replies: &mut Vec<Vec<Value>>) -> bool {
    if turn.get("role").and_then(Value::as_str) != Some("agent") {
        return false;
    }
    let calls = turn.get("toolCalls").and_then(Value::as_array);
    replies.push(calls.cloned().unwrap_or_default());
    true
}

/// The tool call that call `id` (`t<turn>-c<index>`) tracks: the
/// index-th of the turn-th reply.
fn issued<'a>(replies: &'a [Vec<Value>], id: Option<&Value>) -> Option<&'a Value> {
    let id: CallId = id?.as_str()?.parse().ok()?;
    let reply = replies.get((id.turn as usize).checked_sub(1)?)?;
    reply.get(id.index as usize)
}

fn issued_or_refuse<'a>(
    replies: &'a [Vec<Value>],
    id: Option<&Value>,
    at: &str,
) -> Result<&'a Value, ConvertError> {
    issued(replies, id).ok_or_else(|| ConvertError {
        field: at.to_string(),
        message: format!(
            "names no tool call, and status.state.turns holds no reply with a call for its \
             id {}: restore the call (modelCallId, name, arguments) or the reply",
            id.map_or_else(|| "(none)".to_string(), Value::to_string)
        ),
    })
}

fn array_mut<'a>(v: &'a mut Value, key: &str) -> impl Iterator<Item = &'a mut Value> {
    v.get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter(|item| item.is_object())
}

fn open_calls(doc: &mut Value) -> impl Iterator<Item = &mut Value> {
    doc.get_mut("open")
        .into_iter()
        .flat_map(|open| array_mut(open, "calls"))
}

fn object_mut(v: &mut Value) -> &mut Map<String, Value> {
    v.as_object_mut().expect("only objects are visited")
}

/// The stored state's schema with the repeats optional, each saying where
/// its value is when it is absent (the API server would refuse a status
/// without a required field).
pub(super) fn describe_in_schema(schema: &mut Value) {
    let named = "(`t<turn>-c<index>`: the index-th of `toolCalls` in the turn-th reply of `turns`)";
    let call = &mut schema["properties"]["open"]["properties"]["calls"]["items"];
    let text = format!(
        "The call as the model issued it; absent when it is the tool call `id` names {named}."
    );
    unrequire(call, "call", &text);
    let result = &mut schema["properties"]["turns"]["items"]["properties"]["toolResults"]["items"];
    let text = format!(
        "The model's call id; absent when it is that of the tool call `callId` names {named}."
    );
    unrequire(result, "modelCallId", &text);
    let text =
        format!("The tool's name; absent when it is that of the tool call `callId` names {named}.");
    unrequire(result, "tool", &text);
}

fn unrequire(node: &mut Value, field: &str, description: &str) {
    if let Some(required) = node.get_mut("required").and_then(Value::as_array_mut) {
        required.retain(|r| r != field);
    }
    node["properties"][field]["description"] = description.into();
}
