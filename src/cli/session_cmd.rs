//! `agents session ...`.

use super::run_cmd::block_on;
use super::{OutputFormat, SessionCommand};
use crate::core::ids::validate_name;
use crate::core::ContinuationToken;
use crate::standalone::commands::{self, Output, StoreSel};
use anyhow::Context;
use std::process::ExitCode;

fn sel(store: &super::StoreArgs) -> StoreSel {
    StoreSel::new(&store.store, store.namespace.as_deref())
}

fn output(f: OutputFormat) -> Output {
    Output {
        json: f == OutputFormat::Json,
    }
}

/// Refuses a session name or token that no session could have, before
/// the store is opened: such text must not reach a hint or a query.
fn check_name(kind: &str, name: &str) -> anyhow::Result<()> {
    validate_name(kind, name).map_err(anyhow::Error::msg)
}

/// `agents` is how the engine signs what it records itself (timeouts,
/// retried results); a person or worker must not pass as it.
fn check_by(by: &str) -> anyhow::Result<()> {
    if crate::core::acceptance::is_engine(by) {
        anyhow::bail!("--by {by:?} is reserved for what the engine records itself; give your own name, e.g. --by alice");
    }
    Ok(())
}

pub fn run(cmd: SessionCommand) -> anyhow::Result<ExitCode> {
    check_names(&cmd)?;
    block_on(dispatch(cmd))
}

/// Names are checked before any store is opened, so a typo costs nothing.
fn check_names(cmd: &SessionCommand) -> anyhow::Result<()> {
    match cmd {
        SessionCommand::List { .. } => {}
        SessionCommand::Fork { source, name, .. } => {
            check_name("session", source)?;
            if let Some(name) = name {
                check_name("fork", name)?;
            }
        }
        SessionCommand::Show { session, .. }
        | SessionCommand::Pending { session, .. }
        | SessionCommand::Tree { session, .. }
        | SessionCommand::Pause { session, .. }
        | SessionCommand::Resume { session, .. }
        | SessionCommand::Retry { session, .. }
        | SessionCommand::RunIsolated { session, .. }
        | SessionCommand::Export { session, .. } => check_name("session", session)?,
        SessionCommand::Replay { .. } => {}
        SessionCommand::Import { name, .. } => {
            if let Some(name) = name {
                check_name("session", name)?;
            }
        }
        SessionCommand::Complete { token, by, .. }
        | SessionCommand::Answer { token, by, .. }
        | SessionCommand::Approve { token, by, .. }
        | SessionCommand::RunAgain { token, by, .. }
        | SessionCommand::Deny { token, by, .. } => {
            check_name("token", token)?;
            if let Some(by) = by {
                check_by(by)?;
            }
        }
    }
    Ok(())
}

async fn dispatch(cmd: SessionCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        SessionCommand::List { store, output: o } => commands::list(&sel(&store), output(o)).await,
        SessionCommand::Show {
            session,
            store,
            output: o,
        } => commands::show(&session, &sel(&store), output(o)).await,
        SessionCommand::Pending {
            session,
            store,
            output: o,
        } => super::pending_tree::run(&session, &sel(&store), output(o)).await,
        SessionCommand::Tree {
            session,
            store,
            output: o,
        } => super::tree_cmd::run(&session, &store.store, store.namespace.as_deref(), o).await,
        SessionCommand::Pause { session, store } => commands::pause(&session, &sel(&store)).await,
        SessionCommand::Fork {
            source,
            at_turn,
            name,
            message,
            store,
            output: o,
        } => {
            let args = crate::standalone::fork::ForkArgs {
                source: &source,
                turn: at_turn,
                name: name.as_deref(),
                message: message.as_deref(),
            };
            crate::standalone::fork::fork(args, &sel(&store), output(o)).await
        }
        SessionCommand::Resume {
            session,
            store,
            output: o,
        } => commands::resume(&session, &sel(&store), output(o)).await,
        SessionCommand::Retry {
            session,
            store,
            output: o,
        } => commands::retry(&session, &sel(&store), output(o)).await,
        SessionCommand::Complete {
            token,
            result_file_arg,
            result_file,
            text,
            error,
            by,
            store,
        } => {
            let raw = result_text(one_result_file(result_file_arg, result_file)?, text)?;
            let result = commands::parse_result(&raw, &ContinuationToken(token.clone()), error)?;
            commands::complete(&token, result, by.as_deref(), &sel(&store)).await
        }
        SessionCommand::Answer {
            token,
            answers,
            by,
            store,
        } => commands::answer(&token, &answers, by.as_deref(), &sel(&store)).await,
        SessionCommand::Approve {
            token,
            args_file,
            raise,
            by,
            store,
        } => {
            let arguments = args_file.map(|path| read_file(&path)).transpose()?;
            let raise = parse_raise(&raise)?;
            let how = (arguments, raise);
            commands::decide(&token, true, None, by.as_deref(), how, &sel(&store)).await
        }
        SessionCommand::RunAgain { token, by, store } => {
            commands::run_again(&token, by.as_deref(), &sel(&store)).await
        }
        SessionCommand::Deny {
            token,
            reason,
            by,
            store,
        } => {
            let how = (None, None);
            commands::decide(&token, false, reason, by.as_deref(), how, &sel(&store)).await
        }
        SessionCommand::RunIsolated {
            session,
            timeout_seconds,
            container_engine,
            store,
        } => {
            commands::run_isolated(
                &session,
                timeout_seconds,
                container_engine,
                &sel(&store),
                Output::default(),
            )
            .await
        }
        SessionCommand::Export { session, store } => {
            crate::standalone::export::export(&session, &sel(&store)).await
        }
        SessionCommand::Import { file, name, store } => {
            crate::standalone::import::import(&file, name.as_deref(), &sel(&store)).await
        }
        SessionCommand::Replay {
            source,
            agent,
            model,
            strict,
            run_unmatched,
            store,
            output: o,
        } => {
            let opts = crate::standalone::replay::ReplayOptions {
                agent,
                model,
                strict,
                run_unmatched,
                json: o == OutputFormat::Json,
            };
            crate::standalone::replay::replay(&source, &sel(&store), &opts).await
        }
    }
}

/// The result file, given after the token (as the plan writes it) or
/// with `--result-file`, but not both: two files would leave it unclear
/// which result is meant.
fn one_result_file(
    positional: Option<std::path::PathBuf>,
    flag: Option<std::path::PathBuf>,
) -> anyhow::Result<Option<std::path::PathBuf>> {
    match (positional, flag) {
        (Some(a), Some(b)) => anyhow::bail!(
            "the result file is given twice, as {} after the token and as --result-file {}; \
             give it once, either way",
            a.display(),
            b.display()
        ),
        (a, b) => Ok(a.or(b)),
    }
}

fn result_text(
    result_file: Option<std::path::PathBuf>,
    text: Option<String>,
) -> anyhow::Result<String> {
    match (result_file, text) {
        (Some(path), _) => read_file(&path),
        (None, Some(t)) => Ok(t),
        (None, None) => anyhow::bail!("give the result with --text or --result-file"),
    }
}

/// `--raise tokens=N --raise cost=D` as one raise; `None` without any.
fn parse_raise(given: &[String]) -> anyhow::Result<Option<crate::core::budget::Raise>> {
    let mut raise = crate::core::budget::Raise::default();
    for text in given {
        raise.parse_into(text).map_err(|e| anyhow::anyhow!(e))?;
    }
    Ok((!given.is_empty()).then_some(raise))
}

/// The largest arguments or result file read: twice the largest result a
/// call may have (its JSON may be escaped).
const MAX_FILE_BYTES: usize = 2 * crate::core::session::MAX_RESULT_BYTES;

fn read_file(path: &std::path::Path) -> anyhow::Result<String> {
    crate::host::read_named_file(path, MAX_FILE_BYTES)
        .with_context(|| format!("reading {}", path.display()))
}
