//! `agents run`.

use super::{OutputFormat, RunArgs};
use crate::standalone::commands::{self, Output};
use std::process::ExitCode;

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let out = Output {
        json: args.output == OutputFormat::Json,
    };
    block_on(commands::run_file(&args.file, &args.store.store, out))
}

/// The CLI is one short-lived task: a current-thread runtime is enough.
pub(super) fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime starts")
        .block_on(f)
}
