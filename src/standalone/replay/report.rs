//! The replay's verdict: per agent turn, the calls made against the
//! recorded ones, the answer and the tokens used; rendered as text or
//! JSON (for CI).

use super::served::{same_arguments, Served};
use crate::core::{AgentTurn, SessionState, Turn};
use serde::Serialize;

/// One agent turn, recorded and replayed.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnReport {
    /// 1-based, as `t<turn>-c<index>` counts.
    pub turn: usize,
    /// `same` or `different` at the chosen strictness.
    pub verdict: &'static str,
    pub recorded_calls: Vec<String>,
    pub replayed_calls: Vec<String>,
    pub answer: Option<String>,
    pub tokens: u64,
}

/// The whole replay.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayReport {
    pub session: String,
    pub strict: bool,
    pub passed: bool,
    pub turns: Vec<TurnReport>,
    /// Calls that had no recorded result (`tool(arguments)`), run or not.
    pub unmatched: Vec<String>,
    pub phase: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

fn agent_turns(state: &SessionState) -> Vec<&AgentTurn> {
    state
        .turns
        .iter()
        .filter_map(|t| match t {
            Turn::Agent(a) => Some(a),
            Turn::User(_) => None,
        })
        .collect()
}

fn call_text(name: &str, arguments: &str) -> String {
    format!("{name}({arguments})")
}

/// Whether two turns made the same calls: the same tools in the same
/// order, and with `strict` the same arguments too.
fn same_calls(recorded: Option<&AgentTurn>, replayed: Option<&AgentTurn>, strict: bool) -> bool {
    let (Some(a), Some(b)) = (recorded, replayed) else {
        return false;
    };
    a.tool_calls.len() == b.tool_calls.len()
        && a.tool_calls.iter().zip(&b.tool_calls).all(|(x, y)| {
            x.name == y.name && (!strict || same_arguments(&x.arguments, &y.arguments))
        })
}

fn turn_report(
    i: usize,
    rec: Option<&AgentTurn>,
    rep: Option<&AgentTurn>,
    strict: bool,
) -> TurnReport {
    let calls = |t: Option<&AgentTurn>| {
        t.map(|t| {
            t.tool_calls
                .iter()
                .map(|c| call_text(&c.name, &c.arguments))
                .collect()
        })
        .unwrap_or_default()
    };
    TurnReport {
        turn: i + 1,
        verdict: if same_calls(rec, rep, strict) {
            "same"
        } else {
            "different"
        },
        recorded_calls: calls(rec),
        replayed_calls: calls(rep),
        answer: rep.and_then(|t| t.text.clone()),
        tokens: rep.map_or(0, |t| t.usage.total()),
    }
}

/// Compares the replay's state with the recorded one.
pub fn compare(
    recorded: &SessionState,
    replayed: &SessionState,
    log: &[(String, String, Served)],
    strict: bool,
) -> ReplayReport {
    let (rec, rep) = (agent_turns(recorded), agent_turns(replayed));
    let turns: Vec<TurnReport> = (0..rec.len().max(rep.len()))
        .map(|i| turn_report(i, rec.get(i).copied(), rep.get(i).copied(), strict))
        .collect();
    let unmatched: Vec<String> = log
        .iter()
        .filter(|(_, _, served)| *served != Served::Recorded)
        .map(|(name, args, _)| call_text(name, args))
        .collect();
    ReplayReport {
        session: recorded.id.0.clone(),
        strict,
        passed: unmatched.is_empty() && turns.iter().all(|t| t.verdict == "same"),
        turns,
        unmatched,
        phase: format!("{:?}", replayed.phase),
        failure: replayed.failure.clone(),
    }
}

/// The report for a person.
pub fn text(report: &ReplayReport) -> String {
    let mut out = String::new();
    let level = if report.strict {
        "strict"
    } else {
        "same tools"
    };
    for t in &report.turns {
        out.push_str(&format!(
            "turn {}: {} ({} tokens)\n",
            t.turn, t.verdict, t.tokens
        ));
        if t.verdict != "same" {
            out.push_str(&format!("  recorded: {}\n", t.recorded_calls.join(", ")));
            out.push_str(&format!("  replayed: {}\n", t.replayed_calls.join(", ")));
        }
        if let Some(answer) = &t.answer {
            out.push_str(&format!("  answer: {answer}\n"));
        }
    }
    for call in &report.unmatched {
        out.push_str(&format!("unmatched call (no recorded result): {call}\n"));
    }
    let verdict = if report.passed { "passed" } else { "FAILED" };
    out.push_str(&format!(
        "replay of {} {verdict} ({level}); the replay ended {}\n",
        report.session, report.phase
    ));
    out
}
