//! `agents session approve TOKEN --raise LIMIT=N` on a session's question
//! about its budget (`onExceed: ask`, `waitingFor: budget`): what the
//! decision must carry, checked before anything is written.

use crate::core::budget::{LimitKind, Raise};
use crate::core::WaitingFor;
use crate::store::ContinuationRecord;
use anyhow::bail;

/// The limit a question is about and what was spent, from its
/// continuation (its `budget` call's arguments).
fn asked(record: &ContinuationRecord) -> Option<(LimitKind, u64)> {
    let args: serde_json::Value = serde_json::from_str(&record.spec.tool_call.arguments).ok()?;
    let limit = serde_json::from_value(args.get("limit")?.clone()).ok()?;
    Some((limit, args.get("used")?.as_u64()?))
}

/// Refuses a raise where it means nothing, and an approval of a budget
/// question whose raise does not lift the limit it is about (the session
/// would ask again at once).
pub fn check_raise(
    record: &ContinuationRecord,
    approved: bool,
    raise: Option<&Raise>,
) -> anyhow::Result<()> {
    let token = record.token();
    let is_budget = record.spec.waiting_for == WaitingFor::Budget;
    match (is_budget, approved, raise) {
        (false, _, Some(_)) => bail!(
            "{token} is not a question about a session's budget (it waits for {}); --raise is only for those (waitingFor: budget)",
            crate::engine::events::waiting_for_text(record.spec.waiting_for)
        ),
        (true, false, Some(_)) => {
            bail!("a denial raises nothing: give --raise with approve, or deny without it")
        }
        (true, true, raise) => lifts(record, raise),
        _ => Ok(()),
    }
}

/// True when `raise` puts the asked-about limit above the spend.
fn lifts(record: &ContinuationRecord, raise: Option<&Raise>) -> anyhow::Result<()> {
    let token = record.token();
    let Some((limit, used)) = asked(record) else {
        return Ok(());
    };
    let (name, raised) = match limit {
        LimitKind::Tokens => ("tokens", raise.and_then(|r| r.tokens)),
        LimitKind::Cost => ("cost", raise.and_then(|r| r.cost_micros)),
        LimitKind::ToolCalls => ("toolCalls", raise.and_then(|r| r.tool_calls.map(u64::from))),
    };
    let shown = |v: u64| match limit {
        LimitKind::Cost => crate::core::budget::show_micros(v),
        _ => v.to_string(),
    };
    match raised {
        Some(n) if n > used => Ok(()),
        Some(n) => bail!(
            "--raise {name}={} does not lift the limit: {} is already spent; give more, e.g. --raise {name}={}",
            shown(n),
            shown(used),
            shown(used.saturating_mul(2).max(used + 1))
        ),
        None => bail!(
            "{token} asks to go past the {name} limit ({} spent): approve it with a new bound, e.g. agents session approve {token} --raise {name}={}",
            shown(used),
            shown(used.saturating_mul(2).max(used + 1))
        ),
    }
}
