use super::*;
use crate::core::policy::{Decorators, Disposition, Policy, Rule};
use crate::core::session::{Action, Event, Scope, Session, SessionConfig};
use crate::core::{AgentTurn, ContinuationToken, Millis, TokenUsage, ToolCall, ToolResult};

const T0: Millis = Millis(1_700_000_000_000);

/// `lookup` runs here; `ask_*` waits for a person.
fn config(uid: &str) -> SessionConfig {
    SessionConfig {
        policy: Policy {
            default: Disposition::RunSync,
            default_decorators: Decorators::default(),
            rules: vec![Rule {
                tool: "ask_*".into(),
                disposition: Disposition::Defer {
                    reason: "a person answers".into(),
                },
                decorators: Decorators::default(),
            }],
        },
        scope: Scope {
            namespace: "team".into(),
            uid: uid.into(),
        },
        ..SessionConfig::default()
    }
}

fn call(id: &str, name: &str) -> ToolCall {
    ToolCall {
        model_call_id: id.into(),
        name: name.into(),
        arguments: "{}".into(),
    }
}

fn reply(s: &mut Session, text: Option<&str>, calls: Vec<ToolCall>) {
    let turn = AgentTurn {
        text: text.map(str::to_string),
        tool_calls: calls,
        usage: TokenUsage {
            prompt_tokens: 10,
            completion_tokens: 1,
            ..TokenUsage::default()
        },
        ..AgentTurn::default()
    };
    s.handle(Event::ModelReplied { turn }, T0).unwrap();
}

fn drain(s: &mut Session) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

/// Turn 1 asks for `lookup` (done) and `ask_human` (still waiting).
fn waiting_source() -> Session {
    let mut s = Session::new(SessionId("src".into()), config("uid-src"));
    let text = "question".to_string();
    s.handle(Event::UserMessage { text }, T0).unwrap();
    drain(&mut s);
    reply(
        &mut s,
        None,
        vec![call("m1", "lookup"), call("m2", "ask_human")],
    );
    drain(&mut s);
    let result = ToolResult::text("sunny");
    let call = crate::core::CallId::new(1, 0);
    s.handle(
        Event::ToolFinished {
            call,
            result,
            from_cache: false,
        },
        T0,
    )
    .unwrap();
    drain(&mut s);
    assert_eq!(s.state().phase, Phase::Waiting);
    s
}

/// The waiting source, answered, and finished at turn 2.
fn finished_source() -> Session {
    let mut s = waiting_source();
    let token =
        ContinuationToken::for_call(&SessionId("src".into()), crate::core::CallId::new(1, 1));
    let (result, by) = (ToolResult::text("yes"), "alice".to_string());
    s.handle(Event::Wake { token, result, by }, T0).unwrap();
    drain(&mut s);
    reply(&mut s, Some("done"), vec![]);
    assert_eq!(s.state().phase, Phase::Succeeded);
    s
}

fn fork_id() -> SessionId {
    SessionId("fork".into())
}

#[test]
fn a_fork_keeps_the_turn_and_its_results_and_asks_the_model_next() {
    let source = finished_source().into_state();
    let fork = fork_state(&source, "uid-src", 1, fork_id()).unwrap();
    assert_eq!(fork.turns, source.turns[..3].to_vec());
    assert_eq!(fork.phase, Phase::AwaitingModel);
    assert_eq!((fork.agent_turns, fork.usage.prompt_tokens), (1, 10));
    assert_eq!(fork.tool_calls, 2);
    let from = fork.forked_from.clone().unwrap();
    assert_eq!(
        (from.session.as_str(), from.uid.as_str(), from.turn),
        ("src", "uid-src", 1)
    );
    assert_eq!((fork.messages_taken, fork.answer.clone()), (0, None));
    // Restored with a new message, the fork's first work is a model call:
    // nothing recorded before the fork point runs again.
    let mut s = Session::restore(fork, config("uid-fork"), T0);
    let text = "and tomorrow?".to_string();
    s.handle(Event::UserMessage { text }, T0).unwrap();
    let actions = drain(&mut s);
    assert!(
        actions
            .iter()
            .all(|a| !a.starts_work() || matches!(a, Action::CallModel { turn: 2 })),
        "{actions:?}"
    );
    assert!(
        actions.contains(&Action::CallModel { turn: 2 }),
        "{actions:?}"
    );
}

#[test]
fn calls_after_the_fork_point_run_under_keys_holding_the_forks_uid() {
    let source = finished_source().into_state();
    let fork = fork_state(&source, "uid-src", 1, fork_id()).unwrap();
    let mut s = Session::restore(fork, config("uid-fork"), T0);
    drain(&mut s);
    reply(&mut s, None, vec![call("m3", "lookup")]);
    let keys: Vec<String> = drain(&mut s)
        .into_iter()
        .filter_map(|a| match a {
            Action::RunTool {
                idempotency_key, ..
            } => Some(idempotency_key),
            _ => None,
        })
        .collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(
        keys[0].contains("uid-fork") && !keys[0].contains("uid-src"),
        "{keys:?}"
    );
    assert!(keys[0].starts_with("team/"), "{keys:?}");
}

#[test]
fn a_fork_at_a_final_answer_has_succeeded_and_a_message_goes_on_from_it() {
    let source = finished_source().into_state();
    let fork = fork_state(&source, "uid-src", 2, fork_id()).unwrap();
    assert_eq!(
        (fork.phase, fork.answer.as_deref()),
        (Phase::Succeeded, Some("done"))
    );
    assert_eq!(fork.turns, source.turns);
    let mut s = Session::restore(fork, config("uid-fork"), T0);
    let text = "more".to_string();
    s.handle(Event::UserMessage { text }, T0).unwrap();
    assert!(drain(&mut s).contains(&Action::CallModel { turn: 3 }));
}

#[test]
fn calls_open_at_the_fork_point_are_planned_afresh_and_finished_ones_kept() {
    let source = waiting_source().into_state();
    let fork = fork_state(&source, "uid-src", 1, fork_id()).unwrap();
    assert_eq!(fork.phase, Phase::RunningTools);
    let open = fork.open.clone().unwrap();
    assert_eq!(open.calls[0], source.open.as_ref().unwrap().calls[0]);
    assert_eq!(open.calls[1].state(), CallState::Ready);
    assert_eq!((open.calls[1].token(), open.calls[1].attempts), (None, 0));
    let mut s = Session::restore(fork, config("uid-fork"), T0);
    let actions = drain(&mut s);
    let ensured: Vec<_> = actions
        .iter()
        .filter_map(|a| match a {
            Action::EnsureContinuation(spec) => Some(spec.token.clone()),
            _ => None,
        })
        .collect();
    let expected = ContinuationToken::for_call(&fork_id(), crate::core::CallId::new(1, 1));
    assert_eq!(ensured, vec![expected], "{actions:?}");
    assert!(
        !actions.iter().any(|a| matches!(a, Action::RunTool { .. })),
        "{actions:?}"
    );
}

#[test]
fn a_turn_that_does_not_exist_is_refused_with_the_turns_there_are() {
    let source = finished_source().into_state();
    for turn in [0, 3] {
        let e = fork_state(&source, "uid-src", turn, fork_id()).unwrap_err();
        assert_eq!(
            e,
            ForkError::NoSuchTurn {
                session: SessionId("src".into()),
                turn,
                turns: 2
            }
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!("no agent turn {turn}")) && text.contains("between 1 and 2"),
            "{text}"
        );
    }
}

#[test]
fn results_that_reached_the_source_after_the_fork_point_are_not_carried_over() {
    let source = finished_source().into_state();
    let fork = fork_state(&source, "uid-src", 1, fork_id()).unwrap();
    let later = source.turns.len() - fork.turns.len();
    assert_eq!(later, 1, "the final answer stays with the source");
    let mut with_message = source.clone();
    if let Some(Turn::User(u)) = with_message.turns.get_mut(2) {
        u.message = Some("said after the results".into());
    }
    let fork = fork_state(&with_message, "uid-src", 1, fork_id()).unwrap();
    let Some(Turn::User(u)) = fork.turns.last() else {
        panic!("results")
    };
    assert_eq!(u.message, None);
}
