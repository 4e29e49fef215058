//! The store's rules: conflicts replayed, a store away waited out (and past patience), claims between racing drivers, the fence, nothing to do writing nothing, states too large or refused.

use super::*;

#[tokio::test]
async fn a_lost_compare_and_swap_replays_the_model_reply_instead_of_asking_again() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![text("hello")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    // The claim commits; the checkpoint carrying the reply loses to another
    // writer: the step reloads and replays the reply onto what it finds.
    store.inject([Fault::Pass, Fault::Conflict]);
    let holder = Holder::named("cli/test/1/1");
    let report = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(
        store.saves.load(Ordering::SeqCst),
        3,
        "claim, lost, replayed"
    );
    assert!(
        matches!(&report.outcome, StepOutcome::Succeeded { answer } if answer == "hello"),
        "{:?}",
        report.outcome
    );
    assert_eq!(model.calls(), 1, "the reply was replayed, not asked again");
}

#[tokio::test]
async fn a_briefly_unavailable_store_is_waited_out_and_nothing_is_asked_twice() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["lookup"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    // Every checkpoint meets three failures first (an API server restart).
    store.inject(std::iter::repeat_n(Fault::Unavailable, 3));
    let report = step(&p, &id(), &runtime(), &Holder::named("h"), Roles::ALL)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, StepOutcome::Succeeded { .. }),
        "{:?}",
        report.outcome
    );
    assert_eq!(model.calls(), 2);
    assert_eq!(tools.runs.lock().unwrap().values().sum::<u32>(), 1);
    // The waits were on the step's clock, not real time.
    assert!(clock.now().0 >= 1_000 + 200 + 400 + 800);
}

#[tokio::test]
async fn a_store_away_between_a_tool_run_and_its_next_write_runs_the_tool_once() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["now", "later"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    rt.config.policy.rules.push(crate::core::policy::Rule {
        tool: "later".into(),
        disposition: crate::core::Disposition::RunAsync,
        decorators: Default::default(),
    });
    // `now` ran in the step; the continuation of `later` cannot be written
    // for a while (the API server restarts).
    store.ensure_faults.store(4, Ordering::SeqCst);
    let holder = Holder::named("h");
    // Stepped again as a driver would after a failed step, until done.
    let mut outcome = None;
    for _ in 0..8 {
        match step(&p, &id(), &rt, &holder, Roles::ALL).await {
            Ok(r) if matches!(r.outcome, StepOutcome::Succeeded { .. }) => {
                outcome = Some(r.outcome);
                break;
            }
            _ => continue,
        }
    }
    assert!(outcome.is_some(), "the session never finished");
    let runs = tools.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(runs.values().all(|n| *n == 1), "each tool once: {runs:?}");
}

#[tokio::test]
async fn a_store_away_past_the_patience_fails_the_step_with_its_error() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![text("hello")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(0)));
    let p = ports(&store, &model, &tools, &clock);
    store.inject(std::iter::repeat_n(Fault::Unavailable, 1_000));
    let err = step(&p, &id(), &runtime(), &Holder::named("h"), Roles::ALL)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, EngineError::Store(e) if e.is_transient()),
        "{err}"
    );
    assert!(clock.now().0 < CHECKPOINT_PATIENCE.as_millis() as i64 + 3_000);
    assert_eq!(model.calls(), 0, "no model call before its claim committed");
}

/// A model that, while answering driver A, lets driver B step the same
/// session: B must see A's committed claim and leave the model alone.
struct Racer<'a> {
    inner: Script,
    other: &'a (dyn Fn() -> BoxFuture<'a, StepReport> + Sync),
    seen: Mutex<Option<StepReport>>,
}

impl ModelPort for Racer<'_> {
    fn reply<'a>(
        &'a self,
        input: ModelInput<'a>,
    ) -> BoxFuture<'a, Result<AgentTurn, ModelFailure>> {
        Box::pin(async move {
            let b = (self.other)().await;
            *self.seen.lock().unwrap() = Some(b);
            self.inner.reply(input).await
        })
    }
}

#[tokio::test]
async fn a_second_driver_leaves_claimed_work_alone() {
    let store = MemStore::with_session(&["hi"]);
    let b_model = Script::new(vec![text("from b")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let rt = runtime();
    let b_ports = ports(&store, &b_model, &tools, &clock);
    let b_holder = Holder::named("operator/b/1");
    let other = || -> BoxFuture<'_, StepReport> {
        Box::pin(async {
            step(&b_ports, &id(), &rt, &b_holder, Roles::ALL)
                .await
                .unwrap()
        })
    };
    let a_model = Racer {
        inner: Script::new(vec![text("from a")]),
        other: &other,
        seen: Mutex::new(None),
    };
    let a_ports = ports(&store, &a_model, &tools, &clock);
    let report = step(
        &a_ports,
        &id(),
        &rt,
        &Holder::named("operator/a/1"),
        Roles::ALL,
    )
    .await
    .unwrap();
    let b = a_model.seen.lock().unwrap().take().expect("b stepped");
    assert_eq!(
        b_model.calls(),
        0,
        "b asked the model while a held the claim"
    );
    assert!(
        matches!(b.outcome, StepOutcome::Busy { .. }),
        "{:?}",
        b.outcome
    );
    assert_eq!(b.writes, 0, "b wrote nothing");
    assert!(
        matches!(&report.outcome, StepOutcome::Succeeded { answer } if answer == "from a"),
        "{:?}",
        report.outcome
    );
}

#[derive(Debug)]
struct Closed;
impl holder::Fence for Closed {
    fn check(&self) -> Result<(), String> {
        Err("the Lease lapsed".into())
    }
}

#[tokio::test]
async fn a_fenced_driver_starts_no_work() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![text("hello")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(0)));
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("operator/x/1").with_fence(Arc::new(Closed));
    let err = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::Fenced { .. }), "{err}");
    assert_eq!(model.calls(), 0);
}

#[tokio::test]
async fn a_step_with_nothing_to_do_writes_nothing() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![text("hello")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(0)));
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    let saves = store.saves.load(Ordering::SeqCst);
    let again = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(again.writes, 0);
    assert_eq!(store.saves.load(Ordering::SeqCst), saves, "no save at all");
    assert_eq!(model.calls(), 1);
    assert!(store.state().turns.len() >= 2);
}

/// Steps once: the store refuses the step's state with an error `refusal`
/// accepts.
async fn step_is_refused(p: &Ports<'_>, holder: &Holder, refusal: fn(&StoreError) -> bool) {
    let refused = step(p, &id(), &runtime(), holder, Roles::ALL).await;
    assert!(
        matches!(&refused, Err(EngineError::Store(e)) if refusal(e)),
        "{refused:?}"
    );
}

/// Steps again: the session is found failed.
async fn next_step_finds_it_failed(p: &Ports<'_>, holder: &Holder) {
    let report = step(p, &id(), &runtime(), holder, Roles::ALL)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, StepOutcome::Failed { .. }),
        "{:?}",
        report.outcome
    );
}

#[tokio::test]
async fn a_state_too_large_to_store_fails_the_session_and_asks_nothing_again() {
    let mut store = MemStore::with_session(&["hi"]);
    store.max_record_bytes = Some(4_000);
    let model = Script::new(vec![text(&"long answer ".repeat(1_000))]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    step_is_refused(&p, &holder, |e| matches!(e, StoreError::TooLarge { .. })).await;
    let stored = store.state();
    assert_eq!(stored.phase, crate::core::Phase::Failed);
    let why = stored.failure.unwrap();
    assert!(why.contains("outgrew its store"), "{why}");
    // The next step finds it failed: the model is not asked again.
    next_step_finds_it_failed(&p, &holder).await;
    assert_eq!(model.calls(), 1);
}

/// A state the store refuses as invalid fails the session once, with the
/// way out; the tools that ran for it are not run again and again.
#[tokio::test]
async fn a_state_the_store_refuses_fails_the_session_and_runs_nothing_again() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["lookup"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    // The claim and the reply commit; the checkpoint after the tool run is refused.
    store.inject([Fault::Pass, Fault::Pass, Fault::Refused]);
    step_is_refused(&p, &holder, |e| matches!(e, StoreError::Refused { .. })).await;
    let stored = store.state();
    assert_eq!(stored.phase, crate::core::Phase::Failed);
    let why = stored.failure.unwrap();
    assert!(
        why.contains("the store refused the session's state")
            && why.contains("kubectl apply -f crds/"),
        "{why}"
    );
    next_step_finds_it_failed(&p, &holder).await;
    assert_eq!(
        tools.runs.lock().unwrap().values().sum::<u32>(),
        1,
        "the tool ran once"
    );
}

/// A message whose turn cannot be stored (as with a spec that leaves no
/// room) fails the session once: the next step does not take it again.
#[tokio::test]
async fn a_message_too_large_to_store_is_taken_once() {
    let long = "long message ".repeat(200);
    let mut store = MemStore::with_session(&[&long]);
    let stored = serde_json::to_string(&store.session.lock().unwrap().as_ref().unwrap().0);
    store.max_record_bytes = Some(stored.unwrap().len() + 1_000);
    let model = Script::new(vec![text("never asked")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    step_is_refused(&p, &holder, |e| matches!(e, StoreError::TooLarge { .. })).await;
    let stored = store.state();
    assert_eq!(
        (stored.phase, stored.messages_taken),
        (crate::core::Phase::Failed, 1)
    );
    let saves = store.saves.load(Ordering::SeqCst);
    next_step_finds_it_failed(&p, &holder).await;
    assert_eq!(
        store.saves.load(Ordering::SeqCst),
        saves,
        "nothing written again"
    );
    assert_eq!(model.calls(), 0);
}
