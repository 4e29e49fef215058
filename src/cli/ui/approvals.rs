//! `/`: the calls waiting for people, paged through the API, with age,
//! quorum progress and an arguments preview; `/call`: one call, decided,
//! completed or answered (an MCP task's request for input) on the page.
//! Decisions and results are the store's write-once writes; answers take
//! the same path as `agents session answer`.

use super::html::{
    age, api_message, clip, error_page, escape, field, href, millis, page, pretty, see_other, Page,
};
use super::paging::page_ask;
use super::session_page::PREVIEW_BYTES;
use super::sessions::wait_name;
use super::Ui;
use crate::api::session::WaitingForName;
use crate::api::{Continuation, Session};
use crate::cli::tree_cmd::path_of;
use crate::core::budget::Raise;
use crate::core::{ContinuationToken, SessionId, ToolResult, Turn};
use crate::ports::records::{Decision, WriteOnce};
use crate::ports::{ContinuationPort, SessionPort};
use crate::standalone::budget_ask::check_raise;
use crate::standalone::commands::{compact_answers, record_answers};
use crate::store::kube::KubeStore;
use hyper::StatusCode;
use kube::api::Api;
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The most of a call's arguments the list shows.
const ARGS_PREVIEW_BYTES: usize = 120;

/// A call a person can move on: it waits for a decision, an outside
/// result or an answer to its MCP task, and has no outcome yet.
fn waits_for_people(c: &Continuation) -> bool {
    let s = c.status.as_ref();
    s.is_some_and(|s| {
        s.outcome.is_none()
            && matches!(
                s.waiting_for,
                Some(
                    WaitingForName::Approval
                        | WaitingForName::External
                        | WaitingForName::McpTask
                        | WaitingForName::Budget
                )
            )
    })
}

/// `decisions so far / required` for a call awaiting approval.
pub fn quorum(c: &Continuation) -> String {
    let s = c.status.clone().unwrap_or_default();
    if s.waiting_for != Some(WaitingForName::Approval) {
        return String::new();
    }
    let needed = c
        .spec
        .policy
        .decorators
        .approval_policy
        .as_ref()
        .and_then(|p| p.quorum)
        .unwrap_or(1);
    let approvals = s.decisions.iter().filter(|d| d.approved).count();
    format!("{approvals}/{needed}")
}

impl Ui {
    pub(super) async fn waiting_list(&self, query: &[(String, String)]) -> Page {
        let ask = match page_ask(query) {
            Ok(a) => a,
            Err(e) => return error_page(StatusCode::BAD_REQUEST, &e),
        };
        let ns = self.namespace_for(&field(query, "ns"));
        let found = match self
            .scan::<Continuation>(&ns, "", &ask, waits_for_people)
            .await
        {
            Ok(f) => f,
            Err(e) => return error_page(StatusCode::BAD_GATEWAY, &e),
        };
        let mut body = format!("<p>Signed in as <b id=me>{}</b>.</p>", escape(&self.me));
        if found.items.is_empty() {
            body.push_str("<p id=none>No call waits for a person.</p>");
        } else {
            let paths = self.tree_paths(&found.items).await;
            body.push_str(&waiting_table(&found.items, &paths));
        }
        if let Some(next) = &found.next {
            let limit = ask.limit.to_string();
            let _ = write!(
                body,
                "<p class=muted>{} read in {} API page(s); the wait is matched here (the API server cannot select Continuations by it).</p>\
                 <p><a id=next href=\"{}\">next page</a></p>",
                found.read,
                found.api_pages,
                href("/", &[("ns", &ns), ("limit", &limit), ("continue", next)])
            );
        }
        page(StatusCode::OK, "Waiting calls", &body)
    }

    pub(super) async fn call(&self, ns: &str, token: &str) -> Page {
        if let Err(e) = check_call(self.only.as_deref(), ns, token) {
            return error_page(StatusCode::BAD_REQUEST, &e);
        }
        let api: Api<Continuation> = Api::namespaced(self.client.clone(), ns);
        let c = match api.get(token).await {
            Ok(c) => c,
            Err(e) => return error_page(StatusCode::BAD_GATEWAY, &api_message(&e)),
        };
        let status = c.status.clone().unwrap_or_default();
        let waits = wait_name(status.waiting_for);
        let args = pretty(&c.spec.tool_call.arguments);
        let mut body = format!(
            "<p>Session <a href=\"{}\"><b>{}</b></a> in <b>{}</b> calls <b id=tool>{}</b>{}; it waits for <b id=waits>{}</b>.</p><h2>Arguments</h2><pre id=arguments>{}</pre>",
            href("/session", &[("ns", ns), ("name", &c.spec.session)]),
            escape(&c.spec.session),
            escape(ns),
            escape(&c.spec.tool_call.name),
            status.reason.as_deref().map(|r| format!(" ({})", escape(r))).unwrap_or_default(),
            escape(waits),
            escape(&args),
        );
        body.push_str(&votes(&c));
        let state = self.session_state(ns, &c.spec.session).await;
        body.push_str(&self.forms(ns, token, waits, &c, &args, state.as_ref()));
        body.push_str("<h2>The conversation before it</h2>");
        body.push_str(&match &state {
            Ok(s) => conversation(&s.turns),
            Err(e) => format!("<p class=error>{}</p>", escape(e)),
        });
        page(StatusCode::OK, &format!("Call {token}"), &body)
    }

    async fn session_state(
        &self,
        ns: &str,
        session: &str,
    ) -> Result<crate::core::SessionState, String> {
        let store = KubeStore::new(self.client.clone(), ns);
        match store.load(&SessionId(session.to_string())).await {
            Ok(Some(r)) => Ok(r.value.state),
            Ok(None) => Err("(the session is gone)".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn hidden(&self, ns: &str, token: &str) -> String {
        format!(
            "<input type=hidden name=csrf value=\"{}\"><input type=hidden name=ns value=\"{}\"><input type=hidden name=token value=\"{}\">",
            escape(&self.csrf),
            escape(ns),
            escape(token)
        )
    }

    fn forms(
        &self,
        ns: &str,
        token: &str,
        waits: &str,
        c: &Continuation,
        args: &str,
        state: Result<&crate::core::SessionState, &String>,
    ) -> String {
        let hidden = self.hidden(ns, token);
        match waits {
            "external" => format!(
                "<h2>Complete</h2><form method=post action=/decide>{hidden}<input type=hidden name=action value=complete>\
                 <textarea name=text rows=4 cols=80></textarea><br><button id=complete>Complete with this text</button></form>"
            ),
            "budget" => budget_forms(&hidden),
            "mcpTask" => answer_form(&hidden, state.ok().and_then(|s| s.find_call(&ContinuationToken(token.into()))).and_then(|t| t.task_asks())),
            _ => decide_forms(&hidden, c, args),
        }
    }

    pub(super) async fn act(&self, form: &[(String, String)]) -> Page {
        if field(form, "csrf") != self.csrf {
            return error_page(
                StatusCode::FORBIDDEN,
                "this form is stale or not from this page (CSRF token); reload the page",
            );
        }
        let (ns, token) = (field(form, "ns"), field(form, "token"));
        if let Err(e) = check_call(self.only.as_deref(), &ns, &token) {
            return error_page(StatusCode::BAD_REQUEST, &e);
        }
        let store = KubeStore::new(self.client.clone(), &ns);
        let token = ContinuationToken(token);
        let now = crate::ports::Clock::now(&crate::ports::SystemClock);
        let written = match field(form, "action").as_str() {
            "approve" | "deny" => {
                let approved = field(form, "action") == "approve";
                let raise =
                    match checked_raise(&store, &token, approved, &field(form, "raise")).await {
                        Ok(r) => r,
                        Err(e) => return error_page(StatusCode::BAD_REQUEST, &e),
                    };
                let decision = Decision {
                    approved,
                    by: self.me.clone(),
                    reason: Some(field(form, "reason")).filter(|r| !r.trim().is_empty()),
                    at: now,
                    arguments: Some(field(form, "arguments")).filter(|a| !a.trim().is_empty()),
                    raise,
                };
                store.decide(&token, &decision).await
            }
            "complete" => {
                let result = ToolResult::text(field(form, "text"));
                store.complete(&token, &result, &self.me, now).await
            }
            "answer" => return self.answer(&store, &token, &field(form, "answers")).await,
            other => {
                return error_page(
                    StatusCode::BAD_REQUEST,
                    &format!("unknown action {other:?}"),
                )
            }
        };
        match written {
            Ok(WriteOnce::Recorded) | Ok(WriteOnce::AlreadySame { .. }) => see_other("/"),
            Ok(WriteOnce::AlreadyDifferent { by, .. }) => error_page(
                StatusCode::CONFLICT,
                &format!("{token} was already decided or completed by {by}"),
            ),
            Err(e) => error_page(StatusCode::FORBIDDEN, &e.to_string()),
        }
    }

    /// Answers an MCP task's request for input, as `agents session answer`.
    async fn answer(&self, store: &KubeStore, token: &ContinuationToken, answers: &str) -> Page {
        let written = match compact_answers(answers) {
            Ok(compact) => record_answers(store, token, &compact, &self.me).await,
            Err(e) => Err(e),
        };
        match written {
            Ok(_) => see_other("/"),
            Err(e) => error_page(StatusCode::FORBIDDEN, &format!("{e:#}")),
        }
    }
}

/// The namespace and token of a call link or form, checked before any read.
fn check_call(only: Option<&str>, ns: &str, token: &str) -> Result<(), String> {
    crate::core::ids::validate_name("namespace", ns)?;
    crate::core::ids::validate_name("token", token)?;
    match only {
        Some(o) if o != ns => Err(format!(
            "this console serves namespace {o} only (agents ui -n {o})"
        )),
        _ => Ok(()),
    }
}

/// (namespace, session) -> the sessions above it in its sub-agent tree.
type TreePaths = BTreeMap<(String, String), Vec<String>>;

impl Ui {
    /// The path from the root of each listed call's session that is a
    /// sub-agent (one read a session; a session not read shows alone).
    async fn tree_paths(&self, items: &[Continuation]) -> TreePaths {
        let mut paths = TreePaths::new();
        for c in items {
            let key = (c.namespace().unwrap_or_default(), c.spec.session.clone());
            if paths.contains_key(&key) {
                continue;
            }
            let api: Api<Session> = Api::namespaced(self.client.clone(), &key.0);
            let above = match api.get_opt(&key.1).await {
                Ok(Some(s)) if s.spec.parent.is_some() => {
                    let mut path: Vec<String> =
                        path_of(&s).split(" > ").map(str::to_string).collect();
                    path.pop();
                    path
                }
                _ => Vec::new(),
            };
            paths.insert(key, above);
        }
        paths
    }
}

/// The session cell: its path from the root of its tree, then its link.
fn session_cell(ns: &str, session: &str, paths: &TreePaths) -> String {
    let above = paths
        .get(&(ns.to_string(), session.to_string()))
        .filter(|p| !p.is_empty())
        .map(|p| format!("<span class=path>{} &gt; </span>", escape(&p.join(" > "))))
        .unwrap_or_default();
    format!(
        "{above}<a href=\"{}\">{}</a>",
        href("/session", &[("ns", ns), ("name", session)]),
        escape(session)
    )
}

fn waiting_table(items: &[Continuation], paths: &TreePaths) -> String {
    let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
    let mut out = String::from(
        "<table id=calls><tr><th>namespace</th><th>session</th><th>tool</th><th>arguments</th><th>waits for</th>\
         <th>age</th><th>quorum</th><th>why</th><th></th></tr>",
    );
    for c in items {
        let ns = c.namespace().unwrap_or_default();
        let s = c.status.clone().unwrap_or_default();
        let created = c
            .creation_timestamp()
            .map(|t| age(millis(&t.0), now))
            .unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=session>{}</td><td>{}</td><td><code class=args>{}</code></td><td>{}</td><td class=age>{created}</td>\
             <td class=quorum>{}</td><td>{}</td><td><a class=open href=\"{}\">{}</a></td></tr>",
            escape(&ns),
            session_cell(&ns, &c.spec.session, paths),
            escape(&c.spec.tool_call.name),
            escape(&clip(&c.spec.tool_call.arguments, ARGS_PREVIEW_BYTES)),
            escape(wait_name(s.waiting_for)),
            escape(&quorum(c)),
            escape(&clip(s.reason.as_deref().unwrap_or(""), ARGS_PREVIEW_BYTES)),
            href("/call", &[("ns", &ns), ("token", &c.name_any())]),
            escape(&c.name_any()),
        );
    }
    out.push_str("</table>");
    out
}

fn votes(c: &Continuation) -> String {
    let status = c.status.clone().unwrap_or_default();
    let mut out = String::new();
    let q = quorum(c);
    if !q.is_empty() {
        let _ = write!(out, "<p>Approvals so far: <b id=quorum>{q}</b>.</p>");
    }
    if !status.decisions.is_empty() {
        out.push_str("<h2>Votes so far</h2><ul>");
        for d in &status.decisions {
            let verb = if d.approved { "approved" } else { "denied" };
            let _ = write!(out, "<li>{} {verb}</li>", escape(&d.by));
        }
        out.push_str("</ul>");
    }
    out
}

fn decide_forms(hidden: &str, c: &Continuation, args: &str) -> String {
    let edit = c
        .spec
        .policy
        .decorators
        .approval_policy
        .as_ref()
        .filter(|p| p.allow_edit)
        .map(|_| {
            format!(
                "<form method=post action=/decide>{hidden}<input type=hidden name=action value=approve>\
                 <textarea name=arguments rows=6 cols=80>{}</textarea><br><button id=edit>Edit and approve</button></form>",
                escape(args)
            )
        })
        .unwrap_or_default();
    format!(
        "<h2>Decide</h2><form method=post action=/decide>{hidden}<input type=hidden name=action value=approve><button id=approve>Approve</button></form>\
         <form method=post action=/decide>{hidden}<input type=hidden name=action value=deny><input name=reason placeholder=\"why (for the model)\"><button id=deny>Deny</button></form>{edit}"
    )
}

/// A session's question about its budget: approve with new bounds, or
/// deny (the session fails, with the reason).
fn budget_forms(hidden: &str) -> String {
    format!(
        "<h2>Decide</h2><form method=post action=/decide>{hidden}<input type=hidden name=action value=approve>\
         <input name=raise id=raise size=40 placeholder=\"tokens=200000, cost=0.5, toolCalls=60\"><button id=approve>Approve with this raise</button></form>\
         <form method=post action=/decide>{hidden}<input type=hidden name=action value=deny><input name=reason placeholder=\"why\"><button id=deny>Deny (the session fails)</button></form>"
    )
}

/// The raise a form gives (`tokens=N, cost=D`, comma or space separated),
/// checked as `agents session approve --raise` checks it.
async fn checked_raise(
    store: &KubeStore,
    token: &ContinuationToken,
    approved: bool,
    text: &str,
) -> Result<Option<Raise>, String> {
    let mut raise = Raise::default();
    let parts: Vec<&str> = text
        .split([',', ' '])
        .filter(|p| !p.trim().is_empty())
        .collect();
    for part in &parts {
        raise.parse_into(part)?;
    }
    let raise = (!parts.is_empty()).then_some(raise);
    if let Ok(Some(record)) = store.get_continuation(token).await {
        check_raise(&record, approved, raise.as_ref()).map_err(|e| format!("{e:#}"))?;
    }
    Ok(raise)
}

/// What an MCP task asks (its `inputRequests`) and a form to answer it
/// with an `inputResponses` object.
fn answer_form(hidden: &str, asks: Option<&str>) -> String {
    let Some(asks) = asks else {
        return "<h2>Answer</h2><p class=muted id=asks>The task asks for nothing now; the operator polls it and shows its questions here when it asks.</p>".into();
    };
    format!(
        "<h2>The task asks</h2><pre id=asks>{}</pre><h2>Answer</h2><form method=post action=/decide>{hidden}<input type=hidden name=action value=answer>\
         <textarea name=answers rows=6 cols=80 placeholder='{{\"q1\": {{\"action\": \"accept\", \"content\": {{\"ok\": true}}}}}}'></textarea><br>\
         <button id=answer>Answer</button></form>",
        escape(&clip(&pretty(asks), 4 * PREVIEW_BYTES))
    )
}

fn conversation(turns: &[Turn]) -> String {
    let shown = &turns[turns.len().saturating_sub(50)..];
    let mut out = String::from("<div id=conversation>");
    for turn in shown {
        match turn {
            Turn::User(u) => {
                if let Some(m) = &u.message {
                    let _ = write!(
                        out,
                        "<p><b>user:</b> {}</p>",
                        escape(&clip(m, PREVIEW_BYTES))
                    );
                }
                for r in &u.tool_results {
                    let _ = write!(
                        out,
                        "<p><b>{} returned:</b> {}</p>",
                        escape(&r.tool),
                        escape(&clip(&r.result.to_model_text(), PREVIEW_BYTES))
                    );
                }
            }
            Turn::Agent(a) => {
                if let Some(t) = &a.text {
                    let _ = write!(
                        out,
                        "<p><b>agent:</b> {}</p>",
                        escape(&clip(t, PREVIEW_BYTES))
                    );
                }
                for call in &a.tool_calls {
                    let _ = write!(
                        out,
                        "<p><b>agent calls {}</b> <code>{}</code></p>",
                        escape(&call.name),
                        escape(&clip(&call.arguments, PREVIEW_BYTES))
                    );
                }
            }
        }
    }
    out.push_str("</div>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sub_agents_call_shows_its_path_from_the_root() {
        let paths = TreePaths::from([
            (
                ("ns".to_string(), "root-t1-c0".to_string()),
                vec!["root".to_string()],
            ),
            (("ns".to_string(), "root".to_string()), Vec::new()),
        ]);
        let cell = session_cell("ns", "root-t1-c0", &paths);
        assert!(
            cell.starts_with("<span class=path>root &gt; </span><a href="),
            "{cell}"
        );
        assert!(cell.ends_with(">root-t1-c0</a>"), "{cell}");
        let plain = session_cell("ns", "root", &paths);
        assert!(plain.starts_with("<a href="), "a root shows alone: {plain}");
    }
}
