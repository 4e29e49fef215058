//! `agents session fork SRC --at-turn N [--name NEW] [--message TEXT]`:
//! a new session that starts with SRC's conversation up to and including
//! agent turn N and that turn's recorded results (`core::fork`). Every
//! check runs before anything is written; the source is only read.

use super::any_store::{load_agent, with_mcp_tools};
use super::commands::{exit_for, open, options, store_flag, Output, StoreSel};
use super::driver::{drive, now};
use super::out;
use crate::core::fork::fork_state;
use crate::core::ids::validate_name;
use crate::core::SessionId;
use crate::ports::{AdminPort, SessionInput, SessionRecord, StoreError};
use anyhow::{anyhow, bail};
use std::process::ExitCode;

/// What to fork, from the command line.
pub struct ForkArgs<'a> {
    pub source: &'a str,
    pub turn: u32,
    pub name: Option<&'a str>,
    pub message: Option<&'a str>,
}

/// The fork's name when none is given: `<source>-fork-t<turn>`.
pub fn default_name(source: &str, turn: u32) -> String {
    format!("{source}-fork-t{turn}")
}

pub async fn fork(args: ForkArgs<'_>, sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let (source, record) = plan(store.as_ref(), &args).await?;
    let id = record.state.id.clone();
    match store.create_fork(&source, record).await {
        Err(StoreError::SessionExists(_)) => return Err(taken(store.as_ref(), &id)),
        other => other?,
    }
    let what = format!(
        "session {id} forked from {} at turn {}",
        args.source, args.turn
    );
    if store.operator_driven() {
        let flag = store_flag(sel);
        out::line(&format!(
            "{what} (spec.forkFrom); the operator writes its history and drives it: `agents session show {id} {flag}`"
        ));
        return Ok(ExitCode::SUCCESS);
    }
    out::line(&format!("{what}; driving it on"));
    let (_, _, agent) = load_agent(store.as_ref(), &id).await?;
    let agent = with_mcp_tools(agent).await?;
    let outcome = drive(store.as_ref(), &agent, &id, &options(sel), &|p| out.emit(p)).await?;
    Ok(exit_for(&outcome))
}

/// The source as stored now and the fork's record made from it; an error
/// naming what is wrong (no such source or turn, the name taken) before
/// anything is written.
async fn plan(
    store: &dyn AdminPort,
    args: &ForkArgs<'_>,
) -> anyhow::Result<(SessionRecord, SessionRecord)> {
    let name = args
        .name
        .map_or_else(|| default_name(args.source, args.turn), str::to_string);
    validate_name("fork", &name).map_err(|e| anyhow!("{e}; give another with --name"))?;
    if let Some(m) = args.message.filter(|m| m.trim().is_empty()) {
        bail!("--message {m:?} is empty; give the fork's next message some text, or leave --message out");
    }
    let source_id = SessionId(args.source.to_string());
    let source = store
        .load(&source_id)
        .await?
        .ok_or_else(|| gone(store, &source_id))?;
    let id = SessionId(name);
    if store.load(&id).await?.is_some() {
        return Err(taken(store, &id));
    }
    let state = fork_state(&source.value.state, &source.value.uid, args.turn, id)
        .map_err(|e| anyhow!("{e}"))?;
    let t = now();
    let record = SessionRecord {
        state,
        input: SessionInput {
            messages: args.message.map(str::to_string).into_iter().collect(),
            paused: false,
            retry: 0,
        },
        namespace: source.value.namespace.clone(),
        uid: uuid::Uuid::new_v4().to_string(),
        definition: source.value.definition.clone(),
        created_at: t,
        updated_at: t,
        trace: None,
    };
    Ok((source.value, record))
}

fn gone(store: &dyn AdminPort, id: &SessionId) -> anyhow::Error {
    anyhow!(
        "session {id} not found {}, so there is nothing to fork; `agents session list` lists the sessions there",
        store.place()
    )
}

fn taken(store: &dyn AdminPort, id: &SessionId) -> anyhow::Error {
    anyhow!(
        "session {id} already exists {}; give the fork another name with --name NEW",
        store.place()
    )
}
