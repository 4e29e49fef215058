//! Results served from the cache.

use super::*;
use crate::core::policy::{Decorators, IsolationSpec, Rule};

/// A cached result is written to the call's continuation only if nothing
/// is there yet. A result that got there first (a worker's, between the
/// continuation's creation and the cache's write) stands, and the model
/// is given that one: the session and its continuation never disagree.
#[tokio::test]
async fn a_cached_result_yields_to_one_written_first() {
    let store = MemStore::with_session(&["hi"]);
    *store.cached.lock().unwrap() = Some(ToolResult::text("cached"));
    *store.completes_first.lock().unwrap() = Some(ToolResult::text("the worker's"));
    let model = Script::new(vec![calls(&["build"]), text("done")]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let mut rt = runtime();
    rt.config.policy.rules.push(Rule {
        tool: "build".into(),
        disposition: crate::core::Disposition::RunIsolated {
            spec: IsolationSpec {
                image: "busybox:ci".into(),
                ..Default::default()
            },
        },
        decorators: Decorators {
            cache: true,
            ..Default::default()
        },
    });
    assert_succeeded(&run_to_end(&p, &rt, &clock, 10).await);
    let held: Vec<_> = store
        .continuations
        .lock()
        .unwrap()
        .values()
        .map(|r| (r.result.clone(), r.completed_by.clone()))
        .collect();
    assert_eq!(
        held,
        [(
            Some(ToolResult::text("the worker's")),
            Some("worker".into())
        )]
    );
    assert_eq!(
        first_result(&store),
        Some(ToolResult::text("the worker's")),
        "the model is given what the continuation holds"
    );
}
