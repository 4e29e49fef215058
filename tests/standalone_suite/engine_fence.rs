//! Fencing in the engine step: a driver whose fence is closed (an operator
//! that lost its Lease while paused) commits nothing new and starts no
//! work; with the fence open the same step calls the model.
//!
//! Failing through the engine, over the SQLite store: failed steps are
//! counted in the session's state, so the count survives the driver (a
//! store opened again), a step that ends well resets it, and the eighth in
//! a row fails the session with a compare-and-swap like any checkpoint.

use crate::support;

use agents::core::{AgentTurn, Millis, SessionConfig, SessionId, SessionState};
use agents::engine::holder::Fence;
use agents::engine::{
    self, AgentRuntime, EngineError, Holder, ModelFailure, ModelInput, ModelPort, Observer, Ports,
    Roles, RunKind, RunStatus, RunnerPort, SystemClock, ToolPort,
};
use agents::store::sqlite::SqliteStore;
use agents::store::{SessionInput, SessionRecord};
use futures::future::BoxFuture;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::scratch::Scratch;

#[derive(Default)]
struct CountingModel {
    calls: AtomicU32,
}

impl ModelPort for CountingModel {
    fn reply<'a>(&'a self, _: ModelInput<'a>) -> BoxFuture<'a, Result<AgentTurn, ModelFailure>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {
            Ok(AgentTurn {
                text: Some("done".into()),
                tool_calls: Vec::new(),
                usage: Default::default(),
                ..Default::default()
            })
        })
    }
}

struct NoTools;
impl ToolPort for NoTools {
    fn run<'a>(
        &'a self,
        _: &'a agents::core::ToolCall,
        _: &'a str,
        _: Duration,
    ) -> BoxFuture<'a, agents::engine::ToolRun> {
        panic!("no tool may run")
    }
}
impl RunnerPort for NoTools {
    fn start<'a>(
        &'a self,
        _: RunKind<'a>,
        _: &'a agents::core::envelope::CallEnvelope,
        _: u32,
        _: Duration,
    ) -> BoxFuture<'a, RunStatus> {
        panic!("no run may start")
    }
}

#[derive(Debug, Default)]
struct Switch {
    open: AtomicBool,
}
impl Fence for Switch {
    fn check(&self) -> Result<(), String> {
        if self.open.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("the leader Lease lapsed".into())
        }
    }
}

#[tokio::test]
async fn a_closed_fence_starts_no_model_call_and_an_open_one_does() {
    let scratch = Scratch::new("fence");
    let store = SqliteStore::open(scratch.path("s.db")).unwrap();
    let id = SessionId("fenced".into());
    store
        .create_session(SessionRecord {
            state: SessionState::new(id.clone()),
            input: SessionInput {
                messages: vec!["hello".into()],
                ..Default::default()
            },
            namespace: String::new(),
            uid: "u1".into(),
            definition: serde_json::json!({}),
            created_at: Millis(0),
            updated_at: Millis(0),
            trace: None,
        })
        .await
        .unwrap();
    let model = CountingModel::default();
    let observer = |_: &agents::engine::Progress| {};
    let ports = Ports {
        sessions: &store,
        continuations: &store,
        cache: &store,
        model: &model,
        tools: &NoTools,
        runner: &NoTools,
        clock: &SystemClock,
        observer: &observer as &dyn Observer,
        tracer: &agents::ports::NoTraces,
    };
    let runtime = AgentRuntime {
        config: SessionConfig::default(),
        system_prompt: String::new(),
        tools: Vec::new(),
    };
    let switch = Arc::new(Switch::default());
    let holder = Holder::named("operator/test/1").with_fence(switch.clone());

    let err = engine::step(&ports, &id, &runtime, &holder, Roles::ALL)
        .await
        .expect_err("a fenced driver must not proceed");
    assert!(
        matches!(&err, EngineError::Fenced { why, .. } if why.contains("Lease lapsed")),
        "{err}"
    );
    assert_eq!(model.calls.load(Ordering::SeqCst), 0, "no model call");

    // The claim it committed is its own: once the fence opens again (it
    // leads again), the same holder goes on.
    switch.open.store(true, Ordering::SeqCst);
    let report = engine::step(&ports, &id, &runtime, &holder, Roles::ALL)
        .await
        .unwrap();
    assert_eq!(model.calls.load(Ordering::SeqCst), 1);
    assert!(
        matches!(report.outcome, engine::StepOutcome::Succeeded { .. }),
        "{:?}",
        report.outcome
    );
}

/// The identity and process table the drivers read from the OS
/// (`agents::host`) judge real processes: a live CLI's claims stand, a gone
/// one's are void, and an operator outside a pod voids only its own
/// earlier, dead instance.
#[test]
fn holders_judge_this_hosts_real_processes() {
    let (me, host) = (agents::host::this_process(), agents::host::processes());
    let cli = Holder::cli(&me, host.clone());
    let mut child = std::process::Command::new("sleep")
        .arg("5")
        .spawn()
        .unwrap();
    let other = agents::ports::ProcessIdentity {
        host: me.host.clone(),
        pid: child.id(),
        start: host.start_of(child.id()).expect("a live child has a start"),
    };
    let other_cli = Holder::cli(&other, host.clone());
    let other_operator = Holder::operator(&other.clone().into(), host.clone());
    let operator = Holder::operator(&me.clone().into(), host.clone());
    assert!(!cli.knows_dead(other_cli.name()), "a live process");
    assert!(!operator.knows_dead(other_operator.name()));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(cli.knows_dead(other_cli.name()), "its pid is gone");
    assert!(operator.knows_dead(other_operator.name()));
    assert!(!other_cli.knows_dead(cli.name()), "this process lives");
}

fn record(id: &SessionId, messages: &[&str]) -> SessionRecord {
    SessionRecord {
        state: SessionState::new(id.clone()),
        input: SessionInput {
            messages: messages.iter().map(|m| m.to_string()).collect(),
            ..Default::default()
        },
        namespace: String::new(),
        uid: "u1".into(),
        definition: serde_json::json!({}),
        created_at: Millis(0),
        updated_at: Millis(0),
        trace: None,
    }
}

async fn failed_steps(path: &std::path::Path, id: &SessionId) -> u32 {
    let store = SqliteStore::open(path).unwrap();
    let loaded = store.load_session(id).await.unwrap().unwrap();
    loaded.value.state.failed_steps
}

#[tokio::test]
async fn failed_steps_are_counted_across_drivers_and_the_eighth_fails_the_session() {
    let scratch = Scratch::new("failed-steps");
    let path = scratch.path("s.db");
    let id = SessionId("failing".into());
    SqliteStore::open(&path)
        .unwrap()
        .create_session(record(&id, &["hello"]))
        .await
        .unwrap();
    // Three drivers in turn (each opens the store afresh: a restart) count
    // one failure each, then a fourth counts four more.
    for n in 1..=3 {
        let store = SqliteStore::open(&path).unwrap();
        let counted = engine::step_failed(&store, &SystemClock, &id, "403 Forbidden").await;
        assert_eq!(counted.unwrap(), engine::Failing::Counted(n));
    }
    assert_eq!(
        failed_steps(&path, &id).await,
        3,
        "kept in the stored state"
    );
    let store = SqliteStore::open(&path).unwrap();
    for n in 4..engine::MAX_FAILED_STEPS {
        let counted = engine::step_failed(&store, &SystemClock, &id, "403 Forbidden").await;
        assert_eq!(counted.unwrap(), engine::Failing::Counted(n));
    }
    let last = engine::step_failed(&store, &SystemClock, &id, "403 Forbidden").await;
    let reason = "8 steps in a row failed; the last: 403 Forbidden".to_string();
    assert_eq!(last.unwrap(), engine::Failing::Failed { reason });
    let state = store.load_session(&id).await.unwrap().unwrap().value.state;
    assert_eq!(state.phase, agents::core::Phase::Failed);
    assert_eq!(state.messages_taken, 1, "its message counts as seen");
    assert_eq!(state.failed_steps, 0, "a retry starts counting afresh");
    let again = engine::step_failed(&store, &SystemClock, &id, "403 Forbidden").await;
    assert_eq!(
        again.unwrap(),
        engine::Failing::Final,
        "a final session is left alone"
    );
    let failed = engine::fail(&store, &SystemClock, &id, "another reason").await;
    assert_eq!(failed.unwrap(), engine::Failing::Final);
}

#[tokio::test]
async fn a_step_that_ends_well_resets_the_count_of_failed_steps() {
    let scratch = Scratch::new("failed-steps-reset");
    let store = SqliteStore::open(scratch.path("s.db")).unwrap();
    let id = SessionId("recovering".into());
    store.create_session(record(&id, &["hello"])).await.unwrap();
    for _ in 0..5 {
        engine::step_failed(&store, &SystemClock, &id, "403 Forbidden")
            .await
            .unwrap();
    }
    let model = CountingModel::default();
    let observer = |_: &agents::engine::Progress| {};
    let ports = Ports {
        sessions: &store,
        continuations: &store,
        cache: &store,
        model: &model,
        tools: &NoTools,
        runner: &NoTools,
        clock: &SystemClock,
        observer: &observer as &dyn Observer,
        tracer: &agents::ports::NoTraces,
    };
    let runtime = AgentRuntime {
        config: SessionConfig::default(),
        system_prompt: String::new(),
        tools: Vec::new(),
    };
    let holder = Holder::named("operator/test/1");
    let report = engine::step(&ports, &id, &runtime, &holder, Roles::ALL)
        .await
        .unwrap();
    assert!(matches!(
        report.outcome,
        engine::StepOutcome::Succeeded { .. }
    ));
    let state = store.load_session(&id).await.unwrap().unwrap().value.state;
    assert_eq!(state.failed_steps, 0);
}

#[tokio::test]
async fn failing_a_session_another_driver_moved_on_reads_it_again() {
    let scratch = Scratch::new("fail-cas");
    let store = SqliteStore::open(scratch.path("s.db")).unwrap();
    let id = SessionId("raced".into());
    let v1 = store.create_session(record(&id, &["hello"])).await.unwrap();
    // Another driver finished the session: failing it now changes nothing.
    let mut done = record(&id, &["hello"]);
    done.state.phase = agents::core::Phase::Succeeded;
    done.state.answer = Some("done".into());
    store.save_session(&done, &v1).await.unwrap();
    let failed = engine::fail(&store, &SystemClock, &id, "too late").await;
    assert_eq!(failed.unwrap(), engine::Failing::Final);
    let state = store.load_session(&id).await.unwrap().unwrap().value.state;
    assert_eq!(
        state.phase,
        agents::core::Phase::Succeeded,
        "not overwritten"
    );
}
