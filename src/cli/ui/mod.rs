//! `agents ui` (`kubectl agents ui` when installed as `kubectl-agents`): a
//! console on loopback for sessions and the calls waiting for people.
//!
//! - `/`: the waiting calls (approvals, outside results, MCP tasks asking
//!   for input), with age, quorum progress and an arguments preview;
//!   `/call` decides, completes or answers one ([`approvals`]).
//! - `/sessions`: every session, filtered and paged through the API
//!   ([`sessions`]); `/session`: one session's timeline, a chart of its
//!   calls' states, its Jobs, Events and lineage ([`session_page`]).
//!
//! It acts with the user's own kubeconfig, so the API server (RBAC and the
//! approvals policy) decides what they may do; its refusals are shown on
//! the page. Like `kubectl proxy` it binds to loopback only. Every form
//! carries a token made at start (CSRF), and requests must name a loopback
//! host (against DNS rebinding). Rendered on the server, with no script;
//! the Content-Security-Policy allows none ([`html::CSP`]).

mod approvals;
mod html;
mod paging;
mod session_page;
mod sessions;
mod svg;
mod timeline;

use crate::store::kube::KubeStore;
use anyhow::{bail, Context};
use html::{error_page, field, read_form, Page};
use hyper::body::Incoming;
use hyper::header::HOST;
use hyper::service::service_fn;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kube::Client;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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
        "serving the console for {} on http://127.0.0.1:{port}/",
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
            (Method::GET, "/") => self.waiting_list(&query).await,
            (Method::GET, "/call") => {
                let (ns, token) = (field(&query, "ns"), field(&query, "token"));
                self.call(&ns, &token).await
            }
            (Method::GET, "/sessions") => self.sessions(&query).await,
            (Method::GET, "/session") => {
                let (ns, name) = (field(&query, "ns"), field(&query, "name"));
                self.session(&ns, &name).await
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

    /// The namespace a page reads: `-n` when given, else the one asked
    /// for, else "" (every namespace the user may list).
    fn namespace_for(&self, asked: &str) -> String {
        match &self.only {
            Some(ns) => ns.clone(),
            None => asked.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query string's pairs, as the server hands them to a page.
    pub(super) fn q(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
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
