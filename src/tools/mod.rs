//! Tools that run inside a step (`runSync`) or in the background
//! (`runAsync`): builtins for tests and demos, and the `http` kind.
//! Container tools never run here; they go to a runner (`crate::runner`).

use crate::core::{ToolCall, ToolResponse, ToolResult, ToolSchema};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Builtin tool names, with what each does (shown in errors and docs).
pub const BUILTINS: &[(&str, &str)] = &[
    (
        "echo",
        "returns its `text` argument (or all arguments as JSON)",
    ),
    ("add", "adds the numbers `a` and `b`"),
    ("time", "the current time as Unix milliseconds"),
    ("sleep", "waits `ms` milliseconds, then answers"),
    (
        "fail",
        "always fails with `message` (for retry and error tests)",
    ),
];

/// How one tool runs.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolKind {
    Builtin {
        function: String,
    },
    /// The arguments are POSTed as JSON; the response body is the result.
    Http {
        url: String,
    },
    /// Runs only isolated, through a runner.
    Container,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments, offered to the model.
    pub parameters: Option<Value>,
    pub kind: ToolKind,
}

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("tool {tool:?} uses builtin {function:?}, which does not exist; builtins: {known}")]
    UnknownBuiltin {
        tool: String,
        function: String,
        known: String,
    },
}

/// The tools of one agent, ready to run.
#[derive(Clone, Debug, Default)]
pub struct Toolbox {
    tools: BTreeMap<String, ToolDef>,
    http: Option<reqwest::Client>,
}

impl Toolbox {
    /// Checks every definition up front, so a typo fails at load time and
    /// not in the middle of a session.
    pub fn new(defs: Vec<ToolDef>) -> Result<Self, ToolError> {
        let mut tools = BTreeMap::new();
        for def in defs {
            if let ToolKind::Builtin { function } = &def.kind {
                if !BUILTINS.iter().any(|(n, _)| n == function) {
                    return Err(ToolError::UnknownBuiltin {
                        tool: def.name.clone(),
                        function: function.clone(),
                        known: BUILTINS
                            .iter()
                            .map(|(n, _)| *n)
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
            }
            tools.insert(def.name.clone(), def);
        }
        Ok(Toolbox { tools, http: None })
    }

    pub fn get(&self, name: &str) -> Option<&ToolDef> {
        self.tools.get(name)
    }

    pub fn defs(&self) -> impl Iterator<Item = &ToolDef> {
        self.tools.values()
    }

    /// What the model is offered: each tool's name, description and
    /// parameters, in name order.
    pub fn schemas(&self) -> Vec<ToolSchema> {
        self.tools
            .values()
            .map(|d| ToolSchema {
                name: d.name.clone(),
                description: d.description.clone(),
                parameters: d.parameters.clone(),
            })
            .collect()
    }

    /// Runs `call` here. Every failure is a tool error result for the
    /// model, never a driver error: the session goes on.
    pub async fn run(
        &self,
        call: &ToolCall,
        idempotency_key: &str,
        timeout: Option<Duration>,
    ) -> ToolResult {
        let Some(def) = self.tools.get(&call.name) else {
            return ToolResult::error(format!("unknown tool {:?}", call.name));
        };
        let args = match call.parsed_arguments() {
            Ok(a) => a,
            Err(e) => return ToolResult::error(e),
        };
        let work = async {
            match &def.kind {
                ToolKind::Builtin { function } => builtin(function, &args).await,
                ToolKind::Http { url } => self.http_call(url, &args, idempotency_key).await,
                ToolKind::Container => ToolResult::error(format!(
                    "tool {:?} is a container tool; it runs only isolated",
                    call.name
                )),
            }
        };
        match timeout {
            Some(t) => tokio::time::timeout(t, work)
                .await
                .unwrap_or_else(|_| ToolResult::error(format!("timed out after {}s", t.as_secs()))),
            None => work.await,
        }
    }

    async fn http_call(
        &self,
        url: &str,
        args: &Map<String, Value>,
        idempotency_key: &str,
    ) -> ToolResult {
        let client = match &self.http {
            Some(c) => c.clone(),
            None => reqwest::Client::new(),
        };
        let response = client
            .post(url)
            // Lets the service drop a repeated delivery of the same call.
            .header("Idempotency-Key", idempotency_key)
            .json(args)
            .send()
            .await;
        let response = match response {
            Ok(r) => r,
            Err(e) => return ToolResult::error(format!("POST {url} failed: {e}")),
        };
        let status = response.status();
        let is_json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("json"));
        let body = match response.text().await {
            Ok(b) => b,
            Err(e) => return ToolResult::error(format!("reading the reply of {url}: {e}")),
        };
        if !status.is_success() {
            let snippet: String = body.chars().take(500).collect();
            return ToolResult::error(format!("POST {url} answered {status}: {snippet}"));
        }
        if is_json {
            if let Ok(content) = serde_json::from_str(&body) {
                return ToolResult::ok(ToolResponse::Json { content });
            }
        }
        ToolResult::text(body)
    }
}

async fn builtin(function: &str, args: &Map<String, Value>) -> ToolResult {
    match function {
        "echo" => match args.get("text") {
            Some(Value::String(s)) => ToolResult::text(s.clone()),
            _ => ToolResult::ok(ToolResponse::Json {
                content: Value::Object(args.clone()),
            }),
        },
        "add" => {
            let num = |k: &str| args.get(k).and_then(Value::as_f64);
            match (num("a"), num("b")) {
                (Some(a), Some(b)) => ToolResult::ok(ToolResponse::Json {
                    content: json!(a + b),
                }),
                _ => ToolResult::error("add needs numbers `a` and `b`"),
            }
        }
        "time" => {
            let ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            ToolResult::ok(ToolResponse::Json {
                content: json!({ "unixMillis": ms }),
            })
        }
        "sleep" => {
            let ms = args.get("ms").and_then(Value::as_u64).unwrap_or(100);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            ToolResult::text(format!("slept {ms} ms"))
        }
        "fail" => ToolResult::error(
            args.get("message")
                .and_then(Value::as_str)
                .unwrap_or("failed on purpose")
                .to_string(),
        ),
        other => ToolResult::error(format!("unknown builtin {other:?}")),
    }
}

#[cfg(test)]
mod tests {
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
}
