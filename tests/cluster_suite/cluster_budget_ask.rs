//! `onExceed: ask` under the operator (issue 31): three sessions reach
//! their token limit and each asks a person through a Continuation
//! `waitingFor: budget` that shows the spend and the limit. One is
//! approved with a raise from the CLI, one from the console page, and
//! both finish; the third is denied and fails with the reason. The model
//! is an OpenAI-compatible fake that reports usage. Skipped without a
//! cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use kube::Client;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;
use support::budgets;
use support::{apply, kubectl, kubectl_ok, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn get(ns: &str, what: &str, jsonpath: &str) -> String {
    let path = format!("jsonpath={jsonpath}");
    let out = kubectl(["get", what, "-n", ns, "-o", &path]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Waits until `session` asks, and checks what its question shows.
async fn asks(ns: &str, session: &str) -> String {
    let token = format!("{session}-budget-0");
    let cont = format!("continuation/{token}");
    let mut waits = String::new();
    for _ in 0..180 {
        waits = get(ns, &cont, "{.status.waitingFor}");
        if waits == "budget" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let s = format!("session/{session}");
    assert_eq!(
        waits,
        "budget",
        "no budget question; the session: {}",
        get(ns, &s, "{.status}")
    );
    let args = get(ns, &cont, "{.spec.toolCall.arguments}");
    let args: serde_json::Value = serde_json::from_str(&args).unwrap();
    assert_eq!(
        (args["used"].as_u64(), args["allowed"].as_u64()),
        (Some(1400), Some(1000)),
        "{args}"
    );
    assert!(
        args["spend"].as_str().unwrap().contains("1400 tokens"),
        "{args}"
    );
    assert_eq!(get(ns, &s, "{.status.waitingFor}"), "budget");
    let reason = get(
        ns,
        &s,
        "{.status.conditions[?(@.type==\"Waiting\")].reason}",
    );
    assert_eq!(reason, "AwaitingBudget");
    token
}

fn cli(ns: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["session"])
        .args(args)
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", support::kubeconfig_path().unwrap())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn wait_for(ns: &str, session: &str, condition: &str) {
    kubectl_ok([
        "wait",
        "-n",
        ns,
        &format!("--for=condition={condition}"),
        &format!("session/{session}"),
        "--timeout=90s",
    ]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_is_approved_with_a_raise_from_the_cli_and_the_page_and_a_denial_fails() {
    let Some((client, ns)) = support::cluster_namespace("budget-ask").await else {
        return;
    };
    let (model, calls) = budgets::echo_twice_model();
    for name in ["bycli", "bypage", "denied"] {
        apply(&ns.name, &budgets::asking_session_yaml(name, &model));
    }
    let operator = support::launcher::Operator::watching(BIN, &ns.name, "budget-ask");

    let token = asks(&ns.name, "bycli").await;
    let (ok, said) = cli(&ns.name, &["approve", &token]);
    assert!(!ok && said.contains("--raise tokens="), "{said}");
    let (ok, said) = cli(&ns.name, &["approve", &token, "--raise", "tokens=5000"]);
    assert!(ok, "{said}");
    wait_for(&ns.name, "bycli", "Succeeded");
    let by = get(
        &ns.name,
        &format!("continuation/{token}"),
        "{.status.decision.by}",
    );
    assert_eq!(by, "kubernetes-admin", "signed with the caller's own name");
    let raised = get(
        &ns.name,
        "session/bycli",
        "{.status.state.budgetRaise.tokens}",
    );
    assert_eq!(raised, "5000");

    let token = asks(&ns.name, "bypage").await;
    approve_on_the_page(&client, &ns.name, &token).await;
    wait_for(&ns.name, "bypage", "Succeeded");

    let token = asks(&ns.name, "denied").await;
    let (ok, said) = cli(
        &ns.name,
        &["deny", &token, "--reason", "over the team's budget"],
    );
    assert!(ok, "{said}");
    wait_for(&ns.name, "denied", "Failed");
    let failure = get(&ns.name, "session/denied", "{.status.failure}");
    assert!(
        failure.contains("denied going past the limit: over the team's budget"),
        "{failure}"
    );
    check_views(&operator, &ns.name, calls.load(Ordering::SeqCst));
    ns.delete(&client).await;
}

/// `kubectl get sessions` shows each session's tokens; the operator's
/// token counter for the namespace holds every model turn's 700.
fn check_views(operator: &support::launcher::Operator, ns: &str, model_calls: usize) {
    let table = kubectl_ok(["get", "sessions", "-n", ns]);
    let header = table.lines().next().unwrap_or_default();
    assert!(header.contains("TOKENS"), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("bycli "))
        .unwrap_or_default();
    assert!(
        row.split_whitespace().any(|c| c == "2100"),
        "3 turns of 700: {table}"
    );
    let (_, metrics) = operator.probe("/metrics");
    let counted = |name: &str| -> u64 {
        let head = format!("{name}{{");
        metrics
            .lines()
            .filter(|l| l.starts_with(&head) && l.contains(&format!("namespace=\"{ns}\"")))
            .filter(|l| l.contains("model=\"test\"") && l.contains("agent=\"(inline)\""))
            .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
            .sum()
    };
    let tokens = counted("agents_model_tokens_total");
    assert_eq!(tokens, 700 * model_calls as u64, "{metrics}");
    assert!(
        metrics.contains("agents_model_cost_micros_total"),
        "{metrics}"
    );
}

/// `agents ui`: the question's page has the raise form; a raise that
/// lifts nothing gets the CLI's own refusal, a good one is recorded.
async fn approve_on_the_page(_client: &Client, ns: &str, token: &str) {
    let admin = support::kubeconfig_path().unwrap();
    let port = support::launcher::free_port();
    let mut ui = Command::new(BIN)
        .args(["ui", "--addr", &format!("127.0.0.1:{port}"), "-n", ns])
        .env("KUBECONFIG", &admin)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}/");
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let page = wait_until(Duration::from_secs(20), "the console", || async {
        let url = format!("{base}call?ns={ns}&token={token}");
        http.get(url).send().await.ok()?.text().await.ok()
    })
    .await;
    assert!(
        page.contains("id=raise") && page.contains("spent 1400 of 1000"),
        "{page}"
    );
    let csrf = hidden(&page, "csrf");
    let post = |raise: &str| {
        let form = [
            ("csrf", csrf.clone()),
            ("ns", ns.to_string()),
            ("token", token.to_string()),
            ("action", "approve".to_string()),
            ("raise", raise.to_string()),
        ];
        http.post(format!("{base}decide")).form(&form).send()
    };
    let bad = post("tokens=1000").await.unwrap().text().await.unwrap();
    assert!(bad.contains("does not lift the limit"), "{bad}");
    let done = post("tokens=6000").await.unwrap();
    assert_eq!(
        done.status().as_u16(),
        303,
        "{}",
        done.text().await.unwrap()
    );
    let _ = ui.kill();
    let _ = ui.wait();
}

/// The value of the first `name=` hidden input on a page.
fn hidden(page: &str, name: &str) -> String {
    let at = page
        .find(&format!("name={name} value=\""))
        .unwrap_or_else(|| panic!("no {name} in {page}"));
    let rest = &page[at + name.len() + 13..];
    rest[..rest.find('"').unwrap()].to_string()
}
