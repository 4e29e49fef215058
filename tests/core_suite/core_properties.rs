//! Property tests: random interleavings of events never break the core's
//! invariants, refused events change nothing, and state survives both the
//! store's JSON and the CRD status mapping unchanged.

use agents::api::stored::{session_state, session_status};
use agents::api::SessionStatus;
use agents::core::policy::{Decorators, Rule};
use agents::core::session::ToolInfo;
use agents::core::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

const TOOLS: [&str; 5] = ["lookup", "send_email", "bash", "search", "nope"];

fn config() -> SessionConfig {
    let tools = TOOLS[..4]
        .iter()
        .map(|t| (t.to_string(), ToolInfo::default()))
        .collect::<BTreeMap<_, _>>();
    let rule = |tool: &str, disposition, decorators| Rule {
        tool: tool.into(),
        disposition,
        decorators,
    };
    SessionConfig {
        agent: None,
        policy: Policy {
            default: Disposition::RunSync,
            default_decorators: Decorators {
                retries: 1,
                ..Default::default()
            },
            rules: vec![
                rule(
                    "send_*",
                    Disposition::Defer {
                        reason: "human".into(),
                    },
                    Decorators {
                        approval: true,
                        timeout_seconds: Some(5),
                        ..Default::default()
                    },
                ),
                rule(
                    "bash",
                    Disposition::RunIsolated {
                        spec: IsolationSpec {
                            image: "busybox:ci".into(),
                            ..Default::default()
                        },
                    },
                    Decorators {
                        retries: 2,
                        truncate_bytes: Some(8),
                        ..Default::default()
                    },
                ),
                rule(
                    "search",
                    Disposition::RunAsync,
                    Decorators {
                        cache: true,
                        ..Default::default()
                    },
                ),
            ],
        },
        tools,
        limits: Limits {
            max_turns: Some(6),
            deadline: None,
            max_calls_per_reply: None,
        },
        context_has_secrets: false,
        ..SessionConfig::default()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Message,
    Reply(Vec<(usize, bool)>),
    Final,
    ModelError(bool),
    ToolDone(usize, bool),
    Attempt(usize, bool, bool),
    Wake(usize, bool),
    WakeUnknown,
    Decide(usize, bool),
    Tick(u64),
    Pause,
    Resume,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Message),
        prop::collection::vec((0..TOOLS.len(), any::<bool>()), 1..4).prop_map(Op::Reply),
        Just(Op::Final),
        any::<bool>().prop_map(Op::ModelError),
        (0..4usize, any::<bool>()).prop_map(|(i, ok)| Op::ToolDone(i, ok)),
        (0..4usize, any::<bool>(), any::<bool>()).prop_map(|(i, ok, s)| Op::Attempt(i, ok, s)),
        (0..4usize, any::<bool>()).prop_map(|(i, a)| Op::Wake(i, a)),
        Just(Op::WakeUnknown),
        (0..4usize, any::<bool>()).prop_map(|(i, a)| Op::Decide(i, a)),
        (0..8000u64).prop_map(Op::Tick),
        Just(Op::Pause),
        Just(Op::Resume),
        Just(Op::Restart),
    ]
}

fn event(s: &Session, op: &Op) -> Option<Event> {
    let open = s.state().open.as_ref();
    let call = |i: usize| open.and_then(|o| o.calls.get(i));
    Some(match op {
        Op::Message => Event::UserMessage {
            text: "hello".into(),
        },
        Op::Reply(calls) => Event::ModelReplied {
            turn: AgentTurn {
                text: None,
                tool_calls: calls
                    .iter()
                    .enumerate()
                    .map(|(i, (t, valid))| ToolCall {
                        model_call_id: format!("m{i}"),
                        name: TOOLS[*t].into(),
                        arguments: if *valid {
                            format!(r#"{{"n":{i}}}"#)
                        } else {
                            "{oops".into()
                        },
                    })
                    .collect(),
                usage: TokenUsage {
                    prompt_tokens: 1,
                    completion_tokens: 1,
                    ..TokenUsage::default()
                },
                ..Default::default()
            },
        },
        Op::Final => Event::ModelReplied {
            turn: AgentTurn {
                text: Some("done".into()),
                ..Default::default()
            },
        },
        Op::ModelError(retryable) => Event::ModelFailed {
            error: "boom".into(),
            retryable: *retryable,
            retry_after_ms: None,
        },
        Op::ToolDone(i, ok) => Event::ToolFinished {
            call: call(*i)?.id,
            result: if *ok {
                ToolResult::text("ok")
            } else {
                ToolResult::error("bad")
            },
            from_cache: false,
        },
        Op::Attempt(i, ok, stale) => {
            let c = call(*i)?;
            Event::AttemptFinished {
                token: c.token().cloned()?,
                attempt: if *stale {
                    c.attempts.saturating_sub(1)
                } else {
                    c.attempts
                },
                result: if *ok {
                    ToolResult::text("a long isolated result")
                } else {
                    ToolResult::error("exit 1")
                },
            }
        }
        Op::Wake(i, a) => Event::Wake {
            token: call(*i)?.token().cloned()?,
            result: ToolResult::text(if *a { "A" } else { "B" }),
            by: "prop".into(),
        },
        Op::WakeUnknown => Event::Wake {
            token: ContinuationToken("nobody-t9-c9".into()),
            result: ToolResult::text("x"),
            by: "prop".into(),
        },
        Op::Decide(i, approved) => Event::Decide {
            token: call(*i)?.token().cloned()?,
            approved: *approved,
            by: "prop".into(),
            reason: None,
            arguments: None,
        },
        Op::Tick(_) => Event::Tick,
        Op::Pause => Event::Pause,
        Op::Resume => Event::Resume,
        Op::Restart => return None,
    })
}

fn check_invariants(
    state: &SessionState,
    finals: &mut HashMap<String, ToolResult>,
    closed_calls: &mut HashMap<String, usize>,
) {
    if let Some(open) = &state.open {
        assert!(
            open.calls.iter().any(|c| !c.state().is_final()) || state.phase == Phase::Failed,
            "an open turn whose calls are all final must have closed"
        );
        for c in &open.calls {
            assert_eq!(c.state().is_final(), c.result().is_some(), "{c:?}");
            if let Some(r) = c.result() {
                let prev = finals.entry(c.id.to_string()).or_insert_with(|| r.clone());
                assert_eq!(
                    prev, r,
                    "call {} completed twice with different results",
                    c.id
                );
            }
        }
    }
    let mut seen = HashMap::new();
    for (i, t) in state.turns.iter().enumerate() {
        if let Turn::User(u) = t {
            let ids: Vec<CallId> = u.tool_results.iter().map(|r| r.call_id).collect();
            let mut sorted = ids.clone();
            sorted.sort();
            assert_eq!(ids, sorted, "results go back in the model's call order");
            for r in &u.tool_results {
                assert!(
                    seen.insert(r.call_id.to_string(), i).is_none(),
                    "{} closed twice",
                    r.call_id
                );
                if let Some(prev) = finals.get(&r.call_id.to_string()) {
                    assert_eq!(prev, &r.result);
                }
            }
        }
    }
    for (id, turn) in &seen {
        if let Some(prev) = closed_calls.insert(id.clone(), *turn) {
            assert_eq!(prev, *turn, "call {id} moved between turns");
        }
    }
    // A success result on a call under `approval` was approved first.
    for c in state.open.iter().flat_map(|o| o.calls.iter()) {
        // Every reachable call loads back from its stored, flat form.
        let flat = agents::core::call::flat::FlatCall::from(c.clone());
        assert_eq!(TrackedToolCall::try_from(flat).as_ref(), Ok(c));
        if c.policy.decorators.approval && c.result().is_some_and(|r| !r.is_error()) {
            assert!(
                c.approval().is_some_and(|a| a.approved),
                "{} holds a success result without an approval",
                c.id
            );
        }
    }
    // The store's JSON and the CRD status both round-trip the state.
    let json = serde_json::to_string(state).unwrap();
    assert_eq!(&serde_json::from_str::<SessionState>(&json).unwrap(), state);
    let status = session_status(state);
    let status: SessionStatus =
        serde_json::from_str(&serde_json::to_string(&status).unwrap()).unwrap();
    assert_eq!(&session_state(&state.id, &status).unwrap(), state);
}

fn run(ops: &[Op]) -> (String, String) {
    let mut s = Session::new(SessionId("prop".into()), config());
    let mut now = Millis(1_000_000);
    let mut finals = HashMap::new();
    let mut closed = HashMap::new();
    let mut log = String::new();
    for op in ops {
        if let Op::Tick(ms) = op {
            now = now.plus_millis(*ms);
        }
        match event(&s, op) {
            None if matches!(op, Op::Restart) => {
                let state = s.state().clone();
                s = Session::restore(state, config(), now);
            }
            None => continue,
            Some(ev) => {
                let before = s.state().clone();
                let awaited_approval = match &ev {
                    Event::Wake { token, .. } => before
                        .find_call(token)
                        .is_some_and(|c| c.waiting_for() == Some(WaitingFor::Approval)),
                    _ => false,
                };
                let out = s.handle(ev.clone(), now);
                assert!(
                    !(awaited_approval && out.is_ok()),
                    "a result landed on a call waiting for approval: {ev:?}"
                );
                if let Err(e) = &out {
                    assert_eq!(s.state(), &before, "refused {ev:?} ({e}) changed the state");
                }
                log.push_str(&format!("{out:?}\n"));
            }
        }
        while let Some(a) = s.poll_action() {
            log.push_str(&format!("{a:?}\n"));
        }
        check_invariants(s.state(), &mut finals, &mut closed);
    }
    (log, serde_json::to_string(s.state()).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_interleavings_keep_the_invariants(ops in prop::collection::vec(op(), 1..60)) {
        run(&ops);
    }

    #[test]
    fn no_interleaving_lands_a_result_on_a_call_waiting_for_approval(
        ops in prop::collection::vec(prop_oneof![
            3 => (0..4usize, any::<bool>()).prop_map(|(i, a)| Op::Wake(i, a)),
            2 => (0..4usize, any::<bool>()).prop_map(|(i, a)| Op::Decide(i, a)),
            1 => op(),
        ], 1..60)
    ) {
        // `run` asserts after every event that no result was applied to a
        // call waiting for approval, and that success needs an approval.
        run(&ops);
    }

    #[test]
    fn the_same_events_give_the_same_actions_and_state(ops in prop::collection::vec(op(), 1..40)) {
        prop_assert_eq!(run(&ops), run(&ops));
    }
}
