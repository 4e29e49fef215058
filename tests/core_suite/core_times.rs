//! The times the core keeps for people (the console's timeline): when the
//! model was asked and replied, when each call started and ended. All come
//! from the `now` the driver passes in; none is read from a clock.

use agents::core::policy::Rule;
use agents::core::*;

const T0: Millis = Millis(1_700_000_000_000);

fn call(id: &str, name: &str) -> ToolCall {
    ToolCall {
        model_call_id: id.into(),
        name: name.into(),
        arguments: "{}".into(),
    }
}

/// `lookup` runs in the step; `ask` waits for an outside party.
fn config() -> SessionConfig {
    SessionConfig {
        policy: Policy {
            default: Disposition::RunSync,
            rules: vec![Rule {
                tool: "ask".into(),
                disposition: Disposition::Defer {
                    reason: "a person".into(),
                },
                decorators: Decorators::default(),
            }],
            ..Policy::default()
        },
        ..SessionConfig::default()
    }
}

fn drain(s: &mut Session) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

fn agent_turn(s: &Session, index: usize) -> AgentTurn {
    match &s.state().turns[index] {
        Turn::Agent(a) => a.clone(),
        other => panic!("turn {index} is not the model's: {other:?}"),
    }
}

fn at(ms: i64) -> Millis {
    Millis(T0.0 + ms)
}

#[test]
fn a_reply_and_each_call_keep_when_they_happened() {
    let mut s = Session::new(SessionId("s".into()), config());
    s.handle(Event::UserMessage { text: "hi".into() }, T0)
        .unwrap();
    drain(&mut s);
    let turn = AgentTurn {
        tool_calls: vec![call("m-1", "lookup"), call("m-2", "ask")],
        ..Default::default()
    };
    s.handle(Event::ModelReplied { turn }, at(1_500)).unwrap();
    drain(&mut s);
    let reply = agent_turn(&s, 1);
    // Asked when the model call was claimed, recorded when the reply came.
    assert_eq!(
        (reply.asked_at, reply.replied_at),
        (Some(T0), Some(at(1_500)))
    );
    let open = &s.state().open.as_ref().unwrap().calls;
    assert_eq!(
        open.iter()
            .map(|c| (c.started_at, c.finished_at))
            .collect::<Vec<_>>(),
        vec![(Some(at(1_500)), None), (Some(at(1_500)), None)],
        "the sync call from its claim, the deferred one from its wait"
    );

    s.handle(
        Event::ToolFinished {
            call: CallId::new(1, 0),
            result: ToolResult::text("found"),
            from_cache: false,
        },
        at(1_800),
    )
    .unwrap();
    let open = &s.state().open.as_ref().unwrap().calls;
    assert_eq!(open[0].finished_at, Some(at(1_800)));
    assert_eq!(open[1].finished_at, None, "still waiting");

    s.handle(
        Event::Wake {
            token: ContinuationToken("s-t1-c1".into()),
            result: ToolResult::text("yes"),
            by: "ann".into(),
        },
        at(9_000),
    )
    .unwrap();
    let Some(Turn::User(results)) = s.state().turns.last() else {
        panic!("the turn closed: {:?}", s.state())
    };
    let times: Vec<_> = results
        .tool_results
        .iter()
        .map(|r| (r.started_at, r.finished_at))
        .collect();
    assert_eq!(
        times,
        vec![
            (Some(at(1_500)), Some(at(1_800))),
            (Some(at(1_500)), Some(at(9_000)))
        ]
    );
    // One integer each, under readable names, and back as they were.
    let text = serde_json::to_string(&s.state()).unwrap();
    assert!(
        text.contains(&format!(
            r#""startedAt":{},"finishedAt":{}"#,
            at(1_500).0,
            at(1_800).0
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            r#""askedAt":{},"repliedAt":{}"#,
            T0.0,
            at(1_500).0
        )),
        "{text}"
    );
    let back: SessionState = serde_json::from_str(&text).unwrap();
    assert_eq!(&back, s.state());
}

#[test]
fn a_retried_call_keeps_its_first_start_and_a_refused_one_has_none() {
    let mut cfg = config();
    cfg.policy.default_decorators.retries = 1;
    cfg.tools.insert("lookup".into(), Default::default());
    let mut s = Session::new(SessionId("s".into()), cfg);
    s.handle(Event::UserMessage { text: "hi".into() }, T0)
        .unwrap();
    let turn = AgentTurn {
        tool_calls: vec![call("m-1", "lookup"), call("m-2", "nope")],
        ..Default::default()
    };
    s.handle(Event::ModelReplied { turn }, at(100)).unwrap();
    drain(&mut s);
    let failed = Event::ToolFinished {
        call: CallId::new(1, 0),
        result: ToolResult::error("flaky"),
        from_cache: false,
    };
    s.handle(failed, at(200)).unwrap();
    // The retry comes due and is claimed again, later.
    s.handle(Event::Tick, at(60_000)).unwrap();
    assert!(
        drain(&mut s)
            .iter()
            .any(|a| matches!(a, Action::RunTool { attempt: 2, .. })),
        "the retry runs"
    );
    s.handle(
        Event::ToolFinished {
            call: CallId::new(1, 0),
            result: ToolResult::text("found"),
            from_cache: false,
        },
        at(61_000),
    )
    .unwrap();
    let Some(Turn::User(results)) = s.state().turns.last() else {
        panic!("the turn closed: {:?}", s.state())
    };
    let times: Vec<_> = results
        .tool_results
        .iter()
        .map(|r| (r.started_at, r.finished_at))
        .collect();
    assert_eq!(
        times,
        vec![
            (Some(at(100)), Some(at(61_000))),
            // An unknown tool is refused at the reply: it never started.
            (None, Some(at(100)))
        ]
    );
}
