//! Shared helpers for integration tests that talk to the test cluster
//! (`tests/cluster/up`, `make cluster-up`). Use it from a test file with
//! `mod support;`.
//!
//! Gating: [`cluster`] returns `None` (and prints a "skipped" line) when no
//! test cluster is reachable, so a plain `cargo test` passes on a laptop. With
//! `AGENTS_REQUIRE_CLUSTER=1` (what `make test` and CI set) a missing cluster
//! is a test failure instead.
//!
//! The kubeconfig comes from `AGENTS_TEST_KUBECONFIG`, else from
//! [`DEFAULT_KUBECONFIG`], which `tests/cluster/up` writes. The user's own
//! `~/.kube/config` and `KUBECONFIG` are never read.
#![allow(dead_code)]

pub mod anthropic;
pub mod budgets;
pub mod chat;
pub mod fake;
pub mod fork;
pub mod http;
pub mod launcher;
pub mod mcp;
pub mod otel;
pub mod rng;
pub mod scratch;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use agents::runner::container::{ContainerRunner, Engine, ENGINE_ARGS_ENV};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::Deserialize;

/// A test's size from the environment variable `name`, else `default`.
pub fn sized(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v}: give a number"))
        })
        .unwrap_or(default)
}

/// Where `tests/cluster/up` writes the admin kubeconfig of the test cluster.
pub const DEFAULT_KUBECONFIG: &str = "/var/lib/agents-test-cluster/admin.kubeconfig";
/// Where `tests/cluster/build` caches the cluster binaries (kubectl among them).
pub const BINARY_CACHE: &str = "/var/cache/agents-cluster";
/// The busybox image that `tests/cluster/up` imports into the node's
/// containerd; [`podman_busybox`] loads it into the local container engine.
pub const BUSYBOX_IMAGE: &str = "agents.local/busybox:ci";
/// Label put on every namespace created by [`TestNamespace`].
pub const TEST_LABEL: &str = "agents.test/owner";

/// True when the cluster tests must run (`AGENTS_REQUIRE_CLUSTER=1`).
pub fn cluster_required() -> bool {
    matches!(
        std::env::var("AGENTS_REQUIRE_CLUSTER").as_deref(),
        Ok("1") | Ok("true") | Ok("yes")
    )
}

/// The test cluster's kubeconfig path, if the file exists.
pub fn kubeconfig_path() -> Option<PathBuf> {
    let path = match std::env::var_os("AGENTS_TEST_KUBECONFIG") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(DEFAULT_KUBECONFIG),
    };
    path.is_file().then_some(path)
}

fn no_cluster(why: &str) -> Option<Client> {
    if cluster_required() {
        panic!(
            "AGENTS_REQUIRE_CLUSTER=1 but the test cluster is not usable: {why}. \
             Start it with `make cluster-up` (kubeconfig: AGENTS_TEST_KUBECONFIG or {DEFAULT_KUBECONFIG})"
        );
    }
    eprintln!("skipped: no test cluster ({why}); run `make cluster-up` or `make test`");
    None
}

/// A client for the test cluster, or `None` (test should return early) when
/// there is none and `AGENTS_REQUIRE_CLUSTER` is not set.
///
/// ```ignore
/// let Some(client) = support::cluster().await else { return };
/// ```
pub async fn cluster() -> Option<Client> {
    let Some(path) = kubeconfig_path() else {
        return no_cluster("no kubeconfig found");
    };
    let kubeconfig = match Kubeconfig::read_from(&path) {
        Ok(k) => k,
        Err(e) => return no_cluster(&format!("cannot read {}: {e}", path.display())),
    };
    let config =
        match Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await {
            Ok(c) => c,
            Err(e) => return no_cluster(&format!("bad kubeconfig {}: {e}", path.display())),
        };
    let client = match Client::try_from(config) {
        Ok(c) => c,
        Err(e) => return no_cluster(&format!("cannot build client: {e}")),
    };
    match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
        Ok(Ok(_)) => Some(client),
        Ok(Err(e)) => no_cluster(&format!(
            "API server at {} not answering: {e}",
            path.display()
        )),
        Err(_) => no_cluster("API server did not answer within 10 s"),
    }
}

/// The kubectl to use against the test cluster: `AGENTS_TEST_KUBECTL`, else
/// the one built by `tests/cluster/build`, else `kubectl` from `PATH`.
pub fn kubectl_path() -> PathBuf {
    if let Some(p) = std::env::var_os("AGENTS_TEST_KUBECTL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let mut built: Vec<PathBuf> = std::fs::read_dir(BINARY_CACHE)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("kubernetes-v"))
        .map(|e| e.path().join("kubectl"))
        .filter(|p| p.is_file())
        .collect();
    built.sort();
    built.pop().unwrap_or_else(|| PathBuf::from("kubectl"))
}

/// Run kubectl against the test cluster (never the user's default context).
pub fn kubectl<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let kubeconfig = kubeconfig_path().unwrap_or_else(|| PathBuf::from(DEFAULT_KUBECONFIG));
    Command::new(kubectl_path())
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .expect("failed to run kubectl")
}

/// Waits (`kubectl wait`, at most `secs`) until Session `session` in `ns`
/// has condition `condition`; panics with kubectl's error and the Session.
pub fn wait_session_condition(ns: &str, session: &str, condition: &str, secs: u32) {
    let out = kubectl([
        "wait",
        "-n",
        ns,
        &format!("--for=condition={condition}"),
        &format!("session/{session}"),
        &format!("--timeout={secs}s"),
    ]);
    assert!(
        out.status.success(),
        "kubectl wait --for=condition={condition} session/{session}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        kubectl_ok(["get", "session", session, "-n", ns, "-o", "yaml"])
    );
}

/// Run kubectl and return its stdout; panic with stderr when it fails.
pub fn kubectl_ok<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().into()).collect();
    let out = kubectl(&args);
    assert!(
        out.status.success(),
        "kubectl {:?} failed: {}\n{}",
        args,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kubectl apply -n NS -f FILE` of `yaml` (written to a scratch file);
/// panics when it fails.
pub fn apply(ns: &str, yaml: &str) -> String {
    apply_with(ns, yaml, &[])
}

/// [`apply`] with more kubectl arguments (`--server-side`, ...).
pub fn apply_with(ns: &str, yaml: &str, args: &[&str]) -> String {
    let scratch = scratch::Scratch::new("apply");
    let file = scratch.write("objects.yaml", yaml);
    let mut all = vec!["apply"];
    all.extend_from_slice(args);
    all.extend(["-n", ns, "-f", file.to_str().unwrap()]);
    kubectl_ok(all)
}

/// A fresh, labelled namespace with a random name; deleted (without waiting)
/// when dropped, also when the test panics.
pub struct TestNamespace {
    pub name: String,
}

/// Waits for namespace `ns`'s default service account, which the
/// ServiceAccount admission plugin wants before it admits a pod, and makes
/// it if kube-controller-manager has not in 20 s. Right after a chaos test
/// restarts kube-apiserver, the restarted server can answer the
/// controller's watches "forbidden" before its RBAC cache is filled, and
/// the controller then backs off for up to a minute: its account is the
/// same empty object, made a little sooner.
async fn default_service_account(client: &Client, ns: &str) {
    use k8s_openapi::api::core::v1::ServiceAccount;
    let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(Some(_)) = sa.get_opt("default").await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let default: ServiceAccount = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"},
    }))
    .expect("service account object");
    match sa.create(&PostParams::default(), &default).await {
        Ok(_) => {
            eprintln!("made namespace {ns}'s default service account (the controller had not)")
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create namespace {ns}'s default service account: {e}"),
    }
}

impl TestNamespace {
    /// Create `<prefix>-<random>` labelled `agents.test/owner=<prefix>`.
    pub async fn create(client: &Client, prefix: &str) -> TestNamespace {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{prefix}-{}", &suffix[..8]);
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {TEST_LABEL: prefix}},
        }))
        .expect("namespace object");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        default_service_account(client, &name).await;
        TestNamespace { name }
    }

    /// Delete now and wait until the namespace is gone.
    pub async fn delete(self, client: &Client) {
        let api = Api::<Namespace>::all(client.clone());
        let _ = api.delete(&self.name, &DeleteParams::background()).await;
        let name = self.name.clone();
        wait_until(Duration::from_secs(120), "namespace deletion", || async {
            matches!(api.get_opt(&name).await, Ok(None)).then_some(())
        })
        .await;
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let _ = kubectl([
            "delete",
            "namespace",
            &self.name,
            "--wait=false",
            "--ignore-not-found",
        ]);
    }
}

/// Poll `check` every 250 ms until it returns `Some`, or panic after `timeout`.
pub async fn wait_until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The repository root (for finding `crds/`, `examples/`, ...).
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `tests/cluster/chaos ARGS`, with no file descriptor of this process
/// but stdin, stdout and stderr: the components it starts again outlive
/// the test, and one holding an inherited descriptor of the cluster lock
/// (`flock -x /work/cluster.lock`) would hold the lock for ever.
pub fn chaos(args: &[&str]) -> Output {
    let mut command = Command::new(repo_root().join("tests/cluster/chaos"));
    command.args(args);
    // SAFETY: only close(2), async-signal-safe, between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            for fd in 3..4096 {
                libc::close(fd);
            }
            Ok(())
        });
    }
    let out = command.output().expect("run tests/cluster/chaos");
    eprintln!(
        "chaos {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Waits, blocking the thread, until `check` holds; fails after `timeout`
/// naming `what`. For tests that drive processes and `kubectl`, not async
/// clients (`wait_until` is the async one).
pub fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The release `agents` binary the image ships, for tests that measure the
/// operator or run it long (a debug build spends several times the CPU on
/// JSON, and on two cores that CPU is the API server's). It is what
/// `tests/cluster/agents-image --no-import` builds: incremental, a no-op
/// when it is fresh (`make test` builds the image from its dev build, so
/// a first call here builds the release binary). `AGENTS_SCALE_BIN` names
/// another binary.
#[allow(dead_code)]
pub fn release_agents_bin() -> String {
    if let Ok(bin) = std::env::var("AGENTS_SCALE_BIN") {
        return bin;
    }
    let built = agents_image_script()
        .arg("--no-import")
        .env("AGENTS_IMAGE_PROFILE", "release")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("tests/cluster/agents-image runs");
    assert!(
        built.success(),
        "tests/cluster/agents-image --no-import failed"
    );
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target"));
    target
        .join("x86_64-unknown-linux-gnu/release/agents")
        .display()
        .to_string()
}

/// `tests/cluster/agents-image`, run from the checkout without what cargo
/// adds to every test process's environment: the package's `CARGO_*`
/// values, `OUT_DIR`, and the build script's `AGENTS_GIT_COMMIT` and
/// `AGENTS_BUILD_DATE`. Build scripts rerun when such a variable changes
/// (ring's on `CARGO_MANIFEST_DIR`, ours on `AGENTS_GIT_COMMIT`), and the
/// release binary that `make test` built moments before would be built
/// again: minutes of CPU, once per test process.
fn agents_image_script() -> Command {
    let mut cmd = Command::new(repo_root().join("tests/cluster/agents-image"));
    cmd.current_dir(repo_root());
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if added_by_cargo_test(&name) {
            cmd.env_remove(&*name);
        }
    }
    cmd
}

fn added_by_cargo_test(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "CARGO",
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "OUT_DIR",
        "AGENTS_GIT_COMMIT",
        "AGENTS_BUILD_DATE",
    ];
    EXACT.contains(&name) || name.starts_with("CARGO_PKG_") || name.starts_with("CARGO_BIN_EXE_")
}

/// The test cluster with the repo's CRDs installed and a fresh namespace
/// named after `prefix`; `None` without a cluster (the test is skipped).
#[allow(dead_code)]
pub async fn cluster_namespace(prefix: &str) -> Option<(kube::Client, TestNamespace)> {
    let client = cluster().await?;
    install_crds(&client).await;
    let ns = TestNamespace::create(&client, prefix).await;
    Some((client, ns))
}

/// Every CustomResourceDefinition in `crds/*.yaml` (multi-document files allowed).
pub fn crds_from_repo() -> Vec<(String, CustomResourceDefinition)> {
    let dir = repo_root().join("crds");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    let mut crds = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in serde_norway::Deserializer::from_str(&text) {
            let value = serde_json::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: invalid YAML: {e}", file.display()));
            if value.is_null() {
                continue;
            }
            if value["kind"] == "CustomResourceDefinition" {
                let crd: CustomResourceDefinition = serde_json::from_value(value)
                    .unwrap_or_else(|e| panic!("{}: not a CRD: {e}", file.display()));
                crds.push((file.display().to_string(), crd));
            }
        }
    }
    crds
}

/// Applies every CRD in `crds/` (server-side apply, forced) and waits until
/// each is Established. Returns them.
pub async fn install_crds(client: &Client) -> Vec<CustomResourceDefinition> {
    let crds = crds_from_repo();
    assert!(
        !crds.is_empty(),
        "no CustomResourceDefinition found in crds/*.yaml"
    );
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let ssa = PatchParams::apply("agents-tests").force();
    for (file, crd) in &crds {
        let name = crd.metadata.name.clone().expect("CRD without a name");
        api.patch(&name, &ssa, &Patch::Apply(crd))
            .await
            .unwrap_or_else(|e| panic!("{file}: apply CRD {name}: {e}"));
    }
    for (_, crd) in &crds {
        let name = crd.metadata.name.clone().unwrap();
        wait_until(
            Duration::from_secs(30),
            &format!("CRD {name} Established"),
            || async {
                let c = api.get(&name).await.ok()?;
                c.status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(())
            },
        )
        .await;
    }
    crds.into_iter().map(|(_, crd)| crd).collect()
}

/// The cache of `tests/cluster/*`: `AGENTS_CLUSTER_CACHE`, else [`BINARY_CACHE`].
pub fn cache_dir() -> PathBuf {
    std::env::var_os("AGENTS_CLUSTER_CACHE")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(BINARY_CACHE))
}

/// A test cannot get what it needs (an engine, an image): a failure under
/// `AGENTS_REQUIRE_CLUSTER=1`, else a printed "skipped" and `None`.
pub fn skip_or_fail<T>(why: &str) -> Option<T> {
    if cluster_required() {
        panic!("AGENTS_REQUIRE_CLUSTER=1 but {why}");
    }
    eprintln!("skipped: {why}");
    None
}

/// Runs the container engine with the global arguments the runner uses too
/// (`AGENTS_CONTAINER_ENGINE_ARGS`, e.g. `--storage-driver vfs`), stdin closed.
pub fn engine_cmd(engine: &Engine, args: &[&str]) -> Output {
    let extra: Vec<String> = std::env::var(ENGINE_ARGS_ENV)
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    Command::new(&engine.program)
        .args(extra)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", engine.program.display()))
}

/// The local container engine the runner picks (podman, else docker; as
/// `AGENTS_CONTAINER_ENGINE` says), with [`BUSYBOX_IMAGE`] loaded and shown
/// to run; or why not.
///
/// Needs no earlier run and no other test: the archive
/// (`<cache>/images/busybox.tar`) is built with `tests/cluster/images` when
/// it is missing, and loaded into the engine once per test process (so an
/// image removed from the engine, or a fresh machine, is no problem).
pub fn podman_busybox() -> Result<Engine, String> {
    static READY: OnceLock<Result<Engine, String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            let engine = ContainerRunner::default().resolve()?;
            let archive = cache_dir().join("images/busybox.tar");
            if !archive.is_file() {
                let script = repo_root().join("tests/cluster/images");
                let out = Command::new(&script)
                    .stdin(Stdio::null())
                    .output()
                    .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
                if !out.status.success() || !archive.is_file() {
                    return Err(format!(
                        "{} did not build {}: {}",
                        script.display(),
                        archive.display(),
                        String::from_utf8_lossy(&out.stderr)
                    ));
                }
            }
            let archive = archive.to_string_lossy();
            let load = engine_cmd(&engine, &["load", "-i", &archive]);
            if !load.status.success() {
                return Err(format!(
                    "`{} load -i {archive}` failed: {}",
                    engine.program.display(),
                    String::from_utf8_lossy(&load.stderr)
                ));
            }
            let run = engine_cmd(
                &engine,
                &[
                    "run",
                    "--rm",
                    "--pull=never",
                    "--network",
                    "none",
                    "--ulimit",
                    "nofile=1024:4096",
                    "--ulimit",
                    "nproc=1024:2048",
                    BUSYBOX_IMAGE,
                    "true",
                ],
            );
            if !run.status.success() {
                return Err(format!(
                    "{} cannot run {BUSYBOX_IMAGE}: {}",
                    engine.program.display(),
                    String::from_utf8_lossy(&run.stderr)
                ));
            }
            Ok(engine)
        })
        .clone()
}

/// [`podman_busybox`] for a test: `None` (printed "skipped") when this
/// machine cannot run the image, a panic instead under
/// `AGENTS_REQUIRE_CLUSTER=1`.
pub fn podman_busybox_or_skip() -> Option<Engine> {
    match podman_busybox() {
        Ok(engine) => Some(engine),
        Err(why) => skip_or_fail(&format!(
            "no container engine runs {BUSYBOX_IMAGE} here: {why}"
        )),
    }
}

/// Whether the test cluster's containerd holds `image` (the node cannot
/// pull: there is no registry).
pub fn image_in_cluster(image: &str) -> Result<bool, String> {
    let run = std::env::var_os("AGENTS_CLUSTER_RUN")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/agents-test-cluster"));
    let sock = run.join("containerd/containerd.sock");
    let out = Command::new("ctr")
        .arg("--address")
        .arg(&sock)
        .args(["-n", "k8s.io", "images", "ls", "-q"])
        .output()
        .map_err(|e| format!("cannot run ctr: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ctr images ls on {}: {}",
            sock.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l == image))
}

/// The agents image (built from the `Dockerfile`), present in the test
/// cluster's containerd; or why not.
///
/// `AGENTS_TEST_AGENTS_IMAGE` (what `make test` sets after building and
/// importing it) when set and present in the cluster. Else, once per test
/// process, `tests/cluster/agents-image` builds it from this checkout (cached
/// by the binary's hash) and imports it: never a reference some earlier run
/// left in a file, which may name an older binary or an image the current
/// cluster lacks. Call it after [`cluster`] answered.
pub fn agents_image_ready() -> Result<String, String> {
    static READY: OnceLock<Result<String, String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            if let Some(image) = std::env::var("AGENTS_TEST_AGENTS_IMAGE")
                .ok()
                .filter(|r| !r.trim().is_empty())
            {
                let image = image.trim().to_string();
                if !image_in_cluster(&image)? {
                    return Err(format!(
                        "AGENTS_TEST_AGENTS_IMAGE={image} is not in the test cluster's containerd \
                         (tests/cluster/agents-image imports it; or unset the variable)"
                    ));
                }
                return Ok(image);
            }
            let script = repo_root().join("tests/cluster/agents-image");
            let out = agents_image_script()
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
            let image = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if !out.status.success() || image.is_empty() {
                return Err(format!(
                    "{} failed: {}",
                    script.display(),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Ok(image)
        })
        .clone()
}

/// [`agents_image_ready`] for a test: `None` (printed "skipped") without it,
/// a panic instead under `AGENTS_REQUIRE_CLUSTER=1`.
pub fn agents_image() -> Option<String> {
    match agents_image_ready() {
        Ok(image) => Some(image),
        Err(why) => skip_or_fail(&format!("no agents image in the test cluster: {why}")),
    }
}

/// `apiserver_request_total` summed by (verb, resource) for our kinds.
pub fn api_writes() -> BTreeMap<(String, String), u64> {
    let metrics = kubectl_ok(["get", "--raw", "/metrics"]);
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let get = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let (verb, resource) = (get("verb"), get("resource"));
        if !matches!(verb.as_str(), "POST" | "PUT" | "PATCH" | "DELETE" | "APPLY") {
            continue;
        }
        if !matches!(
            resource.as_str(),
            "sessions" | "continuations" | "configmaps" | "jobs" | "events"
        ) {
            continue;
        }
        let n: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry((verb, resource)).or_insert(0) += n as u64;
    }
    out
}

/// A kubeconfig that authenticates as service account `sa` of `ns`.
pub fn service_account_kubeconfig(ns: &str, sa: &str) -> PathBuf {
    let token = kubectl_ok(["create", "token", sa, "-n", ns, "--duration=1h"]);
    let admin_path = kubeconfig_path().expect("the test cluster's kubeconfig");
    let admin: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(admin_path).unwrap()).unwrap();
    let cluster = admin["clusters"][0]["cluster"].clone();
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": sa, "user": {"token": token.trim()}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "test", "user": sa, "namespace": ns}}],
        "current-context": "ctx",
    });
    let path = std::env::temp_dir().join(format!("agents-{ns}-{sa}.kubeconfig"));
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    path
}

/// Cluster-scoped objects a test created (`kind/name`), deleted when it
/// ends, also when it fails.
pub struct ClusterScoped(pub Vec<String>);

impl Drop for ClusterScoped {
    fn drop(&mut self) {
        for object in &self.0 {
            let _ = kubectl([
                "delete",
                object.as_str(),
                "--ignore-not-found",
                "--wait=false",
            ]);
        }
    }
}

/// The chart rendered by helm (built by tests/cluster/build) for release
/// `release` in `ns`, its objects named `<release>-...`; `args` adds
/// `--set` and `--show-only`.
pub fn helm_template(release: &str, ns: &str, args: &[&str]) -> String {
    let helm = std::fs::read_dir(BINARY_CACHE)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("helm-"))
        .map(|e| e.path().join("helm"))
        .find(|p| p.is_file())
        .expect("helm, built by tests/cluster/build");
    let out = Command::new(helm)
        .args(["template", release])
        .arg(repo_root().join("charts/agents"))
        .args([
            "--namespace",
            ns,
            "--set",
            &format!("fullnameOverride={release}"),
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
