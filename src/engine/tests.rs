//! The engine's rules, each in a fast test over in-memory ports (no
//! process, no cluster) and a manual clock: conflict replay, a briefly
//! unavailable store, the limit of that patience, claims between two racing
//! drivers, the fence, a step with nothing to do writing nothing, a state
//! too large to store, cache serving, retries after their backoff, a
//! deferred call's timeout, and the session deadline.

use super::*;
use crate::core::acceptance::{self, Verdict};
use crate::core::{AgentTurn, Millis, ToolCall};
use crate::ports::{
    CachePort, ContinuationPort, Decision, ManualClock, ModelFailure, ModelInput, ModelPort,
    RunKind, RunStatus, RunnerPort, SessionInput, SessionPort, StoreResult, ToolPort, Versioned,
};
use futures::future::BoxFuture;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// What the in-memory store does on its next saves.
#[derive(Clone, Debug)]
enum Fault {
    /// This save goes through.
    Pass,
    /// Another writer wrote first: the version moves, the save is refused.
    Conflict,
    /// The store does not answer.
    Unavailable,
    /// The store refuses the state as invalid (a CRD older than the build).
    Refused,
}

#[derive(Default)]
struct MemStore {
    session: Mutex<Option<(SessionRecord, u64)>>,
    continuations: Mutex<BTreeMap<String, ContinuationRecord>>,
    cache: Mutex<BTreeMap<String, ToolResult>>,
    faults: Mutex<VecDeque<Fault>>,
    saves: AtomicU32,
    /// Continuation writes that fail as unavailable before one goes through.
    ensure_faults: AtomicU32,
    /// Records larger than this (as JSON) are refused as too large.
    max_record_bytes: Option<usize>,
}

impl MemStore {
    fn with_session(messages: &[&str]) -> MemStore {
        let id = SessionId("s".into());
        let store = MemStore::default();
        *store.session.lock().unwrap() = Some((
            SessionRecord {
                state: SessionState::new(id),
                input: SessionInput {
                    messages: messages.iter().map(|m| m.to_string()).collect(),
                    ..Default::default()
                },
                namespace: "ns".into(),
                uid: "uid-1".into(),
                definition: serde_json::json!({}),
                created_at: Millis(0),
                updated_at: Millis(0),
                trace: None,
            },
            1,
        ));
        store
    }

    fn inject(&self, faults: impl IntoIterator<Item = Fault>) {
        self.faults.lock().unwrap().extend(faults);
    }

    fn state(&self) -> SessionState {
        self.session
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .0
            .state
            .clone()
    }
}

impl SessionPort for MemStore {
    fn load<'a>(
        &'a self,
        _: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Option<Versioned<SessionRecord>>>> {
        let loaded = self.session.lock().unwrap().clone();
        Box::pin(async move {
            Ok(loaded.map(|(value, v)| Versioned {
                value,
                version: Version(v.to_string()),
            }))
        })
    }

    fn save<'a>(
        &'a self,
        record: &'a SessionRecord,
        expected: &'a Version,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        self.saves.fetch_add(1, Ordering::SeqCst);
        let fault = self.faults.lock().unwrap().pop_front();
        let mut stored = self.session.lock().unwrap();
        let (current, version) = stored.as_mut().unwrap();
        let size = serde_json::to_string(record).unwrap().len();
        let result = match fault {
            _ if self.max_record_bytes.is_some_and(|most| size > most) => {
                Err(StoreError::TooLarge {
                    id: record.state.id.clone(),
                    why: format!("{size} bytes"),
                })
            }
            Some(Fault::Pass) | None if expected.0 != version.to_string() => {
                Err(StoreError::Conflict {
                    id: record.state.id.clone(),
                    expected: expected.clone(),
                })
            }
            Some(Fault::Pass) | None => {
                *current = record.clone();
                *version += 1;
                Ok(Version(version.to_string()))
            }
            Some(Fault::Unavailable) => Err(StoreError::Unavailable("injected".into())),
            Some(Fault::Refused) => Err(StoreError::Refused {
                id: record.state.id.clone(),
                why: "422: unsupported value".into(),
            }),
            Some(Fault::Conflict) => {
                *version += 1;
                Err(StoreError::Conflict {
                    id: record.state.id.clone(),
                    expected: expected.clone(),
                })
            }
        };
        Box::pin(async move { result })
    }
}

impl ContinuationPort for MemStore {
    fn ensure<'a>(
        &'a self,
        _: &'a SessionRef,
        spec: &'a crate::core::session::ContinuationSpec,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<ContinuationRecord>> {
        if self
            .ensure_faults
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Box::pin(async { Err(StoreError::Unavailable("injected".into())) });
        }
        let mut all = self.continuations.lock().unwrap();
        let rec = all
            .entry(spec.token.0.clone())
            .or_insert_with(|| ContinuationRecord {
                spec: spec.clone(),
                result: None,
                completed_by: None,
                completed_at: None,
                decision: None,
                created_at: now,
                answers: None,
            })
            .clone();
        Box::pin(async move { Ok(rec) })
    }

    fn list_for<'a>(
        &'a self,
        _: &'a SessionRef,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>> {
        let all = self
            .continuations
            .lock()
            .unwrap()
            .values()
            .cloned()
            .collect();
        Box::pin(async move { Ok(all) })
    }

    fn complete<'a>(
        &'a self,
        token: &'a ContinuationToken,
        result: &'a ToolResult,
        by: &'a str,
        now: Millis,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        let mut all = self.continuations.lock().unwrap();
        let outcome = match all.get_mut(&token.0) {
            None => Err(StoreError::UnknownToken(token.clone())),
            Some(rec) => {
                let verdict = acceptance::result(&rec.held(), result, by);
                if verdict == Verdict::Write {
                    rec.result = Some(result.clone());
                    rec.completed_by = Some(by.to_string());
                    rec.completed_at = Some(now);
                }
                WriteOnce::judged(token, verdict)
            }
        };
        Box::pin(async move { outcome })
    }

    fn decide<'a>(
        &'a self,
        token: &'a ContinuationToken,
        decision: &'a Decision,
    ) -> BoxFuture<'a, StoreResult<WriteOnce>> {
        let mut all = self.continuations.lock().unwrap();
        let outcome = match all.get_mut(&token.0) {
            None => Err(StoreError::UnknownToken(token.clone())),
            Some(rec) => {
                let verdict = acceptance::decision(&rec.held(), decision.approved);
                if verdict == Verdict::Write {
                    rec.decision = Some(decision.clone());
                }
                WriteOnce::judged(token, verdict)
            }
        };
        Box::pin(async move { outcome })
    }
}

impl CachePort for MemStore {
    fn lookup<'a>(
        &'a self,
        key: &'a crate::core::CacheKey,
    ) -> BoxFuture<'a, StoreResult<Option<ToolResult>>> {
        let hit = self.cache.lock().unwrap().get(&format!("{key:?}")).cloned();
        Box::pin(async move { Ok(hit) })
    }
    fn remember<'a>(
        &'a self,
        key: &'a crate::core::CacheKey,
        result: &'a ToolResult,
        _: Millis,
    ) -> BoxFuture<'a, StoreResult<()>> {
        self.cache
            .lock()
            .unwrap()
            .insert(format!("{key:?}"), result.clone());
        Box::pin(async { Ok(()) })
    }
}

/// A model that replies from a script and counts its calls.
#[derive(Default)]
struct Script {
    replies: Mutex<VecDeque<AgentTurn>>,
    calls: AtomicU32,
}

impl Script {
    fn new(replies: Vec<AgentTurn>) -> Script {
        Script {
            replies: Mutex::new(replies.into()),
            calls: AtomicU32::new(0),
        }
    }
    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl ModelPort for Script {
    fn reply<'a>(&'a self, _: ModelInput<'a>) -> BoxFuture<'a, Result<AgentTurn, ModelFailure>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let reply = self.replies.lock().unwrap().pop_front();
        Box::pin(async move {
            reply.ok_or(ModelFailure {
                message: "the script ran out".into(),
                retryable: false,
                retry_after: None,
            })
        })
    }
}

fn text(t: &str) -> AgentTurn {
    AgentTurn {
        text: Some(t.into()),
        tool_calls: Vec::new(),
        usage: Default::default(),
    }
}

fn calls(names: &[&str]) -> AgentTurn {
    AgentTurn {
        text: None,
        tool_calls: names
            .iter()
            .enumerate()
            .map(|(i, n)| ToolCall {
                model_call_id: format!("m{i}"),
                name: n.to_string(),
                arguments: "{}".into(),
            })
            .collect(),
        usage: Default::default(),
    }
}

/// Tools that answer at once and count their runs per key; the first
/// `failing` background or isolated attempts fail.
#[derive(Default)]
struct Tools {
    runs: Mutex<BTreeMap<String, u32>>,
    failing: AtomicU32,
    /// The timeout each run was given.
    timeouts: Mutex<Vec<std::time::Duration>>,
    /// Polls a `long` call's MCP task answers `Working` before it ends.
    task_polls_left: AtomicU32,
    /// What polls answer, first to last, before `task_polls_left` counts.
    poll_script: Mutex<std::collections::VecDeque<TaskPoll>>,
    /// The task ids polled and cancelled, in order.
    polled: Mutex<Vec<String>>,
    cancelled: Mutex<Vec<String>>,
}

impl ToolPort for Tools {
    fn run<'a>(
        &'a self,
        call: &'a ToolCall,
        key: &'a str,
        timeout: std::time::Duration,
    ) -> BoxFuture<'a, ToolRun> {
        self.timeouts.lock().unwrap().push(timeout);
        *self
            .runs
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_insert(0) += 1;
        let name = call.name.clone();
        Box::pin(async move {
            if name == "long" {
                return ToolRun::Task(crate::core::call::TaskHandle {
                    id: format!("task-{key}"),
                    poll_ms: 3_000,
                });
            }
            ToolRun::Done(ToolResult::text(format!("{name} done")))
        })
    }

    fn poll_task<'a>(
        &'a self,
        _: &'a ToolCall,
        task: &'a crate::core::call::TaskHandle,
        _: Option<&'a str>,
    ) -> BoxFuture<'a, TaskPoll> {
        self.polled.lock().unwrap().push(task.id.clone());
        if let Some(scripted) = self.poll_script.lock().unwrap().pop_front() {
            return Box::pin(async move { scripted });
        }
        let left = self
            .task_polls_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        Box::pin(async move {
            match left {
                Ok(_) => TaskPoll::Working,
                Err(_) => TaskPoll::Ended(ToolResult::text("the long task's answer")),
            }
        })
    }

    fn cancel_task<'a>(
        &'a self,
        _: &'a ToolCall,
        task: &'a crate::core::call::TaskHandle,
    ) -> BoxFuture<'a, ()> {
        self.cancelled.lock().unwrap().push(task.id.clone());
        Box::pin(async {})
    }
}

impl RunnerPort for Tools {
    fn start<'a>(
        &'a self,
        _: RunKind<'a>,
        envelope: &'a crate::core::envelope::CallEnvelope,
        _: u32,
        timeout: std::time::Duration,
    ) -> BoxFuture<'a, RunStatus> {
        self.timeouts.lock().unwrap().push(timeout);
        *self
            .runs
            .lock()
            .unwrap()
            .entry(envelope.context.idempotency_key.clone())
            .or_insert(0) += 1;
        let fails = self
            .failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            RunStatus::Finished(if fails {
                ToolResult::error("flaky")
            } else {
                ToolResult::text("ran")
            })
        })
    }
}

fn runtime() -> AgentRuntime {
    AgentRuntime {
        config: SessionConfig::default(),
        system_prompt: String::new(),
        tools: Vec::new(),
    }
}

fn ports<'a>(
    store: &'a MemStore,
    model: &'a dyn ModelPort,
    tools: &'a Tools,
    clock: &'a ManualClock,
) -> Ports<'a> {
    Ports {
        sessions: store,
        continuations: store,
        cache: store,
        model,
        tools,
        runner: tools,
        clock,
        observer: &|_: &Progress| {},
        tracer: &NoTraces,
    }
}

fn id() -> SessionId {
    SessionId("s".into())
}

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

#[tokio::test]
async fn a_state_too_large_to_store_fails_the_session_and_asks_nothing_again() {
    let mut store = MemStore::with_session(&["hi"]);
    store.max_record_bytes = Some(4_000);
    let model = Script::new(vec![text(&"long answer ".repeat(1_000))]);
    let (tools, clock) = (Tools::default(), ManualClock::at(Millis(1_000)));
    let p = ports(&store, &model, &tools, &clock);
    let holder = Holder::named("h");
    let refused = step(&p, &id(), &runtime(), &holder, Roles::ALL).await;
    assert!(
        matches!(
            refused,
            Err(EngineError::Store(StoreError::TooLarge { .. }))
        ),
        "{refused:?}"
    );
    let stored = store.state();
    assert_eq!(stored.phase, crate::core::Phase::Failed);
    let why = stored.failure.unwrap();
    assert!(why.contains("outgrew its store"), "{why}");
    // The next step finds it failed: the model is not asked again.
    let report = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, StepOutcome::Failed { .. }),
        "{:?}",
        report.outcome
    );
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
    let refused = step(&p, &id(), &runtime(), &holder, Roles::ALL).await;
    assert!(
        matches!(refused, Err(EngineError::Store(StoreError::Refused { .. }))),
        "{refused:?}"
    );
    let stored = store.state();
    assert_eq!(stored.phase, crate::core::Phase::Failed);
    let why = stored.failure.unwrap();
    assert!(
        why.contains("the store refused the session's state")
            && why.contains("kubectl apply -f crds/"),
        "{why}"
    );
    let report = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, StepOutcome::Failed { .. }),
        "{:?}",
        report.outcome
    );
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
    let refused = step(&p, &id(), &runtime(), &holder, Roles::ALL).await;
    assert!(
        matches!(
            refused,
            Err(EngineError::Store(StoreError::TooLarge { .. }))
        ),
        "{refused:?}"
    );
    let stored = store.state();
    assert_eq!(
        (stored.phase, stored.messages_taken),
        (crate::core::Phase::Failed, 1)
    );
    let saves = store.saves.load(Ordering::SeqCst);
    let report = step(&p, &id(), &runtime(), &holder, Roles::ALL)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, StepOutcome::Failed { .. }),
        "{:?}",
        report.outcome
    );
    assert_eq!(
        store.saves.load(Ordering::SeqCst),
        saves,
        "nothing written again"
    );
    assert_eq!(model.calls(), 0);
}

fn rule(tool: &str, disposition: crate::core::Disposition) -> crate::core::policy::Rule {
    crate::core::policy::Rule {
        tool: tool.into(),
        disposition,
        decorators: Default::default(),
    }
}

/// Steps as a driver would, moving the clock to each wake-up, until the
/// session is final or `steps` ran out.
async fn run_to_end(
    p: &Ports<'_>,
    rt: &AgentRuntime,
    clock: &ManualClock,
    steps: usize,
) -> StepOutcome {
    let holder = Holder::named("h");
    let mut last = None;
    for _ in 0..steps {
        let report = step(p, &id(), rt, &holder, Roles::ALL).await.unwrap();
        match report.outcome {
            StepOutcome::Busy { at }
            | StepOutcome::Waiting {
                wake_at: Some(at), ..
            } => {
                clock.sleep_until(at).await;
                last = Some(report.outcome);
            }
            final_or_idle => return final_or_idle,
        }
    }
    last.expect("at least one step")
}

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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
    let given = tools.timeouts.lock().unwrap().clone();
    assert_eq!(given, vec![std::time::Duration::from_secs(42); 2]);
}

/// The first tool result the model was given.
fn first_result(store: &MemStore) -> Option<ToolResult> {
    store.state().turns.iter().find_map(|t| match t {
        crate::core::Turn::User(u) => u.tool_results.first().map(|r| r.result.clone()),
        _ => None,
    })
}

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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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

mod spans;
mod subagents;

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
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
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
