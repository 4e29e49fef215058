//! `/session`: one session. Its summary and lineage, a chart of its calls'
//! states over time, the conversation as a timeline, and its Jobs and
//! Events. Each read is bounded: at most [`MAX_LISTED`] Continuations,
//! Jobs, Events and children, the most recent [`MAX_TURNS`] turns, and
//! every text a tenant wrote clipped to [`PREVIEW_BYTES`].

use super::html::{age, api_message, clip, duration, error_page, escape, href, millis, page, Page};
use super::sessions::{agent_of, phase_name, wait_name};
use super::svg;
use super::timeline::{self, CallRow, ContinuationFacts, Entry, EventTimes};
use super::Ui;
use crate::api::{Continuation, Session};
use crate::core::{SessionId, Turn};
use crate::ports::SessionPort;
use crate::runner::job::LABEL_CONTINUATION;
use crate::store::kube::{KubeStore, SESSION_LABEL};
use hyper::StatusCode;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The label a child session carries: its parent's name.
pub const PARENT_LABEL: &str = "agents-exe.io/parent";
/// The label a forked session carries: the name of the one it forked from.
pub const FORK_LABEL: &str = crate::api::session::FORK_LABEL;
/// The most objects of each kind the page lists.
const MAX_LISTED: u32 = 200;
/// The most turns the timeline shows (the most recent).
const MAX_TURNS: usize = 200;
/// The most of a message, argument or result the page shows.
pub const PREVIEW_BYTES: usize = 600;

impl Ui {
    pub(super) async fn session(&self, ns: &str, name: &str) -> Page {
        if let Err(e) = check_place(self.only.as_deref(), ns, name) {
            return error_page(StatusCode::BAD_REQUEST, &e);
        }
        let s = match Api::<Session>::namespaced(self.client.clone(), ns)
            .get(name)
            .await
        {
            Ok(s) => s,
            Err(e) => return error_page(StatusCode::BAD_GATEWAY, &api_message(&e)),
        };
        let mut body = summary(&s);
        body.push_str(&self.lineage(ns, &s).await);
        let facts = self.continuation_facts(ns, name).await;
        let (events, event_rows) = self.events(ns, name).await;
        let (turns, open, note) = self.turns(ns, name).await;
        let preview = |t: &str| clip(t, PREVIEW_BYTES);
        let entries = timeline::entries(&turns, open.as_ref(), &facts.0, &events, &preview);
        let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
        let lanes: Vec<svg::Lane> = calls(&entries).map(|c| c.lane(now)).collect();
        body.push_str("<h2>Calls over time</h2>");
        body.push_str(&svg::chart(&lanes));
        body.push_str("<h2>Timeline</h2>");
        body.push_str(&note);
        body.push_str(&render_timeline(&entries, ns));
        body.push_str(&facts.1);
        body.push_str(&self.jobs(ns, &facts.0).await);
        body.push_str(&event_rows);
        page(StatusCode::OK, &format!("Session {name}"), &body)
    }

    /// The turns, reassembled by the store (archived ones included), the
    /// most recent [`MAX_TURNS`]; a note when some are left out.
    async fn turns(
        &self,
        ns: &str,
        name: &str,
    ) -> (
        Vec<Turn>,
        Option<crate::core::session::PartialUserTurn>,
        String,
    ) {
        let store = KubeStore::new(self.client.clone(), ns);
        match store.load(&SessionId(name.to_string())).await {
            Ok(Some(r)) => {
                let mut turns = r.value.state.turns;
                let mut note = String::new();
                if turns.len() > MAX_TURNS {
                    let _ = write!(
                        note,
                        "<p class=muted>The {} earliest turns are not shown.</p>",
                        turns.len() - MAX_TURNS
                    );
                    turns.drain(..turns.len() - MAX_TURNS);
                }
                (turns, r.value.state.open, note)
            }
            Ok(None) => (
                vec![],
                None,
                "<p class=muted>The session has no state yet.</p>".into(),
            ),
            Err(e) => (
                vec![],
                None,
                format!("<p class=error>{}</p>", escape(&e.to_string())),
            ),
        }
    }

    /// The session's Continuations by call id, and their table.
    async fn continuation_facts(
        &self,
        ns: &str,
        name: &str,
    ) -> (BTreeMap<String, ContinuationFacts>, String) {
        let lp = ListParams::default()
            .labels(&format!("{SESSION_LABEL}={name}"))
            .limit(MAX_LISTED);
        let list = match Api::<Continuation>::namespaced(self.client.clone(), ns)
            .list(&lp)
            .await
        {
            Ok(l) => l.items,
            Err(e) => {
                return (
                    BTreeMap::new(),
                    format!(
                        "<h2>Continuations</h2><p class=error>{}</p>",
                        escape(&api_message(&e))
                    ),
                )
            }
        };
        let facts = list
            .iter()
            .map(|c| (c.spec.call_id.clone(), facts_of(c)))
            .collect();
        (facts, String::new())
    }

    /// The session's children and forks, by label; its parent by its own.
    async fn lineage(&self, ns: &str, s: &Session) -> String {
        let mut out = String::from("<h2>Lineage</h2><ul id=lineage>");
        match s.labels().get(PARENT_LABEL) {
            Some(p) => {
                let _ = write!(
                    out,
                    "<li>parent: <a href=\"{}\">{}</a></li>",
                    href("/session", &[("ns", ns), ("name", p)]),
                    escape(p)
                );
            }
            None => out.push_str("<li>parent: none</li>"),
        }
        for (what, label) in [("children", PARENT_LABEL), ("forks", FORK_LABEL)] {
            let lp = ListParams::default()
                .labels(&format!("{label}={}", s.name_any()))
                .limit(MAX_LISTED);
            let names = match Api::<Session>::namespaced(self.client.clone(), ns)
                .list(&lp)
                .await
            {
                Ok(l) => l
                    .items
                    .iter()
                    .map(|c| {
                        let n = c.name_any();
                        format!(
                            "<a href=\"{}\">{}</a>",
                            href("/session", &[("ns", ns), ("name", &n)]),
                            escape(&n)
                        )
                    })
                    .collect::<Vec<_>>(),
                Err(e) => vec![escape(&api_message(&e))],
            };
            let shown = if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            };
            let _ = write!(out, "<li>{what}: {shown}</li>");
        }
        out.push_str("</ul>");
        out
    }

    /// The session's Events (when each step happened), and their table.
    async fn events(&self, ns: &str, name: &str) -> (EventTimes, String) {
        let lp = ListParams::default()
            .fields(&format!(
                "involvedObject.kind=Session,involvedObject.name={name}"
            ))
            .limit(MAX_LISTED);
        let list = match Api::<Event>::namespaced(self.client.clone(), ns)
            .list(&lp)
            .await
        {
            Ok(l) => l.items,
            Err(e) => {
                return (
                    EventTimes::new(),
                    format!(
                        "<h2>Events</h2><p class=error>{}</p>",
                        escape(&api_message(&e))
                    ),
                )
            }
        };
        let mut rows: Vec<(i64, &Event)> = list
            .iter()
            .filter_map(|e| Some((event_time(e)?, e)))
            .collect();
        rows.sort_by_key(|(t, _)| *t);
        let mut times = EventTimes::new();
        for (t, e) in &rows {
            if let Some(a) = &e.action {
                times.entry(a.clone()).or_insert(*t);
            }
        }
        (times, events_table(&rows))
    }

    async fn jobs(&self, ns: &str, facts: &BTreeMap<String, ContinuationFacts>) -> String {
        let tokens: Vec<&str> = facts
            .values()
            .filter(|f| f.job.is_some() && f.token.len() <= 63)
            .map(|f| f.token.as_str())
            .take(100)
            .collect();
        let mut out = String::from("<h2>Jobs</h2>");
        if tokens.is_empty() {
            out.push_str("<p class=muted id=jobs>No call of this session ran in a Job.</p>");
            return out;
        }
        let lp = ListParams::default()
            .labels(&format!("{LABEL_CONTINUATION} in ({})", tokens.join(",")))
            .limit(MAX_LISTED);
        match Api::<Job>::namespaced(self.client.clone(), ns)
            .list(&lp)
            .await
        {
            Ok(l) => out.push_str(&jobs_table(&l.items)),
            Err(e) => {
                let _ = write!(out, "<p class=error>{}</p>", escape(&api_message(&e)));
            }
        }
        out
    }
}

/// The namespace and name of a session link, checked before any read.
fn check_place(only: Option<&str>, ns: &str, name: &str) -> Result<(), String> {
    crate::core::ids::validate_name("namespace", ns)?;
    crate::core::ids::validate_name("session", name)?;
    match only {
        Some(o) if o != ns => Err(format!(
            "this console serves namespace {o} only (agents ui -n {o})"
        )),
        _ => Ok(()),
    }
}

fn calls(entries: &[Entry]) -> impl Iterator<Item = &CallRow> {
    entries.iter().flat_map(|e| match e {
        Entry::Agent { calls, .. } => calls.as_slice(),
        Entry::User(_) => &[],
    })
}

fn facts_of(c: &Continuation) -> ContinuationFacts {
    let status = c.status.clone().unwrap_or_default();
    let mut decisions: Vec<String> = status
        .decisions
        .iter()
        .map(|d| verdict(&d.by, d.approved))
        .collect();
    if let Some(d) = &status.decision {
        let line = verdict(&d.by, d.approved);
        if !decisions.contains(&line) {
            decisions.push(line);
        }
    }
    let failed = status
        .outcome
        .as_ref()
        .is_some_and(|o| o.result.get("status").and_then(|s| s.as_str()) == Some("error"));
    ContinuationFacts {
        token: c.name_any(),
        disposition: serde_json::to_value(c.spec.policy.disposition)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        created: c.creation_timestamp().map(|t| millis(&t.0)),
        decisions,
        completed: status
            .outcome
            .as_ref()
            .map(|o| (millis(&o.completed_at.0), o.completed_by.clone())),
        failed,
        job: status.job.clone(),
    }
}

fn verdict(by: &str, approved: bool) -> String {
    format!("{by} {}", if approved { "approved" } else { "denied" })
}

fn event_time(e: &Event) -> Option<i64> {
    e.event_time
        .as_ref()
        .map(|t| millis(&t.0))
        .or_else(|| e.first_timestamp.as_ref().map(|t| millis(&t.0)))
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| millis(&t.0)))
}

fn summary(s: &Session) -> String {
    let status = s.status.clone().unwrap_or_default();
    let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
    let created = s
        .creation_timestamp()
        .map(|t| age(millis(&t.0), now))
        .unwrap_or_default();
    let mut out = format!(
        "<table id=summary><tr><th>namespace</th><td>{}</td><th>agent</th><td>{}</td><th>phase</th><td id=phase>{}</td></tr>\
         <tr><th>waits for</th><td>{}</td><th>turns</th><td>{}</td><th>age</th><td>{created}</td></tr></table>",
        escape(&s.namespace().unwrap_or_default()),
        escape(&agent_of(s)),
        phase_name(status.phase),
        wait_name(status.waiting_for),
        status.agent_turns,
    );
    if let Some(a) = &status.answer {
        let _ = write!(
            out,
            "<p><b>answer:</b> {}</p>",
            escape(&clip(a, PREVIEW_BYTES))
        );
    }
    if let Some(f) = &status.failure {
        let _ = write!(
            out,
            "<p class=error><b>failure:</b> {}</p>",
            escape(&clip(f, PREVIEW_BYTES))
        );
    }
    out
}

fn render_timeline(entries: &[Entry], ns: &str) -> String {
    let mut out = String::from("<div id=timeline>");
    for e in entries {
        match e {
            Entry::User(m) => {
                let _ = write!(
                    out,
                    "<div class=\"turn user\"><b>user:</b> {}</div>",
                    escape(m)
                );
            }
            Entry::Agent {
                turn,
                text,
                at,
                asked,
                calls,
            } => {
                let _ = write!(
                    out,
                    "<div class=\"turn agent\"><b>agent, turn {turn}:</b> {}{}",
                    reply_time(*at, *asked),
                    escape(text.as_deref().unwrap_or(""))
                );
                if !calls.is_empty() {
                    out.push_str("<table class=calls><tr><th>call</th><th>tool</th><th>arguments</th><th>disposition</th><th>state</th><th>started</th><th>took</th><th>who</th><th>result</th></tr>");
                    for c in calls {
                        out.push_str(&call_row(c, ns));
                    }
                    out.push_str("</table>");
                }
                out.push_str("</div>");
            }
        }
    }
    out.push_str("</div>");
    out
}

fn call_row(c: &CallRow, ns: &str) -> String {
    let id = match &c.token {
        Some(t) => format!(
            "<a href=\"{}\">{}</a>",
            href("/call", &[("ns", ns), ("token", t)]),
            escape(&c.id)
        ),
        None => escape(&c.id),
    };
    format!(
        "<tr><td>{id}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td class=state>{}</td><td class=started>{}</td><td class=took>{}</td><td>{}</td><td>{}</td></tr>",
        escape(&c.tool),
        escape(&c.arguments),
        escape(&c.disposition),
        c.state,
        c.started.or(c.deferred).map(instant).unwrap_or_default(),
        c.duration().map(duration).unwrap_or_default(),
        escape(&c.who.join("; ")),
        escape(c.result.as_deref().unwrap_or("")),
    )
}

/// An instant as RFC 3339 in UTC, to the millisecond (as the Jobs table).
fn instant(ms: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond(ms)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// When a model reply was recorded, and how long the model took where
/// the ask is known.
fn reply_time(at: Option<i64>, asked: Option<i64>) -> String {
    let Some(at) = at else {
        return String::new();
    };
    let took = asked
        .map(|a| format!(", took {}", duration(at - a)))
        .unwrap_or_default();
    format!("<span class=\"muted at\">({}{took})</span> ", instant(at))
}

fn jobs_table(jobs: &[Job]) -> String {
    let mut out = String::from("<table id=jobs><tr><th>Job</th><th>call</th><th>state</th><th>started</th><th>took</th></tr>");
    for j in jobs {
        let st = j.status.clone().unwrap_or_default();
        let state = if st.succeeded.unwrap_or(0) > 0 {
            "Succeeded"
        } else if st.failed.unwrap_or(0) > 0 {
            "Failed"
        } else if st.active.unwrap_or(0) > 0 {
            "Active"
        } else {
            "Pending"
        };
        let start = st.start_time.as_ref().map(|t| millis(&t.0));
        let took = match (start, st.completion_time.as_ref().map(|t| millis(&t.0))) {
            (Some(a), Some(b)) => duration(b - a),
            _ => String::new(),
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{state}</td><td>{}</td><td>{took}</td></tr>",
            escape(&j.name_any()),
            escape(
                j.labels()
                    .get(LABEL_CONTINUATION)
                    .map(String::as_str)
                    .unwrap_or("")
            ),
            start
                .map(|t| k8s_openapi::jiff::Timestamp::from_millisecond(t)
                    .map(|t| t.to_string())
                    .unwrap_or_default())
                .unwrap_or_default(),
        );
    }
    out.push_str("</table>");
    out
}

fn events_table(rows: &[(i64, &Event)]) -> String {
    let mut out = String::from("<h2>Events</h2>");
    if rows.is_empty() {
        out.push_str(
            "<p class=muted id=events>No Events (they expire after an hour by default).</p>",
        );
        return out;
    }
    out.push_str(
        "<table id=events><tr><th>time</th><th>type</th><th>reason</th><th>message</th></tr>",
    );
    for (t, e) in rows {
        let at = k8s_openapi::jiff::Timestamp::from_millisecond(*t)
            .map(|t| t.to_string())
            .unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&at),
            escape(e.type_.as_deref().unwrap_or("")),
            escape(e.reason.as_deref().unwrap_or("")),
            escape(&clip(e.message.as_deref().unwrap_or(""), PREVIEW_BYTES)),
        );
    }
    out.push_str("</table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_link_names_a_session_in_the_served_namespace() {
        assert!(check_place(None, "team-a", "s1").is_ok());
        assert!(check_place(None, "team-a", "<script>")
            .unwrap_err()
            .contains("not valid"));
        assert!(check_place(Some("team-b"), "team-a", "s1")
            .unwrap_err()
            .contains("team-b only"));
    }

    #[test]
    fn the_timeline_shows_a_sync_call_and_a_reply_with_their_times() {
        let turns = super::timeline::tests::timed_turns();
        let entries = timeline::entries(
            &turns,
            None,
            &BTreeMap::new(),
            &EventTimes::new(),
            &|s: &str| s.to_string(),
        );
        let html = render_timeline(&entries, "ns");
        assert!(
            html.contains("(1970-01-01T00:00:01Z, took 600ms)"),
            "the reply's time and the model's: {html}"
        );
        assert!(
            html.contains("<td class=started>1970-01-01T00:00:01.1Z</td><td class=took>250ms</td>"),
            "{html}"
        );
    }

    #[test]
    fn hostile_text_in_the_timeline_shows_as_text() {
        let entries = vec![
            Entry::User("<script>alert(1)</script>".into()),
            Entry::Agent {
                turn: 1,
                text: Some("<img src=x onerror=alert(1)>".into()),
                at: None,
                asked: None,
                calls: vec![],
            },
        ];
        let html = render_timeline(&entries, "ns");
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{html}"
        );
        assert!(
            !html.contains("<script") && !html.contains("<img"),
            "{html}"
        );
    }
}
