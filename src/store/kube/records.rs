//! From API objects to the engine's records and back: merge patches, conditions, owner references, vote tallies, errors.

use super::*;

/// The field manager of every write of a Session's status, by the
/// operator or by a CLI driving the session: one entry in the Session's
/// `managedFields` for its status, whichever process wrote it (without a
/// name, the API server takes the client's user agent).
pub const STATUS_MANAGER: &str = "agents";

/// How a Session's status is patched: under [`STATUS_MANAGER`].
pub fn status_patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(STATUS_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// How a Session's status is replaced (a PUT): under [`STATUS_MANAGER`].
pub fn status_post_params() -> kube::api::PostParams {
    kube::api::PostParams {
        field_manager: Some(STATUS_MANAGER.into()),
        ..Default::default()
    }
}

pub(crate) fn wall_now() -> Millis {
    use crate::ports::Clock;
    SystemClock.now()
}

/// The API server (or etcd behind it) refusing an object for its size.
pub(crate) fn too_large(s: &kube::core::Status) -> bool {
    s.code == 413 || s.message.to_ascii_lowercase().contains("too large")
}

/// A 409 that is not "already exists": a stale `resourceVersion`. kube-core
/// matches only `reason`, which may be empty, so the code counts too.
pub(crate) fn is_conflict(s: &kube::core::Status) -> bool {
    s.is_conflict() || (s.code == 409 && !s.is_already_exists())
}

/// A create that a ResourceQuota refused for now: a wait (see
/// [`StoreError::QuotaExceeded`]).
pub(crate) fn quota_held(what: String, e: &kube::Error) -> StoreError {
    StoreError::QuotaExceeded {
        what,
        message: exceeded_quota(e).unwrap_or_default().to_string(),
    }
}

pub(crate) fn backend(e: kube::Error) -> StoreError {
    match e {
        // Throttled (API priority and fairness) or the server (or its etcd)
        // failing for now: the same request may succeed in a moment.
        // An API server just started refuses requests its admission
        // policies cannot judge yet (403 "not yet ready to handle request").
        kube::Error::Api(s)
            if s.code == 429
                || s.code >= 500
                || (s.code == 403 && s.message.contains("not yet ready to handle request")) =>
        {
            StoreError::Unavailable(format!(
                "the API server answered {} {}: {}",
                s.code, s.reason, s.message
            ))
        }
        kube::Error::Api(s) => StoreError::Backend(format!(
            "the API server answered {} {}: {}",
            s.code, s.reason, s.message
        )),
        other => StoreError::Unavailable(format!("cannot reach the API server: {other}")),
    }
}

pub(crate) fn version_of(meta: &ObjectMeta) -> StoreResult<Version> {
    meta.resource_version
        .clone()
        .map(Version)
        .ok_or_else(|| StoreError::Backend("object without a resourceVersion".into()))
}

pub(crate) fn status_json(obj: &Session) -> Value {
    obj.status
        .as_ref()
        .map(|s| serde_json::to_value(s).unwrap_or(Value::Null))
        .unwrap_or(Value::Null)
}

/// An RFC 7386 merge patch that turns `old` into `new`: keys `new` drops
/// are set to null (a plain merge would keep them: a closed turn's
/// `openTurn` would stay), objects are patched key by key, the rest replaced.
pub fn merge_patch(old: &Value, new: &Value) -> Value {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = serde_json::Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) if ov == nv => {}
                    Some(ov) => {
                        out.insert(k.clone(), merge_patch(ov, nv));
                    }
                    None => {
                        out.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            Value::Object(out)
        }
        _ => new.clone(),
    }
}

/// A Session object as the engine's record.
pub fn session_record(obj: &Session) -> StoreResult<SessionRecord> {
    let name = obj.name_any();
    let id = SessionId(name.clone());
    let state = match &obj.status {
        None => SessionState::new(id.clone()),
        Some(status) => stored::session_state(&id, status).map_err(|e| StoreError::Corrupt {
            what: format!("session {name} (status)"),
            why: e.to_string(),
        })?,
    };
    let created = obj
        .metadata
        .creation_timestamp
        .as_ref()
        .map(convert::millis)
        .unwrap_or_default();
    Ok(SessionRecord {
        state,
        input: session_input(&obj.spec),
        namespace: obj.namespace().unwrap_or_default(),
        uid: obj.uid().unwrap_or_default(),
        definition: serde_json::to_value(&obj.spec).unwrap_or(Value::Null),
        created_at: created,
        updated_at: created,
        trace: obj.status.as_ref().and_then(|s| s.traceparent.clone()),
    })
}

/// The phase of a status as stored: spilled results do not parse as
/// results, so the shown phase stands in where the turns cannot be read.
pub(crate) fn listed_phase(name: &str, status: &SessionStatus) -> crate::core::Phase {
    use crate::api::session::SessionPhase as Shown;
    use crate::core::Phase;
    if let Ok(state) = stored::session_state(&SessionId(name.into()), status) {
        return state.phase;
    }
    match status.phase {
        Shown::Succeeded => Phase::Succeeded,
        Shown::Failed => Phase::Failed,
        Shown::AwaitingModel => Phase::AwaitingModel,
        Shown::Running => Phase::RunningTools,
        Shown::Waiting => Phase::Waiting,
        Shown::Pending | Shown::Paused => Phase::Idle,
    }
}

pub(crate) fn session_input(spec: &SessionSpec) -> SessionInput {
    SessionInput {
        messages: spec.messages.clone(),
        paused: spec.paused,
        retry: spec.retry.unwrap_or(0),
    }
}

/// The UID of the object's controller owner.
/// Blob names start with the session's name and the head of its UID: a
/// session re-created under its name never meets the old one's blobs.
pub(crate) fn blob_prefix(session: &str, uid: &str) -> String {
    let head: String = uid
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect();
    format!("{session}-{}", head.to_ascii_lowercase())
}

/// The cache key of a blob: blobs are shared only within their session.
pub(crate) fn blob_key(uid: &str, name: &str) -> String {
    format!("{uid}/{name}")
}

/// The decision the votes of an approval policy add up to, if any yet.
pub(crate) fn tally(
    votes: &[crate::api::continuation::DecisionStatus],
    quorum: u32,
) -> Option<Decision> {
    let votes: Vec<acceptance::Vote<'_>> = votes
        .iter()
        .map(|d| acceptance::Vote {
            approved: d.approved,
            by: &d.by,
            reason: d.reason.as_deref(),
            at: convert::millis(&d.decided_at),
            arguments: d.arguments.as_deref(),
        })
        .collect();
    acceptance::tally(&votes, quorum).map(|t| Decision {
        approved: t.approved,
        by: t.by,
        reason: t.reason,
        at: t.at,
        arguments: t.arguments,
        raise: None,
    })
}

pub(crate) fn controller_uid(c: &Continuation) -> Option<String> {
    c.owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
}

pub(crate) fn owner_reference(owner: &SessionRef) -> OwnerReference {
    OwnerReference {
        api_version: Session::api_version(&()).into_owned(),
        kind: Session::kind(&()).into_owned(),
        name: owner.id.0.clone(),
        uid: owner.uid.clone(),
        controller: Some(true),
        // Setting it needs `sessions/finalizers` permission; garbage
        // collection works without it.
        block_owner_deletion: None,
    }
}

/// A Continuation object as the engine's record.
pub fn continuation_record(c: &Continuation) -> StoreResult<ContinuationRecord> {
    let name = c.name_any();
    let token = ContinuationToken(name.clone());
    let corrupt = |why: String| StoreError::Corrupt {
        what: format!("continuation {name}"),
        why,
    };
    let spec = convert::core_continuation_spec(&token, &c.spec, c.status.as_ref())
        .map_err(|e| corrupt(e.to_string()))?;
    let status = c.status.clone().unwrap_or_default();
    let (result, completed_by, completed_at) = match &status.outcome {
        None => (None, None, None),
        Some(o) => (
            Some(
                convert::tool_result(&o.result, "status.outcome.result")
                    .unwrap_or_else(|e| malformed(&o.completed_by, &e.to_string())),
            ),
            Some(o.completed_by.clone()),
            Some(convert::micro_millis(&o.completed_at)),
        ),
    };
    let decision = match &spec.policy.decorators.approval_policy {
        Some(policy) if !status.decisions.is_empty() => tally(&status.decisions, policy.quorum),
        _ => status.decision.as_ref().map(|d| Decision {
            approved: d.approved,
            by: d.by.clone(),
            reason: d.reason.clone(),
            at: convert::millis(&d.decided_at),
            arguments: d.arguments.clone(),
            raise: d.raise,
        }),
    };
    Ok(ContinuationRecord {
        spec,
        result,
        completed_by,
        completed_at,
        decision,
        answers: status.answers.as_ref().map(|a| a.input_responses.clone()),
        created_at: c
            .metadata
            .creation_timestamp
            .as_ref()
            .map(convert::millis)
            .unwrap_or_default(),
    })
}

/// The error a call gets for a result its writer got wrong.
pub(crate) fn malformed(by: &str, why: &str) -> ToolResult {
    ToolResult::error(format!("the result written by {by} was malformed: {why}"))
}

/// A core condition as `metav1.Condition`.
pub fn meta_condition(c: &conditions::Condition) -> MetaCondition {
    MetaCondition {
        type_: c.type_.clone(),
        status: c.status.as_str().to_string(),
        reason: c.reason.clone(),
        message: c.message.clone(),
        last_transition_time: convert::time(c.last_transition),
        observed_generation: c.observed_generation,
    }
}

pub fn core_condition(c: &MetaCondition) -> Option<conditions::Condition> {
    let status = match c.status.as_str() {
        "True" => CondStatus::True,
        "False" => CondStatus::False,
        "Unknown" => CondStatus::Unknown,
        _ => return None,
    };
    let mut out = conditions::Condition::new(&c.type_, status, &c.reason, c.message.clone());
    out.last_transition = convert::millis(&c.last_transition_time);
    out.observed_generation = c.observed_generation;
    Some(out)
}

pub(crate) fn same_condition(a: &MetaCondition, b: &MetaCondition) -> bool {
    a.status == b.status
        && a.reason == b.reason
        && a.message == b.message
        && a.observed_generation == b.observed_generation
}

#[cfg(test)]
mod status_bytes {
    use super::merge_patch;
    use crate::api::stored::session_status;
    use crate::api::stored::shape_tests::{flow_checkpoints, status_with_repeats};
    use crate::api::SessionStatus;
    use serde_json::{json, Value};

    /// The bytes of each status write of a flow session (the merge patch's
    /// body, as the store sends it) and of its last status.
    fn writes(statuses: &[SessionStatus]) -> (Vec<usize>, usize) {
        let (mut old, mut sizes) = (Value::Null, Vec::new());
        for status in statuses {
            let new = serde_json::to_value(status).unwrap();
            let body = json!({"metadata": {"resourceVersion": "1234567"}, "status": merge_patch(&old, &new)});
            sizes.push(serde_json::to_vec(&body).unwrap().len());
            old = new;
        }
        (sizes, serde_json::to_vec(&old).unwrap().len())
    }

    /// Prints what a flow session's status writes cost in both shapes (run
    /// with `--nocapture`), and holds the new one to fewer bytes.
    #[test]
    fn a_flow_session_s_status_writes_take_fewer_bytes_without_repeats() {
        let states = flow_checkpoints();
        let before: Vec<_> = states.iter().map(status_with_repeats).collect();
        let after: Vec<_> = states.iter().map(session_status).collect();
        let (before, after) = (writes(&before), writes(&after));
        let mean = |w: &[usize]| w.iter().sum::<usize>() as f64 / w.len() as f64;
        println!(
            "flow session, {} status writes: before {:?} bytes (mean {:.0}), last status {} bytes; \
             after {:?} bytes (mean {:.0}), last status {} bytes",
            after.0.len(),
            before.0,
            mean(&before.0),
            before.1,
            after.0,
            mean(&after.0),
            after.1
        );
        assert!(mean(&after.0) < mean(&before.0));
        assert!(after.1 < before.1);
    }
}
