//! A Session's managedFields under the operator: its status is written
//! under one field manager, so the entries and their bytes stay the same
//! however many status writes a session takes (3 turns or 20), and that
//! manager owns the status as one atomic value (`x-kubernetes-map-type:
//! atomic`), not field by field.

use crate::support;

use agents::api::Session;
use kube::api::Api;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::http::{Request, Response, Server};
use support::launcher::Operator;

const BIN: &str = env!("CARGO_BIN_EXE_agents");

/// A model that calls `ping` until the session has taken the turns its
/// message asks for (`turns: N`), then answers.
fn model_and_tool() -> Server {
    Server::start(move |req: &Request| {
        if req.path.ends_with("/ping") {
            return Response::json(200, json!({"pong": true}).to_string());
        }
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let asked = messages
            .iter()
            .find(|m| m["role"] == "user")
            .and_then(|m| m["content"].as_str()?.strip_prefix("turns: ")?.parse().ok())
            .unwrap_or(1);
        let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
        let message = if turn + 1 >= asked {
            json!({"role": "assistant", "content": "done"})
        } else {
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": format!("c{turn}"), "type": "function",
                "function": {"name": "ping", "arguments": format!("{{\"turn\":{turn}}}")}}]})
        };
        Response::json(
            200,
            json!({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
                .to_string(),
        )
    })
}

fn manifests(port: u16) -> String {
    let session = |name: &str, turns: u32| {
        format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: {name}}}\n\
             spec:\n  agentRef: {{name: fields}}\n  messages: [\"turns: {turns}\"]\n"
        )
    };
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: fields}}
spec:
  model: {{provider: openai, openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m}}}}
  tools:
    - {{name: ping, description: "answers pong", http: {{url: "http://127.0.0.1:{port}/ping"}}}}
  policy: {{default: runSync}}
{}{}"#,
        session("three", 3),
        session("twenty", 20)
    )
}

/// A session's managedFields: the entries, their bytes, and the managers
/// of its status.
fn managed(session: &Session) -> (usize, usize, Vec<String>) {
    let entries = serde_json::to_value(&session.metadata.managed_fields).unwrap();
    let entries = entries.as_array().cloned().unwrap_or_default();
    let status_managers = entries
        .iter()
        .filter(|e| e["subresource"] == "status")
        .map(|e| e["manager"].as_str().unwrap_or("").to_string())
        .collect();
    let bytes = serde_json::to_vec(&entries).unwrap().len();
    (entries.len(), bytes, status_managers)
}

/// The field sets the status entries own.
fn status_field_sets(session: &Session) -> Vec<Value> {
    let entries = serde_json::to_value(&session.metadata.managed_fields).unwrap();
    entries
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["subresource"] == "status")
        .map(|e| e["fieldsV1"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_writes_keep_managed_fields_one_entry_and_the_same_size() {
    let Some((client, ns)) = support::cluster_namespace("fields").await else {
        return;
    };
    let server = model_and_tool();
    let kubeconfig = support::kubeconfig_path().unwrap();
    let op = Operator::start(BIN, &ns.name, &kubeconfig, &["-n", &ns.name], &[]);
    support::apply(&ns.name, &manifests(server.port));
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let started = Instant::now();
    let mut most_entries = 0;
    let done = loop {
        let three = sessions.get("three").await.unwrap();
        let twenty = sessions.get("twenty").await.unwrap();
        most_entries = most_entries.max(managed(&twenty).0);
        let phase = |s: &Session| serde_json::to_value(&s.status).unwrap()["phase"].clone();
        if [&three, &twenty].iter().any(|s| phase(s) == "Failed") {
            panic!("a session failed\n{}", op.log_text());
        }
        if phase(&three) == "Succeeded" && phase(&twenty) == "Succeeded" {
            break [three, twenty];
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "{}",
            op.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let turns: Vec<Value> = done
        .iter()
        .map(|s| serde_json::to_value(&s.status).unwrap()["agentTurns"].clone())
        .collect();
    assert_eq!(turns, [json!(3), json!(20)]);
    let [(entries3, bytes3, managers3), (entries20, bytes20, managers20)] =
        [managed(&done[0]), managed(&done[1])];
    println!(
        "managedFields after 3 turns: {entries3} entries, {bytes3} bytes; \
         after 20 turns: {entries20} entries, {bytes20} bytes"
    );
    assert_eq!(managers3, ["agents"], "one manager writes the status");
    assert_eq!(managers20, ["agents"], "one manager writes the status");
    assert_eq!(entries20, entries3, "{:?}", done[1].metadata.managed_fields);
    assert!(
        most_entries <= entries20,
        "{most_entries} entries at one time"
    );
    assert_eq!(bytes20, bytes3, "managedFields grew with the status writes");
    for session in &done {
        assert_eq!(
            status_field_sets(session),
            [json!({"f:status": {}})],
            "the status manager owns the status whole (atomic), not field by field"
        );
    }
}

/// The session `labelled` as a person applies it: with `labels`.
fn labelled(labels: &str) -> String {
    format!(
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\n\
         metadata: {{name: labelled, labels: {{{labels}}}, annotations: {{note: kept}}}}\n\
         spec:\n  agentRef: {{name: fields}}\n  messages: [\"turns: 4\"]\n"
    )
}

/// Status writes send the rest of the object back as they found it, so
/// they take no field from its owner: a label a person applied is still
/// theirs after every status write, and applying again without it
/// removes it (a write that dropped the owner would leave it behind, as
/// it would leave a finalizer nobody can take off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_writes_leave_a_persons_labels_theirs() {
    let Some((client, ns)) = support::cluster_namespace("owners").await else {
        return;
    };
    let server = model_and_tool();
    let kubeconfig = support::kubeconfig_path().unwrap();
    let op = Operator::start(BIN, &ns.name, &kubeconfig, &["-n", &ns.name], &[]);
    let agent_only: String = manifests(server.port)
        .split("---")
        .next()
        .unwrap()
        .to_string();
    support::apply(&ns.name, &agent_only);
    let person = ["--server-side", "--field-manager=person"];
    support::apply_with(&ns.name, &labelled("team: a, tier: b"), &person);
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let started = Instant::now();
    let done = loop {
        let s = sessions.get("labelled").await.unwrap();
        let phase = serde_json::to_value(&s.status).unwrap()["phase"].clone();
        if phase == "Succeeded" {
            break s;
        }
        assert!(phase != "Failed", "{}", op.log_text());
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{}",
            op.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let entries = serde_json::to_value(&done.metadata.managed_fields).unwrap();
    let persons = entries
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["manager"] == "person")
        .unwrap_or_else(|| panic!("no entry of the person's apply: {entries}"));
    let labels = &persons["fieldsV1"]["f:metadata"]["f:labels"];
    assert!(
        labels.get("f:team").is_some() && labels.get("f:tier").is_some(),
        "the person's labels lost their owner: {entries}"
    );
    assert!(
        persons["fieldsV1"]["f:metadata"]["f:annotations"]
            .get("f:note")
            .is_some(),
        "{entries}"
    );
    let spec = &persons["fieldsV1"]["f:spec"];
    assert!(
        spec.get("f:agentRef").is_some() && spec.get("f:messages").is_some(),
        "the person's spec lost its owner: {entries}"
    );
    support::apply_with(&ns.name, &labelled("team: a"), &person);
    let after = sessions.get("labelled").await.unwrap();
    let labels = after.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("a"));
    assert!(
        !labels.contains_key("tier"),
        "applying without the label left it: {labels:?}"
    );
}
