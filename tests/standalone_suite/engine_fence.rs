//! Fencing in the engine step: a driver whose fence is closed (an operator
//! that lost its Lease while paused) commits nothing new and starts no
//! work; with the fence open the same step calls the model.

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
