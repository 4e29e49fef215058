//! Budgets shared by many sessions (a namespace's `Budget` resources):
//! their periods, and the check before each model call.
//!
//! The driver reads each Budget that selects the session (from its watch
//! cache) and hands the core what it saw as a [`SharedBudget`]: the
//! limits and what the Budget had counted. The core only compares; the
//! counting itself is the driver's (see `api::namespace_budget`).

use super::budget::show_micros;
use super::time::Millis;
use serde::{Deserialize, Serialize};

/// How often a Budget's count starts over.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Period {
    /// Each UTC day, from midnight.
    Day,
    /// Each UTC calendar month, from the first at midnight.
    Month,
    /// Never: the Budget counts from its creation on.
    #[default]
    None,
}

const DAY_MS: i64 = 86_400_000;

/// Days since 1970-01-01 of a civil (proleptic Gregorian) date.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil (year, month) of a day count since 1970-01-01.
fn civil_month(days: i64) -> (i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month)
}

impl Period {
    /// When the period holding `now` started; `created` for `none`.
    pub fn start(self, now: Millis, created: Millis) -> Millis {
        let days = now.0.div_euclid(DAY_MS);
        match self {
            Period::Day => Millis(days * DAY_MS),
            Period::Month => {
                let (y, m) = civil_month(days);
                Millis(days_from_civil(y, m, 1) * DAY_MS)
            }
            Period::None => created,
        }
    }

    /// When the period that started at `start` ends; `None` for `none`.
    pub fn end(self, start: Millis) -> Option<Millis> {
        match self {
            Period::Day => Some(Millis(start.0 + DAY_MS)),
            Period::Month => {
                let (y, m) = civil_month(start.0.div_euclid(DAY_MS));
                let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                Some(Millis(days_from_civil(y, m, 1) * DAY_MS))
            }
            Period::None => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Month => "month",
            Period::None => "none",
        }
    }
}

/// A Budget that selects the session, as the driver last saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SharedBudget {
    /// The Budget's name.
    pub name: String,
    /// Its token limit, if it has one.
    pub tokens: Option<u64>,
    /// Its cost limit in micro-units, if it has one.
    pub cost_micros: Option<u64>,
    /// The cost limit's currency.
    pub currency: Option<String>,
    /// Tokens counted in the current period.
    pub used_tokens: u64,
    /// Cost counted in the current period, in micro-units.
    pub used_cost_micros: u64,
    /// What of that is this session's own, as the Budget counted it.
    pub own: OwnCharge,
    /// Why the session cannot be counted against it at all (the Budget
    /// counts as many sessions as it can hold): it must wait.
    pub refused: Option<String>,
    /// When the current period ends (`None`: never).
    pub period_end: Option<Millis>,
}

/// This session's entry in a Budget, as the driver last saw it. The
/// check counts the session's own spend as it is now in place of
/// `counted`: the driver's copy of the Budget may not show its last
/// charge yet, and a session would then take a turn more than the bound.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnCharge {
    /// Its tokens counted in the current period.
    pub counted_tokens: u64,
    /// Its cost counted in the current period, in micro-units.
    pub counted_cost_micros: u64,
    /// Its tokens over its life when the current period started.
    pub base_tokens: u64,
    /// Its cost over its life when the current period started.
    pub base_cost_micros: u64,
    /// Its cost counts (its agent is priced in the Budget's currency).
    pub cost_counted: bool,
}

/// What a session has spent over its life, itself (not its sub-agents,
/// which the Budgets count as sessions of their own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnSpend {
    pub tokens: u64,
    pub cost_micros: u64,
}

/// Why a session waits for a shared Budget: its name and what it says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetExhausted {
    /// The Budget that is spent.
    pub budget: String,
    /// What it says to people: the Budget, its use and its limit.
    pub message: String,
}

impl SharedBudget {
    /// Tokens and cost counted in the period with the session's own spend
    /// as it is now (`own`); never less than the Budget showed.
    pub fn counted(&self, own: OwnSpend) -> (u64, u64) {
        let o = &self.own;
        let tokens = own
            .tokens
            .saturating_sub(o.base_tokens)
            .max(o.counted_tokens);
        let cost = if o.cost_counted {
            own.cost_micros
                .saturating_sub(o.base_cost_micros)
                .max(o.counted_cost_micros)
        } else {
            o.counted_cost_micros
        };
        (
            (self.used_tokens - o.counted_tokens.min(self.used_tokens)).saturating_add(tokens),
            (self.used_cost_micros - o.counted_cost_micros.min(self.used_cost_micros))
                .saturating_add(cost),
        )
    }

    /// Why no model call may start under this Budget, if it is spent (a
    /// model call always spends some: at the limit is spent), with the
    /// session's own spend as it is now.
    pub fn stops(&self, own: OwnSpend) -> Option<BudgetExhausted> {
        let (used_tokens, used_cost_micros) = self.counted(own);
        let name = &self.name;
        let how = "it goes on when the Budget is raised or its period starts over";
        let message = if let Some(why) = &self.refused {
            format!("Budget {name} cannot count this session: {why}")
        } else if let Some(limit) = self.tokens.filter(|l| used_tokens >= *l) {
            format!("Budget {name} is spent: used {used_tokens} of {limit} tokens; {how}")
        } else if let Some(limit) = self.cost_micros.filter(|l| used_cost_micros >= *l) {
            let currency = self.currency.as_deref().unwrap_or("");
            format!(
                "Budget {name} is spent: used {} of {} {currency}; {how}",
                show_micros(used_cost_micros),
                show_micros(limit)
            )
        } else {
            return None;
        };
        Some(BudgetExhausted {
            budget: name.clone(),
            message,
        })
    }
}

/// The first spent Budget among `budgets`, in name order, for a session
/// whose own spend is `own`.
pub fn first_spent(budgets: &[SharedBudget], own: OwnSpend) -> Option<BudgetExhausted> {
    let mut spent: Vec<BudgetExhausted> = budgets.iter().filter_map(|b| b.stops(own)).collect();
    spent.sort_by(|a, b| a.budget.cmp(&b.budget));
    spent.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(y: i64, m: i64, d: i64, ms: i64) -> Millis {
        Millis(days_from_civil(y, m, d) * DAY_MS + ms)
    }

    #[test]
    fn periods_start_at_utc_midnight_and_the_first_of_the_month() {
        let now = at(2026, 12, 4, 3_600_000);
        assert_eq!(Period::Day.start(now, Millis(0)), at(2026, 12, 4, 0));
        assert_eq!(
            Period::Day.end(at(2026, 12, 4, 0)),
            Some(at(2026, 12, 5, 0))
        );
        assert_eq!(Period::Month.start(now, Millis(0)), at(2026, 12, 1, 0));
        assert_eq!(
            Period::Month.end(at(2026, 12, 1, 0)),
            Some(at(2027, 1, 1, 0))
        );
        assert_eq!(
            Period::Month.end(at(2028, 2, 1, 0)),
            Some(at(2028, 3, 1, 0))
        );
        assert_eq!(Period::None.start(now, Millis(7)), Millis(7));
        assert_eq!(Period::None.end(Millis(7)), None);
        // 1970-01-01 is day 0; 2000-03-01 is a known day count.
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(civil_month(11_017), (2000, 3));
    }

    #[test]
    fn a_budget_at_its_limit_stops_model_calls_and_says_which() {
        let mut b = SharedBudget {
            name: "team".into(),
            tokens: Some(1000),
            used_tokens: 999,
            ..SharedBudget::default()
        };
        let none = OwnSpend::default();
        assert_eq!(b.stops(none), None);
        b.used_tokens = 1000;
        let stop = b.stops(none).unwrap();
        assert_eq!(stop.budget, "team");
        assert!(
            stop.message.contains("used 1000 of 1000 tokens"),
            "{}",
            stop.message
        );
        let other = SharedBudget {
            name: "a-full".into(),
            refused: Some("it counts at most 2 sessions".into()),
            ..SharedBudget::default()
        };
        assert_eq!(first_spent(&[b, other], none).unwrap().budget, "a-full");
    }

    /// The Budget as last seen shows 100 of this session's tokens; it has
    /// spent 300 since: 900 − 100 + 300 reaches the limit.
    #[test]
    fn the_sessions_own_spend_counts_as_it_is_now_not_as_last_seen() {
        let b = SharedBudget {
            name: "team".into(),
            tokens: Some(1000),
            cost_micros: Some(5_000),
            used_tokens: 900,
            used_cost_micros: 1_000,
            own: OwnCharge {
                counted_tokens: 100,
                counted_cost_micros: 500,
                cost_counted: true,
                ..OwnCharge::default()
            },
            ..SharedBudget::default()
        };
        let seen = OwnSpend {
            tokens: 100,
            cost_micros: 500,
        };
        assert_eq!(b.counted(seen), (900, 1_000));
        assert_eq!(b.stops(seen), None);
        let now = OwnSpend {
            tokens: 300,
            cost_micros: 900,
        };
        assert_eq!(b.counted(now), (1_100, 1_400));
        let stop = b.stops(now).expect("its own last turn counts");
        assert!(
            stop.message.contains("used 1100 of 1000 tokens"),
            "{}",
            stop.message
        );
        // Spend before the period started (its base) does not count, and
        // an older copy of the session never lowers what the Budget showed.
        let rolled = SharedBudget {
            used_tokens: 0,
            used_cost_micros: 0,
            own: OwnCharge {
                base_tokens: 250,
                cost_counted: true,
                base_cost_micros: 900,
                ..OwnCharge::default()
            },
            ..b.clone()
        };
        assert_eq!(rolled.counted(now), (50, 0));
        assert_eq!(b.counted(OwnSpend::default()), (900, 1_000));
        // Its cost in another currency is not counted: what the Budget
        // showed stays.
        let other_currency = SharedBudget {
            own: OwnCharge {
                cost_counted: false,
                ..b.own.clone()
            },
            ..b.clone()
        };
        assert_eq!(other_currency.counted(now), (1_100, 1_000));
    }
}
