//! The session export format (`agents session export`), read back by
//! `agents session import` and `agents session replay`: one JSON document,
//! versioned, that carries a session between stores.
//!
//! ```text
//! { "format": "agents-exe.io/session-export", "version": 1,
//!   "exportedAt", "source": {store, namespace, name, uid},
//!   "definition": {session, agentName?, agent, spec}, "subAgents": {...},
//!   "input": {messages, paused, retry}, "state": <the core's SessionState>,
//!   "continuations": [<stored continuations>], "lineage": {parent?, tree?},
//!   "createdAt" }
//! ```
//!
//! The state is the whole conversation (spilled turns and results read
//! back), its calls, results and usage. Secrets appear by reference only
//! (`secretKeyRef`): a definition never holds a value, and the state holds
//! what tools answered, never what they were sent from a Secret.

use crate::agent::Definition;
use crate::api::session::ParentRef;
use crate::core::conversation::check_user_messages;
use crate::core::{ContinuationToken, Millis, SessionId, SessionState, Turn};
use crate::ports::{AdminPort, ContinuationRecord, SessionInput, TreeLink};
use crate::standalone::definition::SubAgents;
use anyhow::{anyhow, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeSet;

/// The `format` every export carries.
pub const EXPORT_FORMAT: &str = "agents-exe.io/session-export";
/// The newest format version this build writes and reads.
pub const EXPORT_VERSION: u64 = 1;
/// The largest export an import or a replay reads: a session's status, its
/// spilled turns (24 MiB at the most) and its open calls' results, with
/// room to spare.
pub const MAX_EXPORT_BYTES: usize = 256 << 20;

/// One exported session (format version 1).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionExport {
    pub format: String,
    pub version: u64,
    pub exported_at: Millis,
    pub source: ExportSource,
    /// The agent and the Session's spec, as the store keeps them (an
    /// `agentRef` resolved to the Agent it names at export time).
    pub definition: Definition,
    /// The Agents the session's `agent` tools may run (standalone).
    #[serde(default, skip_serializing_if = "SubAgents::is_empty")]
    pub sub_agents: SubAgents,
    pub input: SessionInput,
    pub state: SessionState,
    #[serde(default)]
    pub continuations: Vec<ContinuationRecord>,
    #[serde(default)]
    pub lineage: Lineage,
    pub created_at: Millis,
}

/// Where an export was taken from.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportSource {
    /// `sqlite` or `kube`.
    pub store: String,
    #[serde(default)]
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub uid: String,
}

/// Which session this one came from, if any.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lineage {
    /// The parent whose sub-agent call made this session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    /// Its place in a standalone tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreeLink>,
}

/// Reads session `id` from `store` into an export.
pub async fn export_session(
    store: &dyn AdminPort,
    id: &SessionId,
    store_kind: &str,
) -> anyhow::Result<SessionExport> {
    let place = store.place();
    let (record, source) = store.agent_source(id).await?;
    let definition = crate::agent::stored(&id.0, source, &place)
        .await
        .map_err(|e| anyhow!(e))?;
    let owner = super::driver::owner_of(&record);
    let continuations = store.list_for(&owner).await?;
    let sub_agents = record
        .definition
        .get("subAgents")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    let tree = store
        .tree(id)
        .await
        .ok()
        .and_then(|members| members.into_iter().find(|m| m.record.state.id == *id))
        .and_then(|m| m.link);
    Ok(SessionExport {
        format: EXPORT_FORMAT.into(),
        version: EXPORT_VERSION,
        exported_at: super::driver::now(),
        source: ExportSource {
            store: store_kind.into(),
            namespace: record.namespace.clone(),
            name: id.0.clone(),
            uid: record.uid.clone(),
        },
        lineage: Lineage {
            parent: definition.spec.parent.clone(),
            tree,
        },
        definition,
        sub_agents,
        input: record.input,
        state: record.state,
        continuations,
        created_at: record.created_at,
    })
}

/// Reads an export from its text: the format and version first (a newer
/// version is refused by number, before its fields are read), then the
/// fields, then the checks that a hand-edited file could fail.
pub fn parse_export(text: &str, shown: &str) -> anyhow::Result<SessionExport> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        anyhow!("{shown} is not JSON ({e}); give a file `agents session export` wrote")
    })?;
    check_format(&value, shown)?;
    let export: SessionExport = serde_json::from_value(value)
        .map_err(|e| anyhow!("{shown}: the export cannot be read ({e}); it was changed by hand or is damaged; export the session again"))?;
    check_consistent(&export).map_err(|why| {
        anyhow!("{shown} is refused: {why}; the file was changed by hand or is damaged; export the session again")
    })?;
    Ok(export)
}

fn check_format(value: &Value, shown: &str) -> anyhow::Result<()> {
    let format = value.get("format").and_then(Value::as_str);
    if format != Some(EXPORT_FORMAT) {
        bail!("{shown} is not a session export (its \"format\" is {format:?}, expected {EXPORT_FORMAT:?}); give a file `agents session export` wrote");
    }
    match value.get("version").and_then(Value::as_u64) {
        Some(v) if v > EXPORT_VERSION => bail!(
            "{shown} has export format version {v}, newer than this build reads (version {EXPORT_VERSION}); upgrade agents to import it, or export it again with this version"
        ),
        Some(v) if v >= 1 => Ok(()),
        other => bail!("{shown}: \"version\" is {other:?}; expected a format version from 1 to {EXPORT_VERSION}"),
    }
}

/// What a tampered or damaged export would break: every result answers a
/// call of the agent turn before it, call ids are unique, and every
/// continuation belongs to a call the state holds.
pub fn check_consistent(export: &SessionExport) -> Result<(), String> {
    check_user_messages(&export.input.messages).map_err(|e| format!("input.messages: {e}"))?;
    let state = &export.state;
    if state.messages_taken as usize > export.input.messages.len() {
        return Err(format!(
            "the state took {} user messages but input.messages holds {}",
            state.messages_taken,
            export.input.messages.len()
        ));
    }
    let calls = check_turns(&state.turns)?;
    let mut open = BTreeSet::new();
    for call in state.open.iter().flat_map(|o| o.calls.iter()) {
        let id = call.id.to_string();
        if calls.contains(&id) || !open.insert(id.clone()) {
            return Err(format!("call id {id} appears twice"));
        }
    }
    check_continuations(export, &calls, &open)
}

/// The call ids the turns' results hold, each checked against the agent
/// turn before it.
fn check_turns(turns: &[Turn]) -> Result<BTreeSet<String>, String> {
    let mut seen = BTreeSet::new();
    let mut asked: Vec<&str> = Vec::new();
    let mut agent_turn = 0;
    for turn in turns {
        match turn {
            Turn::Agent(a) => {
                agent_turn += 1;
                asked = a
                    .tool_calls
                    .iter()
                    .map(|c| c.model_call_id.as_str())
                    .collect();
                let unique: BTreeSet<_> = asked.iter().collect();
                if unique.len() != asked.len() {
                    return Err(format!("agent turn {agent_turn} has duplicate call ids"));
                }
            }
            Turn::User(u) => {
                for r in &u.tool_results {
                    if !asked.contains(&r.model_call_id.as_str()) {
                        return Err(format!(
                            "a result for call {} ({:?}), which agent turn {agent_turn} did not make",
                            r.call_id, r.model_call_id
                        ));
                    }
                    if !seen.insert(r.call_id.to_string()) {
                        return Err(format!("call id {} has two results", r.call_id));
                    }
                }
            }
        }
    }
    Ok(seen)
}

fn check_continuations(
    export: &SessionExport,
    closed: &BTreeSet<String>,
    open: &BTreeSet<String>,
) -> Result<(), String> {
    let mut tokens = BTreeSet::new();
    for c in &export.continuations {
        let call = c.spec.call_id.to_string();
        if !closed.contains(&call) && !open.contains(&call) {
            return Err(format!(
                "continuation {} is for call {call}, which the session does not hold",
                c.spec.token
            ));
        }
        if !tokens.insert(c.spec.token.clone()) {
            return Err(format!("continuation {} appears twice", c.spec.token));
        }
    }
    Ok(())
}

/// The tokens of the calls still open (not final): their continuations
/// go along to the target store.
pub fn open_tokens(state: &SessionState) -> BTreeSet<ContinuationToken> {
    state
        .open
        .iter()
        .flat_map(|o| o.calls.iter())
        .filter(|c| !c.state().is_final())
        .filter_map(|c| c.token().cloned())
        .collect()
}

/// `agents session export NAME`: the export on stdout.
pub async fn export(
    session: &str,
    sel: &super::commands::StoreSel,
) -> anyhow::Result<std::process::ExitCode> {
    let store = super::commands::open(sel).await?;
    let id = SessionId(session.to_string());
    let kind = if sel.url == "kube" { "kube" } else { "sqlite" };
    let export = export_session(store.as_ref(), &id, kind).await?;
    super::out::line(&serde_json::to_string_pretty(&export)?);
    Ok(std::process::ExitCode::SUCCESS)
}
