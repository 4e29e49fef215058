//! Retention: a finished session is deleted, with everything it owns,
//! `ttlSecondsAfterFinished` (or the operator's default) after it finished.

use super::{Context, Error, Options};
use crate::api::Session;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::ResourceExt;
use std::time::Duration;
use tracing::info;

/// The seconds a finished session is kept: its own, else the operator's.
pub(super) fn ttl(session: &Session, options: &Options) -> Option<u64> {
    session
        .spec
        .ttl_seconds_after_finished
        .or(options.finished_session_ttl_seconds)
}

/// How long until a finished session is due for deletion under `ttl`
/// seconds (zero: now); `None` while it is not finished, is kept, or was
/// asked to retry.
pub(super) fn retention_wait(
    session: &Session,
    ttl: Option<u64>,
    now: crate::core::Millis,
) -> Option<Duration> {
    let ttl = ttl?;
    let status = session.status.as_ref()?;
    if session.spec.retry.unwrap_or(0) > status.retries_taken {
        return None;
    }
    let finished = status
        .conditions
        .iter()
        .filter(|c| (c.type_ == "Succeeded" || c.type_ == "Failed") && c.status == "True")
        .map(|c| crate::api::convert::millis(&c.last_transition_time))
        .max()?;
    let due = finished.plus_secs(ttl);
    Some(Duration::from_millis((due.0 - now.0).max(0) as u64))
}

/// Deletes a finished session whose time has come (this very one: its
/// UID is the precondition), or looks again when it comes.
pub(super) async fn retain_or_delete(
    ctx: &Context,
    session: &Session,
    ns: &str,
    wait: Duration,
) -> Result<Action, Error> {
    if !wait.is_zero() {
        return Ok(Action::requeue(wait));
    }
    let api: Api<Session> = Api::namespaced(ctx.client.clone(), ns);
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: session.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(&session.name_any(), &params).await {
        Ok(_) => {
            info!(session = %format!("{ns}/{}", session.name_any()), "finished session deleted (ttlSecondsAfterFinished)");
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(e) => return Err(Error::Kube(e)),
    }
    Ok(Action::await_change())
}
