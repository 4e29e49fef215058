//! `agents operator`.

use super::OperatorArgs;
use std::process::ExitCode;

pub fn run(args: OperatorArgs) -> anyhow::Result<ExitCode> {
    // Logs go to stderr; `RUST_LOG` filters them (default: info).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(crate::operator::run(crate::operator::Options {
        namespace: args.namespace,
    }))?;
    Ok(ExitCode::SUCCESS)
}
