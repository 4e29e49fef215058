//! The spans a step records (`engine::spans`), over the same in-memory
//! ports: one trace per session with a link from each step to the one
//! before, no span for a look that did nothing, cached and outside
//! results never reported as runs, content only when asked and never an
//! idempotency key.

use super::*;
use crate::ports::trace::{ResultSource, StepTrace, TraceContext, TracePort};
use std::sync::atomic::AtomicU8;

/// A trace port that keeps what it is given; ids count up.
#[derive(Default)]
struct Kept {
    steps: Mutex<Vec<StepTrace>>,
    next: AtomicU8,
    content: bool,
}

impl TracePort for Kept {
    fn fresh_context(&self) -> Option<TraceContext> {
        let n = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        Some(TraceContext {
            trace_id: [n; 16],
            span_id: [n; 8],
            sampled: true,
        })
    }
    fn records_content(&self) -> bool {
        self.content
    }
    fn export(&self, step: StepTrace) {
        self.steps.lock().unwrap().push(step);
    }
}

impl Kept {
    fn steps(&self) -> Vec<StepTrace> {
        self.steps.lock().unwrap().clone()
    }
}

/// Tools that echo their idempotency key, as the tests' http tool does.
struct Echo;

impl ToolPort for Echo {
    fn run<'a>(
        &'a self,
        _: &'a ToolCall,
        key: &'a str,
        _: std::time::Duration,
    ) -> BoxFuture<'a, ToolRun> {
        let text = format!("{{\"key\":\"{key}\"}}");
        Box::pin(async move { ToolRun::Done(ToolResult::text(text)) })
    }
}

fn stored_trace(store: &MemStore) -> Option<String> {
    store
        .session
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .0
        .trace
        .clone()
}

/// `lookup` runs in the step, `ask` waits for a person.
fn lookup_and_ask() -> AgentRuntime {
    let mut rt = runtime();
    let ask = crate::core::Disposition::Defer {
        reason: "a person".into(),
    };
    rt.config.policy.rules.push(rule("ask", ask));
    rt.config.agent = Some("helper".into());
    rt
}

#[tokio::test]
async fn every_step_of_a_session_joins_one_trace_and_links_to_the_step_before() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["lookup", "ask"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let kept = Kept::default();
    let p = ports(&store, &model, &tools, &clock).traced(&kept);
    let (rt, holder) = (lookup_and_ask(), Holder::named("h"));

    let first = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert!(matches!(first.outcome, StepOutcome::Waiting { .. }));
    let looked = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert_eq!(looked.writes, 0);
    let steps = kept.steps();
    assert_eq!(steps.len(), 1, "a look that did nothing is no span");
    let one = &steps[0];
    assert_eq!(stored_trace(&store), Some(one.context.traceparent()));
    assert_eq!(one.previous, None);
    assert_eq!(
        (one.agent.as_deref(), one.conversation.as_str()),
        (Some("helper"), "uid-1")
    );
    assert_eq!(one.outcome, "waiting");
    assert_eq!(one.chats.len(), 1);
    let tools_run: Vec<_> = one.tools.iter().map(|t| (&*t.tool, &t.source)).collect();
    let sync = ResultSource::Executed {
        runner: "runSync".into(),
    };
    assert_eq!(tools_run, vec![("lookup", &sync)]);
    assert_eq!(one.tools[0].model_call_id, "m0");
    assert_eq!(one.deferred.len(), 1);
    assert_eq!(one.deferred[0].tool, "ask");

    let token = store.state().pending()[0].token().unwrap().clone();
    store
        .complete(&token, &ToolResult::text("42"), "alice", Millis(5_000))
        .await
        .unwrap();
    clock.advance(10_000);
    let last = step(&p, &id(), &rt, &holder, Roles::ALL).await.unwrap();
    assert!(matches!(last.outcome, StepOutcome::Succeeded { .. }));
    let steps = kept.steps();
    assert_eq!(steps.len(), 2);
    let two = &steps[1];
    assert_eq!(two.context.trace_id, one.context.trace_id, "one trace");
    assert_ne!(two.context.span_id, one.context.span_id);
    assert_eq!(two.previous, Some(one.context), "linked to the first");
    assert_eq!(stored_trace(&store), Some(two.context.traceparent()));
    let outside = ResultSource::Outside { by: "alice".into() };
    assert_eq!(two.tools.len(), 1);
    assert_eq!(
        (&*two.tools[0].tool, &two.tools[0].source),
        ("ask", &outside)
    );
    assert_eq!(two.chats.len(), 1);
    assert!(two.started >= Millis(11_000), "{:?}", two.started);
}

#[tokio::test]
async fn a_cached_result_is_traced_as_a_cache_hit_never_as_a_run() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![calls(&["lookup"]), calls(&["lookup"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let kept = Kept::default();
    let p = ports(&store, &model, &tools, &clock).traced(&kept);
    let mut rt = runtime();
    let mut cached = rule("lookup", crate::core::Disposition::RunSync);
    cached.decorators.cache = true;
    rt.config.policy.rules.push(cached);
    run_to_end(&p, &rt, &clock, 4).await;
    let sources: Vec<String> = kept
        .steps()
        .iter()
        .flat_map(|s| s.tools.iter().map(|t| t.source.label().to_string()))
        .collect();
    assert_eq!(sources, ["executed", "cache"]);
    assert_eq!(tools.runs.lock().unwrap().values().sum::<u32>(), 1);
}

#[tokio::test]
async fn content_goes_in_only_when_asked_and_never_with_an_idempotency_key() {
    for content in [false, true] {
        let store = MemStore::with_session(&["hi"]);
        let model = Script::new(vec![calls(&["lookup"]), text("done")]);
        let clock = ManualClock::at(Millis(1_000));
        let kept = Kept {
            content,
            ..Default::default()
        };
        let tools = Tools::default();
        let mut p = ports(&store, &model, &tools, &clock).traced(&kept);
        p.tools = &Echo;
        step(&p, &id(), &runtime(), &Holder::named("h"), Roles::ALL)
            .await
            .unwrap();
        let tool = kept.steps()[0].tools[0].clone();
        let key = "ns/s/uid-1/t1-c0";
        if !content {
            assert_eq!((tool.arguments, tool.result), (None, None));
            continue;
        }
        assert_eq!(tool.arguments.as_deref(), Some("{}"));
        let result = tool.result.unwrap();
        assert!(!result.contains(key), "{result}");
        assert!(result.contains("[idempotency key]"), "{result}");
    }
}

#[tokio::test]
async fn with_tracing_off_nothing_is_stored() {
    let store = MemStore::with_session(&["hi"]);
    let model = Script::new(vec![text("hello")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(0)));
    let p = ports(&store, &model, &tools, &clock);
    step(&p, &id(), &runtime(), &Holder::named("h"), Roles::ALL)
        .await
        .unwrap();
    assert_eq!(stored_trace(&store), None);
}
