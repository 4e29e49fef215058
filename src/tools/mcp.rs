//! The `mcp` tool kind: a client of Model Context Protocol servers, over
//! Streamable HTTP (any driver) or a stdio child process (standalone only).
//!
//! **Protocol revisions.** The client speaks the stateless revision
//! [`MODERN_VERSION`] (2026-07-28, the newest of the official Python SDK
//! 2.3): no handshake, no session; every request is one POST that carries
//! the revision and the client's capabilities in `params._meta` and, over
//! HTTP, the `MCP-Protocol-Version`, `Mcp-Method` and `Mcp-Name` headers.
//! Whether a server speaks it is learnt once per connection, as the SDK's
//! own client does: a `server/discover` probe (no side effects) whose
//! result names the revision means yes; any other answer (an HTTP 4xx, a
//! JSON-RPC error, a result without the revision, none within
//! [`PROBE_TIMEOUT`]) means the server is of
//! the session-based revisions, and the client falls back to them: an
//! `initialize` handshake offering [`HANDSHAKE_VERSION`] (2025-11-25),
//! the `Mcp-Session-Id` it hands out sent with every later request, and
//! `notifications/initialized`. A session the server forgot (404) is
//! started again once. A network error is no verdict: it fails the
//! request.
//!
//! **Bounds.** Every reply, JSON or an SSE stream, is read as a stream up
//! to [`MAX_MESSAGE_BYTES`] (the cap of http tools' replies); a listing
//! takes at most [`MAX_PAGES`] pages and [`MAX_TOOLS`] tools. Requests go
//! through the http tools' client: redirects only within the origin, and
//! only to URLs the operator's allow-list holds.
//!
//! **Results.** A `tools/call` result with `isError: true`, and a JSON-RPC
//! error, are error results for the model. A result whose `resultType` is
//! `task` (the Tasks extension) is a task handle: the call waits on it
//! ([`tasks`]).

mod http;
mod stdio;
mod tasks;
mod toolbox;

use crate::core::policy::EnvVarSpec;
use crate::core::{ToolResponse, ToolResult};
use crate::http::allow::AllowedUrls;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use http::HttpEndpoint;
pub use stdio::StdioEndpoint;
pub use tasks::{answer_of, poll_of, TASKS_EXTENSION};
pub use toolbox::{DiscoverError, ServerListing};

/// The stateless revision spoken first.
pub const MODERN_VERSION: &str = "2026-07-28";
/// The session-based revision offered in `initialize` when a server does
/// not speak [`MODERN_VERSION`].
pub const HANDSHAKE_VERSION: &str = "2025-11-25";
/// Session-based revisions a server may answer `initialize` with.
pub const HANDSHAKE_VERSIONS: &[&str] = &["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
/// The most one JSON-RPC message from a server may hold.
pub const MAX_MESSAGE_BYTES: usize = super::MAX_REPLY_BYTES;
/// Pages of `tools/list` read at most.
pub const MAX_PAGES: usize = 20;
/// Tools one server may offer at most.
pub const MAX_TOOLS: usize = 256;
/// How long a listing (with its handshake) may take.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the `server/discover` probe is waited for before falling
/// back to the handshake.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a listing is reused before the server is asked again.
pub const LIST_TTL: Duration = Duration::from_secs(60);

const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
const META_CLIENT: &str = "io.modelcontextprotocol/clientInfo";
/// The `_meta` key of a `tools/call` that carries the call's idempotency key.
pub const META_IDEMPOTENCY_KEY: &str = "agents-exe.io/idempotencyKey";

/// One MCP server of an agent.
#[derive(Clone, Debug, PartialEq)]
pub struct McpServerDef {
    /// The entry's `name`, for messages and the Agent's status.
    pub name: String,
    pub endpoint: Endpoint,
    /// The tools to offer (`tools:`); empty: all the server lists.
    pub only: Vec<String>,
    /// The Agent's own `idempotent` for this server's tools (it overrides
    /// the server's annotations), and its `onUnknownOutcome`.
    pub idempotent: Option<bool>,
    pub on_unknown_outcome: Option<crate::core::session::OnUnknownOutcome>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Endpoint {
    /// Streamable HTTP at `url`, with the headers the entry names.
    Http {
        url: String,
        headers: Vec<EnvVarSpec>,
    },
    /// A child process speaking JSON-RPC on stdin/stdout (standalone).
    Stdio {
        command: Vec<String>,
        env: Vec<EnvVarSpec>,
    },
}

impl Endpoint {
    /// The URL, or the command line, for messages.
    pub fn describe(&self) -> String {
        match self {
            Endpoint::Http { url, .. } => url.clone(),
            Endpoint::Stdio { command, .. } => format!("stdio: {}", command.join(" ")),
        }
    }
}

/// A tool as a server lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct McpTool {
    pub name: String,
    pub description: String,
    pub input_schema: Option<Value>,
    /// Whether the server's annotations say the tool is idempotent; `None`
    /// when they do not say.
    pub idempotent_hint: Option<bool>,
}

/// What a tool's annotations say of repeating it: idempotent when it only
/// reads (`readOnlyHint`) or says so (`idempotentHint: true`); not when it
/// says `idempotentHint: false` or `destructiveHint: true`. A server that
/// sends no annotations says nothing, and the tool keeps the default
/// (idempotent): the protocol's own defaults would make every such tool
/// "destructive and not idempotent", which most servers never meant.
pub fn idempotent_hint(annotations: Option<&Value>) -> Option<bool> {
    let hint = |k: &str| annotations?.get(k)?.as_bool();
    if hint("readOnlyHint") == Some(true) || hint("idempotentHint") == Some(true) {
        return Some(true);
    }
    if hint("idempotentHint") == Some(false) || hint("destructiveHint") == Some(true) {
        return Some(false);
    }
    None
}

/// What listing one server found.
#[derive(Clone, Debug, PartialEq)]
pub struct Listing {
    /// The revision spoken with it.
    pub protocol_version: String,
    pub tools: Vec<McpTool>,
}

/// Why a request to a server failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum McpError {
    /// Nothing came back: refused, unreachable, timed out, cut.
    #[error("{0}")]
    Transport(String),
    /// An HTTP status without a JSON-RPC error in its body.
    #[error("answered HTTP {status}: {body}")]
    Http { status: u16, body: String },
    /// A JSON-RPC error.
    #[error("answered error {code}: {message}")]
    Rpc { code: i64, message: String },
    /// Something that is not the protocol.
    #[error("{0}")]
    Protocol(String),
    /// The session-based server no longer knows the session (HTTP 404).
    #[error("the server ended the MCP session (404)")]
    SessionGone,
}

/// The revision a connection speaks, once learnt.
#[derive(Clone, Debug, PartialEq)]
enum Era {
    Modern,
    Legacy {
        version: String,
        session: Option<String>,
    },
}

/// What one request is, for the transport's headers.
pub(crate) struct Route<'a> {
    /// `MCP-Protocol-Version`; none before `initialize` is answered.
    pub version: Option<&'a str>,
    pub method: &'a str,
    /// `Mcp-Name` (the tool of a `tools/call`), modern only.
    pub name: Option<&'a str>,
    pub session: Option<&'a str>,
}

/// A transport's answer to one message.
pub(crate) struct Reply {
    /// The response with the request's id; none for an accepted notification.
    pub message: Option<Value>,
    /// `Mcp-Session-Id`, when the server handed one out.
    pub session: Option<String>,
}

enum Transport {
    Http(HttpEndpoint),
    Stdio(Box<StdioEndpoint>),
}

impl Transport {
    async fn send(&self, message: &Value, route: &Route<'_>) -> Result<Reply, McpError> {
        match self {
            Transport::Http(h) => h.send(message, route).await,
            Transport::Stdio(s) => s.send(message).await,
        }
    }
}

/// One server, and what was learnt of it.
pub struct Connection {
    transport: Transport,
    era: tokio::sync::Mutex<Option<Era>>,
    next_id: AtomicU64,
}

impl Connection {
    fn new(transport: Transport) -> Self {
        Connection {
            transport,
            era: tokio::sync::Mutex::new(None),
            next_id: AtomicU64::new(1),
        }
    }

    /// The result of `method`, negotiating the revision first if need be;
    /// a forgotten session is started again once.
    pub async fn request(
        &self,
        method: &str,
        params: Map<String, Value>,
    ) -> Result<Value, McpError> {
        let era = self.era().await?;
        match self.send_in(&era, method, params.clone()).await {
            Err(McpError::SessionGone) => {
                let era = self.renew(&era).await?;
                self.send_in(&era, method, params).await
            }
            other => other,
        }
    }

    /// After a session was lost: a new handshake for a session-based
    /// server (the revision is known; no new probe); nothing to renew for
    /// a stateless one (a restarted stdio child).
    async fn renew(&self, old: &Era) -> Result<Era, McpError> {
        let mut known = self.era.lock().await;
        let era = match old {
            Era::Modern => Era::Modern,
            Era::Legacy { .. } => self.initialize().await?,
        };
        *known = Some(era.clone());
        Ok(era)
    }

    /// The revision this connection speaks: learnt once, by the probe and
    /// the fallback the module docs describe.
    async fn era(&self) -> Result<Era, McpError> {
        let mut known = self.era.lock().await;
        if let Some(era) = known.as_ref() {
            return Ok(era.clone());
        }
        // A server that never answers the probe (one that drops requests
        // before its handshake) is of the session-based revisions too.
        let probe = self.send_in(&Era::Modern, "server/discover", Map::new());
        let era = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
            Ok(Ok(result)) if speaks_modern(&result) => Era::Modern,
            Ok(Err(McpError::Transport(e))) => return Err(McpError::Transport(e)),
            _ => self.initialize().await?,
        };
        *known = Some(era.clone());
        Ok(era)
    }

    /// The session-based handshake: `initialize`, then
    /// `notifications/initialized` in the session it opened.
    async fn initialize(&self) -> Result<Era, McpError> {
        let params = json!({
            "protocolVersion": HANDSHAKE_VERSION,
            "capabilities": {},
            "clientInfo": client_info(),
        });
        let message = json!({
            "jsonrpc": "2.0",
            "id": self.next_id.fetch_add(1, Ordering::Relaxed),
            "method": "initialize",
            "params": params,
        });
        let route = Route {
            version: None,
            method: "initialize",
            name: None,
            session: None,
        };
        let reply = self.transport.send(&message, &route).await?;
        let result = result_of(reply.message)?;
        let version = result
            .get("protocolVersion")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if !HANDSHAKE_VERSIONS.contains(&version.as_str()) {
            return Err(McpError::Protocol(format!(
                "the server answered initialize with protocol version {version:?}; this client speaks {MODERN_VERSION} and {}",
                HANDSHAKE_VERSIONS.join(", ")
            )));
        }
        let era = Era::Legacy {
            version,
            session: reply.session,
        };
        self.notify(&era, "notifications/initialized").await?;
        Ok(era)
    }

    async fn notify(&self, era: &Era, method: &str) -> Result<(), McpError> {
        let message = json!({"jsonrpc": "2.0", "method": method});
        let (version, session) = match era {
            Era::Modern => (MODERN_VERSION, None),
            Era::Legacy { version, session } => (version.as_str(), session.as_deref()),
        };
        let route = Route {
            version: Some(version),
            method,
            name: None,
            session,
        };
        self.transport.send(&message, &route).await.map(|_| ())
    }

    /// One request under `era`: its `_meta` envelope (modern) or its
    /// session (legacy), and its result or error.
    async fn send_in(
        &self,
        era: &Era,
        method: &str,
        mut params: Map<String, Value>,
    ) -> Result<Value, McpError> {
        let (version, session) = match era {
            Era::Modern => {
                let meta = params
                    .entry("_meta")
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Some(meta) = meta.as_object_mut() {
                    meta.insert(META_VERSION.into(), json!(MODERN_VERSION));
                    meta.insert(
                        META_CAPABILITIES.into(),
                        json!({"extensions": {TASKS_EXTENSION: {}}}),
                    );
                    meta.insert(META_CLIENT.into(), client_info());
                }
                (MODERN_VERSION, None)
            }
            Era::Legacy { version, session } => (version.as_str(), session.as_deref()),
        };
        // `Mcp-Name`: the tool of a call, the task of a tasks/ request.
        let name = match method {
            "tools/call" => params.get("name"),
            m if m.starts_with("tasks/") => params.get("taskId"),
            _ => None,
        }
        .and_then(Value::as_str)
        .filter(|_| *era == Era::Modern);
        let message = json!({
            "jsonrpc": "2.0",
            "id": self.next_id.fetch_add(1, Ordering::Relaxed),
            "method": method,
            "params": params,
        });
        let route = Route {
            version: Some(version),
            method,
            name,
            session,
        };
        let reply = self.transport.send(&message, &route).await?;
        result_of(reply.message)
    }

    /// The revision spoken, once learnt.
    async fn version(&self) -> String {
        match self.era.lock().await.as_ref() {
            Some(Era::Legacy { version, .. }) => version.clone(),
            _ => MODERN_VERSION.to_string(),
        }
    }
}

fn client_info() -> Value {
    json!({"name": "agents", "version": env!("CARGO_PKG_VERSION")})
}

fn speaks_modern(discover: &Value) -> bool {
    discover
        .get("supportedVersions")
        .and_then(Value::as_array)
        .is_some_and(|v| v.iter().any(|v| v == MODERN_VERSION))
}

/// The `result` of a response, or its `error` as [`McpError::Rpc`].
fn result_of(message: Option<Value>) -> Result<Value, McpError> {
    let Some(mut message) = message else {
        return Err(McpError::Protocol(
            "the server accepted the request without answering it".into(),
        ));
    };
    if let Some(error) = message.get("error") {
        return Err(rpc_error(error));
    }
    match message.get_mut("result") {
        Some(result) => Ok(result.take()),
        None => Err(McpError::Protocol(
            "the server's response has neither result nor error".into(),
        )),
    }
}

pub(crate) fn rpc_error(error: &Value) -> McpError {
    McpError::Rpc {
        code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
        message: crate::http::clip(
            error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("(no message)"),
            2000,
        )
        .to_string(),
    }
}

/// Tools names a model can call: what the OpenAI wire format allows.
fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Every tool the server lists, page by page (bounded).
async fn list_all(conn: &Connection) -> Result<Listing, McpError> {
    let mut tools = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let mut params = Map::new();
        if let Some(c) = &cursor {
            params.insert("cursor".into(), json!(c));
        }
        let page = conn.request("tools/list", params).await?;
        for t in page
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            tools.push(parse_tool(t)?);
            if tools.len() > MAX_TOOLS {
                return Err(McpError::Protocol(format!(
                    "the server lists more than {MAX_TOOLS} tools, the most one server may offer; name the ones you need in `tools:` of a server that lists fewer"
                )));
            }
        }
        cursor = page
            .get("nextCursor")
            .and_then(Value::as_str)
            .map(str::to_string);
        if cursor.is_none() {
            return Ok(Listing {
                protocol_version: conn.version().await,
                tools,
            });
        }
    }
    Err(McpError::Protocol(format!(
        "tools/list still had more pages after {MAX_PAGES}; a server may list its tools in at most {MAX_PAGES} pages"
    )))
}

fn parse_tool(t: &Value) -> Result<McpTool, McpError> {
    let name = t.get("name").and_then(Value::as_str).unwrap_or_default();
    if !valid_tool_name(name) {
        return Err(McpError::Protocol(format!(
            "the server lists a tool named {:?}; a tool name a model can call is 1 to 64 letters, digits, `_` or `-`",
            crate::http::clip(name, 100)
        )));
    }
    Ok(McpTool {
        name: name.to_string(),
        description: t
            .get("description")
            .and_then(Value::as_str)
            .map(|d| crate::http::clip(d, 4096).to_string())
            .unwrap_or_default(),
        input_schema: t.get("inputSchema").cloned(),
        idempotent_hint: idempotent_hint(t.get("annotations")),
    })
}

/// The model's answer from a `tools/call` result: content as text (or
/// media), `isError` as an error result.
pub fn interpret_call(result: &Value) -> ToolResult {
    // A task handle is taken by `answer_of` before this; any other type
    // (a request for input) is an error the model can read.
    match result.get("resultType").and_then(Value::as_str) {
        None | Some("complete") => {}
        Some(other) => {
            return ToolResult::error(format!(
                "the MCP server answered with a result of type {other:?} (a request for input outside a task), which this client does not take"
            ))
        }
    }
    let parts: Vec<ToolResponse> = result
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(content_part)
        .collect();
    if result.get("isError").and_then(Value::as_bool) == Some(true) {
        let text = ToolResponse::Mixed { parts }.to_model_text();
        return ToolResult::error(if text.is_empty() {
            "the MCP tool failed without saying why".to_string()
        } else {
            text
        });
    }
    match (parts.len(), result.get("structuredContent")) {
        (0, Some(structured)) => ToolResult::ok(ToolResponse::Json {
            content: structured.clone(),
        }),
        (1, _) => ToolResult::ok(parts.into_iter().next().expect("one part")),
        _ => ToolResult::ok(ToolResponse::Mixed { parts }),
    }
}

/// One content block: text, media, an embedded resource's text, or a
/// resource link.
fn content_part(c: &Value) -> ToolResponse {
    let s = |k: &str| c.get(k).and_then(Value::as_str).unwrap_or_default();
    match s("type") {
        "text" => ToolResponse::text(s("text")),
        "image" | "audio" => ToolResponse::Media {
            mime_type: s("mimeType").to_string(),
            base64_data: s("data").to_string(),
            filename: None,
        },
        "resource" => {
            let r = c.get("resource").cloned().unwrap_or_default();
            match r.get("text").and_then(Value::as_str) {
                Some(text) => ToolResponse::text(text),
                None => ToolResponse::text(format!(
                    "[resource {}]",
                    r.get("uri").and_then(Value::as_str).unwrap_or_default()
                )),
            }
        }
        "resource_link" => ToolResponse::text(format!("[resource link {}]", s("uri"))),
        other => ToolResponse::text(format!("[content of type {other:?}]")),
    }
}

/// The MCP connections of a process, and the listings it has read: one
/// per server and resolved headers (so two tenants' credentials never
/// share one), reused across steps. The operator keeps one for its life;
/// a standalone run one per process.
#[derive(Default)]
pub struct McpPool {
    connections: Mutex<HashMap<String, Arc<Connection>>>,
    listings: Mutex<HashMap<String, (Instant, Listing)>>,
    /// What this process knows of each task it polls, by task id.
    tasks: Mutex<HashMap<String, tasks::Polls>>,
}

impl std::fmt::Debug for McpPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("McpPool")
    }
}

/// A connection's key and how to open it, resolved for one call.
pub(crate) struct Resolved {
    key: String,
    open: Box<dyn FnOnce() -> Result<Transport, McpError> + Send>,
}

impl McpPool {
    fn connection(&self, resolved: Resolved) -> Result<Arc<Connection>, McpError> {
        let mut all = self.connections.lock().expect("mcp connections");
        if let Some(c) = all.get(&resolved.key) {
            return Ok(c.clone());
        }
        if all.len() > 1024 {
            all.clear();
        }
        let conn = Arc::new(Connection::new((resolved.open)()?));
        all.insert(resolved.key, conn.clone());
        Ok(conn)
    }

    /// The tools of a server: from a listing younger than [`LIST_TTL`],
    /// or asked again (within [`LIST_TIMEOUT`]).
    pub(crate) async fn list(&self, resolved: Resolved) -> Result<Listing, McpError> {
        let key = resolved.key.clone();
        if let Some((at, listing)) = self.listings.lock().expect("mcp listings").get(&key) {
            if at.elapsed() < LIST_TTL {
                return Ok(listing.clone());
            }
        }
        let conn = self.connection(resolved)?;
        let listing = tokio::time::timeout(LIST_TIMEOUT, list_all(&conn))
            .await
            .map_err(|_| {
                McpError::Transport(format!(
                    "listing its tools took longer than {}s",
                    LIST_TIMEOUT.as_secs()
                ))
            })??;
        let mut all = self.listings.lock().expect("mcp listings");
        if all.len() > 1024 {
            all.clear();
        }
        all.insert(key, (Instant::now(), listing.clone()));
        Ok(listing)
    }

    /// Calls tool `name` of a server. The call's idempotency key goes in
    /// `_meta` ([`META_IDEMPOTENCY_KEY`]), as http tools send it in a
    /// header: a server may drop a repeated delivery of one call.
    pub(crate) async fn call(
        &self,
        resolved: Resolved,
        name: &str,
        arguments: &Map<String, Value>,
        idempotency_key: &str,
    ) -> Result<Value, McpError> {
        let conn = self.connection(resolved)?;
        let mut params = Map::new();
        params.insert("name".into(), json!(name));
        params.insert("arguments".into(), Value::Object(arguments.clone()));
        // The key is unique per call, so it doubles as the progress token:
        // a server may then stream progress (SSE) before the result, which
        // the client reads past.
        params.insert(
            "_meta".into(),
            json!({ META_IDEMPOTENCY_KEY: idempotency_key, "progressToken": idempotency_key }),
        );
        conn.request("tools/call", params).await
    }
}

/// How a server is reached with these secrets, or why it cannot be. A
/// connection is opened (its HTTP client made: redirects within the origin
/// and `allowed`) only when the pool has none under the same key.
pub(crate) fn resolve(
    endpoint: &Endpoint,
    allowed: Option<Arc<AllowedUrls>>,
    lookup: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Resolved, McpError> {
    match endpoint {
        Endpoint::Http { url, headers } => {
            let (key, headers) = http::resolve_headers(url, headers, lookup)?;
            let url = url.clone();
            Ok(Resolved {
                key,
                open: Box::new(move || {
                    let client = super::http_client(allowed)
                        .map_err(|e| McpError::Transport(format!("no HTTP client: {e}")))?;
                    HttpEndpoint::new(&url, client, headers).map(Transport::Http)
                }),
            })
        }
        Endpoint::Stdio { command, env } => {
            let (key, env) = stdio::resolve_env(command, env, lookup)?;
            let command = command.clone();
            Ok(Resolved {
                key,
                open: Box::new(move || {
                    StdioEndpoint::spawn(&command, env).map(|s| Transport::Stdio(Box::new(s)))
                }),
            })
        }
    }
}

#[cfg(test)]
mod hint_tests {
    use super::idempotent_hint;
    use serde_json::json;

    #[test]
    fn annotations_say_idempotent_or_not_and_silence_keeps_the_default() {
        let hint = |v: serde_json::Value| idempotent_hint(Some(&v));
        assert_eq!(idempotent_hint(None), None);
        assert_eq!(hint(json!({})), None);
        assert_eq!(hint(json!({"readOnlyHint": true})), Some(true));
        assert_eq!(
            hint(json!({"idempotentHint": true, "destructiveHint": true})),
            Some(true)
        );
        assert_eq!(hint(json!({"idempotentHint": false})), Some(false));
        assert_eq!(hint(json!({"destructiveHint": true})), Some(false));
        assert_eq!(hint(json!({"destructiveHint": false})), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_results_become_text_media_or_errors() {
        let r = interpret_call(
            &json!({"content": [{"type": "text", "text": "5"}], "structuredContent": {"result": 5}, "isError": false}),
        );
        assert_eq!(r, ToolResult::text("5"));
        let r = interpret_call(
            &json!({"content": [{"type": "text", "text": "refused: no"}], "isError": true}),
        );
        assert_eq!(r, ToolResult::error("refused: no"));
        let r = interpret_call(&json!({"content": [], "structuredContent": {"a": 1}}));
        assert_eq!(
            r,
            ToolResult::ok(ToolResponse::Json {
                content: json!({"a": 1})
            })
        );
        let r = interpret_call(&json!({"resultType": "input_required", "inputRequests": {}}));
        assert!(r.is_error(), "{r:?}");
        let r = interpret_call(
            &json!({"content": [{"type": "image", "mimeType": "image/png", "data": "AAAA"}, {"type": "text", "text": "x"}]}),
        );
        assert!(
            matches!(r, ToolResult::Success { response: ToolResponse::Mixed { ref parts } } if parts.len() == 2),
            "{r:?}"
        );
    }

    /// A server of the session-based revision only, scripted on a raw
    /// socket: it refuses the stateless probe, hands out sessions `s1`,
    /// `s2`, …, forgets the first after one request, answers in SSE. Keeps
    /// (method, Mcp-Session-Id, MCP-Protocol-Version) of each request.
    async fn legacy_server(
        sse_padding: usize,
    ) -> (String, Arc<Mutex<Vec<(String, String, String)>>>) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            let mut sessions = 0;
            while let Ok((mut sock, _)) = listener.accept().await {
                let raw = crate::http::tests::read_request(&mut sock).await;
                let text = String::from_utf8_lossy(&raw).into_owned();
                let (head, body) = text.split_once("\r\n\r\n").unwrap();
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix(name)
                                .map(|v| v.trim().to_string())
                        })
                        .unwrap_or_default()
                };
                let msg: Value = serde_json::from_str(body).unwrap();
                let method = msg["method"].as_str().unwrap().to_string();
                let session = header("mcp-session-id:");
                log.lock().unwrap().push((
                    method.clone(),
                    session.clone(),
                    header("mcp-protocol-version:"),
                ));
                let id = msg["id"].clone();
                let reply = |status: &str, extra: &str, ctype: &str, body: String| {
                    format!("HTTP/1.1 {status}\r\n{extra}content-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
                };
                let answer = match method.as_str() {
                    "server/discover" => reply("400 Bad Request", "", "application/json", json!({"jsonrpc": "2.0", "id": "server-error", "error": {"code": -32600, "message": "Bad Request: Unsupported protocol version"}}).to_string()),
                    "initialize" => {
                        sessions += 1;
                        let result = json!({"jsonrpc": "2.0", "id": id, "result": {"protocolVersion": "2025-06-18", "capabilities": {}, "serverInfo": {"name": "x", "version": "1"}}});
                        reply("200 OK", &format!("mcp-session-id: s{sessions}\r\n"), "application/json", result.to_string())
                    }
                    "notifications/initialized" => reply("202 Accepted", "", "application/json", String::new()),
                    _ if session == "s1" && log.lock().unwrap().iter().filter(|(_, s, _)| s == "s1").count() > 2 => {
                        reply("404 Not Found", "", "application/json", String::new())
                    }
                    _ => {
                        let result = json!({"jsonrpc": "2.0", "id": id, "result": {"tools": [{"name": "t", "inputSchema": {"type": "object"}}]}});
                        let padding = "x".repeat(sse_padding);
                        let events = format!(": {padding}\n\nevent: message\ndata: {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}}\n\nevent: message\ndata: {result}\n\n");
                        reply("200 OK", "", "text/event-stream", events)
                    }
                };
                let _ = sock.write_all(answer.as_bytes()).await;
            }
        });
        (url, seen)
    }

    fn http_endpoint(url: &str) -> Resolved {
        resolve(
            &Endpoint::Http {
                url: url.into(),
                headers: vec![],
            },
            None,
            &|_| None,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn a_session_based_server_gets_the_handshake_and_a_forgotten_session_is_renewed() {
        let (url, seen) = legacy_server(0).await;
        let pool = McpPool::default();
        let listing = pool.list(http_endpoint(&url)).await.unwrap();
        assert_eq!(listing.protocol_version, "2025-06-18");
        assert_eq!(listing.tools[0].name, "t");
        // s1 is forgotten now: a new session, and the request again.
        let args = Map::new();
        pool.call(http_endpoint(&url), "t", &args, "k")
            .await
            .unwrap();
        let seen: Vec<(String, String, String)> = seen.lock().unwrap().clone();
        let row = |m: &str, s: &str, v: &str| (m.to_string(), s.to_string(), v.to_string());
        assert_eq!(
            seen,
            [
                row("server/discover", "", MODERN_VERSION),
                row("initialize", "", ""),
                row("notifications/initialized", "s1", "2025-06-18"),
                row("tools/list", "s1", "2025-06-18"),
                row("tools/call", "s1", "2025-06-18"),
                row("initialize", "", ""),
                row("notifications/initialized", "s2", "2025-06-18"),
                row("tools/call", "s2", "2025-06-18"),
            ]
        );
    }

    #[tokio::test]
    async fn an_event_stream_past_the_cap_fails_the_request() {
        let (url, _) = legacy_server(MAX_MESSAGE_BYTES + 1).await;
        let e = McpPool::default()
            .list(http_endpoint(&url))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("the most an MCP server's message may hold"),
            "{e}"
        );
    }

    #[test]
    fn tool_names_a_model_cannot_call_are_refused() {
        assert!(valid_tool_name("get_weather-2"));
        assert!(!valid_tool_name("a b"));
        assert!(!valid_tool_name(""));
        assert!(!valid_tool_name(&"x".repeat(65)));
        let e = parse_tool(&json!({"name": "a.b"})).unwrap_err();
        assert!(e.to_string().contains("1 to 64 letters"), "{e}");
    }
}
