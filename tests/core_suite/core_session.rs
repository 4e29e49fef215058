//! The core's behaviour through its public API: the requested flow, wake,
//! cache, approval, retries, timeouts, bad input and determinism.

use agents::core::call::WaitingFor;
use agents::core::envelope::ResultEnvelope;
use agents::core::policy::{Decorators, Rule};
use agents::core::session::{ContinuationSpec, ToolInfo};
use agents::core::*;
use std::collections::BTreeMap;

const T0: Millis = Millis(1_700_000_000_000);

fn call(id: &str, name: &str, args: &str) -> ToolCall {
    ToolCall {
        model_call_id: id.into(),
        name: name.into(),
        arguments: args.into(),
    }
}

fn rule(tool: &str, disposition: Disposition, decorators: Decorators) -> Rule {
    Rule {
        tool: tool.into(),
        disposition,
        decorators,
    }
}

/// lookup runs now; send_email waits for a human; bash runs isolated.
fn config() -> SessionConfig {
    let mut tools = BTreeMap::new();
    for t in ["lookup", "send_email", "bash", "search"] {
        tools.insert(t.to_string(), ToolInfo::default());
    }
    SessionConfig {
        agent: Some("helper".into()),
        policy: Policy {
            default: Disposition::RunSync,
            default_decorators: Decorators::default(),
            rules: vec![
                rule(
                    "send_*",
                    Disposition::Defer {
                        reason: "a human sends mail".into(),
                    },
                    Decorators::default(),
                ),
                rule(
                    "bash",
                    Disposition::RunIsolated {
                        spec: IsolationSpec {
                            image: "agents.local/busybox:ci".into(),
                            command: vec!["/bin/sh".into()],
                            ..Default::default()
                        },
                    },
                    Decorators::default(),
                ),
            ],
        },
        tools,
        limits: Limits::default(),
        context_has_secrets: false,
        ..SessionConfig::default()
    }
}

fn drain(s: &mut Session) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

fn three_calls() -> AgentTurn {
    AgentTurn {
        text: None,
        tool_calls: vec![
            call("m-1", "lookup", r#"{"key":"weather"}"#),
            call("m-2", "send_email", r#"{"to":"ops@example.org"}"#),
            call("m-3", "bash", r#"{"cmd":"uptime"}"#),
        ],
        usage: TokenUsage {
            prompt_tokens: 10,
            completion_tokens: 5,
            ..TokenUsage::default()
        },
        ..Default::default()
    }
}

fn started(config: SessionConfig) -> Session {
    let mut s = Session::new(SessionId("demo".into()), config);
    s.handle(
        Event::UserMessage {
            text: "What is up?".into(),
        },
        T0,
    )
    .unwrap();
    // The model call is claimed in a checkpoint before it starts.
    assert_eq!(
        drain(&mut s),
        vec![Action::Checkpoint, Action::CallModel { turn: 1 }]
    );
    s
}

/// The model answers with `calls` at T0.
fn reply(s: &mut Session, calls: Vec<ToolCall>) {
    s.handle(
        Event::ModelReplied {
            turn: AgentTurn {
                tool_calls: calls,
                ..Default::default()
            },
        },
        T0,
    )
    .unwrap();
}

fn token(call: &str) -> ContinuationToken {
    ContinuationToken(format!("demo-{call}"))
}

fn tool_results(state: &SessionState) -> Vec<(String, ToolResult)> {
    match state.turns.last() {
        Some(Turn::User(u)) => u
            .tool_results
            .iter()
            .map(|r| (r.model_call_id.clone(), r.result.clone()))
            .collect(),
        other => panic!("expected a user turn, got {other:?}"),
    }
}

#[test]
fn requested_flow_one_sync_two_deferred_survives_a_restart() {
    let mut s = started(config());
    s.handle(
        Event::ModelReplied {
            turn: three_calls(),
        },
        T0,
    )
    .unwrap();
    let actions = drain(&mut s);
    assert_eq!(actions[0], Action::Checkpoint, "agent turn is stored first");
    let run_tool = actions
        .iter()
        .filter(|a| matches!(a, Action::RunTool { .. }))
        .count();
    assert_eq!(run_tool, 1, "{actions:#?}");
    let ensured: Vec<&ContinuationSpec> = actions
        .iter()
        .filter_map(|a| match a {
            Action::EnsureContinuation(c) => Some(c),
            _ => None,
        })
        .collect();
    assert_eq!(ensured.len(), 2);
    assert_eq!(ensured[0].waiting_for, WaitingFor::External);
    assert_eq!(ensured[0].reason.as_deref(), Some("a human sends mail"));
    assert_eq!(ensured[1].waiting_for, WaitingFor::Isolated);
    assert!(actions
        .iter()
        .any(|a| matches!(a, Action::LaunchIsolated { spec, .. } if spec.image == "agents.local/busybox:ci")));
    assert_eq!(s.state().phase, Phase::RunningTools);

    // The sync call finishes; every remaining call is deferred: yield.
    s.handle(
        Event::ToolFinished {
            call: CallId::new(1, 0),
            result: ToolResult::text("sunny"),
            from_cache: false,
        },
        T0,
    )
    .unwrap();
    let actions = drain(&mut s);
    assert_eq!(
        actions.last(),
        Some(&Action::Yield {
            pending: vec![token("t1-c1"), token("t1-c2")]
        })
    );
    assert_eq!(s.state().phase, Phase::Waiting);

    // Persist, drop everything, restore (the "operator killed" moment).
    let stored = serde_json::to_string(s.state()).unwrap();
    drop(s);
    let state: SessionState = serde_json::from_str(&stored).unwrap();
    let mut s = Session::restore(state, config(), T0.plus_secs(60));
    let rederived = drain(&mut s);
    assert!(
        rederived
            .iter()
            .filter(|a| matches!(a, Action::EnsureContinuation(_)))
            .count()
            == 2,
        "a restart re-ensures both continuations: {rederived:#?}"
    );

    // Results arrive in the opposite order of the calls.
    let isolated = ResultEnvelope::parse_for(
        &serde_json::to_string(&ResultEnvelope::from_result(
            token("t1-c2"),
            &ToolResult::text(" 10:00 up 3 days"),
        ))
        .unwrap(),
        &token("t1-c2"),
    )
    .unwrap();
    let outcomes = s.wake_many(
        vec![
            (token("t1-c2"), isolated.clone()),
            (token("t1-c1"), ToolResult::text("sent")),
        ],
        "alice",
        T0.plus_secs(61),
    );
    assert!(outcomes
        .iter()
        .all(|(_, o)| o.as_ref() == Ok(&WakeOutcome::Applied)));
    let actions = drain(&mut s);
    assert_eq!(actions.last(), Some(&Action::CallModel { turn: 2 }));
    assert_eq!(s.state().phase, Phase::AwaitingModel);
    assert!(s.state().open.is_none());
    assert_eq!(
        tool_results(s.state()),
        vec![
            ("m-1".to_string(), ToolResult::text("sunny")),
            ("m-2".to_string(), ToolResult::text("sent")),
            ("m-3".to_string(), isolated),
        ],
        "all three results, in the model's call order"
    );

    s.handle(
        Event::ModelReplied {
            turn: AgentTurn {
                text: Some("All done.".into()),
                ..Default::default()
            },
        },
        T0.plus_secs(62),
    )
    .unwrap();
    assert_eq!(
        drain(&mut s),
        vec![
            Action::Checkpoint,
            Action::Finished {
                answer: "All done.".into()
            }
        ]
    );
    assert_eq!(s.state().phase, Phase::Succeeded);
    assert_eq!(s.state().usage.total(), 15);
}

#[test]
fn isolated_attempts_retry_with_backoff_then_record() {
    let mut cfg = config();
    cfg.policy.rules[1].decorators.retries = 1;
    let mut s = started(cfg);
    reply(&mut s, vec![call("m", "bash", "{}")]);
    drain(&mut s);
    let t = token("t1-c0");
    let out = s
        .handle(
            Event::AttemptFinished {
                token: t.clone(),
                attempt: 1,
                result: ToolResult::error("exit 1"),
            },
            T0,
        )
        .unwrap();
    assert_eq!(out, Handled::Wake(WakeOutcome::Applied));
    assert_eq!(s.poll_timeout(), Some(T0.plus_secs(1)));
    assert!(drain(&mut s).is_empty());
    s.handle(Event::Tick, T0.plus_millis(999)).unwrap();
    assert!(drain(&mut s)
        .iter()
        .all(|a| !matches!(a, Action::LaunchIsolated { .. })));
    s.handle(Event::Tick, T0.plus_secs(1)).unwrap();
    let relaunch = drain(&mut s);
    assert!(relaunch
        .iter()
        .any(|a| matches!(a, Action::LaunchIsolated { attempt: 2, .. })));
    // A late answer from the first attempt is ignored.
    assert_eq!(
        s.handle(
            Event::AttemptFinished {
                token: t.clone(),
                attempt: 1,
                result: ToolResult::text("stale"),
            },
            T0.plus_secs(2),
        )
        .unwrap(),
        Handled::Wake(WakeOutcome::AlreadyCompleted)
    );
    s.handle(
        Event::AttemptFinished {
            token: t.clone(),
            attempt: 2,
            result: ToolResult::error("exit 2"),
        },
        T0.plus_secs(3),
    )
    .unwrap();
    let actions = drain(&mut s);
    assert!(actions.contains(&Action::RecordResult {
        token: t,
        result: ToolResult::error("exit 2"),
        by: "agents".into()
    }));
    assert_eq!(
        tool_results(s.state()),
        vec![("m".to_string(), ToolResult::error("exit 2"))]
    );
}

#[test]
fn sync_calls_retry_then_fail_and_the_model_hears_the_error() {
    let mut cfg = config();
    cfg.policy.default_decorators.retries = 2;
    let mut s = started(cfg);
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    let mut now = T0;
    for attempt in 1..=3u32 {
        s.handle(
            Event::ToolFinished {
                call: CallId::new(1, 0),
                result: ToolResult::error(format!("boom {attempt}")),
                from_cache: false,
            },
            now,
        )
        .unwrap();
        let actions = drain(&mut s);
        if attempt < 3 {
            let at = s.poll_timeout().expect("a retry is scheduled");
            assert_eq!(at.0 - now.0, 1000 << (attempt - 1));
            now = at;
            s.handle(Event::Tick, now).unwrap();
            assert!(drain(&mut s)
                .iter()
                .any(|a| matches!(a, Action::RunTool { attempt: n, .. } if *n == attempt + 1)));
        } else {
            assert_eq!(actions.last(), Some(&Action::CallModel { turn: 2 }));
        }
    }
    assert_eq!(
        tool_results(s.state()),
        vec![("m".to_string(), ToolResult::error("boom 3"))]
    );
}

#[test]
fn approval_then_run_and_denial_is_fed_back() {
    let mut cfg = config();
    cfg.policy.rules.insert(
        0,
        rule(
            "lookup",
            Disposition::RunSync,
            Decorators {
                approval: true,
                ..Default::default()
            },
        ),
    );
    cfg.policy.rules.insert(
        0,
        rule(
            "search",
            Disposition::RunAsync,
            Decorators {
                approval: true,
                ..Default::default()
            },
        ),
    );
    let mut s = started(cfg);
    reply(
        &mut s,
        vec![call("a", "lookup", "{}"), call("b", "search", "{}")],
    );
    let actions = drain(&mut s);
    assert_eq!(
        actions.last(),
        Some(&Action::Yield {
            pending: vec![token("t1-c0"), token("t1-c1")]
        })
    );
    assert!(s
        .state()
        .pending()
        .iter()
        .all(|c| c.waiting_for() == Some(WaitingFor::Approval)));

    let approve = |s: &mut Session, t: &str, ok: bool| {
        s.handle(
            Event::Decide {
                token: token(t),
                approved: ok,
                by: "bob".into(),
                reason: (!ok).then(|| "not today".to_string()),
                arguments: None,
            },
            T0,
        )
    };
    assert_eq!(
        approve(&mut s, "t1-c0", true),
        Ok(Handled::Wake(WakeOutcome::Applied))
    );
    let actions = drain(&mut s);
    assert_eq!(actions[0], Action::Checkpoint, "the run is claimed first");
    assert!(matches!(actions[1], Action::RunTool { .. }), "{actions:?}");
    // Approving twice is harmless; reversing a decision is refused.
    assert_eq!(
        approve(&mut s, "t1-c0", true),
        Ok(Handled::Wake(WakeOutcome::AlreadyCompleted))
    );
    let err = approve(&mut s, "t1-c0", false).unwrap_err();
    assert!(err.to_string().contains("already approved"), "{err}");

    assert_eq!(
        approve(&mut s, "t1-c1", false),
        Ok(Handled::Wake(WakeOutcome::Applied))
    );
    s.handle(
        Event::ToolFinished {
            call: CallId::new(1, 0),
            result: ToolResult::text("ok"),
            from_cache: false,
        },
        T0,
    )
    .unwrap();
    assert_eq!(
        tool_results(s.state()),
        vec![
            ("a".to_string(), ToolResult::text("ok")),
            (
                "b".to_string(),
                ToolResult::error("denied by bob: not today")
            ),
        ]
    );
    assert_eq!(
        approve(&mut s, "t1-c9", true),
        Ok(Handled::Wake(WakeOutcome::Unknown))
    );
}

#[test]
fn cache_hit_resolves_a_deferred_call_on_resume() {
    // The product serves from the cache only calls that run by themselves
    // (runAsync, runIsolated): the continuation carries the key, the driver
    // finds a hit and wakes the call as `cache` instead of launching it.
    let mut cfg = config();
    cfg.policy.rules[1].decorators.cache = true;
    let mut s = started(cfg.clone());
    reply(&mut s, vec![call("m", "bash", r#"{"cmd":"uptime"}"#)]);
    let key = drain(&mut s)
        .into_iter()
        .find_map(|a| match a {
            Action::EnsureContinuation(c) => c.cache_key,
            _ => None,
        })
        .expect("cacheable continuation carries its key");

    // After a restart the same key comes back with the continuation.
    let restored = Session::restore(s.state().clone(), cfg, T0.plus_secs(5));
    let mut s = restored;
    let again = drain(&mut s);
    let key_again = again.iter().find_map(|a| match a {
        Action::EnsureContinuation(c) => c.cache_key.clone(),
        _ => None,
    });
    assert_eq!(key_again, Some(key));
    let out = s
        .handle(
            Event::Wake {
                token: token("t1-c0"),
                result: ToolResult::text("up 3 days"),
                by: "cache".into(),
            },
            T0.plus_secs(5),
        )
        .unwrap();
    assert_eq!(out, Handled::Wake(WakeOutcome::Applied));
    assert_eq!(s.state().phase, Phase::AwaitingModel);
    // The launch queued before the hit is stale now: a driver skips it.
    assert!(again
        .iter()
        .filter(|a| matches!(a, Action::LaunchIsolated { .. }))
        .all(|a| !s.is_current(a)));
}

#[test]
fn a_result_never_preempts_an_approval() {
    let mut cfg = config();
    cfg.policy.default_decorators.approval = true;
    let mut s = started(cfg);
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    let before = s.state().clone();
    let err = s
        .handle(
            Event::Wake {
                token: token("t1-c0"),
                result: ToolResult::text("sneaked in"),
                by: "mallory".into(),
            },
            T0,
        )
        .unwrap_err();
    assert!(err.to_string().contains("waits for an approval"), "{err}");
    assert_eq!(s.state(), &before, "a refused result changes nothing");

    // Denied: the model hears the denial; a later outside result is refused.
    s.handle(
        Event::Decide {
            token: token("t1-c0"),
            approved: false,
            by: "bob".into(),
            reason: None,
            arguments: None,
        },
        T0,
    )
    .unwrap();
    let err = s
        .handle(
            Event::Wake {
                token: token("t1-c0"),
                result: ToolResult::text("ran anyway"),
                by: "mallory".into(),
            },
            T0,
        )
        .unwrap_err();
    assert!(err.to_string().contains("different result"), "{err}");
    match s.state().turns.last() {
        Some(Turn::User(u)) => assert!(u.tool_results[0].result.is_error()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_pause_drops_queued_starts_and_keeps_the_checkpoint() {
    let mut s = started(config());
    s.handle(
        Event::ModelReplied {
            turn: three_calls(),
        },
        T0,
    )
    .unwrap();
    // The queue holds starts (lookup runs, bash launches); a pause arrives
    // before the driver performed them.
    s.handle(Event::Pause, T0).unwrap();
    let actions = drain(&mut s);
    assert!(
        actions.iter().all(|a| !a.starts_work()),
        "no start survives a pause: {actions:?}"
    );
    assert!(actions.contains(&Action::Checkpoint), "{actions:?}");
    assert!(
        s.state()
            .open
            .iter()
            .flat_map(|o| o.calls.iter())
            .all(|c| c.claim().is_none()),
        "claims of dropped starts are released"
    );
    s.handle(Event::Resume, T0).unwrap();
    let actions = drain(&mut s);
    assert!(actions.iter().any(|a| matches!(a, Action::RunTool { .. })));
}

#[test]
fn the_core_counts_the_messages_it_took() {
    let mut s = Session::new(SessionId("demo".into()), config());
    for m in ["one", "two", "three"] {
        s.handle(Event::UserMessage { text: m.into() }, T0).unwrap();
    }
    assert_eq!(s.state().messages_taken, 3);
    // Every message present at the start reaches the first model call, each
    // as its own user turn, in order.
    let users: Vec<_> = s
        .state()
        .turns
        .iter()
        .filter_map(|t| match t {
            Turn::User(u) => u.message.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(users, ["one", "two", "three"]);
    assert_eq!(
        drain(&mut s),
        vec![Action::Checkpoint, Action::CallModel { turn: 1 }]
    );
}

#[test]
fn an_isolated_call_that_fails_ends_failed_and_the_model_hears_why() {
    let mut s = started(config());
    reply(&mut s, vec![call("m", "bash", r#"{"cmd":"false"}"#)]);
    drain(&mut s);
    s.handle(
        Event::AttemptFinished {
            token: token("t1-c0"),
            attempt: 1,
            result: ToolResult::error("exit status 1: no such file"),
        },
        T0,
    )
    .unwrap();
    let results = tool_results(s.state());
    assert_eq!(
        results,
        vec![(
            "m".to_string(),
            ToolResult::error("exit status 1: no such file")
        )]
    );
    // The closed turn keeps the failure; the state machine ended in Failed.
    let actions = drain(&mut s);
    assert!(actions
        .iter()
        .any(|a| matches!(a, Action::RecordResult { result, .. } if result.is_error())));
}

#[test]
fn claims_keep_a_second_driver_off_work_until_they_lapse() {
    let me = |name: &str| {
        let mut c = config();
        c.driver.holder = name.into();
        c
    };
    let mut a = Session::new(SessionId("demo".into()), me("a"));
    a.handle(Event::UserMessage { text: "hi".into() }, T0)
        .unwrap();
    assert_eq!(
        drain(&mut a),
        vec![Action::Checkpoint, Action::CallModel { turn: 1 }]
    );
    let claim = a
        .state()
        .model_attempt
        .claim()
        .cloned()
        .expect("the model call is claimed");
    assert_eq!(claim.holder, "a");
    // Driver b loads the checkpoint: it leaves the model call alone...
    let mut b = Session::restore(a.state().clone(), me("b"), T0.plus_secs(1));
    assert!(drain(&mut b).iter().all(|x| !x.starts_work()));
    assert_eq!(
        b.outlook(T0.plus_secs(1)),
        Outlook::Busy { at: claim.until },
        "b looks again when the claim lapses"
    );
    // ...until the claim lapses, or b learns that a is dead.
    let mut late = Session::restore(a.state().clone(), me("b"), claim.until);
    assert!(drain(&mut late).contains(&Action::CallModel { turn: 1 }));
    let mut dead = me("b");
    dead.driver.dead_holders.insert("a".into());
    let mut told = Session::restore(a.state().clone(), dead, T0.plus_secs(1));
    assert!(drain(&mut told).contains(&Action::CallModel { turn: 1 }));
}

#[test]
fn a_retry_runs_a_failed_model_step_again() {
    let mut cfg = config();
    cfg.model_retries = 0;
    let mut s = started(cfg);
    s.handle(
        Event::ModelFailed {
            error: "401 Unauthorized".into(),
            retryable: false,
            retry_after_ms: None,
        },
        T0,
    )
    .unwrap();
    assert_eq!(s.state().phase, Phase::Failed);
    drain(&mut s);
    s.handle(Event::Retry, T0).unwrap();
    assert_eq!(s.state().phase, Phase::AwaitingModel);
    assert_eq!(s.state().retries_taken, 1);
    assert!(drain(&mut s).contains(&Action::CallModel { turn: 1 }));
}

#[test]
fn results_over_the_agent_limit_are_cut_and_say_so() {
    let mut cfg = config();
    cfg.max_result_bytes = 10;
    let mut s = started(cfg);
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    s.handle(
        Event::ToolFinished {
            call: CallId::new(1, 0),
            result: ToolResult::text("0123456789abcdef"),
            from_cache: false,
        },
        T0,
    )
    .unwrap();
    let text = tool_results(s.state())[0].1.to_model_text();
    assert!(text.starts_with("0123456789\n[truncated"), "{text}");
    assert!(text.contains("10 of 16 bytes"), "{text}");
}

#[test]
fn completed_sync_calls_fill_the_cache_unless_secrets_are_involved() {
    for secrets in [false, true] {
        let mut cfg = config();
        cfg.policy.default_decorators.cache = true;
        cfg.context_has_secrets = secrets;
        let mut s = started(cfg);
        reply(&mut s, vec![call("m", "lookup", r#"{"k":1}"#)]);
        let run = drain(&mut s);
        let cache_key = run.iter().find_map(|a| match a {
            Action::RunTool { cache_key, .. } => Some(cache_key.clone()),
            _ => None,
        });
        assert_eq!(cache_key.unwrap().is_some(), !secrets);
        s.handle(
            Event::ToolFinished {
                call: CallId::new(1, 0),
                result: ToolResult::text("v"),
                from_cache: false,
            },
            T0,
        )
        .unwrap();
        let stored = drain(&mut s)
            .iter()
            .any(|a| matches!(a, Action::StoreCache { .. }));
        assert_eq!(stored, !secrets);
    }
}

#[test]
fn deferred_call_times_out_and_a_late_result_is_refused() {
    let mut cfg = config();
    cfg.policy.rules[0].decorators.timeout_seconds = Some(30);
    let mut s = started(cfg);
    reply(&mut s, vec![call("m", "send_email", "{}")]);
    drain(&mut s);
    assert_eq!(s.poll_timeout(), Some(T0.plus_secs(30)));
    s.handle(Event::Tick, T0.plus_secs(30)).unwrap();
    let actions = drain(&mut s);
    let timeout = ToolResult::error("timed out after 30s waiting for an outside result");
    assert!(actions.contains(&Action::RecordResult {
        token: token("t1-c0"),
        result: timeout.clone(),
        by: "agents".into()
    }));
    let err = s
        .handle(
            Event::Wake {
                token: token("t1-c0"),
                result: ToolResult::text("late"),
                by: "alice".into(),
            },
            T0.plus_secs(31),
        )
        .unwrap_err();
    assert!(matches!(err, CoreError::ConflictingResult { .. }));
    assert_eq!(tool_results(s.state()), vec![("m".to_string(), timeout)]);
}

#[test]
fn truncate_caps_results_and_redelivery_still_matches() {
    let mut cfg = config();
    cfg.policy.rules[0].decorators.truncate_bytes = Some(4);
    let mut s = started(cfg);
    reply(&mut s, vec![call("m", "send_email", "{}")]);
    let big = ToolResult::text("abcdefgh");
    let wake = |s: &mut Session, r: ToolResult| {
        s.handle(
            Event::Wake {
                token: token("t1-c0"),
                result: r,
                by: "w".into(),
            },
            T0,
        )
    };
    assert_eq!(
        wake(&mut s, big.clone()),
        Ok(Handled::Wake(WakeOutcome::Applied))
    );
    assert_eq!(
        tool_results(s.state())[0].1,
        ToolResult::text("abcd\n[truncated: showing 4 of 8 bytes]")
    );
    assert_eq!(
        wake(&mut s, big),
        Ok(Handled::Wake(WakeOutcome::AlreadyCompleted))
    );
}

/// An error is never spilled, so a huge one (a completer's 1 MiB message)
/// is cut before it enters the conversation, and a redelivery still
/// matches.
#[test]
fn huge_error_results_are_cut_to_a_bounded_size() {
    let mut s = started(config());
    reply(&mut s, vec![call("m", "send_email", "{}")]);
    let huge = ToolResult::error("x".repeat(1 << 20));
    let wake = |s: &mut Session, r: ToolResult| {
        s.handle(
            Event::Wake {
                token: token("t1-c0"),
                result: r,
                by: "w".into(),
            },
            T0,
        )
    };
    assert_eq!(
        wake(&mut s, huge.clone()),
        Ok(Handled::Wake(WakeOutcome::Applied))
    );
    let ToolResult::Error { message } = &tool_results(s.state())[0].1 else {
        panic!("an error stays an error");
    };
    assert!(message.len() < 9 * 1024, "{} bytes kept", message.len());
    assert!(message.ends_with(&format!("[truncated: showing 8192 of {} bytes]", 1 << 20)));
    assert_eq!(
        wake(&mut s, huge),
        Ok(Handled::Wake(WakeOutcome::AlreadyCompleted))
    );
}

/// A reply asking for more tool calls than the cap fails the session
/// before any of it is kept or run; one at the cap runs.
#[test]
fn a_reply_over_the_call_cap_fails_the_session() {
    let mut cfg = config();
    cfg.limits.max_calls_per_reply = Some(2);
    let mut s = started(cfg.clone());
    reply(
        &mut s,
        vec![
            call("m1", "lookup", "{}"),
            call("m2", "lookup", "{}"),
            call("m3", "lookup", "{}"),
        ],
    );
    assert_eq!(s.state().phase, Phase::Failed);
    let why = s.state().failure.clone().unwrap();
    assert!(
        why.contains("asked for 3 tool calls in one reply; at most 2"),
        "{why}"
    );
    assert_eq!(s.state().agent_turns, 0, "the reply was not kept");
    assert!(s.state().open.is_none());
    let mut fits = started(cfg);
    reply(
        &mut fits,
        vec![call("m1", "lookup", "{}"), call("m2", "lookup", "{}")],
    );
    assert_ne!(fits.state().phase, Phase::Failed);
}

#[test]
fn bad_input_is_reported_and_leaves_the_state_intact() {
    let mut s = started(config());
    s.handle(
        Event::ModelReplied {
            turn: AgentTurn {
                tool_calls: vec![
                    call("a", "lookup", "{not json"),
                    call("b", "rm_rf", "{}"),
                    call("c", "lookup", "[1,2]"),
                    call("d", "send_email", "{}"),
                ],
                ..Default::default()
            },
        },
        T0,
    )
    .unwrap();
    drain(&mut s);
    let results: Vec<(CallState, Option<ToolResult>)> = s
        .state()
        .open
        .as_ref()
        .unwrap()
        .calls
        .iter()
        .map(|c| (c.state(), c.result().cloned()))
        .collect();
    let msg = |i: usize| match &results[i].1 {
        Some(ToolResult::Error { message }) => message.clone(),
        other => panic!("call {i}: expected an error result, got {other:?}"),
    };
    assert!(msg(0).contains("not valid JSON"), "{}", msg(0));
    assert!(
        msg(1).contains("unknown tool \"rm_rf\"") && msg(1).contains("lookup"),
        "{}",
        msg(1)
    );
    assert!(
        msg(2).contains("must be a JSON object, got an array"),
        "{}",
        msg(2)
    );
    assert_eq!(results[3].0, CallState::Deferred);

    let before = s.state().clone();
    // Unknown token.
    assert_eq!(
        s.handle(
            Event::Wake {
                token: ContinuationToken("nope".into()),
                result: ToolResult::text("x"),
                by: "u".into()
            },
            T0
        ),
        Ok(Handled::Wake(WakeOutcome::Unknown))
    );
    // A result for a call that is not running here (illegal transition).
    let err = s
        .handle(
            Event::ToolFinished {
                call: CallId::new(1, 3),
                result: ToolResult::text("x"),
                from_cache: false,
            },
            T0,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "no running tool call t1-c3 in the open turn"
    );
    // A model reply nobody asked for.
    let err = s
        .handle(
            Event::ModelReplied {
                turn: AgentTurn::default(),
            },
            T0,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("while the session is Waiting"),
        "{err}"
    );
    // A runner result for a call that waits for a human.
    let err = s
        .handle(
            Event::AttemptFinished {
                token: token("t1-c3"),
                attempt: 0,
                result: ToolResult::text("x"),
            },
            T0,
        )
        .unwrap_err();
    assert!(err.to_string().contains("not waiting for"), "{err}");
    assert!(s
        .handle(Event::UserMessage { text: "  ".into() }, T0)
        .is_err());
    assert_eq!(s.state(), &before, "refused input changes nothing");

    // A second, different result for a completed call is refused; the same
    // result again is harmless.
    s.handle(
        Event::Wake {
            token: token("t1-c3"),
            result: ToolResult::text("done"),
            by: "u".into(),
        },
        T0,
    )
    .unwrap();
    let after = s.state().clone();
    assert_eq!(
        s.handle(
            Event::Wake {
                token: token("t1-c3"),
                result: ToolResult::text("done"),
                by: "u".into()
            },
            T0
        ),
        Ok(Handled::Wake(WakeOutcome::AlreadyCompleted))
    );
    let err = s
        .handle(
            Event::Wake {
                token: token("t1-c3"),
                result: ToolResult::text("other"),
                by: "u".into(),
            },
            T0,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("already holds a different result"),
        "{err}"
    );
    assert_eq!(s.state(), &after);
}

#[test]
fn pause_holds_every_action_and_resume_rederives_them() {
    let mut s = Session::new(SessionId("demo".into()), config());
    s.handle(Event::Pause, T0).unwrap();
    s.handle(Event::UserMessage { text: "hi".into() }, T0)
        .unwrap();
    assert!(drain(&mut s).is_empty(), "paused: the model is not called");
    s.handle(Event::Resume, T0).unwrap();
    assert_eq!(
        drain(&mut s),
        vec![Action::Checkpoint, Action::CallModel { turn: 1 }]
    );
    s.handle(Event::Pause, T0).unwrap();
    s.handle(
        Event::ModelReplied {
            turn: three_calls(),
        },
        T0,
    )
    .unwrap();
    assert_eq!(
        drain(&mut s),
        vec![Action::Checkpoint],
        "no call starts while paused"
    );
    s.handle(Event::Resume, T0).unwrap();
    let actions = drain(&mut s);
    assert_eq!(
        actions
            .iter()
            .filter(|a| matches!(a, Action::RunTool { .. } | Action::EnsureContinuation(_)))
            .count(),
        3
    );
}

#[test]
fn messages_sent_while_busy_go_with_the_next_user_turn_and_limits_hold() {
    let mut cfg = config();
    cfg.limits.max_turns = Some(1);
    let mut s = started(cfg);
    s.handle(
        Event::UserMessage {
            text: "also this".into(),
        },
        T0,
    )
    .unwrap();
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    s.handle(
        Event::ToolFinished {
            call: CallId::new(1, 0),
            result: ToolResult::text("x"),
            from_cache: false,
        },
        T0,
    )
    .unwrap();
    match s.state().turns.last() {
        Some(Turn::User(u)) => assert_eq!(u.message.as_deref(), Some("also this")),
        other => panic!("{other:?}"),
    }
    let actions = drain(&mut s);
    assert!(
        matches!(actions.last(), Some(Action::Failed { reason }) if reason.contains("maxTurns"))
    );
    assert_eq!(s.state().phase, Phase::Failed);
    // A new message after a failure starts again (the limit still applies).
    assert!(s
        .handle(
            Event::UserMessage {
                text: "retry".into()
            },
            T0
        )
        .is_ok());
}

#[test]
fn model_failures_back_off_then_fail_the_session() {
    let mut s = started(config());
    let mut now = T0;
    for _ in 0..4 {
        s.handle(
            Event::ModelFailed {
                error: "503".into(),
                retryable: true,
                retry_after_ms: None,
            },
            now,
        )
        .unwrap();
        now = s.poll_timeout().unwrap();
        s.handle(Event::Tick, now).unwrap();
        assert_eq!(
            drain(&mut s),
            vec![Action::Checkpoint, Action::CallModel { turn: 1 }]
        );
    }
    s.handle(
        Event::ModelFailed {
            error: "503".into(),
            retryable: true,
            retry_after_ms: None,
        },
        now,
    )
    .unwrap();
    assert_eq!(s.state().phase, Phase::Failed);
    assert!(s
        .state()
        .failure
        .as_ref()
        .unwrap()
        .contains("after 5 attempt(s): 503"));
}

#[test]
fn session_deadline_fails_the_session() {
    let mut cfg = config();
    cfg.limits.deadline = Some(T0.plus_secs(10));
    let mut s = started(cfg);
    assert_eq!(s.poll_timeout(), Some(T0.plus_secs(10)));
    s.handle(Event::Tick, T0.plus_secs(10)).unwrap();
    assert_eq!(s.state().phase, Phase::Failed);
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn same_state_and_events_give_the_same_actions_and_state() {
    let run = || {
        let mut s = started(config());
        let mut log = Vec::new();
        s.handle(
            Event::ModelReplied {
                turn: three_calls(),
            },
            T0,
        )
        .unwrap();
        log.extend(drain(&mut s));
        let snapshot = serde_json::to_string(s.state()).unwrap();
        let mut s = Session::restore(serde_json::from_str(&snapshot).unwrap(), config(), T0);
        log.extend(drain(&mut s));
        s.wake_many(vec![(token("t1-c1"), ToolResult::text("a"))], "x", T0);
        log.extend(drain(&mut s));
        (
            format!("{log:?}"),
            serde_json::to_string(s.state()).unwrap(),
        )
    };
    assert_eq!(run(), run());
}

#[test]
fn re_issuing_work_under_way_changes_nothing_to_write() {
    // The operator steps again while its background run is in flight (a
    // watch event): the start is issued again (the runner adopts it) but
    // the stored state stays the same, so the step writes nothing.
    let mut cfg = config();
    cfg.policy.default = Disposition::RunAsync;
    let mut s = started(cfg.clone());
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    let first = drain(&mut s);
    assert!(first
        .iter()
        .any(|a| matches!(a, Action::RunInBackground { .. })));
    let stored = s.state().clone();
    let mut again = Session::restore(stored.clone(), cfg, T0.plus_secs(30));
    let actions = drain(&mut again);
    assert!(actions
        .iter()
        .any(|a| matches!(a, Action::RunInBackground { .. })));
    assert_eq!(again.state(), &stored, "no new claim, no write");
}

#[test]
fn a_paused_session_collects_what_runs_and_starts_nothing() {
    let mut s = started(config());
    reply(&mut s, vec![call("m", "bash", "{}")]);
    assert!(drain(&mut s)
        .iter()
        .any(|a| matches!(a, Action::LaunchIsolated { attempt: 1, .. })));
    s.handle(Event::Pause, T0).unwrap();
    s.replan(T0.plus_secs(1));
    let planned = drain(&mut s);
    assert!(
        planned.iter().all(|a| !a.starts_work()),
        "paused: nothing starts: {planned:?}"
    );
    assert!(
        planned.iter().any(|a| matches!(
            a,
            Action::Collect {
                attempt: 1,
                isolated: Some(_),
                ..
            }
        )),
        "paused: the running attempt is collected: {planned:?}"
    );
    let out = s
        .handle(
            Event::AttemptFinished {
                token: token("t1-c0"),
                attempt: 1,
                result: ToolResult::text("done while paused"),
            },
            T0.plus_secs(2),
        )
        .unwrap();
    assert_eq!(out, Handled::Wake(WakeOutcome::Applied));
    let after = drain(&mut s);
    assert!(
        after
            .iter()
            .any(|a| matches!(a, Action::RecordResult { .. })),
        "the result is recorded while paused: {after:?}"
    );
    assert!(
        after.iter().all(|a| !matches!(a, Action::CallModel { .. })),
        "the model waits for resume: {after:?}"
    );
}

#[test]
fn a_failed_session_takes_no_decision_until_retried() {
    let mut s = started(config_with_approval());
    reply(&mut s, vec![call("m", "bash", "{}")]);
    drain(&mut s);
    let mut failed = s.state().clone();
    failed.fail("stopped".into());
    let mut s = Session::restore_quiet(failed, config_with_approval());
    let out = s
        .handle(
            Event::Decide {
                token: token("t1-c0"),
                approved: false,
                by: "carol".into(),
                reason: None,
                arguments: None,
            },
            T0,
        )
        .unwrap();
    assert_eq!(out, Handled::Wake(WakeOutcome::Unknown));
    assert!(
        drain(&mut s).is_empty(),
        "nothing to record for a failed session"
    );
}

fn config_with_approval() -> SessionConfig {
    let mut cfg = config();
    cfg.policy.rules[1].decorators.approval = true;
    cfg
}

/// `lookup` (run here) behind an approval policy.
fn approval_config(policy: agents::core::policy::ApprovalPolicy) -> SessionConfig {
    let mut cfg = config();
    cfg.policy.rules.push(rule(
        "lookup",
        Disposition::RunSync,
        Decorators {
            approval: true,
            approval_policy: Some(policy),
            ..Decorators::default()
        },
    ));
    cfg
}

fn timing_out(on_timeout: agents::core::policy::OnTimeout) -> SessionConfig {
    approval_config(agents::core::policy::ApprovalPolicy {
        quorum: 1,
        timeout_seconds: Some(5),
        on_timeout,
        ..Default::default()
    })
}

#[test]
fn an_approval_timeout_applies_on_timeout() {
    use agents::core::policy::OnTimeout;
    // deny: the call is denied and the model told nobody decided.
    let mut s = started(timing_out(OnTimeout::Deny));
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    assert_eq!(s.poll_timeout(), Some(T0.plus_secs(5)));
    s.handle(Event::Tick, T0.plus_secs(5)).unwrap();
    let recorded = drain(&mut s);
    assert!(
        recorded
            .iter()
            .any(|a| matches!(a, Action::RecordResult { result, .. }
            if result.to_model_text().contains("no decision within 5s (onTimeout: deny)"))),
        "{recorded:?}"
    );
    // approve: the call runs.
    let mut s = started(timing_out(OnTimeout::Approve));
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    s.handle(Event::Tick, T0.plus_secs(5)).unwrap();
    assert!(drain(&mut s)
        .iter()
        .any(|a| matches!(a, Action::RunTool { .. })));
    // fail: the session fails, saying why.
    let mut s = started(timing_out(OnTimeout::Fail));
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    s.handle(Event::Tick, T0.plus_secs(5)).unwrap();
    assert_eq!(s.state().phase, Phase::Failed);
    assert!(s
        .state()
        .failure
        .as_deref()
        .unwrap_or("")
        .contains("onTimeout: fail"));
}

#[test]
fn an_edited_call_runs_with_the_edit_and_the_model_hears_of_it() {
    let mut s = started(approval_config(agents::core::policy::ApprovalPolicy {
        quorum: 1,
        allow_edit: true,
        ..Default::default()
    }));
    reply(&mut s, vec![call("m", "lookup", r#"{"q":"all"}"#)]);
    drain(&mut s);
    s.handle(
        Event::Decide {
            token: token("t1-c0"),
            approved: true,
            by: "alice".into(),
            reason: None,
            arguments: Some(r#"{"q":"some"}"#.into()),
        },
        T0,
    )
    .unwrap();
    let run = drain(&mut s);
    let Some(Action::RunTool {
        tool_call, call, ..
    }) = run.iter().find(|a| matches!(a, Action::RunTool { .. }))
    else {
        panic!("no run: {run:?}");
    };
    assert_eq!(tool_call.arguments, r#"{"q":"some"}"#);
    s.handle(
        Event::ToolFinished {
            call: *call,
            result: ToolResult::text("found some"),
            from_cache: false,
        },
        T0,
    )
    .unwrap();
    let heard = s
        .state()
        .turns
        .iter()
        .filter_map(|t| match t {
            Turn::User(u) => u.tool_results.first().map(|r| r.result.to_model_text()),
            _ => None,
        })
        .next_back()
        .unwrap();
    assert!(
        heard.contains(
            r#"alice edited the arguments before the call ran; it ran with {"q":"some"}"#
        ),
        "{heard}"
    );
    assert!(heard.contains("found some"), "{heard}");
}

#[test]
fn an_edit_the_policy_does_not_allow_fails_the_call_saying_why() {
    let mut s = started(approval_config(agents::core::policy::ApprovalPolicy {
        quorum: 1,
        ..Default::default()
    }));
    reply(&mut s, vec![call("m", "lookup", "{}")]);
    drain(&mut s);
    s.handle(
        Event::Decide {
            token: token("t1-c0"),
            approved: true,
            by: "alice".into(),
            reason: None,
            arguments: Some("{}".into()),
        },
        T0,
    )
    .unwrap();
    let recorded = drain(&mut s);
    assert!(
        recorded
            .iter()
            .any(|a| matches!(a, Action::RecordResult { result, .. }
            if result.to_model_text().contains("allowEdit"))),
        "{recorded:?}"
    );
    assert!(recorded
        .iter()
        .all(|a| !matches!(a, Action::RunTool { .. })));
}
