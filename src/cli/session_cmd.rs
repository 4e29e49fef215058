//! `agents session ...`.

use super::SessionCommand;
use std::process::ExitCode;

pub fn run(cmd: SessionCommand) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`agents session {cmd:?}` is not wired to a store in this build")
}
