//! The `mcp` tool kind in a cluster, against the real MCP server
//! (tests/mcp/server.py, the official Python SDK, on loopback where the
//! operator runs): the Agent controller lists the server's tools into the
//! Agent's status (names, schemas, the revision spoken); a Session of the
//! agent calls one tool runSync and one runAsync, with a header from an
//! opted-in Secret, and succeeds with both results; an `isError` result
//! reaches the model as an error; the book's example Agent
//! (docs/src/tools/mcp.md) works as written (but for the port); a server
//! whose URL the operator's allow-list does not hold makes its Agent not
//! Ready, and is never asked.

use crate::support;

use serde_json::Value;
use support::launcher::Operator;
use support::mcp::McpServer;
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

fn apply(ns: &str, name: &str, yaml: &str) {
    let file = std::env::temp_dir().join(format!("agents-mcp-{ns}-{name}.yaml"));
    std::fs::write(&file, yaml).unwrap();
    kubectl_ok(["apply", "-n", ns, "-f", file.to_str().unwrap()]);
}

fn wait_for(ns: &str, what: &str, jsonpath: &str) {
    let out = kubectl([
        "wait",
        "-n",
        ns,
        &format!("--for=jsonpath={jsonpath}"),
        what,
        "--timeout=90s",
    ]);
    let status = kubectl_ok(["get", "-n", ns, what, "-o", "jsonpath={.status}"]);
    assert!(
        out.status.success(),
        "{what}: {jsonpath}: {}\nstatus: {status}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn get_json(ns: &str, what: &str) -> Value {
    serde_json::from_str(&kubectl_ok(["get", "-n", ns, what, "-o", "json"])).unwrap()
}

/// Every tool result in a Session's status, by tool name.
/// Each tool result in a Session's status, with its tool's name: a result
/// stores its call's id (`t<turn>-c<index>`) and the reply holds the call
/// (the status stores each tool call once).
fn results(status: &Value, out: &mut Vec<(String, Value)>) {
    let turns = status["state"]["turns"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for r in turns
        .iter()
        .flat_map(|t| t["toolResults"].as_array().into_iter().flatten())
    {
        let id = r["callId"].as_str().unwrap_or_default();
        out.push((tool_of(status, id), r["result"].clone()));
    }
}

/// The tool the call `id` (`t<turn>-c<index>`) named, read from its reply.
fn tool_of(status: &Value, id: &str) -> String {
    let (turn, index) = id
        .strip_prefix('t')
        .and_then(|rest| rest.split_once("-c"))
        .and_then(|(t, c)| Some((t.parse::<usize>().ok()?, c.parse::<usize>().ok()?)))
        .unwrap_or_else(|| panic!("not a call id: {id:?}"));
    let turns = status["state"]["turns"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let reply = turns
        .iter()
        .filter(|t| t["role"] == "agent")
        .nth(turn - 1)
        .unwrap_or_else(|| panic!("no reply {turn}: {status}"));
    reply["toolCalls"][index]["name"]
        .as_str()
        .unwrap_or_else(|| panic!("no call {id}: {status}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_mcp_tools_are_listed_in_its_status_and_called_sync_and_async() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "mcp").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let server = McpServer::start("cluster", &[]);
    let off_list = McpServer::start("cluster-off-list", &["--legacy"]);
    kubectl_ok([
        "create",
        "secret",
        "generic",
        "mcp",
        "-n",
        &ns.name,
        "--from-literal=token=Bearer from-the-secret-51c",
    ]);
    kubectl_ok([
        "label",
        "secret",
        "mcp",
        "-n",
        &ns.name,
        "agents-exe.io/usable-by-agents=true",
    ]);
    let allowed = format!(
        "--http-tool-allowed-urls=http://127.0.0.1:{}/*",
        server.port
    );
    let op = Operator::start(
        BIN,
        &format!("mcp-{}", ns.name),
        &kubeconfig,
        &["-n", &ns.name, &allowed],
        &[],
    );
    apply(
        &ns.name,
        "agent",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: calc}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: add, arguments: {{a: 20, b: 22}}}}
            - {{name: slow_echo, arguments: {{text: later, ms: 300}}}}
            - {{name: refuse, arguments: {{reason: policy}}}}
        - text: done
  policy:
    rules:
      - {{tool: slow_echo, disposition: runAsync}}
  tools:
    - name: calc-server
      mcp:
        url: "{url}"
        tools: [add, slow_echo, refuse]
        headers:
          - name: Authorization
            valueFrom: {{secretKeyRef: {{name: mcp, key: token}}}}
"#,
            url = server.url()
        ),
    );
    wait_for(
        &ns.name,
        "agent/calc",
        "{.status.conditions[?(@.type==\"Ready\")].status}=True",
    );
    let agent = get_json(&ns.name, "agent/calc");
    let status = &agent["status"];
    assert_eq!(status["mcpServers"][0]["name"], "calc-server", "{status}");
    assert_eq!(status["mcpServers"][0]["protocolVersion"], "2026-07-28");
    assert_eq!(status["mcpServers"][0]["tools"], 3);
    let tools: Vec<&str> = status["mcpTools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(tools, ["add", "slow_echo", "refuse"], "{status}");
    let add = &status["mcpTools"][0];
    assert_eq!(add["server"], "calc-server");
    assert_eq!(add["description"], "Adds two integers.");
    assert_eq!(add["inputSchema"]["properties"]["b"]["type"], "integer");

    apply(
        &ns.name,
        "session",
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: sum}
spec:
  agentRef: {name: calc}
  messages: ["what is 20 + 22?"]
"#,
    );
    wait_for(
        &ns.name,
        "session/sum",
        "{.status.conditions[?(@.type==\"Succeeded\")].status}=True",
    );
    let session = get_json(&ns.name, "session/sum");
    let mut found = Vec::new();
    results(&session["status"], &mut found);
    let result = |tool: &str| {
        found
            .iter()
            .find(|(t, _)| t == tool)
            .map(|(_, r)| r.clone())
            .unwrap_or_else(|| panic!("no result of {tool}: {found:?}"))
    };
    assert_eq!(result("add")["response"]["content"], "42", "{found:?}");
    assert_eq!(result("slow_echo")["response"]["content"], "later");
    assert_eq!(result("refuse")["status"], "error");
    assert!(
        result("refuse")["message"]
            .as_str()
            .unwrap()
            .contains("refused: policy"),
        "{found:?}"
    );
    // The runAsync call waited on a Continuation (its token); the runSync
    // ones did not.
    let text = session.to_string();
    assert!(text.contains(r#""token":"sum-t1-c1""#), "{text}");
    assert_eq!(tool_of(&session["status"], "t1-c1"), "slow_echo");
    assert!(!text.contains("sum-t1-c0"), "{text}");
    assert!(
        !text.contains("from-the-secret-51c"),
        "the secret is in the Session"
    );
    let calls = server.calls();
    let called: Vec<&str> = calls.iter().map(|c| c["tool"].as_str().unwrap()).collect();
    let mut sorted = called.clone();
    sorted.sort();
    assert_eq!(sorted, ["add", "refuse", "slow_echo"], "{calls:?}");
    for c in &calls {
        assert_eq!(c["authorization"], "Bearer from-the-secret-51c", "{c}");
        assert_eq!(c["protocolVersion"], "2026-07-28");
    }

    // The book's example (docs/src/tools/mcp.md), as written but for the server's port, works.
    let chapter =
        std::fs::read_to_string(support::repo_root().join("docs/src/tools/mcp.md")).unwrap();
    let section = &chapter[chapter.find("# MCP tools").unwrap()..];
    let example = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap()
        .replace("http://127.0.0.1:8000/mcp", &server.url())
        .replace("name: calc}", "name: readme}");
    apply(&ns.name, "readme", &example);
    wait_for(
        &ns.name,
        "agent/readme",
        "{.status.conditions[?(@.type==\"Ready\")].status}=True",
    );
    let listed = kubectl_ok([
        "get",
        "-n",
        &ns.name,
        "agent/readme",
        "-o",
        "jsonpath={.status.mcpTools[*].name}",
    ]);
    assert_eq!(listed, "add slow_echo");
    apply(
        &ns.name,
        "readme-session",
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: readme}\nspec: {agentRef: {name: readme}, messages: [go]}\n",
    );
    wait_for(
        &ns.name,
        "session/readme",
        "{.status.conditions[?(@.type==\"Succeeded\")].status}=True",
    );

    // A server off the allow-list: the Agent is not Ready, and says why.
    apply(
        &ns.name,
        "blocked",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: blocked}}
spec:
  model: {{provider: scripted, scripted: {{replies: [{{text: ok}}]}}}}
  tools:
    - name: elsewhere
      mcp: {{url: "{url}"}}
"#,
            url = off_list.url()
        ),
    );
    wait_for(
        &ns.name,
        "agent/blocked",
        "{.status.conditions[?(@.type==\"Ready\")].reason}=McpServerUrlNotAllowed",
    );
    let blocked = get_json(&ns.name, "agent/blocked");
    let message = blocked["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("mcp server \"elsewhere\"")
            && message.contains("is not on the operator's allow-list")
            && message.contains("--http-tool-allowed-urls"),
        "{message}"
    );
    assert!(blocked["status"]["conditions"][0]["status"] == "False");
    assert!(off_list.calls().is_empty());
    assert!(
        off_list
            .log_text()
            .lines()
            .all(|l| !l.contains("session ID")),
        "{}",
        off_list.log_text()
    );
    drop(op);
    ns.delete(&client).await;
}

/// `agents --store kube -n NS ARGS`, as the admin user; its stdout.
fn agents_ok(ns: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(BIN)
        .args(args)
        .args(["--store", "kube", "-n", ns])
        .env("KUBECONFIG", support::kubeconfig_path().unwrap())
        .env_remove("AGENTS_STORE")
        .env_remove("AGENTS_NAMESPACE")
        .output()
        .expect("run agents");
    assert!(
        out.status.success(),
        "agents {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `what` until `ready` holds of its JSON (60 s).
fn wait_until(ns: &str, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let v = get_json(ns, what);
        if ready(&v) {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never got there: {v}"
        );
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

fn has_finalizer(v: &Value) -> bool {
    v["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == "agents-exe.io/cancel-mcp-tasks"))
}

/// An Agent named `name` whose model calls `calls` (YAML flow list) and
/// then answers `answer`, with the MCP server's task tools.
fn task_agent(url: &str, name: &str, calls: &str, answer: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: {name}}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: {calls}
        - text: {answer}
  tools:
    - name: jobs
      mcp: {{url: "{url}", tools: [add, long_job, confirm]}}
"#
    )
}

fn session_of(name: &str, agent: &str) -> String {
    format!(
        "apiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: {name}}}\nspec: {{agentRef: {{name: {agent}}}, messages: [go]}}\n"
    )
}

/// The requested flow where the deferred call is an MCP task: the server
/// answers `long_job` with a task; the operator is SIGKILLed while it
/// runs; the new one polls the task from the Session's status (no second
/// `tools/call`) and the model gets its result once. A task that asks for
/// input is answered with `agents session answer` (delivered by
/// `tasks/update`); a session deleted while its task runs sends
/// `tasks/cancel` before it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_task_survives_an_operator_kill_takes_a_persons_answer_and_is_cancelled_on_deletion()
{
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "mcptask").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let server = McpServer::start("cluster-task", &[]);
    let url = server.url();
    let allowed = format!(
        "--http-tool-allowed-urls=http://127.0.0.1:{}/*",
        server.port
    );
    let args = ["-n", ns.name.as_str(), allowed.as_str()];
    let name = format!("mcptask-{}", ns.name);
    let mut op = Operator::start(BIN, &name, &kubeconfig, &args, &[]);
    let calls = "[{name: add, arguments: {a: 1, b: 2}}, {name: long_job, arguments: {text: report, ms: 6000}}]";
    apply(&ns.name, "a1", &task_agent(&url, "jobs", calls, "done"));
    apply(&ns.name, "s1", &session_of("flow", "jobs"));
    let waiting = wait_until(&ns.name, "session/flow", |v| {
        v["status"]["state"]["open"]["calls"][1]["waitingFor"] == "mcpTask"
    });
    let task = waiting["status"]["state"]["open"]["calls"][1]["task"]["id"].clone();
    assert!(task.is_string(), "{waiting}");
    let cont = wait_until(&ns.name, "continuation/flow-t1-c1", |v| {
        v["status"]["waitingFor"] == "mcpTask"
    });
    assert!(
        cont["status"]["reason"]
            .as_str()
            .unwrap()
            .contains(task.as_str().unwrap()),
        "{cont}"
    );
    wait_until(&ns.name, "session/flow", has_finalizer);
    op.kill();
    op = Operator::start(BIN, &format!("{name}-2"), &kubeconfig, &args, &[]);
    wait_for(
        &ns.name,
        "session/flow",
        "{.status.conditions[?(@.type==\"Succeeded\")].status}=True",
    );
    let session = get_json(&ns.name, "session/flow");
    let mut found = Vec::new();
    results(&session["status"], &mut found);
    let long = found
        .iter()
        .find(|(t, _)| t == "long_job")
        .expect("long_job's result");
    assert_eq!(long.1["response"]["content"], "done: report", "{found:?}");
    assert!(
        !has_finalizer(&session),
        "the finalizer goes once no task is open"
    );
    let cont = get_json(&ns.name, "continuation/flow-t1-c1");
    assert_eq!(
        cont["status"]["outcome"]["completedBy"], "mcp-task",
        "{cont}"
    );
    let log = server.calls();
    let started = log.iter().filter(|c| c["tool"] == "long_job").count();
    assert_eq!(started, 1, "one tools/call across the kill: {log:?}");
    let polls = log
        .iter()
        .filter(|c| c["method"] == "tasks/get" && c["taskId"] == task)
        .count();
    assert!(polls >= 2, "polled by both operators: {log:?}");

    // A task that asks a person.
    let ask = "[{name: confirm, arguments: {question: 'ship it?'}}]";
    apply(&ns.name, "a2", &task_agent(&url, "asker", ask, "shipped"));
    apply(&ns.name, "s2", &session_of("ask", "asker"));
    let asking = wait_until(&ns.name, "session/ask", |v| {
        v["status"]["state"]["open"]["calls"][0]["taskAsks"].is_string()
    });
    let asks = asking["status"]["state"]["open"]["calls"][0]["taskAsks"]
        .as_str()
        .unwrap();
    assert!(asks.contains("ship it?"), "{asks}");
    let shown = agents_ok(&ns.name, &["session", "pending", "ask"]);
    assert!(shown.contains("agents session answer ask-t1-c0"), "{shown}");
    let answered = agents_ok(
        &ns.name,
        &[
            "session",
            "answer",
            "ask-t1-c0",
            r#"{"q1": {"action": "accept", "content": {"ok": true}}}"#,
        ],
    );
    assert!(answered.contains("answered ask-t1-c0"), "{answered}");
    wait_for(
        &ns.name,
        "session/ask",
        "{.status.conditions[?(@.type==\"Succeeded\")].status}=True",
    );
    let mut found = Vec::new();
    results(&get_json(&ns.name, "session/ask")["status"], &mut found);
    let confirmed = found
        .iter()
        .find(|(t, _)| t == "confirm")
        .expect("confirm's result");
    assert!(
        confirmed.1["response"]["content"]
            .as_str()
            .unwrap()
            .contains(r#""ok": true"#),
        "{found:?}"
    );
    let updates = server
        .calls()
        .into_iter()
        .filter(|c| c["method"] == "tasks/update")
        .count();
    assert!(updates >= 1, "the answers went back with tasks/update");

    // Deleting a session whose task runs cancels the task.
    let slow = "[{name: long_job, arguments: {text: never, ms: 600000}}]";
    apply(&ns.name, "a3", &task_agent(&url, "slow", slow, "never"));
    apply(&ns.name, "s3", &session_of("doomed", "slow"));
    let doomed = wait_until(&ns.name, "session/doomed", |v| {
        has_finalizer(v) && v["status"]["state"]["open"]["calls"][0]["waitingFor"] == "mcpTask"
    });
    let task = doomed["status"]["state"]["open"]["calls"][0]["task"]["id"].clone();
    kubectl_ok(["delete", "-n", &ns.name, "session/doomed", "--timeout=60s"]);
    let cancels: Vec<Value> = server
        .calls()
        .into_iter()
        .filter(|c| c["method"] == "tasks/cancel")
        .collect();
    assert_eq!(cancels.len(), 1, "{cancels:?}");
    assert_eq!(cancels[0]["taskId"], task);
    drop(op);
    ns.delete(&client).await;
}

/// A session deleted while its call is making an MCP task (the server has
/// made it and not yet answered with its handle) still cancels the task:
/// the session held its finalizer before the step began, so the handle is
/// recorded and the deletion waits for the cancel. Before, the finalizer
/// came after the step, and such a task was orphaned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_deleted_while_its_call_makes_a_task_cancels_that_task() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "mcprace").await;
    let kubeconfig = support::kubeconfig_path().unwrap();
    let server = McpServer::start("cluster-task-race", &[]);
    let allowed = format!(
        "--http-tool-allowed-urls=http://127.0.0.1:{}/*",
        server.port
    );
    let args = ["-n", ns.name.as_str(), allowed.as_str()];
    let _op = Operator::start(
        BIN,
        &format!("mcprace-{}", ns.name),
        &kubeconfig,
        &args,
        &[],
    );
    let slow = "[{name: long_job, arguments: {text: never, ms: 600000, delay_ms: 4000}}]";
    apply(
        &ns.name,
        "a",
        &task_agent(&server.url(), "slow", slow, "never"),
    );
    apply(&ns.name, "s", &session_of("racing", "slow"));
    let created = wait_for_call(&server, "task created");
    kubectl_ok(["delete", "-n", &ns.name, "session/racing", "--wait=false"]);
    kubectl_ok([
        "wait",
        "--for=delete",
        "-n",
        &ns.name,
        "session/racing",
        "--timeout=60s",
    ]);
    let cancels: Vec<Value> = server
        .calls()
        .into_iter()
        .filter(|c| c["method"] == "tasks/cancel")
        .collect();
    assert_eq!(
        cancels.len(),
        1,
        "the task made as the session was deleted is cancelled once: {:?}",
        server.calls()
    );
    assert_eq!(cancels[0]["taskId"], created["taskId"]);
    ns.delete(&client).await;
}

/// The first entry of the server's log whose method is `method` (60 s).
fn wait_for_call(server: &McpServer, method: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(c) = server.calls().into_iter().find(|c| c["method"] == method) {
            return c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {method} in {:?}",
            server.calls()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
