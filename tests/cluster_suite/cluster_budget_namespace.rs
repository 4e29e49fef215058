//! A namespace `Budget` under the operator (issue 31, item 4): 20
//! sessions share a token Budget; an OpenAI-compatible fake reports 100
//! tokens a turn and keeps its own tally. The sessions stop at the bound
//! (overshoot at most one turn per running session) waiting for the
//! Budget (`waitingFor: budget`, `Waiting=BudgetExhausted`); a raise lets
//! them finish. Across operator SIGKILLs with two operators racing, the
//! Budget's `used` equals the fake's tally exactly. Bad Budgets are
//! refused at admission; a selector matching nothing says so.
//!
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::{Budget, Session};
use kube::api::{Api, ListParams};
use kube::Client;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::{Request, Response, Server};
use support::launcher;
use support::{apply, kubectl, kubectl_ok, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_agents");
const SESSIONS: usize = 20;
/// Model turns each session takes: two `echo` calls, then its answer.
const TURNS: usize = 3;
/// Tokens the fake reports for every turn (80 prompt + 20 completion).
const TURN_TOKENS: u64 = 100;

/// What the fake reported: every request, and each distinct turn (a
/// session's user message and how many tool results it had) once. A
/// model call cut by a kill before its reply was recorded is asked
/// again with the same conversation: billed twice, recorded once.
#[derive(Clone, Default)]
struct Tally {
    requests: Arc<Mutex<u64>>,
    turns: Arc<Mutex<BTreeMap<(String, usize), u64>>>,
}

impl Tally {
    fn reported(&self) -> u64 {
        *self.requests.lock().unwrap() * TURN_TOKENS
    }
    fn recorded_turns(&self) -> u64 {
        self.turns.lock().unwrap().values().sum()
    }
}

fn model(tally: Tally) -> Server {
    Server::start(move |req: &Request| {
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let user = messages
            .iter()
            .find(|m| m["role"] == "user")
            .map(|m| m["content"].to_string())
            .unwrap_or_default();
        let results = messages.iter().filter(|m| m["role"] == "tool").count();
        *tally.requests.lock().unwrap() += 1;
        tally
            .turns
            .lock()
            .unwrap()
            .insert((user, results), TURN_TOKENS);
        let message = if results + 1 < TURNS {
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": format!("c{results}"), "type": "function",
                 "function": {"name": "echo", "arguments": "{\"n\":1}"}}]})
        } else {
            serde_json::json!({"role": "assistant", "content": "done"})
        };
        let body = serde_json::json!({
            "choices": [{"index": 0, "message": message}],
            "usage": {"prompt_tokens": 80, "completion_tokens": 20}
        });
        Response::json(200, body.to_string())
    })
}

fn agent_and_sessions(model: &Server) -> String {
    let mut yaml = agent_yaml(model);
    for i in 0..SESSIONS {
        yaml.push_str(&format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: s{i:02}, labels: {{team: a}}}}\nspec: {{agentRef: {{name: worker}}, messages: [\"work {i}\"]}}\n"
        ));
    }
    yaml
}

fn agent_yaml(model: &Server) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: worker}}
spec:
  model:
    provider: openai
    openai: {{baseUrl: "{}", model: test}}
  tools:
    - {{name: echo, builtin: {{function: echo}}}}
"#,
        model.url("/v1")
    )
}

fn budget_yaml(name: &str, tokens: u64, team: &str) -> String {
    format!(
        "apiVersion: agents-exe.io/v1alpha1\nkind: Budget\nmetadata: {{name: {name}}}\nspec: {{tokens: {tokens}, period: day, selector: {{matchLabels: {{team: {team}}}}}}}\n"
    )
}

async fn budget(client: &Client, ns: &str, name: &str) -> Budget {
    Api::<Budget>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap()
}

fn used(b: &Budget) -> u64 {
    b.status.as_ref().map_or(0, |s| s.used.tokens)
}

fn condition<'a>(
    b: &'a Budget,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    b.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

async fn sessions(client: &Client, ns: &str) -> Vec<Session> {
    Api::<Session>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

fn succeeded(s: &Session) -> bool {
    s.status
        .as_ref()
        .is_some_and(|st| st.phase == agents::api::session::SessionPhase::Succeeded)
}

fn waits_for_budget(s: &Session) -> bool {
    s.status.as_ref().is_some_and(|st| {
        st.waiting_for == Some(agents::core::WaitingFor::Budget)
            && st
                .conditions
                .iter()
                .any(|c| c.type_ == "Waiting" && c.reason == "BudgetExhausted")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_sessions_stop_at_the_budget_and_a_raise_lets_them_finish() {
    let Some((client, ns)) = support::cluster_namespace("budget-ns").await else {
        return;
    };
    let tally = Tally::default();
    let server = model(tally.clone());
    apply(&ns.name, &budget_yaml("team", 1000, "a"));
    apply(&ns.name, &budget_yaml("nobody", 1000, "z"));
    apply(&ns.name, &agent_and_sessions(&server));
    let _operator = launcher::Operator::watching(BIN, &ns.name, "budget-ns");
    let held = wait_until(
        Duration::from_secs(120),
        "every session done or held by the Budget",
        || async {
            let all = sessions(&client, &ns.name).await;
            let settled =
                all.len() == SESSIONS && all.iter().all(|s| succeeded(s) || waits_for_budget(s));
            (settled && all.iter().any(waits_for_budget)).then_some(all)
        },
    )
    .await;
    let team = budget(&client, &ns.name, "team").await;
    let spent = tally.recorded_turns();
    println!(
        "held at {spent} tokens (budget 1000); Budget used {}",
        used(&team)
    );
    // Overshoot: at most one turn in flight per running session.
    assert!(
        spent >= 1000 && spent <= 1000 + SESSIONS as u64 * TURN_TOKENS,
        "{spent}"
    );
    assert_eq!(
        tally.reported(),
        spent,
        "no kills: every request recorded once"
    );
    let waiting = held.iter().find(|s| waits_for_budget(s)).unwrap();
    let message = &waiting
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "Waiting")
        .unwrap()
        .message;
    assert!(
        message.contains("Budget team is spent: used") && message.contains("of 1000 tokens"),
        "{message}"
    );
    wait_until(
        Duration::from_secs(30),
        "the Budget counts every turn",
        || async {
            (used(&budget(&client, &ns.name, "team").await) == tally.recorded_turns()).then_some(())
        },
    )
    .await;
    // The Budget's own reconcile writes its conditions after the charge
    // that spent it: moments later.
    wait_until(
        Duration::from_secs(30),
        "the Budget says it is exhausted",
        || async {
            let team = budget(&client, &ns.name, "team").await;
            let exhausted = condition(&team, "Exhausted").map(|c| c.status.clone());
            (exhausted.as_deref() == Some("True")).then_some(())
        },
    )
    .await;
    let table = kubectl_ok(["get", "budgets", "-n", &ns.name]);
    assert!(
        table.contains("USED") && table.contains("LIMIT") && table.contains("PERIOD"),
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("team"))
        .unwrap_or_default()
        .to_string();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells[1..4],
        [spent.to_string().as_str(), "1000", "day"],
        "{table}"
    );
    let nobody = wait_until(
        Duration::from_secs(30),
        "nobody's Selecting condition",
        || async {
            let b = budget(&client, &ns.name, "nobody").await;
            condition(&b, "Selecting").is_some().then_some(b)
        },
    )
    .await;
    let selecting = condition(&nobody, "Selecting").unwrap();
    assert_eq!(
        (selecting.status.as_str(), selecting.reason.as_str()),
        ("False", "NoSessionsMatch")
    );

    kubectl_ok([
        "patch",
        "budget",
        "team",
        "-n",
        &ns.name,
        "--type=merge",
        "-p",
        r#"{"spec":{"tokens":100000}}"#,
    ]);
    wait_until(
        Duration::from_secs(120),
        "all sessions succeeded after the raise",
        || async {
            let all = sessions(&client, &ns.name).await;
            (all.len() == SESSIONS && all.iter().all(succeeded)).then_some(())
        },
    )
    .await;
    let total = SESSIONS as u64 * TURNS as u64 * TURN_TOKENS;
    assert_eq!(tally.recorded_turns(), total);
    wait_until(
        Duration::from_secs(30),
        "the Budget counts all 6000 tokens",
        || async { (used(&budget(&client, &ns.name, "team").await) == total).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_count_is_exact_across_sigkills_of_two_racing_operators() {
    let Some((client, ns)) = support::cluster_namespace("budget-kills").await else {
        return;
    };
    let tally = Tally::default();
    let server = model(tally.clone());
    apply(&ns.name, &budget_yaml("team", 100_000, "a"));
    apply(&ns.name, &agent_and_sessions(&server));
    let start =
        |i: usize| launcher::Operator::watching(BIN, &ns.name, &format!("budget-kills-{i}"));
    let mut operators = [start(0), start(1)];
    let mut rng = support::rng::Rng::from_env_or_time();
    for k in 0..support::sized("AGENTS_BUDGET_KILLS", 5) {
        tokio::time::sleep(Duration::from_millis(rng.below(1500))).await;
        let i = k % 2;
        operators[i].kill();
        operators[i] = start(i);
    }
    wait_until(
        Duration::from_secs(180),
        "all sessions succeeded",
        || async {
            let all = sessions(&client, &ns.name).await;
            (all.len() == SESSIONS && all.iter().all(succeeded)).then_some(())
        },
    )
    .await;
    let recorded = tally.recorded_turns();
    assert_eq!(recorded, SESSIONS as u64 * TURNS as u64 * TURN_TOKENS);
    let by_sessions: u64 = sessions(&client, &ns.name)
        .await
        .iter()
        .map(|s| s.status.as_ref().map_or(0, |st| st.usage.total()))
        .sum();
    assert_eq!(
        by_sessions, recorded,
        "each session recorded each turn once"
    );
    let counted = wait_until(
        Duration::from_secs(30),
        "the Budget's count settles",
        || async {
            let b = budget(&client, &ns.name, "team").await;
            (used(&b) >= recorded).then_some(used(&b))
        },
    )
    .await;
    println!(
        "fake reported {} tokens ({} turns recorded); Budget used {counted}",
        tally.reported(),
        recorded
    );
    assert_eq!(
        counted, recorded,
        "every recorded turn counted exactly once"
    );
    let team = budget(&client, &ns.name, "team").await;
    assert_eq!(team.status.unwrap().charged.len(), SESSIONS);
}

#[tokio::test]
async fn bad_budgets_are_refused_at_admission_with_a_message() {
    let Some((_client, ns)) = support::cluster_namespace("budget-bad").await else {
        return;
    };
    for (spec, says) in [
        ("{tokens: -5}", "spec.tokens"),
        ("{tokens: 10000000000000}", "spec.tokens"),
        ("{cost: {amount: 5}}", "spec.cost.currency"),
        ("{cost: {amount: -1, currency: USD}}", "spec.cost.amount"),
        (
            "{cost: {amount: 5, currency: dollars}}",
            "spec.cost.currency",
        ),
        ("{period: day}", "a Budget bounds tokens, cost or both"),
    ] {
        let file = support::scratch::Scratch::new("budget-bad");
        let yaml = format!("apiVersion: agents-exe.io/v1alpha1\nkind: Budget\nmetadata: {{name: bad}}\nspec: {spec}\n");
        let path = file.write("b.yaml", &yaml);
        let out = kubectl(["apply", "-n", &ns.name, "-f", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{spec}: {err}");
    }
}

/// The reason and message of a session's `Ready` condition.
fn ready(s: &Session) -> Option<(String, String)> {
    let c = s
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.reason.clone(), c.message.clone()))
}

/// More Budgets than may select one session hold it before its first
/// model call, saying how many select it and what to do; once one is
/// deleted the Budget watch lets it run, without waiting for a recheck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_budgets_than_may_select_a_session_hold_it_until_one_goes() {
    let Some((client, ns)) = support::cluster_namespace("budget-cap").await else {
        return;
    };
    let tally = Tally::default();
    let server = model(tally.clone());
    let kubeconfig = support::kubeconfig_path().unwrap();
    let op = launcher::Operator::start(BIN, &ns.name, &kubeconfig, &["-n", &ns.name], &[]);
    let over = agents::api::namespace_budget::MAX_BUDGETS_PER_SESSION + 1;
    for i in 0..over {
        apply(&ns.name, &budget_yaml(&format!("b{i}"), 1_000_000, "a"));
    }
    apply(
        &ns.name,
        &format!(
            "{}---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: held, labels: {{team: a}}}}\nspec: {{agentRef: {{name: worker}}, messages: [\"work\"]}}\n",
            agent_yaml(&server)
        ),
    );
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    let message = wait_until(Duration::from_secs(60), "the session held", || async {
        let s = sessions.get("held").await.ok()?;
        ready(&s).filter(|(reason, _)| reason == "TooManyBudgets")
    })
    .await
    .1;
    assert!(
        message.contains(&format!("{over} Budgets select this session"))
            && message.contains(&format!("at most {}", over - 1))
            && message.contains("spec.selector"),
        "{message}"
    );
    assert_eq!(tally.reported(), 0, "no model call while held");
    kubectl_ok(["delete", "budget", "b0", "-n", &ns.name]);
    let deleted = std::time::Instant::now();
    wait_until(Duration::from_secs(45), "the session to finish", || async {
        sessions
            .get("held")
            .await
            .ok()
            .filter(succeeded)
            .map(|_| ())
    })
    .await;
    assert!(
        deleted.elapsed() < Duration::from_secs(30),
        "woken by its recheck, not by the Budget's deletion\n{}",
        op.log_text()
    );
}

/// The chart's operator RBAC for release `ns` with Budgets' list and
/// watch taken away (`get` kept), bound in `ns`, and a kubeconfig for its
/// service account; with the cluster-scoped objects to delete, and the
/// chart's own RBAC to grant them back.
fn operator_that_may_not_list_budgets(ns: &str) -> (PathBuf, support::ClusterScoped, String) {
    let scoped = support::ClusterScoped(vec![
        format!("clusterrole/{ns}-operator"),
        format!("clusterrole/{ns}-completer"),
    ]);
    let chart = support::helm_template(
        ns,
        ns,
        &[
            "--show-only",
            "templates/rbac.yaml",
            "--show-only",
            "templates/serviceaccount.yaml",
        ],
    );
    let mut lines: Vec<String> = chart.lines().map(str::to_string).collect();
    let rule = lines
        .iter()
        .position(|l| l.trim() == r#"resources: ["budgets"]"#)
        .unwrap_or_else(|| panic!("the chart has no Budget rule:\n{chart}"));
    let verbs = &mut lines[rule + 1];
    assert_eq!(
        verbs.trim(),
        r#"verbs: ["get", "list", "watch"]"#,
        "{chart}"
    );
    *verbs = verbs.replace(r#"["get", "list", "watch"]"#, r#"["get"]"#);
    let narrowed = lines.join("\n");
    apply(ns, &narrowed);
    kubectl_ok([
        "create",
        "rolebinding",
        "operator-here",
        "-n",
        ns,
        &format!("--clusterrole={ns}-operator"),
        &format!("--serviceaccount={ns}:{ns}-operator"),
    ]);
    let kubeconfig = support::service_account_kubeconfig(ns, &format!("{ns}-operator"));
    (kubeconfig, scoped, chart)
}

/// An operator that has not listed the Budgets cannot tell what a session
/// may spend: an empty cache is not "no Budget". One that may not list
/// them holds every session before its first model call (Ready=False,
/// BudgetsNotListed, saying what to check); once it may, the Budgets are
/// listed, the sessions run, and their Budget counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_wait_until_the_budgets_are_listed() {
    let Some((client, ns)) = support::cluster_namespace("budget-unlisted").await else {
        return;
    };
    let (kubeconfig, _scoped, chart) = operator_that_may_not_list_budgets(&ns.name);
    let tally = Tally::default();
    let server = model(tally.clone());
    apply(&ns.name, &budget_yaml("team", 1_000_000, "a"));
    let mut yaml = agent_yaml(&server);
    for i in 0..2 {
        yaml.push_str(&format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: s{i}, labels: {{team: a}}}}\nspec: {{agentRef: {{name: worker}}, messages: [\"work {i}\"]}}\n"
        ));
    }
    apply(&ns.name, &yaml);
    let _operator = launcher::Operator::start(BIN, &ns.name, &kubeconfig, &["-n", &ns.name], &[]);
    let held = wait_until(
        Duration::from_secs(60),
        "both sessions held until the Budgets are listed",
        || async {
            let all = sessions(&client, &ns.name).await;
            let reasons: Vec<_> = all.iter().filter_map(ready).collect();
            (reasons.len() == 2 && reasons.iter().all(|(r, _)| r == "BudgetsNotListed"))
                .then_some(reasons)
        },
    )
    .await;
    let message = &held[0].1;
    assert!(
        message.contains("list and watch budgets.agents-exe.io"),
        "{message}"
    );
    assert_eq!(
        tally.reported(),
        0,
        "no model call before the Budgets are listed"
    );

    apply(&ns.name, &chart);
    wait_until(
        Duration::from_secs(120),
        "both sessions succeeded once the Budgets could be listed",
        || async {
            let all = sessions(&client, &ns.name).await;
            (all.len() == 2 && all.iter().all(succeeded)).then_some(())
        },
    )
    .await;
    let total = 2 * TURNS as u64 * TURN_TOKENS;
    assert_eq!(tally.recorded_turns(), total);
    wait_until(
        Duration::from_secs(30),
        "the Budget counts both sessions",
        || async { (used(&budget(&client, &ns.name, "team").await) == total).then_some(()) },
    )
    .await;
}
