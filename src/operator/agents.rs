//! The Agent controller: each Agent is checked as a session would use it
//! (policy globs, tools, model, the Secret it names) and the result is its
//! `Ready` condition, so a broken agent is visible before a session runs it.

use super::report::{self, ready};
use super::{prepare, Context, NotReady, HTTP_TOOL_URL_NOT_ALLOWED, INVALID_RECHECK};
use crate::api::agent::{AgentStatus, McpServerStatus, McpToolStatus};
use crate::api::{Agent, SessionSpec};
use crate::core::conditions::{self, Condition, Status};
use crate::engine::{Clock, SystemClock};
use crate::store::kube::{core_condition, meta_condition};
use futures::{Future, StreamExt};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::ResourceExt;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// An agent's Secret may appear later, and Secrets are not watched.
const RECHECK: Duration = Duration::from_secs(60);

pub fn controller(
    client: &kube::Client,
    namespace: Option<&str>,
    ctx: Arc<Context>,
    health: &crate::observe::Health,
) -> impl Future<Output = ()> {
    use kube::runtime::WatchStreamExt;
    let (store, writer) = kube::runtime::reflector::store::<Agent>();
    let events = super::tracked_watch(
        super::api::<Agent>(client, namespace),
        watcher::Config::default(),
        health,
        format!(
            "watch agents (agent controller)/{}",
            namespace.unwrap_or("all")
        ),
    )
    .reflect(writer)
    .applied_objects();
    Controller::for_stream(events, store)
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                debug!(error = %e, "agent reconcile not done");
            }
        })
}

/// The Agents a session names, read from the session controller's watch
/// cache: a step reads no Agent from the API server. An Agent the cache
/// has not seen yet (the operator just started, or it was created a moment
/// ago) is read from the API server.
pub(super) struct WatchedAgents<'a> {
    pub seen: &'a kube::runtime::reflector::Store<Agent>,
    pub api: crate::store::kube_admin::ClusterAgents,
    pub namespace: &'a str,
}

impl crate::agent::AgentLookup for WatchedAgents<'_> {
    fn agent<'b>(
        &'b self,
        name: &'b str,
    ) -> futures::future::BoxFuture<'b, Result<Option<crate::api::AgentSpec>, String>> {
        let key = kube::runtime::reflector::ObjectRef::new(name).within(self.namespace);
        match self.seen.get(&key) {
            Some(agent) => Box::pin(futures::future::ready(Ok(Some(agent.spec.clone())))),
            None => self.api.agent(name),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the API server: {0}")]
    Kube(#[from] kube::Error),
    #[error("agent {0} has no namespace")]
    NoNamespace(String),
}

async fn reconcile(agent: Arc<Agent>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = agent.name_any();
    let ns = agent
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    let created = SystemClock.now();
    let (ready, recheck, mcp) = check(&ctx, &ns, &name, &agent.spec, created).await;
    let status = agent.status.clone().unwrap_or_default();
    let previous: Vec<conditions::Condition> = status
        .conditions
        .iter()
        .filter_map(core_condition)
        .collect();
    let generation = agent.metadata.generation;
    let settled = report::agent_conditions(ready.clone(), &previous, generation, created);
    let (mcp_servers, mcp_tools) = mcp;
    if settled == previous
        && status.observed_generation == generation
        && status.mcp_servers == mcp_servers
        && status.mcp_tools == mcp_tools
    {
        return Ok(Action::requeue(recheck));
    }
    let next = AgentStatus {
        conditions: settled.iter().map(meta_condition).collect(),
        observed_generation: generation,
        mcp_servers,
        mcp_tools,
    };
    // A merge patch: lists are replaced whole, and emptied ones removed.
    // Over the version checked: an Agent changed meanwhile is checked again
    // (the watch brings it), never given the status of its old spec.
    let mut patch = json!({
        "metadata": {"resourceVersion": agent.resource_version()},
        "status": next,
    });
    for list in ["mcpServers", "mcpTools"] {
        if patch["status"].get(list).is_none() {
            patch["status"][list] = serde_json::Value::Null;
        }
    }
    let agents: Api<Agent> = Api::namespaced(ctx.client.clone(), &ns);
    match agents
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => {
            debug!(agent = %format!("{ns}/{name}"), "agent changed while checked; checking again");
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        written => written?,
    };
    if ready.status == Status::True {
        info!(agent = %format!("{ns}/{name}"), "agent valid");
    } else {
        warn!(agent = %format!("{ns}/{name}"), reason = %ready.reason, message = %ready.message, "agent not ready");
    }
    Ok(Action::requeue(recheck))
}

/// What a session referring to the agent would meet: its `Ready`
/// condition, when to look again, and what its MCP servers offer.
async fn check(
    ctx: &Context,
    ns: &str,
    name: &str,
    spec: &crate::api::AgentSpec,
    created: crate::core::Millis,
) -> (
    Condition,
    Duration,
    (Vec<McpServerStatus>, Vec<McpToolStatus>),
) {
    // The checks a session referring to it would meet.
    let probe = SessionSpec::referring_to(name);
    let definition = crate::agent::Definition {
        session: "agent-check".into(),
        agent_name: Some(name.into()),
        agent: spec.clone(),
        spec: probe,
    };
    let mut mcp = (Vec::new(), Vec::new());
    if let Some(missing) = missing_sub_agent(ctx, ns, spec) {
        let message = format!("agent tool {missing:?}: there is no Agent {missing:?} in namespace {ns}; create it, or remove the tool (each call would fail)");
        return (
            ready(Status::False, "SubAgentNotFound", message),
            INVALID_RECHECK,
            mcp,
        );
    }
    let (ready, recheck) = match prepare(ctx, ns, definition, created).await {
        Ok(resolved) => match resolved.tools.urls_not_allowed().first() {
            None => {
                mcp = crate::agent::mcp::status(&resolved.mcp);
                (
                    ready(
                        Status::True,
                        "Valid",
                        "policy, tools and model are valid".into(),
                    ),
                    RECHECK,
                )
            }
            // The URL is static: every call of the tool would be refused.
            Some((tool, _, why)) => (
                ready(
                    Status::False,
                    HTTP_TOOL_URL_NOT_ALLOWED,
                    format!(
                        "http tool {tool:?}: {why}; sessions of this agent run, and each call of {tool:?} fails with this error"
                    ),
                ),
                INVALID_RECHECK,
            ),
        },
        Err(NotReady {
            reason,
            message,
            recheck,
        }) => (
            ready(Status::False, reason, message),
            recheck.min(INVALID_RECHECK),
        ),
    };
    (ready, recheck, mcp)
}

/// The first Agent an `agent` tool names that the watch has not seen.
fn missing_sub_agent(ctx: &Context, ns: &str, spec: &crate::api::AgentSpec) -> Option<String> {
    spec.tools
        .iter()
        .filter_map(|t| t.agent.as_ref())
        .map(|a| a.agent_ref.clone())
        .find(|name| {
            let at = kube::runtime::reflector::ObjectRef::<Agent>::new(name).within(ns);
            ctx.agents.get(&at).is_none()
        })
}

fn error_policy(agent: Arc<Agent>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(agent = %agent.name_any(), error = %error, "agent reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}
