//! Carrying out one action of a step: the model call, a tool run (now,
//! in the background, isolated, or from the cache), a continuation made
//! or its result recorded, each after the claim that allows it.

use super::*;

/// What every action of one step shares.
pub(super) struct StepContext<'a> {
    pub(super) agent: &'a AgentRuntime,
    pub(super) holder: &'a Holder,
    pub(super) owner: &'a SessionRef,
    pub(super) sid: &'a str,
    pub(super) known_waits: &'a [(ContinuationToken, Option<WaitingFor>)],
    /// This step's span, when traces are exported.
    pub(super) trace: Option<crate::ports::TraceContext>,
}

pub(super) async fn perform(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    mut action: Action,
    replay: &mut Vec<Event>,
) -> Result<(), EngineError> {
    let sid = ctx.sid;
    join_the_trace(ctx, &mut action);
    if starts_work(&action) {
        // Fencing: the claim for this work committed, but a driver that
        // lost its Lease meanwhile (paused past it) must not start it.
        ctx.holder.may_act().map_err(|why| EngineError::Fenced {
            session: SessionId(sid.to_string()),
            why,
        })?;
    }
    match action {
        Action::Checkpoint => unreachable!("handled by the step"),
        Action::CallModel { turn } => call_model(p, ctx, session, turn, replay).await,
        tool @ Action::RunTool { .. } => run_tool(p, sid, session, tool, replay).await?,
        Action::EnsureContinuation(spec) => ensure_continuation(p, ctx, session, spec).await?,
        run @ (Action::RunInBackground { .. }
        | Action::LaunchIsolated { .. }
        | Action::StartSubAgent { .. }
        | Action::Collect { .. }) => run_or_collect(p, sid, session, run, replay).await?,
        Action::PollTask {
            envelope,
            task,
            asks,
        } => tasks::poll(p, ctx, session, &envelope, &task, asks, replay).await?,
        Action::CancelTask { envelope, task } => {
            info!(session = sid, token = %envelope.token, task = %task.id, "cancelling the MCP task");
            p.tools.cancel_task(&envelope.tool_call, &task).await;
        }
        Action::RecordResult { token, result, by } => {
            record_and_release(p, ctx, &token, &result, &by).await?
        }
        Action::StoreCache { key, result } => {
            patiently(p.clock, "caching a result", || {
                p.cache.remember(&key, &result, p.clock.now())
            })
            .await?
        }
        Action::Yield { pending } => {
            debug!(session = sid, pending = pending.len(), "yielded");
        }
        // Reported from the outlook once the queue is drained.
        Action::Finished { .. } | Action::Failed { .. } => {}
    }
    Ok(())
}

/// A child Session to make (or look at) joins this session's trace,
/// under the span of the call that makes it.
fn join_the_trace(ctx: &StepContext<'_>, action: &mut Action) {
    let (Some(trace), Action::StartSubAgent { child, .. }) = (ctx.trace, action) else {
        return;
    };
    let span = trace.sub_agent_call(ctx.sid, &child.call_id.to_string());
    child.traceparent = Some(span.traceparent());
}

/// Starts or collects a background or isolated attempt; a background call
/// with a cached result is answered from the cache instead.
pub(super) async fn run_or_collect(
    p: &Ports<'_>,
    sid: &str,
    session: &mut Session,
    action: Action,
    replay: &mut Vec<Event>,
) -> Result<(), StoreError> {
    let run = match &action {
        Action::RunInBackground {
            envelope,
            attempt,
            cache_key,
        } => {
            // A call with no continuation is answered from the cache here,
            // as `ensure_continuation` answers one that has.
            let hit = match cache_key {
                Some(k) => patiently(p.clock, "a cache lookup", || p.cache.lookup(k)).await?,
                None => None,
            };
            if let Some(hit) = hit {
                serve_cached(p, sid, session, envelope, hit);
                return Ok(());
            }
            Run::start(envelope, *attempt, RunKind::Background)
        }
        Action::LaunchIsolated {
            envelope,
            spec,
            attempt,
        } => Run::start(envelope, *attempt, RunKind::Isolated(spec)),
        Action::StartSubAgent {
            envelope,
            child,
            attempt,
        } => Run::start(envelope, *attempt, RunKind::SubAgent(child)),
        Action::Collect {
            envelope,
            isolated,
            child,
            attempt,
        } => {
            let kind = match (isolated, child) {
                (Some(spec), _) => RunKind::Isolated(spec),
                (None, Some(child)) => RunKind::SubAgent(child),
                (None, None) => RunKind::Background,
            };
            Run {
                collect_only: true,
                ..Run::start(envelope, *attempt, kind)
            }
        }
        _ => unreachable!("run_or_collect takes background, isolated and collect actions"),
    };
    run_attempt(p, sid, session, run, replay).await;
    Ok(())
}

/// Records a result, then frees an isolated call's runner resources.
pub(super) async fn record_and_release(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    token: &ContinuationToken,
    result: &ToolResult,
    by: &str,
) -> Result<(), StoreError> {
    // Known at the step's start: the turn may have closed since. A child
    // ended early (a timeout) is stopped by its release.
    let waited = ctx
        .known_waits
        .iter()
        .find(|(t, _)| t == token)
        .and_then(|(_, w)| *w);
    record_result(p, ctx.sid, token, result, by).await?;
    match waited {
        Some(WaitingFor::Isolated) => p.runner.release(token).await,
        Some(WaitingFor::SubAgent) => p.runner.release_child(token).await,
        _ => {}
    }
    Ok(())
}

/// Asks the model (its claim committed) and feeds the reply or the failure
/// to the core, keeping it for a replay should the checkpoint be lost.
pub(super) async fn call_model(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    turn: u32,
    replay: &mut Vec<Event>,
) {
    let (agent, sid) = (ctx.agent, ctx.sid);
    p.observer.began(&Work::ModelCall { turn });
    let reply = p
        .model
        .reply(ModelInput {
            system_prompt: &agent.system_prompt,
            turns: &session.state().turns,
            tools: &agent.tools,
        })
        .await;
    let event = match reply {
        Ok(agent_turn) => {
            info!(
                session = sid,
                turn,
                calls = agent_turn.tool_calls.len(),
                "model replied"
            );
            Event::ModelReplied { turn: agent_turn }
        }
        Err(e) => {
            warn!(session = sid, turn, retryable = e.retryable, error = %e.message, "model call failed");
            p.observer.observe(&Progress::ModelError {
                session: sid.to_string(),
                error: e.message.clone(),
                retryable: e.retryable,
            });
            Event::ModelFailed {
                error: e.message,
                retryable: e.retryable,
                retry_after_ms: e.retry_after.map(|d| d.as_millis() as u64),
            }
        }
    };
    replay.push(event.clone());
    let shown = match &event {
        Event::ModelReplied { turn } => Some(turn.clone()),
        _ => None,
    };
    let now = p.clock.now();
    match session.handle(event, now) {
        Ok(_) => {
            if let Some(mut t) = shown {
                // Priced as the core priced it, for the observers' spend.
                if let Some(pricing) = &session.config().pricing {
                    t.usage.cost_micros = pricing.cost_micros(&t.usage);
                }
                p.observer
                    .observe(&Progress::agent_turn(sid, turn, &t, session.state()));
            }
        }
        Err(e) => refuse_logged(sid, "model reply", Err::<(), _>(e)),
    }
}

/// Runs a `runSync` tool inside the step (or serves it from the cache).
pub(super) async fn run_tool(
    p: &Ports<'_>,
    sid: &str,
    session: &mut Session,
    action: Action,
    replay: &mut Vec<Event>,
) -> Result<(), StoreError> {
    let Action::RunTool {
        call,
        tool_call,
        idempotency_key,
        timeout_seconds,
        cache_key,
        attempt,
    } = action
    else {
        unreachable!("run_tool takes RunTool actions")
    };
    let cached = match &cache_key {
        Some(k) => patiently(p.clock, "a cache lookup", || p.cache.lookup(k)).await?,
        None => None,
    };
    let from_cache = cached.is_some();
    let result = match cached {
        Some(r) => r,
        None => {
            let default = session.config().default_tool_timeout_secs;
            let timeout = Duration::from_secs(timeout_seconds.unwrap_or(default));
            p.observer.began(&Work::Tool {
                call: &call.to_string(),
            });
            match p.tools.run(&tool_call, &idempotency_key, timeout).await {
                ToolRun::Done(result) => result,
                ToolRun::Task(task) => {
                    info!(session = sid, call = %call, tool = %tool_call.name, task = %task.id, "tool became an MCP task");
                    let event = Event::TaskCreated {
                        call,
                        attempt,
                        task,
                    };
                    replay.push(event.clone());
                    refuse_logged(sid, "task handle", session.handle(event, p.clock.now()));
                    return Ok(());
                }
            }
        }
    };
    info!(
        session = sid,
        call = %call,
        tool = %tool_call.name,
        from_cache,
        failed = result.is_error(),
        "tool ran"
    );
    let by = match p.tools.served_by(&tool_call) {
        _ if from_cache => Provenance::Cache,
        Some(label) => Provenance::Runner(label),
        None => Provenance::RunSync,
    };
    p.observer
        .observe(&Progress::tool_result(sid, &call, &tool_call, &result, by));
    let event = Event::ToolFinished {
        call,
        result,
        from_cache,
    };
    replay.push(event.clone());
    refuse_logged(sid, "tool result", session.handle(event, p.clock.now()));
    Ok(())
}

/// Creates or adopts a call's continuation, and takes in what it already
/// holds (a result written before a crash, a cached result, a decision).
pub(super) async fn ensure_continuation(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    spec: crate::core::session::ContinuationSpec,
) -> Result<(), StoreError> {
    let (owner, sid) = (ctx.owner, ctx.sid);
    let now = p.clock.now();
    let record = patiently(p.clock, "a continuation", || {
        p.continuations.ensure(owner, &spec, now)
    })
    .await?;
    let settled = session
        .state()
        .find_call(&spec.token)
        .filter(|c| c.state().is_final())
        .and_then(|c| Some((c.result()?.clone(), c.completed_by().map(str::to_string))));
    if let (Some((result, by)), None) = (settled, &record.result) {
        // The call ended before its continuation existed (a crash
        // between the two writes): give the continuation its result.
        let by = by.unwrap_or_else(|| "agents".into());
        patiently(p.clock, "a result", || {
            p.continuations.complete(&spec.token, &result, &by, now)
        })
        .await?;
    } else if record.decision.is_some() || record.result.is_some() {
        // Written from outside before we got here (or before a crash).
        let waiting = Some(spec.waiting_for);
        let usage = recorded_child_usage(p, session, &record, waiting).await;
        apply_record(p.observer, session, &record, waiting, now, usage);
    } else if let Some(hit) = cache_hit(p, &spec).await? {
        // Only calls that run by themselves may be answered from the
        // cache; an approval or a person's answer is never skipped.
        let written = patiently(p.clock, "a result", || {
            p.continuations.complete(&spec.token, &hit, "cache", now)
        })
        .await?;
        if let WriteOnce::AlreadyDifferent { .. } = written {
            // Another writer completed it after our `ensure`: its result
            // stands, as the first of any write-once value does.
            return take_in_current(p, ctx, session, &spec).await;
        }
        let by = "cache".to_string();
        p.observer.observe(&Progress::tool_result(
            sid,
            &spec.call_id,
            &spec.tool_call,
            &hit,
            Provenance::Cache,
        ));
        refuse_logged(
            sid,
            "cached result",
            session.handle(
                Event::Wake {
                    token: spec.token.clone(),
                    result: hit,
                    by,
                },
                now,
            ),
        );
    } else if spec.waiting_for != WaitingFor::Background
        && !ctx
            .known_waits
            .contains(&(spec.token.clone(), Some(spec.waiting_for)))
    {
        p.observer.observe(&Progress::Deferred {
            session: sid.to_string(),
            call: spec.call_id.to_string(),
            tool: spec.tool_call.name.clone(),
            token: spec.token.0.clone(),
            waiting_for: spec.waiting_for,
            reason: spec.reason.clone(),
        });
    }
    Ok(())
}

/// Reads a continuation again and takes in what it holds.
async fn take_in_current(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    spec: &crate::core::session::ContinuationSpec,
) -> Result<(), StoreError> {
    let now = p.clock.now();
    let record = patiently(p.clock, "a continuation", || {
        p.continuations.ensure(ctx.owner, spec, now)
    })
    .await?;
    let waiting = Some(spec.waiting_for);
    let usage = recorded_child_usage(p, session, &record, waiting).await;
    apply_record(p.observer, session, &record, waiting, now, usage);
    Ok(())
}

/// Tells the observer of `result`, the answer to the call `envelope` carries.
pub(super) fn observe_result(
    p: &Ports<'_>,
    sid: &str,
    envelope: &crate::core::envelope::CallEnvelope,
    result: &ToolResult,
    from: Provenance,
) {
    p.observer.observe(&Progress::tool_result(
        sid,
        &envelope.context.call_id,
        &envelope.tool_call,
        result,
        from,
    ));
}

/// Answers a background call from the cache.
pub(super) fn serve_cached(
    p: &Ports<'_>,
    sid: &str,
    session: &mut Session,
    envelope: &crate::core::envelope::CallEnvelope,
    hit: ToolResult,
) {
    observe_result(p, sid, envelope, &hit, Provenance::Cache);
    let wake = Event::Wake {
        token: envelope.token.clone(),
        result: hit,
        by: crate::core::acceptance::CACHE_BY.to_string(),
    };
    refuse_logged(sid, "cached result", session.handle(wake, p.clock.now()));
}

/// Writes a call's result into its continuation (write-once).
pub(super) async fn record_result(
    p: &Ports<'_>,
    sid: &str,
    token: &ContinuationToken,
    result: &ToolResult,
    by: &str,
) -> Result<(), StoreError> {
    let now = p.clock.now();
    let outcome = match patiently(p.clock, "a result", || {
        p.continuations.complete(token, result, by, now)
    })
    .await
    {
        // Not created yet (a crash before its ensure): the queued
        // ensure writes the result when it creates it.
        Err(StoreError::UnknownToken(_)) => {
            debug!(session = sid, %token, "result waits for its continuation");
            return Ok(());
        }
        other => other?,
    };
    if let WriteOnce::AlreadyDifferent { by, .. } = outcome {
        p.observer.observe(&Progress::Note {
            session: sid.to_string(),
            message: format!(
                "{token} was completed by {by} first; that result stands in the continuation"
            ),
        });
    }
    Ok(())
}

/// Actions with effects outside the store: a model call, a tool run, a
/// background or isolated attempt.
pub(super) fn starts_work(action: &Action) -> bool {
    matches!(
        action,
        Action::CallModel { .. }
            | Action::RunTool { .. }
            | Action::RunInBackground { .. }
            | Action::LaunchIsolated { .. }
            | Action::StartSubAgent { .. }
    )
}

/// The call's `timeout` decorator, else the driver's default (the
/// operator's `--job-active-deadline-seconds`).
pub(super) fn attempt_timeout(
    session: &Session,
    envelope: &crate::core::envelope::CallEnvelope,
) -> Duration {
    let default = session.config().default_tool_timeout_secs;
    Duration::from_secs(
        envelope
            .policy
            .decorators
            .timeout_seconds
            .unwrap_or(default),
    )
}

/// One attempt handed to the runner.
pub(super) struct Run<'a> {
    envelope: &'a crate::core::envelope::CallEnvelope,
    attempt: u32,
    kind: RunKind<'a>,
    /// Only look at what runs or ran (while paused): start nothing.
    collect_only: bool,
}

impl<'a> Run<'a> {
    fn start(
        envelope: &'a crate::core::envelope::CallEnvelope,
        attempt: u32,
        kind: RunKind<'a>,
    ) -> Self {
        Run {
            envelope,
            attempt,
            kind,
            collect_only: false,
        }
    }
}

/// Starts (or collects) one attempt and feeds a finished one's result to
/// the core.
pub(super) async fn run_attempt(
    p: &Ports<'_>,
    sid: &str,
    session: &mut Session,
    run: Run<'_>,
    replay: &mut Vec<Event>,
) {
    let Run {
        envelope,
        attempt,
        kind,
        collect_only,
    } = run;
    let status = if collect_only {
        p.runner.collect(kind, envelope, attempt).await
    } else {
        let timeout = attempt_timeout(session, envelope);
        p.observer.began(&Work::Tool {
            call: &envelope.context.call_id.to_string(),
        });
        p.runner.start(kind, envelope, attempt, timeout).await
    };
    let by = p.runner.label(kind);
    let usage = match (kind, &status) {
        (RunKind::SubAgent(child), RunStatus::Finished(_)) => p.runner.child_usage(child).await,
        _ => None,
    };
    finish_attempt(
        p, session, envelope, attempt, status, by, sid, replay, usage,
    );
}

#[allow(clippy::too_many_arguments)]
pub(super) fn finish_attempt(
    p: &Ports<'_>,
    session: &mut Session,
    envelope: &crate::core::envelope::CallEnvelope,
    attempt: u32,
    status: RunStatus,
    by: &'static str,
    sid: &str,
    replay: &mut Vec<Event>,
    child_usage: Option<crate::core::TokenUsage>,
) {
    let result = match status {
        RunStatus::Finished(result) => result,
        RunStatus::InFlight => return,
        RunStatus::Task(task) => {
            let event = Event::TaskCreated {
                call: envelope.context.call_id,
                attempt,
                task,
            };
            replay.push(event.clone());
            refuse_logged(sid, "task handle", session.handle(event, p.clock.now()));
            return;
        }
    };
    observe_result(p, sid, envelope, &result, Provenance::Runner(by));
    let failed = result.is_error().then(|| result.to_model_text());
    let event = Event::AttemptFinished {
        token: envelope.token.clone(),
        attempt,
        result,
    };
    let event = with_child_usage(event, child_usage);
    replay.push(event.clone());
    refuse_logged(sid, "attempt result", session.handle(event, p.clock.now()));
    note_retry(p, session, &envelope.token, attempt, failed, sid);
}

/// Says when a failed attempt will be retried (the `retries` decorator).
pub(super) fn note_retry(
    p: &Ports<'_>,
    session: &Session,
    token: &ContinuationToken,
    attempt: u32,
    failed: Option<String>,
    sid: &str,
) {
    let (Some(why), Some(call)) = (failed, session.state().find_call(token)) else {
        return;
    };
    if let Some(at) = call.retry_at() {
        let secs = (at.0 - p.clock.now().0).max(0) as f64 / 1000.0;
        p.observer.observe(&Progress::Note {
            session: sid.to_string(),
            message: format!(
                "{} ({}) attempt {attempt} failed ({why}); retrying in {secs:.0}s",
                call.id, call.call.name
            ),
        });
    }
}

pub(super) async fn cache_hit(
    p: &Ports<'_>,
    spec: &crate::core::session::ContinuationSpec,
) -> Result<Option<ToolResult>, StoreError> {
    if !matches!(
        spec.waiting_for,
        WaitingFor::Background | WaitingFor::Isolated
    ) {
        return Ok(None);
    }
    match &spec.cache_key {
        Some(k) => patiently(p.clock, "a cache lookup", || p.cache.lookup(k)).await,
        None => Ok(None),
    }
}

/// A sub-agent's answer carries its child's usage into the parent's.
pub(super) fn with_child_usage(answer: Event, usage: Option<crate::core::TokenUsage>) -> Event {
    match usage {
        Some(usage) => Event::ChildAnswered {
            answer: Box::new(answer),
            usage,
        },
        None => answer,
    }
}
