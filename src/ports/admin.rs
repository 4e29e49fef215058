//! The port behind `agents session ...`: what a person's commands need from
//! a store beyond the engine's ports (list, show, pause, resume, retry, the
//! agent a stored session runs). Both stores implement it, so the CLI holds
//! one `Box<dyn AdminPort>` whichever `--store` it was given.
//!
//! The agent a session runs crosses this port as the documents its store
//! keeps (JSON), not as CRD types: the store maps its own objects to them,
//! and the agent layer reads them by its one rule. So this layer, and the
//! engine above it, need no Kubernetes types.

use super::StorePorts;
use crate::core::{ContinuationToken, SessionId};
use crate::ports::records::*;
use futures::future::BoxFuture;

/// Where a session's named agent (`spec.agentRef`) is found, as a document:
/// the API server's Agents of a namespace.
pub trait AgentDocuments: Send + Sync {
    /// The Agent's spec (JSON, as an Agent's `spec`), `Ok(None)` when there
    /// is no such Agent, or why it cannot be read.
    fn agent_document<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<serde_json::Value>, String>>;
}

/// Where a stored session's agent comes from; the agent layer turns it into
/// a definition by its one rule.
pub enum AgentSource {
    /// Standalone: the definition stored beside the session.
    Stored(serde_json::Value),
    /// In a cluster: the Session's spec (JSON, as a Session's `spec`), and
    /// the Agents of its namespace for a `spec.agentRef`.
    Cluster {
        spec: serde_json::Value,
        agents: Box<dyn AgentDocuments>,
    },
}

/// A change to what the user asked for (the Session's spec, or the stored
/// input standalone).
pub type InputChange<'a> = &'a (dyn Fn(&mut SessionInput) + Send + Sync);

pub trait AdminPort: StorePorts {
    /// True when an operator drives these sessions (the cluster): a command
    /// then changes what the user asked for and leaves the running to it.
    fn operator_driven(&self) -> bool;

    /// Where the sessions live, for messages: `in namespace team-a`.
    fn place(&self) -> String;

    /// Who the person at the keyboard is, to sign decisions and results:
    /// in a cluster, the user the API server authenticates (its admission
    /// policy refuses any other name); standalone, `$USER`.
    fn identity(&self) -> BoxFuture<'_, StoreResult<String>>;

    /// Records `answers` (an `inputResponses` object, JSON) to the MCP
    /// task behind `token`'s request for input, signed `by`; a later
    /// answer replaces it. The driver delivers it with `tasks/update`.
    fn answer_task<'a>(
        &'a self,
        token: &'a ContinuationToken,
        answers: &'a str,
        by: &'a str,
        now: crate::core::Millis,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// Every session, by id.
    fn list(&self) -> BoxFuture<'_, StoreResult<Vec<SessionSummary>>>;

    /// The continuation named `token`, or `None`.
    fn continuation<'a>(
        &'a self,
        token: &'a ContinuationToken,
    ) -> BoxFuture<'a, StoreResult<Option<ContinuationRecord>>>;

    /// The continuations of session `id`, in call order, as a completer may
    /// read them (in a cluster: Continuations only, by label).
    fn continuations_of<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<Vec<ContinuationRecord>>>;

    /// Applies `change` to what the user asked for; nothing is written when
    /// it changes nothing.
    fn change_input<'a>(
        &'a self,
        id: &'a SessionId,
        change: InputChange<'a>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// The stored session and where its agent comes from.
    fn agent_source<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> BoxFuture<'a, StoreResult<(SessionRecord, AgentSource)>>;

    /// Creates a child session in its tree (a driver that runs sub-agents
    /// in its own process); `SessionExists` when one of that name is
    /// there. Stores whose children an operator makes refuse.
    fn create_child<'a>(
        &'a self,
        record: SessionRecord,
        link: &'a TreeLink,
    ) -> BoxFuture<'a, StoreResult<Version>> {
        let _ = (record, link);
        Box::pin(async {
            Err(StoreError::Backend(
                "this store's sub-agent sessions are made by the operator".into(),
            ))
        })
    }

    /// Creates `fork`, whose state is already a prefix of `source`'s
    /// (`state.forkedFrom` set; see `core::fork`). Standalone it is stored
    /// with that history; in a cluster it becomes a Session with
    /// `spec.forkFrom`, whose history the operator writes. `SessionExists`
    /// when the name is taken. The source is only read.
    fn create_fork<'a>(
        &'a self,
        source: &'a SessionRecord,
        fork: SessionRecord,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// `root` and every session under it, the root first, then by depth;
    /// empty when the store keeps no trees (or has no such session).
    fn tree<'a>(&'a self, root: &'a SessionId) -> BoxFuture<'a, StoreResult<Vec<TreeMember>>> {
        let _ = root;
        Box::pin(async { Ok(Vec::new()) })
    }
}
