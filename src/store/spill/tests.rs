use super::*;
use crate::api::stored::{session_state, session_status};
use crate::core::conversation::{AgentTurn, ToolResultEntry, UserTurn};
use crate::core::{CallId, Millis, SessionId, SessionState, ToolResult, Turn};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// A long conversation with one 5 MB result; each reply and the
/// result keep their times, archived and spilled with them.
fn long_state(turns: u32) -> SessionState {
    let mut s = SessionState::new(SessionId("long".into()));
    for i in 0..turns {
        s.turns.push(Turn::User(UserTurn {
            message: Some(format!("message {i}: {}", "words ".repeat(200))),
            tool_results: if i == 3 {
                vec![ToolResultEntry {
                    call_id: CallId::new(i, 0),
                    model_call_id: "m".into(),
                    tool: "dump".into(),
                    token: None,
                    // Barely compressible: a hex stream.
                    result: ToolResult::text(
                        (0..5_000_000u32 / 64)
                            .map(|n| sha256_hex(&n.to_be_bytes()))
                            .collect::<String>(),
                    ),
                    truncate_bytes: None,
                    started_at: Some(Millis(1_000 * i64::from(i))),
                    finished_at: Some(Millis(1_000 * i64::from(i) + 250)),
                }]
            } else {
                Vec::new()
            },
        }));
        s.turns.push(Turn::Agent(AgentTurn {
            text: Some(format!("answer {i}")),
            asked_at: Some(Millis(1_000 * i64::from(i) + 300)),
            replied_at: Some(Millis(1_000 * i64::from(i) + 900)),
            ..Default::default()
        }));
    }
    s.phase = crate::core::Phase::Succeeded;
    s
}

fn run<T>(f: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn a_long_session_with_a_huge_result_packs_small_and_comes_back_whole() {
    let state = long_state(300);
    let mut status = session_status(&state);
    let blobs = pack(&mut status, "long", STATUS_BUDGET_BYTES);
    let status_bytes = serde_json::to_vec(&status).unwrap().len();
    assert!(status_bytes <= STATUS_BUDGET_BYTES, "{status_bytes}");
    let largest = blobs.iter().map(|b| b.data.len()).max().unwrap();
    assert!(largest <= BLOB_BYTES, "{largest}");
    assert!(!status.archived_turns.is_empty());
    // Packing again gives the same blobs: nothing new to write.
    let mut again = session_status(&state);
    let blobs_again = pack(&mut again, "long", STATUS_BUDGET_BYTES);
    assert_eq!(blobs, blobs_again);
    let store: BTreeMap<String, Vec<u8>> = blobs.into_iter().map(|b| (b.name, b.data)).collect();
    let fetched = Mutex::new(0);
    run(unpack(&mut status, |name| {
        *fetched.lock().unwrap() += 1;
        let data = store.get(&name).cloned();
        async move { data.ok_or_else(|| format!("no blob {name}")) }
    }))
    .unwrap();
    assert_eq!(session_state(&state.id, &status).unwrap(), state);
}

#[test]
fn a_changed_blob_is_refused_by_its_checksum() {
    let state = long_state(5);
    let mut status = session_status(&state);
    let blobs = pack(&mut status, "s", STATUS_BUDGET_BYTES);
    assert!(!blobs.is_empty());
    let forged = gzip(b"{\"type\":\"text\",\"content\":\"forged\"}");
    let err = run(unpack(&mut status, |_| {
        let data = forged.clone();
        async move { Ok(data) }
    }))
    .unwrap_err();
    assert!(err.contains("checksum"), "{err}");
}

/// Incompressible text of `n` bytes: hex of hashes, numbered by `seed`.
fn noise(seed: u32, n: usize) -> String {
    let mut s = String::with_capacity(n + 64);
    let mut i = 0u32;
    while s.len() < n {
        s.push_str(&sha256_hex(&[seed.to_be_bytes(), i.to_be_bytes()].concat()));
        i += 1;
    }
    s.truncate(n);
    s
}

fn big_call(turn: u32, i: u32) -> crate::core::ToolCall {
    crate::core::ToolCall {
        model_call_id: format!("m{turn}-{i}"),
        name: "echo".into(),
        arguments: json!({ "text": noise(turn * 100 + i, 300_000) }).to_string(),
    }
}

/// Four agent turns, each with a 300 KB argument and 100 KB of text, and
/// an open turn whose calls carry the last turn's arguments.
fn chatty_state() -> SessionState {
    let mut s = SessionState::new(SessionId("chatty".into()));
    for turn in 1..=4u32 {
        s.turns.push(Turn::User(UserTurn {
            message: Some(format!("go on {turn}")),
            tool_results: Vec::new(),
        }));
        s.turns.push(Turn::Agent(AgentTurn {
            text: Some(noise(turn, 100_000)),
            tool_calls: vec![big_call(turn, 0)],
            ..Default::default()
        }));
    }
    s.open = Some(crate::core::session::PartialUserTurn {
        turn: 4,
        calls: vec![crate::core::TrackedToolCall::new(
            CallId::new(4, 0),
            big_call(4, 0),
            Default::default(),
        )],
    });
    s.phase = crate::core::Phase::RunningTools;
    s
}

/// `status` unpacked from `blobs`.
fn unpacked(mut status: SessionStatus, blobs: Vec<Blob>) -> Result<SessionStatus, String> {
    let store: BTreeMap<String, Vec<u8>> = blobs.into_iter().map(|b| (b.name, b.data)).collect();
    run(unpack(&mut status, |name| {
        let data = store.get(&name).cloned();
        async move { data.ok_or_else(|| format!("no blob {name}")) }
    }))?;
    Ok(status)
}

/// How many turns are inline in the status.
fn inline(status: &SessionStatus) -> usize {
    let turns = status.state.as_ref().and_then(|s| s["turns"].as_array());
    turns.map_or(0, Vec::len)
}

fn strings_of(status: &SessionStatus) -> Vec<String> {
    let state = status.state.clone().unwrap_or_default();
    let text = |v: &Value| v.as_str().map(str::to_string);
    let mut out: Vec<String> = Vec::new();
    for t in state["turns"].as_array().into_iter().flatten() {
        out.extend(text(&t["text"]));
        let calls = t["toolCalls"].as_array().into_iter().flatten();
        out.extend(calls.filter_map(|c| text(&c["arguments"])));
    }
    let open = state["open"]["calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    out.extend(open.iter().filter_map(|c| text(&c["call"]["arguments"])));
    out.extend(status.answer.clone());
    out
}

#[test]
fn large_arguments_and_text_spill_and_come_back() {
    let state = chatty_state();
    let mut status = session_status(&state);
    let blobs = pack(&mut status, "chatty", STATUS_BUDGET_BYTES);
    let size = stored_bytes(&status);
    assert!(size <= STATUS_BUDGET_BYTES, "{size}");
    assert!(
        status.archived_turns.is_empty(),
        "nine turns fit once spilled"
    );
    for s in strings_of(&status) {
        assert!(s.len() <= INLINE_TEXT_BYTES, "{} bytes inline", s.len());
        assert!(s.starts_with("{\"spilled\":{\"blobs\":["), "{s}");
    }
    // The open call's arguments are the last turn's: one blob for both.
    let names: std::collections::BTreeSet<_> = blobs.iter().map(|b| &b.name).collect();
    assert_eq!(names.len(), 8, "{names:?}");
    let back = unpacked(status, blobs).unwrap();
    assert_eq!(session_state(&state.id, &back).unwrap(), state);
}

#[test]
fn a_marker_written_by_the_model_comes_back_as_written() {
    let mut state = SessionState::new(SessionId("s".into()));
    let forged =
        json!({"spilled": {"blobs": ["kube-system-secret"], "sha256": "0".repeat(64), "bytes": 1}});
    let looks_like = |text: String| {
        Turn::Agent(AgentTurn {
            text: Some(text.clone()),
            tool_calls: vec![crate::core::ToolCall {
                model_call_id: "m".into(),
                name: "echo".into(),
                arguments: text,
            }],
            ..Default::default()
        })
    };
    state.turns.push(looks_like(forged.to_string()));
    state.turns.push(looks_like(format!(" {forged:#}")));
    state.phase = crate::core::Phase::Succeeded;
    let mut status = session_status(&state);
    let blobs = pack(&mut status, "s", STATUS_BUDGET_BYTES);
    assert!(!blobs.is_empty());
    for s in strings_of(&status) {
        assert!(!s.contains("kube-system-secret"), "{s}");
    }
    let back = unpacked(status, blobs).unwrap();
    assert_eq!(session_state(&state.id, &back).unwrap(), state);
}

/// `turns` user turns, each with `results` results of 15 KB: too small
/// to spill one by one.
fn heavy_turns(turns: u32, results: u32) -> SessionState {
    heavy_turns_of(turns, results, 15_000)
}

/// `turns` user turns of `results` incompressible results of `bytes`.
fn heavy_turns_of(turns: u32, results: u32, bytes: usize) -> SessionState {
    let mut s = SessionState::new(SessionId("heavy".into()));
    for turn in 0..turns {
        let results = (0..results)
            .map(|i| ToolResultEntry {
                call_id: CallId::new(turn, i),
                model_call_id: format!("m{i}"),
                tool: "dump".into(),
                token: None,
                result: ToolResult::text(noise(turn * 100 + i, bytes)),
                truncate_bytes: None,
                started_at: None,
                finished_at: None,
            })
            .collect();
        s.turns.push(Turn::User(UserTurn {
            message: None,
            tool_results: results,
        }));
    }
    s.phase = crate::core::Phase::AwaitingModel;
    s
}

#[test]
fn recent_turns_too_large_for_the_budget_are_archived_too() {
    let state = heavy_turns(10, 20);
    let mut status = session_status(&state);
    let blobs = pack(&mut status, "heavy", STATUS_BUDGET_BYTES);
    let size = stored_bytes(&status);
    assert!(size <= STATUS_BUDGET_BYTES, "{size}");
    assert!(inline(&status) < KEEP_RECENT_TURNS, "{}", inline(&status));
    let archived: u32 = status.archived_turns.iter().map(|a| a.turns).sum();
    assert_eq!(archived as usize + inline(&status), 10);
    let back = unpacked(status, blobs).unwrap();
    assert_eq!(session_state(&state.id, &back).unwrap(), state);
}

#[test]
fn a_growing_session_writes_each_chunk_of_old_turns_once() {
    let mut names = std::collections::BTreeSet::new();
    let mut blob_bytes = 0;
    let (mut most_status, mut last) = (0, None::<(SessionStatus, SessionState)>);
    let mut all = Vec::new();
    for turns in 1..=300 {
        let state = heavy_turns_of(turns, 1, 2_000);
        let mut status = session_status(&state);
        // As the store writes: over the status the last write stored.
        let earlier = last.as_ref().map(|(s, _)| s.archived_turns.clone());
        let blobs = pack_over(
            &mut status,
            "long",
            STATUS_BUDGET_BYTES,
            &earlier.unwrap_or_default(),
        );
        most_status = most_status.max(stored_bytes(&status));
        for blob in &blobs {
            if names.insert(blob.name.clone()) {
                blob_bytes += blob.data.len();
            }
        }
        all.extend(blobs);
        last = Some((status, state));
    }
    let (status, state) = last.unwrap();
    let chunks = status.archived_turns.len();
    assert!(chunks > 10, "{chunks} chunks");
    assert_eq!(
        (names.len(), all.len()),
        (chunks, chunks),
        "each archived chunk is one blob, compressed and written once for the session's life"
    );
    assert!(most_status <= STATUS_BUDGET_BYTES, "{most_status}");
    // Incompressible 2 KB results: what is stored stays near the turns' own size.
    assert!(blob_bytes < 300 * 2_300, "{blob_bytes} bytes of blobs");
    let back = unpacked(status, all).unwrap();
    assert_eq!(session_state(&state.id, &back).unwrap(), state);
}

#[test]
fn a_write_keeps_the_chunks_the_status_it_replaces_archived() {
    let earlier_state = heavy_turns_of(200, 1, 2_000);
    let mut earlier = session_status(&earlier_state);
    let earlier_blobs = pack(&mut earlier, "long", STATUS_BUDGET_BYTES);
    assert!(earlier.archived_turns.len() > 5);
    let state = heavy_turns_of(210, 1, 2_000);
    let mut fresh = session_status(&state);
    let fresh_blobs = pack(&mut fresh, "long", STATUS_BUDGET_BYTES);
    let mut kept = session_status(&state);
    let kept_blobs = pack_over(
        &mut kept,
        "long",
        STATUS_BUDGET_BYTES,
        &earlier.archived_turns,
    );
    // The same status as packing every turn again, without compressing
    // the earlier chunks again: only chunks completed since are blobs.
    assert_eq!(kept, fresh);
    let earlier_names: Vec<&String> = earlier_blobs.iter().map(|b| &b.name).collect();
    assert!(kept_blobs.iter().all(|b| !earlier_names.contains(&&b.name)));
    assert!(
        kept_blobs.len() < fresh_blobs.len(),
        "{} of {}",
        kept_blobs.len(),
        fresh_blobs.len()
    );
    let mut all = earlier_blobs;
    all.extend(kept_blobs);
    let back = unpacked(kept, all).unwrap();
    assert_eq!(session_state(&state.id, &back).unwrap(), state);
}

#[test]
fn earlier_chunks_that_do_not_describe_the_conversation_are_not_kept() {
    let mut earlier = session_status(&heavy_turns_of(200, 1, 2_000));
    pack(&mut earlier, "long", STATUS_BUDGET_BYTES);
    let chunks = earlier.archived_turns;
    let fewer_turns = heavy_turns_of(20, 1, 2_000);
    let mut gap = chunks.clone();
    gap.remove(0);
    let mut empty = chunks.clone();
    empty[0].blobs.clear();
    let cases = [
        (
            "more turns than the session has",
            &fewer_turns,
            chunks.clone(),
            "long",
        ),
        (
            "not from the first turn",
            &heavy_turns_of(210, 1, 2_000),
            gap,
            "long",
        ),
        (
            "another session's blobs",
            &heavy_turns_of(210, 1, 2_000),
            chunks.clone(),
            "other",
        ),
        (
            "a chunk without blobs",
            &heavy_turns_of(210, 1, 2_000),
            empty,
            "long",
        ),
    ];
    for (case, state, earlier, session) in cases {
        let mut fresh = session_status(state);
        let fresh_blobs = pack(&mut fresh, session, STATUS_BUDGET_BYTES);
        let mut packed = session_status(state);
        let blobs = pack_over(&mut packed, session, STATUS_BUDGET_BYTES, &earlier);
        assert_eq!(packed, fresh, "{case}");
        assert_eq!(blobs, fresh_blobs, "{case}");
    }
}

#[test]
fn recent_turns_stay_while_they_fit() {
    // Twelve turns of 5 KB: the oldest four go, eight fit.
    let state = heavy_turns_of(12, 1, 5_000);
    let mut status = session_status(&state);
    pack(&mut status, "heavy", STATUS_BUDGET_BYTES);
    assert!(!status.archived_turns.is_empty());
    assert_eq!(inline(&status), KEEP_RECENT_TURNS);
}

#[test]
fn a_large_spec_leaves_less_room_for_the_status() {
    let roomy = Budget::beside(2_000, 1_000);
    assert_eq!(
        (roomy.target, roomy.limit),
        (STATUS_BUDGET_BYTES, MAX_STATUS_BYTES)
    );
    let tight = Budget::beside(1_500_000, 2_000);
    assert_eq!(tight.limit, MAX_OBJECT_BYTES - 1_502_000);
    assert_eq!(tight.target, tight.limit);
    // The heavy turns pack into what the spec leaves, archiving all.
    let state = heavy_turns(10, 20);
    let mut status = session_status(&state);
    let blobs = pack(&mut status, "heavy", tight.target);
    let size = stored_bytes(&status);
    assert!(tight.admit(size).is_ok(), "{size} > {}", tight.limit);
    assert_eq!(inline(&status), 0);
    let back = unpacked(status, blobs).unwrap();
    assert_eq!(session_state(&state.id, &back).unwrap(), state);
}

#[test]
fn a_spec_that_leaves_no_room_is_refused_saying_so() {
    let full = Budget::beside(1_539_500, 900);
    let mut status = session_status(&heavy_turns(1, 20));
    pack(&mut status, "heavy", full.target);
    let why = full.admit(stored_bytes(&status)).unwrap_err();
    assert!(why.contains("its spec takes 1539500 bytes"), "{why}");
    assert!(why.contains("Make the spec smaller"), "{why}");
    let why = Budget::beside(1_000, 900)
        .admit(MAX_STATUS_BYTES + 1)
        .unwrap_err();
    assert!(!why.contains("Make the spec smaller"), "{why}");
}

#[test]
fn stored_size_counts_what_go_escapes() {
    assert_eq!(stored_bytes("a<b>&"), "\"a<b>&\"".len() + 3 * 5);
    assert_eq!(stored_bytes("\u{2028}"), 2 + 3 + 3);
    assert_eq!(stored_bytes("\u{8}\n"), "\"\\b\\n\"".len());
}

#[test]
fn small_sessions_are_left_alone() {
    let state = long_state(2);
    let mut status = session_status(&state);
    // (turn 3 holds the large result; two turns have none)
    let before = status.clone();
    assert!(pack(&mut status, "s", STATUS_BUDGET_BYTES).is_empty());
    assert_eq!(status, before);
}

#[test]
fn an_archived_chunk_whose_counts_do_not_match_its_turns_is_refused() {
    let state = heavy_turns_of(200, 1, 2_000);
    let mut packed = session_status(&state);
    let blobs = pack(&mut packed, "long", STATUS_BUDGET_BYTES);
    assert!(packed.archived_turns.len() > 2);
    let mut wrong_count = packed.clone();
    wrong_count.archived_turns[0].turns += 1;
    let mut wrong_start = packed.clone();
    wrong_start.archived_turns[1].first_turn += 1;
    for forged in [wrong_count, wrong_start] {
        let err = unpacked(forged, blobs.clone()).unwrap_err();
        assert!(err.contains("but hold"), "{err}");
    }
    assert!(unpacked(packed, blobs).is_ok());
}

/// The API server stores `status.state` as written, so a hand edit may
/// leave `turns` something other than a list: read as no turns, it would
/// start the conversation over (the model asked again, the tools run
/// again). It is refused, saying what is wrong; absent, it is no turns.
#[test]
fn turns_that_are_not_a_list_are_refused() {
    let state = heavy_turns_of(200, 1, 2_000);
    let mut packed = session_status(&state);
    let blobs = pack(&mut packed, "long", STATUS_BUDGET_BYTES);
    for (turns, kind) in [(json!("nope"), "a string"), (json!({"0": {}}), "an object")] {
        let mut forged = packed.clone();
        forged.state.as_mut().unwrap()["turns"] = turns;
        let err = unpacked(forged, blobs.clone()).unwrap_err();
        assert!(
            err.contains(&format!("status.state.turns is {kind}")),
            "{err}"
        );
    }
    let mut all_archived = packed.clone();
    let inline = all_archived.state.as_mut().unwrap()["turns"].take();
    all_archived
        .state
        .as_mut()
        .unwrap()
        .as_object_mut()
        .unwrap()
        .remove("turns");
    let unpacked_all = unpacked(all_archived, blobs.clone()).unwrap();
    let archived_count = state.turns.len() - inline.as_array().unwrap().len();
    let read = unpacked_all.state.as_ref().unwrap()["turns"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(read, archived_count);
    assert!(unpacked(packed, blobs).is_ok());
}

/// Whatever shape a hand edit gives `status.state` (the API server no
/// longer checks it), reading it back refuses it with an error: it never
/// panics the operator, and never reads as another conversation.
#[test]
fn a_state_of_any_shape_is_read_or_refused_never_a_panic() {
    let state = heavy_turns_of(3, 1, 100);
    let good = session_status(&state);
    let shapes = [
        json!({"turns": [1, "x", null]}),
        json!({"turns": [{"role": "agent", "toolCalls": "x"}]}),
        json!({"turns": [{"role": "agent", "toolCalls": [3]}, {"role": "user", "toolResults": [7, {"callId": "t1-c0"}]}]}),
        json!({"turns": [{"role": "user", "toolResults": {"a": 1}}]}),
        json!({"open": {"turn": 1, "calls": [1, {"id": "t9-c9"}]}}),
        json!({"open": "x"}),
        json!({"open": {"calls": "x"}}),
        json!({"inbox": 3, "turns": []}),
        json!({"phase": 7}),
        json!({"turns": [{"role": "agent", "text": {"spilled": "x"}}]}),
        json!({"turns": [{"role": "user", "toolResults": [{"callId": "t1-c0", "result": {"spilled": 1}}]}]}),
    ];
    for shape in shapes {
        let mut forged = good.clone();
        forged.state = Some(shape.clone());
        let read = unpacked(forged, Vec::new())
            .and_then(|s| session_state(&state.id, &s).map_err(|e| e.to_string()));
        assert!(read.is_err(), "{shape} was read as {read:?}");
    }
}
