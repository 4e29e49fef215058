//! Sub-agent calls in the core: a call of an `agent` tool waits for a child
//! Session that the core plans (name, prompt, depth, stack) and a driver
//! makes after the claim is committed; bad prompts and depth are refused
//! before anything is claimed; `maxChildren` makes the rest wait their turn.

use agents::core::call::WaitingFor;
use agents::core::session::subagent::{child_name, Lineage, StackEntry};
use agents::core::session::ToolInfo;
use agents::core::*;
use std::collections::BTreeMap;

const T0: Millis = Millis(1_700_000_000_000);

fn config(lineage: Lineage) -> SessionConfig {
    let mut tools = BTreeMap::new();
    tools.insert(
        "researcher".to_string(),
        ToolInfo {
            container: None,
            sub_agent: Some("researcher".into()),
            unknown_outcome: None,
        },
    );
    tools.insert("lookup".to_string(), ToolInfo::default());
    SessionConfig {
        agent: Some("planner".into()),
        tools,
        lineage,
        limits: Limits {
            deadline: Some(T0.plus_secs(3600)),
            ..Limits::default()
        },
        ..SessionConfig::default()
    }
}

fn drain(s: &mut Session) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

fn call(i: usize, name: &str, args: &str) -> ToolCall {
    ToolCall {
        model_call_id: format!("m-{i}"),
        name: name.into(),
        arguments: args.into(),
    }
}

/// A session of `config` whose model asked for `calls`; the actions.
fn replied(config: SessionConfig, calls: Vec<ToolCall>) -> (Session, Vec<Action>) {
    let mut s = Session::new(SessionId("root".into()), config);
    s.handle(Event::UserMessage { text: "go".into() }, T0)
        .unwrap();
    drain(&mut s);
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
    let actions = drain(&mut s);
    (s, actions)
}

fn starts(actions: &[Action]) -> Vec<&agents::core::session::subagent::ChildPlan> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::StartSubAgent { child, .. } => Some(child),
            _ => None,
        })
        .collect()
}

fn result_text(s: &Session, call: CallId) -> String {
    s.state()
        .turns
        .iter()
        .rev()
        .find_map(|t| match t {
            Turn::User(u) => u
                .tool_results
                .iter()
                .find(|r| r.call_id == call)
                .map(|r| r.result.to_model_text()),
            _ => None,
        })
        .or_else(|| {
            s.state()
                .find_call(&ContinuationToken::for_call(&s.state().id, call))
                .and_then(|c| c.result().map(|r| r.to_model_text()))
        })
        .unwrap_or_else(|| panic!("no result for {call}"))
}

#[test]
fn a_call_of_an_agent_tool_plans_its_child_after_the_claim() {
    let args = r#"{"prompt":"find the facts","topic":"tides"}"#;
    let (s, actions) = replied(
        config(Lineage::default()),
        vec![call(0, "researcher", args)],
    );
    let start = actions
        .iter()
        .position(|a| matches!(a, Action::StartSubAgent { .. }))
        .expect("a child is started");
    assert!(
        actions[..start].contains(&Action::Checkpoint),
        "the claim is committed before the child is made: {actions:#?}"
    );
    let child = starts(&actions)[0];
    assert_eq!(child.name, "root-t1-c0");
    assert_eq!(child.agent, "researcher");
    assert_eq!(child.depth, 1);
    assert_eq!(child.deadline, Some(T0.plus_secs(3600)));
    assert!(child.prompt.starts_with("find the facts"));
    assert!(
        child.prompt.contains(r#""topic":"tides""#),
        "{}",
        child.prompt
    );
    assert_eq!(
        child.stack,
        vec![StackEntry {
            agent: "planner".into(),
            session: "root".into(),
            depth: 0
        }]
    );
    let c = &s.state().open.as_ref().unwrap().calls[0];
    assert_eq!(c.waiting_for(), Some(WaitingFor::SubAgent));
    assert_eq!(s.state().phase, Phase::Waiting, "the session yields");
}

#[test]
fn the_childs_answer_is_the_calls_result() {
    let (mut s, actions) = replied(
        config(Lineage::default()),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    let token = match actions
        .iter()
        .find(|a| matches!(a, Action::StartSubAgent { .. }))
    {
        Some(Action::StartSubAgent { envelope, .. }) => envelope.token.clone(),
        _ => unreachable!(),
    };
    s.handle(
        Event::AttemptFinished {
            token,
            attempt: 1,
            result: ToolResult::text("the tide is high"),
        },
        T0,
    )
    .unwrap();
    drain(&mut s);
    assert_eq!(result_text(&s, CallId::new(1, 0)), "the tide is high");
    assert_eq!(s.state().phase, Phase::AwaitingModel);
}

#[test]
fn a_missing_or_non_string_prompt_is_an_error_for_the_model() {
    let (s, actions) = replied(
        config(Lineage::default()),
        vec![
            call(0, "researcher", r#"{"topic":"tides"}"#),
            call(1, "researcher", r#"{"prompt": 42}"#),
        ],
    );
    assert!(starts(&actions).is_empty(), "no child: {actions:#?}");
    let missing = result_text(&s, CallId::new(1, 0));
    assert!(missing.contains("needs a \"prompt\" argument"), "{missing}");
    let not_string = result_text(&s, CallId::new(1, 1));
    assert!(
        not_string.contains("\"prompt\" must be a string, not 42"),
        "{not_string}"
    );
}

#[test]
fn a_call_past_max_depth_is_refused_naming_the_chain_and_the_cycle() {
    let lineage = Lineage {
        depth: 2,
        ancestors: vec![
            StackEntry {
                agent: "researcher".into(),
                session: "top".into(),
                depth: 0,
            },
            StackEntry {
                agent: "writer".into(),
                session: "top-t1-c0".into(),
                depth: 1,
            },
        ],
        max_depth: 2,
        ..Lineage::default()
    };
    let (s, actions) = replied(
        config(lineage),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    assert!(starts(&actions).is_empty(), "no child: {actions:#?}");
    let why = result_text(&s, CallId::new(1, 0));
    assert!(
        why.contains("a cycle: researcher is already on the call stack"),
        "{why}"
    );
    assert!(why.contains("depth 3 passes maxDepth 2"), "{why}");
    assert!(
        why.contains("researcher (top) -> writer (top-t1-c0) -> planner (root) -> researcher"),
        "{why}"
    );
}

#[test]
fn past_max_children_the_rest_wait_their_turn() {
    let lineage = Lineage {
        max_children: 2,
        ..Lineage::default()
    };
    let calls = (0..5)
        .map(|i| call(i, "researcher", r#"{"prompt":"x"}"#))
        .collect();
    let (mut s, actions) = replied(config(lineage), calls);
    let first = starts(&actions);
    assert_eq!(
        first.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["root-t1-c0", "root-t1-c1"]
    );
    // One child ends.
    s.handle(
        Event::AttemptFinished {
            token: ContinuationToken::for_call(&SessionId("root".into()), CallId::new(1, 0)),
            attempt: 1,
            result: ToolResult::text("done"),
        },
        T0,
    )
    .unwrap();
    drain(&mut s);
    // The next step (a driver restores the session) starts one more child.
    let config = s.config().clone();
    let mut s = Session::restore(s.into_state(), config, T0.plus_secs(1));
    let next = drain(&mut s);
    let names: Vec<&str> = starts(&next).iter().map(|c| c.name.as_str()).collect();
    assert!(names.contains(&"root-t1-c2"), "{next:#?}");
    assert!(!names.contains(&"root-t1-c3"), "{next:#?}");
}

#[test]
fn child_names_are_deterministic_and_fit_a_label() {
    let long = SessionId("a".repeat(70));
    let n = child_name(&long, CallId::new(3, 1), 1);
    assert!(n.len() <= 63, "{n}");
    assert_eq!(n, child_name(&long, CallId::new(3, 1), 1));
    let retry = child_name(&long, CallId::new(3, 1), 2);
    assert!(retry.len() <= 63 && retry.ends_with("-a2"), "{retry}");
    assert_ne!(n, retry);
    assert_eq!(
        child_name(&SessionId("root".into()), CallId::new(1, 0), 2),
        "root-t1-c0-a2"
    );
}

#[test]
fn a_childs_lineage_rides_in_every_call_context() {
    let lineage = Lineage {
        depth: 1,
        ancestors: vec![StackEntry {
            agent: "boss".into(),
            session: "top".into(),
            depth: 0,
        }],
        ..Lineage::default()
    };
    let (_, actions) = replied(
        config(lineage),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    let Some(Action::StartSubAgent {
        envelope, child, ..
    }) = actions
        .iter()
        .find(|a| matches!(a, Action::StartSubAgent { .. }))
    else {
        panic!("{actions:#?}")
    };
    assert_eq!(child.depth, 2);
    let sessions: Vec<&str> = envelope
        .context
        .call_stack
        .iter()
        .map(|e| e.session.as_str())
        .collect();
    assert_eq!(sessions, ["top", "root"]);
}

#[test]
fn a_call_past_max_depth_without_a_cycle_is_refused_as_too_deep() {
    let lineage = Lineage {
        depth: 1,
        ancestors: vec![StackEntry {
            agent: "boss".into(),
            session: "top".into(),
            depth: 0,
        }],
        max_depth: 1,
        ..Lineage::default()
    };
    let (s, actions) = replied(
        config(lineage),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    assert!(starts(&actions).is_empty(), "no child: {actions:#?}");
    let why = result_text(&s, CallId::new(1, 0));
    assert!(why.contains("sub-agent call refused (too deep)"), "{why}");
    assert!(!why.contains("cycle"), "{why}");
    assert!(
        why.contains("a child at depth 2 passes maxDepth 1"),
        "{why}"
    );
    assert!(
        why.contains("boss (top) -> planner (root) -> researcher"),
        "{why}"
    );
    assert!(why.contains("raise spec.maxDepth"), "{why}");
}

/// The child's final usage is added to the parent's with its answer, once:
/// an answer handled again (a replayed step, a second delivery) adds
/// nothing, and the path after a crash (the answer read from the call's
/// continuation) adds it as the runner's path does.
#[test]
fn a_childs_usage_is_added_once_with_its_answer() {
    let usage = TokenUsage {
        prompt_tokens: 30,
        completion_tokens: 12,
        ..TokenUsage::default()
    };
    let token = ContinuationToken::for_call(&SessionId("root".into()), CallId::new(1, 0));
    let answer = |token: &ContinuationToken| Event::ChildAnswered {
        answer: Box::new(Event::AttemptFinished {
            token: token.clone(),
            attempt: 1,
            result: ToolResult::text("the tide is high"),
        }),
        usage,
    };
    let (mut s, _) = replied(
        config(Lineage::default()),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    let own = s.state().usage;
    s.handle(answer(&token), T0).unwrap();
    drain(&mut s);
    let mut expected = own;
    expected.add(usage);
    assert_eq!(s.state().usage, expected, "added with the answer");
    // Kept apart too: a namespace Budget charges each session its own
    // spend, the child being a session it counts itself.
    assert_eq!(s.state().children_usage, usage);
    assert_eq!(s.state().usage.less(&s.state().children_usage), own);
    s.handle(answer(&token), T0).unwrap();
    assert_eq!(s.state().usage, expected, "a second delivery adds nothing");
    assert_eq!(s.state().children_usage, usage, "nor to the children's");

    // After a crash: the answer comes back from the continuation (a wake).
    let (mut s, _) = replied(
        config(Lineage::default()),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    let wake = Event::ChildAnswered {
        answer: Box::new(Event::Wake {
            token: token.clone(),
            result: ToolResult::text("the tide is high"),
            by: "agents".into(),
        }),
        usage,
    };
    s.handle(wake, T0).unwrap();
    assert_eq!(s.state().usage, expected, "the wake path adds it too");
    assert_eq!(result_text(&s, CallId::new(1, 0)), "the tide is high");
}

/// A child that failed spent its tokens too: its usage comes with the
/// error result the call ends with.
#[test]
fn a_failed_childs_usage_is_added_with_its_error() {
    let (mut s, _) = replied(
        config(Lineage::default()),
        vec![call(0, "researcher", r#"{"prompt":"x"}"#)],
    );
    let token = ContinuationToken::for_call(&SessionId("root".into()), CallId::new(1, 0));
    let own = s.state().usage;
    let failed = Event::ChildAnswered {
        answer: Box::new(Event::AttemptFinished {
            token,
            attempt: 1,
            result: ToolResult::error("the child failed"),
        }),
        usage: TokenUsage {
            prompt_tokens: 7,
            completion_tokens: 1,
            ..TokenUsage::default()
        },
    };
    s.handle(failed, T0).unwrap();
    assert_eq!(s.state().usage.total(), own.total() + 8);
    assert!(result_text(&s, CallId::new(1, 0)).contains("the child failed"));
}

/// Fan-out is not an error for the model: past `maxChildren` the calls
/// wait their turn, and the model's next turn gets every child's answer.
#[test]
fn past_max_children_the_model_still_gets_every_childs_answer() {
    let lineage = Lineage {
        max_children: 2,
        ..Lineage::default()
    };
    let calls = (0..3)
        .map(|i| call(i, "researcher", r#"{"prompt":"x"}"#))
        .collect();
    let (mut s, actions) = replied(config(lineage), calls);
    assert_eq!(starts(&actions).len(), 2, "two run at once");
    let root = SessionId("root".into());
    let mut now = T0;
    for i in 0..3 {
        now = now.plus_secs(1);
        let config = s.config().clone();
        s = Session::restore(s.into_state(), config, now);
        let started: Vec<String> = starts(&drain(&mut s))
            .iter()
            .map(|c| c.name.clone())
            .collect();
        assert!(started.len() <= 2, "never more than two: {started:?}");
        s.handle(
            Event::AttemptFinished {
                token: ContinuationToken::for_call(&root, CallId::new(1, i)),
                attempt: 1,
                result: ToolResult::text(format!("answer {i}")),
            },
            now,
        )
        .unwrap();
        drain(&mut s);
    }
    assert_eq!(s.state().phase, Phase::AwaitingModel);
    for i in 0..3 {
        assert_eq!(
            result_text(&s, CallId::new(1, i as u32)),
            format!("answer {i}")
        );
    }
}
