use super::*;

#[test]
fn a_packed_status_lists_with_its_phase() {
    use crate::core::conversation::{AgentTurn, ToolResultEntry, UserTurn};
    use crate::core::{CallId, Turn};
    let mut state = SessionState::new(SessionId("s".into()));
    state.turns.push(Turn::User(UserTurn {
        message: None,
        tool_results: vec![ToolResultEntry {
            call_id: CallId::new(1, 0),
            model_call_id: "m".into(),
            tool: "dump".into(),
            token: None,
            result: ToolResult::text("x".repeat(spill::INLINE_RESULT_BYTES * 2)),
            truncate_bytes: None,
            started_at: None,
            finished_at: None,
        }],
    }));
    state.turns.push(Turn::Agent(AgentTurn::default()));
    state.phase = crate::core::Phase::Succeeded;
    let mut status = stored::session_status(&state);
    assert!(!spill::pack(&mut status, "s", spill::STATUS_BUDGET_BYTES).is_empty());
    let unread = stored::session_state(&SessionId("s".into()), &status);
    assert!(unread.is_err(), "a spilled result reads as no result");
    assert_eq!(listed_phase("s", &status), crate::core::Phase::Succeeded);
}

#[tokio::test]
async fn the_memory_cache_is_bounded_in_bytes() {
    let cache = MemoryCache::default();
    let key = |i: usize| CacheKey {
        tool: "t".into(),
        arguments_sha256: format!("{i:064x}"),
    };
    let big = ToolResult::text("x".repeat(CACHE_ENTRY_BYTES + 1));
    cache.remember(&key(0), &big, Millis(0)).await.unwrap();
    assert_eq!(
        cache.lookup(&key(0)).await.unwrap(),
        None,
        "too big to keep"
    );
    let part = ToolResult::text("y".repeat(CACHE_ENTRY_BYTES));
    for i in 1..=16 {
        cache.remember(&key(i), &part, Millis(0)).await.unwrap();
    }
    let held = cache.held_bytes();
    assert!(held <= CACHE_BYTES, "{held} bytes held");
    assert_eq!(cache.lookup(&key(16)).await.unwrap(), Some(part));
}

#[test]
fn merge_patch_removes_what_the_new_status_drops() {
    let old = json!({"phase": "Waiting", "openTurn": {"turn": 1, "calls": [1, 2]}, "answer": null, "usage": {"a": 1, "b": 2}});
    let new = json!({"phase": "Succeeded", "answer": "done", "usage": {"a": 1, "b": 3}});
    let patch = merge_patch(&old, &new);
    assert_eq!(
        patch,
        json!({"phase": "Succeeded", "openTurn": null, "answer": "done", "usage": {"b": 3}})
    );
    // Applying it gives `new` (RFC 7386).
    let mut applied = old.clone();
    apply(&mut applied, &patch);
    assert_eq!(applied.as_object().unwrap().get("openTurn"), None);
    assert_eq!(applied["usage"], json!({"a": 1, "b": 3}));
}

fn apply(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().unwrap();
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    apply(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// A Session as the operator wrote it before the state moved into
/// `status.state` (tests/fixtures: its spilled blobs beside it, and the
/// core state it was written from).
#[tokio::test]
async fn a_status_in_the_earlier_form_loads_as_the_state_it_was_written_from() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let read = |name: &str| std::fs::read_to_string(fixtures.join(name)).unwrap();
    let expected: SessionState = serde_json::from_str(&read("legacy-session-state.json")).unwrap();
    let blobs: BTreeMap<String, ByteString> =
        serde_json::from_str(&read("legacy-session-blobs.json")).unwrap();
    for file in ["legacy-session.json", "legacy-session-archived.json"] {
        let obj: Session = serde_json::from_str(&read(file)).unwrap();
        loads_as(&obj, &blobs, &expected).await;
    }
}

async fn loads_as(obj: &Session, blobs: &BTreeMap<String, ByteString>, expected: &SessionState) {
    let old = obj.status.clone().unwrap();
    assert!(old.state.is_none() && old.earlier.contains_key("openTurn"));
    let mut status = old.clone();
    legacy::upgrade(&mut status).unwrap();
    spill::unpack(&mut status, |name| {
        let data = blobs.get(&name).map(|b| b.0.clone());
        async move { data.ok_or_else(|| format!("no blob {name}")) }
    })
    .await
    .unwrap();
    let state = stored::session_state(&SessionId(obj.name_any()), &status).unwrap();
    assert_eq!(&state, expected);
    // The next write removes every field of the earlier form.
    let new = serde_json::to_value(stored::session_status(&state)).unwrap();
    let patch = merge_patch(&serde_json::to_value(&old).unwrap(), &new);
    for key in old.earlier.keys() {
        assert_eq!(patch.get(key), Some(&Value::Null), "{key} stays");
    }
}

#[test]
fn a_quota_is_a_wait_and_a_server_not_ready_is_away() {
    let forbidden = |message: &str| {
        kube::Error::Api(
            kube::core::Status::failure(message, "Forbidden")
                .with_code(403)
                .boxed(),
        )
    };
    let full = forbidden("continuations.agents-exe.io \"s-t1-c0\" is forbidden: exceeded quota: q, requested: count/continuations.agents-exe.io=1, used: count/continuations.agents-exe.io=0, limited: count/continuations.agents-exe.io=0");
    let held = quota_held("the Continuation s-t1-c0".into(), &full);
    assert!(held.is_quota() && !held.is_transient(), "{held}");
    assert!(
        held.to_string().contains("limited: count/continuations"),
        "{held}"
    );
    let starting = backend(forbidden("not yet ready to handle request"));
    assert!(starting.is_transient(), "{starting}");
    let rbac = backend(forbidden(
        "User \"x\" cannot patch resource \"continuations/status\"",
    ));
    assert!(!rbac.is_transient() && !rbac.is_quota(), "{rbac}");
}

#[test]
fn conditions_round_trip_through_metav1() {
    let mut c = conditions::Condition::new("Ready", CondStatus::False, "AgentNotFound", "x");
    c.last_transition = Millis(1_700_000_000_000);
    c.observed_generation = Some(3);
    assert_eq!(core_condition(&meta_condition(&c)), Some(c));
}
