//! The approvals page (`agents ui`) in a real headless browser: Debian's
//! chromium and chromium-driver, driven by Selenium (tests/ui/click.py).
//! A session waits; the page shows it; a click approves it; the session
//! succeeds. A user without the right to decide sees the API server's
//! refusal on the page. Skipped without a cluster unless
//! AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::{kubectl, kubectl_ok, TestNamespace};

const BIN: &str = env!("CARGO_BIN_EXE_agents");

const SESSION: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: NAME}
spec:
  messages: ["publish the post"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: publish, arguments: {title: "<b>Hello</b>"}}]
          - text: published
    tools:
      - {name: publish, builtin: {function: echo}}
    policy:
      rules:
        - {tool: publish, disposition: runSync, approval: true}
"#;

/// `agents ui` on a free loopback port; stopped when dropped.
struct Page {
    child: Child,
    url: String,
}

impl Page {
    fn start(kubeconfig: &Path, ns: &str) -> Page {
        let port = support::launcher::free_port();
        let mut child = Command::new(BIN)
            .args(["ui", "--addr", &format!("127.0.0.1:{port}"), "-n", ns])
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}/");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Page { child, url };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("agents ui did not listen on {url}");
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the Selenium script; its stdout.
fn click(url: &str, token: &str, button: &str, screenshot: Option<&Path>) -> String {
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg(support::repo_root().join("tests/ui/click.py"))
        .args([url, token, button]);
    if let Some(s) = screenshot {
        cmd.arg(s);
    }
    let out = cmd
        .output()
        .expect("/usr/bin/python3 with python3-selenium");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "click.py: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn browser_present() -> bool {
    Path::new("/usr/bin/chromium").exists() && Path::new("/usr/bin/chromedriver").exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_click_on_the_page_approves_and_a_user_without_rights_sees_the_refusal() {
    let Some(client) = support::cluster().await else {
        return;
    };
    if !browser_present() {
        support::skip_or_fail::<()>("chromium and chromium-driver are not installed");
        return;
    }
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "ui").await;
    let apply = |name: &str| support::apply(&ns.name, &SESSION.replace("NAME", name));
    apply("post");
    apply("other");
    let admin = support::kubeconfig_path().unwrap();
    let _op = support::launcher::Operator::start(BIN, "ui", &admin, &["-n", &ns.name], &[]);
    for token in ["post-t1-c0", "other-t1-c0"] {
        let mut found = false;
        for _ in 0..240 {
            if kubectl(["get", "continuation", token, "-n", &ns.name])
                .status
                .success()
            {
                found = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        assert!(found, "{token} waits");
    }

    // Someone who may read calls but not decide them.
    kubectl_ok(["create", "serviceaccount", "viewer", "-n", &ns.name]);
    kubectl_ok([
        "create",
        "role",
        "viewer",
        "-n",
        &ns.name,
        "--verb=get,list,watch",
        "--resource=continuations.agents-exe.io,sessions.agents-exe.io,configmaps",
    ]);
    kubectl_ok([
        "create",
        "rolebinding",
        "viewer",
        "-n",
        &ns.name,
        "--role=viewer",
        &format!("--serviceaccount={}:viewer", ns.name),
    ]);
    let viewer = support::service_account_kubeconfig(&ns.name, "viewer");
    let page = Page::start(&viewer, &ns.name);
    let said = click(&page.url, "other-t1-c0", "approve", None);
    assert!(
        said.contains("shown: tool arguments conversation approve deny"),
        "{said}"
    );
    assert!(
        said.contains("after: error:") && said.to_lowercase().contains("forbidden"),
        "the viewer sees the API server's refusal: {said}"
    );
    drop(page);

    // The admin approves with a click; the session succeeds.
    let page = Page::start(&admin, &ns.name);
    let shot = std::env::temp_dir().join(format!("agents-ui-{}.png", ns.name));
    let said = click(&page.url, "post-t1-c0", "approve", Some(&shot));
    assert!(said.contains("after: ok"), "{said}");
    kubectl_ok([
        "wait",
        "-n",
        &ns.name,
        "--for=condition=Succeeded",
        "session/post",
        "--timeout=60s",
    ]);
    let by = kubectl_ok([
        "get",
        "continuation",
        "post-t1-c0",
        "-n",
        &ns.name,
        "-o",
        "jsonpath={.status.decision.by}",
    ]);
    assert_eq!(
        by.trim(),
        "kubernetes-admin",
        "signed with the page user's own name"
    );
    assert!(
        kubectl_ok([
            "get",
            "continuation",
            "other-t1-c0",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.status.decision}"
        ])
        .trim()
        .is_empty(),
        "the viewer's click decided nothing"
    );
    if let Ok(dir) = std::env::var("AGENTS_UI_SCREENSHOT") {
        std::fs::copy(&shot, dir).unwrap();
    }
    let _ = std::fs::remove_file(&viewer);
    ns.delete(&client).await;
}

/// An agent whose model calls the MCP server's `confirm` tool, a task that
/// asks a person before it ends, and `note`, which runs in the step (no
/// Event, no Continuation: its times come from the session's state).
fn asking_agent(url: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: asker}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls: [{{name: confirm, arguments: {{question: "ship it?"}}}}, {{name: note, arguments: {{text: noted}}}}]
        - text: shipped
  tools:
    - name: jobs
      mcp: {{url: "{url}", tools: [confirm]}}
    - {{name: note, builtin: {{function: echo}}}}
"#
    )
}

/// A session of `agent` whose message a hostile tenant wrote.
const HOSTILE: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: NAME}
spec:
  agentRef: {name: AGENT}
  messages: ["<script>alert('pwned')</script> ship the release"]
"#;

/// A call that waits for two approvals.
const QUORUM: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: vote}
spec:
  messages: ["deploy"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls: [{name: deploy, arguments: {to: "<i>prod</i>"}}]
          - text: deployed
    tools:
      - {name: deploy, builtin: {function: echo}}
    policy:
      rules:
        - {tool: deploy, disposition: runSync, approval: {quorum: 2}}
"#;

/// GET `path` of the console: status, headers' CSP, body.
async fn get(http: &reqwest::Client, base: &str, path: &str) -> (u16, String, String) {
    let r = http
        .get(format!("{}{}", base.trim_end_matches('/'), path))
        .send()
        .await
        .unwrap();
    let csp = r
        .headers()
        .get("content-security-policy")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.status().as_u16(), csp, r.text().await.unwrap())
}

/// The value of the first `name=` hidden input on a page.
fn hidden(page: &str, name: &str) -> String {
    let at = page
        .find(&format!("name={name} value=\""))
        .unwrap_or_else(|| panic!("no {name} in {page}"));
    let rest = &page[at + name.len() + 13..];
    rest[..rest.find('"').unwrap()].to_string()
}

/// Sessions named by the list's rows.
fn listed(page: &str) -> Vec<String> {
    page.split("<a class=session href=\"")
        .skip(1)
        .map(|r| {
            let text = &r[r.find('>').unwrap() + 1..];
            text[..text.find('<').unwrap()].to_string()
        })
        .collect()
}

/// The `next page` link's path, unescaped.
fn next_link(page: &str) -> Option<String> {
    let at = page.find("<a id=next href=\"")?;
    let rest = &page[at + 17..];
    Some(rest[..rest.find('"').unwrap()].replace("&amp;", "&"))
}

fn wait_jsonpath(ns: &str, what: &str, jsonpath: &str, want: &str) {
    for _ in 0..240 {
        let out = kubectl(["get", what, "-n", ns, "-o", &format!("jsonpath={jsonpath}")]);
        if String::from_utf8_lossy(&out.stdout).contains(want) {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("{what} never showed {want} at {jsonpath}");
}

/// The console end to end over HTTP: the sessions list pages through the
/// API and filters; the session page shows the timeline (a hostile
/// message as text), the chart, Events and lineage; the waiting calls show
/// quorum progress and arguments; an MCP task's question is answered on
/// the page and the session goes on. Screenshots of the three pages are
/// saved (to $AGENTS_UI_SCREENSHOTS when set: tests/ui/console-screenshots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_pages_sessions_shows_a_timeline_and_answers_a_task_on_the_page() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "console").await;
    let server = support::mcp::McpServer::start("console-task", &[]);
    let allowed = format!(
        "--http-tool-allowed-urls=http://127.0.0.1:{}/*",
        server.port
    );
    let admin = support::kubeconfig_path().unwrap();
    let _op = support::launcher::Operator::start(
        BIN,
        &format!("console-{}", ns.name),
        &admin,
        &["-n", &ns.name, &allowed],
        &[],
    );
    apply_console_sessions(&ns.name, &server.url());

    let page = Page::start(&admin, &ns.name);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    check_sessions_list(&http, &page.url, &ns.name).await;
    check_waiting_calls(&http, &page.url).await;
    let shots = Screenshots::new(&ns.name);
    shots.take(&page.url, &ns.name, "before");

    answer_the_task_on_the_page(&http, &page.url, &ns.name).await;
    check_session_page(&http, &page.url, &ns.name).await;
    shots.take(&page.url, &ns.name, "after");
    shots.publish();
    ns.delete(&client).await;
}

async fn check_sessions_list(http: &reqwest::Client, base: &str, ns: &str) {
    let (status, csp, first) = get(http, base, &format!("/sessions?ns={ns}&limit=2")).await;
    assert_eq!(status, 200, "{first}");
    assert!(
        csp.contains("default-src 'none'") && !csp.contains("script-src"),
        "{csp}"
    );
    assert!(
        !first.contains("<script"),
        "the console sends no script: {first}"
    );
    let mut seen = listed(&first);
    assert_eq!(seen.len(), 2, "{first}");
    let mut next = next_link(&first);
    while let Some(link) = next {
        let (_, _, more) = get(http, base, &link).await;
        seen.extend(listed(&more));
        next = next_link(&more);
    }
    seen.sort();
    assert_eq!(
        seen,
        ["ask", "idle-0", "idle-1", "idle-2", "vote"],
        "every session once, over pages"
    );
    let (_, _, waiting) = get(http, base, &format!("/sessions?ns={ns}&phase=Waiting")).await;
    let mut shown = listed(&waiting);
    shown.sort();
    assert_eq!(shown, ["ask", "vote"], "{waiting}");
    assert!(
        waiting.contains("matched here on each page: phase"),
        "{waiting}"
    );
    let (_, _, by_agent) = get(
        http,
        base,
        &format!("/sessions?ns={ns}&agent=absent&waitingFor="),
    )
    .await;
    assert_eq!(listed(&by_agent).len(), 3, "{by_agent}");
    let (status, _, bad) = get(http, base, "/sessions?phase=Done").await;
    assert!(status == 400 && bad.contains("Succeeded"), "{bad}");
}

async fn check_waiting_calls(http: &reqwest::Client, base: &str) {
    let (_, _, list) = get(http, base, "/").await;
    let row = list
        .split("<tr>")
        .find(|r| r.contains(">vote-t1-c0<"))
        .unwrap_or_else(|| panic!("vote-t1-c0 waits: {list}"));
    assert!(
        row.contains("<td class=quorum>0/2</td>"),
        "quorum progress: {row}"
    );
    assert!(
        row.contains("&lt;i&gt;prod&lt;/i&gt;"),
        "arguments, escaped: {row}"
    );
    assert!(
        row.contains("<td class=age>") && row.contains("s</td>"),
        "age: {row}"
    );
    assert!(
        list.contains(">ask-t1-c0<") && list.contains("mcpTask"),
        "{list}"
    );
}

async fn check_session_page(http: &reqwest::Client, base: &str, ns: &str) {
    let (status, _, s) = get(http, base, &format!("/session?ns={ns}&name=ask")).await;
    assert_eq!(status, 200, "{s}");
    assert!(
        s.contains("&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt; ship the release"),
        "the message shows as text: {s}"
    );
    assert!(!s.contains("<script>"), "{s}");
    assert!(
        s.contains("<svg id=chart") && s.contains("class=\"Deferred\""),
        "{s}"
    );
    let timeline = &s[s.find("<div id=timeline>").expect("a timeline")..];
    assert!(
        timeline.contains("confirm") && timeline.contains(">Completed<"),
        "{timeline}"
    );
    assert!(timeline.contains("completed by mcp-task"), "{timeline}");
    check_times(timeline);
    assert!(s.contains("<ul id=lineage><li>parent: none</li>"), "{s}");
    assert!(
        s.contains("<table id=events>") && s.contains("CallDeferred"),
        "{s}"
    );
    assert!(s.contains("<td id=phase>Succeeded</td>"), "{s}");
}

/// The runSync call `note` (no Event, no Continuation) shows when it
/// started and how long it took, and each model reply when it came: the
/// times are the session's own, and survive the status's schema.
fn check_times(timeline: &str) {
    let row = timeline
        .split("<tr>")
        .find(|r| r.starts_with("<td>t1-c1</td>"))
        .unwrap_or_else(|| panic!("the note call: {timeline}"));
    assert!(
        row.contains("runSync") && row.contains(">Completed<"),
        "{row}"
    );
    let cell = |class: &str| {
        let from = row
            .find(&format!("<td class={class}>"))
            .unwrap_or_else(|| panic!("{class}: {row}"));
        let rest = &row[from + class.len() + 11..];
        rest[..rest.find("</td>").unwrap()].to_string()
    };
    let year = k8s_openapi::jiff::Timestamp::now().to_string()[..4].to_string();
    assert!(cell("started").starts_with(&year), "a start time: {row}");
    let took = cell("took");
    assert!(
        took.ends_with("ms") || took.ends_with('s'),
        "a duration: {row}"
    );
    let replies = timeline.matches("<span class=\"muted at\">(").count();
    assert_eq!(replies, 2, "each model reply has its time: {timeline}");
}

/// Screenshots of the console's pages in headless Chromium, when present.
struct Screenshots {
    dir: std::path::PathBuf,
}

impl Screenshots {
    fn new(ns: &str) -> Screenshots {
        let dir = std::env::temp_dir().join(format!("agents-console-{ns}"));
        std::fs::create_dir_all(&dir).unwrap();
        Screenshots { dir }
    }

    fn take(&self, base: &str, ns: &str, when: &str) {
        if !browser_present() {
            return;
        }
        let pages: Vec<(String, &str)> = match when {
            "before" => vec![
                (format!("{base}sessions?ns={ns}"), "console-sessions.png"),
                (base.to_string(), "console-approvals.png"),
                (
                    format!("{base}call?ns={ns}&token=ask-t1-c0"),
                    "console-answer.png",
                ),
            ],
            _ => vec![(
                format!("{base}session?ns={ns}&name=ask"),
                "console-session.png",
            )],
        };
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.arg(support::repo_root().join("tests/ui/screenshot.py"));
        for (url, png) in &pages {
            cmd.arg(url).arg(self.dir.join(png));
        }
        let out = cmd
            .output()
            .expect("/usr/bin/python3 with python3-selenium");
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "screenshot.py: {said}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(said.matches("saved: ").count(), pages.len(), "{said}");
    }

    /// Copies the screenshots to $AGENTS_UI_SCREENSHOTS (the book's images).
    fn publish(&self) {
        let Ok(to) = std::env::var("AGENTS_UI_SCREENSHOTS") else {
            return;
        };
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, Path::new(&to).join(path.file_name().unwrap())).unwrap();
        }
    }
}

/// The sessions the console test looks at: one whose MCP task asks a
/// person (its message hostile), one waiting for two approvals, and three
/// whose Agent does not exist; returns once the two wait.
fn apply_console_sessions(ns: &str, url: &str) {
    support::apply(ns, &asking_agent(url));
    support::apply(
        ns,
        &HOSTILE.replace("NAME", "ask").replace("AGENT", "asker"),
    );
    support::apply(ns, QUORUM);
    for i in 0..3 {
        let name = format!("idle-{i}");
        support::apply(
            ns,
            &HOSTILE.replace("NAME", &name).replace("AGENT", "absent"),
        );
    }
    wait_jsonpath(
        ns,
        "continuation/vote-t1-c0",
        "{.status.waitingFor}",
        "approval",
    );
    wait_jsonpath(
        ns,
        "session/ask",
        "{.status.state.open.calls[0].taskAsks}",
        "ship it?",
    );
}

/// The MCP task's question, answered on the page: malformed answers get
/// the CLI's own refusal; good ones move the session to its end.
async fn answer_the_task_on_the_page(http: &reqwest::Client, base: &str, ns: &str) {
    let (_, _, call) = get(http, base, &format!("/call?ns={}&token=ask-t1-c0", ns)).await;
    assert!(
        call.contains("<pre id=asks>") && call.contains("ship it?"),
        "{call}"
    );
    let form = [
        ("csrf", hidden(&call, "csrf")),
        ("ns", ns.to_string()),
        ("token", "ask-t1-c0".to_string()),
        ("action", "answer".to_string()),
        ("answers", "not json".to_string()),
    ];
    let bad = http
        .post(format!("{}decide", base))
        .form(&form)
        .send()
        .await
        .unwrap();
    let said = bad.text().await.unwrap();
    assert!(
        said.contains("the answers are not JSON"),
        "the CLI's check, on the page: {said}"
    );
    let mut form = form;
    form[4].1 = r#"{"q1": {"action": "accept", "content": {"ok": true}}}"#.into();
    let done = http
        .post(format!("{}decide", base))
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(
        done.status().as_u16(),
        303,
        "{}",
        done.text().await.unwrap()
    );
    kubectl_ok([
        "wait",
        "-n",
        ns,
        "--for=condition=Succeeded",
        "session/ask",
        "--timeout=60s",
    ]);
    let by = kubectl_ok([
        "get",
        "continuation",
        "ask-t1-c0",
        "-n",
        ns,
        "-o",
        "jsonpath={.status.answers.by}",
    ]);
    assert_eq!(
        by.trim(),
        "kubernetes-admin",
        "signed with the page user's name"
    );
}
