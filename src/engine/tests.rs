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
    /// What every cache lookup finds.
    cached: Mutex<Option<ToolResult>>,
    /// A writer that gets in first: at the next cache lookup, it completes
    /// every open continuation with this result, as `worker`.
    completes_first: Mutex<Option<ToolResult>>,
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
        if let Some(first) = self.completes_first.lock().unwrap().take() {
            let mut all = self.continuations.lock().unwrap();
            for rec in all.values_mut().filter(|r| r.result.is_none()) {
                rec.result = Some(first.clone());
                rec.completed_by = Some("worker".into());
                rec.completed_at = Some(Millis(0));
            }
        }
        let stored = self.cache.lock().unwrap().get(&format!("{key:?}")).cloned();
        let hit = stored.or_else(|| self.cached.lock().unwrap().clone());
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
        ..Default::default()
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
        ..Default::default()
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
        clock,
        ..Ports::over_store(store, model, tools, tools, &|_: &Progress| {})
    }
}

fn id() -> SessionId {
    SessionId("s".into())
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

/// Fails unless the session succeeded.
fn assert_succeeded(outcome: &StepOutcome) {
    assert!(
        matches!(outcome, StepOutcome::Succeeded { .. }),
        "{outcome:?}"
    );
}

/// The first tool result the model was given.
fn first_result(store: &MemStore) -> Option<ToolResult> {
    store.state().turns.iter().find_map(|t| match t {
        crate::core::Turn::User(u) => u.tool_results.first().map(|r| r.result.clone()),
        _ => None,
    })
}

mod background;
mod cached;
mod calls;
mod claims_and_store;
mod shared_budgets;
mod spans;
mod subagents;
mod tasks;
