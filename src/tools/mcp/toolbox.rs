//! MCP servers in a [`Toolbox`]: checked when the toolbox is made, listed
//! by [`Toolbox::discover`] (each listed tool becomes a tool of the
//! toolbox, called by its own name), called by [`Toolbox::run`].

use super::{answer_of, resolve, Endpoint, McpPool, McpServerDef, McpTool, Resolved};
use crate::core::call::TaskHandle;
use crate::core::ToolResult;
use crate::ports::{TaskPoll, ToolRun};
use crate::tools::{check_header, ToolDef, ToolError, ToolKind, Toolbox};
use serde_json::{Map, Value};
use std::sync::Arc;

/// What listing one server gave the toolbox.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerListing {
    pub server: String,
    /// The URL, or `stdio: COMMAND`.
    pub endpoint: String,
    pub protocol_version: String,
    /// The tools offered (after `tools:`), in the server's order.
    pub tools: Vec<McpTool>,
}

/// Why an agent's MCP tools cannot be had.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DiscoverError {
    #[error("mcp server {server:?}: {why}; its tools cannot be listed or called")]
    NotAllowed { server: String, why: String },
    #[error("mcp server {server:?} is started as a process ({command}), which only `agents run` does; in a cluster give the server's `url` (Streamable HTTP) instead of `command`")]
    StdioNotHere { server: String, command: String },
    #[error("mcp server {server:?} ({endpoint}): listing its tools failed: {error}")]
    Unavailable {
        server: String,
        endpoint: String,
        error: String,
    },
    #[error("mcp server {server:?} ({endpoint}) offers no tool {tool:?}, which its `tools:` names; it offers: {offered}")]
    Missing {
        server: String,
        endpoint: String,
        tool: String,
        offered: String,
    },
    #[error("mcp server {server:?} offers a tool {tool:?}, and {other} has that name too; a tool name must be the agent's only one: rename the other tool, or leave {tool:?} out with the server's `tools:`")]
    Collision {
        server: String,
        tool: String,
        other: String,
    },
}

impl Toolbox {
    /// Adds MCP servers, checked (headers, env, `tools:`); their tools come
    /// with [`Toolbox::discover`].
    pub fn with_mcp_servers(mut self, servers: Vec<McpServerDef>) -> Result<Self, ToolError> {
        for s in &servers {
            check_server(s).map_err(|why| ToolError::BadMcpServer {
                server: s.name.clone(),
                why,
            })?;
        }
        self.servers = servers;
        Ok(self)
    }

    /// Shares `pool`'s connections and listings (the operator's, across
    /// reconciles).
    pub fn with_mcp_pool(mut self, pool: Arc<McpPool>) -> Self {
        self.mcp = pool;
        self
    }

    pub fn mcp_servers(&self) -> &[McpServerDef] {
        &self.servers
    }

    /// Lists every MCP server (a listing younger than a minute is reused)
    /// and adds the tools each offers; `stdio`: whether servers may be
    /// started as processes here.
    pub async fn discover(
        mut self,
        stdio: bool,
    ) -> Result<(Toolbox, Vec<ServerListing>), DiscoverError> {
        let mut listings = Vec::new();
        for server in self.servers.clone() {
            let listing = self.list_server(&server, stdio).await?;
            let server = Arc::new(server);
            for t in &listing.tools {
                if let Some(other) = self.tools.get(&t.name) {
                    return Err(DiscoverError::Collision {
                        server: server.name.clone(),
                        tool: t.name.clone(),
                        other: match &other.kind {
                            ToolKind::Mcp { server } => {
                                format!("a tool of mcp server {:?}", server.name)
                            }
                            _ => "another tool of the agent".into(),
                        },
                    });
                }
                self.tools.insert(
                    t.name.clone(),
                    ToolDef {
                        name: t.name.clone(),
                        description: t.description.clone(),
                        parameters: t.input_schema.clone(),
                        kind: ToolKind::Mcp {
                            server: server.clone(),
                        },
                    },
                );
            }
            listings.push(listing);
        }
        Ok((self, listings))
    }

    /// One server's tools, `tools:` applied.
    async fn list_server(
        &self,
        server: &McpServerDef,
        stdio: bool,
    ) -> Result<ServerListing, DiscoverError> {
        let endpoint = server.endpoint.describe();
        match &server.endpoint {
            Endpoint::Stdio { command, .. } if !stdio => {
                return Err(DiscoverError::StdioNotHere {
                    server: server.name.clone(),
                    command: command.join(" "),
                })
            }
            Endpoint::Http { url, .. } => self.check_allowed(&server.name, url)?,
            Endpoint::Stdio { .. } => {}
        }
        let unavailable = |error: String| DiscoverError::Unavailable {
            server: server.name.clone(),
            endpoint: endpoint.clone(),
            error,
        };
        let lookup = |k: &str| self.secret(k);
        let resolved = resolve(&server.endpoint, self.allowed_urls.clone(), &lookup)
            .map_err(|e| unavailable(e.to_string()))?;
        let listing = self
            .mcp
            .list(resolved)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let mut tools = listing.tools;
        if !server.only.is_empty() {
            if let Some(missing) = server
                .only
                .iter()
                .find(|n| !tools.iter().any(|t| &t.name == *n))
            {
                return Err(DiscoverError::Missing {
                    server: server.name.clone(),
                    endpoint,
                    tool: missing.clone(),
                    offered: tools
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
            tools.retain(|t| server.only.contains(&t.name));
        }
        Ok(ServerListing {
            server: server.name.clone(),
            endpoint,
            protocol_version: listing.protocol_version,
            tools,
        })
    }

    fn check_allowed(&self, server: &str, url: &str) -> Result<(), DiscoverError> {
        match &self.allowed_urls {
            Some(allowed) if !allowed.allows_str(url) => Err(DiscoverError::NotAllowed {
                server: server.into(),
                why: allowed.not_listed(url),
            }),
            _ => Ok(()),
        }
    }

    /// A secret the driver resolved, or (standalone) the environment's.
    pub(crate) fn secret(&self, k: &str) -> Option<String> {
        match &self.secrets {
            Some(resolved) => resolved.get(k).cloned(),
            None => std::env::var(k).ok(),
        }
    }

    /// `tools/call` of tool `name` on `server`: its result (`isError` and
    /// JSON-RPC errors as error results), or the task it became.
    pub(crate) async fn mcp_call(
        &self,
        server: &McpServerDef,
        name: &str,
        args: &Map<String, Value>,
        idempotency_key: &str,
    ) -> ToolRun {
        let resolved = match self.mcp_resolve(server, &format!("tools/call {name}")) {
            Ok(r) => r,
            Err(refused) => return ToolRun::Done(refused),
        };
        match self.mcp.call(resolved, name, args, idempotency_key).await {
            Ok(result) => answer_of(&result),
            Err(e) => ToolRun::Done(ToolResult::error(format!(
                "mcp server {:?} ({}): tools/call {name}: {e}",
                server.name,
                server.endpoint.describe()
            ))),
        }
    }

    /// Polls the task a call of `server`'s became.
    pub(crate) async fn mcp_poll(
        &self,
        server: &McpServerDef,
        task: &TaskHandle,
        answers: Option<&str>,
    ) -> TaskPoll {
        match self.mcp_resolve(server, &format!("tasks/get {}", task.id)) {
            Ok(resolved) => self.mcp.poll_task(resolved, task, answers).await,
            Err(refused) => TaskPoll::Ended(refused),
        }
    }

    /// Cancels the task a call of `server`'s became (best effort).
    pub(crate) async fn mcp_cancel(&self, server: &McpServerDef, task: &TaskHandle) {
        if let Ok(resolved) = self.mcp_resolve(server, &format!("tasks/cancel {}", task.id)) {
            self.mcp.cancel_task(resolved, task).await;
        }
    }

    /// How `server` is reached now (the allow-list and secrets applied),
    /// or the error result saying why it cannot be, for `what`.
    fn mcp_resolve(&self, server: &McpServerDef, what: &str) -> Result<Resolved, ToolResult> {
        if let Endpoint::Http { url, .. } = &server.endpoint {
            if let Err(e) = self.check_allowed(&server.name, url) {
                return Err(ToolResult::error(e.to_string()));
            }
        }
        let lookup = |k: &str| self.secret(k);
        resolve(&server.endpoint, self.allowed_urls.clone(), &lookup).map_err(|e| {
            ToolResult::error(format!(
                "mcp server {:?} ({}): {what}: {e}",
                server.name,
                server.endpoint.describe()
            ))
        })
    }
}

/// What an entry must be before anything is asked of its server.
fn check_server(s: &McpServerDef) -> Result<(), String> {
    match &s.endpoint {
        Endpoint::Http { url, headers } => {
            reqwest::Url::parse(url).map_err(|e| format!("url {url:?} is not a URL: {e}"))?;
            for h in headers {
                check_header(h).map_err(|why| format!("header {:?}: {why}", h.name))?;
                if super::http::RESERVED_HEADERS.contains(&h.name.to_ascii_lowercase().as_str()) {
                    return Err(format!(
                        "header {:?}: set by the MCP client itself; remove it",
                        h.name
                    ));
                }
            }
        }
        Endpoint::Stdio { command, env } => {
            if command.is_empty() || command[0].is_empty() {
                return Err("give `url`, or (standalone) a `command` to start".into());
            }
            for e in env {
                if e.value.is_some() == e.secret.is_some() {
                    return Err(format!(
                        "env {:?}: give exactly one of value and valueFrom",
                        e.name
                    ));
                }
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = s.only.iter().find(|n| !seen.insert(*n)) {
        return Err(format!("`tools:` names {twice:?} twice"));
    }
    Ok(())
}
