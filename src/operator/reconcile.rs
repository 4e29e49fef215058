//! One reconcile of a Session, in stages that are types:
//!
//! 1. [`Resolved`]: the agent dereferenced and validated ([`super::resolve`]),
//!    or why it is not ready (its `Ready=False` condition and a recheck);
//!    a fork's history is written first, once ([`super::fork`]);
//! 2. [`Stepped`]: one engine step over the [`KubeStore`], with the status
//!    applied once: the store writes the report's conditions with each status
//!    write of the step, and settles them once more only when they changed;
//! 3. the report: Events, metrics, notifications and the requeue.

use super::api_requests::Tally;
use super::background::SessionRunner;
use super::resolve::{resolve, NotReady, Resolved};
use super::{events, failure, notify, publish, report, retention, task_cancel, Context, Error};
use crate::agent::{AgentModel, AgentTools};
use crate::api::Session;
use crate::core::conditions::Status;
use crate::core::SessionId;
use crate::engine::{self, Clock, Ports, Progress, Roles, StepOutcome, SystemClock};
use crate::store::kube::KubeStore;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};

/// One reconcile, timed.
pub(super) async fn reconcile(session: Arc<Session>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let result = reconcile_timed(session, ctx.clone()).await;
    ctx.metrics.reconcile_duration(started.elapsed());
    result
}

async fn reconcile_timed(session: Arc<Session>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = session.name_any();
    let ns = session
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    // The watch delivering a version this process already saw replaced
    // (its own earlier write, mostly): the newer one's delivery follows and
    // steps the session, so this one needs no step, and no read. That later
    // reconcile runs after this one, so its requeue is the one that holds.
    if ctx.known.is_superseded(&session) {
        return Ok(Action::await_change());
    }
    let Some(_slot) = ctx.slots.take(&ns) else {
        ctx.metrics.namespace_at_cap();
        return Ok(Action::requeue(namespace_busy_recheck(&name)));
    };
    // Taken now, so that a reconcile that ends before its step (retention,
    // deletion, backing off) leaves no whole copy behind in the operator.
    let handed = ctx.handed.take(&ns, &name);
    if session.metadata.deletion_timestamp.is_some() {
        // Its continuations go by garbage collection; its runs by the
        // sweep; its MCP tasks are cancelled here.
        task_cancel::cancel_then_release(&ctx, &session, &ns).await?;
        return Ok(Action::await_change());
    }
    let ttl = retention::ttl(&session, &ctx.options);
    if let Some(wait) = retention::retention_wait(&session, ttl, SystemClock.now()) {
        return retention::retain_or_delete(&ctx, &session, &ns, wait).await;
    }
    if let Some(wait) = failure::backing_off(&ctx, &session) {
        return Ok(Action::requeue(wait));
    }
    // The step starts from the watch's copy only when it is the newest
    // this process saw: an older one would show the operator's own claim
    // of a call as work cut off, and the call would run again.
    // Its requests are noted, to count what a wake asks before it writes.
    let tally = Tally::default();
    let store = ctx
        .store_over(&tally.client(&ctx.client), &ns)
        .starting_from(handed);
    let resolved = match resolve(&ctx, &session, &ns).await {
        Ok(r) => r,
        Err(not_ready) => return report_not_ready(&ctx, &session, store, not_ready).await,
    };
    // Once the watched status shows the history written, no read is
    // spent on it again (a stale object is caught by `seed`'s own check).
    let seeded = session
        .status
        .as_ref()
        .is_some_and(|s| s.forked_from.is_some());
    if let Some(from) = session.spec.fork_from.as_ref().filter(|_| !seeded) {
        let id = SessionId(name.clone());
        if let Some(not_ready) = super::fork::seed(&store, &id, from).await? {
            return report_not_ready(&ctx, &session, store, not_ready).await;
        }
    }
    match Stepped::step(&ctx, &session, &ns, store, resolved, tally).await? {
        Some(stepped) => Ok(stepped.report(&ctx, &session, &ns, ttl).await),
        None => Ok(Action::await_change()),
    }
}

/// A session after its engine step, with its status settled.
struct Stepped {
    step: engine::StepReport,
    /// What the step observed, for Events and metrics.
    progress: Vec<Progress>,
    /// Why a ResourceQuota held a call's Job, if one did.
    quota: Option<String>,
    /// The conditions needed a write of their own.
    settled: bool,
    store: KubeStore,
    notify: Option<notify::Target>,
    /// Who the step's model turns spent for (metrics labels).
    spend: report::SpendLabels,
    /// When a namespace Budget lets the session look again (its period's
    /// end), or a charge that lost its races is tried again.
    budget_wake: Option<Duration>,
    /// The reconcile's API requests so far.
    tally: Tally,
}

impl Stepped {
    /// The step of a session whose agent is `resolved`; `None` when the
    /// session is going (its MCP tasks being cancelled).
    async fn step(
        ctx: &Context,
        session: &Session,
        ns: &str,
        store: KubeStore,
        mut resolved: Resolved,
        tally: Tally,
    ) -> Result<Option<Stepped>, Error> {
        let store = store.with_report(Arc::new(report::SessionConditions {
            ready: report::ready(
                Status::True,
                "AgentResolved",
                format!("agent {} resolved and valid", resolved.agent_name),
            ),
        }));
        let uses_mcp = !resolved.mcp.is_empty();
        let held = match task_cancel::hold_before_step(ctx, session, ns, uses_mcp).await? {
            task_cancel::Hold::Step { held } => held,
            task_cancel::Hold::Going => return Ok(None),
        };
        let now = SystemClock.now();
        let currency = resolved.runtime.config.pricing.as_ref();
        let currency = currency.map(|p| p.currency.clone());
        let shared =
            super::budgets::shared_for(&resolved.budgets, session, now, currency.as_deref());
        resolved.runtime.config.shared_budgets = shared.clone();
        let (step, progress, quota) = step_session(ctx, session, ns, &store, &resolved).await?;
        let budget_wake = charge_budgets(ctx, session, &step.state, &resolved)
            .await?
            .or(step
                .state
                .budget_exhausted
                .as_ref()
                .and_then(|_| super::budgets::next_period_end(&shared, now)));
        let id = SessionId(session.name_any());
        let settled = store.settle(&id, &step.state).await?;
        // The next step (often a wake) starts from it without a read.
        if let Some((newest, older, confirmed)) = store.take_newest() {
            ctx.handed.hand_back(&newest, &older, confirmed);
        }
        task_cancel::keep_finalizer(ctx, session, ns, &step.state, uses_mcp, held).await?;
        ctx.background
            .prune(&session.uid().unwrap_or_default(), &step.state);
        ctx.failures.succeeded(&failure::key(session));
        Ok(Some(Stepped {
            step,
            progress,
            quota,
            settled,
            store,
            notify: resolved.notify,
            spend: report::SpendLabels {
                namespace: ns.to_string(),
                agent: resolved.agent_name.clone(),
                model: resolved.model_name.clone(),
            },
            budget_wake,
            tally,
        }))
    }

    /// Events, metrics and notifications for the step, and when to look
    /// again.
    async fn report(self, ctx: &Context, session: &Session, ns: &str, ttl: Option<u64>) -> Action {
        let Stepped {
            step,
            progress,
            quota,
            settled,
            store,
            notify,
            spend,
            budget_wake,
            tally,
        } = self;
        if progress.iter().any(|p| matches!(p, Progress::Woke { .. })) {
            ctx.metrics
                .wake_requests_before_write(tally.before_first_write());
        }
        report_step(ctx, session, &step, progress, &spend);
        let quota_retry = quota.map(|why| held_by_quota(ctx, session, why));
        // Waits for a person are announced once each (a marker in the
        // Continuation's status); a failed POST is retried after a backoff.
        let retry_notify = match (&notify, &step.outcome) {
            (Some(target), StepOutcome::Waiting { .. } | StepOutcome::Busy { .. }) => {
                notify::after_step(ctx, session, ns, target, store.owned_continuations()).await
            }
            _ => None,
        };
        info!(
            session = %failure::key(session),
            outcome = report::outcome_name(&step.outcome),
            writes = step.writes,
            api_writes = store.api_writes(),
            wrote = step.writes > 0 || settled,
            "step"
        );
        let look_again = [retry_notify, quota_retry, budget_wake]
            .into_iter()
            .flatten()
            .min();
        report::requeue(&step.outcome, ttl, look_again, SystemClock.now())
    }
}

/// Charges the session's usage so far to the namespace Budgets that select
/// it (after the step committed it; a crash before this charge is made
/// good by the next reconcile, which charges the same total). Some
/// wait when a charge lost every race and is tried again soon.
async fn charge_budgets(
    ctx: &Context,
    session: &Session,
    state: &crate::core::SessionState,
    resolved: &Resolved,
) -> Result<Option<Duration>, Error> {
    // Its own spend: its sub-agents are sessions the Budgets count too.
    let own = state.usage.less(&state.children_usage);
    let total = crate::api::namespace_budget::Spent {
        tokens: own.total(),
        cost_micros: own.cost_micros,
    };
    let currency = resolved
        .runtime
        .config
        .pricing
        .as_ref()
        .map(|p| p.currency.as_str());
    let done =
        super::budgets::charge(&ctx.client, &resolved.budgets, session, total, currency).await?;
    Ok((!done).then_some(super::budgets::CHARGE_RETRY))
}

/// When a session whose namespace holds all its slots is looked at again:
/// in one to two seconds, spread by its name so they do not come back at
/// once.
fn namespace_busy_recheck(name: &str) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    Duration::from_millis(1_000 + h.finish() % 1_000)
}

/// A session whose agent cannot run now: its `Ready=False` condition (and
/// an Event when that is news), and a recheck.
async fn report_not_ready(
    ctx: &Context,
    session: &Session,
    store: KubeStore,
    not_ready: NotReady,
) -> Result<Action, Error> {
    let id = SessionId(session.name_any());
    let key = failure::key(session);
    let store = store.with_report(Arc::new(report::SessionConditions {
        ready: report::ready(Status::False, not_ready.reason, not_ready.message.clone()),
    }));
    // Read fresh: the conditions follow the stored state.
    let Some(loaded) = crate::ports::SessionPort::load(&store, &id).await? else {
        return Ok(Action::await_change());
    };
    if store.settle(&id, &loaded.value.state).await? {
        warn!(session = %key, reason = not_ready.reason, message = %not_ready.message, "session not ready");
        let event = kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: not_ready.reason.into(),
            note: Some(not_ready.message),
            action: "ResolveAgent".into(),
            secondary: None,
        };
        publish(ctx, &session.object_ref(&()), event);
    }
    ctx.failures.succeeded(&key);
    Ok(Action::requeue(not_ready.recheck))
}

/// A call's Job waits for the namespace's ResourceQuota: said in a
/// Warning Event (repeats fold into its series), and looked at again soon.
fn held_by_quota(ctx: &Context, session: &Session, why: String) -> Duration {
    let event = events::event(
        kube::runtime::events::EventType::Warning,
        "QuotaExceeded",
        "CreateJob",
        format!(
            "an isolated call waits for room in the namespace's ResourceQuota, tried again every {} s until the call's timeout: {why}",
            crate::runner::job::QUOTA_RETRY.as_secs()
        ),
    );
    publish(ctx, &session.object_ref(&()), event);
    crate::runner::job::QUOTA_RETRY
}

/// The engine step over the cluster's ports; returns its report, what it
/// observed, and why a ResourceQuota held a call's Job, if one did.
async fn step_session(
    ctx: &Context,
    session: &Session,
    ns: &str,
    store: &KubeStore,
    resolved: &Resolved,
) -> Result<(engine::StepReport, Vec<Progress>, Option<String>), Error> {
    let progress: Mutex<Vec<Progress>> = Mutex::new(Vec::new());
    let observer = |p: &Progress| progress.lock().expect("progress").push(p.clone());
    let model = AgentModel(&resolved.model);
    let tools = AgentTools(&resolved.tools);
    let runner = SessionRunner {
        background: ctx.background.clone(),
        session: ObjectRef::from_obj(session),
        uid: session.uid().unwrap_or_default(),
        tools: resolved.tools.clone(),
        jobs: ctx.jobs.as_ref().map(|j| j.with_namespace(ns)),
        children: super::children::Children {
            client: store.client().clone(),
            namespace: ns.to_string(),
            parent: session.name_any(),
            parent_uid: session.uid().unwrap_or_default(),
            paused: session.spec.paused,
            ended_usage: Default::default(),
        },
    };
    let ports = Ports::over_store(store, &model, &tools, &runner, &observer)
        .traced(crate::telemetry::tracer());
    let roles = Roles {
        model: true,
        background: true,
        isolated: ctx.jobs.is_some(),
    };
    let id = SessionId(session.name_any());
    let report = engine::step(&ports, &id, &resolved.runtime, &ctx.holder, roles).await?;
    let quota = runner.jobs.as_ref().and_then(|j| j.held_by_quota());
    Ok((report, progress.into_inner().expect("progress"), quota))
}

/// Metrics and Events for what a step did; a wait already announced is not
/// announced again (every step re-ensures open continuations).
fn report_step(
    ctx: &Context,
    session: &Session,
    step: &engine::StepReport,
    progress: Vec<Progress>,
    spend: &report::SpendLabels,
) {
    let uid = session.uid().unwrap_or_default();
    let progress = ctx
        .announced
        .lock()
        .expect("announced")
        .news(&uid, progress);
    ctx.metrics.reconciled(true);
    for p in &progress {
        report::count(&ctx.metrics, p);
        report::count_spend(&ctx.metrics, spend, p);
    }
    let reference = session.object_ref(&());
    for e in report::step_events(&progress, &step.outcome, step.writes > 0) {
        publish(ctx, &reference, e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_put_off_come_back_spread_over_a_second() {
        let waits: std::collections::BTreeSet<Duration> = (0..50)
            .map(|i| namespace_busy_recheck(&format!("s{i}")))
            .collect();
        assert!(waits.len() > 10, "spread: {waits:?}");
        assert!(waits
            .iter()
            .all(|w| *w >= Duration::from_secs(1) && *w < Duration::from_secs(2)));
    }
}
