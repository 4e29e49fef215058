//! The rules for what a continuation accepts from outside: a result, or an
//! approve/deny decision. One pure function each; every store only reads the
//! continuation, asks here, and compare-and-swaps the answer in (a guarded
//! `UPDATE` in SQLite, a `resourceVersion` precondition in a cluster, where
//! the CRD's CEL rules hold the same line for writers that bypass us).

use super::{AppliedPolicy, Millis, ToolResult, WaitingFor};

/// Who writes on the engine's own behalf (a timed-out approval, a denial's
/// result); the rules never refuse it.
pub const ENGINE_BY: &str = "agents";

/// Who writes a result served from the cache.
pub const CACHE_BY: &str = "cache";

/// Who writes the result an MCP task ended with.
pub const TASK_BY: &str = "mcp-task";

/// The names only the engine writes under; a person or worker must not.
pub fn is_engine(by: &str) -> bool {
    by == ENGINE_BY || by == CACHE_BY || by == TASK_BY
}

/// Why an approver's edited arguments are refused, if they are: only a
/// policy with `approval.allowEdit` takes edits, and only as a JSON object
/// (what a model's arguments always are).
pub fn edit_refusal(policy: &AppliedPolicy, arguments: &str) -> Option<String> {
    let allowed = policy
        .decorators
        .approval_policy
        .as_ref()
        .is_some_and(|p| p.allow_edit);
    if !allowed {
        return Some(
            "its policy does not let approvers edit its arguments (approval.allowEdit is not set); approve it as it is, or deny it"
                .into(),
        );
    }
    match serde_json::from_str::<serde_json::Value>(arguments) {
        Ok(serde_json::Value::Object(_)) => None,
        Ok(_) => Some("the edited arguments must be a JSON object, like the model's".into()),
        Err(e) => Some(format!("the edited arguments are not JSON: {e}")),
    }
}

/// One person's vote on a call under an approval policy.
#[derive(Clone, Copy, Debug)]
pub struct Vote<'a> {
    pub approved: bool,
    pub by: &'a str,
    pub reason: Option<&'a str>,
    pub at: Millis,
    /// Edited arguments this vote approves (`None`: the model's).
    pub arguments: Option<&'a str>,
}

/// What the votes add up to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tally {
    pub approved: bool,
    /// Who denied, or everyone whose approvals made the quorum.
    pub by: String,
    pub reason: Option<String>,
    pub at: Millis,
    /// The edited arguments the quorum approved, if any.
    pub arguments: Option<String>,
}

/// The decision the votes add up to, in the order they were cast: the
/// first denial denies; else the first arguments (the model's or an
/// edit) that `quorum` different people approved are approved, signed by
/// all of them; else none yet. Approvals of different edits do not add up.
pub fn tally(votes: &[Vote<'_>], quorum: u32) -> Option<Tally> {
    if let Some(no) = votes.iter().find(|v| !v.approved) {
        return Some(Tally {
            approved: false,
            by: no.by.to_string(),
            reason: no.reason.map(str::to_string),
            at: no.at,
            arguments: None,
        });
    }
    for (i, v) in votes.iter().enumerate() {
        let mut yes: Vec<&Vote<'_>> = Vec::new();
        for w in votes[..=i].iter().filter(|w| w.arguments == v.arguments) {
            if !yes.iter().any(|y| y.by == w.by) {
                yes.push(w);
            }
        }
        if yes.len() >= quorum.max(1) as usize {
            return Some(Tally {
                approved: true,
                by: yes.iter().map(|v| v.by).collect::<Vec<_>>().join(", "),
                reason: None,
                at: v.at,
                arguments: v.arguments.map(str::to_string),
            });
        }
    }
    None
}

/// A decision already made on a call.
#[derive(Clone, Copy, Debug)]
pub struct Decided<'a> {
    pub approved: bool,
    pub by: &'a str,
    pub reason: Option<&'a str>,
    pub at: Millis,
}

/// A result already recorded.
#[derive(Clone, Copy, Debug)]
pub struct Recorded<'a> {
    pub result: &'a ToolResult,
    pub by: &'a str,
    pub at: Millis,
}

/// What a continuation holds, as the rules see it.
#[derive(Clone, Copy, Debug)]
pub struct Held<'a> {
    pub token: &'a str,
    pub waiting_for: WaitingFor,
    /// How the call runs when the engine runs it (`runSync`, `runAsync`,
    /// `runIsolated`); `None` for a `defer` call, which waits for someone
    /// outside: only such a call takes an outside result.
    pub runs_by_itself: Option<&'static str>,
    pub decision: Option<Decided<'a>>,
    pub result: Option<Recorded<'a>>,
}

/// The answer to a proposed write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write it (with compare-and-swap: the rules hold for what was read).
    Write,
    /// The same value is already there, written by `by` at `at`.
    Same { by: String, at: Millis },
    /// A different value is already there; this one is refused.
    Different { by: String, at: Millis },
    /// The continuation takes no such write now; why, for the writer.
    Refused(String),
}

/// The error result the model is given for a denied call.
pub fn denial(by: &str, reason: Option<&str>) -> ToolResult {
    ToolResult::error(match reason {
        Some(r) => format!("denied by {by}: {r}"),
        None => format!("denied by {by}"),
    })
}

/// Whether `result` from `by` may be recorded. A result is written once. A
/// call that waits for an approval takes one only once approved: before a
/// decision there is nothing to complete, and after a denial the model has
/// been told it was denied (only the denial's own result is taken then).
pub fn result(held: &Held<'_>, result: &ToolResult, by: &str) -> Verdict {
    if let Some(existing) = held.result {
        let (by, at) = (existing.by.to_string(), existing.at);
        return if existing.result == result {
            Verdict::Same { by, at }
        } else {
            Verdict::Different { by, at }
        };
    }
    if is_engine(by) {
        return Verdict::Write;
    }
    let token = held.token;
    let refusal = match held.decision {
        None if held.waiting_for == WaitingFor::Approval => Verdict::Refused(format!(
            "it waits for an approval, and nobody has decided yet; approve it first (`agents session approve {token}`; the call then runs per its policy) or deny it (`agents session deny {token}`)"
        )),
        Some(d) if !d.approved && result != &denial(d.by, d.reason) => Verdict::Refused(format!(
            "it was denied by {}, and the model is told that it was denied; a denied call takes no result",
            d.by
        )),
        Some(d) if !d.approved => return Verdict::Write,
        _ => Verdict::Write,
    };
    match (refusal, held.runs_by_itself) {
        // Its run's outcome is unknown: a person says what it was.
        (Verdict::Write, Some(_)) if held.waiting_for == WaitingFor::Outcome => Verdict::Write,
        (Verdict::Write, Some(how)) => Verdict::Refused(format!(
            "its policy runs it ({how}), so only that run completes it; an outside result is taken only by a call that waits for one (disposition defer)"
        )),
        (verdict, _) => verdict,
    }
}

/// Whether a decision (`approved`) may be recorded: once, whatever it is.
pub fn decision(held: &Held<'_>, approved: bool) -> Verdict {
    match held.decision {
        None => Verdict::Write,
        Some(d) if d.approved == approved => Verdict::Same {
            by: d.by.to_string(),
            at: d.at,
        },
        Some(d) => Verdict::Different {
            by: d.by.to_string(),
            at: d.at,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held<'a>(decision: Option<Decided<'a>>, result: Option<Recorded<'a>>) -> Held<'a> {
        Held {
            token: "s-t1-c0",
            waiting_for: WaitingFor::Approval,
            runs_by_itself: None,
            decision,
            result,
        }
    }

    fn decided(approved: bool) -> Decided<'static> {
        Decided {
            approved,
            by: "ann",
            reason: Some("no"),
            at: Millis(5),
        }
    }

    #[test]
    fn votes_add_up_to_a_quorum_of_different_people_or_one_denial() {
        let v = |approved, by| Vote {
            approved,
            by,
            reason: None,
            at: Millis(1),
            arguments: None,
        };
        assert!(tally(&[v(true, "alice")], 2).is_none());
        assert!(tally(&[v(true, "alice"), v(true, "alice")], 2).is_none());
        let t = tally(&[v(true, "alice"), v(true, "bob")], 2).unwrap();
        assert!(t.approved);
        assert_eq!(t.by, "alice, bob");
        let t = tally(&[v(true, "alice"), v(false, "carol"), v(true, "bob")], 2).unwrap();
        assert!(!t.approved);
        assert_eq!(t.by, "carol");
        assert!(tally(&[], 1).is_none());
        // Approvals of different arguments do not add up.
        let edit = |by, args| Vote {
            arguments: Some(args),
            ..v(true, by)
        };
        let n1 = r#"{"n":1}"#;
        assert!(tally(&[edit("alice", n1), v(true, "bob")], 2).is_none());
        let t = tally(&[edit("alice", n1), v(true, "bob"), edit("dan", n1)], 2).unwrap();
        assert_eq!(t.by, "alice, dan");
        assert_eq!(t.arguments.as_deref(), Some(n1));
    }

    #[test]
    fn a_result_waits_for_the_approval() {
        let ok = ToolResult::text("x");
        let refused = result(&held(None, None), &ok, "bob");
        assert!(matches!(refused, Verdict::Refused(ref why) if why.contains("approve it first")));
        assert_eq!(
            result(&held(Some(decided(true)), None), &ok, "bob"),
            Verdict::Write
        );
        // The engine's own writes are never refused.
        assert_eq!(result(&held(None, None), &ok, ENGINE_BY), Verdict::Write);
    }

    #[test]
    fn a_denied_call_takes_only_its_denial() {
        let d = decided(false);
        let refused = result(&held(Some(d), None), &ToolResult::text("x"), "bob");
        assert!(matches!(refused, Verdict::Refused(ref why) if why.contains("denied by ann")));
        let own = denial("ann", Some("no"));
        assert_eq!(own, ToolResult::error("denied by ann: no"));
        assert_eq!(result(&held(Some(d), None), &own, "ann"), Verdict::Write);
    }

    #[test]
    fn only_a_deferred_call_takes_an_outside_result() {
        let mut h = held(Some(decided(true)), None);
        h.runs_by_itself = Some("runAsync");
        let ok = ToolResult::text("made up");
        let refused = result(&h, &ok, "mallory");
        assert!(matches!(refused, Verdict::Refused(ref why) if why.contains("runAsync")));
        for engine in [ENGINE_BY, CACHE_BY] {
            assert_eq!(result(&h, &ok, engine), Verdict::Write);
        }
        // A denial's own result is written under the decider's name.
        let mut denied = held(Some(decided(false)), None);
        denied.runs_by_itself = Some("runIsolated");
        assert_eq!(
            result(&denied, &denial("ann", Some("no")), "ann"),
            Verdict::Write
        );
    }

    #[test]
    fn a_person_tells_an_unknown_outcome() {
        let mut h = held(None, None);
        h.runs_by_itself = Some("runSync");
        h.waiting_for = WaitingFor::Outcome;
        assert_eq!(result(&h, &ToolResult::text("sent"), "ann"), Verdict::Write);
    }

    #[test]
    fn a_result_is_written_once() {
        let first = ToolResult::text("a");
        let rec = Recorded {
            result: &first,
            by: "w1",
            at: Millis(9),
        };
        let h = held(Some(decided(true)), Some(rec));
        let same = Verdict::Same {
            by: "w1".into(),
            at: Millis(9),
        };
        assert_eq!(result(&h, &first, "w2"), same);
        let other = result(&h, &ToolResult::text("b"), ENGINE_BY);
        assert!(matches!(other, Verdict::Different { .. }));
    }

    #[test]
    fn a_decision_is_written_once() {
        assert_eq!(decision(&held(None, None), false), Verdict::Write);
        let h = held(Some(decided(true)), None);
        assert!(matches!(decision(&h, true), Verdict::Same { .. }));
        assert!(matches!(decision(&h, false), Verdict::Different { .. }));
    }
}
