use super::*;

fn call(name: &str, args: &str) -> ToolCall {
    ToolCall {
        model_call_id: "m".into(),
        name: name.into(),
        arguments: args.into(),
    }
}

fn toolbox() -> Toolbox {
    let def = |name: &str, f: &str| ToolDef {
        name: name.into(),
        description: String::new(),
        parameters: None,
        kind: ToolKind::Builtin { function: f.into() },
    };
    Toolbox::new(vec![
        def("echo", "echo"),
        def("add", "add"),
        def("nap", "sleep"),
    ])
    .unwrap()
}

#[tokio::test]
async fn builtins_answer_and_bad_arguments_become_tool_errors() {
    let t = toolbox();
    assert_eq!(
        t.run(&call("echo", r#"{"text":"hi"}"#), "k", None).await,
        ToolResult::text("hi")
    );
    assert_eq!(
        t.run(&call("add", r#"{"a":2,"b":3}"#), "k", None).await,
        ToolResult::ok(ToolResponse::Json {
            content: json!(5.0)
        })
    );
    assert!(t.run(&call("add", "{oops"), "k", None).await.is_error());
    assert!(t.run(&call("nope", "{}"), "k", None).await.is_error());
    let slow = t
        .run(
            &call("nap", r#"{"ms":5000}"#),
            "k",
            Some(Duration::from_millis(20)),
        )
        .await;
    assert!(slow.is_error(), "{slow:?}");
}

#[test]
fn schemas_offer_name_description_and_parameters() {
    let t = Toolbox::new(vec![ToolDef {
        name: "echo".into(),
        description: "Echoes.".into(),
        parameters: Some(json!({"type": "object"})),
        kind: ToolKind::Builtin {
            function: "echo".into(),
        },
    }])
    .unwrap();
    assert_eq!(
        t.schemas(),
        [ToolSchema {
            name: "echo".into(),
            description: "Echoes.".into(),
            parameters: Some(json!({"type": "object"})),
        }]
    );
}

#[test]
fn an_unknown_builtin_is_refused_at_load_time() {
    let err = Toolbox::new(vec![ToolDef {
        name: "x".into(),
        description: String::new(),
        parameters: None,
        kind: ToolKind::Builtin {
            function: "rm_rf".into(),
        },
    }])
    .unwrap_err();
    assert!(err.to_string().contains("builtins: echo, add"), "{err}");
}

/// One HTTP request, read raw on a loopback socket; answers `ok`.
async fn capture_one_request() -> (String, tokio::task::JoinHandle<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/tool", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        // Headers end at a blank line; the small JSON body follows.
        while !String::from_utf8_lossy(&buf).contains("\r\n\r\n{") {
            let n = sock.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            .await
            .unwrap();
        String::from_utf8_lossy(&buf).to_lowercase()
    });
    (url, task)
}

#[tokio::test]
async fn http_tools_send_only_the_headers_their_definition_names() {
    use crate::core::policy::SecretKeyRef;
    let (url, seen) = capture_one_request().await;
    let headers = vec![
        EnvVarSpec {
            name: "X-Team".into(),
            value: Some("blue".into()),
            ..Default::default()
        },
        EnvVarSpec {
            name: "Authorization".into(),
            secret: Some(SecretKeyRef {
                name: "svc".into(),
                key: "token".into(),
            }),
            ..Default::default()
        },
    ];
    let lookup = |k: &str| (k == "AGENTS_SECRET_SVC_TOKEN").then(|| "Bearer s3cret".to_string());
    let args = Map::new();
    let result = Toolbox::default()
        .http_call(&url, &headers, &args, "s/t1-c0", &lookup)
        .await;
    assert_eq!(result, ToolResult::text("ok"));
    let request = seen.await.unwrap();
    let names: Vec<&str> = request
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':').map(|(n, _)| n))
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "accept",
            // identity: replies are asked for uncompressed (crate::http).
            "accept-encoding",
            "authorization",
            "content-length",
            "content-type",
            "host",
            "idempotency-key",
            "x-team"
        ],
        "{request}"
    );
    assert!(request.contains("x-team: blue") && request.contains("authorization: bearer s3cret"));
    // A secret the worker does not have is a tool error naming it.
    let missing = Toolbox::default()
        .http_call(&url, &headers, &args, "k", &|_| None)
        .await;
    assert!(
        matches!(&missing, ToolResult::Error { message } if message.contains("AGENTS_SECRET_SVC_TOKEN")),
        "{missing:?}"
    );
}

/// POSTs `url` with the default toolbox: no headers, no arguments.
async fn post_plainly(url: &str) -> ToolResult {
    Toolbox::default()
        .http_call(url, &[], &Map::new(), "k", &|_| None)
        .await
}

/// The error `url` answers with; any other result fails the test.
async fn error_from(url: String) -> String {
    match post_plainly(&url).await {
        ToolResult::Error { message } => message,
        other => panic!("{url}: {other:?}"),
    }
}

/// A 200 reply holding `body` as JSON.
fn json_reply(body: String) -> String {
    let mut raw = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    raw.push_str(&body);
    raw
}

#[tokio::test]
async fn an_http_reply_past_the_cap_is_refused() {
    use crate::http::tests::server;
    // 64 MiB streamed with no length: cut at the cap.
    let close = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n";
    let (port, _) = server(close.into(), 64 << 20).await;
    let e = error_from(format!("http://127.0.0.1:{port}/")).await;
    assert!(
        e.contains("sent a reply of more than 8388608 bytes (8 MiB), the most an http tool's reply may hold"),
        "{e}"
    );
}

#[tokio::test]
async fn an_http_error_page_is_quoted_in_a_short_excerpt() {
    use crate::http::tests::server;
    let (port, _) = server(
        "HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\n\r\n".into(),
        64 << 20,
    )
    .await;
    let e = error_from(format!("http://127.0.0.1:{port}/")).await;
    assert!(
        e.starts_with(&format!(
            "POST http://127.0.0.1:{port}/ answered 502 Bad Gateway: xxx"
        )),
        "{e}"
    );
    assert!(e.ends_with("… (cut)") && e.len() < 700, "{e}");
}

#[tokio::test]
async fn an_http_redirect_to_another_host_is_not_followed() {
    use crate::http::tests::server;
    use std::sync::atomic::Ordering;
    let (other, hits) = server(
        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n".into(),
        2,
    )
    .await;
    let (port, _) = server(
        format!("HTTP/1.1 302 Found\r\nlocation: http://localhost:{other}/\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"),
        0,
    )
    .await;
    let e = error_from(format!("http://127.0.0.1:{port}/")).await;
    assert!(e.contains("answered 302 Found, a redirect to"), "{e}");
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn http_json_under_the_cap_is_json_and_large_json_stays_text() {
    use crate::http::tests::server;
    let (port, _) = server(json_reply("[1, 2]".into()), 0).await;
    let small = post_plainly(&format!("http://127.0.0.1:{port}/")).await;
    assert_eq!(
        small,
        ToolResult::ok(ToolResponse::Json {
            content: json!([1, 2])
        })
    );
    let many = format!("[{}0]", "0,".repeat(JSON_PARSE_BYTES / 2));
    let (port, _) = server(json_reply(many.clone()), 0).await;
    let large = post_plainly(&format!("http://127.0.0.1:{port}/")).await;
    assert_eq!(large, ToolResult::text(many));
}

/// Serves every request with `answer(path)`, keeping the paths asked.
async fn path_server(
    answer: fn(&str) -> String,
) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let paths = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = paths.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let request = crate::http::tests::read_request(&mut sock).await;
            let line = String::from_utf8_lossy(&request).into_owned();
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let reply = answer(&path);
            seen.lock().unwrap().push(path);
            let _ = sock.write_all(reply.as_bytes()).await;
        }
    });
    (port, paths)
}

type AskedPaths = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// Two servers, only `/ok/*` of the first on the allow-list, and a
/// toolbox with a tool on each: `good` on the first, `bad` on `other`.
struct AllowListed {
    tools: Toolbox,
    port: u16,
    paths: AskedPaths,
    other: u16,
    other_paths: AskedPaths,
}

impl AllowListed {
    async fn start() -> Self {
        let (port, paths) = path_server(|path| match path {
            "/ok/bounce" => "HTTP/1.1 307 Temporary Redirect\r\nlocation: /admin\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into(),
            "/ok/hop" => "HTTP/1.1 307 Temporary Redirect\r\nlocation: /ok/there\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into(),
            _ => "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".into(),
        })
        .await;
        let (other, other_paths) = path_server(|_| {
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".into()
        })
        .await;
        let allowed = AllowedUrls::parse(&[format!("http://127.0.0.1:{port}/ok/*")]).unwrap();
        let http_tool = |name: &str, port: u16| ToolDef {
            name: name.into(),
            description: String::new(),
            parameters: None,
            kind: ToolKind::Http {
                url: format!("http://127.0.0.1:{port}/ok/x"),
                headers: vec![],
            },
        };
        let tools = Toolbox::new(vec![http_tool("good", port), http_tool("bad", other)])
            .unwrap()
            .with_allowed_urls(Some(std::sync::Arc::new(allowed)));
        AllowListed {
            tools,
            port,
            paths,
            other,
            other_paths,
        }
    }

    async fn post(&self, url: String) -> ToolResult {
        self.tools
            .http_call(&url, &[], &Map::new(), "k", &|_| None)
            .await
    }
}

#[tokio::test]
async fn an_allowed_url_is_called() {
    let servers = AllowListed::start().await;
    let port = servers.port;
    assert_eq!(
        servers.post(format!("http://127.0.0.1:{port}/ok/x")).await,
        ToolResult::text("ok")
    );
}

#[tokio::test]
async fn a_url_off_the_allow_list_is_refused_before_anything_is_sent() {
    let servers = AllowListed::start().await;
    let (port, other) = (servers.port, servers.other);
    // Another port, the same path.
    let refused = format!("http://127.0.0.1:{other}/ok/x");
    let ToolResult::Error { message } = servers.post(refused.clone()).await else {
        panic!("{refused} was called")
    };
    assert!(
        message.starts_with(&format!(
            "POST {refused} was refused: \"{refused}\" is not on the operator's allow-list"
        )) && message.contains("--http-tool-allowed-urls")
            && message.contains("operator.httpToolAllowedUrls"),
        "{message}"
    );
    // The allowed host's userinfo leads elsewhere: refused too.
    let ToolResult::Error { message } = servers
        .post(format!("http://127.0.0.1:{port}@127.0.0.1:{other}/ok/x"))
        .await
    else {
        panic!("userinfo led the call to another port")
    };
    assert!(
        message.contains("is not on the operator's allow-list"),
        "{message}"
    );
    assert!(servers.other_paths.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_redirect_is_followed_only_to_an_allowed_path() {
    let servers = AllowListed::start().await;
    let port = servers.port;
    assert_eq!(
        servers
            .post(format!("http://127.0.0.1:{port}/ok/hop"))
            .await,
        ToolResult::text("ok")
    );
    let ToolResult::Error { message } = servers
        .post(format!("http://127.0.0.1:{port}/ok/bounce"))
        .await
    else {
        panic!("the redirect was followed")
    };
    assert!(
        message.contains(&format!(
            "answered 307 Temporary Redirect, a redirect to \"http://127.0.0.1:{port}/admin\", which was not followed: \"http://127.0.0.1:{port}/admin\" is not on the operator's allow-list"
        )),
        "{message}"
    );
    // The path off the list is never asked.
    let paths = servers.paths.lock().unwrap();
    assert!(!paths.iter().any(|p| p == "/admin"), "{paths:?}");
}

#[tokio::test]
async fn an_agents_check_names_the_tool_whose_url_is_off_the_list() {
    let servers = AllowListed::start().await;
    let off: Vec<String> = servers
        .tools
        .urls_not_allowed()
        .into_iter()
        .map(|(t, _, _)| t)
        .collect();
    assert_eq!(off, ["bad"]);
    assert!(Toolbox::default().urls_not_allowed().is_empty());
}

#[test]
fn bad_or_reserved_headers_are_refused_at_load_time() {
    let with = |name: &str| {
        Toolbox::new(vec![ToolDef {
            name: "h".into(),
            description: String::new(),
            parameters: None,
            kind: ToolKind::Http {
                url: "http://127.0.0.1:1/".into(),
                headers: vec![EnvVarSpec {
                    name: name.into(),
                    value: Some("v".into()),
                    ..Default::default()
                }],
            },
        }])
    };
    assert!(with("X-Ok").is_ok());
    let e = with("Bad Header").unwrap_err().to_string();
    assert!(e.contains("not a valid HTTP header name"), "{e}");
    let e = with("Idempotency-Key").unwrap_err().to_string();
    assert!(e.contains("set by the runtime"), "{e}");
}
