//! `agents operator`.

use super::OperatorArgs;
use std::process::ExitCode;

pub fn run(args: OperatorArgs) -> anyhow::Result<ExitCode> {
    // Logs are set up in `cli::main` (RUST_LOG, default info; AGENTS_LOG_FORMAT=json).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut job_defaults = crate::runner::job::JobDefaults {
        service_account: args.tool_service_account,
        allowed_images: (!args.allowed_tool_images.is_empty()).then_some(args.allowed_tool_images),
        ..Default::default()
    };
    job_defaults
        .limits
        .insert("cpu".into(), args.tool_cpu_limit);
    job_defaults
        .limits
        .insert("memory".into(), args.tool_memory_limit);
    runtime.block_on(crate::operator::run(crate::operator::Options {
        namespace: args.namespace,
        agents_image: args.agents_image,
        job_defaults,
        leader_elect: args.leader_elect,
        metrics_addr: args.metrics_addr,
    }))?;
    Ok(ExitCode::SUCCESS)
}
