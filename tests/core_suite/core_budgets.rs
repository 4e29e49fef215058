//! Budgets in the core (issue 31): each turn's usage gets its cost, and
//! the limits on tokens, cost and tool calls are checked before each model
//! call and each tool run, with `onExceed: fail` and `pause`.

use crate::core_budget_session::*;
use agents::core::budget::{Budget, LimitKind, OnExceed, Pricing};
use agents::core::*;

fn config(budget: Budget) -> SessionConfig {
    SessionConfig {
        pricing: Some(Pricing {
            input_micros_per_mtok: 2_000_000,
            output_micros_per_mtok: 10_000_000,
            cached_input_micros_per_mtok: None,
            currency: "USD".into(),
        }),
        ..with_lookup(budget)
    }
}

fn tokens(limit: u64, on_exceed: OnExceed) -> Budget {
    Budget {
        tokens: Some(limit),
        on_exceed,
        ..Budget::default()
    }
}

#[test]
fn each_turn_gets_its_cost_in_micro_units() {
    let mut s = started(config(Budget::default()));
    // 1000 prompt tokens at 2/M and 100 completion tokens at 10/M.
    reply(&mut s, 0, 1000, 100);
    let Some(Turn::Agent(turn)) = s.state().turns.last() else {
        panic!("an agent turn")
    };
    assert_eq!(turn.usage.cost_micros, 2000 + 1000);
    assert_eq!(s.state().usage.cost_micros, 3000);
    assert_eq!(s.state().phase, Phase::Succeeded);
}

#[test]
fn fail_stops_the_next_model_call_once_the_tokens_are_spent() {
    let mut s = started(config(tokens(100, OnExceed::Fail)));
    // Exactly at the limit: the turn's tool still runs (it spends no tokens).
    let actions = reply(&mut s, 1, 90, 10);
    assert_eq!(tool_runs(&actions), vec![CallId::new(1, 0)]);
    let actions = finish(&mut s, CallId::new(1, 0));
    assert!(!calls_model(&actions), "{actions:#?}");
    assert_eq!(s.state().phase, Phase::Failed);
    let failure = s.state().failure.clone().unwrap();
    assert!(
        failure.contains("tokens limit: spent 100 of 100 (onExceed: fail)"),
        "{failure}"
    );
    assert!(failure.contains("spec.limits.tokens"), "{failure}");
}

#[test]
fn a_turn_in_flight_overshoots_by_its_own_usage_and_no_more() {
    let mut s = started(config(tokens(100, OnExceed::Fail)));
    let actions = reply(&mut s, 1, 40, 10);
    finish(&mut s, tool_runs(&actions)[0]);
    // 50 spent: the second call starts and uses 80, ending at 130.
    let actions = reply(&mut s, 2, 70, 10);
    assert!(tool_runs(&actions).is_empty(), "{actions:#?}");
    assert_eq!(s.state().usage.total(), 130);
    assert_eq!(s.state().phase, Phase::Failed);
    assert!(s
        .state()
        .failure
        .as_ref()
        .unwrap()
        .contains("spent 130 of 100"));
}

#[test]
fn cost_limits_speak_the_pricing_currency() {
    let budget = Budget {
        cost_micros: Some(2_500),
        currency: Some("USD".into()),
        ..Budget::default()
    };
    let mut s = started(config(budget));
    // 3000 micro-units: past 0.0025 USD, so the tool does not run.
    let actions = reply(&mut s, 1, 1000, 100);
    assert!(tool_runs(&actions).is_empty());
    let failure = s.state().failure.clone().unwrap();
    assert!(
        failure.contains("cost limit: spent 0.003 USD of 0.0025 USD"),
        "{failure}"
    );
}

#[test]
fn pause_holds_the_model_call_until_the_limit_is_raised() {
    let mut s = started(config(tokens(100, OnExceed::Pause)));
    let actions = reply(&mut s, 1, 90, 20);
    assert!(tool_runs(&actions).is_empty(), "110 > 100: no tool runs");
    let stop = s.state().budget_stop.clone().expect("held");
    assert_eq!(
        (stop.limit, stop.used, stop.allowed),
        (LimitKind::Tokens, 110, 100)
    );
    assert_ne!(s.state().phase, Phase::Failed);
    assert_eq!(s.outlook(T0), Outlook::Paused);
    let paused = conditions::of(s.state())
        .into_iter()
        .find(|c| c.type_ == "Paused")
        .unwrap();
    assert_eq!(
        (paused.status, paused.reason.as_str()),
        (conditions::Status::True, "BudgetExceeded")
    );
    assert!(paused
        .message
        .contains("spent 110 of 100 (onExceed: pause)"));

    // Stored and restored under the same limit: still held, nothing starts.
    let stored = s.state().clone();
    let mut again = Session::restore(stored.clone(), config(tokens(100, OnExceed::Pause)), T0);
    assert!(tool_runs(&drain(&mut again)).is_empty());
    assert!(again.state().budget_stop.is_some());

    // Raised: the hold lifts and the tool runs, then the model is called.
    let mut s = Session::restore(stored, config(tokens(1000, OnExceed::Pause)), T0);
    let actions = drain(&mut s);
    assert_eq!(tool_runs(&actions), vec![CallId::new(1, 0)]);
    assert_eq!(s.state().budget_stop, None);
    assert!(calls_model(&finish(&mut s, CallId::new(1, 0))));
}

#[test]
fn a_tool_call_limit_starts_only_the_calls_within_it() {
    let budget = Budget {
        tool_calls: Some(2),
        on_exceed: OnExceed::Pause,
        ..Budget::default()
    };
    let mut s = started(config(budget.clone()));
    let actions = reply(&mut s, 3, 10, 10);
    assert_eq!(
        tool_runs(&actions),
        vec![CallId::new(1, 0), CallId::new(1, 1)],
        "the third call would be the third run"
    );
    assert_eq!(s.state().tool_calls, 2);
    let stop = s.state().budget_stop.clone().expect("held");
    assert_eq!(
        (stop.limit, stop.used, stop.allowed),
        (LimitKind::ToolCalls, 2, 2)
    );
    finish(&mut s, CallId::new(1, 0));
    let actions = finish(&mut s, CallId::new(1, 1));
    assert!(!calls_model(&actions) && tool_runs(&actions).is_empty());

    let raised = Budget {
        tool_calls: Some(3),
        ..budget
    };
    let mut s = Session::restore(s.state().clone(), config(raised), T0);
    assert_eq!(tool_runs(&drain(&mut s)), vec![CallId::new(1, 2)]);
    assert_eq!(s.state().tool_calls, 3);
}

#[test]
fn a_tool_call_limit_with_fail_starts_none_of_the_turn_past_it() {
    let budget = Budget {
        tool_calls: Some(1),
        ..Budget::default()
    };
    let mut s = started(config(budget));
    let actions = reply(&mut s, 2, 10, 10);
    assert!(tool_runs(&actions).is_empty(), "{actions:#?}");
    assert!(actions.iter().any(|a| matches!(a, Action::Failed { reason } if reason.contains("tool calls limit: spent 1 of 1"))));
}
