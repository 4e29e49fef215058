//! `onExceed: ask` in the core (issue 31): a limit reached makes a
//! question to a person (a continuation `waitingFor: budget` showing the
//! spend and the limit); an approval with a raise is kept, so the same
//! limit asks again only at the new bound; a denial fails the session.

use crate::core_budget_session::*;
use agents::core::budget::{Budget, LimitKind, OnExceed, Raise};
use agents::core::session::ToolInfo;
use agents::core::*;
use std::collections::BTreeMap;

fn asking(budget: Budget) -> SessionConfig {
    with_lookup(Budget {
        on_exceed: OnExceed::Ask,
        ..budget
    })
}

/// The budget question the actions make, if any.
fn question(actions: &[Action]) -> Option<&agents::core::session::ContinuationSpec> {
    actions.iter().find_map(|a| match a {
        Action::EnsureContinuation(spec) if spec.waiting_for == WaitingFor::Budget => Some(spec),
        _ => None,
    })
}

fn decide(s: &mut Session, token: &ContinuationToken, approved: bool, raise: Raise) -> Handled {
    let event = Event::BudgetDecided {
        token: token.clone(),
        approved,
        by: "ann".into(),
        reason: (!approved).then(|| "too dear".to_string()),
        raise,
    };
    s.handle(event, T0).unwrap()
}

fn tokens_to(n: u64) -> Raise {
    Raise {
        tokens: Some(n),
        ..Raise::default()
    }
}

/// Spends 100 of a 100-token limit: the next model call asks instead.
fn asked_at_the_limit() -> (Session, ContinuationToken) {
    let mut s = started(asking(Budget {
        tokens: Some(100),
        ..Budget::default()
    }));
    assert_eq!(
        tool_runs(&reply(&mut s, 1, 100, 0)),
        vec![CallId::new(1, 0)]
    );
    let actions = finish(&mut s, CallId::new(1, 0));
    assert!(
        !calls_model(&actions),
        "the limit is reached: no model call"
    );
    let spec = question(&actions).expect("a question to a person");
    assert_eq!(spec.token.0, "demo-budget-0");
    assert_eq!(spec.tool_call.name, "budget");
    let args: serde_json::Value = serde_json::from_str(&spec.tool_call.arguments).unwrap();
    assert_eq!(
        (
            args["limit"].as_str(),
            args["used"].as_u64(),
            args["allowed"].as_u64()
        ),
        (Some("tokens"), Some(100), Some(100))
    );
    assert!(args["spend"].as_str().unwrap().contains("100 tokens"));
    assert!(spec
        .reason
        .as_deref()
        .unwrap()
        .contains("spent 100 of 100 (onExceed: ask)"));
    (s, spec.token.clone())
}

#[test]
fn ask_waits_for_a_person_and_an_approval_raises_the_limit_once() {
    let (mut s, token) = asked_at_the_limit();
    let ask = s.state().budget_ask.clone().expect("an open question");
    assert_eq!(ask.stop.limit, LimitKind::Tokens);
    assert_ne!(s.state().phase, Phase::Failed);
    assert_eq!(s.state().budget_stop, None, "asking is not a pause");
    assert!(
        matches!(s.outlook(T0), Outlook::Waiting { pending, .. } if pending == vec![token.clone()])
    );
    let waiting = conditions::of(s.state())
        .into_iter()
        .find(|c| c.type_ == "Waiting")
        .unwrap();
    assert_eq!(waiting.reason, "AwaitingBudget");

    // Stored and restored: still asking, the same question (adopted, not a new one).
    let mut again = Session::restore(s.state().clone(), s.config().clone(), T0);
    let actions = drain(&mut again);
    assert!(!calls_model(&actions));
    assert_eq!(question(&actions).map(|q| &q.token), Some(&token));

    // An answer to another token is not this question's.
    let other = ContinuationToken("demo-budget-7".into());
    assert_eq!(
        decide(&mut s, &other, true, tokens_to(1000)),
        Handled::Wake(WakeOutcome::Unknown)
    );

    // Approved with a raise to 300: the model is called, the question closed.
    assert_eq!(
        decide(&mut s, &token, true, tokens_to(300)),
        Handled::Wake(WakeOutcome::Applied)
    );
    let actions = drain(&mut s);
    assert!(calls_model(&actions), "{actions:?}");
    assert!(actions.iter().any(|a| matches!(a,
        Action::RecordResult { token: t, result, .. } if t == &token && !result.is_error())));
    assert_eq!(s.state().budget_ask, None);
    assert_eq!(s.state().budget_raise.tokens, Some(300));

    // Below the new bound nothing asks; at it, a new question is asked.
    assert_eq!(
        tool_runs(&reply(&mut s, 1, 150, 0)),
        vec![CallId::new(2, 0)]
    );
    let actions = finish(&mut s, CallId::new(2, 0));
    assert!(calls_model(&actions), "250 of 300: the model is called");
    assert!(question(&actions).is_none());
    assert_eq!(tool_runs(&reply(&mut s, 1, 50, 0)), vec![CallId::new(3, 0)]);
    let actions = finish(&mut s, CallId::new(3, 0));
    assert!(!calls_model(&actions));
    let next = question(&actions).expect("asked again at the new bound");
    assert_eq!(next.token.0, "demo-budget-1");
    assert!(next.reason.as_deref().unwrap().contains("spent 300 of 300"));
}

#[test]
fn a_denial_fails_the_session_with_the_reason() {
    let (mut s, token) = asked_at_the_limit();
    assert_eq!(
        decide(&mut s, &token, false, Raise::default()),
        Handled::Wake(WakeOutcome::Applied)
    );
    let actions = drain(&mut s);
    assert!(!calls_model(&actions));
    assert!(actions.iter().any(|a| matches!(a,
        Action::RecordResult { token: t, result, .. } if t == &token && result.is_error())));
    assert_eq!(s.state().phase, Phase::Failed);
    let failure = s.state().failure.clone().unwrap();
    assert!(
        failure.contains("ann denied going past the limit: too dear"),
        "{failure}"
    );
    assert!(failure.contains("spent 100 of 100"), "{failure}");
}

#[test]
fn an_approval_that_does_not_lift_the_limit_asks_again() {
    let (mut s, token) = asked_at_the_limit();
    decide(&mut s, &token, true, tokens_to(100));
    let actions = drain(&mut s);
    assert!(!calls_model(&actions));
    assert_eq!(
        question(&actions).map(|q| q.token.0.as_str()),
        Some("demo-budget-1")
    );
}

#[test]
fn a_tool_call_limit_asks_before_the_run_past_it() {
    let mut s = started(asking(Budget {
        tool_calls: Some(1),
        ..Budget::default()
    }));
    let actions = reply(&mut s, 2, 10, 0);
    assert_eq!(
        tool_runs(&actions),
        vec![CallId::new(1, 0)],
        "one within the limit"
    );
    let spec = question(&actions).expect("asked about the second");
    let token = spec.token.clone();
    assert!(spec
        .reason
        .as_deref()
        .unwrap()
        .contains("tool calls limit: spent 1 of 1"));
    let actions = finish(&mut s, CallId::new(1, 0));
    assert!(tool_runs(&actions).is_empty() && !calls_model(&actions));
    let raise = Raise {
        tool_calls: Some(2),
        ..Raise::default()
    };
    decide(&mut s, &token, true, raise);
    assert_eq!(tool_runs(&drain(&mut s)), vec![CallId::new(1, 1)]);
}

/// Trees: a sub-agent call's child is started with what the parent has
/// left of its limits, and the child's usage, taken with its answer,
/// counts against the parent's own limits.
#[test]
fn a_child_is_bounded_by_what_its_parent_has_left_and_its_usage_counts_up() {
    let mut tools = BTreeMap::new();
    let helper = ToolInfo {
        sub_agent: Some("helper".into()),
        ..ToolInfo::default()
    };
    tools.insert("helper".to_string(), helper);
    let config = SessionConfig {
        tools,
        budget: Budget {
            tokens: Some(1000),
            tool_calls: Some(5),
            on_exceed: OnExceed::Ask,
            ..Budget::default()
        },
        ..SessionConfig::default()
    };
    let mut s = started(config);
    let turn = AgentTurn {
        text: None,
        tool_calls: vec![ToolCall {
            model_call_id: "m-0".into(),
            name: "helper".into(),
            arguments: r#"{"prompt":"dig"}"#.into(),
        }],
        usage: TokenUsage {
            prompt_tokens: 700,
            ..TokenUsage::default()
        },
        asked_at: None,
        replied_at: None,
    };
    s.handle(Event::ModelReplied { turn }, T0).unwrap();
    let actions = drain(&mut s);
    let (child, envelope) = actions
        .iter()
        .find_map(|a| match a {
            Action::StartSubAgent {
                child, envelope, ..
            } => Some((child, envelope)),
            _ => None,
        })
        .expect("the child starts");
    let left = child.budget.clone().expect("bounded");
    assert_eq!((left.tokens, left.tool_calls), (Some(300), Some(4)));
    assert_eq!(left.on_exceed, OnExceed::Ask);
    // The child spent 400: the parent is at 1100 of 1000, and asks
    // before its next model call.
    let answer = Event::AttemptFinished {
        token: envelope.token.clone(),
        attempt: 1,
        result: ToolResult::text("found it"),
    };
    let usage = TokenUsage {
        prompt_tokens: 400,
        ..TokenUsage::default()
    };
    s.handle(
        Event::ChildAnswered {
            answer: Box::new(answer),
            usage,
        },
        T0,
    )
    .unwrap();
    let actions = drain(&mut s);
    assert_eq!(s.state().usage.total(), 1100);
    assert!(!calls_model(&actions));
    let spec = question(&actions).expect("the parent asks");
    assert!(spec
        .reason
        .as_deref()
        .unwrap()
        .contains("spent 1100 of 1000"));
}
