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
