//! Sub-agents under `agents run`: each call of an `agent` tool runs as a
//! child session in the same store and the same process. The engine asks
//! for the child only after the call's claim is committed; the child is
//! created if absent (adopted when its stored parent is this call's
//! session, by UID), driven here until it ends or waits on the outside,
//! and its answer (or failure) is the call's result, recorded once by the
//! parent's step like any other result.
//!
//! A child that waits on the outside (an approval, a result) leaves the
//! call in flight: the parent's step yields too, and the whole tree is
//! taken up again by `agents session resume ROOT`, whose step finds the
//! claim of the process that ended and adopts the child again.

use super::definition::{EnvSecrets, SubAgents};
use super::driver::{drive_session, pending_calls, DriveOptions, Outcome};
use super::progress::{PendingCall, Progress};
use crate::agent::{subagents, Definition, RunnableAgent};
use crate::core::session::subagent::{self, ChildPlan};
use crate::core::{ContinuationToken, Phase, SessionId, SessionState, ToolResult};
use crate::engine::{Roles, SessionPort, SystemClock};
use crate::ports::{AdminPort, RunStatus, SessionInput, SessionRecord, StoreError, TreeLink};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use tracing::warn;

/// A session's definition as the embedded store keeps it: its agent, and
/// the file's Agents its sub-agents may run (passed down the tree).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredDefinition {
    #[serde(flatten)]
    pub definition: Definition,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sub_agents: SubAgents,
}

impl StoredDefinition {
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("a definition serialises")
    }
}

/// The Agents stored beside a session for its sub-agents.
fn stored_sub_agents(record: &SessionRecord) -> SubAgents {
    record
        .definition
        .get("subAgents")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// The parent this record's session was made for, if it is a child.
fn stored_parent(record: &SessionRecord) -> Option<crate::api::session::ParentRef> {
    let def: Definition = serde_json::from_value(record.definition.clone()).ok()?;
    def.spec.parent
}

/// Why a child cannot be had now: an answer for the model, or a passing
/// fault (the call stays in flight; the next step tries again).
enum NoChild {
    Result(ToolResult),
    Later(String),
}

/// Makes and drives the children of one session's sub-agent calls.
#[derive(Clone, Copy)]
pub struct ChildRunner<'a> {
    pub store: &'a dyn AdminPort,
    /// The session whose calls these are.
    pub parent: &'a SessionId,
    pub opts: &'a DriveOptions,
    pub report: &'a (dyn Fn(&Progress) + Send + Sync),
}

impl<'a> ChildRunner<'a> {
    /// The child of `plan`: created if absent, then driven until it ends
    /// (its answer), waits on the outside, is paused with a session above
    /// it, or runs past `bound` (the call's timeout): in flight, then.
    pub fn start(self, plan: &'a ChildPlan, bound: Option<Duration>) -> BoxFuture<'a, RunStatus> {
        Box::pin(async move {
            let record = match self.child(plan, true).await {
                Ok(record) => record,
                Err(NoChild::Result(r)) => return RunStatus::Finished(r),
                Err(NoChild::Later(why)) => {
                    warn!(child = %plan.name, %why, "the sub-agent session cannot be had now");
                    return RunStatus::InFlight;
                }
            };
            if let Some(done) = outcome(plan, &record.state) {
                return done;
            }
            let Some(bound) = bound else {
                return self.drive(plan, &record).await;
            };
            // Past its time the child is left where it is: the parent's
            // next step ends the call (the model is told) and releases it.
            tokio::time::timeout(bound, self.drive(plan, &record))
                .await
                .unwrap_or(RunStatus::InFlight)
        })
    }

    /// Stops the child of the call `token` (its timeout ended the call
    /// first): the child and every unfinished session below it end
    /// `Failed`, saying why. A finished child is left as it is.
    pub fn release(self, token: &'a ContinuationToken) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let id = SessionId(token.as_str().to_string());
            let Ok(Some(child)) = SessionPort::load(self.store, &id).await else {
                return;
            };
            let mine = stored_parent(&child.value).is_some_and(|p| p.name == self.parent.0);
            if !mine || child.value.state.phase.is_final() {
                return;
            }
            let members = match self.store.tree(&id).await {
                Ok(members) => members,
                Err(e) => {
                    warn!(child = %id, error = %e, "stopping a sub-agent session failed");
                    return;
                }
            };
            let why = format!(
                "stopped: the call that made it ({} of session {}) timed out",
                token, self.parent
            );
            for m in members.iter().filter(|m| !m.record.state.phase.is_final()) {
                let below = &m.record.state.id;
                if let Err(e) = crate::engine::fail(self.store, &SystemClock, below, &why).await {
                    warn!(session = %below, error = %e, "stopping a sub-agent session failed");
                }
            }
        })
    }

    /// The child's outcome if it ended; never makes or drives one (a
    /// paused parent collects).
    pub fn collect(self, plan: &'a ChildPlan) -> BoxFuture<'a, RunStatus> {
        Box::pin(async move {
            match self.child(plan, false).await {
                Ok(record) => outcome(plan, &record.state).unwrap_or(RunStatus::InFlight),
                Err(NoChild::Result(r)) => RunStatus::Finished(r),
                Err(NoChild::Later(_)) => RunStatus::InFlight,
            }
        })
    }

    /// The final token usage of the ended child of `plan` (this parent's
    /// own, by UID), for the parent's usage and limits.
    pub fn usage(self, plan: &'a ChildPlan) -> BoxFuture<'a, Option<crate::core::TokenUsage>> {
        Box::pin(async move {
            let record = self.child(plan, false).await.ok()?;
            record.state.phase.is_final().then_some(record.state.usage)
        })
    }

    /// The stored child of `plan`, made first when `make` and it is absent.
    async fn child(&self, plan: &ChildPlan, make: bool) -> Result<SessionRecord, NoChild> {
        let later = |e: StoreError| NoChild::Later(e.to_string());
        let parent = SessionPort::load(self.store, &plan.parent)
            .await
            .map_err(later)?
            .ok_or_else(|| NoChild::Later(format!("session {} is gone", plan.parent)))?
            .value;
        let id = SessionId(plan.name.clone());
        for _ in 0..2 {
            if let Some(found) = SessionPort::load(self.store, &id).await.map_err(later)? {
                return adopt(plan, &parent, found.value);
            }
            if !make {
                return Err(NoChild::Later("not made yet".into()));
            }
            let (record, link) = child_record(plan, &parent)?;
            match self.store.create_child(record, &link).await {
                // Made by an earlier step that lost its reply: adopt it.
                Ok(_) | Err(StoreError::SessionExists(_)) => continue,
                Err(e) => return Err(later(e)),
            }
        }
        Err(NoChild::Later(format!(
            "session {id} was not found after its creation"
        )))
    }

    /// Drives the child in this process; a wait of its own leaves the call
    /// in flight (the tree yields, the root's yield lists the wait).
    async fn drive(&self, plan: &ChildPlan, record: &SessionRecord) -> RunStatus {
        let agent = match child_agent(record).await {
            Ok(agent) => agent,
            Err(why) => {
                return RunStatus::Finished(ToolResult::error(format!(
                    "the sub-agent {} (session {}) cannot run: {why}",
                    plan.agent, plan.name
                )))
            }
        };
        let report = self.report;
        let quiet = move |p: &Progress| {
            if !matches!(p, Progress::Yielded { .. }) {
                report(p)
            }
        };
        let id = SessionId(plan.name.clone());
        let mut opts = self.opts.clone();
        opts.held_by.push(self.parent.clone());
        match drive_session(self.store, &agent, &id, &opts, &quiet).await {
            Ok(Outcome::Succeeded { answer }) => RunStatus::Finished(ToolResult::text(answer)),
            Ok(Outcome::Failed { reason }) => RunStatus::Finished(failed(plan, &reason)),
            Ok(_) => RunStatus::InFlight,
            Err(e) => {
                warn!(child = %plan.name, error = %e, "driving the sub-agent session stopped");
                RunStatus::InFlight
            }
        }
    }
}

/// The child's agent, as `resume` would build it.
async fn child_agent(record: &SessionRecord) -> Result<RunnableAgent, String> {
    let def: Definition = serde_json::from_value(record.definition.clone())
        .map_err(|e| format!("its stored definition cannot be read: {e}"))?;
    let agent = def.build(record.created_at, &EnvSecrets)?;
    super::any_store::with_mcp_tools(agent)
        .await
        .map_err(|e| e.to_string())
}

/// A found child is this call's when its stored parent is the call's
/// session by name and UID.
fn adopt(
    plan: &ChildPlan,
    parent: &SessionRecord,
    child: SessionRecord,
) -> Result<SessionRecord, NoChild> {
    match stored_parent(&child) {
        Some(p) if p.name == plan.parent.0 && p.uid == parent.uid => Ok(child),
        _ => Err(NoChild::Result(ToolResult::error(format!(
            "a session named {} exists and is not this call's child (its parent is not session {}); remove it from the store or rename the parent session",
            plan.name, plan.parent
        )))),
    }
}

/// The child's record and its place in the tree.
fn child_record(
    plan: &ChildPlan,
    parent: &SessionRecord,
) -> Result<(SessionRecord, TreeLink), NoChild> {
    let sub_agents = stored_sub_agents(parent);
    let Some(agent) = sub_agents.get(&plan.agent).cloned() else {
        return Err(NoChild::Result(ToolResult::error(format!(
            "the sub-agent {:?} is not among the Agents stored with session {}; add that Agent to the file the session was run from",
            plan.agent, plan.parent
        ))));
    };
    let definition = StoredDefinition {
        definition: Definition {
            session: plan.name.clone(),
            agent_name: Some(plan.agent.clone()),
            agent,
            spec: subagents::child_spec(plan, &parent.uid, false),
        },
        sub_agents,
    };
    let now = super::driver::now();
    let record = SessionRecord {
        state: SessionState::new(SessionId(plan.name.clone())),
        input: SessionInput {
            messages: vec![plan.prompt.clone()],
            paused: false,
            retry: 0,
        },
        namespace: String::new(),
        uid: uuid::Uuid::new_v4().to_string(),
        definition: definition.to_value(),
        created_at: now,
        updated_at: now,
        trace: None,
    };
    let root = plan
        .stack
        .first()
        .map_or_else(|| plan.parent.clone(), |e| SessionId(e.session.clone()));
    let link = TreeLink {
        parent: plan.parent.clone(),
        call_id: plan.call_id.to_string(),
        depth: plan.depth,
        root,
    };
    Ok((record, link))
}

/// The call's result when the child has ended.
fn outcome(plan: &ChildPlan, state: &SessionState) -> Option<RunStatus> {
    match state.phase {
        Phase::Succeeded => Some(RunStatus::Finished(ToolResult::text(
            state.answer.clone().unwrap_or_default(),
        ))),
        Phase::Failed => Some(RunStatus::Finished(failed(
            plan,
            state.failure.as_deref().unwrap_or("no reason given"),
        ))),
        _ => None,
    }
}

fn failed(plan: &ChildPlan, reason: &str) -> ToolResult {
    ToolResult::error(format!(
        "the sub-agent {} (session {}) failed: {reason}",
        plan.agent, plan.name
    ))
}

/// True when a sub-agent call of `state` waits for a place among the
/// running children and one is free: the operator steps such a session
/// again when a child ends; this process does so at once.
pub fn turn_is_free(state: &SessionState, agent: &RunnableAgent) -> bool {
    state.open.iter().any(|open| {
        subagent::running_children(&open.calls) < agent.config.lineage.max_children
            && open
                .calls
                .iter()
                .any(|c| subagent::is_new_child(c) && c.retry_at().is_none())
    })
}

/// The waits of every unfinished session below `root`, each with the
/// path from the root (`root`, …, the waiting session). Calls completed
/// in their continuation but not yet taken in are not waits.
pub async fn waits_below(
    store: &dyn AdminPort,
    root: &SessionId,
    opts: &DriveOptions,
    roles: Roles,
) -> Result<Vec<PendingCall>, StoreError> {
    let members = store.tree(root).await?;
    let parents: BTreeMap<String, String> = members
        .iter()
        .filter_map(|m| {
            Some((
                m.record.state.id.0.clone(),
                m.link.as_ref()?.parent.0.clone(),
            ))
        })
        .collect();
    let mut waits = Vec::new();
    for m in members.iter().filter(|m| m.record.state.id != *root) {
        let state = &m.record.state;
        if state.phase.is_final() {
            continue;
        }
        let records = store.continuations_of(&state.id).await?;
        let path = path_to(&state.id.0, &root.0, &parents);
        for mut p in pending_calls(state, opts, roles) {
            let done = records
                .iter()
                .any(|r| r.spec.token.0 == p.token && r.is_completed());
            if !done {
                p.path = path.clone();
                waits.push(p);
            }
        }
    }
    Ok(waits)
}

/// The root of the tree session `id` is in (itself when it is no child):
/// the session whose resume runs it on.
pub async fn root_of(store: &dyn AdminPort, id: &SessionId) -> SessionId {
    let Ok((_, crate::ports::AgentSource::Stored(stored))) = store.agent_source(id).await else {
        return id.clone();
    };
    serde_json::from_value::<Definition>(stored)
        .map(|d| SessionId(subagents::root_of(&id.0, &d.spec)))
        .unwrap_or_else(|_| id.clone())
}

/// The sessions from `root` down to `id`.
fn path_to(id: &str, root: &str, parents: &BTreeMap<String, String>) -> Vec<String> {
    let mut path = vec![id.to_string()];
    let mut at = id;
    while at != root {
        let Some(parent) = parents.get(at) else { break };
        path.push(parent.clone());
        at = parent;
    }
    path.reverse();
    path
}

/// `agents session tree ROOT` on the embedded store: each session, its
/// phase, the call that made it, its depth and its token usage (its ended children's included).
pub async fn tree(store: &dyn AdminPort, root: &SessionId) -> anyhow::Result<Value> {
    let members = store.tree(root).await?;
    let Some(top) = members.iter().find(|m| m.record.state.id == *root) else {
        anyhow::bail!(
            "session {root} not found {}; `agents session list` lists them",
            store.place()
        );
    };
    Ok(node(top, &members))
}

fn node(m: &crate::ports::TreeMember, all: &[crate::ports::TreeMember]) -> Value {
    let id = &m.record.state.id;
    let children: Vec<Value> = all
        .iter()
        .filter(|c| c.link.as_ref().is_some_and(|l| l.parent == *id))
        .map(|c| node(c, all))
        .collect();
    let forked_from = m.record.state.forked_from.as_ref();
    let forks: Vec<Value> = all
        .iter()
        .filter(|c| c.record.state.id != *id)
        .filter(|c| {
            let from = c.record.state.forked_from.as_ref();
            from.is_some_and(|f| f.session == id.0 && f.uid == m.record.uid)
        })
        .map(|c| node(c, all))
        .collect();
    let agent: Option<String> = m
        .record
        .definition
        .get("agentName")
        .and_then(Value::as_str)
        .map(str::to_string);
    json!({
        "name": id.0,
        "agent": agent,
        "phase": format!("{:?}", m.record.state.phase),
        "callId": m.link.as_ref().map(|l| l.call_id.clone()),
        "depth": m.link.as_ref().map_or(0, |l| l.depth),
        "usage": m.record.state.usage,
        "children": children,
        "forkedAtTurn": forked_from.map(|f| f.turn),
        "forks": forks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_runs_from_the_root_down() {
        let parents = BTreeMap::from([
            ("c".to_string(), "b".to_string()),
            ("b".to_string(), "a".to_string()),
        ]);
        assert_eq!(path_to("c", "a", &parents), ["a", "b", "c"]);
        assert_eq!(path_to("b", "b", &parents), ["b"]);
    }
}
