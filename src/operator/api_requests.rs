//! The operator's API requests, counted by verb and resource as the API
//! server names them (`get`, `list`, `watch`, `create`, `patch`, ...;
//! `sessions`, `sessions/status`, `continuations`, `pods/log`), without the
//! API server's own metrics: those count every client of the cluster.
//!
//! - [`CountLayer`] wraps the operator's clients and counts every request
//!   (each attempt of a retried one) into `agents_api_requests_total`;
//! - [`Tally`] keeps the requests of one reconcile in order, through a
//!   client of its own over the shared one, so a reconcile knows what it
//!   asked before its first write.

use crate::observe::Metrics;
use futures::future::BoxFuture;
use hyper::{Method, Uri};
use kube::client::Body;
use kube::Client;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tower::{Layer, Service};

/// One API request, in the API server's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiRequest {
    pub verb: &'static str,
    /// The resource, with its subresource (`sessions/status`); `-` for a
    /// path that names none (discovery, `/version`).
    pub resource: String,
}

impl ApiRequest {
    /// What `method` on `uri` is.
    pub fn of(method: &Method, uri: &Uri) -> ApiRequest {
        let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
        let rest = match segments.as_slice() {
            ["api", _version, rest @ ..] | ["apis", _, _version, rest @ ..] => rest,
            _ => &[],
        };
        let rest = match rest {
            ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
            other => other,
        };
        let (resource, named) = match rest {
            [] => ("-".to_string(), false),
            [resource] => (resource.to_string(), false),
            [resource, _name] => (resource.to_string(), true),
            [resource, _name, sub, ..] => (format!("{resource}/{sub}"), true),
        };
        let watch = uri
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
        let verb = match *method {
            Method::GET if watch => "watch",
            Method::GET if named => "get",
            Method::GET => "list",
            Method::POST => "create",
            Method::PUT => "update",
            Method::PATCH => "patch",
            Method::DELETE if named => "delete",
            Method::DELETE => "deletecollection",
            _ => "other",
        };
        ApiRequest { verb, resource }
    }

    /// A request that changes something stored.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb,
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }
}

/// Counts every request of the client it wraps into
/// `agents_api_requests_total{verb,resource}`.
#[derive(Clone)]
pub struct CountLayer(pub Arc<Metrics>);

impl<S> Layer<S> for CountLayer {
    type Service = Counted<S>;
    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// A service whose requests are counted (see [`CountLayer`]).
#[derive(Clone)]
pub struct Counted<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B> Service<hyper::Request<B>> for Counted<S>
where
    S: Service<hyper::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: hyper::Request<B>) -> Self::Future {
        let seen = ApiRequest::of(request.method(), request.uri());
        self.metrics.api_request(seen.verb, &seen.resource);
        self.inner.call(request)
    }
}

/// The requests of one reconcile, in the order they were sent.
#[derive(Clone, Debug, Default)]
pub struct Tally(Arc<Mutex<Vec<ApiRequest>>>);

impl Tally {
    /// A client that notes each request here and sends it through `over`
    /// (its connections, pace, retries and counting).
    pub fn client(&self, over: &Client) -> Client {
        let tallied = Tallied {
            tally: self.clone(),
            inner: over.clone(),
        };
        Client::new(tallied, over.default_namespace())
    }

    /// The requests so far.
    pub fn requests(&self) -> Vec<ApiRequest> {
        self.0.lock().expect("tally lock").clone()
    }

    /// Requests sent before the first write (all of them when none wrote).
    pub fn before_first_write(&self) -> usize {
        let requests = self.0.lock().expect("tally lock");
        requests.iter().take_while(|r| !r.is_write()).count()
    }
}

/// The service under a [`Tally`]'s client.
struct Tallied {
    tally: Tally,
    inner: Client,
}

impl Service<hyper::Request<Body>> for Tallied {
    type Response = hyper::Response<Body>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The shared client waits for room itself, in `send`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: hyper::Request<Body>) -> Self::Future {
        let seen = ApiRequest::of(request.method(), request.uri());
        self.tally.0.lock().expect("tally lock").push(seen);
        let inner = self.inner.clone();
        Box::pin(async move { inner.send(request).await })
    }
}

#[cfg(test)]
mod tests;
