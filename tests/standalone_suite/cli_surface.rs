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

/// `agents ARGS`: (success, stdout).
fn agents(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    (out.status.success(), stdout)
}

#[test]
fn version_names_the_commit_and_the_build_date() {
    let (ok, version) = agents(&["version"]);
    assert!(ok, "{version}");
    let (ok, flag) = agents(&["--version"]);
    assert!(ok, "{flag}");
    assert_eq!(version, flag, "`agents version` and `--version` differ");
    let prefix = format!("agents {} (commit ", env!("CARGO_PKG_VERSION"));
    let rest = version
        .strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("{version:?} does not start with {prefix:?}"));
    let (commit, rest) = rest.split_once(", built ").expect("', built '");
    let date = rest.strip_suffix(")\n").expect("ends with ')'");
    assert_rfc3339_utc(date);
    // Built from this checkout: the commit is git's (build.rs reruns when HEAD moves).
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success());
    match head {
        Some(head) => assert_eq!(commit, String::from_utf8_lossy(&head.stdout).trim()),
        None => assert_eq!(commit, "unknown"),
    }
}

fn assert_rfc3339_utc(date: &str) {
    let b = date.as_bytes();
    let shape = date.len() == 20
        && date.chars().enumerate().all(|(i, c)| match i {
            4 | 7 => c == '-',
            10 => c == 'T',
            13 | 16 => c == ':',
            19 => c == 'Z',
            _ => c.is_ascii_digit(),
        });
    assert!(
        shape && b[0] == b'2',
        "build date {date:?} is not YYYY-MM-DDThh:mm:ssZ"
    );
}

/// build.rs on its own, compiled with rustc, run in a folder without git
/// history (a source tarball, the Dockerfile's build context without .git).
fn stamp_outside_git(env: &[(&str, &str)]) -> String {
    let scratch = Scratch::new("stamp");
    let exe = scratch.path("stamp");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/build.rs");
    let built = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args(["--edition", "2021", "-o"])
        .arg(&exe)
        .arg(script)
        .env("CARGO_MANIFEST_DIR", scratch.path("."))
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let mut run = Command::new(&exe);
    run.env_remove("AGENTS_GIT_COMMIT")
        .env_remove("SOURCE_DATE_EPOCH")
        .env("GIT_CEILING_DIRECTORIES", scratch.path(".."));
    for (k, v) in env {
        run.env(k, v);
    }
    let out = run.output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_version_stamp_works_without_git() {
    let out = stamp_outside_git(&[("SOURCE_DATE_EPOCH", "1700000000")]);
    assert!(
        out.contains("cargo:rustc-env=AGENTS_GIT_COMMIT=unknown\n"),
        "{out}"
    );
    assert!(
        out.contains("cargo:rustc-env=AGENTS_BUILD_DATE=2023-11-14T22:13:20Z\n"),
        "{out}"
    );
    assert!(
        !out.contains(".git"),
        "watches a git path that is not there:\n{out}"
    );
    let given = stamp_outside_git(&[("AGENTS_GIT_COMMIT", "abc123")]);
    assert!(
        given.contains("cargo:rustc-env=AGENTS_GIT_COMMIT=abc123\n"),
        "{given}"
    );
}

#[test]
fn completion_scripts_name_the_commands_and_flags() {
    for shell in ["bash", "zsh", "fish"] {
        let (ok, script) = agents(&["completion", shell]);
        assert!(ok, "{shell}: {script}");
        for word in [
            "session",
            "operator",
            "completion",
            "approve",
            "leader-elect",
        ] {
            assert!(script.contains(word), "{shell} script lacks {word}");
        }
    }
    let (ok, _) = agents(&["completion", "powershell"]);
    assert!(!ok, "an unknown shell is refused");
}

/// The bash script, sourced in a real bash, completes `agents ses<TAB>`
/// and the subcommands of `agents session <TAB>`.
#[test]
fn bash_completion_completes_subcommands() {
    let (_, script) = agents(&["completion", "bash"]);
    let scratch = Scratch::new("completion");
    let file = scratch.path("agents.bash");
    std::fs::write(&file, script).unwrap();
    let complete = |line: &str| {
        let probe = format!(
            "source {file}; COMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); \
             COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; \
             _agents agents \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            file = file.display()
        );
        let out = Command::new("bash").args(["-c", &probe]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(complete("agents ses").trim(), "session");
    let subs = complete("agents session ''");
    for sub in ["list", "approve", "run-isolated"] {
        assert!(subs.lines().any(|l| l == sub), "no {sub} in {subs}");
    }
}

/// plugins/agents.yaml against krew's manifest rules (krew's
/// internal/index/validation: apiVersion, kind, a safe name equal to the
/// file's, a one-line short description, a semver version, and per
/// platform a uri, a sha256, a bin, files and an os/arch selector), and
/// its version is this package's.
#[test]
fn the_krew_manifest_follows_krews_rules() {
    use serde_norway::Value;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/plugins/agents.yaml");
    let m: Value = serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    assert_eq!(
        s(&m["apiVersion"]),
        "krew.googlecontainertools.github.com/v1alpha2"
    );
    assert_eq!(s(&m["kind"]), "Plugin");
    assert_eq!(
        s(&m["metadata"]["name"]),
        "agents",
        "the name must be the file's"
    );
    let spec = &m["spec"];
    let short = s(&spec["shortDescription"]);
    assert!(
        !short.is_empty() && !short.contains(['\r', '\n']),
        "{short:?}"
    );
    assert_eq!(
        s(&spec["version"]),
        format!("v{}", env!("CARGO_PKG_VERSION"))
    );
    let platforms = spec["platforms"].as_sequence().expect("platforms");
    assert!(!platforms.is_empty());
    for p in platforms {
        assert!(s(&p["uri"]).starts_with("https://"), "{p:?}");
        let sha = s(&p["sha256"]);
        assert!(
            sha.len() == 64 && sha.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')),
            "{sha}"
        );
        assert_eq!(s(&p["bin"]), "agents");
        for f in p["files"].as_sequence().expect("files") {
            assert!(
                !s(&f["from"]).is_empty() && !s(&f["to"]).is_empty(),
                "{f:?}"
            );
        }
        let labels = p["selector"]["matchLabels"]
            .as_mapping()
            .expect("matchLabels");
        assert!(!labels.is_empty());
        for (k, _) in labels {
            assert!(
                matches!(k.as_str(), Some("os" | "arch")),
                "selector key {k:?}"
            );
        }
    }
}
