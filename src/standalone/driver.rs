//! The driver loop around the core: load, restore, perform actions, feed
//! the outcomes back, persist at every `Checkpoint`.
//!
//! Crash safety comes from three rules:
//! - the core's state is saved (compare-and-swap) before any tool of a new
//!   agent turn runs, so a restart never asks the model for different calls;
//! - results written by others (or by us just before a crash) live in the
//!   continuation records, write-once, and are re-applied on every load;
//! - every action is idempotent (continuations are adopted, results are
//!   write-once), so a restart simply re-derives and re-performs them.

use super::definition::RunnableAgent;
use super::progress::{PendingCall, Progress};
use crate::core::session::ContinuationSpec;
use crate::core::{
    Action, CallState, ContinuationToken, Disposition, Event, Millis, Phase, Session, SessionId,
    SessionState, ToolResult, WaitingFor,
};
use crate::model::ModelRequest;
use crate::runner::ProcessRunner;
use crate::store::{ContinuationRecord, SessionRecord, Store, StoreError, Version, WriteOnce};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub fn now() -> Millis {
    Millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0),
    )
}

/// How a drive ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Succeeded {
        answer: String,
    },
    Failed {
        reason: String,
    },
    /// Every open call waits on the outside.
    Yielded {
        pending: Vec<PendingCall>,
    },
    Paused,
    /// Nothing to do (no user message yet).
    Idle,
}

#[derive(Clone, Debug, Default)]
pub struct DriveOptions {
    /// Run `runIsolated` calls here with the process runner instead of
    /// leaving them to `agents session run-isolated` (an external worker).
    pub run_isolated_here: bool,
    pub runner: ProcessRunner,
    /// Shown in hints: the `--store` flag that reaches this store.
    pub store_flag: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("session {0} kept changing under this process; try again")]
    TooManyConflicts(SessionId),
}

/// Drives the session until it succeeds, fails, yields or is paused.
/// A concurrent writer makes a checkpoint conflict; the driver then reloads
/// and carries on from the stored state.
pub async fn drive<S: Store>(
    store: &S,
    agent: &RunnableAgent,
    id: &SessionId,
    opts: &DriveOptions,
    report: &mut dyn FnMut(Progress),
) -> Result<Outcome, DriveError> {
    for _ in 0..8 {
        match drive_once(store, agent, id, opts, report).await {
            Err(DriveError::Store(StoreError::Conflict { .. })) => continue,
            other => return other,
        }
    }
    Err(DriveError::TooManyConflicts(id.clone()))
}

/// Applies events to the stored session with compare-and-swap (retrying
/// on conflict): user messages, pause, resume.
pub async fn apply_events<S: Store>(
    store: &S,
    agent: &RunnableAgent,
    id: &SessionId,
    events: &dyn Fn(&SessionState) -> Vec<Event>,
) -> Result<SessionState, DriveError> {
    for _ in 0..8 {
        let loaded = store
            .load_session(id)
            .await?
            .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
        let mut record = loaded.value;
        let t = now();
        let mut session = Session::restore(record.state.clone(), agent.config.clone(), t);
        for e in events(session.state()) {
            // A refused event (an empty message) leaves the state as it was.
            let _ = session.handle(e, t);
        }
        if session.state() == &record.state {
            return Ok(record.state);
        }
        record.state = session.into_state();
        record.updated_at = t;
        match store.save_session(&record, &loaded.version).await {
            Ok(_) => return Ok(record.state),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(DriveError::TooManyConflicts(id.clone()))
}

struct Driver<'a, S: Store> {
    store: &'a S,
    agent: &'a RunnableAgent,
    opts: &'a DriveOptions,
    record: SessionRecord,
    version: Version,
}

impl<S: Store> Driver<'_, S> {
    /// Saves the state if it changed since the last save.
    async fn checkpoint(&mut self, state: &SessionState) -> Result<(), DriveError> {
        if &self.record.state == state {
            return Ok(());
        }
        let mut next = self.record.clone();
        next.state = state.clone();
        next.updated_at = now();
        self.version = self.store.save_session(&next, &self.version).await?;
        self.record = next;
        Ok(())
    }
}

async fn drive_once<S: Store>(
    store: &S,
    agent: &RunnableAgent,
    id: &SessionId,
    opts: &DriveOptions,
    report: &mut dyn FnMut(Progress),
) -> Result<Outcome, DriveError> {
    let loaded = store
        .load_session(id)
        .await?
        .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
    let mut d = Driver {
        store,
        agent,
        opts,
        record: loaded.value,
        version: loaded.version,
    };
    let state = absorb_outside_results(store, agent, d.record.state.clone(), report).await?;
    let mut session = Session::restore(state, agent.config.clone(), now());
    // Fires deadlines and retries that came due while nobody was running.
    let _ = session.handle(Event::Tick, now());
    let sid = id.0.clone();
    loop {
        while let Some(action) = session.poll_action() {
            perform(&mut d, &mut session, action, &sid, report).await?;
        }
        let state = session.state().clone();
        match state.phase {
            Phase::Succeeded => {
                d.checkpoint(&state).await?;
                let answer = state.answer.clone().unwrap_or_default();
                report(Progress::Finished {
                    session: sid.clone(),
                    answer: answer.clone(),
                });
                return Ok(Outcome::Succeeded { answer });
            }
            Phase::Failed => {
                d.checkpoint(&state).await?;
                let reason = state.failure.clone().unwrap_or_default();
                report(Progress::Failed {
                    session: sid.clone(),
                    reason: reason.clone(),
                });
                return Ok(Outcome::Failed { reason });
            }
            _ => {}
        }
        if state.paused {
            d.checkpoint(&state).await?;
            report(Progress::Paused {
                session: sid.clone(),
            });
            return Ok(Outcome::Paused);
        }
        if state.phase == Phase::Waiting && !own_retry_due(&session, opts) {
            d.checkpoint(&state).await?;
            // A result may have landed while we worked: take it and go on.
            let fresh = absorb_outside_results(store, agent, state.clone(), report).await?;
            if fresh != state {
                session = Session::restore(fresh, agent.config.clone(), now());
                continue;
            }
            // Deadlines of waiting calls fire on the next resume (a Tick).
            let pending = pending_calls(&session, opts);
            report(Progress::Yielded {
                session: sid.clone(),
                pending: pending.clone(),
            });
            return Ok(Outcome::Yielded { pending });
        }
        d.checkpoint(&state).await?;
        match session.poll_timeout() {
            // Backoff before a retry of the model or of a tool.
            Some(at) => {
                let wait = (at.0 - now().0).max(0) as u64;
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let _ = session.handle(Event::Tick, now());
            }
            None => return Ok(Outcome::Idle),
        }
    }
}

async fn perform<S: Store>(
    d: &mut Driver<'_, S>,
    session: &mut Session,
    action: Action,
    sid: &str,
    report: &mut dyn FnMut(Progress),
) -> Result<(), DriveError> {
    match action {
        Action::Checkpoint => d.checkpoint(&session.state().clone()).await?,
        Action::CallModel { turn } => {
            let tools: Vec<_> = d.agent.toolbox.defs().collect();
            let reply = d
                .agent
                .model
                .reply(&ModelRequest {
                    system_prompt: &d.agent.system_prompt,
                    turns: &session.state().turns,
                    tools: &tools,
                })
                .await;
            match reply {
                Ok(agent_turn) => {
                    let t = agent_turn.clone();
                    if session
                        .handle(Event::ModelReplied { turn: agent_turn }, now())
                        .is_ok()
                    {
                        report(Progress::agent_turn(sid, turn, &t, session.state()));
                    }
                }
                Err(e) => {
                    report(Progress::ModelError {
                        session: sid.to_string(),
                        error: e.message.clone(),
                        retryable: e.retryable,
                    });
                    let _ = session.handle(
                        Event::ModelFailed {
                            error: e.message,
                            retryable: e.retryable,
                        },
                        now(),
                    );
                }
            }
        }
        Action::RunTool {
            call,
            tool_call,
            idempotency_key,
            timeout_seconds,
            cache_key,
            ..
        } => {
            let cached = match &cache_key {
                Some(k) => d.store.cache_get(k).await?,
                None => None,
            };
            let from_cache = cached.is_some();
            let result = match cached {
                Some(r) => r,
                None => {
                    d.agent
                        .toolbox
                        .run(
                            &tool_call,
                            &idempotency_key,
                            timeout_seconds.map(Duration::from_secs),
                        )
                        .await
                }
            };
            report(Progress::ToolResult {
                session: sid.to_string(),
                call: call.to_string(),
                tool: tool_call.name.clone(),
                result: result.clone(),
                by: if from_cache { "cache" } else { "runSync" }.into(),
            });
            let _ = session.handle(
                Event::ToolFinished {
                    call,
                    result,
                    from_cache,
                },
                now(),
            );
        }
        Action::EnsureContinuation(spec) => {
            let record = d.store.ensure_continuation(&spec, now()).await?;
            if let Some(result) = record.result.clone() {
                // Completed from outside before we got here (or before a crash).
                let by = record.completed_by.clone().unwrap_or_default();
                let _ = session.handle(
                    Event::Wake {
                        token: spec.token.clone(),
                        result,
                        by,
                    },
                    now(),
                );
            } else if let Some(hit) = cache_hit(d.store, &spec).await? {
                d.store
                    .complete_continuation(&spec.token, &hit, "cache", now())
                    .await?;
                let _ = session.handle(
                    Event::Wake {
                        token: spec.token.clone(),
                        result: hit,
                        by: "cache".into(),
                    },
                    now(),
                );
            } else if spec.waiting_for != WaitingFor::Background {
                // (A background call runs right away; its result is the news.)
                report(Progress::Deferred {
                    session: sid.to_string(),
                    call: spec.call_id.to_string(),
                    tool: spec.tool_call.name.clone(),
                    token: spec.token.0.clone(),
                    waiting_for: spec.waiting_for,
                    reason: spec.reason.clone(),
                });
            }
        }
        Action::RunInBackground { envelope, attempt }
            if still_waiting(session, &envelope.token) =>
        {
            // Standalone, "background" runs in this process before it yields.
            let result = d
                .agent
                .toolbox
                .run(
                    &envelope.tool_call,
                    &envelope.context.idempotency_key,
                    envelope
                        .policy
                        .decorators
                        .timeout_seconds
                        .map(Duration::from_secs),
                )
                .await;
            finish_attempt(
                session,
                envelope.token.clone(),
                attempt,
                result,
                "runAsync",
                sid,
                &envelope.tool_call.name,
                report,
            );
        }
        Action::LaunchIsolated {
            envelope,
            spec,
            attempt,
        } if still_waiting(session, &envelope.token) => {
            if d.opts.run_isolated_here {
                let timeout = envelope
                    .policy
                    .decorators
                    .timeout_seconds
                    .map(Duration::from_secs);
                let out = d.opts.runner.run(&envelope, &spec, timeout).await;
                finish_attempt(
                    session,
                    envelope.token.clone(),
                    attempt,
                    out.result,
                    "process",
                    sid,
                    &envelope.tool_call.name,
                    report,
                );
            }
            // Otherwise the continuation waits for `agents session run-isolated`.
        }
        // Answered meanwhile (from the cache, or from outside): nothing to run.
        Action::RunInBackground { .. } | Action::LaunchIsolated { .. } => {}
        Action::RecordResult { token, result, by } => {
            let outcome = d
                .store
                .complete_continuation(&token, &result, &by, now())
                .await?;
            if let WriteOnce::AlreadyDifferent { by, .. } = outcome {
                report(Progress::Note {
                    session: sid.to_string(),
                    message: format!(
                        "{token} was completed by {by} first; that result stands in the continuation"
                    ),
                });
            }
        }
        Action::StoreCache { key, result } => d.store.cache_put(&key, &result, now()).await?,
        Action::Yield { .. } => {
            // Decided once the queue is empty: later actions may still
            // record results (see `drive_once`).
        }
        // Reported once the queue is drained, also when a rerun finds the
        // session already finished.
        Action::Finished { .. } | Action::Failed { .. } => {}
    }
    Ok(())
}

fn still_waiting(session: &Session, token: &ContinuationToken) -> bool {
    session
        .state()
        .find_call(token)
        .is_some_and(|c| c.state == CallState::Deferred)
}

/// A retry of work this process does itself (a background call, or an
/// isolated one run here) is due later: wait for it rather than yield.
fn own_retry_due(session: &Session, opts: &DriveOptions) -> bool {
    session
        .state()
        .open
        .iter()
        .flat_map(|o| o.calls.iter())
        .any(|c| {
            c.retry_at.is_some()
                && match c.waiting_for {
                    Some(WaitingFor::Background) => true,
                    Some(WaitingFor::Isolated) => opts.run_isolated_here,
                    _ => false,
                }
        })
}

#[allow(clippy::too_many_arguments)]
fn finish_attempt(
    session: &mut Session,
    token: ContinuationToken,
    attempt: u32,
    result: ToolResult,
    by: &str,
    sid: &str,
    tool: &str,
    report: &mut dyn FnMut(Progress),
) {
    let call = session
        .state()
        .find_call(&token)
        .map(|c| c.id.to_string())
        .unwrap_or_default();
    report(Progress::ToolResult {
        session: sid.to_string(),
        call,
        tool: tool.to_string(),
        result: result.clone(),
        by: by.to_string(),
    });
    let _ = session.handle(
        Event::AttemptFinished {
            token,
            attempt,
            result,
        },
        now(),
    );
}

async fn cache_hit<S: Store>(
    store: &S,
    spec: &ContinuationSpec,
) -> Result<Option<ToolResult>, StoreError> {
    // Only calls that run by themselves may be answered from the cache;
    // an approval or a human's answer is never skipped.
    if !matches!(
        spec.waiting_for,
        WaitingFor::Background | WaitingFor::Isolated
    ) {
        return Ok(None);
    }
    match &spec.cache_key {
        Some(k) => store.cache_get(k).await,
        None => Ok(None),
    }
}

/// Feeds the core every result and decision that the continuation records
/// hold but the session state does not yet: written by `complete`,
/// `approve`, a worker, or by this driver just before a crash.
pub async fn absorb_outside_results<S: Store>(
    store: &S,
    agent: &RunnableAgent,
    state: SessionState,
    report: &mut dyn FnMut(Progress),
) -> Result<SessionState, StoreError> {
    let open: Vec<(ContinuationToken, Option<WaitingFor>)> = state
        .open
        .iter()
        .flat_map(|o| o.calls.iter())
        .filter(|c| c.state == CallState::Deferred)
        .filter_map(|c| c.token.clone().map(|t| (t, c.waiting_for)))
        .collect();
    if open.is_empty() {
        return Ok(state);
    }
    let records = store.session_continuations(&state.id).await?;
    let t = now();
    let mut session = Session::restore(state.clone(), agent.config.clone(), t);
    let mut changed = false;
    for (token, waiting) in open {
        let Some(rec) = records.iter().find(|r| r.token() == &token) else {
            continue;
        };
        if waiting == Some(WaitingFor::Approval) {
            if let Some(dec) = &rec.decision {
                changed |= session
                    .handle(
                        Event::Decide {
                            token: token.clone(),
                            approved: dec.approved,
                            by: dec.by.clone(),
                            reason: dec.reason.clone(),
                        },
                        t,
                    )
                    .is_ok();
            }
            continue;
        }
        if let Some(result) = &rec.result {
            let by = rec.completed_by.clone().unwrap_or_default();
            let woke = session.handle(
                Event::Wake {
                    token: token.clone(),
                    result: result.clone(),
                    by: by.clone(),
                },
                t,
            );
            if woke.is_ok() {
                changed = true;
                report(Progress::ToolResult {
                    session: state.id.0.clone(),
                    call: rec.spec.call_id.to_string(),
                    tool: rec.spec.tool_call.name.clone(),
                    result: result.clone(),
                    by,
                });
            }
        }
    }
    Ok(if changed { session.into_state() } else { state })
}

/// The open calls that wait, with the command that completes each.
pub fn pending_calls(session: &Session, opts: &DriveOptions) -> Vec<PendingCall> {
    let sid = &session.state().id;
    session
        .state()
        .pending()
        .into_iter()
        .filter_map(|c| {
            let token = c.token.clone()?;
            let flag = if opts.store_flag.is_empty() {
                String::new()
            } else {
                format!(" {}", opts.store_flag)
            };
            let command = match (c.waiting_for, &c.policy.disposition) {
                (Some(WaitingFor::Approval), _) => format!(
                    "agents session approve {token}{flag}   (or: agents session deny {token} --reason ...{flag})"
                ),
                (Some(WaitingFor::Isolated), Disposition::RunIsolated { .. }) => {
                    format!("agents session run-isolated {sid}{flag}")
                }
                _ => format!("agents session complete {token} --text RESULT{flag}"),
            };
            Some(PendingCall {
                token: token.0,
                call: c.id.to_string(),
                tool: c.call.name.clone(),
                waiting_for: c.waiting_for,
                reason: match &c.policy.disposition {
                    Disposition::Defer { reason } => Some(reason.clone()),
                    _ => None,
                },
                command,
            })
        })
        .collect()
}

/// The continuations an isolated worker should run.
pub fn isolated_work(records: &[ContinuationRecord]) -> Vec<&ContinuationRecord> {
    records
        .iter()
        .filter(|r| !r.is_completed() && r.spec.waiting_for == WaitingFor::Isolated)
        .collect()
}
