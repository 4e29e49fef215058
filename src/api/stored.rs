//! The session's state as a Session's status stores it: the core's own
//! serialisation in `status.state`, with the few fields people read
//! (answer, failure, usage, counters) lifted beside it, each stored once.
//! A field added to the core's `SessionState` lands in `status.state`, and
//! in its schema, with no edit here.

mod repeats;
#[cfg(test)]
pub(crate) mod shape_tests;

use super::convert::ConvertError;
use super::session::{SessionPhase, SessionStatus};
use crate::core::conditions::most_needed_wait;
use crate::core::{Phase, SessionId, SessionState};
use schemars::generate::SchemaSettings;
use schemars::transform::Transform;
use schemars::{Schema, SchemaGenerator};
use serde_json::{json, Map, Value};

/// The state's fields stored beside `status.state` instead of in it (the
/// id is the object's name).
const LIFTED: [&str; 7] = [
    "id",
    "forkedFrom",
    "agentTurns",
    "usage",
    "answer",
    "failure",
    "retriesTaken",
];

/// The status for `state`. Conditions, observedGeneration, traceparent and
/// archived turns are left for the store to fill.
pub fn session_status(state: &SessionState) -> SessionStatus {
    let mut doc = serde_json::to_value(state).expect("the core's state serialises");
    repeats::drop_repeats(&mut doc, state.answer.as_deref());
    if let Some(fields) = doc.as_object_mut() {
        for key in LIFTED {
            fields.remove(key);
        }
    }
    SessionStatus {
        phase: session_phase(state),
        waiting_for: match &state.budget_ask {
            _ if state.budget_exhausted.is_some() && !state.phase.is_final() => {
                Some(crate::core::WaitingFor::Budget)
            }
            Some(_) => Some(crate::core::WaitingFor::Budget),
            None => (state.phase == Phase::Waiting)
                .then(|| most_needed_wait(state))
                .flatten(),
        },
        pending_count: state.pending().len() as u32,
        agent_turns: state.agent_turns,
        usage: state.usage,
        tokens: state.usage.total(),
        answer: state.answer.clone(),
        failure: state.failure.clone(),
        retries_taken: state.retries_taken,
        forked_from: state.forked_from.clone(),
        state: Some(doc),
        ..SessionStatus::default()
    }
}

/// The phase people see: the core's, with `Paused` over a running one.
pub fn session_phase(state: &SessionState) -> SessionPhase {
    match state.phase {
        Phase::Succeeded => SessionPhase::Succeeded,
        Phase::Failed => SessionPhase::Failed,
        _ if state.paused || state.budget_stop.is_some() => SessionPhase::Paused,
        _ if state.budget_ask.is_some() || state.budget_exhausted.is_some() => {
            SessionPhase::Waiting
        }
        Phase::Idle => SessionPhase::Pending,
        Phase::AwaitingModel => SessionPhase::AwaitingModel,
        Phase::RunningTools => SessionPhase::Running,
        Phase::Waiting => SessionPhase::Waiting,
    }
}

/// The core's state from a status written by [`session_status`] (spilled
/// parts already read back), or by an earlier version of the operator.
pub fn session_state(id: &SessionId, status: &SessionStatus) -> Result<SessionState, ConvertError> {
    let Some(doc) = &status.state else {
        return super::legacy::session_state(id, status);
    };
    // Taken for an empty state, anything else would start the session over.
    let Some(mut fields) = doc.as_object().cloned() else {
        return Err(ConvertError {
            field: "status.state".into(),
            message: "not an object: a session state is an object of its fields".into(),
        });
    };
    let lifted = json!({
        "id": id,
        "agentTurns": status.agent_turns,
        "usage": status.usage,
        "answer": status.answer,
        "failure": status.failure,
        "retriesTaken": status.retries_taken,
        "forkedFrom": status.forked_from,
    });
    for (key, value) in lifted.as_object().into_iter().flatten() {
        fields.insert(key.clone(), value.clone());
    }
    let mut doc = Value::Object(fields);
    repeats::restore_repeats(&mut doc)?;
    serde_json::from_value(doc).map_err(|e| ConvertError {
        field: "status.state".into(),
        message: format!("not a session state this operator can read: {e}"),
    })
}

/// The schema of `status.state`: the core's `SessionState`, made a
/// structural schema the API server takes (tagged unions merged into one
/// object, free-form objects kept whole), without the lifted fields.
pub(crate) fn stored_state_schema(_: &mut SchemaGenerator) -> Schema {
    let mut generator = SchemaSettings::openapi3()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator();
    let mut schema = generator.root_schema_for::<SessionState>();
    let mut value = schema.clone().to_value();
    merge_tagged_unions(&mut value);
    schema = Schema::try_from(value).expect("a schema stays a schema");
    kube::core::schema::StructuralSchemaRewriter.transform(&mut schema);
    let mut value = schema.to_value();
    keep_free_form_objects(&mut value);
    let top = value.as_object_mut().expect("an object schema");
    for key in LIFTED {
        top.get_mut("properties")
            .and_then(Value::as_object_mut)
            .map(|p| p.remove(key));
    }
    top.remove("required");
    top.remove("title");
    top.insert(
        "description".into(),
        "The session's state as the core keeps it: phase, recent turns, the open turn's calls, the inbox, the model call's attempt.".into(),
    );
    repeats::describe_in_schema(&mut value);
    Schema::try_from(value).expect("a schema stays a schema")
}

/// Folds every `oneOf` of objects (a serde tagged enum) into one object
/// holding every variant's properties: the tag's values are merged into
/// one enum, and only properties all variants require stay required.
fn merge_tagged_unions(schema: &mut Value) {
    match schema {
        Value::Object(node) => {
            node.values_mut().for_each(merge_tagged_unions);
            let variants = node.get("oneOf").and_then(Value::as_array).cloned();
            if let Some(variants) = variants.filter(|v| v.iter().all(is_object_schema)) {
                node.remove("oneOf");
                merge_variants(node, &variants);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(merge_tagged_unions),
        _ => {}
    }
}

fn is_object_schema(v: &Value) -> bool {
    v.get("properties").is_some_and(Value::is_object)
}

fn merge_variants(node: &mut Map<String, Value>, variants: &[Value]) {
    let mut properties = Map::new();
    let mut required: Option<Vec<Value>> = None;
    for variant in variants {
        for (name, property) in variant["properties"].as_object().into_iter().flatten() {
            match properties.get_mut(name) {
                Some(Value::Object(known)) => add_enum_values(known, property),
                _ => {
                    properties.insert(name.clone(), property.clone());
                }
            }
        }
        let here = variant["required"].as_array().cloned().unwrap_or_default();
        required = Some(match required {
            None => here,
            Some(all) => all.into_iter().filter(|r| here.contains(r)).collect(),
        });
    }
    describe_tags(&mut properties, variants);
    node.insert("type".into(), "object".into());
    node.insert("properties".into(), Value::Object(properties));
    if let Some(required) = required.filter(|r| !r.is_empty()) {
        node.insert("required".into(), Value::Array(required));
    }
}

/// A tag seen in several variants: one enum of every variant's value.
fn add_enum_values(known: &mut Map<String, Value>, property: &Value) {
    let values = |p: &Value| -> Vec<Value> {
        match (p.get("enum"), p.get("const")) {
            (Some(Value::Array(v)), _) => v.clone(),
            (_, Some(c)) => vec![c.clone()],
            _ => Vec::new(),
        }
    };
    let mut all = values(&Value::Object(known.clone()));
    all.extend(values(property));
    if !all.is_empty() {
        known.remove("const");
        known.insert("enum".into(), Value::Array(all));
    }
}

/// A tag has no doc comment of its own: it is described by the variants'.
fn describe_tags(properties: &mut Map<String, Value>, variants: &[Value]) {
    for (name, property) in properties.iter_mut() {
        let Some(values) = property.get("enum").and_then(Value::as_array).cloned() else {
            continue;
        };
        if property.get("description").is_some() {
            continue;
        }
        let described: Vec<String> = values
            .iter()
            .filter_map(Value::as_str)
            .map(|tag| {
                let doc = variants
                    .iter()
                    .find(|v| {
                        let quoted = format!("\"{tag}\"");
                        v["properties"][name.as_str()].to_string().contains(&quoted)
                    })
                    .and_then(|v| v["description"].as_str());
                match doc {
                    Some(d) => format!("`{tag}` ({})", d.trim_end_matches('.')),
                    None => format!("`{tag}`"),
                }
            })
            .collect();
        property["description"] = format!("One of {}.", described.join("; ")).into();
    }
}

/// An object schema naming no properties (a tool's response) keeps what it
/// is given instead of being pruned to `{}`.
fn keep_free_form_objects(schema: &mut Value) {
    match schema {
        Value::Object(node) => {
            let typed_object = node.get("type") == Some(&json!("object"));
            let open =
                !node.contains_key("properties") && !node.contains_key("additionalProperties");
            if typed_object && open {
                node.insert("x-kubernetes-preserve-unknown-fields".into(), true.into());
            }
            node.values_mut().for_each(keep_free_form_objects);
        }
        Value::Array(items) => items.iter_mut().for_each(keep_free_form_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::call::TrackedToolCall;
    use crate::core::session::PartialUserTurn;
    use crate::core::{AppliedPolicy, CallId, TokenUsage, ToolCall};

    fn waiting_state() -> SessionState {
        let mut state = SessionState::new(SessionId("s".into()));
        let mut call = TrackedToolCall::new(
            CallId::new(1, 0),
            ToolCall {
                model_call_id: "m".into(),
                name: "search".into(),
                arguments: "{}".into(),
            },
            AppliedPolicy::default(),
        );
        call.start().unwrap();
        state.open = Some(PartialUserTurn {
            turn: 1,
            calls: vec![call],
        });
        state.phase = Phase::RunningTools;
        state.agent_turns = 1;
        state.usage = TokenUsage {
            prompt_tokens: 10,
            completion_tokens: 2,
            ..TokenUsage::default()
        };
        state.retries_taken = 2;
        state
    }

    /// Every lifted field set, so each shows in the core's serialisation.
    fn full_state() -> SessionState {
        let mut state = waiting_state();
        state.answer = Some("done".into());
        state.failure = Some("not really".into());
        state.forked_from = Some(crate::core::fork::ForkedFrom {
            session: "source".into(),
            uid: "u-1".into(),
            turn: 1,
        });
        state
    }

    #[test]
    fn the_state_round_trips_and_each_field_is_stored_once() {
        let state = full_state();
        let status = session_status(&state);
        assert_eq!(session_state(&state.id, &status), Ok(state.clone()));
        let doc = status.state.as_ref().unwrap().as_object().unwrap();
        let whole = serde_json::to_value(&state).unwrap();
        for key in LIFTED {
            // A lifted name the core no longer has would silently be lost.
            assert!(whole.get(key).is_some(), "the core's state has no {key}");
            assert!(!doc.contains_key(key), "{key} is stored twice");
        }
        assert_eq!((status.agent_turns, status.retries_taken), (1, 2));
        assert_eq!(status.phase, SessionPhase::Running);
    }

    /// The API server prunes what the schema does not name: the times the
    /// core keeps must be in it, where the core writes them.
    #[test]
    fn the_status_schema_keeps_the_times_of_replies_and_calls() {
        let schema = stored_state_schema(&mut SchemaGenerator::default()).to_value();
        let props = |v: &Value, path: &[&str]| -> Vec<String> {
            let mut at = v;
            for step in path {
                at = &at[*step];
            }
            at["properties"]
                .as_object()
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default()
        };
        let turn = props(&schema, &["properties", "turns", "items"]);
        let result = props(
            &schema,
            &[
                "properties",
                "turns",
                "items",
                "properties",
                "toolResults",
                "items",
            ],
        );
        let call = props(
            &schema,
            &["properties", "open", "properties", "calls", "items"],
        );
        for (names, what) in [
            (&turn, ["askedAt", "repliedAt"]),
            (&result, ["startedAt", "finishedAt"]),
            (&call, ["startedAt", "finishedAt"]),
        ] {
            for name in what {
                assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
            }
        }
    }

    #[test]
    fn a_status_call_no_event_can_produce_is_refused_naming_the_field() {
        let state = waiting_state();
        let mut status = session_status(&state);
        status.state.as_mut().unwrap()["open"]["calls"][0]["state"] = json!("Completed");
        let refused = session_state(&state.id, &status).unwrap_err();
        assert_eq!(refused.field, "status.state");
        assert!(
            refused
                .message
                .contains("tool call t1-c0 (search) is final but holds no result"),
            "{}",
            refused.message
        );
    }

    /// The API server stores `status.state` as written: a state that is no
    /// object is refused, never read as an empty one (which would start
    /// the session over).
    #[test]
    fn a_state_that_is_no_object_is_refused() {
        let state = waiting_state();
        for not_an_object in [json!("x"), json!([]), json!(3)] {
            let mut status = session_status(&state);
            status.state = Some(not_an_object);
            let refused = session_state(&state.id, &status).unwrap_err();
            assert_eq!(refused.field, "status.state");
            assert!(
                refused.message.contains("not an object"),
                "{}",
                refused.message
            );
        }
    }
}
