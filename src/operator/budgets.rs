//! Namespace `Budget`s in the operator: what the core is handed before a
//! session's step (from the watch cache, never a read per step), the
//! charge of a session's usage after it (compare-and-swap on the Budget's
//! status), and the Budget's own reconcile (period rollover, deleted
//! sessions folded, conditions).

use super::Error;
use crate::api::namespace_budget::{Charged, Spent, MAX_BUDGETS_PER_SESSION};
use crate::api::{Budget, Session};
use crate::core::shared_budget::SharedBudget;
use crate::core::Millis;
use crate::engine::{Clock, SystemClock};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, warn};

/// Tries of one compare-and-swap write of a Budget's status before the
/// session is looked at again (many sessions charge one Budget at once).
const CAS_ATTEMPTS: u32 = 12;

/// When a charge that lost every race is tried again.
pub(super) const CHARGE_RETRY: Duration = Duration::from_secs(1);

/// The reason of a session's `Ready=False` while too many Budgets select it.
pub(super) const TOO_MANY_BUDGETS: &str = "TooManyBudgets";

/// The reason of a session's `Ready=False` while the operator has not yet
/// listed the Budgets: a step then could spend what a Budget forbids.
pub(super) const BUDGETS_NOT_LISTED: &str = "BudgetsNotListed";

/// How long a step waits for the first list of Budgets before the
/// session is held (at start it arrives in milliseconds; when the
/// operator may not list Budgets, never).
const LIST_WAIT: Duration = Duration::from_secs(5);

/// Why no session may step yet: the Budget watch has not listed the
/// Budgets once. An empty cache would read as "no Budget selects it", and
/// the session would spend what its Budget forbids.
pub(super) async fn not_listed(budgets: &Store<Budget>) -> Option<String> {
    not_listed_within(budgets, LIST_WAIT).await
}

async fn not_listed_within(budgets: &Store<Budget>, wait: Duration) -> Option<String> {
    let listed = tokio::time::timeout(wait, budgets.wait_until_ready()).await;
    if matches!(listed, Ok(Ok(()))) {
        return None;
    }
    Some(format!(
        "the operator has not listed the namespace Budgets in {}s, so it cannot tell what \
         this session may spend; it runs once they are listed: check that the operator's \
         ClusterRole may list and watch budgets.agents-exe.io, that the Budget CRD is \
         installed, and the operator's log",
        wait.as_secs()
    ))
}

/// Why a session may not run while `selecting` (the Budgets that select
/// it) are as they are: more than [`MAX_BUDGETS_PER_SESSION`].
pub(super) fn too_many(selecting: &[Arc<Budget>]) -> Option<String> {
    let mut names: Vec<String> = selecting.iter().map(|b| b.name_any()).collect();
    if names.len() <= MAX_BUDGETS_PER_SESSION {
        return None;
    }
    names.sort();
    let more = names.len() - 3;
    Some(format!(
        "{} Budgets select this session ({}, and {more} more); at most \
         {MAX_BUDGETS_PER_SESSION} may, as each is charged after every model turn: \
         narrow their spec.selector or delete some, and the session goes on",
        names.len(),
        names[..3].join(", ")
    ))
}

/// The Budgets of the session's namespace that select it: looked up once
/// a reconcile, for its checks before the step and its charge after.
pub(super) fn selecting(budgets: &Store<Budget>, session: &Session) -> Vec<Arc<Budget>> {
    let ns = session.namespace();
    budgets
        .state()
        .into_iter()
        .filter(|b| b.namespace() == ns && b.spec.selects(session.labels()))
        .collect()
}

/// What the core compares before each model call of `session`, whose
/// agent prices in `currency`, from `selecting` (the Budgets that select it).
pub(super) fn shared_for(
    selecting: &[Arc<Budget>],
    session: &Session,
    now: Millis,
    currency: Option<&str>,
) -> Vec<SharedBudget> {
    let uid = session.uid().unwrap_or_default();
    selecting
        .iter()
        .map(|b| b.shared(&uid, now, currency))
        .collect()
}

/// When the soonest period of these Budgets ends, from `now`.
pub(super) fn next_period_end(shared: &[SharedBudget], now: Millis) -> Option<Duration> {
    shared
        .iter()
        .filter_map(|b| b.period_end)
        .min()
        .map(|end| Duration::from_millis((end.0 - now.0).max(1_000) as u64))
}

/// Charges `selecting` (the Budgets that select `session`) with its usage
/// so far (`total`); `currency` is its agent's pricing currency. False
/// when a charge lost every race and must be tried again.
pub(super) async fn charge(
    client: &kube::Client,
    selecting: &[Arc<Budget>],
    session: &Session,
    total: Spent,
    currency: Option<&str>,
) -> Result<bool, Error> {
    let (uid, name) = (session.uid().unwrap_or_default(), session.name_any());
    let ns = session.namespace().unwrap_or_default();
    let mut done = true;
    for budget in selecting {
        let counted = budget.counts_cost_in(currency);
        // The cache shows this usage counted in the current period: no write.
        let mut seen = budget.status.clone().unwrap_or_default();
        let now = SystemClock.now();
        let current = seen.started() == Some(period_start(budget, now));
        if current && seen.charge(&uid, &name, total, counted) == Charged::Unchanged {
            continue;
        }
        let api: Api<Budget> = Api::namespaced(client.clone(), &ns);
        done &= charge_one(&api, &budget.name_any(), &uid, &name, total, counted).await?;
    }
    Ok(done)
}

fn period_start(budget: &Budget, now: Millis) -> Millis {
    let created = budget
        .metadata
        .creation_timestamp
        .as_ref()
        .map(crate::api::convert::millis)
        .unwrap_or(now);
    budget.spec.period.start(now, created)
}

/// One Budget charged by compare-and-swap: read, roll the period over if
/// it ended, set the session's total, write with the read's
/// resourceVersion; a conflict reads again.
async fn charge_one(
    api: &Api<Budget>,
    budget: &str,
    uid: &str,
    session: &str,
    total: Spent,
    counted: bool,
) -> Result<bool, Error> {
    for attempt in 0..CAS_ATTEMPTS {
        let mut fresh = match api.get_opt(budget).await? {
            Some(b) => b,
            None => return Ok(true),
        };
        let mut status = fresh.status.clone().unwrap_or_default();
        let start = period_start(&fresh, SystemClock.now());
        let rolled = status.started().is_none_or(|s| s < start);
        if rolled {
            status.roll_over(start);
        }
        let charged = status.charge(uid, session, total, counted);
        if charged == Charged::Full {
            warn!(
                budget,
                session, "the Budget counts no more sessions this period"
            );
        }
        if !rolled && charged != Charged::Changed {
            return Ok(true);
        }
        fresh.status = Some(status);
        fresh.metadata.managed_fields = None;
        match api
            .replace_status(budget, &PostParams::default(), &fresh)
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => {
                debug!(
                    budget,
                    session, attempt, "budget charge lost a race; reading again"
                );
                tokio::time::sleep(Duration::from_millis(10 + u64::from(attempt) * 15)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}

/// The sessions a Budget change may let go: those of its namespace it
/// selects that wait for a Budget, and any there that too many Budgets
/// hold (the change may be a selector that no longer selects them) or
/// that were held before the Budgets were listed.
pub(super) fn sessions_waiting_on(
    sessions: &Store<Session>,
    budget: &Budget,
) -> Vec<ObjectRef<Session>> {
    let ns = budget.namespace();
    let has = |s: &Session, type_: &str, reason: &str| {
        s.status.as_ref().is_some_and(|st| {
            st.conditions
                .iter()
                .any(|c| c.type_ == type_ && c.reason == reason)
        })
    };
    sessions
        .state()
        .iter()
        .filter(|s| s.namespace() == ns)
        .filter(|s| {
            has(s, "Ready", TOO_MANY_BUDGETS)
                || has(s, "Ready", BUDGETS_NOT_LISTED)
                || (budget.spec.selects(s.labels()) && has(s, "Waiting", "BudgetExhausted"))
        })
        .map(|s| ObjectRef::from_obj(s.as_ref()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher::Event;

    fn session(status_reason: &str) -> Session {
        let mut s: Session = serde_json::from_value(serde_json::json!({
            "apiVersion": "agents-exe.io/v1alpha1", "kind": "Session",
            "metadata": {"name": "s", "namespace": "team", "labels": {"team": "a"}},
            "spec": {"agentRef": {"name": "worker"}, "messages": ["hi"]},
        }))
        .unwrap();
        let mut status = crate::api::session::SessionStatus::default();
        status
            .conditions
            .push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: status_reason.into(),
                message: String::new(),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    Default::default(),
                ),
                observed_generation: None,
            });
        s.status = Some(status);
        s
    }

    fn budget() -> Budget {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "agents-exe.io/v1alpha1", "kind": "Budget",
            "metadata": {"name": "team", "namespace": "team"},
            "spec": {"tokens": 1000, "selector": {"matchLabels": {"team": "z"}}},
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn no_step_before_the_budgets_are_listed_once() {
        let (store, mut writer) = kube::runtime::reflector::store::<Budget>();
        let why = not_listed_within(&store, Duration::from_millis(50)).await;
        let why = why.expect("an empty, never listed cache is not 'no Budget'");
        assert!(
            why.contains("list and watch budgets.agents-exe.io"),
            "{why}"
        );
        writer.apply_watcher_event(&Event::Init);
        assert!(not_listed_within(&store, Duration::from_millis(50))
            .await
            .is_some());
        writer.apply_watcher_event(&Event::InitDone);
        assert_eq!(
            not_listed_within(&store, Duration::from_millis(50)).await,
            None
        );
    }

    #[test]
    fn the_first_list_wakes_sessions_held_before_it_whatever_they_select() {
        let (sessions, mut writer) = kube::runtime::reflector::store::<Session>();
        writer.apply_watcher_event(&Event::Apply(session(BUDGETS_NOT_LISTED)));
        let woken = sessions_waiting_on(&sessions, &budget());
        assert_eq!(woken.len(), 1, "the held session is woken");
        let (sessions, mut writer) = kube::runtime::reflector::store::<Session>();
        writer.apply_watcher_event(&Event::Apply(session("AgentResolved")));
        assert!(sessions_waiting_on(&sessions, &budget()).is_empty());
    }
}
