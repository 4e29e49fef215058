use super::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, Patch, PatchParams};

fn seen(method: Method, uri: &str) -> (&'static str, String) {
    let r = ApiRequest::of(&method, &uri.parse().unwrap());
    (r.verb, r.resource)
}

#[test]
fn requests_are_named_as_the_api_server_names_them() {
    let crd = "/apis/agents-exe.io/v1/namespaces/ns";
    let cases = [
        (Method::GET, format!("{crd}/sessions/s1"), "get", "sessions"),
        (
            Method::GET,
            format!("{crd}/continuations?labelSelector=agents-exe.io%2Fsession%3Ds1"),
            "list",
            "continuations",
        ),
        (
            Method::GET,
            format!("{crd}/continuations?&watch=true&timeoutSeconds=240"),
            "watch",
            "continuations",
        ),
        (
            Method::GET,
            "/apis/agents-exe.io/v1/sessions?watch=1".into(),
            "watch",
            "sessions",
        ),
        (
            Method::PATCH,
            format!("{crd}/sessions/s1/status?"),
            "patch",
            "sessions/status",
        ),
        (
            Method::POST,
            format!("{crd}/continuations?"),
            "create",
            "continuations",
        ),
        (
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/ns/events".into(),
            "create",
            "events",
        ),
        (
            Method::GET,
            "/api/v1/namespaces/ns/pods/p/log?container=tool".into(),
            "get",
            "pods/log",
        ),
        (
            Method::DELETE,
            format!("{crd}/sessions/s1"),
            "delete",
            "sessions",
        ),
        (
            Method::DELETE,
            format!("{crd}/sessions"),
            "deletecollection",
            "sessions",
        ),
        (
            Method::PUT,
            "/api/v1/namespaces/ns".into(),
            "update",
            "namespaces",
        ),
        (
            Method::GET,
            "/api/v1/namespaces".into(),
            "list",
            "namespaces",
        ),
        (Method::GET, "/apis/agents-exe.io/v1".into(), "list", "-"),
        (Method::GET, "/version".into(), "list", "-"),
    ];
    for (method, uri, verb, resource) in cases {
        assert_eq!(seen(method, &uri), (verb, resource.to_string()), "{uri}");
    }
}

/// An API server in a function: every GET of a name answers a ConfigMap,
/// every other GET an empty list, every write the ConfigMap.
#[derive(Clone)]
struct FakeServer;

impl Service<hyper::Request<Body>> for FakeServer {
    type Response = hyper::Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: hyper::Request<Body>) -> Self::Future {
        let object = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ns", "resourceVersion": "1"},
        });
        let seen = ApiRequest::of(request.method(), request.uri());
        let body = match seen.verb {
            "list" => serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMapList", "metadata": {}, "items": [object],
            }),
            _ => object,
        };
        let body = Body::from(serde_json::to_vec(&body).unwrap());
        std::future::ready(Ok(hyper::Response::new(body)))
    }
}

#[tokio::test]
async fn every_request_is_counted_and_a_tally_keeps_one_reconciles_in_order() {
    let metrics = Arc::new(Metrics::new());
    let shared = kube::client::ClientBuilder::new(FakeServer, "ns")
        .with_layer(&CountLayer(metrics.clone()))
        .build();
    let tally = Tally::default();
    let maps: Api<ConfigMap> = Api::namespaced(tally.client(&shared), "ns");
    maps.get_opt("c").await.unwrap().expect("found");
    maps.list(&ListParams::default()).await.unwrap();
    let patch = serde_json::json!({"data": {"k": "v"}});
    maps.patch("c", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    maps.get("c").await.unwrap();
    let verbs: Vec<&str> = tally.requests().iter().map(|r| r.verb).collect();
    assert_eq!(verbs, ["get", "list", "patch", "get"]);
    assert_eq!(tally.before_first_write(), 2);
    // A request beside the tally's client is counted, not tallied.
    let other: Api<ConfigMap> = Api::namespaced(shared, "ns");
    other.get("c").await.unwrap();
    assert_eq!(tally.requests().len(), 4);
    let text = metrics.encode();
    for line in [
        r#"agents_api_requests_total{verb="get",resource="configmaps"} 3"#,
        r#"agents_api_requests_total{verb="list",resource="configmaps"} 1"#,
        r#"agents_api_requests_total{verb="patch",resource="configmaps"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in:\n{text}");
    }
}

#[test]
fn a_tally_without_a_write_counts_every_request() {
    let tally = Tally::default();
    let get = ApiRequest {
        verb: "get",
        resource: "sessions".into(),
    };
    tally.0.lock().unwrap().extend([get.clone(), get]);
    assert_eq!(tally.before_first_write(), 2);
}

#[test]
fn wakes_are_measured_in_whole_requests() {
    let metrics = Metrics::new();
    metrics.wake_requests_before_write(1);
    metrics.wake_requests_before_write(2);
    let text = metrics.encode();
    assert!(
        text.contains(r#"agents_wake_requests_before_write_bucket{le="1.0"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("agents_wake_requests_before_write_count 2"),
        "{text}"
    );
}
