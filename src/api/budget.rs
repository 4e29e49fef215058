//! Spend in the API: an agent's `spec.model.pricing`, and the session's
//! limits on tokens, cost and tool calls mapped to the core's [`Budget`].
//! The schema bounds refuse negative and absurd values at admission; the
//! same bounds are checked here for `agents run`, which has no API server.

use super::convert::{err, ConvertError};
use super::session::LimitsSpec;
use crate::core::budget::{units_to_micros, Budget, Pricing};
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// The most a million tokens may cost, in currency units.
pub const MAX_PRICE_PER_MTOK: f64 = 10_000.0;
/// The largest cost limit a session may have, in currency units.
pub const MAX_COST_LIMIT: f64 = 1_000_000.0;
/// The largest token limit a session may have.
pub const MAX_TOKENS_LIMIT: u64 = 1_000_000_000_000;
/// The largest tool-call limit a session may have.
pub const MAX_TOOL_CALLS_LIMIT: u32 = 1_000_000;

/// What the model's tokens cost, per million tokens, in `currency`. Each
/// model turn's usage gets its cost (`usage.costMicros`, in millionths of
/// the currency, rounded up).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PricingSpec {
    /// Price of a million prompt tokens (0 to 10000).
    #[schemars(range(min = 0.0, max = 10_000.0))]
    pub input_per_m_tok: f64,
    /// Price of a million completion tokens (0 to 10000).
    #[schemars(range(min = 0.0, max = 10_000.0))]
    pub output_per_m_tok: f64,
    /// Price of a million prompt tokens served from the provider's prompt
    /// cache (0 to 10000); default: `inputPerMTok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 10_000.0))]
    pub cached_input_per_m_tok: Option<f64>,
    /// The currency, as an ISO 4217 code (three capital letters); default `USD`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[A-Z]{3}$"))]
    pub currency: Option<String>,
}

/// A price per million tokens as micro-units, refused when out of bounds.
fn price(value: f64, field: String) -> Result<u64, ConvertError> {
    match units_to_micros(value).filter(|_| value <= MAX_PRICE_PER_MTOK) {
        Some(micros) => Ok(micros),
        None => Err(err(
            field,
            format!("{value} is not a price per million tokens; give a number from 0 to {MAX_PRICE_PER_MTOK}"),
        )),
    }
}

/// The core's pricing for `spec`; `field` names it in errors.
pub fn pricing(spec: &PricingSpec, field: &str) -> Result<Pricing, ConvertError> {
    let currency = spec.currency.clone().unwrap_or_else(|| "USD".into());
    if currency.len() != 3 || !currency.chars().all(|c| c.is_ascii_uppercase()) {
        return Err(err(
            format!("{field}.currency"),
            format!("{currency:?} is not an ISO 4217 currency code; give three capital letters, e.g. USD or EUR"),
        ));
    }
    Ok(Pricing {
        input_micros_per_mtok: price(spec.input_per_m_tok, format!("{field}.inputPerMTok"))?,
        output_micros_per_mtok: price(spec.output_per_m_tok, format!("{field}.outputPerMTok"))?,
        cached_input_micros_per_mtok: spec
            .cached_input_per_m_tok
            .map(|p| price(p, format!("{field}.cachedInputPerMTok")))
            .transpose()?,
        currency,
    })
}

/// The core's budget for `spec.limits`; a cost limit needs the agent's
/// pricing (its currency is the limit's).
pub fn budget(
    limits: Option<&LimitsSpec>,
    pricing: Option<&Pricing>,
) -> Result<Budget, ConvertError> {
    let Some(limits) = limits else {
        return Ok(Budget::default());
    };
    let cost_micros = match limits.cost {
        None => None,
        Some(_) if pricing.is_none() => {
            return Err(err(
                "spec.limits.cost",
                "a cost limit needs prices: set the agent's spec.model.pricing (inputPerMTok, outputPerMTok), or limit tokens instead",
            ))
        }
        Some(cost) => match units_to_micros(cost).filter(|_| cost <= MAX_COST_LIMIT) {
            Some(micros) => Some(micros),
            None => {
                return Err(err(
                    "spec.limits.cost",
                    format!("{cost} is not a cost limit; give a number from 0 to {MAX_COST_LIMIT}"),
                ))
            }
        },
    };
    if let Some(tokens) = limits
        .tokens
        .filter(|t| !(1..=MAX_TOKENS_LIMIT).contains(t))
    {
        return Err(err(
            "spec.limits.tokens",
            format!("{tokens} is not a token limit; give a number from 1 to {MAX_TOKENS_LIMIT}"),
        ));
    }
    if let Some(calls) = limits.tool_calls.filter(|c| *c > MAX_TOOL_CALLS_LIMIT) {
        return Err(err(
            "spec.limits.toolCalls",
            format!(
                "{calls} is not a tool-call limit; give a number from 0 to {MAX_TOOL_CALLS_LIMIT}"
            ),
        ));
    }
    Ok(Budget {
        tokens: limits.tokens,
        cost_micros,
        tool_calls: limits.tool_calls,
        on_exceed: limits.on_exceed.unwrap_or_default(),
        currency: pricing.map(|p| p.currency.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(input: f64) -> PricingSpec {
        PricingSpec {
            input_per_m_tok: input,
            output_per_m_tok: 10.0,
            cached_input_per_m_tok: None,
            currency: None,
        }
    }

    #[test]
    fn prices_become_micro_units_and_bad_ones_say_which_field() {
        let p = pricing(&spec(2.5), "spec.model.pricing").unwrap();
        assert_eq!(
            (p.input_micros_per_mtok, p.output_micros_per_mtok),
            (2_500_000, 10_000_000)
        );
        assert_eq!(p.currency, "USD");
        let e = pricing(&spec(-1.0), "spec.model.pricing").unwrap_err();
        assert_eq!(e.field, "spec.model.pricing.inputPerMTok");
        assert!(e.message.contains("from 0 to 10000"), "{}", e.message);
        let mut euro = spec(1.0);
        euro.currency = Some("euro".into());
        let e = pricing(&euro, "spec.model.pricing").unwrap_err();
        assert!(e.message.contains("ISO 4217"), "{}", e.message);
    }

    #[test]
    fn a_cost_limit_needs_pricing_and_bounds_hold() {
        let limits = LimitsSpec {
            cost: Some(1.5),
            ..LimitsSpec::default()
        };
        let e = budget(Some(&limits), None).unwrap_err();
        assert!(e.message.contains("spec.model.pricing"), "{}", e.message);
        let p = pricing(&spec(1.0), "p").unwrap();
        let b = budget(Some(&limits), Some(&p)).unwrap();
        assert_eq!(b.cost_micros, Some(1_500_000));
        let absurd = LimitsSpec {
            tokens: Some(0),
            ..LimitsSpec::default()
        };
        assert_eq!(
            budget(Some(&absurd), None).unwrap_err().field,
            "spec.limits.tokens"
        );
    }
}
