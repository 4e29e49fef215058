use super::*;

fn continuation(name: &str, session: &str, version: &str) -> Continuation {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "agents-exe.io/v1",
        "kind": "Continuation",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": version,
            "labels": {SESSION_LABEL: session},
        },
        "spec": {
            "session": session,
            "turn": 1,
            "callId": "t1-c0",
            "toolCall": {"modelCallId": "m0", "name": "deploy", "arguments": "{}"},
            "policy": {"disposition": "defer"},
            "context": {"session": session, "turn": 1, "callId": "t1-c0", "idempotencyKey": "k"},
        },
    }))
    .expect("a valid Continuation")
}

fn synced(objects: &[Continuation]) -> WatchedContinuations {
    let w = WatchedContinuations::default();
    w.apply(&Event::Init);
    for c in objects {
        w.apply(&Event::InitApply(c.clone()));
    }
    w.apply(&Event::InitDone);
    w
}

fn versions(w: &WatchedContinuations, session: &str) -> Option<Vec<String>> {
    let listed = w.labelled("ns", session)?;
    Some(listed.iter().filter_map(|c| c.resource_version()).collect())
}

#[test]
fn nothing_is_trusted_before_the_first_list_is_in() {
    let w = WatchedContinuations::default();
    w.apply(&Event::Init);
    w.apply(&Event::InitApply(continuation("a", "s", "1")));
    assert_eq!(versions(&w, "s"), None, "the list is not complete yet");
    w.apply(&Event::InitDone);
    assert_eq!(versions(&w, "s"), Some(vec!["1".into()]));
    assert_eq!(versions(&w, "other"), Some(vec![]), "synced: none is none");
}

#[test]
fn an_own_copy_stands_in_until_the_watch_shows_its_newest_version() {
    let w = synced(&[]);
    w.note_live(&continuation("a", "s", "1"), None);
    assert_eq!(versions(&w, "s"), Some(vec!["1".into()]), "created here");
    w.note_live(&continuation("a", "s", "2"), Some("1"));
    assert_eq!(versions(&w, "s"), Some(vec!["2".into()]), "then patched");
    w.apply(&Event::Apply(continuation("a", "s", "1")));
    assert_eq!(
        versions(&w, "s"),
        Some(vec!["2".into()]),
        "the watch shows an older one of ours"
    );
    w.apply(&Event::Apply(continuation("a", "s", "2")));
    assert_eq!(versions(&w, "s"), Some(vec!["2".into()]));
    assert!(w.0.lock().unwrap().pending.is_empty(), "caught up");
    assert_eq!(versions(&w, "t"), Some(vec![]), "other sessions untouched");
}

#[test]
fn a_version_this_process_never_got_sends_the_session_to_the_api() {
    let w = synced(&[]);
    w.note_live(&continuation("a", "s", "1"), None);
    w.apply(&Event::Apply(continuation("a", "s", "9")));
    assert_eq!(versions(&w, "s"), None, "9 or ours: which is newer?");
    w.note_listed("ns", "s", &[continuation("a", "s", "9")]);
    assert_eq!(
        versions(&w, "s"),
        Some(vec!["9".into()]),
        "the server says 9"
    );
}

#[test]
fn a_write_on_the_cached_version_keeps_its_copy_in_the_view() {
    let w = synced(&[continuation("a", "s", "5")]);
    w.note_live(&continuation("a", "s", "7"), Some("5"));
    assert_eq!(versions(&w, "s"), Some(vec!["7".into()]));
    w.note_live(&continuation("b", "s", "3"), None);
    assert_eq!(
        versions(&w, "s"),
        Some(vec!["7".into(), "3".into()]),
        "a new one beside it"
    );
}

#[test]
fn an_own_write_the_watch_showed_first_is_not_pending() {
    let w = synced(&[]);
    w.apply(&Event::Apply(continuation("a", "s", "7")));
    w.note_live(&continuation("a", "s", "7"), None);
    assert_eq!(versions(&w, "s"), Some(vec!["7".into()]));
    assert!(w.0.lock().unwrap().pending.is_empty());
}

#[test]
fn a_read_ends_a_pending_entry_the_watch_skipped() {
    // Written as 7, then by someone else as 8; a relist showed only 8.
    let w = synced(&[continuation("a", "s", "5")]);
    w.note_live(&continuation("a", "s", "7"), Some("5"));
    w.apply(&Event::Init);
    w.apply(&Event::InitApply(continuation("a", "s", "8")));
    w.apply(&Event::InitDone);
    assert_eq!(versions(&w, "s"), None, "7 was never shown");
    w.note_listed("ns", "s", &[continuation("a", "s", "8")]);
    assert_eq!(
        versions(&w, "s"),
        Some(vec!["8".into()]),
        "the server holds what the cache holds"
    );
}

#[test]
fn a_read_newer_than_the_cache_waits_for_the_watch() {
    let w = synced(&[continuation("a", "s", "5")]);
    w.note_live(&continuation("a", "s", "7"), None);
    assert_eq!(versions(&w, "s"), None, "read, not written: 5 may be newer");
    w.note_listed("ns", "s", &[continuation("a", "s", "9")]);
    assert_eq!(versions(&w, "s"), None, "the cache is behind 9");
    w.apply(&Event::Apply(continuation("a", "s", "7")));
    assert_eq!(versions(&w, "s"), None, "still behind 9");
    w.apply(&Event::Apply(continuation("a", "s", "9")));
    assert_eq!(versions(&w, "s"), Some(vec!["9".into()]));
}

#[test]
fn a_relist_that_misses_a_pending_object_sends_its_session_to_the_api() {
    let w = synced(&[]);
    w.note_live(&continuation("a", "s", "1"), None);
    w.apply(&Event::Init);
    w.apply(&Event::InitDone);
    assert_eq!(versions(&w, "s"), None, "deleted meanwhile?");
    w.note_listed("ns", "s", &[]);
    assert_eq!(versions(&w, "s"), Some(vec![]), "gone");
}

#[test]
fn a_deleted_continuation_leaves_the_cache_and_ends_its_pending_entry() {
    let w = synced(&[continuation("a", "s", "5"), continuation("b", "s", "5")]);
    w.note_live(&continuation("a", "s", "6"), Some("5"));
    w.apply(&Event::Delete(continuation("a", "s", "6")));
    assert_eq!(versions(&w, "s"), Some(vec!["5".into()]));
    w.note_live(&continuation("b", "s", "6"), None);
    w.note_listed("ns", "s", &[]);
    assert_eq!(
        versions(&w, "s"),
        Some(vec!["5".into()]),
        "not listed by the server: no longer pending (the watch's delete is on its way)"
    );
}

#[test]
fn an_object_too_large_to_keep_sends_its_session_to_the_api() {
    let mut big = continuation("a", "s", "1");
    big.metadata.annotations = Some([("x".to_string(), "y".repeat(KEPT_OBJECT_BYTES))].into());
    let w = synced(&[big, continuation("b", "t", "1")]);
    assert_eq!(versions(&w, "s"), None);
    assert_eq!(versions(&w, "t"), Some(vec!["1".into()]));
    w.apply(&Event::Apply(continuation("a", "s", "2")));
    assert_eq!(versions(&w, "s"), Some(vec!["2".into()]), "small again");
    assert!(
        w.0.lock().unwrap().bytes < 4096,
        "the bytes follow the objects"
    );
}

#[test]
fn kept_copies_drop_managed_fields() {
    let mut c = continuation("a", "s", "1");
    c.metadata.managed_fields = Some(vec![Default::default()]);
    let w = synced(&[c]);
    let kept = w.labelled("ns", "s").unwrap();
    assert!(kept[0].metadata.managed_fields.is_none());
}
