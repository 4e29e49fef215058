use super::*;
use crate::core::session::ContinuationSpec;
use crate::core::{AgentTurn, Disposition, Event, Policy, Rule, Session, SessionConfig, ToolCall};

fn temp_db(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!(
        "agents-store-{name}-{}-{}.db",
        std::process::id(),
        now_nanos()
    ));
    let _ = std::fs::remove_file(&p);
    p
}

/// Opens `path` on a thread, so a store that blocks the open fails
/// the test instead of hanging it.
fn open_within_a_second(path: &Path) -> StoreResult<SqliteStore> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(SqliteStore::open(&path));
    });
    rx.recv_timeout(Duration::from_secs(1))
        .expect("the open answers within a second")
}

fn refusal(path: &Path) -> String {
    match open_within_a_second(path) {
        Ok(_) => panic!("{} was opened as a store", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_directory_where_sqlite_keeps_its_wal_or_shm_is_named() {
    for suffix in ["-wal", "-shm"] {
        let db = temp_db("side");
        SqliteStore::open(&db).unwrap();
        for s in SIDE_FILES {
            let _ = std::fs::remove_file(format!("{}{s}", db.display()));
        }
        let side = PathBuf::from(format!("{}{suffix}", db.display()));
        std::fs::create_dir(&side).unwrap();
        let e = refusal(&db);
        assert!(
            e.contains(&format!("{} is a directory", side.display()))
                && e.contains("move it out of the way")
                && !e.contains("read-only"),
            "{e}"
        );
        std::fs::remove_dir(&side).unwrap();
        SqliteStore::open(&db).unwrap();
        let _ = std::fs::remove_file(&db);
    }
}

#[test]
fn a_fifo_a_socket_or_a_device_is_refused_at_once() {
    let fifo = temp_db("fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = refusal(&fifo);
    assert!(e.contains("is a FIFO (named pipe), not a file"), "{e}");
    assert!(e.contains(&fifo.display().to_string()), "{e}");
    let _ = std::fs::remove_file(&fifo);

    let socket = temp_db("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let e = refusal(&socket);
    assert!(e.contains("is a socket, not a file"), "{e}");
    let _ = std::fs::remove_file(&socket);

    let e = refusal(Path::new("/dev/null"));
    assert!(
        e.contains("/dev/null") && e.contains("a character device"),
        "{e}"
    );
    let e = SqliteStore::open_read_only(Path::new("/dev/null"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("a character device"), "{e}");
}

fn now_nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
}

/// A session with history, an open turn and a deferred call.
fn waiting_session() -> (SessionState, Vec<ContinuationSpec>) {
    let turn = AgentTurn {
        text: Some("asking".into()),
        tool_calls: vec![ToolCall {
            model_call_id: "m1".into(),
            name: "ask".into(),
            arguments: r#"{"q":"x"}"#.into(),
        }],
        usage: Default::default(),
        ..Default::default()
    };
    let (s, specs) = asking_session("s1", Default::default(), turn);
    (s.into_state(), specs)
}

/// Session `id`, whose model answered "hi" with `turn`; its `ask` calls
/// wait for a person, with `decorators`. With the continuations it asks for.
fn asking_session(
    id: &str,
    decorators: crate::core::Decorators,
    turn: AgentTurn,
) -> (Session, Vec<ContinuationSpec>) {
    let config = SessionConfig {
        policy: Policy {
            rules: vec![Rule {
                tool: "ask".into(),
                disposition: Disposition::Defer {
                    reason: "a person".into(),
                },
                decorators,
            }],
            ..Default::default()
        },
        ..Default::default()
    };
    let mut s = Session::new(SessionId(id.into()), config);
    s.handle(Event::UserMessage { text: "hi".into() }, Millis(1))
        .unwrap();
    s.handle(Event::ModelReplied { turn }, Millis(2)).unwrap();
    let specs = std::iter::from_fn(|| s.poll_action())
        .filter_map(|a| match a {
            Action::EnsureContinuation(c) => Some(c),
            _ => None,
        })
        .collect();
    (s, specs)
}

use crate::core::Action;

fn record(state: SessionState) -> SessionRecord {
    SessionRecord {
        state,
        input: SessionInput::default(),
        namespace: String::new(),
        uid: "u1".into(),
        definition: serde_json::json!({"any": "thing"}),
        created_at: Millis(1),
        updated_at: Millis(2),
        trace: None,
    }
}

#[tokio::test]
async fn sessions_round_trip_and_writes_are_compare_and_swap() {
    let path = temp_db("cas");
    let store = SqliteStore::open(&path).unwrap();
    let (state, _) = waiting_session();
    let v1 = store.create_session(record(state.clone())).await.unwrap();
    assert!(matches!(
        store.create_session(record(state.clone())).await,
        Err(StoreError::SessionExists(_))
    ));
    let loaded = store.load_session(&state.id).await.unwrap().unwrap();
    assert_eq!(loaded.value, record(state.clone()), "lossless round trip");
    assert_eq!(loaded.version, v1);
    // The times the core keeps for people are part of what comes back.
    let call = &loaded.value.state.open.as_ref().unwrap().calls[0];
    assert_eq!(call.started_at, Some(Millis(2)));
    assert!(matches!(
        &loaded.value.state.turns[1],
        crate::core::Turn::Agent(a) if a.replied_at == Some(Millis(2))
    ));

    let mut changed = record(state.clone());
    changed.state.paused = true;
    let v2 = store.save_session(&changed, &v1).await.unwrap();
    assert_ne!(v1, v2);
    // A writer still holding v1 loses instead of overwriting.
    let stale = store.save_session(&record(state.clone()), &v1).await;
    assert!(
        matches!(stale, Err(StoreError::Conflict { .. })),
        "{stale:?}"
    );
    let now = store.load_session(&state.id).await.unwrap().unwrap();
    assert!(now.value.state.paused);
    let list = store.list_sessions().await.unwrap();
    assert_eq!(list[0].pending, 1);
    drop(store);
    // Reopening applies no migration twice and keeps the data.
    let again = SqliteStore::open(&path).unwrap();
    assert!(again.load_session(&state.id).await.unwrap().is_some());
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn a_stored_call_no_event_can_produce_is_refused_on_load() {
    let path = temp_db("impossible");
    let store = SqliteStore::open(&path).unwrap();
    let (state, _) = waiting_session();
    store.create_session(record(state.clone())).await.unwrap();
    // A hand edit: the deferred call now says Completed, with no result.
    let mut edited = serde_json::to_value(record(state.clone())).unwrap();
    let call = &mut edited["state"]["open"]["calls"][0];
    call["state"] = "Completed".into();
    for key in ["waitingFor", "deadline"] {
        call.as_object_mut().unwrap().remove(key);
    }
    store
        .with(|c| {
            c.execute(
                "UPDATE sessions SET record = ?1 WHERE id = ?2",
                params![edited.to_string(), state.id.0],
            )
        })
        .unwrap();
    let err = store.load_session(&state.id).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("tool call t1-c0 (ask) is final but holds no result"),
        "{err}"
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn continuation_results_and_decisions_are_written_once() {
    let path = temp_db("once");
    let store = SqliteStore::open(&path).unwrap();
    let (state, specs) = waiting_session();
    store.create_session(record(state)).await.unwrap();
    let spec = &specs[0];
    let first = store.ensure_continuation(spec, Millis(5)).await.unwrap();
    let adopted = store.ensure_continuation(spec, Millis(9)).await.unwrap();
    assert_eq!(first, adopted, "ensuring twice adopts the first record");
    let token = &spec.token;
    let a = ToolResult::text("a");
    assert_eq!(
        store
            .complete_continuation(token, &a, "alice", Millis(10))
            .await
            .unwrap(),
        WriteOnce::Recorded
    );
    assert_eq!(
        store
            .complete_continuation(token, &a, "bob", Millis(11))
            .await
            .unwrap(),
        WriteOnce::AlreadySame {
            by: "alice".into(),
            at: Millis(10)
        }
    );
    assert_eq!(
        store
            .complete_continuation(token, &ToolResult::text("b"), "bob", Millis(11))
            .await
            .unwrap(),
        WriteOnce::AlreadyDifferent {
            by: "alice".into(),
            at: Millis(10)
        }
    );
    let rec = store.get_continuation(token).await.unwrap().unwrap();
    assert_eq!(rec.result, Some(a));
    let unknown = ContinuationToken("nope".into());
    assert!(matches!(
        store
            .complete_continuation(&unknown, &ToolResult::text("x"), "x", Millis(1))
            .await,
        Err(StoreError::UnknownToken(_))
    ));
    let d = |approved| Decision {
        approved,
        by: "carol".into(),
        reason: None,
        at: Millis(3),
        arguments: None,
        raise: None,
    };
    assert_eq!(
        store.decide_continuation(token, &d(true)).await.unwrap(),
        WriteOnce::Recorded
    );
    assert!(matches!(
        store.decide_continuation(token, &d(false)).await.unwrap(),
        WriteOnce::AlreadyDifferent { .. }
    ));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_store_from_a_newer_build_is_refused() {
    let path = temp_db("newer");
    drop(SqliteStore::open(&path).unwrap());
    let c = Connection::open(&path).unwrap();
    c.pragma_update(None, "user_version", 99).unwrap();
    drop(c);
    let err = SqliteStore::open(&path).err().unwrap();
    assert!(err.to_string().contains("newer than this build"), "{err}");
    let _ = std::fs::remove_file(&path);
}

/// A session whose model asks `ask` three times; each call waits for
/// an approval (and then for a person).
fn approval_session() -> (Session, Vec<ContinuationSpec>) {
    let call = |i: u32| ToolCall {
        model_call_id: format!("m{i}"),
        name: "ask".into(),
        arguments: format!(r#"{{"q":{i}}}"#),
    };
    let turn = AgentTurn {
        text: None,
        tool_calls: vec![call(0), call(1), call(2)],
        usage: Default::default(),
        ..Default::default()
    };
    let approval = crate::core::Decorators {
        approval: true,
        ..Default::default()
    };
    asking_session("s2", approval, turn)
}

/// A store holding [`approval_session`] and its three continuations,
/// each waiting for an approval.
async fn approval_store(name: &str) -> (PathBuf, SqliteStore, Session, Vec<ContinuationSpec>) {
    let path = temp_db(name);
    let store = SqliteStore::open(&path).unwrap();
    let (session, specs) = approval_session();
    store
        .create_session(record(session.state().clone()))
        .await
        .unwrap();
    for spec in &specs {
        assert_eq!(spec.waiting_for, crate::core::WaitingFor::Approval);
        store.ensure_continuation(spec, Millis(3)).await.unwrap();
    }
    (path, store, session, specs)
}

/// The denial the tests below write for a call.
fn denial() -> Decision {
    Decision {
        approved: false,
        by: "carol".into(),
        reason: Some("not now".into()),
        at: Millis(5),
        arguments: None,
        raise: None,
    }
}

#[tokio::test]
async fn a_result_before_the_decision_is_refused_naming_the_approve_command() {
    let (path, store, _, specs) = approval_store("approval-undecided").await;
    let undecided = &specs[0].token;
    let err = store
        .complete_continuation(undecided, &ToolResult::text("blue"), "bob", Millis(4))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotAccepting { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("waits for an approval")
            && msg.contains(&format!("agents session approve {undecided}")),
        "{msg}"
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn a_denied_call_refuses_a_persons_result_but_takes_the_cores_denial() {
    let (path, store, mut session, specs) = approval_store("approval-denied").await;
    let denied = &specs[0].token;
    let deny = denial();
    store.decide_continuation(denied, &deny).await.unwrap();
    let err = store
        .complete_continuation(denied, &ToolResult::text("blue"), "bob", Millis(6))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("denied by carol") && err.to_string().contains("takes no result"),
        "{err}"
    );
    // The engine's own record of the denial is taken: feed the decision
    // to the core and write the result it asks to record.
    session
        .handle(
            Event::Decide {
                token: denied.clone(),
                approved: false,
                by: deny.by.clone(),
                reason: deny.reason.clone(),
                arguments: None,
            },
            Millis(7),
        )
        .unwrap();
    let (result, by) = std::iter::from_fn(|| session.poll_action())
        .find_map(|a| match a {
            Action::RecordResult { token, result, by } if &token == denied => Some((result, by)),
            _ => None,
        })
        .expect("the core records the denial");
    assert_eq!(
        result,
        crate::store::denial_result(&deny),
        "the store knows the core's denial text"
    );
    assert_eq!(
        store
            .complete_continuation(denied, &result, &by, Millis(8))
            .await
            .unwrap(),
        WriteOnce::Recorded
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn an_approved_call_takes_a_persons_result() {
    let (path, store, _, specs) = approval_store("approval-approved").await;
    let approved = &specs[1].token;
    let approve = Decision {
        approved: true,
        ..denial()
    };
    store.decide_continuation(approved, &approve).await.unwrap();
    assert_eq!(
        store
            .complete_continuation(approved, &ToolResult::text("blue"), "bob", Millis(9))
            .await
            .unwrap(),
        WriteOnce::Recorded
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn the_engines_timeout_of_an_undecided_approval_is_recorded() {
    let (path, store, _, specs) = approval_store("approval-timeout").await;
    let timed_out = &specs[2].token;
    let timeout = ToolResult::error("timed out after 5s waiting for an approval");
    assert_eq!(
        store
            .complete_continuation(timed_out, &timeout, ENGINE_BY, Millis(10))
            .await
            .unwrap(),
        WriteOnce::Recorded
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn a_read_only_store_is_read_and_refuses_writes_by_name() {
    let path = temp_db("ro");
    let (state, specs) = waiting_session();
    let writer = SqliteStore::open(&path).unwrap();
    writer.create_session(record(state.clone())).await.unwrap();
    writer
        .ensure_continuation(&specs[0], Millis(3))
        .await
        .unwrap();

    // Beside a writer (its -shm exists): shares it and sees its commits.
    let shm = PathBuf::from(format!("{}-shm", path.display()));
    assert!(shm.exists());
    let reader = SqliteStore::open_read_only(&path).unwrap();
    assert!(reader.is_read_only());
    assert_eq!(reader.list_sessions().await.unwrap().len(), 1);
    let mut paused = record(state.clone());
    paused.state.paused = true;
    writer
        .save_session(&paused, &Version("1".into()))
        .await
        .unwrap();
    assert!(reader.list_sessions().await.unwrap()[0].paused);

    let err = reader
        .create_session(record(state.clone()))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::ReadOnly { .. }), "{err:?}");
    assert!(err.to_string().contains("read-only for this user"), "{err}");
    assert!(matches!(
        reader
            .complete_continuation(&specs[0].token, &ToolResult::text("x"), "bob", Millis(4))
            .await,
        Err(StoreError::ReadOnly { .. })
    ));
    drop(reader);
    drop(writer);

    // Nobody has it open: read as it is, and nothing is created beside it.
    assert!(!shm.exists());
    let reader = SqliteStore::open_read_only(&path).unwrap();
    let loaded = reader.load_session(&state.id).await.unwrap().unwrap();
    assert!(loaded.value.state.paused);
    assert_eq!(
        reader.session_continuations(&state.id).await.unwrap().len(),
        1
    );
    assert!(
        !shm.exists(),
        "a reader must not create files beside the store"
    );
    assert!(matches!(
        reader
            .cache_put(
                &crate::core::CacheKey {
                    tool: "t".into(),
                    arguments_sha256: "a".into()
                },
                &ToolResult::text("x"),
                Millis(1)
            )
            .await,
        Err(StoreError::ReadOnly { .. })
    ));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_missing_directory_is_named() {
    let dir = std::env::temp_dir().join(format!(
        "agents-nodir-{}-{}",
        std::process::id(),
        now_nanos()
    ));
    let path = dir.join("x/agents.db");
    let err = SqliteStore::open(&path).err().unwrap();
    assert!(matches!(err, StoreError::NoDirectory { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("does not exist") && msg.contains(&dir.join("x").display().to_string()),
        "{msg}"
    );
}
