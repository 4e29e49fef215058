//! `agents operator`.

use super::OperatorArgs;
use std::process::ExitCode;

pub fn run(args: OperatorArgs) -> anyhow::Result<ExitCode> {
    // Logs are set up in `cli::main` (RUST_LOG, default info; AGENTS_LOG_FORMAT=json).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(crate::operator::run(crate::operator::Options {
        namespace: args.namespace,
    }))?;
    Ok(ExitCode::SUCCESS)
}
