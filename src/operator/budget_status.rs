//! The Budget controller: keeps each Budget's period, folds the entries
//! of deleted sessions into `settled`, and says in conditions whether it
//! is spent, whether its selector matches any Session and whether every
//! session's cost could be counted. Every write is compare-and-swap.

use super::Error;
use crate::api::namespace_budget::BudgetStatus;
use crate::api::{Budget, Session};
use crate::core::Millis;
use crate::engine::{Clock, SystemClock};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::Store;
use kube::ResourceExt;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// A Budget is looked at again at least this often (a session deleted
/// while the operator was away is folded by then).
const RECHECK: Duration = Duration::from_secs(300);

/// How long a Budget's reconcile waits for the sessions' first list.
const SESSIONS_LIST_WAIT: Duration = Duration::from_secs(5);

pub(super) struct BudgetContext {
    pub client: kube::Client,
    pub sessions: Store<Session>,
}

pub(super) async fn reconcile(
    budget: Arc<Budget>,
    ctx: Arc<BudgetContext>,
) -> Result<Action, Error> {
    // Before the sessions are listed every charged one would look deleted
    // (a read each to confirm it).
    let listed = tokio::time::timeout(SESSIONS_LIST_WAIT, ctx.sessions.wait_until_ready()).await;
    if !matches!(listed, Ok(Ok(()))) {
        return Ok(Action::requeue(SESSIONS_LIST_WAIT));
    }
    let ns = budget.namespace().unwrap_or_default();
    let name = budget.name_any();
    let in_ns: Vec<Arc<Session>> = ctx
        .sessions
        .state()
        .into_iter()
        .filter(|s| s.namespace().as_deref() == Some(ns.as_str()))
        .collect();
    let selected = in_ns
        .iter()
        .filter(|s| budget.spec.selects(s.labels()))
        .count();
    let gone = deleted_sessions(&ctx.client, &ns, &budget, &in_ns).await?;
    let api: Api<Budget> = Api::namespaced(ctx.client.clone(), &ns);
    let now = SystemClock.now();
    for _ in 0..8 {
        let Some(mut fresh) = api.get_opt(&name).await? else {
            return Ok(Action::await_change());
        };
        let before = fresh.status.clone().unwrap_or_default();
        let mut status = before.clone();
        let start = fresh.shared("", now, None).period_end;
        let period_start = fresh.spec.period.start(now, created(&fresh, now));
        if status.started().is_none_or(|s| s < period_start) {
            status.roll_over(period_start);
        }
        for uid in &gone {
            status.fold(uid);
        }
        status.conditions = conditions(&fresh, &status, selected, &ns, now);
        status.observed_generation = fresh.metadata.generation;
        let wake = start.map(|end| Duration::from_millis((end.0 - now.0).max(1_000) as u64));
        let again = Action::requeue(wake.map_or(RECHECK, |w| w.min(RECHECK)));
        if status == before {
            return Ok(again);
        }
        fresh.status = Some(status);
        fresh.metadata.managed_fields = None;
        match api
            .replace_status(&name, &PostParams::default(), &fresh)
            .await
        {
            Ok(_) => return Ok(again),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Action::requeue(Duration::from_secs(1)))
}

fn created(budget: &Budget, now: Millis) -> Millis {
    budget
        .metadata
        .creation_timestamp
        .as_ref()
        .map(crate::api::convert::millis)
        .unwrap_or(now)
}

/// The charged sessions that are gone: not in the cache, and a read
/// finds no Session of that name with that UID (a UID never comes back,
/// so folding it cannot count a live session twice).
async fn deleted_sessions(
    client: &kube::Client,
    ns: &str,
    budget: &Budget,
    in_ns: &[Arc<Session>],
) -> Result<Vec<String>, Error> {
    let live: BTreeSet<String> = in_ns.iter().filter_map(|s| s.uid()).collect();
    let api: Api<Session> = Api::namespaced(client.clone(), ns);
    let mut gone = Vec::new();
    let charged = budget
        .status
        .as_ref()
        .map(|s| s.charged.clone())
        .unwrap_or_default();
    for (uid, charge) in charged.iter().filter(|(uid, _)| !live.contains(*uid)) {
        let found = api.get_opt(&charge.session).await?;
        if found.and_then(|s| s.uid()).as_deref() != Some(uid.as_str()) {
            gone.push(uid.clone());
        }
    }
    Ok(gone)
}

/// `Exhausted`, `Selecting` and (with a cost limit) `CostCounted`, each
/// keeping its transition time while its status holds.
fn conditions(
    budget: &Budget,
    status: &BudgetStatus,
    selected: usize,
    ns: &str,
    now: Millis,
) -> Vec<Condition> {
    let spec = &budget.spec;
    let used = status.used;
    let spent_tokens = spec.tokens.filter(|l| used.tokens >= *l);
    let spent_cost = spec
        .cost_micros()
        .ok()
        .flatten()
        .filter(|l| used.cost_micros >= *l);
    let mut next = vec![match (spent_tokens, spent_cost) {
        (Some(limit), _) => cond("Exhausted", "True", "Spent", format!("used {} of {limit} tokens: the selected sessions wait before their next model call until the Budget is raised or its period starts over", used.tokens)),
        (_, Some(_)) => cond("Exhausted", "True", "Spent", format!("used {} of {} {}: the selected sessions wait before their next model call", crate::core::budget::show_micros(used.cost_micros), spec.cost.as_ref().map(|c| c.amount).unwrap_or_default(), spec.cost.as_ref().map(|c| c.currency.as_str()).unwrap_or(""))),
        _ => cond("Exhausted", "False", "WithinLimits", "the selected sessions may spend"),
    }];
    next.push(match selected {
        0 => cond("Selecting", "False", "NoSessionsMatch", format!("spec.selector matches no Session in namespace {ns}; check its matchLabels against the Sessions' labels")),
        n => cond("Selecting", "True", "SessionsMatch", format!("{n} Session(s) counted")),
    });
    if let Some(cost) = &spec.cost {
        let other: Vec<&str> = status
            .charged
            .values()
            .filter(|c| c.cost_not_counted)
            .map(|c| c.session.as_str())
            .collect();
        next.push(match other.len() {
            0 => cond("CostCounted", "True", "AllCounted", format!("every counted session is priced in {}", cost.currency)),
            n => cond("CostCounted", "False", "OtherCurrency", format!("{n} session(s) are priced in another currency than {} or not priced, so only their tokens are counted: {}", cost.currency, other.iter().take(10).cloned().collect::<Vec<_>>().join(", "))),
        });
    }
    for c in next.iter_mut() {
        c.observed_generation = budget.metadata.generation;
        c.last_transition_time = match status.conditions.iter().find(|p| p.type_ == c.type_) {
            Some(p) if p.status == c.status => p.last_transition_time.clone(),
            _ => crate::api::convert::time(now),
        };
    }
    next
}

fn cond(type_: &str, status: &str, reason: &str, message: impl Into<String>) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: crate::api::convert::time(Millis(0)),
        observed_generation: None,
    }
}
