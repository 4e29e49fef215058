//! The container runner: runs a `runIsolated` call of a tool with an image
//! in a local container engine (podman or docker), the standalone twin of
//! the Job runner. Same contract as every runner: the call envelope on
//! stdin, the result envelope or plain text on stdout (read by
//! `harness::interpret`), the token in `AGENTS_TOKEN`.
//!
//! Hardened by default, like the Job's pod: no network, a read-only root
//! (a small tmpfs at `/tmp`), all capabilities dropped, no new privileges,
//! user 65532, memory/CPU/pids limits, explicit lower ulimits, removed
//! after the run (with podman its output is read back from its log, see
//! [`run_command`]), and
//! only the variables the definition names. Their values travel in the
//! engine client's environment (`--env NAME`), never on its command line,
//! where other users could read secrets in the process list.
//!
//! The container's name derives from the token and attempt. A leftover
//! container of that name (its worker was killed) is removed before the
//! attempt starts, never adopted: its stdin and output went with the dead
//! worker, so the attempt runs again, once. A timeout, a dropped future or
//! an error removes the container too, not only the engine client.
//!
//! A tool with an image never falls back to the host: without an engine the
//! call gets an error saying how to fix it.

use super::harness::{self, interpret, Options};
use super::{exchange, failed, with_tool_vars, ProcessOutcome};
use crate::core::envelope::CallEnvelope;
use crate::core::{IsolationSpec, ToolResult};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};
use tokio::process::Command;

/// Chooses the engine: `podman`, `docker`, `none`, or a path to either's
/// client. Unset: podman, then docker, found on `PATH`.
pub const ENGINE_ENV: &str = "AGENTS_CONTAINER_ENGINE";
/// Extra global engine arguments, before `run` (e.g. `--storage-driver vfs`).
pub const ENGINE_ARGS_ENV: &str = "AGENTS_CONTAINER_ENGINE_ARGS";
/// Extra `run` arguments, after the hardening flags (so they can relax them,
/// e.g. `--ulimit nofile=2048:4096`, or `--network slirp4netns` for a tool
/// that must reach the network).
pub const RUN_ARGS_ENV: &str = "AGENTS_CONTAINER_RUN_ARGS";
/// `never` (default), `missing` or `always`: whether the engine may pull.
pub const PULL_ENV: &str = "AGENTS_CONTAINER_PULL";

/// Limits when the tool's definition sets none (as the Job runner's).
pub const DEFAULT_MEMORY: &str = "256Mi";
pub const DEFAULT_CPU: &str = "500m";
/// The non-root user of every tool container (as the Job's pod).
pub const TOOL_USER: &str = "65532:65532";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Engine {
    /// The client to exec (a name found on `PATH`, or a path).
    pub program: PathBuf,
    pub podman: bool,
}

#[derive(Clone, Debug, Default)]
pub struct ContainerRunner {
    /// `podman`, `docker`, `none` or a path; `None`: [`ENGINE_ENV`], then
    /// the first of podman and docker on `PATH`.
    pub engine: Option<String>,
}

impl ContainerRunner {
    pub fn with_engine(engine: Option<String>) -> Self {
        ContainerRunner { engine }
    }

    /// The engine to use, or why there is none (the message says how to fix
    /// it).
    pub fn resolve(&self) -> Result<Engine, String> {
        let chosen = self
            .engine
            .clone()
            .or_else(|| std::env::var(ENGINE_ENV).ok())
            .filter(|s| !s.trim().is_empty());
        let path = std::env::var_os("PATH").unwrap_or_default();
        resolve_engine(chosen.as_deref(), &path)
    }

    pub async fn run(
        &self,
        envelope: &CallEnvelope,
        spec: &IsolationSpec,
        attempt: u32,
        timeout: Duration,
    ) -> ProcessOutcome {
        let started = Instant::now();
        let engine = match self.resolve() {
            Ok(e) => e,
            Err(why) => return failed(started, no_engine(envelope, spec, &why)),
        };
        let name = container_name(envelope.token.as_str(), attempt);
        let (argv, env) = match run_command(&name, engine.podman, envelope, spec, &|k| {
            std::env::var(k).ok()
        }) {
            Ok(x) => x,
            Err(e) => return failed(started, e),
        };
        // A container of this name is left over from a killed worker: it
        // runs no more once this attempt starts (see the module docs).
        remove(&engine, &name).await;
        let mut cmd = Command::new(&engine.program);
        cmd.args(&argv).envs(env);
        // The container is not in the client's process group: the guard
        // below removes it instead.
        let tool = match harness::spawn(&mut cmd, Options::ENGINE_CLIENT) {
            Ok(t) => t,
            Err(e) => {
                return failed(
                    started,
                    format!("cannot start {}: {e}", engine.program.display()),
                )
            }
        };
        let podman = engine.podman;
        // Removes the container however this function is left.
        let mut guard = Remover(Some((engine, name)));
        let mut ended = tool.exchange(exchange(envelope, timeout)).await;
        if ended.is_err() {
            // Timed out: the container goes before the outcome is told.
            guard.remove_now().await;
        }
        if let (true, Ok(run), Some((engine, name))) = (podman, &mut ended, &guard.0) {
            if let Err(why) = output_from_log(envelope, engine, name, run, timeout).await {
                guard.remove_now().await;
                return failed(started, why);
            }
        }
        let outcome = ProcessOutcome::of(
            started,
            ended,
            || {
                format!(
                    "timed out after {}s; the container was removed",
                    timeout.as_secs_f64()
                )
            },
            |status, stdout, stderr| engine_result(envelope, status, stdout, stderr),
        );
        // `--rm` removed it on a normal exit with docker; with podman (no
        // `--rm`, see [`run_command`]) and on failures the guard does.
        if podman || outcome.exit_code.is_none() || outcome.exit_code == Some(125) {
            guard.remove_now().await;
        }
        guard.disarm();
        outcome
    }
}

/// Replaces what the attached client printed with the container's own
/// log (`podman logs`), read with the same caps, when the log holds at
/// least what the client saw. Attached output that overflowed a cap is
/// kept: the log, bounded too, adds nothing then.
/// A run the engine itself failed (125) has no container output to read.
async fn output_from_log(
    envelope: &CallEnvelope,
    engine: &Engine,
    name: &str,
    run: &mut harness::Ended<super::Captured>,
    timeout: Duration,
) -> Result<(), String> {
    if run.stdout.overflow || run.stderr.overflow || run.exit_code() == Some(125) {
        return Ok(());
    }
    let mut cmd = Command::new(&engine.program);
    cmd.args(global_args()).args(["logs", name]);
    let client = harness::spawn(&mut cmd, Options::ENGINE_CLIENT)
        .map_err(|e| format!("cannot start {}: {e}", engine.program.display()))?;
    // `podman logs` reads no stdin; the harness allows a child that does not.
    let logs = client
        .exchange(super::exchange(envelope, timeout))
        .await
        .map_err(|_| {
            format!(
                "reading the container's log took over {}s",
                timeout.as_secs()
            )
        })?;
    match &logs.status {
        // What the client did see is a prefix of the log, or the log was
        // cut (a flood of short lines past its size): then keep the former.
        Ok(s) if s.success() && logs.stdout.text().starts_with(&run.stdout.text()) => {
            run.stdout = logs.stdout;
            run.stderr = logs.stderr;
            Ok(())
        }
        Ok(s) if s.success() => Ok(()),
        other => Err(format!(
            "the container ran, but its output could not be read back (`podman logs {name}`: {other:?}): {}",
            logs.stderr.text().trim()
        )),
    }
}

/// The error of a tool with an image when no engine can run it.
fn no_engine(envelope: &CallEnvelope, spec: &IsolationSpec, why: &str) -> String {
    format!(
        "the tool {:?} has an image ({}) and runs only in a container: {why}. \
         Install podman or docker, or make the tool a plain host command: \
         remove `image` from its `container`",
        envelope.tool_call.name, spec.image
    )
}

/// The call's result from how the engine's client ended.
fn engine_result(
    envelope: &CallEnvelope,
    status: &std::io::Result<ExitStatus>,
    stdout: &str,
    stderr: &str,
) -> ToolResult {
    match status {
        Err(e) => ToolResult::error(format!("waiting for the container engine: {e}")),
        // 125: the engine itself failed (no such image, bad flag).
        Ok(s) if s.code() == Some(125) => {
            let lower = stderr.to_lowercase();
            let hint = if ["image", "pull", "manifest"]
                .iter()
                .any(|w| lower.contains(w))
            {
                format!(
                    ". Images are never pulled unless {PULL_ENV} says so: load or \
                     build the image locally (e.g. `podman load -i IMAGE.tar`)"
                )
            } else {
                String::new()
            };
            ToolResult::error(format!(
                "the container engine could not run the tool's container ({s}): {}{hint}",
                stderr.trim()
            ))
        }
        Ok(s) => interpret(envelope, s.success(), s.code(), stdout, stderr),
    }
}

/// Picks the engine from a choice (`podman`, `docker`, `none`, a path) or
/// from `PATH`.
pub fn resolve_engine(chosen: Option<&str>, path: &std::ffi::OsStr) -> Result<Engine, String> {
    let find = |name: &str| -> Option<PathBuf> {
        std::env::split_paths(path)
            .map(|d| d.join(name))
            .find(|p| is_executable(p))
    };
    let kind = |p: &Path| {
        !p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains("docker"))
    };
    match chosen.map(str::trim) {
        Some("none") => Err(format!(
            "container engines are turned off (--container-engine none or {ENGINE_ENV}=none)"
        )),
        Some(c) if c.contains('/') => {
            let p = PathBuf::from(c);
            if is_executable(&p) {
                Ok(Engine {
                    podman: kind(&p),
                    program: p,
                })
            } else {
                Err(format!(
                    "the container engine {c} is not an executable file"
                ))
            }
        }
        Some(c @ ("podman" | "docker")) => find(c)
            .map(|p| Engine {
                podman: c == "podman",
                program: p,
            })
            .ok_or_else(|| format!("the container engine {c} was not found on PATH")),
        Some(other) => Err(format!(
            "unknown container engine {other:?} (use podman, docker, none or a path)"
        )),
        None => ["podman", "docker"]
            .iter()
            .find_map(|n| {
                find(n).map(|p| Engine {
                    podman: *n == "podman",
                    program: p,
                })
            })
            .ok_or_else(|| "no container engine (podman or docker) was found on PATH".into()),
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `agents-<token>-a<attempt>`, with what engines refuse in names replaced;
/// long names keep a prefix and a hash of the whole, so names stay unique.
pub fn container_name(token: &str, attempt: u32) -> String {
    let raw = format!("agents-{token}-a{attempt}");
    let clean: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if clean == raw && clean.len() <= 100 {
        return clean;
    }
    use sha2::Digest;
    let hash = sha2::Sha256::digest(raw.as_bytes());
    let hex: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let prefix: String = clean.chars().take(80).collect();
    format!("{prefix}-{hex}")
}

/// Arguments of the engine client, and the variables set in its own
/// environment (whose values `--env NAME` hands to the container).
pub type EngineCommand = (Vec<String>, Vec<(String, String)>);

/// The hardening flags of every tool container (see the module docs).
const HARDENING: &[&str] = &[
    "--network",
    "none",
    "--read-only",
    "--tmpfs",
    "/tmp:rw,nosuid,nodev,size=64m",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--user",
    TOOL_USER,
    "--pids-limit",
    "256",
    // Root may lack CAP_SYS_RESOURCE, and the engines' defaults can
    // exceed the machine's limits: runc then fails to set them.
    "--ulimit",
    "nofile=1024:4096",
    "--ulimit",
    "nproc=1024:2048",
];

/// The engine's arguments (global ones, `run`, hardening, limits, env
/// names, image, command) and the values of the variables the container
/// gets; `lookup` reads the worker's environment (secrets, settings).
pub fn run_command(
    name: &str,
    podman: bool,
    envelope: &CallEnvelope,
    spec: &IsolationSpec,
    lookup: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<EngineCommand, String> {
    if spec.image.is_empty() {
        return Err("the container runner needs an image".into());
    }
    let words = |var: &str| -> Vec<String> {
        lookup(var)
            .map(|v| v.split_whitespace().map(String::from).collect())
            .unwrap_or_default()
    };
    let mut argv = words(ENGINE_ARGS_ENV);
    if podman {
        // podman's attach can drop the output of a container that exits
        // without reading its stdin (seen 2-6 % of runs with podman 4.3):
        // the container keeps its log, which the runner reads afterwards
        // and then removes the container. The log holds more than the
        // runner ever captures, so it is never cut short unseen.
        argv.extend(["run", "-i", "--name", name].map(String::from));
        argv.extend([
            "--log-driver".to_string(),
            "k8s-file".to_string(),
            "--log-opt".to_string(),
            format!("max-size={}", 16 * super::MAX_CAPTURE_BYTES),
        ]);
    } else {
        argv.extend(["run", "--rm", "-i", "--name", name].map(String::from));
    }
    argv.extend(HARDENING.iter().map(|f| f.to_string()));
    argv.extend(limit_flags(spec, lookup)?);
    let base = vec![
        ("HOME".into(), "/tmp".into()),
        ("LANG".into(), "C.UTF-8".into()),
    ];
    let mut client_env = Vec::new();
    for (k, v) in with_tool_vars(base, envelope, spec, lookup, true)? {
        argv.push("--env".into());
        argv.push(k.clone());
        client_env.push((k, v));
    }
    argv.extend(words(RUN_ARGS_ENV));
    // Ends the engine's options: an image or command starting with `-` is
    // not taken as a flag.
    argv.push("--".into());
    argv.push(spec.image.clone());
    argv.extend(spec.command.iter().cloned());
    argv.extend(spec.args.iter().cloned());
    // The client itself inherits the worker's environment (it may need
    // XDG_RUNTIME_DIR, DOCKER_HOST, ...); the container gets none of it.
    Ok((argv, client_env))
}

/// `--memory`, `--cpus` (the definition's limits, else the defaults) and
/// `--pull` (from [`PULL_ENV`]).
fn limit_flags(
    spec: &IsolationSpec,
    lookup: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<[String; 5], String> {
    let limit = |key: &str, default: &'static str| {
        spec.limits
            .get(key)
            .map(String::as_str)
            .unwrap_or(default)
            .to_string()
    };
    let (memory, cpu) = (limit("memory", DEFAULT_MEMORY), limit("cpu", DEFAULT_CPU));
    let pull = match lookup(PULL_ENV).as_deref().map(str::trim) {
        None | Some("") | Some("never") => "never",
        Some("missing") => "missing",
        Some("always") => "always",
        Some(other) => {
            return Err(format!(
                "{PULL_ENV}={other:?} is not one of never, missing, always"
            ))
        }
    };
    Ok([
        "--memory".into(),
        memory_flag(&memory)?,
        "--cpus".into(),
        cpus_flag(&cpu)?,
        format!("--pull={pull}"),
    ])
}

/// A Kubernetes memory quantity (`128Mi`, `1Gi`, `500M`, `1048576`) as bytes.
pub fn memory_flag(q: &str) -> Result<String, String> {
    let q = q.trim();
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (num, mult) = units
        .iter()
        .find_map(|(u, m)| q.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|b| *b >= 6 * 1024 * 1024)
        .map(|b| format!("{b}b"))
        .ok_or_else(|| {
            format!("the tool's memory limit {q:?} is not a quantity of at least 6Mi, like 128Mi")
        })
}

/// A Kubernetes CPU quantity (`500m`, `2`, `0.5`) as `--cpus`.
pub fn cpus_flag(q: &str) -> Result<String, String> {
    let q = q.trim();
    let cpus = match q.strip_suffix('m') {
        Some(m) => m.parse::<u64>().ok().map(|m| m as f64 / 1000.0),
        None => q.parse::<f64>().ok(),
    };
    cpus.filter(|c| c.is_finite() && *c >= 0.01)
        .map(|c| format!("{c}"))
        .ok_or_else(|| format!("the tool's cpu limit {q:?} is not a quantity like 500m or 2"))
}

/// `kill` then `rm -f`: a shell as the container's pid 1 ignores the
/// SIGTERM `rm -f` starts with, which would cost the engine's grace period.
fn removal(engine: &Engine, name: &str) -> [std::process::Command; 2] {
    let extra = global_args();
    [&["kill", name][..], &["rm", "-f", name][..]].map(|verb| {
        let mut cmd = std::process::Command::new(&engine.program);
        cmd.args(&extra)
            .args(verb)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    })
}

async fn remove(engine: &Engine, name: &str) {
    for cmd in removal(engine, name) {
        let _ = Command::from(cmd).status().await;
    }
}

fn global_args() -> Vec<String> {
    std::env::var(ENGINE_ARGS_ENV)
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

/// Removes the container when the run is left without doing so (the
/// future dropped mid-run): from a thread, since `Drop` cannot await.
struct Remover(Option<(Engine, String)>);

impl Remover {
    /// Removes the container now, once.
    async fn remove_now(&mut self) {
        if let Some((engine, name)) = self.0.take() {
            remove(&engine, &name).await;
        }
    }

    /// The container is gone (by itself with `--rm`, or removed).
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Remover {
    fn drop(&mut self) {
        if let Some((engine, name)) = self.0.take() {
            let steps = removal(&engine, &name);
            std::thread::spawn(move || {
                for mut cmd in steps {
                    let _ = cmd.status();
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::fixtures::{envelope, image_tool};

    #[test]
    fn the_command_is_hardened_and_secrets_stay_off_the_command_line() {
        let spec = image_tool(
            "agents.local/busybox:ci",
            &["sh", "-c", "cat"],
            &["x"],
            ("GREETING", "hi"),
        );
        let lookup = |k: &str| (k == "AGENTS_SECRET_GH_TOKEN").then(|| "s3cret".to_string());
        let (argv, env) = run_command(
            "agents-s-t1-c0-a1",
            false,
            &envelope("s", "{}"),
            &spec,
            &lookup,
        )
        .unwrap();
        let line = argv.join(" ");
        for flag in [
            "run --rm -i --name agents-s-t1-c0-a1",
            "--network none",
            "--read-only",
            "--cap-drop ALL",
            "--security-opt no-new-privileges",
            "--user 65532:65532",
            "--memory 67108864b",
            "--cpus 0.5",
            "--pull=never",
            "--env GREETING",
            "--env TOKEN",
            "--env AGENTS_TOKEN",
            "-- agents.local/busybox:ci sh -c cat x",
        ] {
            assert!(line.contains(flag), "{flag:?} missing from {line}");
        }
        assert!(!line.contains("s3cret") && !line.contains("hi "), "{line}");
        assert!(env.contains(&("TOKEN".into(), "s3cret".into())));
        assert!(env.contains(&("AGENTS_TOKEN".into(), "s-t1-c0".into())));
        let missing = run_command("n", false, &envelope("s", "{}"), &spec, &|_| None).unwrap_err();
        assert!(missing.contains("AGENTS_SECRET_GH_TOKEN"), "{missing}");
    }

    #[test]
    fn names_quantities_and_engines() {
        assert_eq!(container_name("s-t1-c0", 2), "agents-s-t1-c0-a2");
        let odd = container_name("a/b c", 1);
        assert!(odd.starts_with("agents-a-b-c-a1-"), "{odd}");
        assert_ne!(odd, container_name("a b/c", 1));
        assert!(container_name(&"x".repeat(300), 1).len() < 110);
        assert_eq!(memory_flag("1Gi").unwrap(), "1073741824b");
        assert!(memory_flag("lots").is_err());
        assert_eq!(cpus_flag("250m").unwrap(), "0.25");
        assert_eq!(cpus_flag("2").unwrap(), "2");
        let empty = std::ffi::OsStr::new("/nonexistent");
        assert!(resolve_engine(None, empty).unwrap_err().contains("podman"));
        assert!(resolve_engine(Some("none"), empty).is_err());
        assert!(resolve_engine(Some("rkt"), empty).is_err());
        assert!(resolve_engine(Some("docker"), empty).is_err());
    }
}
