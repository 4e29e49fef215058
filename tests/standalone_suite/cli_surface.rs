//! The binary's surface: `agents crds` prints the checked-in CRDs, and the
//! same binary works as the kubectl plugin `kubectl-agents`.

use crate::support;

use std::process::Command;
use support::scratch::Scratch;

const BIN: &str = env!("CARGO_BIN_EXE_agents");

#[test]
fn crds_command_prints_the_checked_in_crds() {
    let out = Command::new(BIN).arg("crds").output().unwrap();
    assert!(out.status.success());
    let checked_in = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/agents-exe.io.yaml"
    ))
    .unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), checked_in);
}

#[test]
fn works_as_the_kubectl_plugin() {
    let scratch = Scratch::new("plugin");
    let plugin = scratch.path("kubectl-agents");
    std::os::unix::fs::symlink(BIN, &plugin).unwrap();
    let out = Command::new(&plugin)
        .args(["session", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("Usage: kubectl agents session"), "{help}");
    for sub in [
        "list",
        "show",
        "pending",
        "pause",
        "resume",
        "complete",
        "approve",
        "deny",
        "run-isolated",
    ] {
        assert!(help.contains(sub), "missing `{sub}` in:\n{help}");
    }
}
