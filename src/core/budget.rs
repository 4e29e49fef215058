//! Spend: what a model turn costs, and the session's limits on tokens,
//! cost and tool calls.
//!
//! Cost is kept as an integer number of micro-units of the agent's
//! currency (a millionth of a dollar for `USD`), never as a float, so that
//! sums are exact and compare exactly with a limit. A turn's cost is
//! rounded up to the next micro-unit: a budget never under-counts.
//!
//! The checks are pure: the session asks [`Budget::stops`] before each
//! model call and before each tool run, and starts nothing that would go
//! past a limit.

use super::conversation::TokenUsage;
use serde::{Deserialize, Serialize};

/// Micro-units in one unit of a currency.
pub const MICROS_PER_UNIT: u64 = 1_000_000;
/// Tokens in the unit prices are given for (a million tokens).
const TOKENS_PER_PRICE_UNIT: u128 = 1_000_000;

/// What a million tokens cost, in micro-units of `currency`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pricing {
    pub input_micros_per_mtok: u64,
    pub output_micros_per_mtok: u64,
    /// Prompt tokens the provider served from its cache; `None`: the
    /// input price.
    pub cached_input_micros_per_mtok: Option<u64>,
    /// ISO 4217 code, e.g. `USD`.
    pub currency: String,
}

impl Pricing {
    /// The cost of `usage` in micro-units, rounded up.
    pub fn cost_micros(&self, usage: &TokenUsage) -> u64 {
        let cached = usage.cached_prompt_tokens.min(usage.prompt_tokens);
        let fresh = usage.prompt_tokens - cached;
        let cached_price = self
            .cached_input_micros_per_mtok
            .unwrap_or(self.input_micros_per_mtok);
        let micro_tokens = u128::from(fresh) * u128::from(self.input_micros_per_mtok)
            + u128::from(cached) * u128::from(cached_price)
            + u128::from(usage.completion_tokens) * u128::from(self.output_micros_per_mtok);
        let micros = micro_tokens.div_ceil(TOKENS_PER_PRICE_UNIT);
        u64::try_from(micros).unwrap_or(u64::MAX)
    }
}

/// A price or limit given in whole currency units (a decimal) as
/// micro-units; `None` for a negative, non-finite or too large value.
pub fn units_to_micros(units: f64) -> Option<u64> {
    let micros = (units * MICROS_PER_UNIT as f64).round();
    (units.is_finite() && units >= 0.0 && micros < u64::MAX as f64).then_some(micros as u64)
}

/// Micro-units shown as a decimal: `2500000` is `2.5`, `250` is `0.00025`.
pub fn show_micros(micros: u64) -> String {
    let (units, frac) = (micros / MICROS_PER_UNIT, micros % MICROS_PER_UNIT);
    if frac == 0 {
        return units.to_string();
    }
    let frac = format!("{frac:06}");
    format!("{units}.{}", frac.trim_end_matches('0'))
}

/// The spend in words: `1400 tokens (400 cached), cost 0.004 EUR, 2 tool
/// calls`; the cost only where the agent has prices.
pub fn spend_text(spend: &Spend, currency: Option<&str>) -> String {
    let usage = &spend.usage;
    let mut text = format!("{} tokens", usage.total());
    if usage.cached_prompt_tokens > 0 {
        text.push_str(&format!(" ({} cached)", usage.cached_prompt_tokens));
    }
    if let Some(currency) = currency {
        text.push_str(&format!(
            ", cost {} {currency}",
            show_micros(usage.cost_micros)
        ));
    }
    let calls = spend.tool_calls;
    text.push_str(&format!(
        ", {calls} tool call{}",
        if calls == 1 { "" } else { "s" }
    ));
    text
}

/// What a session does when work would start past one of its limits.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum OnExceed {
    /// The session fails, saying which limit and the spend.
    #[default]
    Fail,
    /// The session holds (a `BudgetExceeded` condition says why) until
    /// the limit is raised.
    Pause,
    /// A person is asked (a Continuation `waitingFor: budget`): they
    /// approve with a raised limit, and the session goes on, or deny, and
    /// it fails.
    Ask,
}

impl OnExceed {
    pub fn name(self) -> &'static str {
        match self {
            OnExceed::Fail => "fail",
            OnExceed::Pause => "pause",
            OnExceed::Ask => "ask",
        }
    }
}

/// A session's limits on spend (`spec.limits.tokens`, `cost`, `toolCalls`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    pub tokens: Option<u64>,
    /// In micro-units of the agent's pricing currency.
    pub cost_micros: Option<u64>,
    pub tool_calls: Option<u32>,
    pub on_exceed: OnExceed,
    /// The currency of costs, for messages (the agent's pricing).
    pub currency: Option<String>,
}

/// Work about to start, checked against the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    ModelCall,
    ToolRun,
}

/// The spend so far: what the limits are compared with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spend {
    pub usage: TokenUsage,
    pub tool_calls: u32,
}

/// Which limit stopped work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum LimitKind {
    Tokens,
    Cost,
    ToolCalls,
}

/// A limit that stopped work: which, what was spent, and the limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetStop {
    /// The limit reached: `tokens`, `cost` or `toolCalls`.
    pub limit: LimitKind,
    /// What was spent (tokens, micro-units of the currency, or tool calls).
    pub used: u64,
    /// The limit, in the same unit.
    pub allowed: u64,
    /// What it says to people: the limit, the spend, how to go on.
    pub message: String,
}

/// Limits a person raised when asked (`onExceed: ask`): each is the new
/// bound, kept with the session so that the same limit asks again only
/// once the new bound is reached. A limit in `spec.limits` above it wins.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct Raise {
    /// The new token limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// The new cost limit, in micro-units of the pricing currency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_micros: Option<u64>,
    /// The new tool-call limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<u32>,
}

impl Raise {
    pub fn is_empty(&self) -> bool {
        *self == Raise::default()
    }

    /// Both raises, each limit the higher of the two.
    pub fn merged(self, other: Raise) -> Raise {
        Raise {
            tokens: self.tokens.max(other.tokens),
            cost_micros: self.cost_micros.max(other.cost_micros),
            tool_calls: self.tool_calls.max(other.tool_calls),
        }
    }

    /// `tokens=N`, `cost=D` (a decimal in the pricing currency) or
    /// `toolCalls=N`, added to this raise.
    pub fn parse_into(&mut self, text: &str) -> Result<(), String> {
        let bad = || {
            format!("--raise {text:?}: give LIMIT=VALUE, where LIMIT is tokens, cost or toolCalls (e.g. tokens=200000, cost=0.5, toolCalls=60)")
        };
        let (limit, value) = text.split_once('=').ok_or_else(bad)?;
        let value = value.trim();
        match limit.trim() {
            "tokens" => self.tokens = Some(value.parse().map_err(|_| bad())?),
            "cost" => {
                let units: f64 = value.parse().map_err(|_| bad())?;
                self.cost_micros = Some(units_to_micros(units).ok_or_else(bad)?);
            }
            "toolCalls" | "tool-calls" => self.tool_calls = Some(value.parse().map_err(|_| bad())?),
            _ => return Err(bad()),
        }
        Ok(())
    }

    /// The raise in words: `tokens to 2000, cost to 0.5`.
    pub fn text(&self) -> String {
        let mut parts = Vec::new();
        parts.extend(self.tokens.map(|t| format!("tokens to {t}")));
        parts.extend(
            self.cost_micros
                .map(|c| format!("cost to {}", show_micros(c))),
        );
        parts.extend(self.tool_calls.map(|c| format!("toolCalls to {c}")));
        parts.join(", ")
    }
}

/// What a session has left of its limits when it makes a child session
/// (a sub-agent): the child spends at most this.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetLeft {
    /// Tokens left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Cost left, in micro-units of `currency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_micros: Option<u64>,
    /// The parent's pricing currency (a cost bound holds only for a child
    /// priced in the same one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// Tool runs left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<u32>,
    /// What the child does at the bound: `ask` where the parent asks,
    /// else `fail` (its parent's call gets the error).
    #[serde(default)]
    pub on_exceed: OnExceed,
}

fn lower(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl Budget {
    /// What is left of these limits after `spend`; `None` without limits.
    pub fn left(&self, spend: &Spend) -> Option<BudgetLeft> {
        if self.is_unlimited() {
            return None;
        }
        Some(BudgetLeft {
            tokens: self.tokens.map(|t| t.saturating_sub(spend.usage.total())),
            cost_micros: self
                .cost_micros
                .map(|c| c.saturating_sub(spend.usage.cost_micros)),
            currency: self.currency.clone(),
            tool_calls: self.tool_calls.map(|c| c.saturating_sub(spend.tool_calls)),
            on_exceed: match self.on_exceed {
                OnExceed::Ask => OnExceed::Ask,
                _ => OnExceed::Fail,
            },
        })
    }

    /// These limits, each at most what the parent had `left` (a cost
    /// bound only where the child is priced in the parent's currency); a
    /// child with no limits of its own does at the bound what `left` says.
    pub fn bounded_by(&self, left: &BudgetLeft, currency: Option<&str>) -> Budget {
        let same_currency = currency.is_some() && left.currency.as_deref() == currency;
        let tool_calls = lower(
            self.tool_calls.map(u64::from),
            left.tool_calls.map(u64::from),
        );
        Budget {
            tokens: lower(self.tokens, left.tokens),
            cost_micros: match same_currency {
                true => lower(self.cost_micros, left.cost_micros),
                false => self.cost_micros,
            },
            tool_calls: tool_calls.map(|c| c as u32),
            on_exceed: match self.is_unlimited() {
                true => left.on_exceed,
                false => self.on_exceed,
            },
            currency: self.currency.clone().or(currency.map(str::to_string)),
        }
    }

    /// The limits with what people raised applied: each the higher bound
    /// (a raise of a limit the session does not have is no limit).
    pub fn raised(&self, raise: &Raise) -> Budget {
        Budget {
            tokens: self.tokens.map(|t| t.max(raise.tokens.unwrap_or(0))),
            cost_micros: self
                .cost_micros
                .map(|c| c.max(raise.cost_micros.unwrap_or(0))),
            tool_calls: self
                .tool_calls
                .map(|c| c.max(raise.tool_calls.unwrap_or(0))),
            ..self.clone()
        }
    }

    pub fn is_unlimited(&self) -> bool {
        self.tokens.is_none() && self.cost_micros.is_none() && self.tool_calls.is_none()
    }

    /// The limit that `work` may not start past, if one is reached.
    ///
    /// A model call spends tokens and cost, so it needs some left: it is
    /// stopped once the spend has reached a limit. A tool run spends a
    /// tool call, and does not start while tokens or cost are already past
    /// their limit (the turn in flight may have overshot it).
    pub fn stops(&self, spend: &Spend, work: Work) -> Option<BudgetStop> {
        let tokens = spend.usage.total();
        let cost = spend.usage.cost_micros;
        let past = |used: u64, allowed: u64| match work {
            Work::ModelCall => used >= allowed,
            Work::ToolRun => used > allowed,
        };
        let stop = |limit, used, allowed| BudgetStop {
            limit,
            used,
            allowed,
            message: self.describe(limit, used, allowed),
        };
        if let Some(allowed) = self.tokens.filter(|&a| past(tokens, a)) {
            return Some(stop(LimitKind::Tokens, tokens, allowed));
        }
        if let Some(allowed) = self.cost_micros.filter(|&a| past(cost, a)) {
            return Some(stop(LimitKind::Cost, cost, allowed));
        }
        let calls = u64::from(spend.tool_calls);
        match self.tool_calls.map(u64::from) {
            Some(allowed) if work == Work::ToolRun && calls >= allowed => {
                Some(stop(LimitKind::ToolCalls, calls, allowed))
            }
            _ => None,
        }
    }

    /// What a stop says to people: the limit, the spend and how to go on.
    fn describe(&self, limit: LimitKind, used: u64, allowed: u64) -> String {
        let currency = self.currency.as_deref().unwrap_or("");
        let money = |m: u64| format!("{} {currency}", show_micros(m)).trim().to_string();
        let (what, used, allowed, field) = match limit {
            LimitKind::Tokens => ("tokens", used.to_string(), allowed.to_string(), "tokens"),
            LimitKind::Cost => ("cost", money(used), money(allowed), "cost"),
            LimitKind::ToolCalls => (
                "tool calls",
                used.to_string(),
                allowed.to_string(),
                "toolCalls",
            ),
        };
        let how = match self.on_exceed {
            OnExceed::Ask => format!(
                "approve with a raise (agents session approve TOKEN --raise {field}=N) to go on"
            ),
            _ => format!("raise spec.limits.{field} to go on"),
        };
        format!(
            "the session reached its {what} limit: spent {used} of {allowed} (onExceed: {}); {how}",
            self.on_exceed.name()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u64, cached: u64, completion: u64) -> TokenUsage {
        TokenUsage {
            prompt_tokens: prompt,
            cached_prompt_tokens: cached,
            completion_tokens: completion,
            cost_micros: 0,
        }
    }

    #[test]
    fn cost_is_exact_and_rounds_up() {
        let p = Pricing {
            input_micros_per_mtok: 2_500_000,
            output_micros_per_mtok: 10_000_000,
            cached_input_micros_per_mtok: Some(1_250_000),
            currency: "USD".into(),
        };
        // 100 fresh at 2.5/M, 100 cached at 1.25/M, 10 out at 10/M.
        assert_eq!(p.cost_micros(&usage(200, 100, 10)), 250 + 125 + 100);
        // A third of a micro-unit is a whole one.
        let cheap = Pricing {
            input_micros_per_mtok: 1,
            output_micros_per_mtok: 0,
            cached_input_micros_per_mtok: None,
            currency: "USD".into(),
        };
        assert_eq!(cheap.cost_micros(&usage(3, 0, 0)), 1);
        assert_eq!(cheap.cost_micros(&usage(0, 0, 0)), 0);
    }

    #[test]
    fn decimals_round_trip_through_micros() {
        assert_eq!(units_to_micros(2.5), Some(2_500_000));
        assert_eq!(units_to_micros(0.15), Some(150_000));
        assert_eq!(units_to_micros(-1.0), None);
        assert_eq!(units_to_micros(f64::INFINITY), None);
        assert_eq!(show_micros(2_500_000), "2.5");
        assert_eq!(show_micros(250), "0.00025");
        assert_eq!(show_micros(3_000_000), "3");
    }

    #[test]
    fn a_model_call_needs_spend_left_and_a_tool_run_a_call_left() {
        let budget = Budget {
            tokens: Some(100),
            tool_calls: Some(2),
            ..Budget::default()
        };
        let spend = |tokens, calls| Spend {
            usage: usage(tokens, 0, 0),
            tool_calls: calls,
        };
        assert_eq!(budget.stops(&spend(99, 0), Work::ModelCall), None);
        let stop = budget.stops(&spend(100, 0), Work::ModelCall).unwrap();
        assert_eq!(
            (stop.limit, stop.used, stop.allowed),
            (LimitKind::Tokens, 100, 100)
        );
        // Exactly at the token limit, the turn's tools still run.
        assert_eq!(budget.stops(&spend(100, 1), Work::ToolRun), None);
        assert!(budget.stops(&spend(101, 0), Work::ToolRun).is_some());
        let stop = budget.stops(&spend(0, 2), Work::ToolRun).unwrap();
        assert_eq!(stop.limit, LimitKind::ToolCalls);
        assert_eq!(budget.stops(&spend(0, 2), Work::ModelCall), None);
        assert!(
            stop.message.contains("tool calls limit: spent 2 of 2"),
            "{}",
            stop.message
        );
    }
}
