//! MCP tasks: polled at their interval, requests for input, cancelled past their timeout, and background calls that become tasks.

use super::*;

#[tokio::test]
async fn a_call_that_becomes_an_mcp_task_is_polled_at_its_interval_and_runs_once() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["long"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    tools.task_polls_left.store(2, Ordering::SeqCst);
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    let first = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    // The run became a task: the driver comes back at the server's interval.
    assert_eq!(first.outcome, StepOutcome::Busy { at: Millis(4_000) });
    let call = store.state().open.unwrap().calls[0].clone();
    assert_eq!(call.waiting_for(), Some(WaitingFor::McpTask));
    assert_eq!(call.task().map(|t| t.poll_ms), Some(3_000));
    let cont = store.continuations.lock().unwrap().clone();
    let rec = cont.values().next().expect("the task's continuation");
    assert_eq!(rec.spec.waiting_for, WaitingFor::McpTask);
    let saves = store.saves.load(Ordering::SeqCst);
    // A poll that finds the task working writes nothing.
    clock.sleep_until(Millis(4_000)).await;
    let working = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(working.outcome, StepOutcome::Busy { at: Millis(7_000) });
    assert_eq!(
        store.saves.load(Ordering::SeqCst),
        saves,
        "no write while it works"
    );
    let outcome = run_to_end(&p, &runtime(), &clock, 4).await;
    assert_succeeded(&outcome);
    assert_eq!(
        first_result(&store),
        Some(ToolResult::text("the long task's answer"))
    );
    assert_eq!(
        tools.runs.lock().unwrap().values().sum::<u32>(),
        1,
        "tools/call once"
    );
    assert_eq!(
        tools.polled.lock().unwrap().len(),
        3,
        "two polls working, one ended"
    );
    let cont = store.continuations.lock().unwrap().clone();
    let rec = cont.values().next().unwrap();
    assert_eq!(
        rec.completed_by.as_deref(),
        Some(crate::core::session::TASK_BY)
    );
    assert_eq!(rec.result, Some(ToolResult::text("the long task's answer")));
}

#[tokio::test]
async fn a_tasks_request_for_input_stands_until_the_server_says_otherwise() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["long"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    tools.poll_script.lock().unwrap().extend([
        TaskPoll::AsksForInput(r#"{"q1":{}}"#.into()),
        TaskPoll::NoNews,
        TaskPoll::Working,
    ]);
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    let asks = |store: &MemStore| {
        store.state().open.unwrap().calls[0]
            .task_asks()
            .map(str::to_string)
    };
    step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    clock.sleep_until(Millis(4_000)).await;
    step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(asks(&store).as_deref(), Some(r#"{"q1":{}}"#));
    let saves = store.saves.load(Ordering::SeqCst);
    // A step between polls (or a poll that did not get through) hears
    // nothing new: the question stays shown and nothing is written.
    step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(asks(&store).as_deref(), Some(r#"{"q1":{}}"#));
    assert_eq!(store.saves.load(Ordering::SeqCst), saves);
    // The server working again means the request is no longer open.
    step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(asks(&store), None);
}

#[tokio::test]
async fn an_mcp_task_past_its_timeout_is_cancelled_and_the_model_told() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["long"]), text("gave up")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    tools.task_polls_left.store(1_000, Ordering::SeqCst);
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    let mut timed = rule("long", crate::core::Disposition::RunSync);
    timed.decorators.timeout_seconds = Some(10);
    rt.config.policy.rules.push(timed);
    let outcome = run_to_end(&p, &rt, &clock, 10).await;
    assert_succeeded(&outcome);
    let told = first_result(&store).expect("the model was told");
    assert!(
        told.to_model_text()
            .contains("timed out after 10s waiting for its MCP task"),
        "{told:?}"
    );
    let polled = tools.polled.lock().unwrap().clone();
    assert_eq!(
        tools.cancelled.lock().unwrap().clone(),
        vec![polled[0].clone()]
    );
}

#[tokio::test]
async fn a_background_call_that_becomes_an_mcp_task_waits_on_it() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["long"]), text("done")]);
    let (tools, clock) = (TaskRunner::default(), ManualClock::at(Millis(1_000)));
    let p = Ports {
        runner: &tools,
        ..ports(&store, &model, &tools.0, &clock)
    };
    let mut rt = runtime();
    rt.config
        .policy
        .rules
        .push(rule("long", crate::core::Disposition::RunAsync));
    let outcome = run_to_end(&p, &rt, &clock, 6).await;
    assert_succeeded(&outcome);
    assert_eq!(
        first_result(&store),
        Some(ToolResult::text("the long task's answer"))
    );
    assert_eq!(
        store.continuations.lock().unwrap().len(),
        1,
        "a runAsync call that became a task has a continuation"
    );
}

/// A runner whose background runs are answered with a task handle.
#[derive(Default)]
struct TaskRunner(Tools);

impl RunnerPort for TaskRunner {
    fn start<'a>(
        &'a self,
        _: RunKind<'a>,
        envelope: &'a crate::core::envelope::CallEnvelope,
        _: u32,
        _: std::time::Duration,
    ) -> BoxFuture<'a, RunStatus> {
        let id = format!("task-{}", envelope.context.idempotency_key);
        Box::pin(
            async move { RunStatus::Task(crate::core::call::TaskHandle { id, poll_ms: 1_500 }) },
        )
    }
}
