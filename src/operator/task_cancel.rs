//! MCP tasks outlive the Session that waits on them unless someone says
//! otherwise: a session carries a finalizer while it waits on a task, and
//! its deletion sends `tasks/cancel` for every open task before the
//! finalizer goes. A session whose agent has MCP servers holds it before
//! any step that may call one: a task created by a call in flight when the
//! session is deleted is then recorded and cancelled, not orphaned. The
//! cancels go at once, each tried once (bounded by the MCP client's
//! request timeout): a server that cannot be reached never holds a
//! deletion up for more than that.

use super::{resolve, Context, Error};
use crate::api::Session;
use crate::core::{SessionState, WaitingFor};
use crate::ports::SessionPort;
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

/// Whether the session holds our finalizer.
pub fn holds(session: &Session) -> bool {
    session.finalizers().iter().any(|f| f == FINALIZER)
}

/// Whether a step may go on after [`hold_before_step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Go on; `held`: whether the session holds the finalizer now.
    Step { held: bool },
    /// The session is being deleted (or gone, or recreated): no step, the
    /// deletion's own reconcile comes.
    Going,
}

/// Before a step of a session that is not final and whose agent has MCP
/// servers (`uses_mcp`): the finalizer, so that a call which makes a task
/// cannot outrun it.
pub async fn hold_before_step(
    ctx: &Context,
    session: &Session,
    ns: &str,
    uses_mcp: bool,
) -> Result<Hold, kube::Error> {
    let held = holds(session);
    if held || !uses_mcp || super::is_final(session) {
        return Ok(Hold::Step { held });
    }
    match own_finalizer(ctx, ns, session, true).await {
        Ok(()) => Ok(Hold::Step { held: true }),
        // 422: no finalizer may be added once a deletion began; 409: the
        // UID is not this session's; 404: gone.
        Err(kube::Error::Api(s)) if matches!(s.code, 404 | 409 | 422) => {
            info!(session = %format!("{ns}/{}", session.name_any()), "no step: the session is being deleted ({})", s.message);
            Ok(Hold::Going)
        }
        Err(e) => Err(e),
    }
}

/// After a step: the finalizer while the session waits on a task, or may
/// make one (not final, `uses_mcp`); none once neither holds (one metadata
/// patch each way). `held`: whether it holds it now.
pub async fn keep_finalizer(
    ctx: &Context,
    session: &Session,
    ns: &str,
    state: &SessionState,
    uses_mcp: bool,
    held: bool,
) -> Result<(), kube::Error> {
    let wants = waits_on_tasks(state) || (uses_mcp && !state.phase.is_final());
    if wants == held {
        return Ok(());
    }
    own_finalizer(ctx, ns, session, wants).await
}

/// A Session being deleted: its open MCP tasks are cancelled, then its
/// finalizer goes.
pub async fn cancel_then_release(ctx: &Context, session: &Session, ns: &str) -> Result<(), Error> {
    let name = session.name_any();
    if !holds(session) {
        return Ok(());
    }
    let store = ctx.store(ns);
    let id = crate::core::SessionId(name.clone());
    if let Some(loaded) = store.load(&id).await? {
        cancel_open_tasks(ctx, session, ns, &loaded.value.state).await;
    }
    match own_finalizer(ctx, ns, session, false).await {
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
    // All at once: a deletion waits for the slowest cancel, not their sum.
    let cancels = open.iter().map(|(call, task)| {
        info!(session = %key, task = %task.id, tool = %call.name, "session deleted; cancelling its MCP task");
        resolved.tools.cancel_task(call, task)
    });
    futures::future::join_all(cancels).await;
}

/// Holds (or lets go of) our finalizer by server-side apply under a field
/// manager of its own: `metadata.finalizers` is a set, so other
/// controllers' finalizers are never touched, whatever our cache says. The
/// UID makes it this very session: a recreated one of the same name is
/// refused (409), and a missing one is never created.
async fn own_finalizer(
    ctx: &Context,
    ns: &str,
    session: &Session,
    hold: bool,
) -> Result<(), kube::Error> {
    let name = session.name_any();
    let api: Api<Session> = Api::namespaced(ctx.client.clone(), ns);
    let finalizers: Vec<&str> = if hold { vec![FINALIZER] } else { Vec::new() };
    let mut metadata = json!({"name": name, "finalizers": finalizers});
    if let Some(uid) = session.uid() {
        metadata["uid"] = json!(uid);
    }
    let body = json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Session",
        "metadata": metadata,
    });
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&body),
    )
    .await
    .map(|_| ())
}
