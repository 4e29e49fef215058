//! Resolve: the agent of a session dereferenced (the Agent it names or
//! its inline agent, the model's key from a Secret, the tools and their
//! Secrets, the MCP servers' listings) and validated, ready to step; or
//! why it is not ready (the session's `Ready=False`).

use super::{agents, notify, Context, INVALID_RECHECK};
use crate::agent::{Definition, NoSecrets};
use crate::api::agent::ModelProvider;
use crate::api::Session;
use crate::engine::AgentRuntime;
use crate::model::ModelClient;
use crate::tools::Toolbox;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::ResourceExt;
use std::sync::Arc;
use std::time::Duration;

/// Recheck of a session whose agent or Secret is missing (the Agent watch
/// wakes it sooner; Secrets are not watched: `get` is all we may do).
const NOT_READY_RECHECK: Duration = Duration::from_secs(15);

/// Why a session cannot run now: its `Ready=False` condition.
pub(super) struct NotReady {
    pub(super) reason: &'static str,
    pub(super) message: String,
    pub(super) recheck: Duration,
}

/// The agent of a session, ready to run.
pub(super) struct Resolved {
    pub(super) runtime: AgentRuntime,
    pub(super) model: ModelClient,
    pub(super) tools: Arc<Toolbox>,
    pub(super) agent_name: String,
    /// The model's name (`gpt-4o-mini`; `scripted`), for the spend metrics.
    pub(super) model_name: String,
    /// Where waits for a person are announced.
    pub(super) notify: Option<notify::Target>,
    /// What listing the agent's MCP servers found.
    pub(super) mcp: Vec<crate::tools::mcp::ServerListing>,
    /// The namespace Budgets that select the session (none for an Agent's
    /// own check).
    pub(super) budgets: Vec<Arc<crate::api::Budget>>,
}

pub(super) async fn resolve(
    ctx: &Context,
    session: &Session,
    ns: &str,
) -> Result<Resolved, NotReady> {
    use crate::agent::Unresolved;
    if let Some(message) = super::budgets::not_listed(&ctx.budgets).await {
        // The first list wakes it (or this recheck, when there is no Budget).
        return Err(NotReady {
            reason: super::budgets::BUDGETS_NOT_LISTED,
            message,
            recheck: NOT_READY_RECHECK,
        });
    }
    let budgets = super::budgets::selecting(&ctx.budgets, session);
    if let Some(message) = super::budgets::too_many(&budgets) {
        // The Budget watch wakes the session when one goes or changes.
        return Err(NotReady {
            reason: super::budgets::TOO_MANY_BUDGETS,
            message,
            recheck: NOT_READY_RECHECK * 4,
        });
    }
    let name = session.name_any();
    let lookup = agents::WatchedAgents {
        seen: &ctx.agents,
        api: crate::store::kube_admin::ClusterAgents(Api::namespaced(ctx.client.clone(), ns)),
        namespace: ns,
    };
    let place = format!("in namespace {ns}; the session waits until it is created");
    let definition = crate::agent::definition(&name, &session.spec, &lookup, &place)
        .await
        .map_err(|e| {
            let (reason, recheck) = match &e {
                Unresolved::Ambiguous { .. } => ("InvalidSpec", INVALID_RECHECK),
                Unresolved::Missing { .. } => ("AgentNotFound", NOT_READY_RECHECK * 4),
                Unresolved::Unreadable { .. } => ("AgentUnreadable", NOT_READY_RECHECK),
            };
            NotReady {
                reason,
                message: e.to_string(),
                recheck,
            }
        })?;
    let created = session
        .metadata
        .creation_timestamp
        .as_ref()
        .map(crate::api::convert::millis)
        .unwrap_or_default();
    let resolved = prepare(ctx, ns, definition, created).await?;
    Ok(Resolved {
        budgets,
        ..resolved
    })
}

/// The agent `spec` made runnable for a session: config, model client (its
/// key read from the Secret it names), tools. The Agent controller runs the
/// same checks to report an Agent's own `Ready`.
pub(super) async fn prepare(
    ctx: &Context,
    ns: &str,
    definition: Definition,
    created: crate::core::Millis,
) -> Result<Resolved, NotReady> {
    let (spec, agent_name) = (&definition.agent, definition.agent_name.clone());
    // The model's key is read below from the session namespace's Secret;
    // never from this process's environment.
    let mut agent = definition
        .build(created, &NoSecrets)
        .map_err(|message| NotReady {
            reason: "InvalidAgent",
            message,
            recheck: INVALID_RECHECK,
        })?;
    agent.config.default_tool_timeout_secs = ctx.options.default_tool_timeout_secs;
    let cap = ctx.options.max_sub_agent_depth;
    agent.config.lineage.max_depth = agent.config.lineage.max_depth.min(cap);
    agent.config.limits.max_calls_per_reply = Some(ctx.options.max_calls_per_reply);
    let model_timeout = match (spec.model.timeout_seconds, ctx.options.model_timeout_secs) {
        (None, Some(default)) => default,
        _ => spec.model.timeout_seconds().into(),
    };
    agent.config.model_timeout_secs = model_timeout;
    let model = match spec.model.provider {
        ModelProvider::Scripted => agent.model.clone(),
        ModelProvider::Openai | ModelProvider::Anthropic => {
            remote_model(ctx, ns, spec, model_timeout).await?
        }
    };
    let (agent, mcp) = ready_tools(ctx, ns, agent).await?;
    let runtime = AgentRuntime {
        config: agent.config.clone(),
        system_prompt: agent.system_prompt.clone(),
        tools: agent.toolbox.schemas(),
    };
    Ok(Resolved {
        runtime,
        model,
        tools: Arc::new(agent.toolbox),
        agent_name: agent_name.unwrap_or_else(|| "(inline)".into()),
        model_name: model_name(&spec.model),
        notify: notify::target(spec, ctx.options.notify_webhook_url.as_deref()),
        mcp,
        budgets: Vec::new(),
    })
}

/// The model a spec names, as the spend metrics label it.
fn model_name(model: &crate::api::agent::ModelSpec) -> String {
    let named = match model.provider {
        ModelProvider::Openai => model.openai.as_ref().map(|m| m.model.clone()),
        ModelProvider::Anthropic => model.anthropic.as_ref().map(|m| m.model.clone()),
        ModelProvider::Scripted => None,
    };
    named.unwrap_or_else(|| "scripted".into())
}

/// The remote model client of `spec`, held to the operator's list of
/// model URLs; its key read from the session namespace's Secret, and only
/// once the URL is known to be allowed.
async fn remote_model(
    ctx: &Context,
    ns: &str,
    spec: &crate::api::AgentSpec,
    timeout_secs: u64,
) -> Result<ModelClient, NotReady> {
    let timeout = Duration::from_secs(timeout_secs);
    let client = crate::agent::model_client(&spec.model, &NoSecrets, timeout)
        .map_err(|message| NotReady {
            reason: "InvalidAgent",
            message,
            recheck: INVALID_RECHECK,
        })?
        .with_allowed_urls(ctx.options.model_allowed_urls.clone());
    if let Some(why) = client.url_not_allowed() {
        return Err(NotReady {
            reason: MODEL_URL_NOT_ALLOWED,
            message: format!("{}: {why}", spec.model.base_url_field()),
            recheck: INVALID_RECHECK,
        });
    }
    let key = match spec.model.api_key_secret_ref() {
        None => None,
        Some((r, what)) => Some(read_secret(ctx, ns, &r.name, &r.key, what).await?),
    };
    Ok(client.with_api_key(key))
}

/// The agent's tools made ready to run here: their Secrets read (and
/// those of tool Jobs checked usable), the operator's allow-list, the
/// shared MCP connections, and the MCP servers' tools listed and joined.
async fn ready_tools(
    ctx: &Context,
    ns: &str,
    mut agent: crate::agent::RunnableAgent,
) -> Result<
    (
        crate::agent::RunnableAgent,
        Vec<crate::tools::mcp::ServerListing>,
    ),
    NotReady,
> {
    // Header secrets of http tools and MCP servers come from Secrets in
    // the session's namespace, never from the operator's own environment.
    let mut secrets = std::collections::BTreeMap::new();
    for r in agent.toolbox.secret_refs() {
        let value = read_secret(ctx, ns, &r.name, &r.key, "a tool's header").await?;
        secrets.insert(r.env_name(), value);
    }
    // Secrets of tool Jobs are read by the kubelet, not by us: they must
    // be usable all the same, before any Job names them.
    for r in agent.tool_secrets() {
        usable_secret(ctx, ns, &r.name, "a tool's env").await?;
    }
    agent.toolbox = agent
        .toolbox
        .with_secrets(secrets)
        .with_allowed_urls(ctx.options.http_tool_allowed_urls.clone())
        .with_mcp_pool(ctx.mcp.clone());
    // MCP servers are listed here (a listing is reused for a minute); their
    // tools join the toolbox, the config and what the model is offered.
    agent.with_mcp_tools(false).await.map_err(|e| NotReady {
        reason: e.reason(),
        message: e.to_string(),
        recheck: if e.reason() == "McpServerUnavailable" {
            NOT_READY_RECHECK
        } else {
            INVALID_RECHECK
        },
    })
}

/// The reason of an Agent's `Ready=False` when one of its http tools calls
/// a URL the operator's allow-list does not hold. Sessions of the agent
/// still run; each call of that tool fails with an error result.
pub const HTTP_TOOL_URL_NOT_ALLOWED: &str = "HttpToolUrlNotAllowed";

/// The reason of an Agent's (and its sessions') `Ready=False` when its
/// model's URL is off the operator's list: no request goes to it, and its
/// sessions wait until the Agent or the list changes.
pub const MODEL_URL_NOT_ALLOWED: &str = "ModelUrlNotAllowed";

/// The label that makes a Secret usable by the agents of its namespace
/// (unless the operator runs with `--secrets-need-label=false`).
pub const USABLE_BY_AGENTS: &str = "agents-exe.io/usable-by-agents";

/// Secret `name`, if agents may use it. With the label check on, a missing
/// Secret and an unlabelled one read the same (`SecretNotUsable`): whoever
/// writes an Agent learns nothing of Secrets they were not given.
async fn usable_secret(
    ctx: &Context,
    ns: &str,
    name: &str,
    named_by: &str,
) -> Result<Secret, NotReady> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let labelled = |s: &Secret| {
        s.labels()
            .get(USABLE_BY_AGENTS)
            .is_some_and(|v| v == "true")
    };
    let need_label = ctx.options.secrets_need_label;
    match secrets.get_opt(name).await {
        Ok(Some(s)) if !need_label || labelled(&s) => Ok(s),
        Ok(_) if need_label => Err(NotReady {
            reason: "SecretNotUsable",
            message: format!(
                "Secret {name:?} ({named_by}) is not usable by agents in namespace {ns}: a Secret is usable when it exists and carries the label {USABLE_BY_AGENTS}=true (kubectl -n {ns} label secret {name} {USABLE_BY_AGENTS}=true)"
            ),
            recheck: NOT_READY_RECHECK,
        }),
        Ok(_) => Err(NotReady {
            reason: "SecretNotFound",
            message: format!(
                "Secret {name:?} ({named_by}) does not exist in namespace {ns}; create it, e.g. kubectl -n {ns} create secret generic {name} --from-literal=KEY=..."
            ),
            recheck: NOT_READY_RECHECK,
        }),
        Err(e) => Err(NotReady {
            reason: "SecretUnreadable",
            message: format!("Secret {name:?} in namespace {ns} cannot be read: {}", kube_reason(&e)),
            recheck: NOT_READY_RECHECK,
        }),
    }
}

/// The value of key `key` of Secret `name`, if agents may use it. Never
/// logged.
pub(super) async fn read_secret(
    ctx: &Context,
    ns: &str,
    name: &str,
    key: &str,
    named_by: &str,
) -> Result<String, NotReady> {
    let secret = usable_secret(ctx, ns, name, named_by).await?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_string())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|s| s.trim().to_string())
        });
    match value {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(NotReady {
            reason: "SecretKeyNotFound",
            message: format!(
                "Secret {name:?} in namespace {ns} has no (non-empty) key {key:?}, which {named_by} names"
            ),
            recheck: NOT_READY_RECHECK,
        }),
    }
}

fn kube_reason(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}", s.code, s.message),
        other => other.to_string(),
    }
}
