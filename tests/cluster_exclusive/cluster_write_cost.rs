//! What one write of each kind costs kube-apiserver in CPU, measured on
//! Sessions that carry a real operator status (`tests/fixtures/
//! session-status-repeats.json`), with a watch open on them as the
//! operator keeps one: the operator's status write (a merge patch of the
//! whole status under a resourceVersion precondition), the same status as
//! a PUT of the status subresource, the smallest status as a PUT (the
//! floor under any status write), the raw bound's 4 KB condition patch,
//! a Session create and an Event create. Prints ms of CPU per write and
//! the ratio to the raw patch measured in the same run.
//!
//! `cargo test --test cluster_exclusive cluster_write_cost:: -- --ignored --nocapture`

use crate::support::{self, TestNamespace};
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{json, Value};
use std::time::Instant;

const OBJECTS: usize = 16;
const WRITES: usize = 1600;

fn apiserver_cpu() -> f64 {
    let pid = std::fs::read_to_string("/var/lib/agents-test-cluster/pids/kube-apiserver.pid")
        .unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    let after = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}

/// The fixture's status with the five conditions the operator writes
/// beside it (the fixture holds the stored state only), so each write
/// carries every field a finished session's status has.
fn status_fixture() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/session-status-repeats.json"
    ))
    .unwrap();
    let mut status: Value = serde_json::from_str(&text).unwrap();
    status["conditions"] = json!([
        {"lastTransitionTime": "2026-01-01T00:00:00Z", "message": "the model gave its final answer", "observedGeneration": 1, "reason": "Answered", "status": "True", "type": "Succeeded"},
        {"lastTransitionTime": "2026-01-01T00:00:00Z", "message": "", "observedGeneration": 1, "reason": "NotFailed", "status": "False", "type": "Failed"},
        {"lastTransitionTime": "2026-01-01T00:00:00Z", "message": "", "observedGeneration": 1, "reason": "NotWaiting", "status": "False", "type": "Waiting"},
        {"lastTransitionTime": "2026-01-01T00:00:00Z", "message": "", "observedGeneration": 1, "reason": "NotPaused", "status": "False", "type": "Paused"},
        {"lastTransitionTime": "2026-01-01T00:00:00Z", "message": "agent flow resolved and valid", "observedGeneration": 1, "reason": "AgentResolved", "status": "True", "type": "Ready"}
    ]);
    status
}

/// A status that differs from the last one written to object `i` at `n`.
fn status_at(base: &Value, n: usize) -> Value {
    let mut s = base.clone();
    s["tokens"] = json!(500 + n);
    s
}

/// Runs `per_object` writes on each of the `OBJECTS` objects at once;
/// returns kube-apiserver's CPU ms per write.
async fn timed<F, Fut>(what: &str, per_object: usize, write: F) -> f64
where
    F: Fn(usize, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let cpu = apiserver_cpu();
    let started = Instant::now();
    let tasks = (0..OBJECTS).map(|i| {
        let write = write.clone();
        tokio::spawn(async move {
            for n in 0..per_object {
                write(i, n).await;
            }
        })
    });
    for t in futures::future::join_all(tasks).await {
        t.unwrap();
    }
    let writes = (per_object * OBJECTS) as f64;
    let ms = (apiserver_cpu() - cpu) * 1000.0 / writes;
    println!(
        "bench: {what}: {ms:.2} ms kube-apiserver CPU a write, {:.0} writes/s",
        writes / started.elapsed().as_secs_f64()
    );
    ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a minute of load on the test cluster; run by hand (see the module doc)"]
async fn what_each_write_costs_the_api_server() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "write-cost").await;
    let sessions: Api<agents::api::Session> = Api::namespaced(client.clone(), &ns.name);
    let watched = sessions.clone();
    let watch = tokio::spawn(async move {
        let mut events = watcher(watched, watcher::Config::default()).boxed();
        while events.next().await.is_some() {}
    });
    let base = status_fixture();
    let session = |name: String| -> agents::api::Session {
        serde_json::from_value(json!({
            "apiVersion": "agents-exe.io/v1alpha1", "kind": "Session",
            "metadata": {"name": name},
            "spec": {"messages": ["what is the weather in Oslo and Lima?"], "agentRef": {"name": "none"}},
        }))
        .unwrap()
    };
    let api = sessions.clone();
    let create = timed("Session create", WRITES / OBJECTS, move |i, n| {
        let api = api.clone();
        let s = session(format!("c{i}-{n}"));
        async move {
            api.create(&PostParams::default(), &s).await.unwrap();
        }
    })
    .await;
    for i in 0..OBJECTS {
        sessions
            .create(&PostParams::default(), &session(format!("w{i}")))
            .await
            .unwrap();
    }
    let raw_api = sessions.clone();
    let raw = timed("raw 4 KB condition patch", WRITES / OBJECTS, move |i, n| {
        let api = raw_api.clone();
        async move {
            let body = json!({"status": {"conditions": [{
                "type": "Succeeded", "status": "Unknown", "reason": "InProgress",
                "message": format!("{n:06} {}", "x".repeat(4000)),
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
            api.patch_status(
                &format!("w{i}"),
                &PatchParams::default(),
                &Patch::Merge(&body),
            )
            .await
            .unwrap();
        }
    })
    .await;
    let patch_api = sessions.clone();
    let b = base.clone();
    let merge = timed(
        "status merge patch, resourceVersion precondition",
        WRITES / OBJECTS,
        move |i, n| {
            let api = patch_api.clone();
            let status = status_at(&b, n);
            async move {
                let name = format!("w{i}");
                let rv = api
                    .get_status(&name)
                    .await
                    .unwrap()
                    .metadata
                    .resource_version;
                let body = json!({"metadata": {"resourceVersion": rv}, "status": status});
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
                    .await
                    .unwrap();
            }
        },
    )
    .await;
    let put_api = sessions.clone();
    let b = base.clone();
    let put = timed(
        "status PUT, resourceVersion precondition",
        WRITES / OBJECTS,
        move |i, n| {
            let api = put_api.clone();
            let status = status_at(&b, n + WRITES);
            async move {
                let name = format!("w{i}");
                let mut obj = api.get_status(&name).await.unwrap();
                obj.metadata.managed_fields = None;
                let mut value = serde_json::to_value(&obj).unwrap();
                value["status"] = status;
                let obj: agents::api::Session = serde_json::from_value(value).unwrap();
                api.replace_status(&name, &PostParams::default(), &obj)
                    .await
                    .unwrap();
            }
        },
    )
    .await;
    let min_api = sessions.clone();
    let b = base.clone();
    let ns_name = ns.name.clone();
    let put_min = timed(
        "status PUT of metadata name and resourceVersion and the status only",
        WRITES / OBJECTS,
        move |i, n| {
            put_status_only(
                min_api.clone(),
                ns_name.clone(),
                i,
                status_at(&b, n + 2 * WRITES),
            )
        },
    )
    .await;
    // The floor under any status write: a status of two fields (one
    // changed each time, else the API server skips the write).
    let least_api = sessions.clone();
    let ns_name = ns.name.clone();
    let put_least = timed(
        "status PUT of the smallest status (phase and a counter)",
        WRITES / OBJECTS,
        move |i, n| {
            let status = json!({"phase": "Running", "tokens": 3 * WRITES + n});
            put_status_only(least_api.clone(), ns_name.clone(), i, status)
        },
    )
    .await;
    let after = sessions.get("w0").await.unwrap();
    println!(
        "managedFields after: {}\nspec after: {}",
        serde_json::to_string(&after.metadata.managed_fields).unwrap(),
        serde_json::to_string(&after.spec).unwrap()
    );
    let get_api = sessions.clone();
    let get = timed(
        "GET (subtracted from the two above)",
        WRITES / OBJECTS,
        move |i, _| {
            let api = get_api.clone();
            async move {
                api.get_status(&format!("w{i}")).await.unwrap();
            }
        },
    )
    .await;
    println!(
        "bench: per write in raw patches: create {:.2}, merge patch {:.2}, PUT {:.2}, PUT of status only {:.2} (GET {:.2} taken off each)",
        create / raw,
        (merge - get) / raw,
        (put - get) / raw,
        (put_min - get) / raw,
        get / raw
    );
    // A flow session (two model turns, two tool calls) needs a create and
    // four status writes: each commits a claim or a result before the
    // work that depends on it (DESIGN.md, exactly once).
    println!(
        "bench: the smallest status PUT {:.2} raw patches; a create and four status writes cost at least {:.2} raw patches (the floor of a flow session)",
        (put_least - get) / raw,
        (create + 4.0 * (put_least - get)) / raw
    );
    watch.abort();
    ns.delete(&client).await;
}

/// PUTs `status` to object `i` with only the metadata a PUT needs (name,
/// namespace, the resourceVersion just read) beside it.
async fn put_status_only(api: Api<agents::api::Session>, ns: String, i: usize, status: Value) {
    let name = format!("w{i}");
    let rv = api
        .get_status(&name)
        .await
        .unwrap()
        .metadata
        .resource_version;
    let obj: agents::api::Session = serde_json::from_value(json!({
        "apiVersion": "agents-exe.io/v1alpha1", "kind": "Session",
        "metadata": {"name": name, "namespace": ns, "resourceVersion": rv},
        "spec": {"messages": [], "agentRef": {"name": "x"}},
        "status": status,
    }))
    .unwrap();
    api.replace_status(&name, &PostParams::default(), &obj)
        .await
        .unwrap();
}
