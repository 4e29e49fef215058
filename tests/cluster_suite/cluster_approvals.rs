//! Approvals with identities the API server enforces (issue 19): the
//! chart's ValidatingAdmissionPolicy, named approvers (users, groups,
//! service accounts), a quorum of different people, a denial, and a
//! timeout that applies `onTimeout`. People are impersonated users and
//! groups (`kubectl --as`) and a service account using the agents CLI.
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use serde_json::{json, Value};
use std::process::{Command, Output};
use std::time::Duration;
use support::scratch::Scratch;
use support::{kubectl, kubectl_ok, ClusterScoped, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

const SESSION: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: guarded}
spec:
  messages: ["ship it"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {name: deploy, arguments: {to: prod}}
              - {name: drop_db, arguments: {db: main}}
              - {name: nightly, arguments: {}}
              - {name: scale, arguments: {replicas: 10}}
          - text: all four decided
    tools:
      - {name: deploy, builtin: {function: echo}}
      - {name: drop_db, builtin: {function: echo}}
      - {name: nightly, builtin: {function: echo}}
      - {name: scale, builtin: {function: echo}}
    policy:
      rules:
        - tool: deploy
          disposition: runSync
          approval:
            approvers: {users: [alice, bob], serviceAccounts: [release-manager]}
            quorum: 2
        - tool: drop_db
          disposition: runSync
          approval:
            approvers: {groups: [dba]}
        - tool: nightly
          disposition: runSync
          approval: {timeoutSeconds: 3, onTimeout: approve}
        - tool: scale
          disposition: runSync
          approval: {approvers: {users: [alice]}, allowEdit: true}
"#;

/// `kubectl ARGS --as USER [--as-group G]...`.
fn kubectl_as(user: &str, groups: &[&str], args: &[&str]) -> Output {
    let mut cmd = Command::new(support::kubectl_path());
    cmd.args([
        "--kubeconfig",
        support::kubeconfig_path().unwrap().to_str().unwrap(),
    ]);
    cmd.args(args).args(["--as", user]);
    for g in groups {
        cmd.args(["--as-group", g]);
    }
    cmd.output().unwrap()
}

/// Writes `votes` as the whole `status.decisions` of `token`, as `user`.
fn vote_as(ns: &str, token: &str, user: &str, groups: &[&str], votes: Value) -> Output {
    let patch = json!({"status": {"decisions": votes}}).to_string();
    kubectl_as(
        user,
        groups,
        &[
            "patch",
            "continuation",
            token,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch,
        ],
    )
}

fn vote(approved: bool, by: &str) -> Value {
    json!({"approved": approved, "by": by, "decidedAt": "2026-01-01T00:00:00Z"})
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn continuation(ns: &str, token: &str) -> Value {
    serde_json::from_str(&kubectl_ok([
        "get",
        "continuation",
        token,
        "-n",
        ns,
        "-o",
        "json",
    ]))
    .unwrap()
}

fn wait_for(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    for _ in 0..secs * 4 {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvers_quorum_denial_and_timeout_are_enforced_by_the_api_server() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "approvals").await;
    let release = ns.name.clone();
    let _cluster_scoped = ClusterScoped(vec![
        format!("clusterrole/{release}-operator"),
        format!("clusterrole/{release}-completer"),
        format!("validatingadmissionpolicy/{release}-approvals"),
        format!("validatingadmissionpolicybinding/{release}-approvals"),
    ]);
    let selector = format!(
        "approvals.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name={}",
        ns.name
    );
    let manifests = support::helm_template(
        &release,
        &ns.name,
        &[
            "--set",
            &selector,
            "--show-only",
            "templates/rbac.yaml",
            "--show-only",
            "templates/serviceaccount.yaml",
            "--show-only",
            "templates/approvals-policy.yaml",
        ],
    );
    support::apply(&ns.name, &manifests);
    let bind = |name: &str, clusterrole: &str, subjects: &[&str]| {
        let mut args = vec!["create", "rolebinding", name, "-n", &ns.name];
        let role = format!("--clusterrole={release}-{clusterrole}");
        args.push(&role);
        args.extend_from_slice(subjects);
        kubectl_ok(args);
    };
    let operator_sa = format!("--serviceaccount={}:{release}-operator", ns.name);
    bind("operator-here", "operator", &[&operator_sa]);
    kubectl_ok([
        "create",
        "serviceaccount",
        "release-manager",
        "-n",
        &ns.name,
    ]);
    let manager_sa = format!("--serviceaccount={}:release-manager", ns.name);
    bind(
        "people",
        "completer",
        &[
            "--user=alice",
            "--user=bob",
            "--user=mallory",
            "--group=dba",
            &manager_sa,
        ],
    );
    // The policy takes a moment to be enforced after it is created.
    std::thread::sleep(Duration::from_secs(2));
    support::apply(&ns.name, SESSION);
    let operator_config =
        support::service_account_kubeconfig(&ns.name, &format!("{release}-operator"));
    let _op = support::launcher::Operator::start(
        BIN,
        "approvals",
        &operator_config,
        &["-n", &ns.name],
        &[],
    );
    let (deploy, drop_db) = ("guarded-t1-c0", "guarded-t1-c1");
    wait_for("three calls waiting for approval", 60, || {
        kubectl(["get", "continuation", deploy, drop_db, "-n", &ns.name])
            .status
            .success()
    });

    // Not listed: refused with the policy's message.
    let out = vote_as(
        &ns.name,
        deploy,
        "mallory",
        &[],
        json!([vote(true, "mallory")]),
    );
    assert!(!out.status.success(), "mallory is no approver");
    assert!(
        stderr(&out).contains("mallory is not an approver of this call"),
        "{}",
        stderr(&out)
    );
    // A forged name: refused.
    let out = vote_as(&ns.name, deploy, "alice", &[], json!([vote(true, "bob")]));
    assert!(!out.status.success(), "alice signed as bob");
    assert!(
        stderr(&out).contains("by must be alice"),
        "{}",
        stderr(&out)
    );
    // The release manager (a listed service account) approves with the
    // CLI, signed with the name the API server knows it by: one of a
    // quorum of two, the call still waits.
    let manager = support::service_account_kubeconfig(&ns.name, "release-manager");
    // deploy takes no edits: the CLI says so before writing anything.
    let scratch = Scratch::new("approvals");
    let args_file = scratch.write("args.json", r#"{"to": "staging"}"#);
    let out = Command::new(BIN)
        .args([
            "session", "approve", deploy, "--store", "kube", "-n", &ns.name,
        ])
        .arg("--args-file")
        .arg(&args_file)
        .env("KUBECONFIG", &manager)
        .output()
        .unwrap();
    assert!(!out.status.success(), "an edit the policy does not allow");
    assert!(
        stderr(&out).contains("does not let approvers edit its arguments"),
        "{}",
        stderr(&out)
    );
    assert!(continuation(&ns.name, deploy)["status"]["decisions"].is_null());
    let out = Command::new(BIN)
        .args([
            "session", "approve", deploy, "--store", "kube", "-n", &ns.name,
        ])
        .env("KUBECONFIG", &manager)
        .env("USER", "someone-else")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{said}\n{}", stderr(&out));
    assert!(
        said.contains("needs 2 different approvers and waits for the others"),
        "{said}"
    );
    let by = format!("system:serviceaccount:{}:release-manager", ns.name);
    let first = continuation(&ns.name, deploy)["status"]["decisions"][0].clone();
    assert_eq!(first["by"], by.as_str(), "{first}");
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        continuation(&ns.name, deploy)["status"]["outcome"].is_null(),
        "one approval of two ran the call"
    );
    // The same person twice does not make two, nor can a vote go.
    let out = vote_as(
        &ns.name,
        deploy,
        "alice",
        &[],
        json!([first, vote(true, "alice"), vote(true, "alice")]),
    );
    assert!(!out.status.success(), "alice approved twice");
    let out = vote_as(&ns.name, deploy, "alice", &[], json!([vote(true, "alice")]));
    assert!(!out.status.success(), "the manager's vote was removed");
    // Alice makes the quorum.
    let out = vote_as(
        &ns.name,
        deploy,
        "alice",
        &[],
        json!([first, vote(true, "alice")]),
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // scale: alice edits the arguments as she approves; drop_db takes no
    // edits.
    let edited = json!({"approved": true, "by": "alice", "decidedAt": "2026-01-01T00:00:00Z",
        "arguments": "{\"replicas\": 2}"});
    let out = vote_as(&ns.name, "guarded-t1-c3", "alice", &[], json!([edited]));
    assert!(out.status.success(), "{}", stderr(&out));
    let mut no_edit = vote(true, "carol");
    no_edit["arguments"] = json!("{}");
    let out = vote_as(
        &ns.name,
        drop_db,
        "carol",
        &["dba", "system:authenticated"],
        json!([no_edit]),
    );
    assert!(
        !out.status.success(),
        "an edit where the policy allows none"
    );
    assert!(
        stderr(&out).contains("does not let approvers edit"),
        "{}",
        stderr(&out)
    );

    // Only the operator writes the notification record.
    let forged = json!({"status": {"notified": {"waitingFor": "approval", "state": "Sent",
        "attempts": 1, "lastAttemptAt": "2026-01-01T00:00:00Z"}}})
    .to_string();
    let out = kubectl_as(
        "alice",
        &[],
        &[
            "patch",
            "continuation",
            drop_db,
            "-n",
            &ns.name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &forged,
        ],
    );
    assert!(!out.status.success(), "alice wrote status.notified");
    assert!(
        stderr(&out).contains("only the operator writes it"),
        "{}",
        stderr(&out)
    );

    // drop_db: only the dba group decides; one denial ends the call.
    let out = vote_as(
        &ns.name,
        drop_db,
        "mallory",
        &[],
        json!([vote(false, "mallory")]),
    );
    assert!(!out.status.success(), "mallory is not in dba");
    let out = vote_as(
        &ns.name,
        drop_db,
        "carol",
        &["dba", "system:authenticated"],
        json!([vote(false, "carol")]),
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // nightly: nobody decides; after 3 s onTimeout approves and it runs.
    kubectl_ok([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/guarded",
        "--timeout=90s",
    ]);
    let s: Value = serde_json::from_str(&kubectl_ok([
        "get", "session", "guarded", "-n", &ns.name, "-o", "json",
    ]))
    .unwrap();
    let results = &s["status"]["state"]["turns"][2]["toolResults"];
    assert_eq!(
        results[0]["result"]["status"], "success",
        "deploy ran: {results}"
    );
    assert_eq!(
        results[1]["result"]["status"], "error",
        "drop_db was denied: {results}"
    );
    assert!(
        results[1]["result"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("carol"),
        "the model hears who denied: {results}"
    );
    assert_eq!(
        results[2]["result"]["status"], "success",
        "nightly ran on timeout: {results}"
    );
    // scale ran with alice's arguments, and the model hears she edited them;
    // the model's own arguments stay in its turn.
    let scale = results[3]["result"].to_string();
    assert!(scale.contains("alice edited the arguments"), "{scale}");
    assert!(
        scale.contains("replicas") && !scale.contains("10"),
        "{scale}"
    );
    let asked = s["status"]["state"]["turns"][1]["toolCalls"][3]["arguments"].to_string();
    assert!(
        asked.contains("10"),
        "the model's arguments are kept: {asked}"
    );
    let _ = std::fs::remove_file(&manager);
    let _ = std::fs::remove_file(&operator_config);
    ns.delete(&client).await;
}
