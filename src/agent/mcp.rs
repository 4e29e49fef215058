//! The `mcp` tool kind in the agent: the spec's entries as servers of the
//! toolbox, their listed tools joined to the session config (so policies
//! match them by name and the model is offered them), and the Agent
//! status that shows them.

use super::RunnableAgent;
use crate::api::agent::{McpServerStatus, McpToolStatus, ToolSpec};
use crate::api::convert::env_var;
use crate::core::session::{tool_rule, ToolInfo};
use crate::core::{policy, Disposition, ToolCall};
use crate::tools::mcp::{DiscoverError, Endpoint, McpServerDef, ServerListing};

/// A schema larger than this is left out of the Agent's status.
pub const STATUS_SCHEMA_BYTES: usize = 4 * 1024;
/// The schemas of one Agent's status hold at most this much in all.
pub const STATUS_SCHEMAS_BYTES: usize = 64 * 1024;
/// Descriptions in the status are cut to this.
const STATUS_DESCRIPTION_BYTES: usize = 1024;

/// The MCP servers an agent spec names.
pub fn servers(tools: &[ToolSpec]) -> Vec<McpServerDef> {
    tools
        .iter()
        .filter_map(|t| {
            let m = t.mcp.as_ref()?;
            let endpoint = match (&m.url, &m.command) {
                (Some(url), _) => Endpoint::Http {
                    url: url.clone(),
                    headers: m.headers.iter().map(env_var).collect(),
                },
                (None, command) => Endpoint::Stdio {
                    command: command.clone().unwrap_or_default(),
                    env: m.env.iter().map(env_var).collect(),
                },
            };
            Some(McpServerDef {
                name: t.name.clone(),
                endpoint,
                only: m.tools.clone(),
                idempotent: t.idempotent,
                on_unknown_outcome: t.on_unknown_outcome,
            })
        })
        .collect()
}

/// Why an agent's MCP tools cannot join it.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum McpUnready {
    #[error(transparent)]
    Discover(#[from] DiscoverError),
    #[error("tool {tool:?} (mcp server {server:?}) would run isolated under the policy; MCP tools run where the agent runs: give it runSync, runAsync or defer (with or without approval)")]
    Isolated { tool: String, server: String },
}

impl McpUnready {
    /// The reason of a `Ready=False` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            McpUnready::Discover(DiscoverError::NotAllowed { .. }) => "McpServerUrlNotAllowed",
            McpUnready::Discover(DiscoverError::Unavailable { .. }) => "McpServerUnavailable",
            _ => "InvalidAgent",
        }
    }
}

impl RunnableAgent {
    /// Lists the agent's MCP servers and adds their tools: to the toolbox
    /// (run), the session config (policies and fingerprints), and so to
    /// what the model is offered. `stdio`: whether servers may be started
    /// as processes (standalone only). Call it after the toolbox has its
    /// secrets and allow-list.
    pub async fn with_mcp_tools(
        mut self,
        stdio: bool,
    ) -> Result<(RunnableAgent, Vec<ServerListing>), McpUnready> {
        if self.toolbox.mcp_servers().is_empty() {
            return Ok((self, Vec::new()));
        }
        let (toolbox, listings) = self.toolbox.discover(stdio).await?;
        self.toolbox = toolbox;
        for (listing, server) in listings.iter().zip(self.toolbox.mcp_servers()) {
            let spec = format!("{:?}", server);
            for tool in &listing.tools {
                self.check_not_isolated(&tool.name, &listing.server)?;
                let unknown_outcome = tool_rule(
                    server.idempotent,
                    tool.idempotent_hint,
                    server.on_unknown_outcome,
                );
                self.config.tools.insert(
                    tool.name.clone(),
                    ToolInfo {
                        container: None,
                        sub_agent: None,
                        unknown_outcome,
                    },
                );
                // A changed server or schema never reuses cached results.
                let what = serde_json::json!({"mcp": spec, "schema": tool.input_schema});
                self.config
                    .tool_fingerprints
                    .insert(tool.name.clone(), crate::core::cache::fingerprint(&what));
            }
        }
        Ok((self, listings))
    }

    fn check_not_isolated(&self, tool: &str, server: &str) -> Result<(), McpUnready> {
        let probe = ToolCall {
            model_call_id: String::new(),
            name: tool.into(),
            arguments: "{}".into(),
        };
        let ctx = policy::PolicyContext {
            session: None,
            tool_container: None,
            sub_agent: None,
        };
        match self.config.policy.classify(&ctx, &probe).disposition {
            Disposition::RunIsolated { .. } => Err(McpUnready::Isolated {
                tool: tool.into(),
                server: server.into(),
            }),
            _ => Ok(()),
        }
    }
}

/// What the Agent's status shows of its MCP servers and tools, bounded.
pub fn status(listings: &[ServerListing]) -> (Vec<McpServerStatus>, Vec<McpToolStatus>) {
    let servers = listings
        .iter()
        .map(|l| McpServerStatus {
            name: l.server.clone(),
            protocol_version: l.protocol_version.clone(),
            tools: l.tools.len() as u32,
        })
        .collect();
    let mut budget = STATUS_SCHEMAS_BYTES;
    let mut tools = Vec::new();
    for l in listings {
        for t in &l.tools {
            let size = t.input_schema.as_ref().map_or(0, |s| s.to_string().len());
            let keep = size <= STATUS_SCHEMA_BYTES && size <= budget;
            if keep {
                budget -= size;
            }
            tools.push(McpToolStatus {
                name: t.name.clone(),
                server: l.server.clone(),
                description: crate::http::clip(&t.description, STATUS_DESCRIPTION_BYTES).into(),
                input_schema: if keep { t.input_schema.clone() } else { None },
                schema_omitted: !keep && t.input_schema.is_some(),
            });
        }
    }
    (servers, tools)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::mcp::McpTool;
    use serde_json::json;

    #[test]
    fn the_status_keeps_schemas_within_bounds() {
        let tool = |name: &str, bytes: usize| McpTool {
            name: name.into(),
            description: "d".repeat(5000),
            input_schema: Some(json!({"type": "object", "description": "x".repeat(bytes)})),
            idempotent_hint: None,
        };
        let mut tools = vec![tool("small", 10), tool("big", 5000)];
        tools.extend((0..40).map(|i| tool(&format!("t{i}"), 3000)));
        let listing = ServerListing {
            server: "s".into(),
            endpoint: "http://x/mcp".into(),
            protocol_version: "2026-07-28".into(),
            tools,
        };
        let (servers, tools) = status(&[listing]);
        assert_eq!(servers[0].tools, 42);
        assert!(tools[0].input_schema.is_some() && !tools[0].schema_omitted);
        assert!(tools[1].input_schema.is_none() && tools[1].schema_omitted);
        assert_eq!(tools[0].description.len(), 1024);
        let kept: usize = tools
            .iter()
            .filter_map(|t| t.input_schema.as_ref())
            .map(|s| s.to_string().len())
            .sum();
        assert!(kept <= STATUS_SCHEMAS_BYTES, "{kept}");
        assert!(tools.last().unwrap().schema_omitted);
    }
}
