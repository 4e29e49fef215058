//! `agents run`.

use super::RunArgs;
use std::process::ExitCode;

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!(
        "`agents run -f {}` is not wired to the embedded store in this build",
        args.file.display()
    )
}
