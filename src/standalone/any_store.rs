//! The store an `agents session ...` command works on: the embedded one
//! (`--store sqlite:PATH`) or the cluster's (`--store kube`, `-n`), as one
//! trait object of the admin port.

use super::definition::{Definition, RunnableAgent};
use crate::core::SessionId;
use crate::ports::{AdminPort, SessionRecord, StoreError};
use anyhow::{anyhow, bail};

pub type AnyStore = Box<dyn AdminPort>;

/// A stored session and its agent, rebuilt from what the store holds:
/// standalone the stored definition; in a cluster the Session's spec and
/// the Agent it refers to.
pub async fn load_agent(
    store: &dyn AdminPort,
    id: &SessionId,
) -> anyhow::Result<(SessionRecord, Definition, RunnableAgent)> {
    let place = store.place();
    let (record, source) = match store.agent_source(id).await {
        Err(StoreError::SessionNotFound(_)) if store.operator_driven() => {
            bail!("session {id} not found {place}; `agents session list --store kube` lists them")
        }
        found => found?,
    };
    let def = crate::agent::stored(&id.0, source, &place)
        .await
        .map_err(|e| anyhow!(e))?;
    let agent = def
        .build(record.created_at, &super::definition::EnvSecrets)
        .map_err(|e| anyhow!("session {id}: {e}"))?;
    Ok((record, def, agent))
}

/// The agent with its MCP servers' tools (stdio servers started here):
/// what a command that steps the session needs (`run`, `resume`,
/// `retry`), before it changes anything. Commands that only read or
/// decide (`show`, `pending`, `approve`, …) never ask the servers, so a
/// server that is down does not keep a person from deciding.
pub async fn with_mcp_tools(agent: RunnableAgent) -> anyhow::Result<RunnableAgent> {
    let (agent, _) = agent.with_mcp_tools(true).await.map_err(|e| anyhow!(e))?;
    Ok(agent)
}
