//! MCP tasks outlive the Session that waits on them unless someone says
//! otherwise: while a session waits on a task it carries a finalizer, and
//! its deletion sends `tasks/cancel` for every open task before the
//! finalizer goes. The cancel is tried once per task (bounded by the MCP
//! client's request timeout): a server that cannot be reached never holds
//! a deletion up for more than that.

use super::{resolve, Context, Error};
use crate::api::Session;
use crate::core::{SessionState, WaitingFor};
use crate::ports::SessionPort;
use crate::store::kube::KubeStore;
use kube::api::{Api, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use tracing::{info, warn};

/// The finalizer of a session that waits on MCP tasks.
pub const FINALIZER: &str = "agents-exe.io/cancel-mcp-tasks";
/// The field manager that owns it.
const FIELD_MANAGER: &str = "agents-operator-mcp-tasks";

fn waits_on_tasks(state: &SessionState) -> bool {
    state
        .pending()
        .iter()
        .any(|c| c.waiting_for() == Some(WaitingFor::McpTask))
}

/// After a step: the finalizer while the session waits on a task, none
/// once it no longer does (one metadata patch each way).
pub async fn keep_finalizer(
    ctx: &Context,
    session: &Session,
    ns: &str,
    state: &SessionState,
) -> Result<(), kube::Error> {
    let wants = waits_on_tasks(state);
    let has = session.finalizers().iter().any(|f| f == FINALIZER);
    if wants == has {
        return Ok(());
    }
    own_finalizer(ctx, ns, &session.name_any(), wants).await
}

/// A Session being deleted: its open MCP tasks are cancelled, then its
/// finalizer goes.
pub async fn cancel_then_release(ctx: &Context, session: &Session, ns: &str) -> Result<(), Error> {
    let name = session.name_any();
    if !session.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(());
    }
    let store = KubeStore::new(ctx.client.clone(), ns);
    let id = crate::core::SessionId(name.clone());
    if let Some(loaded) = store.load(&id).await? {
        cancel_open_tasks(ctx, session, ns, &loaded.value.state).await;
    }
    match own_finalizer(ctx, ns, &name, false).await {
        Ok(()) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(Error::Kube(e)),
    }
}

async fn cancel_open_tasks(ctx: &Context, session: &Session, ns: &str, state: &SessionState) {
    let key = format!("{ns}/{}", session.name_any());
    let open: Vec<_> = state
        .pending()
        .into_iter()
        .filter(|c| c.waiting_for() == Some(WaitingFor::McpTask))
        .filter_map(|c| Some((c.effective_call(), c.task()?.clone())))
        .collect();
    if open.is_empty() {
        return;
    }
    let resolved = match resolve(ctx, session, ns).await {
        Ok(r) => r,
        Err(not_ready) => {
            warn!(session = %key, tasks = open.len(), reason = not_ready.reason, "session deleted; its MCP tasks cannot be cancelled: {}", not_ready.message);
            return;
        }
    };
    for (call, task) in open {
        info!(session = %key, task = %task.id, tool = %call.name, "session deleted; cancelling its MCP task");
        resolved.tools.cancel_task(&call, &task).await;
    }
}

/// Holds (or lets go of) our finalizer by server-side apply under a field
/// manager of its own: `metadata.finalizers` is a set, so other
/// controllers' finalizers are never touched, whatever our cache says.
async fn own_finalizer(ctx: &Context, ns: &str, name: &str, hold: bool) -> Result<(), kube::Error> {
    let api: Api<Session> = Api::namespaced(ctx.client.clone(), ns);
    let finalizers: Vec<&str> = if hold { vec![FINALIZER] } else { Vec::new() };
    let body = json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Session",
        "metadata": {"name": name, "finalizers": finalizers},
    });
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&body),
    )
    .await
    .map(|_| ())
}
