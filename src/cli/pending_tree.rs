//! `agents session pending NAME --store kube`: the waits of NAME and of
//! every sub-agent session below it (found by the `agents-exe.io/root`
//! label), each with its path from NAME. The tokens are the ones
//! `complete`, `approve`, `deny` and `answer` take, whichever session of
//! the tree the call belongs to.

use super::tree_cmd::subtree;
use crate::api::Session;
use crate::core::{SessionId, WaitingFor};
use crate::operator::children::LABEL_ROOT;
use crate::ports::AdminPort;
use crate::standalone::commands::{self, Output, StoreSel};
use crate::standalone::out;
use crate::standalone::progress::PendingCall;
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use serde::Serialize;
use std::process::ExitCode;

/// One wait of the tree: the call, and the session it belongs to with its
/// path from the session asked about.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct TreeWait {
    session: String,
    path: Vec<String>,
    #[serde(flatten)]
    call: PendingCall,
}

/// `pending` on the cluster's store: the whole tree where NAME has
/// sub-agent sessions, else NAME's own waits as before.
pub async fn run(session: &str, sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    if sel.url != "kube" {
        return commands::pending(session, sel, out).await;
    }
    let sessions = tree_sessions(session, sel).await?;
    let Some(sessions) = sessions.filter(|all| all.len() > 1) else {
        return commands::pending(session, sel, out).await;
    };
    let store = commands::open(sel).await?;
    let root = sessions
        .iter()
        .find(|s| s.name_any() == session)
        .expect("the tree holds its root");
    let mut waits = Vec::new();
    for (path, s) in subtree(root, &sessions) {
        let name = s.name_any();
        for call in session_waits(store.as_ref(), &name, sel).await? {
            waits.push(TreeWait {
                session: name.clone(),
                path: path.clone(),
                call,
            });
        }
    }
    print(session, &waits, out)?;
    Ok(ExitCode::SUCCESS)
}

/// NAME and the sessions of its tree, or `None` when NAME is in no tree.
async fn tree_sessions(session: &str, sel: &StoreSel) -> anyhow::Result<Option<Vec<Session>>> {
    let config = kube::Config::infer()
        .await
        .map_err(|e| anyhow::anyhow!("--store kube: no usable kubeconfig ({e})"))?;
    let ns = sel
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let api: Api<Session> = Api::namespaced(kube::Client::try_from(config)?, &ns);
    // Not found, or not to be read this way (a role that may read one
    // session's calls but not list sessions): the session's own waits.
    let Some(named) = api.get_opt(session).await.or_else(forbidden)? else {
        return Ok(None);
    };
    let root = named
        .labels()
        .get(LABEL_ROOT)
        .cloned()
        .unwrap_or_else(|| session.to_string());
    let Some(listed) = api
        .list(&ListParams::default().labels(&format!("{LABEL_ROOT}={root}")))
        .await
        .map(Some)
        .or_else(forbidden)?
    else {
        return Ok(None);
    };
    let mut all = listed.items;
    if all.is_empty() {
        return Ok(None);
    }
    if !all.iter().any(|s| s.name_any() == session) {
        all.push(named);
    }
    Ok(Some(all))
}

/// A read the caller's role does not allow is no tree (`None`); any
/// other error is one.
fn forbidden<T>(e: kube::Error) -> Result<Option<T>, kube::Error> {
    match e {
        kube::Error::Api(ref r) if r.code == 403 => Ok(None),
        e => Err(e),
    }
}

/// The open calls of one session that wait on someone else, as `pending`
/// lists them for a session alone. A sub-agent wait is left out: the
/// child's own waits are listed under its path.
async fn session_waits(
    store: &dyn AdminPort,
    session: &str,
    sel: &StoreSel,
) -> anyhow::Result<Vec<PendingCall>> {
    let id = SessionId(session.to_string());
    let (_, waiting) = commands::session_waits(store, &id, sel).await?;
    Ok(waiting
        .into_iter()
        .filter(|p| p.waiting_for != Some(WaitingFor::SubAgent))
        .collect())
}

fn print(session: &str, waits: &[TreeWait], out: Output) -> anyhow::Result<()> {
    if out.json {
        out::line(&serde_json::to_string(waits)?);
        return Ok(());
    }
    if waits.is_empty() {
        out::line(&format!(
            "no call waits in the tree of session {session} (`agents session tree {session} --store kube` shows it)"
        ));
    }
    for w in waits {
        let wait = commands::wait_line(&w.call, "");
        out::line(&format!("{}\n  {wait}", w.path.join(" > ")));
    }
    Ok(())
}
