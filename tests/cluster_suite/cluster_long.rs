//! A long session under the operator: 1,000 turns, each a tool call whose
//! result is the same 2 KB. Its status stays small, what it stores grows
//! linearly with its turns (older turns go into blobs written once), and the
//! model is still sent the whole conversation on every turn.

use crate::support;

use agents::api::Session;
use kube::api::{Api, ListParams};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::http::{Request, Response, Server};
use support::launcher::Operator;
use support::TestNamespace;

/// The status may take at most this, however long the session.
const STATUS_MOST: usize = 64 * 1024;

/// What the fake model saw that it should not have.
#[derive(Default)]
struct Seen {
    turns: usize,
    wrong: Vec<String>,
}

/// The 2 KB every call of `big` answers: the same each time.
fn payload() -> String {
    let line = "the same two kilobytes of tool output, line after line; ";
    line.repeat(2048 / line.len() + 1)[..2048].to_string()
}

/// An OpenAI-compatible model that calls `big` on every turn before the
/// last, and checks the conversation it is sent is whole: the user's
/// message, then for each earlier turn the call and its full result.
fn model_and_tool(turns: usize) -> (Server, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let shared = seen.clone();
    let server = Server::start_without_bodies(move |req: &Request| {
        if req.path.ends_with("/big") {
            return Response::json(200, json!({ "data": payload() }).to_string());
        }
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
        let mut seen = shared.lock().unwrap();
        seen.turns += 1;
        if let Some(wrong) = conversation_is_whole(&messages, turn) {
            seen.wrong.push(format!("turn {turn}: {wrong}"));
        }
        drop(seen);
        let message = if turn + 1 >= turns {
            json!({"role": "assistant", "content": "done"})
        } else {
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": format!("c{turn}"), "type": "function",
                "function": {"name": "big", "arguments": format!("{{\"turn\":{turn}}}")}}]})
        };
        Response::json(
            200,
            json!({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
                .to_string(),
        )
    });
    (server, seen)
}

/// Why the conversation sent at `turn` is not whole, if it is not.
fn conversation_is_whole(messages: &[Value], turn: usize) -> Option<String> {
    let tools: Vec<&Value> = messages.iter().filter(|m| m["role"] == "tool").collect();
    if tools.len() != turn {
        return Some(format!("{} tool results for {turn} turns", tools.len()));
    }
    let want = payload();
    let cut = tools
        .iter()
        .position(|m| !m["content"].as_str().unwrap_or_default().contains(&want));
    cut.map(|i| format!("the result of turn {i} is not the whole 2 KB"))
}

/// What the session keeps in the API server, as JSON bytes: its status,
/// its whole object, and the blobs (ConfigMaps) it owns, with their count.
#[derive(Clone, Copy, Debug)]
struct Stored {
    status: usize,
    object: usize,
    blobs: usize,
    blob_count: usize,
    /// Turns moved out of the status into blobs.
    archived: usize,
}

async fn stored(client: &kube::Client, ns: &str, name: &str) -> Stored {
    let sessions: Api<Session> = Api::namespaced(client.clone(), ns);
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), ns);
    let session = sessions.get(name).await.unwrap();
    let selector = format!("agents-exe.io/session={name}");
    let blobs = configmaps
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap();
    let status = serde_json::to_value(&session.status).unwrap();
    let archived = status["archivedTurns"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| c["turns"].as_u64().unwrap_or(0))
                .sum::<u64>()
        })
        .unwrap_or(0) as usize;
    Stored {
        archived,
        status: serde_json::to_vec(&session.status).unwrap().len(),
        object: serde_json::to_vec(&session).unwrap().len(),
        blobs: blobs
            .items
            .iter()
            .map(|c| serde_json::to_vec(c).unwrap().len())
            .sum(),
        blob_count: blobs.items.len(),
    }
}

fn manifests(port: u16) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: long}}
spec:
  model: {{provider: openai, openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m}}}}
  tools:
    - {{name: big, description: "two kilobytes", http: {{url: "http://127.0.0.1:{port}/big"}}}}
  policy: {{default: runSync}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: long}}
spec:
  agentRef: {{name: long}}
  messages: [go on]
  limits: {{maxTurns: 2000}}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_turns_keep_the_status_small_and_storage_linear() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let turns = support::sized("AGENTS_LONG_TURNS", 1000);
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "long").await;
    let (server, seen) = model_and_tool(turns + 1);
    let kubeconfig = support::kubeconfig_path().unwrap();
    // The build the other tests run. Each write keeps the chunks the
    // stored status already archived, so a turn costs its recent turns and
    // the model request (the whole conversation), not every turn compressed
    // again: 1,000 turns took 672 s in a debug build before, 198 s since.
    let op = Operator::start(
        env!("CARGO_BIN_EXE_agents"),
        &ns.name,
        &kubeconfig,
        &["-n", &ns.name],
        &[],
    );
    support::apply(&ns.name, &manifests(server.port));
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let started = Instant::now();
    let (mut most_status, mut samples) = (0, Vec::new());
    let half = turns / 2;
    loop {
        let session = sessions.get("long").await.unwrap();
        let st = serde_json::to_value(&session.status).unwrap();
        let taken = st["agentTurns"].as_u64().unwrap_or(0) as usize;
        let now = stored(&client, &ns.name, "long").await;
        most_status = most_status.max(now.status);
        if samples.is_empty() && taken >= half {
            samples.push((taken, now));
        }
        match st["phase"].as_str() {
            Some("Succeeded") => break,
            Some("Failed") => panic!("the session failed: {}\n{}", st["failure"], op.log_text()),
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(1200),
            "{taken} turns after 20 minutes\n{}",
            op.log_text()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = started.elapsed().as_secs_f64();
    let end = stored(&client, &ns.name, "long").await;
    most_status = most_status.max(end.status);
    let (wrong, asked) = {
        let seen = seen.lock().unwrap();
        (seen.wrong.clone(), seen.turns)
    };
    let (half, at_half) = samples[0];
    println!(
        "{turns} turns in {took:.0} s ({:.0} ms a turn); largest status {most_status} bytes; \
         at turn {half}: {at_half:?}; at the end: {end:?}",
        took * 1000.0 / turns as f64
    );
    assert!(wrong.is_empty(), "{:?}", &wrong[..wrong.len().min(5)]);
    assert_eq!(asked, turns + 1, "each turn asked once");
    assert!(
        most_status <= STATUS_MOST,
        "the status took {most_status} bytes"
    );
    // Old turns go into chunks of many turns, each written once: not a
    // blob per turn (or per write).
    assert!(
        end.blob_count <= turns / 5,
        "{} blobs for {turns} turns",
        end.blob_count
    );
    // Linear: a turn archived late costs what one archived early did.
    let early = at_half.blobs as f64 / at_half.archived.max(1) as f64;
    let late = (end.blobs - at_half.blobs) as f64 / (end.archived - at_half.archived).max(1) as f64;
    println!("blob bytes an archived turn: {early:.0} up to turn {half}, {late:.0} after it");
    assert!(
        late <= early * 1.5 + 64.0,
        "storage grows faster than the turns"
    );
    // The same 2 KB result on every turn is not kept once per turn.
    let per_turn = (end.object + end.blobs) as f64 / turns as f64;
    assert!(
        per_turn < 1024.0,
        "{per_turn:.0} bytes stored a turn: the 2 KB result is kept per turn"
    );
    drop(op);
    ns.delete(&client).await;
}
