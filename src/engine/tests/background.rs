//! Background runs taken in the step that started them.

use super::*;

/// A runner whose background runs are under way at their first start and
/// done at the next (`quick`), or never done.
#[derive(Default)]
struct Runs {
    quick: bool,
    starts: AtomicU32,
}

impl RunnerPort for Runs {
    fn start<'a>(
        &'a self,
        _: RunKind<'a>,
        _: &'a crate::core::envelope::CallEnvelope,
        _: u32,
        _: std::time::Duration,
    ) -> BoxFuture<'a, RunStatus> {
        let n = self.starts.fetch_add(1, Ordering::SeqCst);
        let done = self.quick && n > 0;
        Box::pin(async move {
            match done {
                true => RunStatus::Finished(ToolResult::text("ran")),
                false => RunStatus::InFlight,
            }
        })
    }

    fn collect<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a crate::core::envelope::CallEnvelope,
        attempt: u32,
    ) -> BoxFuture<'a, RunStatus> {
        self.start(kind, envelope, attempt, std::time::Duration::ZERO)
    }
}

/// The requested flow's shape: a runSync and a runAsync call, then the
/// answer. Its writes in one step, and the outcome.
async fn flow_with(runs: &Runs) -> (StepOutcome, u32) {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["now", "later"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = Ports {
        runner: runs,
        ..ports(&store, &model, &tools, &clock)
    };
    let mut rt = runtime();
    rt.config
        .policy
        .rules
        .push(rule("later", crate::core::Disposition::RunAsync));
    let report = step(&p, &id(), &rt, &Holder::named("h"), Roles::ALL)
        .await
        .unwrap();
    (report.outcome, report.writes)
}

#[tokio::test]
async fn a_quick_background_run_is_taken_in_the_step_that_started_it() {
    let quick = Runs {
        quick: true,
        ..Runs::default()
    };
    let (outcome, writes) = flow_with(&quick).await;
    assert_succeeded(&outcome);
    // The model's claim, the reply with the calls' claims, the results
    // with the next claim, the answer: no write records the wait.
    assert_eq!(writes, 4);
    assert_eq!(
        quick.starts.load(Ordering::SeqCst),
        2,
        "started once, collected once"
    );
    let slow = Runs::default();
    let (outcome, writes) = flow_with(&slow).await;
    assert!(
        matches!(outcome, StepOutcome::Waiting { .. }),
        "{outcome:?}"
    );
    assert_eq!(writes, 3, "a run still going is waited for by a later step");
    assert_eq!(
        slow.starts.load(Ordering::SeqCst),
        2,
        "one more look, no more"
    );
}
