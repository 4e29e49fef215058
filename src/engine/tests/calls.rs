//! Calls: results served from the cache, retries after their backoff, timeouts of deferred calls, the session deadline, the driver's default timeout.

use super::*;

#[tokio::test]
async fn a_cached_result_is_served_without_running_the_tool_again() {
    let store = cached_twice(crate::core::Disposition::RunSync, "lookup done").await;
    assert!(store.continuations.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_cached_background_result_is_served_and_needs_no_continuation() {
    let store = cached_twice(crate::core::Disposition::RunAsync, "ran").await;
    assert!(
        store.continuations.lock().unwrap().is_empty(),
        "a runAsync call run by the driver costs no continuation"
    );
}

/// Two turns call `lookup` under `disposition` with the cache on: the tool
/// runs once (answering `ran`), the second call is served from the cache.
async fn cached_twice(disposition: crate::core::Disposition, ran: &str) -> MemStore {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["lookup"]), calls(&["lookup"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    let mut cached = rule("lookup", disposition);
    cached.decorators.cache = true;
    rt.config.policy.rules.push(cached);
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert_succeeded(&outcome);
    let runs = tools.runs.lock().unwrap().clone();
    assert_eq!(
        runs.values().sum::<u32>(),
        1,
        "the second call came from the cache: {runs:?}"
    );
    let results: Vec<_> = store
        .state()
        .turns
        .iter()
        .filter_map(|t| match t {
            crate::core::Turn::User(u) => u.tool_results.first().map(|r| r.result.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(results, vec![ToolResult::text(ran); 2]);
    store
}

#[tokio::test]
async fn a_failed_attempt_is_retried_after_its_backoff_then_recorded() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["later"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    tools.failing.store(1, Ordering::SeqCst);
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    let mut retried = rule("later", crate::core::Disposition::RunAsync);
    retried.decorators.retries = 1;
    rt.config.policy.rules.push(retried);
    let outcome = run_to_end(&p, &rt, &clock, 6).await;
    assert_succeeded(&outcome);
    let runs = tools.runs.lock().unwrap().clone();
    assert_eq!(
        runs.values().copied().collect::<Vec<_>>(),
        vec![2],
        "one key, two attempts"
    );
    assert!(clock.now().0 > 1_000, "the retry waited for its backoff");
}

#[tokio::test]
async fn a_deferred_call_past_its_timeout_tells_the_model() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["ask"]), text("gave up")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    let mut timed = rule(
        "ask",
        crate::core::Disposition::Defer {
            reason: "a person".into(),
        },
    );
    timed.decorators.timeout_seconds = Some(30);
    rt.config.policy.rules.push(timed);
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert_succeeded(&outcome);
    assert!(
        clock.now().0 >= 31_000,
        "woke at the timeout: {:?}",
        clock.now()
    );
    assert_eq!(model.calls(), 2);
    let state = store.state();
    let timed_out = state.turns.iter().find_map(|t| match t {
        crate::core::Turn::User(u) => u.tool_results.first().map(|r| r.result.clone()),
        _ => None,
    });
    assert!(
        matches!(timed_out, Some(ToolResult::Error { .. })),
        "{timed_out:?}"
    );
    assert_eq!(
        tools.runs.lock().unwrap().len(),
        0,
        "a deferred call runs nothing here"
    );
}

#[tokio::test]
async fn the_session_deadline_fails_a_waiting_session() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["ask"]), text("never")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    rt.config.policy.rules.push(rule(
        "ask",
        crate::core::Disposition::Defer {
            reason: "a person".into(),
        },
    ));
    rt.config.limits.deadline = Some(Millis(11_000));
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert!(matches!(outcome, StepOutcome::Failed { .. }), "{outcome:?}");
    assert!(clock.now().0 >= 11_000);
    assert_eq!(model.calls(), 1, "the model is not asked past the deadline");
}

#[tokio::test]
async fn a_tool_without_a_timeout_gets_the_drivers_default() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["now", "later"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    rt.config.default_tool_timeout_secs = 42;
    rt.config
        .policy
        .rules
        .push(rule("later", crate::core::Disposition::RunAsync));
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert_succeeded(&outcome);
    let given = tools.timeouts.lock().unwrap().clone();
    assert_eq!(given, vec![std::time::Duration::from_secs(42); 2]);
}
