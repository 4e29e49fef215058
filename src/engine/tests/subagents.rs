//! A sub-agent call through the engine: the runner is asked for the child
//! the core planned (after the claim's checkpoint), a child under way is a
//! wait, and the child's answer is the call's result, taken once.

use super::*;
use crate::core::session::ToolInfo;
use std::sync::atomic::AtomicUsize;

/// A runner whose children run for `steps_running` starts, then answer.
#[derive(Default)]
struct Children {
    seen: Mutex<Vec<(String, String, u32)>>,
    traceparents: Mutex<Vec<Option<String>>>,
    steps_running: AtomicUsize,
}

impl RunnerPort for Children {
    fn start<'a>(
        &'a self,
        kind: RunKind<'a>,
        _: &'a crate::core::envelope::CallEnvelope,
        _: u32,
        _: std::time::Duration,
    ) -> BoxFuture<'a, RunStatus> {
        let RunKind::SubAgent(child) = kind else {
            panic!("only sub-agent calls here: {kind:?}")
        };
        let plan = (child.name.clone(), child.prompt.clone(), child.depth);
        self.seen.lock().unwrap().push(plan);
        let traceparent = child.traceparent.clone();
        self.traceparents.lock().unwrap().push(traceparent);
        let running = self
            .steps_running
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            if running {
                RunStatus::InFlight
            } else {
                RunStatus::Finished(ToolResult::text("the child's answer"))
            }
        })
    }

    fn child_usage<'a>(
        &'a self,
        _: &'a crate::core::session::subagent::ChildPlan,
    ) -> BoxFuture<'a, Option<crate::core::TokenUsage>> {
        Box::pin(async { Some(CHILD_USAGE) })
    }
}

impl Children {
    /// The `traceparent` the first child was made with.
    fn first_traceparent(&self) -> crate::ports::TraceContext {
        let given = self.traceparents.lock().unwrap()[0].clone();
        crate::ports::TraceContext::parse(&given.expect("a traceparent")).unwrap()
    }
}

/// A session whose model asks the `researcher` sub-agent to "dig", then
/// answers "done".
fn asks_the_researcher_to_dig() -> (MemStore, Script) {
    let store = MemStore::with_session(&["hi"]);
    let mut ask = calls(&["researcher"]);
    ask.tool_calls[0].arguments = r#"{"prompt":"dig"}"#.into();
    (store, Script::new(vec![ask, text("done")]))
}

/// The spans of the `researcher` calls among `steps`.
fn researcher_spans(
    steps: &[crate::ports::trace::StepTrace],
) -> Vec<&crate::ports::trace::ToolSpan> {
    steps
        .iter()
        .flat_map(|s| &s.tools)
        .filter(|t| t.tool == "researcher")
        .collect()
}

/// What each child spent, as the runner reports it once the child ended.
const CHILD_USAGE: crate::core::TokenUsage = crate::core::TokenUsage {
    prompt_tokens: 100,
    completion_tokens: 40,
    cached_prompt_tokens: 0,
    cost_micros: 0,
};

#[tokio::test]
async fn a_childs_answer_is_the_calls_result_and_the_child_is_asked_for_by_name() {
    let (store, model) = asks_the_researcher_to_dig();
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let children = Children {
        steps_running: AtomicUsize::new(1),
        ..Children::default()
    };
    let mut p = ports(&store, &model, &tools, &clock);
    p.runner = &children;
    let (rt, holder) = (with_researcher(runtime()), Holder::named("h"));
    let first = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert!(
        matches!(first.outcome, StepOutcome::Waiting { .. }),
        "a child under way is a wait: {:?}",
        first.outcome
    );
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert_succeeded(&outcome);
    let seen = children.seen.lock().unwrap().clone();
    assert_eq!(seen[0], ("s-t1-c0".to_string(), "dig".to_string(), 1));
    assert!(seen.iter().all(|s| s == &seen[0]), "one child: {seen:?}");
    assert_eq!(
        first_result(&store),
        Some(ToolResult::text("the child's answer"))
    );
    // The parent's usage: its own turns and, once, the child's.
    let state = store.state();
    let own: u64 = state
        .turns
        .iter()
        .filter_map(|t| match t {
            crate::core::Turn::Agent(a) => Some(a.usage.total()),
            _ => None,
        })
        .sum();
    assert_eq!(state.usage.total(), own + CHILD_USAGE.total());
}

/// Keeps the steps it is given; each fresh context is new.
#[derive(Default)]
struct Traces {
    steps: Mutex<Vec<crate::ports::trace::StepTrace>>,
    next: std::sync::atomic::AtomicU8,
}

impl crate::ports::TracePort for Traces {
    fn fresh_context(&self) -> Option<crate::ports::TraceContext> {
        let n = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        Some(crate::ports::TraceContext {
            trace_id: [n; 16],
            span_id: [n; 8],
            sampled: true,
        })
    }
    fn export(&self, step: crate::ports::trace::StepTrace) {
        self.steps.lock().unwrap().push(step);
    }
}

fn with_researcher(mut rt: AgentRuntime) -> AgentRuntime {
    rt.config.tools.insert(
        "researcher".into(),
        ToolInfo {
            container: None,
            sub_agent: Some("researcher".into()),
            unknown_outcome: None,
        },
    );
    rt
}

/// A tree is one trace: the child is made with the `traceparent` of the
/// parent's span for the call (in the parent's trace), and the span the
/// parent exports for the child's answer has exactly that id.
#[tokio::test]
async fn a_child_is_made_under_the_span_of_its_call() {
    let (store, model) = asks_the_researcher_to_dig();
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let (children, traces) = (Children::default(), Traces::default());
    let mut p = ports(&store, &model, &tools, &clock);
    p.runner = &children;
    p.tracer = &traces;
    let outcome = run_to_end(&p, &with_researcher(runtime()), &clock, 4).await;
    assert_succeeded(&outcome);
    let given = children.first_traceparent();
    let steps = traces.steps.lock().unwrap().clone();
    assert!(steps.iter().all(|s| s.context.trace_id == given.trace_id));
    let call_spans = researcher_spans(&steps);
    assert_eq!(call_spans.len(), 1, "{call_spans:?}");
    assert_eq!(call_spans[0].span_id, Some(given.span_id));
    assert!(
        steps.iter().all(|s| s.parent.is_none()),
        "the root has no parent span"
    );
}

/// A child's steps join the trace its `spec.parent` names, each step span
/// under the parent's call span.
#[tokio::test]
async fn a_childs_steps_go_under_its_parents_call_span() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![text("the answer")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let traces = Traces::default();
    let mut p = ports(&store, &model, &tools, &clock);
    p.tracer = &traces;
    let parent = "00-0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a-0b0b0b0b0b0b0b0b-01";
    let mut rt = runtime();
    rt.config.lineage.trace_parent = Some(parent.into());
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert_succeeded(&outcome);
    let parent = crate::ports::TraceContext::parse(parent).unwrap();
    let steps = traces.steps.lock().unwrap().clone();
    assert!(!steps.is_empty());
    for s in &steps {
        assert_eq!(s.context.trace_id, parent.trace_id);
        assert_eq!(s.parent, Some(parent));
    }
}

/// The child's answer read from the call's Continuation (where a step
/// wrote it after the runner brought it, the step then lost before its
/// checkpoint, as a crash loses it) gets the same span: the parent's span
/// for the call has the id its child was given, so the child's steps stay
/// under it.
#[tokio::test]
async fn a_childs_answer_read_from_the_calls_continuation_has_the_span_its_child_was_given() {
    let (store, model) = asks_the_researcher_to_dig();
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let children = Children {
        steps_running: AtomicUsize::new(usize::MAX),
        ..Children::default()
    };
    let traces = Traces::default();
    let mut p = ports(&store, &model, &tools, &clock);
    p.runner = &children;
    p.tracer = &traces;
    let (rt, holder) = (with_researcher(runtime()), Holder::named("h"));
    let first = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert!(matches!(first.outcome, StepOutcome::Waiting { .. }));
    let given = children.first_traceparent();

    let token = store.state().pending()[0].token().unwrap().clone();
    store
        .complete(
            &token,
            &ToolResult::text("from the continuation"),
            crate::core::acceptance::ENGINE_BY,
            Millis(2_000),
        )
        .await
        .unwrap();
    clock.advance(5_000);
    let outcome = run_to_end(&p, &rt, &clock, 4).await;
    assert_succeeded(&outcome);
    assert_eq!(
        first_result(&store),
        Some(ToolResult::text("from the continuation"))
    );
    let steps = traces.steps.lock().unwrap().clone();
    let call_spans = researcher_spans(&steps);
    assert_eq!(call_spans.len(), 1, "{call_spans:?}");
    // Taken from the Continuation (the engine wrote it there), not run.
    let replayed = crate::ports::trace::ResultSource::Replayed;
    assert_eq!(call_spans[0].source, replayed, "the Continuation's path");
    assert_eq!(call_spans[0].span_id, Some(given.span_id));
    assert!(steps.iter().all(|s| s.context.trace_id == given.trace_id));
}
