//! A hostile tenant on a shared operator (issue 18): results written wrong
//! on purpose fail only their call, and the session carries on.
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::{Continuation, Session};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use sha2::Digest;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::{Response, Server};
use support::{apply, wait_until, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

const THREE_ASKS: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: asks}
spec:
  messages: ["ask three people"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {name: ask, arguments: {who: a}}
              - {name: ask, arguments: {who: b}}
              - {name: ask, arguments: {who: c}}
          - text: heard from all three
    tools:
      - {name: ask, builtin: {function: echo}}
    policy:
      rules:
        - {tool: ask, disposition: defer}
"#;

fn outcome(result: Value) -> Value {
    json!({"status": {"state": "Completed", "outcome": {
        "result": result,
        "completedBy": "mallory",
        "completedAt": "2025-01-01T00:00:00Z",
    }}})
}

/// Three deferred calls completed badly: a made-up spill marker listing
/// hundreds of blobs, a response that is no tool response, and a 1 MiB
/// error message. Each call fails with an error saying what was wrong;
/// the session succeeds and stays small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_results_fail_only_their_call() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-bad").await;
    apply(&ns.name, THREE_ASKS);
    let _op = support::launcher::Operator::start(
        BIN,
        "tenant-bad",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    wait_until(Duration::from_secs(60), "three waiting calls", || async {
        let list = conts.list(&Default::default()).await.ok()?;
        (list.items.len() == 3).then_some(())
    })
    .await;
    let blobs: Vec<String> = (0..500).map(|i| format!("asks-r-{i:016}")).collect();
    let forged = json!({"status": "success", "response": {"spilled": {
        "blobs": blobs, "sha256": "0".repeat(64)}}});
    let bogus = json!({"status": "success", "response": {"type": "hologram"}});
    let huge = json!({"status": "error", "message": "x".repeat(1 << 20)});
    let pp = PatchParams::default();
    for (token, result) in [
        ("asks-t1-c0", forged),
        ("asks-t1-c1", bogus),
        ("asks-t1-c2", huge),
    ] {
        conts
            .patch_status(token, &pp, &Patch::Merge(&outcome(result)))
            .await
            .unwrap_or_else(|e| panic!("{token}: {e}"));
    }
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let done = wait_until(
        Duration::from_secs(90),
        "the session to succeed",
        || async {
            let s = sessions.get("asks").await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Succeeded").then_some(st)
        },
    )
    .await;
    let results = &done["state"]["turns"][2]["toolResults"];
    let message = |i: usize| {
        results[i]["result"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    assert!(
        message(0).starts_with("the result written by mallory was malformed")
            && message(0).contains("lists 500 blobs"),
        "{}",
        message(0)
    );
    assert!(
        message(1).starts_with("the result written by mallory was malformed"),
        "{}",
        message(1)
    );
    assert!(message(2).len() < 9 * 1024, "{} bytes", message(2).len());
    assert!(
        message(2).contains("[truncated: showing 8192 of"),
        "{}",
        &message(2)[8000..]
    );
    assert_eq!(done["answer"], "heard from all three");
    ns.delete(&client).await;
}

/// A spill marker may name only blobs of its own session: a valid blob
/// owned by another session (here one the tenant made to look like it) is
/// refused, and the call fails saying whose it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_cannot_pull_in_another_sessions_blob() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use std::io::Write;
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-blob").await;
    apply(&ns.name, THREE_ASKS);
    let other = THREE_ASKS.replace("name: asks}", "name: other}");
    apply(&ns.name, &other);
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let other_uid = sessions.get("other").await.unwrap().metadata.uid.unwrap();
    // A valid blob, as the store writes them, owned by the other session.
    let secret = serde_json::to_vec(&json!({"type": "text", "content": "other's secret"})).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&secret).unwrap();
    let packed = gz.finish().unwrap();
    let sha: String = sha2::Sha256::digest(&secret)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "other-blob", "ownerReferences": [{
            "apiVersion": "agents-exe.io/v1alpha1", "kind": "Session",
            "name": "other", "uid": other_uid}]},
    }))
    .unwrap();
    cm.binary_data = Some([("data.gz".to_string(), k8s_openapi::ByteString(packed))].into());
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    cms.create(&Default::default(), &cm).await.unwrap();
    let _op = support::launcher::Operator::start(
        BIN,
        "tenant-blob",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    wait_until(Duration::from_secs(60), "waiting calls", || async {
        let list = conts.list(&Default::default()).await.ok()?;
        (list.items.len() == 6).then_some(())
    })
    .await;
    let marker = json!({"status": "success", "response": {"spilled": {
        "blobs": ["other-blob"], "sha256": sha, "bytes": secret.len()}}});
    let plain = json!({"status": "success", "response": {"type": "text", "content": "ok"}});
    let pp = PatchParams::default();
    for (token, result) in [
        ("asks-t1-c0", marker),
        ("asks-t1-c1", plain.clone()),
        ("asks-t1-c2", plain),
    ] {
        conts
            .patch_status(token, &pp, &Patch::Merge(&outcome(result)))
            .await
            .unwrap_or_else(|e| panic!("{token}: {e}"));
    }
    let done = wait_until(
        Duration::from_secs(90),
        "the session to succeed",
        || async {
            let s = sessions.get("asks").await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Succeeded").then_some(st)
        },
    )
    .await;
    let first = done["state"]["turns"][2]["toolResults"][0]["result"].clone();
    let text = first.to_string();
    assert!(!text.contains("other's secret"), "{text}");
    assert!(
        first["message"]
            .as_str()
            .is_some_and(|m| m.contains("is not this session's")),
        "{text}"
    );
    ns.delete(&client).await;
}

/// `pause`, `resume` and `retry` edit the spec only over the version they
/// read: a stale edit is refused as a conflict, and the admin port re-reads
/// and keeps what changed meanwhile.
#[tokio::test]
async fn spec_edits_carry_the_version_they_read() {
    use agents::core::SessionId;
    use agents::ports::{AdminPort, StoreError, Version};
    use agents::store::kube::KubeStore;
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-edit").await;
    apply(&ns.name, THREE_ASKS);
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let read = sessions.get("asks").await.unwrap();
    let stale = Version(read.metadata.resource_version.clone().unwrap());
    // Someone else edits the spec after our read.
    sessions
        .patch(
            "asks",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"messages": ["ask three people", "and hurry"]}})),
        )
        .await
        .unwrap();
    let store = KubeStore::new(client.clone(), &ns.name);
    let id = SessionId("asks".into());
    let refused = store
        .patch_spec(&id, &stale, json!({"paused": true}))
        .await
        .unwrap_err();
    assert!(matches!(refused, StoreError::Conflict { .. }), "{refused}");
    store.change_input(&id, &|i| i.paused = true).await.unwrap();
    let now = sessions.get("asks").await.unwrap();
    assert!(now.spec.paused);
    assert_eq!(now.spec.messages.len(), 2, "the other edit is kept");
    ns.delete(&client).await;
}

/// Serves one 1 GiB reply per request, with no `Content-Length` (it ends
/// when the connection does), the bytes made as they are sent, until the
/// client hangs up.
fn gigabyte_server() -> (u16, Arc<AtomicU64>) {
    let sent = Arc::new(AtomicU64::new(0));
    let counted = sent.clone();
    let server = Server::start(move |_| {
        let counted = counted.clone();
        Response::stream(200, false, move |out| {
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..(1 << 14) {
                out.write_all(&chunk)?;
                counted.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            Ok(())
        })
        .header("Content-Type", "text/plain")
    });
    (server.port, sent)
}

fn peak_rss_mib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb / 1024
}

/// One tenant's http tool answers with 1 GiB: that call fails with an
/// error saying what was cut, the operator stays far under the chart's
/// 256 MiB limit (its peak RSS is measured), and another namespace's
/// session finishes as if nothing happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gigabyte_reply_fails_its_call_and_no_one_elses_work() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let hostile = TestNamespace::create(&client, "tenant-huge").await;
    let neighbour = TestNamespace::create(&client, "tenant-calm").await;
    let (port, sent) = gigabyte_server();
    apply(
        &hostile.name,
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: flood}}
spec:
  messages: ["fetch it all"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{{name: dump, arguments: {{}}}}]
          - text: that was too much
    tools:
      - name: dump
        http: {{url: "http://127.0.0.1:{port}/dump"}}
"#
        ),
    );
    apply(
        &neighbour.name,
        THREE_ASKS.replace("defer", "runSync").as_str(),
    );
    let op = support::launcher::Operator::start(
        BIN,
        "tenant-huge",
        &support::kubeconfig_path().unwrap(),
        &["-n", &hostile.name, "-n", &neighbour.name],
        &[],
    );
    let done = |ns: String, name: &'static str| {
        let api: Api<Session> = Api::namespaced(client.clone(), &ns);
        async move {
            wait_until(Duration::from_secs(120), name, || async {
                let s = api.get(name).await.ok()?;
                let st = serde_json::to_value(s.status.as_ref()?).ok()?;
                (st["phase"] == "Succeeded").then_some(st)
            })
            .await
        }
    };
    let flood = done(hostile.name.clone(), "flood").await;
    let calm = done(neighbour.name.clone(), "asks").await;
    let peak = peak_rss_mib(op.pid());
    let message = flood["state"]["turns"][2]["toolResults"][0]["result"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let streamed = sent.load(Ordering::Relaxed) >> 20;
    eprintln!("operator peak RSS {peak} MiB; the server got {streamed} MiB out before the operator hung up");
    assert!(message.contains("bytes"), "{message}");
    assert_eq!(calm["answer"], "heard from all three");
    assert!(peak < 200, "operator peak RSS {peak} MiB");
    assert!(streamed < 512, "the reply was read whole: {streamed} MiB");
    hostile.delete(&client).await;
    neighbour.delete(&client).await;
}

/// A finished session goes `ttlSecondsAfterFinished` after it finished;
/// one that sets none follows the operator's default (here 10 minutes:
/// still there); and the deletion takes its Continuations with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_sessions_go_after_their_ttl() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-ttl").await;
    let short = THREE_ASKS.replace(
        "name: asks}",
        "name: short}\nspec:\n  ttlSecondsAfterFinished: 3",
    );
    let short = short.replacen("spec:\n  messages", "  messages", 1);
    apply(&ns.name, &short);
    apply(&ns.name, &THREE_ASKS.replace("defer", "runSync"));
    let op = support::launcher::Operator::start(
        BIN,
        "tenant-ttl",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name, "--finished-session-ttl-seconds", "600"],
        &[],
    );
    let conts: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    wait_until(
        Duration::from_secs(60),
        "short's three waiting calls",
        || async {
            let list = conts.list(&Default::default()).await.ok()?;
            (list.items.len() == 3).then_some(())
        },
    )
    .await;
    let done = json!({"status": "success", "response": {"type": "text", "content": "yes"}});
    for i in 0..3 {
        let mut body = outcome(done.clone());
        body["status"]["outcome"]["completedBy"] = json!("ann");
        conts
            .patch_status(
                &format!("short-t1-c{i}"),
                &PatchParams::default(),
                &Patch::Merge(&body),
            )
            .await
            .unwrap();
    }
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    wait_until(
        Duration::from_secs(60),
        "short to finish and go",
        || async {
            sessions
                .get_opt("short")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    wait_until(
        Duration::from_secs(60),
        "its Continuations to go with it",
        || async {
            let list = conts.list(&Default::default()).await.ok()?;
            list.items.is_empty().then_some(())
        },
    )
    .await;
    // It finished too (its calls ran at once), and stays: polled, as a
    // loaded operator may take it after the short one.
    let started = std::time::Instant::now();
    let phase = loop {
        let kept = sessions.get("asks").await.unwrap();
        let phase = kept
            .status
            .map(|s| serde_json::to_value(s).unwrap()["phase"].clone());
        if phase.as_ref().is_some_and(|p| p == "Succeeded") || started.elapsed().as_secs() > 60 {
            break phase;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let phase = phase.unwrap_or_else(|| {
        panic!(
            "asks has no status after a minute; the operator's log:\n{}",
            op.log_text()
        )
    });
    assert_eq!(
        phase, "Succeeded",
        "the session without a TTL of its own is kept"
    );
    ns.delete(&client).await;
}

/// A session whose stored state was broken by hand (a deferred call
/// without its token; turns that are no list) cannot go on: it ends
/// `Failed`, saying what is wrong, instead of being retried for ever or
/// started over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_cannot_go_on_fails_saying_why() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-broken").await;
    apply(&ns.name, THREE_ASKS);
    let _op = support::launcher::Operator::start(
        BIN,
        "tenant-broken",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name],
        &[],
    );
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    wait_until(Duration::from_secs(60), "the session to wait", || async {
        let s = sessions.get("asks").await.ok()?;
        let st = serde_json::to_value(s.status.as_ref()?).ok()?;
        (st["phase"] == "Waiting").then_some(())
    })
    .await;
    let broken = serde_json::from_value(json!([
        {"op": "remove", "path": "/status/state/open/calls/0/token"}
    ]))
    .unwrap();
    sessions
        .patch_status("asks", &PatchParams::default(), &Patch::<()>::Json(broken))
        .await
        .unwrap();
    let failed = wait_until(Duration::from_secs(60), "the session to fail", || async {
        let s = sessions.get("asks").await.ok()?;
        let st = serde_json::to_value(s.status.as_ref()?).ok()?;
        (st["phase"] == "Failed").then_some(st)
    })
    .await;
    let why = failed["failure"].as_str().unwrap_or_default();
    assert!(why.contains("is Deferred but has no token"), "{why}");

    // The API server stores `status.state` as written (its CRD leaves it
    // untyped): turns that are no list fail the session too, and are
    // never read as no turns, which would start it over and ask the model
    // again.
    apply(&ns.name, &THREE_ASKS.replace("name: asks", "name: retyped"));
    wait_until(
        Duration::from_secs(60),
        "the second session to wait",
        || async {
            let s = sessions.get("retyped").await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Waiting").then_some(())
        },
    )
    .await;
    sessions
        .patch_status(
            "retyped",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"state": {"turns": "not a list"}}})),
        )
        .await
        .unwrap();
    let failed = wait_until(
        Duration::from_secs(60),
        "the second session to fail",
        || async {
            let s = sessions.get("retyped").await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Failed").then_some(st)
        },
    )
    .await;
    let why = failed["failure"].as_str().unwrap_or_default();
    assert!(
        why.contains("status.state.turns is a string, not a list of turns"),
        "{why}"
    );
    assert_eq!(failed["agentTurns"], 1, "{failed}");
    ns.delete(&client).await;
}

/// A loopback HTTP server that records the path of every request it gets:
/// `/allowed/bounce` answers with a same-origin redirect to `/elsewhere`,
/// anything else with `200 ok`.
fn recording_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let paths = Arc::new(Mutex::new(Vec::new()));
    let seen = paths.clone();
    let server = Server::start(move |req| {
        seen.lock().unwrap().push(req.path.clone());
        if req.path == "/allowed/bounce" {
            Response::new(307, "").header("Location", "/elsewhere")
        } else {
            Response::text(200, "ok")
        }
    });
    (server.port, paths)
}

/// The operator's allow-list of http tool URLs (`--http-tool-allowed-urls`)
/// holds one path of one loopback server. An Agent with tools beyond it is
/// `Ready=False` (HttpToolUrlNotAllowed); a session of it runs: the listed
/// tool answers, and each other call fails with an error naming the URL and
/// the allow-list, while the other server gets no request at all and the
/// listed one is never asked for the path off the list (not by another
/// port, userinfo, or a same-origin redirect; in a step or in the
/// background).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_tools_call_only_the_urls_the_operator_allows() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-urls").await;
    let (good, good_paths) = recording_server();
    let (bad, bad_paths) = recording_server();
    apply(
        &ns.name,
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: fetcher}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: fetch, arguments: {{}}}}
            - {{name: leak, arguments: {{}}}}
            - {{name: bounce, arguments: {{}}}}
            - {{name: sneak, arguments: {{}}}}
        - text: one of four
  tools:
    - name: fetch
      http: {{url: "http://127.0.0.1:{good}/allowed/fetch"}}
    - name: leak
      http: {{url: "http://127.0.0.1:{bad}/collect"}}
    - name: bounce
      http: {{url: "http://127.0.0.1:{good}/allowed/bounce"}}
    - name: sneak
      http: {{url: "http://127.0.0.1:{good}@127.0.0.1:{bad}/allowed/x"}}
  policy:
    rules:
      - {{tool: sneak, disposition: runAsync}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: fetch}}
spec:
  messages: ["fetch"]
  agentRef: {{name: fetcher}}
"#
        ),
    );
    let allowed = format!("http://127.0.0.1:{good}/allowed/*");
    let op = support::launcher::Operator::start(
        BIN,
        "tenant-urls",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name, "--http-tool-allowed-urls", &allowed],
        &[],
    );
    let agents: Api<agents::api::Agent> = Api::namespaced(client.clone(), &ns.name);
    let ready = wait_until(
        Duration::from_secs(60),
        "the agent's Ready condition",
        || async { condition_in(agents.get("fetcher").await.ok()?.status.as_ref(), "Ready") },
    )
    .await;
    assert_eq!(ready["status"], "False", "{ready}\n{}", op.log_text());
    assert_eq!(ready["reason"], "HttpToolUrlNotAllowed", "{ready}");
    let why = ready["message"].as_str().unwrap_or_default();
    assert!(
        why.starts_with(&format!(
            "http tool \"leak\": \"http://127.0.0.1:{bad}/collect\" is not on the operator's allow-list"
        )),
        "{why}"
    );
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let done = wait_until(
        Duration::from_secs(90),
        "the session to succeed",
        || async {
            let s = sessions.get("fetch").await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Succeeded").then_some(st)
        },
    )
    .await;
    let results = &done["state"]["turns"][2]["toolResults"];
    assert_eq!(
        results[0]["result"],
        json!({"status": "success", "response": {"type": "text", "content": "ok"}}),
        "the listed tool answers: {results}"
    );
    let message = |i: usize| {
        results[i]["result"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let names_the_list = |m: &str| {
        m.contains("is not on the operator's allow-list of URLs http tools may call (--http-tool-allowed-urls, chart value operator.httpToolAllowedUrls)")
            && m.contains(&format!("which holds: {allowed}"))
            && m.contains("no request was sent to it")
    };
    let leak = format!("http://127.0.0.1:{bad}/collect");
    assert!(
        message(1).starts_with(&format!("POST {leak} was refused: \"{leak}\" is not on"))
            && names_the_list(&message(1)),
        "{}",
        message(1)
    );
    let elsewhere = format!("http://127.0.0.1:{good}/elsewhere");
    assert!(
        message(2).contains(&format!(
            "answered 307 Temporary Redirect, a redirect to \"{elsewhere}\", which was not followed: \"{elsewhere}\" is not on"
        )) && names_the_list(&message(2)),
        "{}",
        message(2)
    );
    assert!(
        message(3).contains("was refused") && names_the_list(&message(3)),
        "{}",
        message(3)
    );
    assert_eq!(done["answer"], "one of four");
    assert_eq!(
        bad_paths.lock().unwrap().len(),
        0,
        "the unlisted server was called: {:?}",
        bad_paths.lock().unwrap()
    );
    let mut asked = good_paths.lock().unwrap().clone();
    asked.sort();
    assert_eq!(asked, ["/allowed/bounce", "/allowed/fetch"]);
    drop(op);
    ns.delete(&client).await;
}

/// A model endpoint answering "from TAG" to every chat completion, and
/// the paths it was asked.
fn model_server(tag: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
    let paths = Arc::new(Mutex::new(Vec::new()));
    let seen = paths.clone();
    let server = Server::start(move |req| {
        seen.lock().unwrap().push(req.path.clone());
        let reply = json!({"choices": [{"message": {"role": "assistant", "content": format!("from {tag}")}}]});
        Response::new(200, reply.to_string()).header("Content-Type", "application/json")
    });
    (server.port, paths)
}

/// The condition `kind` in a status (a Session's or an Agent's), once it
/// has one.
fn condition_in<S: serde::Serialize>(status: Option<&S>, kind: &str) -> Option<Value> {
    let st = serde_json::to_value(status?).ok()?;
    st["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

/// The status condition `kind` of a session, once it has one.
async fn condition_of(sessions: &Api<Session>, name: &str, kind: &str) -> Option<Value> {
    condition_in(sessions.get(name).await.ok()?.status.as_ref(), kind)
}

/// The operator's list of model URLs (`--model-allowed-urls`) holds one
/// loopback server. An Agent whose model is another is `Ready=False`
/// (ModelUrlNotAllowed), and so are its sessions and an inline agent's,
/// naming the URL and the list; the other server is never called, while a
/// listed agent's session runs. Pointing the Agent at a listed URL lets
/// its waiting session go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_off_the_operators_list_is_never_called() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-models").await;
    let (good, good_paths) = model_server("good");
    let (bad, bad_paths) = model_server("bad");
    let agent = |name: &str, port: u16| {
        format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: {name}}}
spec:
  model: {{provider: openai, openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m}}}}
"#
        )
    };
    let session = |name: &str, agent: &str| {
        format!(
            "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: \"{name}\"}}\n\
             spec: {{messages: [hi], {agent}}}\n"
        )
    };
    let inline = format!(
        "agent: {{model: {{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{bad}/v1\", model: m}}}}}}"
    );
    apply(
        &ns.name,
        &[
            agent("listed", good),
            agent("unlisted", bad),
            session("ok", "agentRef: {name: listed}"),
            session("off", "agentRef: {name: unlisted}"),
            session("inline-off", &inline),
        ]
        .join("\n---\n"),
    );
    let allowed = format!("http://127.0.0.1:{good}/v1/*");
    let op = support::launcher::Operator::start(
        BIN,
        "tenant-models",
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name, "--model-allowed-urls", &allowed],
        &[],
    );
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let names_the_list = |c: &Value, port: u16| {
        let m = c["message"].as_str().unwrap_or_default();
        c["status"] == "False"
            && c["reason"] == "ModelUrlNotAllowed"
            && m.contains(&format!(
                "\"http://127.0.0.1:{port}/v1/chat/completions\" is not on the operator's \
                 allow-list of URLs models may be called at (--model-allowed-urls, chart value \
                 operator.modelAllowedUrls), which holds: {allowed}"
            ))
    };
    for name in ["off", "inline-off"] {
        let ready = wait_until(Duration::from_secs(60), "the session's Ready", || {
            condition_of(&sessions, name, "Ready")
        })
        .await;
        assert!(
            names_the_list(&ready, bad),
            "{name}: {ready}\n{}",
            op.log_text()
        );
    }
    let agents: Api<agents::api::Agent> = Api::namespaced(client.clone(), &ns.name);
    let agent_ready = wait_until(Duration::from_secs(60), "the Agent's Ready", || async {
        condition_in(agents.get("unlisted").await.ok()?.status.as_ref(), "Ready")
    })
    .await;
    assert!(names_the_list(&agent_ready, bad), "{agent_ready}");
    let answer = |name: &'static str| {
        let sessions = sessions.clone();
        async move {
            let s = sessions.get(name).await.ok()?;
            let st = serde_json::to_value(s.status.as_ref()?).ok()?;
            (st["phase"] == "Succeeded").then(|| st["answer"].clone())
        }
    };
    let done = wait_until(Duration::from_secs(60), "the listed session", || {
        answer("ok")
    })
    .await;
    assert_eq!(done, "from good");
    // Pointed at a listed URL, the Agent's waiting session goes on.
    agents
        .patch(
            "unlisted",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"model": {"openai": {"baseUrl": format!("http://127.0.0.1:{good}/v1")}}}})),
        )
        .await
        .unwrap();
    let done = wait_until(Duration::from_secs(60), "the mended session", || {
        answer("off")
    })
    .await;
    assert_eq!(done, "from good");
    let still = condition_of(&sessions, "inline-off", "Ready")
        .await
        .unwrap();
    assert!(names_the_list(&still, bad), "{still}");
    assert!(
        bad_paths.lock().unwrap().is_empty(),
        "the unlisted model was called: {:?}",
        bad_paths.lock().unwrap()
    );
    assert_eq!(good_paths.lock().unwrap().len(), 2);
    drop(op);
    ns.delete(&client).await;
}

/// One namespace's `runAsync` calls run at most
/// `--max-background-runs-per-namespace` at once (each may hold a reply of
/// up to 8 MiB in the operator); the others wait their turn and all end.
/// Here: 4 sessions with 2 slow runAsync calls each, 3 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaces_background_runs_take_turns_within_their_bound() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "tenant-background").await;
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (in_flight, peak) = (now.clone(), most.clone());
    let server = Server::start(move |_| {
        let n = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        peak.fetch_max(n, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1500));
        in_flight.fetch_sub(1, Ordering::SeqCst);
        Response::json(200, r#"{"ok":true}"#)
    });
    let sessions = support::fake::sessions("slow", "b", 4);
    apply(
        &ns.name,
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: slow}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{{name: a, arguments: {{}}}}, {{name: b, arguments: {{}}}}]
        - text: both
  tools:
    - {{name: a, http: {{url: "http://127.0.0.1:{port}/a"}}}}
    - {{name: b, http: {{url: "http://127.0.0.1:{port}/b"}}}}
  policy:
    default: runAsync
{sessions}"#,
            port = server.port
        ),
    );
    let op = support::launcher::Operator::start(
        BIN,
        &format!("tenant-background-{}", ns.name),
        &support::kubeconfig_path().unwrap(),
        &["-n", &ns.name, "--max-background-runs-per-namespace=3"],
        &[],
    );
    for i in 0..4 {
        support::kubectl_ok([
            "wait",
            "-n",
            &ns.name,
            &format!("session/b{i}"),
            "--for=condition=Succeeded",
            "--timeout=60s",
        ]);
    }
    assert_eq!(server.requests().len(), 8, "every call ran once");
    assert_eq!(
        most.load(Ordering::SeqCst),
        3,
        "at most 3 of the namespace's runs at once, and the bound was reached"
    );
    drop(op);
    ns.delete(&client).await;
}
