//! A namespace Budget before each model call: spent, the session waits
//! (`waitingFor: budget`) and no model call starts; raised, it goes on.

use super::*;
use crate::core::shared_budget::SharedBudget;

fn team(used: u64, limit: u64) -> SharedBudget {
    SharedBudget {
        name: "team".into(),
        tokens: Some(limit),
        used_tokens: used,
        ..SharedBudget::default()
    }
}

#[tokio::test]
async fn a_spent_budget_holds_the_model_call_and_a_raise_lets_it_go() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["lookup"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    rt.config
        .policy
        .rules
        .push(rule("lookup", crate::core::Disposition::RunSync));
    rt.config.shared_budgets = vec![team(1_000, 1_000)];
    let holder = Holder::named("h");
    let report = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert_eq!(model.calls(), 0, "no model call past a spent Budget");
    assert!(
        matches!(report.outcome, StepOutcome::Paused),
        "{:?}",
        report.outcome
    );
    let stored = store.state();
    let spent = stored.budget_exhausted.clone().expect("recorded");
    assert_eq!(spent.budget, "team");
    assert!(
        spent.message.contains("used 1000 of 1000 tokens"),
        "{}",
        spent.message
    );
    let waiting = crate::core::conditions::of(&stored)
        .into_iter()
        .find(|c| c.type_ == "Waiting")
        .unwrap();
    assert_eq!(waiting.reason, "BudgetExhausted");
    // Stepping again with the Budget still spent writes nothing new.
    let saves = store.saves.load(Ordering::SeqCst);
    step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert_eq!(store.saves.load(Ordering::SeqCst), saves);
    assert_eq!(model.calls(), 0);
    // Raised: the session goes on, one model call a step (the driver
    // counts each turn before the next is checked).
    rt.config.shared_budgets = vec![team(1_000, 5_000)];
    let report = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert_eq!(model.calls(), 1);
    assert!(
        matches!(report.outcome, StepOutcome::Busy { .. }),
        "{:?}",
        report.outcome
    );
    assert_eq!(store.state().budget_exhausted, None);
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
    assert_eq!(model.calls(), 2);
}

/// The driver's copy of the Budget does not show the session's last
/// charge yet (800 used, none of it this session's): the check counts the
/// 300 tokens the session has spent since, and the next model call waits.
#[tokio::test]
async fn the_sessions_own_last_turn_counts_before_the_budget_shows_it() {
    let store = MemStore::with_session(&["hi"]);
    let mut first = calls(&["lookup"]);
    first.usage = crate::core::TokenUsage {
        prompt_tokens: 250,
        completion_tokens: 50,
        ..Default::default()
    };
    let model = Script::new(vec![first, text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    rt.config
        .policy
        .rules
        .push(rule("lookup", crate::core::Disposition::RunSync));
    rt.config.shared_budgets = vec![team(800, 1_000)];
    let holder = Holder::named("h");
    step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert_eq!(model.calls(), 1);
    assert_eq!(store.state().usage.total(), 300);
    // The same stale copy: 800 + its own 300 reaches the limit.
    let report = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert_eq!(model.calls(), 1, "no second call past the Budget");
    assert!(
        matches!(report.outcome, StepOutcome::Paused),
        "{:?}",
        report.outcome
    );
    let spent = store.state().budget_exhausted.expect("recorded");
    assert!(
        spent.message.contains("used 1100 of 1000 tokens"),
        "{}",
        spent.message
    );
}
