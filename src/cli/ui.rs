//! `agents ui` (`kubectl agents ui` when installed as `kubectl-agents`): a
//! small page on loopback that lists the calls waiting for people and lets
//! them approve, deny, edit and approve, or complete them. It acts with the
//! user's own kubeconfig, so the API server (RBAC and the approvals
//! policy) decides what they may do; its refusals are shown on the page.
//!
//! Like `kubectl proxy` it binds to loopback only. Every form carries a
//! token made at start (CSRF), and requests must name a loopback host
//! (against DNS rebinding). Rendered on the server; no JavaScript.

use crate::api::session::WaitingForName;
use crate::api::Continuation;
use crate::core::{ContinuationToken, SessionId, ToolResult, Turn};
use crate::ports::records::{Decision, WriteOnce};
use crate::ports::{ContinuationPort, SessionPort};
use crate::store::kube::KubeStore;
use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HOST, LOCATION};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A form is small: a token, a reason, edited arguments.
const MAX_FORM_BYTES: usize = 256 * 1024;
/// The most of a message or result the conversation view shows.
const SHOWN_BYTES: usize = 2048;

#[derive(clap::Args, Debug, Clone)]
pub struct UiArgs {
    /// Where to listen: a loopback address only.
    #[arg(long, default_value = "127.0.0.1:8765")]
    pub addr: SocketAddr,
    /// Only this namespace (default: every namespace you may list, else
    /// your kubeconfig's namespace).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
}

struct Ui {
    client: Client,
    /// The kubeconfig's namespace, where listing all namespaces is refused.
    home: String,
    only: Option<String>,
    csrf: String,
    port: u16,
    me: String,
}

pub fn run(args: UiArgs) -> anyhow::Result<std::process::ExitCode> {
    super::run_cmd::block_on(serve(args))
}

async fn serve(args: UiArgs) -> anyhow::Result<std::process::ExitCode> {
    if !args.addr.ip().is_loopback() {
        bail!(
            "agents ui serves on loopback only (it acts with your credentials); {} is not a loopback address",
            args.addr
        );
    }
    let config = kube::Config::infer()
        .await
        .context("reading your kubeconfig")?;
    let home = config.default_namespace.clone();
    let client = Client::try_from(config)?;
    let me = KubeStore::new(client.clone(), &home).identity().await?;
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("listening on {} (choose another --addr)", args.addr))?;
    let port = listener.local_addr()?.port();
    let ui = Arc::new(Ui {
        client,
        home,
        only: args.namespace,
        csrf: uuid::Uuid::new_v4().simple().to_string(),
        port,
        me,
    });
    println!(
        "serving the approvals page for {} on http://127.0.0.1:{port}/",
        ui.me
    );
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let ui = ui.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let ui = ui.clone();
                async move { Ok::<_, Infallible>(ui.route(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

type Page = Response<Full<Bytes>>;

fn page(status: StatusCode, title: &str, body: &str) -> Page {
    let html = format!(
        "<!doctype html><html><head><meta charset=utf-8><title>{t}</title>\
         <style>body{{font-family:sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}pre{{background:#f4f4f4;padding:.5em;white-space:pre-wrap}}\
         .error{{background:#fee;border:1px solid #c00;padding:.6em}}form{{display:inline-block;margin:.3em}}</style>\
         </head><body><h1>{t}</h1>{body}</body></html>",
        t = escape(title)
    );
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/html; charset=utf-8")
        .header("X-Frame-Options", "DENY")
        .header(
            "Content-Security-Policy",
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'",
        )
        .body(Full::new(Bytes::from(html)))
        .expect("a valid response")
}

fn error_page(status: StatusCode, message: &str) -> Page {
    page(
        status,
        "Not done",
        &format!(
            "<p class=error id=error>{}</p><p><a href=\"/\">back to the waiting calls</a></p>",
            escape(message)
        ),
    )
}

impl Ui {
    async fn route(&self, req: Request<Incoming>) -> Page {
        if !self.host_is_loopback(&req) {
            return error_page(
                StatusCode::FORBIDDEN,
                "requests must be made to 127.0.0.1 or localhost",
            );
        }
        let path = req.uri().path().to_string();
        let query: Vec<(String, String)> = req
            .uri()
            .query()
            .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
            .unwrap_or_default();
        match (req.method().clone(), path.as_str()) {
            (Method::GET, "/") => self.list().await,
            (Method::GET, "/call") => {
                let (ns, token) = (field(&query, "ns"), field(&query, "token"));
                self.call(&ns, &token).await
            }
            (Method::POST, "/decide") => match read_form(req).await {
                Ok(form) => self.act(&form).await,
                Err(e) => error_page(StatusCode::BAD_REQUEST, &e),
            },
            _ => error_page(StatusCode::NOT_FOUND, "no such page"),
        }
    }

    fn host_is_loopback(&self, req: &Request<Incoming>) -> bool {
        let host = req
            .headers()
            .get(HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        [
            format!("127.0.0.1:{}", self.port),
            format!("localhost:{}", self.port),
        ]
        .iter()
        .any(|h| h == host)
    }

    /// Continuations of every namespace the user may list, else of their
    /// kubeconfig's namespace.
    async fn waiting(&self) -> Result<Vec<Continuation>, String> {
        let lp = ListParams::default();
        let all = match &self.only {
            Some(ns) => {
                Api::<Continuation>::namespaced(self.client.clone(), ns)
                    .list(&lp)
                    .await
            }
            None => match Api::<Continuation>::all(self.client.clone())
                .list(&lp)
                .await
            {
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    Api::<Continuation>::namespaced(self.client.clone(), &self.home)
                        .list(&lp)
                        .await
                }
                other => other,
            },
        };
        let mut items = all.map_err(|e| api_message(&e))?.items;
        items.retain(|c| {
            let s = c.status.clone().unwrap_or_default();
            s.outcome.is_none()
                && matches!(
                    s.waiting_for,
                    Some(WaitingForName::Approval | WaitingForName::External)
                )
        });
        Ok(items)
    }

    async fn list(&self) -> Page {
        let items = match self.waiting().await {
            Ok(i) => i,
            Err(e) => return error_page(StatusCode::BAD_GATEWAY, &e),
        };
        let mut body = format!("<p>Signed in as <b id=me>{}</b>.</p>", escape(&self.me));
        if items.is_empty() {
            body.push_str("<p id=none>No call waits for a person.</p>");
            return page(StatusCode::OK, "Waiting calls", &body);
        }
        body.push_str("<table id=calls><tr><th>namespace</th><th>session</th><th>tool</th><th>waits for</th><th>why</th><th></th></tr>");
        for c in &items {
            let ns = c.namespace().unwrap_or_default();
            let s = c.status.clone().unwrap_or_default();
            let waits = wait_name(s.waiting_for);
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><a class=open href=\"/call?ns={}&amp;token={}\">{}</a></td></tr>",
                escape(&ns),
                escape(&c.spec.session),
                escape(&c.spec.tool_call.name),
                escape(waits),
                escape(s.reason.as_deref().unwrap_or("")),
                url(&ns),
                url(&c.name_any()),
                escape(&c.name_any()),
            );
        }
        body.push_str("</table>");
        page(StatusCode::OK, "Waiting calls", &body)
    }

    async fn call(&self, ns: &str, token: &str) -> Page {
        let api: Api<Continuation> = Api::namespaced(self.client.clone(), ns);
        let c = match api.get(token).await {
            Ok(c) => c,
            Err(e) => return error_page(StatusCode::BAD_GATEWAY, &api_message(&e)),
        };
        let status = c.status.clone().unwrap_or_default();
        let waits = wait_name(status.waiting_for);
        let args = pretty(&c.spec.tool_call.arguments.to_string());
        let mut body = format!(
            "<p>Session <b>{}</b> in <b>{}</b> calls <b id=tool>{}</b>{}.</p><h2>Arguments</h2><pre id=arguments>{}</pre>",
            escape(&c.spec.session),
            escape(ns),
            escape(&c.spec.tool_call.name),
            status.reason.as_deref().map(|r| format!(" ({})", escape(r))).unwrap_or_default(),
            escape(&args),
        );
        if !status.decisions.is_empty() {
            body.push_str("<h2>Votes so far</h2><ul>");
            for d in &status.decisions {
                let verb = if d.approved { "approved" } else { "denied" };
                let _ = write!(body, "<li>{} {verb}</li>", escape(&d.by));
            }
            body.push_str("</ul>");
        }
        body.push_str(&self.forms(ns, token, waits, &c, &args));
        body.push_str("<h2>The conversation before it</h2>");
        body.push_str(&self.conversation(ns, &c.spec.session).await);
        page(StatusCode::OK, &format!("Call {token}"), &body)
    }

    fn forms(&self, ns: &str, token: &str, waits: &str, c: &Continuation, args: &str) -> String {
        let hidden = format!(
            "<input type=hidden name=csrf value=\"{}\"><input type=hidden name=ns value=\"{}\"><input type=hidden name=token value=\"{}\">",
            escape(&self.csrf),
            escape(ns),
            escape(token)
        );
        if waits == "external" {
            return format!(
                "<h2>Complete</h2><form method=post action=/decide>{hidden}<input type=hidden name=action value=complete>\
                 <textarea name=text rows=4 cols=80></textarea><br><button id=complete>Complete with this text</button></form>"
            );
        }
        let edit = c
            .spec
            .policy
            .decorators
            .approval_policy
            .as_ref()
            .and_then(|p| p.allow_edit.then_some(()))
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

    async fn conversation(&self, ns: &str, session: &str) -> String {
        let store = KubeStore::new(self.client.clone(), ns);
        let record = match store.load(&SessionId(session.to_string())).await {
            Ok(Some(r)) => r.value,
            Ok(None) => return "<p>(the session is gone)</p>".into(),
            Err(e) => return format!("<p class=error>{}</p>", escape(&e.to_string())),
        };
        let mut out = String::from("<div id=conversation>");
        for turn in &record.state.turns {
            match turn {
                Turn::User(u) => {
                    if let Some(m) = &u.message {
                        let _ = write!(out, "<p><b>user:</b> {}</p>", escape(&clip(m)));
                    }
                    for r in &u.tool_results {
                        let _ = write!(
                            out,
                            "<p><b>{} returned:</b> {}</p>",
                            escape(&r.tool),
                            escape(&clip(&r.result.to_model_text()))
                        );
                    }
                }
                Turn::Agent(a) => {
                    if let Some(t) = &a.text {
                        let _ = write!(out, "<p><b>agent:</b> {}</p>", escape(&clip(t)));
                    }
                    for call in &a.tool_calls {
                        let _ = write!(
                            out,
                            "<p><b>agent calls {}</b> <code>{}</code></p>",
                            escape(&call.name),
                            escape(&clip(&call.arguments))
                        );
                    }
                }
            }
        }
        out.push_str("</div>");
        out
    }

    async fn act(&self, form: &[(String, String)]) -> Page {
        if field(form, "csrf") != self.csrf {
            return error_page(
                StatusCode::FORBIDDEN,
                "this form is stale or not from this page (CSRF token); reload the page",
            );
        }
        let (ns, token) = (field(form, "ns"), field(form, "token"));
        let store = KubeStore::new(self.client.clone(), &ns);
        let token = ContinuationToken(token);
        let now = crate::ports::Clock::now(&crate::ports::SystemClock);
        let written = match field(form, "action").as_str() {
            "approve" | "deny" => {
                let approved = field(form, "action") == "approve";
                let arguments = Some(field(form, "arguments")).filter(|a| !a.trim().is_empty());
                let reason = Some(field(form, "reason")).filter(|r| !r.trim().is_empty());
                let decision = Decision {
                    approved,
                    by: self.me.clone(),
                    reason,
                    at: now,
                    arguments,
                };
                store.decide(&token, &decision).await
            }
            "complete" => {
                let result = ToolResult::text(field(form, "text"));
                store.complete(&token, &result, &self.me, now).await
            }
            other => {
                return error_page(
                    StatusCode::BAD_REQUEST,
                    &format!("unknown action {other:?}"),
                )
            }
        };
        match written {
            Ok(WriteOnce::Recorded) | Ok(WriteOnce::AlreadySame { .. }) => Response::builder()
                .status(StatusCode::SEE_OTHER)
                .header(LOCATION, "/")
                .body(Full::new(Bytes::new()))
                .expect("a valid response"),
            Ok(WriteOnce::AlreadyDifferent { by, .. }) => error_page(
                StatusCode::CONFLICT,
                &format!("{token} was already decided or completed by {by}"),
            ),
            Err(e) => error_page(StatusCode::FORBIDDEN, &e.to_string()),
        }
    }
}

async fn read_form(req: Request<Incoming>) -> Result<Vec<(String, String)>, String> {
    let body = Limited::new(req.into_body(), MAX_FORM_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the form: {e}"))?
        .to_bytes();
    Ok(form_urlencoded::parse(&body).into_owned().collect())
}

/// What a call waits for, as the CRD spells it.
fn wait_name(w: Option<WaitingForName>) -> &'static str {
    match w {
        Some(WaitingForName::Approval) => "approval",
        Some(WaitingForName::Background) => "background",
        Some(WaitingForName::Isolated) => "isolated",
        Some(WaitingForName::External) => "external",
        Some(WaitingForName::McpTask) => "mcpTask",
        Some(WaitingForName::Outcome) => "outcome",
        None => "",
    }
}

fn field(pairs: &[(String, String)], name: &str) -> String {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("the API server refused: {}", s.message),
        other => other.to_string(),
    }
}

fn pretty(json_text: &str) -> String {
    let inner = serde_json::from_str::<serde_json::Value>(json_text)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| json_text.to_string());
    serde_json::from_str::<serde_json::Value>(&inner)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or(inner)
}

fn clip(s: &str) -> String {
    if s.len() <= SHOWN_BYTES {
        return s.to_string();
    }
    let mut end = SHOWN_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}

fn url(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// HTML text and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(
            escape(r#"<script>"x" & 'y'</script>"#),
            "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/script&gt;"
        );
    }

    #[test]
    fn long_text_is_clipped_at_a_character() {
        let s = "é".repeat(3000);
        let c = clip(&s);
        assert!(c.len() < 2100 && c.ends_with("(6000 bytes)"), "{c}");
    }

    #[test]
    fn a_non_loopback_address_is_refused() {
        let err = super::super::run_cmd::block_on(serve(UiArgs {
            addr: "0.0.0.0:0".parse().unwrap(),
            namespace: None,
        }))
        .unwrap_err();
        assert!(err.to_string().contains("loopback only"), "{err}");
    }
}
