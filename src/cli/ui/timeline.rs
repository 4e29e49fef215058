//! A session's conversation as a timeline, from what is stored: the turns
//! (the state, which keeps when each model reply was recorded and when
//! each call started and ended), the calls' Continuations (who decided and
//! completed, and when) and the session's Events (when a call was deferred;
//! the times of sessions stored before the state kept them). Pure: the
//! page reads, this arranges.

use super::svg::{Lane, Shade, Span};
use crate::core::session::PartialUserTurn;
use crate::core::{CallState, ToolResult, Turn};
use std::collections::BTreeMap;

/// What a call's Continuation says (calls that ran in the step have none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContinuationFacts {
    pub token: String,
    pub disposition: String,
    pub created: Option<i64>,
    /// `by approved` / `by denied`, in order.
    pub decisions: Vec<String>,
    pub completed: Option<(i64, String)>,
    pub failed: bool,
    pub job: Option<String>,
}

/// Times from the session's Events, by the Event's action
/// (`CallModel/t1`, `Defer/t1-c0`, `TakeResult/t1-c0`).
pub type EventTimes = BTreeMap<String, i64>;

/// One call as the timeline shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRow {
    pub id: String,
    pub tool: String,
    pub arguments: String,
    pub disposition: String,
    pub state: CallState,
    pub started: Option<i64>,
    pub deferred: Option<i64>,
    pub ended: Option<i64>,
    pub who: Vec<String>,
    pub result: Option<String>,
    pub token: Option<String>,
    pub job: Option<String>,
}

impl CallRow {
    pub fn duration(&self) -> Option<i64> {
        Some(self.ended? - self.started.or(self.deferred)?)
    }

    /// The call's states over time, for the chart; open calls run to `now`.
    pub fn lane(&self, now: i64) -> Lane {
        let mut spans = Vec::new();
        let end = self.ended.unwrap_or(now);
        if let Some(s) = self.started {
            let to = self.deferred.unwrap_or(end).max(s);
            spans.push(Span {
                shade: Shade::Running,
                from: s,
                to,
            });
        }
        if let Some(d) = self.deferred {
            spans.push(Span {
                shade: Shade::Deferred,
                from: d,
                to: end.max(d),
            });
        }
        if let (Some(e), Some(first)) = (self.ended, spans.first().map(|s| s.from)) {
            let shade = if self.state == CallState::Failed {
                Shade::Failed
            } else {
                Shade::Completed
            };
            spans.push(Span {
                shade,
                from: e.max(first),
                to: e.max(first),
            });
        }
        Lane {
            label: format!("{} {}", self.id, self.tool),
            spans,
        }
    }
}

/// One entry of the timeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    User(String),
    Agent {
        turn: u32,
        text: Option<String>,
        /// When the reply was recorded.
        at: Option<i64>,
        /// When the model was asked for it.
        asked: Option<i64>,
        calls: Vec<CallRow>,
    },
}

/// The timeline of `turns` and the open turn. `preview` bounds every text
/// a tenant wrote (messages, arguments, results).
pub fn entries(
    turns: &[Turn],
    open: Option<&PartialUserTurn>,
    facts: &BTreeMap<String, ContinuationFacts>,
    events: &EventTimes,
    preview: &dyn Fn(&str) -> String,
) -> Vec<Entry> {
    let results = results_by_call(turns, preview);
    let mut out = Vec::new();
    let mut turn = 0u32;
    for t in turns {
        match t {
            Turn::User(u) => {
                if let Some(m) = &u.message {
                    out.push(Entry::User(preview(m)));
                }
            }
            Turn::Agent(a) => {
                turn += 1;
                let started = a
                    .replied_at
                    .map(|t| t.0)
                    .or_else(|| events.get(&format!("CallModel/t{turn}")).copied());
                let calls = a
                    .tool_calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let id = format!("t{turn}-c{i}");
                        let live = open.filter(|o| o.turn == turn).and_then(|o| o.calls.get(i));
                        let base = Base {
                            id,
                            tool: c.name.clone(),
                            arguments: preview(&c.arguments),
                            started,
                        };
                        call_row(base, live, facts, events, &results)
                    })
                    .collect();
                out.push(Entry::Agent {
                    turn,
                    text: a.text.as_deref().map(preview),
                    at: started,
                    asked: a.asked_at.map(|t| t.0),
                    calls,
                });
            }
        }
    }
    out
}

struct Base {
    id: String,
    tool: String,
    arguments: String,
    started: Option<i64>,
}

/// A closed call's result as the timeline shows it.
struct Closed {
    preview: String,
    error: bool,
    started: Option<i64>,
    finished: Option<i64>,
}

/// Results of closed turns by call id.
fn results_by_call(turns: &[Turn], preview: &dyn Fn(&str) -> String) -> BTreeMap<String, Closed> {
    let mut out = BTreeMap::new();
    for t in turns {
        if let Turn::User(u) = t {
            for r in &u.tool_results {
                let closed = Closed {
                    preview: preview(&r.result.to_model_text()),
                    error: matches!(r.result, ToolResult::Error { .. }),
                    started: r.started_at.map(|t| t.0),
                    finished: r.finished_at.map(|t| t.0),
                };
                out.insert(r.call_id.to_string(), closed);
            }
        }
    }
    out
}

fn call_row(
    base: Base,
    live: Option<&crate::core::TrackedToolCall>,
    facts: &BTreeMap<String, ContinuationFacts>,
    events: &EventTimes,
    results: &BTreeMap<String, Closed>,
) -> CallRow {
    let fact = facts.get(&base.id).cloned().unwrap_or_default();
    let closed = results.get(&base.id);
    let state = match (live, closed) {
        (Some(c), _) => c.state(),
        (None, Some(r)) if r.error && fact.failed => CallState::Failed,
        (None, Some(_)) => CallState::Completed,
        (None, None) => CallState::Ready,
    };
    // The state's own times first; Events and Continuations for sessions
    // stored before it kept them.
    let (kept_start, kept_end) = match (live, closed) {
        (Some(c), _) => (c.started_at.map(|t| t.0), c.finished_at.map(|t| t.0)),
        (None, Some(r)) => (r.started, r.finished),
        (None, None) => (None, None),
    };
    let disposition = match live {
        Some(c) => c.policy.disposition.name().to_string(),
        None if fact.disposition.is_empty() => "runSync".into(),
        None => fact.disposition.clone(),
    };
    let mut who = fact.decisions.clone();
    let completed_by = fact
        .completed
        .as_ref()
        .map(|(_, by)| by.clone())
        .or_else(|| live.and_then(|c| c.completed_by().map(str::to_string)));
    if let Some(by) = completed_by {
        who.push(format!("completed by {by}"));
    }
    let ended = kept_end
        .or_else(|| events.get(&format!("TakeResult/{}", base.id)).copied())
        .or(fact.completed.as_ref().map(|(t, _)| *t));
    // The Event's time is to the microsecond; a creationTimestamp only to
    // the second, and may read as before the model's reply.
    let deferred = events
        .get(&format!("Defer/{}", base.id))
        .copied()
        .or(fact.created);
    CallRow {
        state,
        disposition,
        started: kept_start.or(base.started),
        deferred,
        ended: if state.is_final() { ended } else { None },
        who,
        result: closed.map(|r| r.preview.clone()),
        token: Some(fact.token.clone()).filter(|t| !t.is_empty()),
        job: fact.job,
        id: base.id,
        tool: base.tool,
        arguments: base.arguments,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::core::conversation::ToolResultEntry;
    use crate::core::{AgentTurn, CallId, Millis, ToolCall, UserTurn};

    fn call(name: &str) -> ToolCall {
        ToolCall {
            model_call_id: "m".into(),
            name: name.into(),
            arguments: r#"{"q":"<b>x</b>"}"#.into(),
        }
    }

    fn result(turn: u32, i: u32, r: ToolResult) -> ToolResultEntry {
        ToolResultEntry {
            call_id: CallId::new(turn, i),
            model_call_id: "m".into(),
            tool: "t".into(),
            token: None,
            result: r,
            truncate_bytes: None,
            started_at: None,
            finished_at: None,
        }
    }

    /// A call run in the step, a denied one, then the answer.
    fn closed_turns() -> Vec<Turn> {
        vec![
            Turn::User(UserTurn {
                message: Some("hi".into()),
                tool_results: vec![],
            }),
            Turn::Agent(AgentTurn {
                text: None,
                tool_calls: vec![call("search"), call("publish")],
                ..Default::default()
            }),
            Turn::User(UserTurn {
                message: None,
                tool_results: vec![
                    result(1, 0, ToolResult::text("found")),
                    result(
                        1,
                        1,
                        ToolResult::Error {
                            message: "denied".into(),
                        },
                    ),
                ],
            }),
            Turn::Agent(AgentTurn {
                text: Some("done".into()),
                ..Default::default()
            }),
        ]
    }

    fn denied_by_alice() -> BTreeMap<String, ContinuationFacts> {
        let mut facts = BTreeMap::new();
        facts.insert(
            "t1-c1".to_string(),
            ContinuationFacts {
                token: "s-t1-c1".into(),
                disposition: "defer".into(),
                created: Some(1_500),
                decisions: vec!["alice denied".into()],
                completed: Some((9_000, "alice".into())),
                failed: false,
                job: None,
            },
        );
        facts
    }

    #[test]
    fn a_closed_turn_shows_each_call_with_who_and_how_long() {
        let (turns, facts) = (closed_turns(), denied_by_alice());
        let events: EventTimes = [
            ("CallModel/t1".to_string(), 1_000),
            ("TakeResult/t1-c0".to_string(), 1_200),
        ]
        .into();
        let got = entries(&turns, None, &facts, &events, &|s: &str| s.to_string());
        assert_eq!(got[0], Entry::User("hi".into()));
        let Entry::Agent { calls, .. } = &got[1] else {
            panic!("{got:?}")
        };
        assert_eq!(
            (
                calls[0].disposition.as_str(),
                calls[0].state,
                calls[0].duration()
            ),
            ("runSync", CallState::Completed, Some(200))
        );
        assert_eq!(calls[0].result.as_deref(), Some("found"));
        assert_eq!(calls[1].disposition, "defer");
        assert_eq!(calls[1].who, vec!["alice denied", "completed by alice"]);
        assert_eq!(calls[1].duration(), Some(8_000));
        let lane = calls[1].lane(20_000);
        assert_eq!(
            lane.spans
                .iter()
                .map(|s| (s.shade, s.from, s.to))
                .collect::<Vec<_>>(),
            vec![
                (Shade::Running, 1_000, 1_500),
                (Shade::Deferred, 1_500, 9_000),
                (Shade::Completed, 9_000, 9_000)
            ]
        );
        assert_eq!(
            got[2],
            Entry::Agent {
                turn: 2,
                text: Some("done".into()),
                at: None,
                asked: None,
                calls: vec![]
            }
        );
    }

    /// A runSync call and a model reply as the core records them now.
    pub(in crate::cli::ui) fn timed_turns() -> Vec<Turn> {
        let mut ran = result(1, 0, ToolResult::text("found"));
        ran.started_at = Some(Millis(1_100));
        ran.finished_at = Some(Millis(1_350));
        vec![
            Turn::Agent(AgentTurn {
                tool_calls: vec![call("search")],
                asked_at: Some(Millis(400)),
                replied_at: Some(Millis(1_000)),
                ..Default::default()
            }),
            Turn::User(UserTurn {
                message: None,
                tool_results: vec![ran],
            }),
        ]
    }

    #[test]
    fn a_sync_call_and_a_reply_show_their_times_without_any_event() {
        let got = entries(
            &timed_turns(),
            None,
            &BTreeMap::new(),
            &EventTimes::new(),
            &|s: &str| s.to_string(),
        );
        let Entry::Agent {
            at, asked, calls, ..
        } = &got[0]
        else {
            panic!("{got:?}")
        };
        assert_eq!((*at, *asked), (Some(1_000), Some(400)));
        let c = &calls[0];
        assert_eq!(
            (c.disposition.as_str(), c.state, c.started, c.duration()),
            ("runSync", CallState::Completed, Some(1_100), Some(250))
        );
        assert_eq!(
            c.lane(9_000)
                .spans
                .iter()
                .map(|s| (s.shade, s.from, s.to))
                .collect::<Vec<_>>(),
            vec![
                (Shade::Running, 1_100, 1_350),
                (Shade::Completed, 1_350, 1_350)
            ]
        );
    }

    #[test]
    fn an_open_call_takes_its_times_from_the_state() {
        let turns = vec![Turn::Agent(AgentTurn {
            tool_calls: vec![call("search")],
            replied_at: Some(Millis(1_000)),
            ..Default::default()
        })];
        let mut live = crate::core::TrackedToolCall::new(
            CallId::new(1, 0),
            call("search"),
            Default::default(),
        );
        live.start().unwrap();
        live.mark_started(Millis(1_200));
        let open = PartialUserTurn {
            turn: 1,
            calls: vec![live],
        };
        let got = entries(
            &turns,
            Some(&open),
            &BTreeMap::new(),
            &EventTimes::new(),
            &|s: &str| s.to_string(),
        );
        let Entry::Agent { calls, .. } = &got[0] else {
            panic!("{got:?}")
        };
        assert_eq!(
            (calls[0].state, calls[0].started),
            (CallState::Running, Some(1_200))
        );
        assert_eq!(calls[0].lane(1_500).spans[0].to, 1_500, "runs to now");
    }

    #[test]
    fn a_call_with_no_time_has_no_duration_and_an_empty_lane() {
        let turns = vec![Turn::Agent(AgentTurn {
            tool_calls: vec![call("x")],
            ..Default::default()
        })];
        let got = entries(
            &turns,
            None,
            &BTreeMap::new(),
            &EventTimes::new(),
            &|s: &str| s.to_string(),
        );
        let Entry::Agent { calls, .. } = &got[0] else {
            panic!()
        };
        assert_eq!(calls[0].state, CallState::Ready);
        assert_eq!(calls[0].duration(), None);
        assert!(calls[0].lane(5).spans.is_empty());
    }
}
