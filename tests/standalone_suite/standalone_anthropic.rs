//! The real Anthropic client against a local fake of the Messages API that
//! checks each request's shape (`support::anthropic`), and the Azure
//! OpenAI option against a local chat-completions server.
//!
//! - Through the CLI: the acceptance flow (one model turn with three tool
//!   calls, one run now, one in the background, one deferred to an outside
//!   party; the results go back as `tool_result` blocks; a final answer),
//!   the key from the environment sent as `x-api-key` and never stored; a
//!   529 with `retry-after` retried; Azure's `api-key` header and
//!   `api-version` query; every example under `examples/models/` runs.
//! - At the adapter: 429 and 529 with `retry-after`, a 401 that names the
//!   Secret and hides the key, a reply cut at `max_tokens`.

use crate::support;

use agents::core::{ToolSchema, Turn, UserTurn};
use agents::model::{AnthropicModel, ModelError, ModelRequest};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::anthropic::*;
use support::http::{Response, Server};
use support::scratch::*;

const KEY: &str = "sk-ant-test-123";
const OTHER_KEY: &str = "sk-openai-not-for-anthropic";

/// A Session `trio` of an Anthropic agent at `base_url`, with `tools`
/// (YAML lines under `agent:`).
fn session_yaml(base_url: &str, tools: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: trio}}
spec:
  messages: ["do three things"]
  agent:
    systemPrompt: You are terse.
    model:
      provider: anthropic
      anthropic:
        baseUrl: {base_url}
        model: claude-test
        maxTokens: 512
        apiKeySecretRef: {{name: anthropic, key: api-key}}
{tools}"#
    )
}

/// `now` runs at once, `later` in the background, `ask` waits for an
/// outside party.
const THREE_TOOLS: &str = r#"    tools:
      - name: now
        description: Runs now.
        parameters: {type: object, properties: {what: {type: string}}}
        builtin: {function: echo}
      - {name: later, builtin: {function: echo}}
      - {name: ask, builtin: {function: echo}}
    policy:
      default: runSync
      rules:
        - {tool: later, disposition: runAsync}
        - {tool: ask, disposition: defer, reason: a person answers}
"#;

/// `agents ARGS` with the Anthropic key (and another provider's key, which
/// must never be sent) in the environment; its JSON events.
fn agents(s: &Scratch, args: &[&str]) -> (Run, Value) {
    let out = s
        .cmd(args)
        .env("AGENTS_SECRET_ANTHROPIC_API_KEY", KEY)
        .env("OPENAI_API_KEY", OTHER_KEY)
        .output()
        .unwrap();
    let run = Run::from(out, args);
    let last = run.ok().lines().last().unwrap_or_default().to_string();
    let event = serde_json::from_str(&last).unwrap_or_else(|_| panic!("{last}"));
    (run, event)
}

fn first_reply() -> Answer {
    message(
        json!([
            text("Three things."),
            tool_use("toolu_1", "now", json!({"what": "first"})),
            tool_use("toolu_2", "later", json!({"what": "second"})),
            tool_use("toolu_3", "ask", json!({"what": "third"})),
        ]),
        "tool_use",
        json!({"input_tokens": 20, "output_tokens": 30,
               "cache_creation_input_tokens": 100, "cache_read_input_tokens": 0}),
    )
}

#[test]
fn the_acceptance_flow_runs_against_the_messages_api() {
    let fake = FakeAnthropic::start(
        KEY,
        vec![
            first_reply(),
            message(
                json!([text("All three done.")]),
                "end_turn",
                json!({"input_tokens": 40, "output_tokens": 5,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100}),
            ),
        ],
    );
    let s = Scratch::new("anthropic");
    let file = s.write("a.yaml", &session_yaml(&fake.base_url(), THREE_TOOLS));
    let (_, yielded) = agents(
        &s,
        &["run", "-f", &file.display().to_string(), "-o", "json"],
    );
    assert_eq!(yielded["event"], "yielded", "{yielded}");
    let pending = yielded["pending"].as_array().unwrap();
    assert_eq!(pending.len(), 1, "only `ask` waits: {yielded}");
    let token = pending[0]["token"].as_str().unwrap();
    s.run(&["session", "complete", token, "--text", "third done"])
        .ok();
    let (_, finished) = agents(&s, &["session", "resume", "trio", "-o", "json"]);
    assert_eq!(finished["event"], "finished", "{finished}");

    assert_eq!(fake.violations(), Vec::<String>::new());
    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let body = requests[1].json();
    assert_eq!(body["system"], "You are terse.");
    assert_eq!(body["max_tokens"], 512);
    assert_eq!(body["model"], "claude-test");
    let tools = body["tools"].as_array().unwrap();
    let now = tools.iter().find(|t| t["name"] == "now").unwrap();
    assert_eq!(now["input_schema"]["properties"]["what"]["type"], "string");
    assert_eq!(tools.len(), 3);
    let messages = body["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    let results: Vec<(&str, &str)> = messages[2]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["tool_use_id"].as_str().unwrap(),
                b["content"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        results,
        [
            ("toolu_1", r#"{"what":"first"}"#),
            ("toolu_2", r#"{"what":"second"}"#),
            ("toolu_3", "third done")
        ]
    );
    assert!(requests.iter().all(|r| r.header("x-api-key") == Some(KEY)));

    let (_, shown) = agents(&s, &["session", "show", "trio", "-o", "json"]);
    assert_eq!(shown["session"]["answer"], "All three done.", "{shown}");
    // input + cache written + cache read, over both turns.
    assert_eq!(
        shown["session"]["usage"]["promptTokens"],
        120 + 140,
        "{shown}"
    );
    assert_eq!(shown["session"]["usage"]["completionTokens"], 35, "{shown}");
    assert_key_never_stored(&s);
}

fn assert_key_never_stored(s: &Scratch) {
    let db = std::fs::read(s.path("agents.db")).unwrap();
    let wal = std::fs::read(s.path("agents.db-wal")).unwrap_or_default();
    for bytes in [db, wal] {
        let text = String::from_utf8_lossy(&bytes).into_owned();
        assert!(
            !text.contains(KEY) && !text.contains(OTHER_KEY),
            "a key was stored"
        );
    }
}

#[test]
fn an_overloaded_api_is_asked_again_after_its_retry_after() {
    let fake = FakeAnthropic::start(
        KEY,
        vec![
            Answer(
                529,
                vec![("retry-after", "2".into())],
                error_body("overloaded_error", "Overloaded"),
            ),
            message(
                json!([text("made it")]),
                "end_turn",
                json!({"input_tokens": 1, "output_tokens": 1}),
            ),
        ],
    );
    let s = Scratch::new("anthropic-529");
    let file = s.write("a.yaml", &session_yaml(&fake.base_url(), ""));
    let started = Instant::now();
    let (run, finished) = agents(
        &s,
        &["run", "-f", &file.display().to_string(), "-o", "json"],
    );
    let took = started.elapsed();
    assert_eq!(finished["event"], "finished", "{}", run.stdout);
    assert!(
        took >= Duration::from_secs(2),
        "retry-after honoured: {took:?}"
    );
    assert!(run.stdout.contains("529"), "{}", run.stdout);
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(fake.violations(), Vec::<String>::new());
}

fn client(fake: &FakeAnthropic) -> AnthropicModel {
    AnthropicModel::new(
        &fake.base_url(),
        "claude-test",
        64,
        Some(KEY.into()),
        Duration::from_secs(10),
    )
}

async fn ask(m: &AnthropicModel) -> Result<agents::core::AgentTurn, ModelError> {
    let turns = vec![Turn::User(UserTurn {
        message: Some("hi".into()),
        tool_results: vec![],
    })];
    let tools = [ToolSchema {
        name: "echo".into(),
        description: String::new(),
        parameters: None,
    }];
    m.reply(&ModelRequest {
        system_prompt: "",
        turns: &turns,
        tools: &tools,
    })
    .await
}

#[tokio::test]
async fn rate_limits_and_overload_are_retryable_with_retry_after() {
    let fake = FakeAnthropic::start(
        KEY,
        vec![
            Answer(
                429,
                vec![("retry-after", "7".into())],
                error_body(
                    "rate_limit_error",
                    "Number of request tokens has exceeded your rate limit",
                ),
            ),
            Answer(
                529,
                vec![("retry-after", "3".into())],
                error_body("overloaded_error", "Overloaded"),
            ),
            Answer(529, vec![], error_body("overloaded_error", "Overloaded")),
            message(
                json!([text("fine")]),
                "end_turn",
                json!({"input_tokens": 1, "output_tokens": 1}),
            ),
        ],
    );
    let m = client(&fake);
    let limited = ask(&m).await.unwrap_err();
    println!("{limited}");
    assert!(limited.retryable);
    assert_eq!(limited.retry_after, Some(Duration::from_secs(7)));
    assert!(
        limited
            .message
            .contains("429 Too Many Requests: Number of request tokens"),
        "{limited}"
    );
    assert!(limited.message.contains("rate limiting"), "{limited}");
    let overloaded = ask(&m).await.unwrap_err();
    println!("{overloaded}");
    assert!(overloaded.retryable);
    assert_eq!(overloaded.retry_after, Some(Duration::from_secs(3)));
    assert!(overloaded.message.contains("529"), "{overloaded}");
    assert!(
        overloaded
            .message
            .contains("Overloaded; the endpoint is overloaded"),
        "{overloaded}"
    );
    let bare = ask(&m).await.unwrap_err();
    assert!(bare.retryable);
    assert_eq!(bare.retry_after, None);
    assert_eq!(ask(&m).await.unwrap().text.as_deref(), Some("fine"));
    assert_eq!(fake.violations(), Vec::<String>::new());
}

#[tokio::test]
async fn a_401_names_the_secret_and_never_shows_the_key() {
    let fake = FakeAnthropic::start(
        KEY,
        vec![Answer(
            401,
            vec![],
            error_body("authentication_error", &format!("invalid x-api-key {KEY}")),
        )],
    );
    let m = client(&fake);
    let denied = ask(&m).await.unwrap_err();
    println!("{denied}");
    assert!(!denied.retryable);
    assert!(
        denied
            .message
            .contains("401 Unauthorized: invalid x-api-key <redacted>"),
        "{denied}"
    );
    assert!(
        denied
            .message
            .contains("spec.model.anthropic.apiKeySecretRef"),
        "{denied}"
    );
    assert!(!denied.message.contains(KEY) && !format!("{m:?}").contains(KEY));
}

#[tokio::test]
async fn a_reply_cut_at_max_tokens_fails_for_good_and_says_what_to_raise() {
    let fake = FakeAnthropic::start(
        KEY,
        vec![message(
            json!([tool_use("toolu_1", "echo", json!({"text": "partial"}))]),
            "max_tokens",
            json!({"input_tokens": 1, "output_tokens": 64}),
        )],
    );
    let cut = ask(&client(&fake)).await.unwrap_err();
    println!("{cut}");
    assert!(!cut.retryable);
    assert!(
        cut.message.contains("max_tokens (64 output tokens)"),
        "{cut}"
    );
    assert!(
        cut.message.contains("raise spec.model.anthropic.maxTokens"),
        "{cut}"
    );
}

#[test]
fn azure_openai_gets_the_api_key_header_and_the_api_version_query() {
    let server = Server::start(|req| {
        let wrong = [
            (req.method != "POST", "not a POST"),
            (
                req.path != "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
                "not the deployment's URL with the api-version query",
            ),
            (req.header("api-key") != Some(KEY), "no api-key header"),
            (
                req.header("authorization").is_some(),
                "an Authorization header",
            ),
        ]
        .into_iter()
        .filter(|(broken, _)| *broken)
        .map(|(_, what)| what)
        .collect::<Vec<_>>();
        if wrong.is_empty() {
            let reply = json!({"choices": [{"message": {"role": "assistant", "content": "hi from azure"}}]});
            Response::json(200, reply.to_string())
        } else {
            let error = json!({"error": {"code": "BadRequest", "message": wrong.join(", ")}});
            Response::json(400, error.to_string())
        }
    });
    let s = Scratch::new("azure");
    let file = s.write(
        "azure.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: az}}
spec:
  messages: ["hello"]
  agent:
    model:
      provider: openai
      openai:
        baseUrl: {}
        model: gpt-4o
        apiKeySecretRef: {{name: azure, key: api-key}}
        azure: {{apiVersion: "2024-10-21"}}
"#,
            server.url("/openai/deployments/gpt-4o")
        ),
    );
    let out = s
        .cmd(&["run", "-f", &file.display().to_string()])
        .env("AGENTS_SECRET_AZURE_API_KEY", KEY)
        .output()
        .unwrap();
    let run = Run::from(out, &["run"]);
    assert!(run.ok().contains("answer: hi from azure"), "{}", run.stdout);
    let requests = server.requests();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert_eq!(requests[0].json()["model"], "gpt-4o");
}

/// Each file under `examples/models/`, its `baseUrl` pointed at a local
/// server that speaks both wire formats, runs to its answer.
#[test]
fn every_model_example_runs_against_a_local_server() {
    let server = Server::start(|req| {
        let answer = if req.path.starts_with("/v1/messages") {
            json!({"content": [{"type": "text", "text": "example ok"}], "stop_reason": "end_turn"})
        } else if req.path.contains("/chat/completions") {
            json!({"choices": [{"message": {"role": "assistant", "content": "example ok"}}]})
        } else {
            return Response::json(404, "{}");
        };
        Response::json(200, answer.to_string())
    });
    let dir = repo_file("examples/models");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    for file in files {
        let yaml = std::fs::read_to_string(&file).unwrap();
        let local: String = yaml
            .lines()
            .map(|l| match l.split_once("baseUrl:") {
                Some((indent, url)) => {
                    let path = url
                        .trim()
                        .split_once("//")
                        .map_or("", |(_, rest)| rest.find('/').map_or("", |i| &rest[i..]));
                    format!("{indent}baseUrl: {}", server.url(path))
                }
                None => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        assert_ne!(local, yaml, "{}: names a baseUrl", file.display());
        let s = Scratch::new("model-example");
        let copy = s.write("example.yaml", &local);
        let run = s.run(&["run", "-f", &copy.display().to_string()]);
        assert!(
            run.ok().contains("answer: example ok"),
            "{}: {}",
            file.display(),
            run.stdout
        );
    }
}

/// The fake refuses what the API refuses, so the tests above would fail
/// if the client sent an OpenAI-shaped request.
#[test]
fn the_fake_refuses_requests_off_the_documented_shape() {
    let request = |headers: Vec<(&str, &str)>, body: Value| support::http::Request {
        method: "POST".into(),
        path: "/v1/messages".into(),
        headers: headers
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        body: body.to_string().into_bytes(),
    };
    let good_headers = vec![
        ("x-api-key", KEY),
        ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
    ];
    let good = json!({"model": "m", "max_tokens": 5, "system": "s", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [tool_use("t1", "echo", json!({}))]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]},
    ]});
    assert_eq!(
        check_request(&request(good_headers.clone(), good), KEY),
        Vec::<String>::new()
    );
    let openai_shaped = json!({"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [tool_use("t1", "echo", json!({}))]},
        {"role": "user", "content": [{"type": "text", "text": "more"},
                                      {"type": "tool_result", "tool_use_id": "t2", "content": "r"}]},
    ], "tools": [{"type": "function", "function": {"name": "echo"}}]});
    let broken = check_request(
        &request(vec![("authorization", "Bearer x")], openai_shaped),
        KEY,
    );
    for expected in [
        "x-api-key is \"\"",
        "anthropic-version is \"\"",
        "an Authorization header was sent",
        "max_tokens: a positive integer is required",
        "messages.0.role: expected user",
        "messages.3.content.1: tool_result blocks must come before other content",
        "messages.3.content.1: unexpected tool_use_id \"t2\"",
        "messages.3: tool_use ids were found without tool_result blocks immediately after: [\"t1\"]",
        "tools.0.input_schema: an object schema is required",
        "tools.0.type: Extra inputs are not permitted",
    ] {
        assert!(
            broken.iter().any(|b| b.starts_with(expected)),
            "{expected:?} not in {broken:#?}"
        );
    }
}
