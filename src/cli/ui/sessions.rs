//! `/sessions`: every session the user may list, in the API's order (by
//! namespace and name), paged through the API's `limit`/`continue`.
//!
//! Filters: the namespace and a label selector go to the API server; the
//! agent, phase and waitingFor are matched here on each page (see
//! [`super::paging`] for why and how far one page reads).

use super::html::{age, escape, field, href, millis, page, Page};
use super::paging::{page_ask, Scanned};
use super::Ui;
use crate::api::session::{SessionPhase, WaitingForName};
use crate::api::Session;
use hyper::StatusCode;
use kube::ResourceExt;
use std::fmt::Write as _;

/// The phases as the CRD spells them.
const PHASES: &[&str] = &[
    "Pending",
    "AwaitingModel",
    "Running",
    "Waiting",
    "Paused",
    "Succeeded",
    "Failed",
];
/// What a session may wait for, as the CRD spells it.
const WAITS: &[&str] = &["approval", "background", "isolated", "external", "mcpTask"];

/// The filters of the sessions list, from its query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionFilter {
    pub namespace: String,
    pub agent: String,
    pub phase: String,
    pub waiting: String,
    pub labels: String,
}

impl SessionFilter {
    pub fn from_query(query: &[(String, String)]) -> Result<Self, String> {
        let f = SessionFilter {
            namespace: field(query, "ns"),
            agent: field(query, "agent"),
            phase: field(query, "phase"),
            waiting: field(query, "waitingFor"),
            labels: field(query, "labels"),
        };
        if !f.phase.is_empty() && !PHASES.contains(&f.phase.as_str()) {
            return Err(format!(
                "phase {:?} is not a session phase; use one of {}",
                f.phase,
                PHASES.join(", ")
            ));
        }
        if !f.waiting.is_empty() && !WAITS.contains(&f.waiting.as_str()) {
            return Err(format!(
                "waitingFor {:?} is not something a session waits for; use one of {}",
                f.waiting,
                WAITS.join(", ")
            ));
        }
        Ok(f)
    }

    /// The filters matched here rather than by the API server.
    pub fn here(&self) -> Vec<&'static str> {
        [
            ("agent", &self.agent),
            ("phase", &self.phase),
            ("waitingFor", &self.waiting),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, _)| k)
        .collect()
    }

    pub fn keeps(&self, s: &Session) -> bool {
        let status = s.status.as_ref();
        (self.agent.is_empty() || agent_of(s) == self.agent)
            && (self.phase.is_empty()
                || phase_name(status.map(|st| st.phase).unwrap_or_default()) == self.phase)
            && (self.waiting.is_empty()
                || wait_name(status.and_then(|st| st.waiting_for)) == self.waiting)
    }

    /// This list's link, at `cont` (or the start).
    pub fn link(&self, limit: u32, cont: &str) -> String {
        let limit = limit.to_string();
        href(
            "/sessions",
            &[
                ("ns", &self.namespace),
                ("agent", &self.agent),
                ("phase", &self.phase),
                ("waitingFor", &self.waiting),
                ("labels", &self.labels),
                ("limit", &limit),
                ("continue", cont),
            ],
        )
    }
}

/// The Agent a session runs: its `agentRef`, or `(inline)`.
pub fn agent_of(s: &Session) -> String {
    match &s.spec.agent_ref {
        Some(r) => r.name.clone(),
        None => "(inline)".into(),
    }
}

pub fn phase_name(p: SessionPhase) -> &'static str {
    match p {
        SessionPhase::Pending => "Pending",
        SessionPhase::AwaitingModel => "AwaitingModel",
        SessionPhase::Running => "Running",
        SessionPhase::Waiting => "Waiting",
        SessionPhase::Paused => "Paused",
        SessionPhase::Succeeded => "Succeeded",
        SessionPhase::Failed => "Failed",
    }
}

/// What a call or session waits for, as the CRD spells it.
pub fn wait_name(w: Option<WaitingForName>) -> &'static str {
    match w {
        Some(WaitingForName::Approval) => "approval",
        Some(WaitingForName::Background) => "background",
        Some(WaitingForName::Isolated) => "isolated",
        Some(WaitingForName::External) => "external",
        Some(WaitingForName::McpTask) => "mcpTask",
        Some(WaitingForName::SubAgent) => "subAgent",
        Some(WaitingForName::Outcome) => "outcome",
        Some(WaitingForName::Budget) => "budget",
        None => "",
    }
}

impl Ui {
    pub(super) async fn sessions(&self, query: &[(String, String)]) -> Page {
        let (filter, ask) =
            match SessionFilter::from_query(query).and_then(|f| Ok((f, page_ask(query)?))) {
                Ok(x) => x,
                Err(e) => return super::html::error_page(StatusCode::BAD_REQUEST, &e),
            };
        let ns = self.namespace_for(&filter.namespace);
        let scanned = self
            .scan::<Session>(&ns, &filter.labels, &ask, |s| filter.keeps(s))
            .await;
        let mut body = self.filter_form(&filter, ask.limit);
        match scanned {
            Ok(found) => body.push_str(&sessions_table(&found, &filter, ask.limit)),
            Err(e) => {
                let _ = write!(body, "<p class=error id=error>{}</p>", escape(&e));
            }
        }
        page(StatusCode::OK, "Sessions", &body)
    }

    fn filter_form(&self, f: &SessionFilter, limit: u32) -> String {
        let ns = match &self.only {
            Some(only) => format!("namespace <b>{}</b> ", escape(only)),
            None => format!(
                "<input name=ns placeholder=\"namespace (all)\" value=\"{}\">",
                escape(&f.namespace)
            ),
        };
        format!(
            "<form class=filters method=get action=/sessions id=filters>{ns}\
             <input name=agent placeholder=agent value=\"{}\">{}{}\
             <input name=labels placeholder=\"label selector\" value=\"{}\">\
             <input name=limit size=4 value=\"{limit}\"><button id=filter>Filter</button></form>",
            escape(&f.agent),
            select("phase", PHASES, &f.phase),
            select("waitingFor", WAITS, &f.waiting),
            escape(&f.labels),
        )
    }
}

fn select(name: &str, options: &[&str], chosen: &str) -> String {
    let mut s = format!("<select name={name}><option value=\"\">{name}: any</option>");
    for o in options {
        let sel = if *o == chosen { " selected" } else { "" };
        let _ = write!(s, "<option{sel}>{o}</option>");
    }
    s.push_str("</select>");
    s
}

fn sessions_table(found: &Scanned<Session>, f: &SessionFilter, limit: u32) -> String {
    let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
    let mut out = String::from(
        "<table id=sessions><tr><th>namespace</th><th>session</th><th>agent</th><th>phase</th>\
         <th>waits for</th><th>pending</th><th>turns</th><th>age</th></tr>",
    );
    for s in &found.items {
        let ns = s.namespace().unwrap_or_default();
        let status = s.status.clone().unwrap_or_default();
        let created = s
            .creation_timestamp()
            .map(|t| age(millis(&t.0), now))
            .unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td><a class=session href=\"{}\">{}</a></td><td>{}</td><td class=phase>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{created}</td></tr>",
            escape(&ns),
            href("/session", &[("ns", &ns), ("name", &s.name_any())]),
            escape(&s.name_any()),
            escape(&agent_of(s)),
            phase_name(status.phase),
            wait_name(status.waiting_for),
            status.pending_count,
            status.agent_turns,
        );
    }
    out.push_str("</table>");
    let here = f.here();
    let _ = write!(
        out,
        "<p class=muted id=paging>{} shown; {} read in {} API page(s) of {limit}{}{}.</p>",
        found.items.len(),
        found.read,
        found.api_pages,
        if found.namespace.is_empty() {
            String::new()
        } else {
            format!(" in namespace {}", escape(&found.namespace))
        },
        if here.is_empty() {
            String::new()
        } else {
            format!(
                "; matched here on each page: {} (the API server cannot select Sessions by them)",
                here.join(", ")
            )
        },
    );
    if let Some(next) = &found.next {
        let _ = write!(
            out,
            "<p><a id=next href=\"{}\">next page</a> · <a href=\"{}\">first page</a></p>",
            f.link(limit, next),
            f.link(limit, "")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests::q;
    use super::*;
    use crate::api::session::{SessionSpec, SessionStatus};

    fn session(agent: &str, phase: SessionPhase, waiting: Option<WaitingForName>) -> Session {
        let mut s = Session::new("s", SessionSpec::referring_to(agent));
        s.status = Some(SessionStatus {
            phase,
            waiting_for: waiting,
            ..Default::default()
        });
        s
    }

    #[test]
    fn filters_match_agent_phase_and_wait() {
        let f = SessionFilter::from_query(&q(&[
            ("agent", "triage"),
            ("phase", "Waiting"),
            ("waitingFor", "approval"),
        ]))
        .unwrap();
        assert_eq!(f.here(), vec!["agent", "phase", "waitingFor"]);
        let w = Some(WaitingForName::Approval);
        assert!(f.keeps(&session("triage", SessionPhase::Waiting, w)));
        assert!(!f.keeps(&session("other", SessionPhase::Waiting, w)));
        assert!(!f.keeps(&session("triage", SessionPhase::Running, w)));
        assert!(!f.keeps(&session("triage", SessionPhase::Waiting, None)));
        assert!(SessionFilter::default().keeps(&session("x", SessionPhase::Failed, None)));
    }

    #[test]
    fn an_unknown_phase_or_wait_is_refused_naming_the_choices() {
        let e = SessionFilter::from_query(&q(&[("phase", "Done")])).unwrap_err();
        assert!(e.contains("Succeeded"), "{e}");
        let e = SessionFilter::from_query(&q(&[("waitingFor", "<b>")])).unwrap_err();
        assert!(e.contains("mcpTask"), "{e}");
    }

    #[test]
    fn the_next_page_link_keeps_the_filters() {
        let f = SessionFilter {
            namespace: "team-a".into(),
            phase: "Waiting".into(),
            ..Default::default()
        };
        assert_eq!(
            f.link(20, "abc="),
            "/sessions?ns=team-a&amp;phase=Waiting&amp;limit=20&amp;continue=abc%3D"
        );
    }
}
