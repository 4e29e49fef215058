//! The `Budget` resource: tokens and cost shared by the Sessions of a
//! namespace (all of them, or those its selector picks), per period.
//!
//! How it counts, exactly once (the ledger in `status`, pure here; the
//! operator writes it with compare-and-swap):
//!
//! - `status.charged` maps each counted session's UID to its usage so far
//!   (`tokens`, `costMicros`: the session's own cumulative `status.usage`)
//!   and its usage when the period started (`baseTokens`, ...). A charge
//!   *sets* the cumulative value (the higher of the stored and the new), so
//!   charging the same usage twice, from a replayed reconcile or a second
//!   operator, changes nothing.
//! - `status.settled` holds what sessions no longer in `charged` spent in
//!   this period (deleted sessions are folded into it).
//! - `used = settled + Σ (charged − base)`.
//! - When the period rolls over, `settled` starts at zero and each entry's
//!   base becomes its cumulative value.

use super::conditions_schema;
use super::convert::{err, millis, time, ConvertError};
use crate::core::budget::units_to_micros;
use crate::core::shared_budget::{OwnCharge, Period, SharedBudget};
use crate::core::Millis;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The most sessions one Budget counts in a period: each is an entry of
/// `status.charged`, so the object stays small. Sessions past it wait.
pub const MAX_CHARGED_SESSIONS: usize = 500;

/// The most Budgets that may select one session. Each is charged (a
/// compare-and-swap write) after every model turn of every session it
/// selects, so this bounds what one turn costs, whatever a namespace's
/// Budgets say. A session more select is held (`Ready=False`,
/// `TooManyBudgets`) until some go or stop selecting it.
pub const MAX_BUDGETS_PER_SESSION: usize = 8;

/// Tokens and cost that the Sessions of a namespace may spend together,
/// per day, per month or in all. A session whose Budget is spent waits
/// before its next model call (`waitingFor: budget`) until the Budget is
/// raised or its period starts over.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agents-exe.io",
    version = "v1alpha1",
    kind = "Budget",
    doc = "Tokens and cost the Sessions of a namespace may spend together, per day, month or in all.",
    namespaced,
    status = "BudgetStatus",
    shortname = "bgt",
    category = "agents-exe",
    printcolumn = r#"{"name":"Used","type":"integer","jsonPath":".status.used.tokens","description":"Tokens counted in this period"}"#,
    printcolumn = r#"{"name":"Limit","type":"integer","jsonPath":".spec.tokens","description":"spec.tokens"}"#,
    printcolumn = r#"{"name":"Period","type":"string","jsonPath":".spec.period","description":"day, month or none"}"#,
    printcolumn = r#"{"name":"Cost-Used","type":"integer","jsonPath":".status.used.costMicros","priority":1,"description":"Cost counted in this period, in millionths of spec.cost.currency"}"#,
    printcolumn = r#"{"name":"Cost-Limit","type":"number","jsonPath":".spec.cost.amount","priority":1,"description":"spec.cost.amount"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("has(self.tokens) || has(self.cost)").message("a Budget bounds tokens, cost or both: set spec.tokens (e.g. 1000000) or spec.cost (amount and currency)"))]
#[serde(rename_all = "camelCase")]
pub struct BudgetSpec {
    /// Most tokens (prompt plus completion) the selected sessions may
    /// spend together in a period (1 to 10^12).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // super::budget::MAX_TOKENS_LIMIT
    #[schemars(range(min = 1, max = 1_000_000_000_000u64))]
    pub tokens: Option<u64>,
    /// Most the selected sessions may cost together in a period, in one
    /// currency: sessions whose agent is priced in another are counted by
    /// tokens only (a condition names them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<CostLimit>,
    /// When the count starts over: `day` (UTC midnight), `month` (the
    /// first, UTC) or `none` (never).
    #[serde(default)]
    pub period: Period,
    /// Which Sessions of the namespace it counts; all when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<SessionSelector>,
}

/// A cost limit with its currency.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CostLimit {
    /// The amount, in whole units of `currency` (0 to 1000000), e.g. `25.5`.
    // super::budget::MAX_COST_LIMIT
    #[schemars(range(min = 0.0, max = 1_000_000.0))]
    pub amount: f64,
    /// The currency, as an ISO 4217 code (three capital letters), e.g.
    /// `USD`: the agents' `spec.model.pricing.currency`.
    #[schemars(regex(pattern = r"^[A-Z]{3}$"))]
    pub currency: String,
}

/// Sessions by their labels.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SessionSelector {
    /// Labels a session must carry, each with this value.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// Tokens and cost.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Spent {
    /// Prompt plus completion tokens.
    #[serde(default)]
    pub tokens: u64,
    /// Cost in millionths of `spec.cost.currency`.
    #[serde(default)]
    pub cost_micros: u64,
}

/// What one session has spent, as the Budget counted it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Charge {
    /// The Session's name.
    pub session: String,
    /// Its usage so far (its `status.usage`), over its whole life.
    #[serde(default)]
    pub total: Spent,
    /// Its usage when this period started (counted in an earlier one).
    #[serde(default)]
    pub base: Spent,
    /// Its agent is priced in another currency (or not at all): its cost
    /// is not counted, its tokens are.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cost_not_counted: bool,
}

impl Charge {
    fn in_period(&self) -> Spent {
        Spent {
            tokens: self.total.tokens.saturating_sub(self.base.tokens),
            cost_micros: self.total.cost_micros.saturating_sub(self.base.cost_micros),
        }
    }
}

/// What the Budget has counted: written by the operator only.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BudgetStatus {
    /// Counted in this period: `settled` plus each charged session's
    /// usage since the period started.
    #[serde(default)]
    pub used: Spent,
    /// When this period started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period_start: Option<Time>,
    /// What sessions no longer charged (deleted) spent in this period.
    #[serde(default)]
    pub settled: Spent,
    /// Each counted session's usage, by the Session's UID (at most 500).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub charged: BTreeMap<String, Charge>,
    /// `Exhausted` (True: the selected sessions wait), `Selecting` (False
    /// with reason `NoSessionsMatch` when the selector matches no Session),
    /// `CostCounted` (False: sessions priced in another currency).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// What a charge did to the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charged {
    /// It held this usage already: nothing to write.
    Unchanged,
    /// The ledger changed: write it.
    Changed,
    /// The session is new and the ledger is full.
    Full,
}

impl BudgetStatus {
    /// Sets `used` from the ledger.
    pub fn recount(&mut self) {
        let mut used = self.settled;
        for charge in self.charged.values() {
            let spent = charge.in_period();
            used.tokens = used.tokens.saturating_add(spent.tokens);
            used.cost_micros = used.cost_micros.saturating_add(spent.cost_micros);
        }
        self.used = used;
    }

    /// Records that the session `uid` has spent `total` over its life
    /// (idempotent: a lower or equal total changes nothing).
    pub fn charge(
        &mut self,
        uid: &str,
        session: &str,
        total: Spent,
        cost_counted: bool,
    ) -> Charged {
        let total = Spent {
            cost_micros: if cost_counted { total.cost_micros } else { 0 },
            ..total
        };
        let full = self.charged.len() >= MAX_CHARGED_SESSIONS;
        match self.charged.get_mut(uid) {
            Some(c) => {
                let next = Spent {
                    tokens: c.total.tokens.max(total.tokens),
                    cost_micros: c.total.cost_micros.max(total.cost_micros),
                };
                if next == c.total && c.cost_not_counted != cost_counted {
                    return Charged::Unchanged;
                }
                c.total = next;
                c.cost_not_counted = !cost_counted;
            }
            None if full => return Charged::Full,
            None => {
                let charge = Charge {
                    session: session.to_string(),
                    total,
                    base: Spent::default(),
                    cost_not_counted: !cost_counted,
                };
                self.charged.insert(uid.to_string(), charge);
            }
        }
        self.recount();
        Charged::Changed
    }

    /// Starts the period that began at `start`: what was counted before
    /// becomes each session's base, and nothing is settled yet.
    pub fn roll_over(&mut self, start: Millis) {
        self.period_start = Some(time(start));
        self.settled = Spent::default();
        for charge in self.charged.values_mut() {
            charge.base = charge.total;
        }
        self.recount();
    }

    /// Moves a deleted session's entry into `settled` (once: only while
    /// the entry is there).
    pub fn fold(&mut self, uid: &str) -> bool {
        let Some(charge) = self.charged.remove(uid) else {
            return false;
        };
        let spent = charge.in_period();
        self.settled.tokens = self.settled.tokens.saturating_add(spent.tokens);
        self.settled.cost_micros = self.settled.cost_micros.saturating_add(spent.cost_micros);
        self.recount();
        true
    }

    /// The period start stored, if any.
    pub fn started(&self) -> Option<Millis> {
        self.period_start.as_ref().map(millis)
    }
}

impl BudgetSpec {
    /// Whether the session with `labels` is counted.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector
            .as_ref()
            .is_none_or(|s| s.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v)))
    }

    /// The cost limit in micro-units.
    pub fn cost_micros(&self) -> Result<Option<u64>, ConvertError> {
        let Some(cost) = &self.cost else {
            return Ok(None);
        };
        match units_to_micros(cost.amount).filter(|_| cost.amount <= super::budget::MAX_COST_LIMIT)
        {
            Some(m) => Ok(Some(m)),
            None => Err(err(
                "spec.cost.amount",
                format!(
                    "{} is not a cost limit; give a number from 0 to {}",
                    cost.amount,
                    super::budget::MAX_COST_LIMIT
                ),
            )),
        }
    }
}

impl Budget {
    /// Whether a session whose agent prices in `currency` has its cost
    /// counted here (its tokens always are).
    pub fn counts_cost_in(&self, currency: Option<&str>) -> bool {
        self.spec
            .cost
            .as_ref()
            .is_none_or(|c| Some(c.currency.as_str()) == currency)
    }

    /// What the core compares before a model call of the session `uid`,
    /// whose agent prices in `currency`: the limits, what is counted in
    /// the period holding `now` (nothing yet when the stored period has
    /// ended), the session's own entry, and whether the session can be
    /// counted at all.
    pub fn shared(&self, uid: &str, now: Millis, currency: Option<&str>) -> SharedBudget {
        let created = self
            .metadata
            .creation_timestamp
            .as_ref()
            .map(millis)
            .unwrap_or(now);
        let period = self.spec.period;
        let start = period.start(now, created);
        let status = self.status.clone().unwrap_or_default();
        let current = status.started() == Some(start);
        let used = if current {
            status.used
        } else {
            Spent::default()
        };
        let full =
            status.charged.len() >= MAX_CHARGED_SESSIONS && !status.charged.contains_key(uid);
        SharedBudget {
            name: self.metadata.name.clone().unwrap_or_default(),
            tokens: self.spec.tokens,
            cost_micros: self.spec.cost_micros().ok().flatten(),
            currency: self.spec.cost.as_ref().map(|c| c.currency.clone()),
            used_tokens: used.tokens,
            used_cost_micros: used.cost_micros,
            own: own_charge(status.charged.get(uid), current, self.counts_cost_in(currency)),
            refused: full.then(|| {
                format!("it counts at most {MAX_CHARGED_SESSIONS} sessions in a period; delete finished sessions (their spend stays counted) or give new sessions another Budget")
            }),
            period_end: period.end(start),
        }
    }
}

/// A session's entry as the core compares it. After the stored period
/// ended, the next charge makes its whole total the base (see
/// [`BudgetStatus::roll_over`]): nothing of it counted yet.
fn own_charge(entry: Option<&Charge>, current: bool, cost_counted: bool) -> OwnCharge {
    let Some(entry) = entry else {
        return OwnCharge {
            cost_counted,
            ..OwnCharge::default()
        };
    };
    let (counted, base) = if current {
        (entry.in_period(), entry.base)
    } else {
        (Spent::default(), entry.total)
    };
    OwnCharge {
        counted_tokens: counted.tokens,
        counted_cost_micros: counted.cost_micros,
        base_tokens: base.tokens,
        base_cost_micros: base.cost_micros,
        cost_counted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spent(tokens: u64) -> Spent {
        Spent {
            tokens,
            cost_micros: tokens * 2,
        }
    }

    #[test]
    fn a_charge_sets_a_sessions_total_once_and_folds_and_rollovers_keep_the_sum() {
        let mut s = BudgetStatus::default();
        assert_eq!(s.charge("u1", "a", spent(100), true), Charged::Changed);
        assert_eq!(s.charge("u1", "a", spent(100), true), Charged::Unchanged);
        // A stale, lower total (an older copy) never lowers the count.
        assert_eq!(s.charge("u1", "a", spent(40), true), Charged::Unchanged);
        assert_eq!(s.charge("u2", "b", spent(50), false), Charged::Changed);
        assert_eq!(
            s.used,
            Spent {
                tokens: 150,
                cost_micros: 200
            }
        );
        assert!(s.fold("u2"));
        assert!(!s.fold("u2"), "folded once");
        assert_eq!(s.used.tokens, 150);
        // A new period: the old usage is the base, only growth counts.
        s.roll_over(Millis(86_400_000));
        assert_eq!(s.used, Spent::default());
        s.charge("u1", "a", spent(130), true);
        assert_eq!(
            s.used,
            Spent {
                tokens: 30,
                cost_micros: 60
            }
        );
        assert_eq!(s.started(), Some(Millis(86_400_000)));
    }

    #[test]
    fn the_ledger_is_bounded_and_a_session_past_it_is_refused() {
        let mut s = BudgetStatus::default();
        for i in 0..MAX_CHARGED_SESSIONS {
            assert_eq!(
                s.charge(&format!("u{i}"), "x", spent(1), true),
                Charged::Changed
            );
        }
        assert_eq!(s.charge("new", "x", spent(1), true), Charged::Full);
        assert_eq!(s.charge("u0", "x", spent(2), true), Charged::Changed);
    }

    #[test]
    fn selectors_match_labels() {
        let mut spec = BudgetSpec {
            tokens: Some(1),
            cost: None,
            period: Period::Day,
            selector: None,
        };
        let labels: BTreeMap<String, String> = [("team".to_string(), "a".to_string())].into();
        assert!(spec.selects(&labels));
        spec.selector = Some(SessionSelector {
            match_labels: [("team".to_string(), "b".to_string())].into(),
        });
        assert!(!spec.selects(&labels));
    }

    /// The core is handed the session's own entry: what is counted of it
    /// in this period and its base, so that it counts its own spend as it
    /// is now; after the stored period ended its whole total is the base.
    #[test]
    fn a_session_is_handed_its_own_entry_and_its_base() {
        let day = 86_400_000;
        let mut status = BudgetStatus::default();
        status.roll_over(Millis(day));
        status.charge("u1", "a", spent(100), true);
        status.roll_over(Millis(2 * day));
        status.charge("u1", "a", spent(160), true);
        status.charge("u2", "b", spent(40), true);
        let budget = Budget {
            metadata: kube::api::ObjectMeta {
                name: Some("team".into()),
                ..Default::default()
            },
            spec: BudgetSpec {
                tokens: Some(1000),
                cost: Some(CostLimit {
                    amount: 5.0,
                    currency: "USD".into(),
                }),
                period: Period::Day,
                selector: None,
            },
            status: Some(status),
        };
        let seen = budget.shared("u1", Millis(2 * day + 5), Some("USD"));
        assert_eq!(seen.used_tokens, 100);
        assert_eq!(
            seen.own,
            OwnCharge {
                counted_tokens: 60,
                counted_cost_micros: 120,
                base_tokens: 100,
                base_cost_micros: 200,
                cost_counted: true,
            }
        );
        // A day later the stored period has ended: nothing counted, all base.
        let next = budget.shared("u1", Millis(3 * day + 5), Some("EUR"));
        assert_eq!((next.used_tokens, next.own.counted_tokens), (0, 0));
        assert_eq!(next.own.base_tokens, 160);
        assert!(!next.own.cost_counted, "priced in another currency");
        // A session the Budget never charged: all its spend counts.
        let new = budget.shared("u3", Millis(2 * day + 5), Some("USD"));
        assert_eq!(new.own.base_tokens + new.own.counted_tokens, 0);
    }
}
