//! Tools that run inside a step (`runSync`) or in the background
//! (`runAsync`): builtins for tests and demos, and the `http` kind.
//! Container tools never run here; they go to a runner (`crate::runner`).
//!
//! An http tool's reply is read as a stream and bounded ([`MAX_REPLY_BYTES`],
//! redirects only within the URL's origin; see [`http`]): a server the
//! tenant chose can fail its own call, never the process. Where the
//! operator lists the URLs http tools may call ([`AllowedUrls`]), a URL
//! off the list, asked or redirected to, fails its call before any request
//! goes to it.

use crate::core::call::TaskHandle;
use crate::core::policy::EnvVarSpec;
use crate::core::{ToolCall, ToolResponse, ToolResult, ToolSchema};
use crate::http;
use crate::http::allow::AllowedUrls;
use crate::ports::{TaskPoll, ToolRun};
use mcp::{McpPool, McpServerDef};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub mod mcp;

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
        /// The only headers sent besides `Content-Type` and
        /// `Idempotency-Key`: literal values, or secrets by reference.
        headers: Vec<EnvVarSpec>,
    },
    /// Runs only isolated, through a runner.
    Container,
    /// A tool of an MCP server, called by its name there (`tools/call`).
    Mcp {
        server: std::sync::Arc<McpServerDef>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments, offered to the model.
    pub parameters: Option<Value>,
    pub kind: ToolKind,
}

/// The most an http tool's reply may hold. It is the default of
/// `spec.maxResultBytes` ([`crate::core::session::MAX_RESULT_BYTES`]), the
/// largest result the model is shown. It is a fixed ceiling, not the agent's
/// own setting: the tenant chooses the server, and one operator holds every
/// namespace's calls under one memory limit. A longer reply fails its call
/// with an error that says so; it is never read whole.
pub const MAX_REPLY_BYTES: usize = crate::core::session::MAX_RESULT_BYTES;

/// A JSON reply up to this size is kept as JSON; a larger one is kept as
/// the text it is (the model reads the same bytes). Parsed, JSON can take
/// some 16 times its text in memory (`[0,0,…]` is two bytes of text but a
/// 32-byte value per item), so an 8 MiB reply is never parsed whole.
pub const JSON_PARSE_BYTES: usize = 1024 * 1024;

/// At most this many bytes of an error reply are quoted in the message.
const QUOTE_BYTES: usize = 500;

/// Headers the runtime sets itself; a definition cannot replace them.
const RESERVED_HEADERS: &[&str] = &["content-type", "idempotency-key", "content-length", "host"];

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("tool {tool:?}: header {header:?}: {why}")]
    BadHeader {
        tool: String,
        header: String,
        why: String,
    },
    #[error("mcp server {server:?}: {why}")]
    BadMcpServer { server: String, why: String },
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
    /// Secret values the driver resolved (the operator reads them from
    /// Secrets in the session's namespace), by `AGENTS_SECRET_*` name. When
    /// set, the process environment is never consulted.
    secrets: Option<std::sync::Arc<BTreeMap<String, String>>>,
    /// The URLs http tools may call (the operator's allow-list); `None`:
    /// any.
    allowed_urls: Option<std::sync::Arc<AllowedUrls>>,
    /// The MCP servers whose tools [`Toolbox::discover`] adds.
    servers: Vec<McpServerDef>,
    /// Connections to MCP servers and their listings.
    mcp: std::sync::Arc<McpPool>,
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
            if let ToolKind::Http { headers, .. } = &def.kind {
                for h in headers {
                    check_header(h).map_err(|why| ToolError::BadHeader {
                        tool: def.name.clone(),
                        header: h.name.clone(),
                        why,
                    })?;
                }
            }
            tools.insert(def.name.clone(), def);
        }
        Ok(Toolbox {
            tools,
            http: None,
            secrets: None,
            allowed_urls: None,
            servers: Vec::new(),
            mcp: Default::default(),
        })
    }

    /// Lets http tools call only the URLs `allowed` lists (`None`: any),
    /// checked before each request and on each redirect.
    pub fn with_allowed_urls(mut self, allowed: Option<std::sync::Arc<AllowedUrls>>) -> Self {
        self.allowed_urls = allowed;
        self
    }

    /// The http tools whose URL the allow-list does not hold, as (tool,
    /// URL, why): each call of theirs would fail. Empty without a list.
    pub fn urls_not_allowed(&self) -> Vec<(String, String, String)> {
        let Some(allowed) = &self.allowed_urls else {
            return Vec::new();
        };
        self.tools
            .values()
            .filter_map(|d| match &d.kind {
                ToolKind::Http { url, .. } if !allowed.allows_str(url) => {
                    Some((d.name.clone(), url.clone(), allowed.not_listed(url)))
                }
                _ => None,
            })
            .collect()
    }

    /// Serves header secrets from `resolved` (keyed by
    /// [`crate::core::policy::SecretKeyRef::env_name`]) instead of the
    /// process environment.
    pub fn with_secrets(mut self, resolved: BTreeMap<String, String>) -> Self {
        self.secrets = Some(std::sync::Arc::new(resolved));
        self
    }

    /// The Secret keys the tools' headers name (and those of MCP servers:
    /// headers, and a stdio server's env).
    pub fn secret_refs(&self) -> Vec<crate::core::policy::SecretKeyRef> {
        let servers = self.servers.iter().map(|s| match &s.endpoint {
            mcp::Endpoint::Http { headers, .. } => headers,
            mcp::Endpoint::Stdio { env, .. } => env,
        });
        self.tools
            .values()
            .filter_map(|d| match &d.kind {
                ToolKind::Http { headers, .. } => Some(headers),
                _ => None,
            })
            .chain(servers)
            .flatten()
            .filter_map(|h| h.secret.clone())
            .collect()
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

    /// Runs `call` here where it cannot become a task (a worker's run):
    /// a task handle is an error result.
    pub async fn run(
        &self,
        call: &ToolCall,
        idempotency_key: &str,
        timeout: Option<Duration>,
    ) -> ToolResult {
        match self.start(call, idempotency_key, timeout).await {
            ToolRun::Done(result) => result,
            ToolRun::Task(task) => ToolResult::error(format!(
                "tool {:?} answered with MCP task {}, which this runner cannot wait for; run the call runSync or runAsync",
                call.name, task.id
            )),
        }
    }

    /// Runs `call` here: its result, or the MCP task it became. Every
    /// failure is a tool error result for the model, never a driver
    /// error: the session goes on.
    pub async fn start(
        &self,
        call: &ToolCall,
        idempotency_key: &str,
        timeout: Option<Duration>,
    ) -> ToolRun {
        let Some(def) = self.tools.get(&call.name) else {
            return ToolRun::Done(ToolResult::error(format!("unknown tool {:?}", call.name)));
        };
        let args = match call.parsed_arguments() {
            Ok(a) => a,
            Err(e) => return ToolRun::Done(ToolResult::error(e)),
        };
        let work = async {
            match &def.kind {
                ToolKind::Builtin { function } => ToolRun::Done(builtin(function, &args).await),
                ToolKind::Http { url, headers } => {
                    let lookup = |k: &str| self.secret(k);
                    ToolRun::Done(
                        self.http_call(url, headers, &args, idempotency_key, &lookup)
                            .await,
                    )
                }
                ToolKind::Container => ToolRun::Done(ToolResult::error(format!(
                    "tool {:?} is a container tool; it runs only isolated",
                    call.name
                ))),
                ToolKind::Mcp { server } => {
                    self.mcp_call(server, &call.name, &args, idempotency_key)
                        .await
                }
            }
        };
        match timeout {
            Some(t) => tokio::time::timeout(t, work).await.unwrap_or_else(|_| {
                ToolRun::Done(ToolResult::error(format!(
                    "timed out after {}s",
                    t.as_secs()
                )))
            }),
            None => work.await,
        }
    }

    /// How the MCP task `call` became is doing (see [`crate::ports::ToolPort::poll_task`]).
    pub async fn poll_task(
        &self,
        call: &ToolCall,
        task: &TaskHandle,
        answers: Option<&str>,
    ) -> TaskPoll {
        match self.tools.get(&call.name).map(|d| &d.kind) {
            Some(ToolKind::Mcp { server }) => self.mcp_poll(server, task, answers).await,
            _ => TaskPoll::Ended(ToolResult::error(format!(
                "tool {:?} waits on MCP task {}, but the agent has no MCP tool of that name now",
                call.name, task.id
            ))),
        }
    }

    /// Cancels the MCP task `call` became (best effort).
    pub async fn cancel_task(&self, call: &ToolCall, task: &TaskHandle) {
        if let Some(ToolKind::Mcp { server }) = self.tools.get(&call.name).map(|d| &d.kind) {
            self.mcp_cancel(server, task).await;
        }
    }

    /// POSTs `args`; `lookup` reads the worker's environment, asked only
    /// for the secrets the definition's headers name.
    async fn http_call(
        &self,
        url: &str,
        headers: &[EnvVarSpec],
        args: &Map<String, Value>,
        idempotency_key: &str,
        lookup: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> ToolResult {
        let target = match self.allowed_target(url) {
            Ok(t) => t,
            Err(refused) => return refused,
        };
        let request = match self.http_request(target, headers, idempotency_key, lookup) {
            Ok(r) => r,
            Err(refused) => return refused,
        };
        let mut response = match request.json(args).send().await {
            Ok(r) => r,
            Err(e) => return ToolResult::error(format!("POST {url} failed: {e}")),
        };
        let status = response.status();
        if status.is_redirection() {
            return ToolResult::error(self.redirect_refused(url, &response));
        }
        if !status.is_success() {
            return error_reply(url, status, &mut response).await;
        }
        success_reply(url, &mut response).await
    }

    /// Where the POST goes: `url` as is without an allow-list; with one,
    /// the URL parsed once, checked, and sent to as parsed (what is
    /// checked is what is called), or the error result that refuses it.
    fn allowed_target(&self, url: &str) -> Result<Target, ToolResult> {
        let Some(allowed) = &self.allowed_urls else {
            return Ok(Target::Any(url.to_string()));
        };
        match reqwest::Url::parse(url) {
            Ok(parsed) if allowed.allows(&parsed) => Ok(Target::Checked(parsed)),
            Ok(_) => Err(ToolResult::error(format!(
                "POST {url} was refused: {}",
                allowed.not_listed(url)
            ))),
            Err(e) => Err(ToolResult::error(format!(
                "POST {url} was refused: it is not a URL ({e})"
            ))),
        }
    }

    /// The error text of a 3xx that was not followed: off the allow-list,
    /// or off the origin (or too many).
    fn redirect_refused(&self, url: &str, response: &reqwest::Response) -> String {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|l| response.url().join(l).ok());
        match (&self.allowed_urls, location) {
            (Some(allowed), Some(to)) if !allowed.allows(&to) => format!(
                "POST {url} answered {}, a redirect to {:?}, which was not followed: {}",
                response.status(),
                http::clip(to.as_str(), 200),
                allowed.not_listed(to.as_str())
            ),
            _ => http::redirect_refused(&format!("POST {url}"), response),
        }
    }

    /// The POST to `target`, with its idempotency key and its headers
    /// (secret ones marked sensitive), or the error result that says which
    /// header cannot be sent.
    fn http_request(
        &self,
        target: Target,
        headers: &[EnvVarSpec],
        idempotency_key: &str,
        lookup: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> Result<reqwest::RequestBuilder, ToolResult> {
        let client = match (&self.http, &self.allowed_urls) {
            (Some(c), None) => c.clone(),
            (_, allowed) => http_client(allowed.clone())
                .map_err(|e| ToolResult::error(format!("no HTTP client: {e}")))?,
        };
        let request = match target {
            Target::Any(url) => client.post(url),
            Target::Checked(url) => client.post(url),
        };
        // Lets the service drop a repeated delivery of the same call.
        let mut request = request.header("Idempotency-Key", idempotency_key);
        for h in headers {
            let value = h
                .resolve(lookup)
                .map_err(|e| ToolResult::error(format!("header {e}")))?;
            let Ok(mut value) = reqwest::header::HeaderValue::from_str(&value) else {
                return Err(ToolResult::error(format!(
                    "header {:?}: its value is not a valid HTTP header value",
                    h.name
                )));
            };
            // Kept out of debug output; redirects never leave the origin.
            value.set_sensitive(h.secret.is_some());
            request = request.header(h.name.as_str(), value);
        }
        Ok(request)
    }
}

/// A 4xx or 5xx answer: an error quoting the start of its (bounded) body.
async fn error_reply(
    url: &str,
    status: reqwest::StatusCode,
    response: &mut reqwest::Response,
) -> ToolResult {
    let body = match http::read_at_most(response, http::ERROR_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return ToolResult::error(format!(
                "POST {url} answered {status}; reading its reply failed: {e}"
            ))
        }
    };
    let text = String::from_utf8_lossy(&body.bytes);
    let snippet = http::clip(&text, QUOTE_BYTES);
    let more = if snippet.len() < text.len() || body.cut {
        "… (cut)"
    } else {
        ""
    };
    ToolResult::error(format!("POST {url} answered {status}: {snippet}{more}"))
}

/// A 2xx answer read up to the cap: JSON when it says so and parses, text
/// otherwise, an error past the cap.
async fn success_reply(url: &str, response: &mut reqwest::Response) -> ToolResult {
    let is_json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    let body = match http::read_capped(response, MAX_REPLY_BYTES).await {
        Ok(Ok(b)) => b,
        Ok(Err(too_large)) => {
            return ToolResult::error(format!(
                "POST {url} {}. Have the tool answer with less (a page of results, a \
                 summary, or where to fetch the rest)",
                too_large.describe("an http tool's reply", MAX_REPLY_BYTES)
            ))
        }
        Err(e) => return ToolResult::error(format!("reading the reply of {url}: {e}")),
    };
    if is_json && body.len() <= JSON_PARSE_BYTES {
        if let Ok(content) = serde_json::from_slice(&body) {
            return ToolResult::ok(ToolResponse::Json { content });
        }
    }
    ToolResult::text(match String::from_utf8(body) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

/// Where an http tool's POST goes.
enum Target {
    /// No allow-list: the URL as written (the client parses it).
    Any(String),
    /// Parsed, and on the allow-list.
    Checked(reqwest::Url),
}

/// The client of the http tools: redirects only within the URL's origin
/// ([`http::redirect_policy`]) and, with an allow-list, only to a URL it
/// holds ([`http::redirect_policy_within`]); the call's timeout bounds the
/// rest.
pub(crate) fn http_client(
    allowed: Option<std::sync::Arc<AllowedUrls>>,
) -> reqwest::Result<reqwest::Client> {
    let policy = match allowed {
        Some(list) => http::redirect_policy_within(list),
        None => http::redirect_policy(),
    };
    http::client_builder().redirect(policy).build()
}

pub(crate) fn check_header(h: &EnvVarSpec) -> Result<(), String> {
    reqwest::header::HeaderName::from_bytes(h.name.as_bytes())
        .map_err(|_| "not a valid HTTP header name".to_string())?;
    if RESERVED_HEADERS.contains(&h.name.to_ascii_lowercase().as_str()) {
        return Err("set by the runtime itself; remove it".into());
    }
    if h.value.is_some() == h.secret.is_some() {
        return Err("give exactly one of value and secret".into());
    }
    Ok(())
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
mod tests;
