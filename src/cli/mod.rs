//! The `agents` command line (also `kubectl agents` when installed as the
//! kubectl plugin `kubectl-agents`).

mod docs_cmd;
mod logging;
mod operator_cmd;
mod pending_tree;
pub use crate::standalone::out;
mod run_cmd;
mod session_cmd;
mod tool_exec;
mod tree_cmd;
mod ui;

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

/// What `agents version` and `agents --version` print after the name:
/// the package version, the commit and the build date (stamped by build.rs;
/// "unknown" commit where the source had no git history).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("AGENTS_GIT_COMMIT"),
    ", built ",
    env!("AGENTS_BUILD_DATE"),
    ")"
);

#[derive(Parser, Debug)]
#[command(
    name = "agents",
    version = VERSION,
    about = "Durable AI-agent sessions: on Kubernetes, or standalone on an embedded store",
    long_about = "Durable AI-agent sessions. A session's tool calls run now, in the background, \
isolated, or wait for an outside party; the session yields, survives restarts, and wakes when \
results arrive.\n\nStandalone: `agents run -f session.yaml` runs a Session on an embedded SQLite \
store. In a cluster: install the operator and `kubectl apply` Sessions; `agents session ...` (or \
`kubectl agents session ...`) works against either store."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print the CustomResourceDefinitions (Agent, Session, Continuation) as YAML.
    Crds,
    /// Run a Session (and its Agent) from YAML on the embedded store, until it
    /// succeeds, fails or yields.
    Run(RunArgs),
    /// Inspect and drive sessions: list, show, pending, pause, resume,
    /// complete, approve, deny, run-isolated.
    #[command(subcommand)]
    Session(SessionCommand),
    /// Run the operator: reconcile Sessions in the cluster of the current
    /// kubeconfig context (or the pod's service account) until SIGTERM.
    Operator(Box<OperatorArgs>),
    /// Serve the console on loopback: sessions, their timelines, and the
    /// calls waiting for people, acted on with your own kubeconfig
    /// (`kubectl agents ui`).
    Ui(ui::UiArgs),
    /// Inside a tool Job's container: run the tool's command with the call
    /// envelope on stdin and report its result (used by the Job runner).
    ToolExec(tool_exec::ToolExecArgs),
    /// Render documentation generated from this binary: `docs crd-reference`
    /// prints the book's CRD reference (docs/src/crd-reference.md).
    #[command(subcommand)]
    Docs(docs_cmd::DocsCommand),
    /// Print the version, the commit and the build date (as --version).
    Version,
    /// Print a shell completion script: `source <(agents completion bash)`,
    /// `agents completion zsh > "${fpath[1]}/_agents"`,
    /// `agents completion fish > ~/.config/fish/completions/agents.fish`.
    Completion {
        #[arg(value_enum)]
        shell: CompletionShell,
    },
}

/// The shells `agents completion` writes scripts for.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

/// The completion script for `shell`, completing the command `agents`.
fn completion_script(shell: CompletionShell) -> String {
    use clap::CommandFactory;
    use clap_complete::Shell;
    let shell = match shell {
        CompletionShell::Bash => Shell::Bash,
        CompletionShell::Zsh => Shell::Zsh,
        CompletionShell::Fish => Shell::Fish,
    };
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "agents", &mut script);
    String::from_utf8_lossy(&script).into_owned()
}

#[derive(Args, Debug, Clone)]
pub struct OperatorArgs {
    /// Watch only these namespaces (repeat the flag); default: all.
    #[arg(
        long = "namespace",
        short = 'n',
        env = "AGENTS_NAMESPACE",
        value_delimiter = ','
    )]
    pub namespaces: Vec<String>,
    /// The agents image (this binary), for the init container that brings
    /// the wrapper into tool Jobs. Without it, `runIsolated` calls wait for
    /// an outside worker (`agents session run-isolated --store kube`).
    #[arg(long, env = "AGENTS_IMAGE")]
    pub agents_image: Option<String>,
    /// An image pattern (glob) tools may run; repeat for more. Default: any.
    #[arg(
        long = "allowed-tool-image",
        env = "AGENTS_ALLOWED_TOOL_IMAGES",
        value_delimiter = ','
    )]
    pub allowed_tool_images: Vec<String>,
    /// A URL pattern http tools may call (repeat, or separate with commas);
    /// default: any URL. `*` matches within one host label, any port
    /// (`:*`), or any run of the path: `https://api.example.com/*`,
    /// `http://127.0.0.1:*/*`, `https://*.svc.example/v1/*`. Checked before
    /// each request and on each redirect; a call to another URL fails with
    /// an error result and sends nothing.
    #[arg(
        long = "http-tool-allowed-urls",
        env = "AGENTS_HTTP_TOOL_ALLOWED_URLS",
        value_delimiter = ',',
        value_name = "PATTERN"
    )]
    pub http_tool_allowed_urls: Vec<String>,
    /// A URL pattern a model may be called at (repeat, or separate with
    /// commas), matched against the URL each request goes to:
    /// `spec.model.openai.baseUrl` + `/chat/completions`, or
    /// `spec.model.anthropic.baseUrl` + `/v1/messages`; default: any URL.
    /// The same patterns as `--http-tool-allowed-urls`. An Agent whose
    /// model is elsewhere is `Ready=False ModelUrlNotAllowed` and its
    /// sessions wait, having sent nothing.
    #[arg(
        long = "model-allowed-urls",
        env = "AGENTS_MODEL_ALLOWED_URLS",
        value_delimiter = ',',
        value_name = "PATTERN"
    )]
    pub model_allowed_urls: Vec<String>,
    /// Where calls that wait for a person (an approval, an outside result)
    /// are announced, for agents without a `notify.webhook`: one JSON POST
    /// per wait (Slack-compatible). Default: nowhere.
    #[arg(long, env = "AGENTS_NOTIFY_WEBHOOK_URL", value_name = "URL")]
    pub notify_webhook_url: Option<String>,
    /// The page where people decide and complete calls: the `link` of
    /// notifications (`{namespace}`, `{session}`, `{token}` are filled in,
    /// else given as query parameters). Default: the CLI command.
    #[arg(long, env = "AGENTS_APPROVALS_PAGE_URL", value_name = "URL")]
    pub approvals_page_url: Option<String>,
    /// The deepest a tree of sub-agent sessions may grow (the root is
    /// depth 0), whatever an Agent's `spec.maxDepth` says.
    #[arg(long, env = "AGENTS_MAX_SUB_AGENT_DEPTH", default_value_t = 8)]
    pub max_sub_agent_depth: u32,
    /// Service account of tool pods (give one without permissions; its
    /// token is never mounted).
    #[arg(long, env = "AGENTS_TOOL_SERVICE_ACCOUNT", default_value = "default")]
    pub tool_service_account: String,
    /// Default CPU and memory limits of tool containers.
    #[arg(long, default_value = "500m")]
    pub job_cpu_limit: String,
    #[arg(long, default_value = "256Mi")]
    pub job_memory_limit: String,
    /// Deadline of a tool call without a `timeout` decorator (its Job's
    /// activeDeadlineSeconds; also runSync and runAsync tools).
    #[arg(long, default_value_t = 300)]
    pub job_active_deadline_seconds: u64,
    /// How long a tool Job stays once its call's result is recorded (its
    /// ttlSecondsAfterFinished): for its logs, and counted by a namespace's
    /// ResourceQuota on Jobs until it goes. 0 to 604800 (a week).
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(i32).range(0..=604_800))]
    pub job_ttl_seconds_after_finished: i32,
    /// Model call timeout for agents that set no `spec.model.timeoutSeconds`.
    #[arg(long)]
    pub model_timeout_seconds: Option<u64>,
    /// Hold a Lease and reconcile only while leading (replicas > 1).
    #[arg(long, env = "AGENTS_LEADER_ELECT")]
    pub leader_elect: bool,
    #[arg(long, default_value = "agents-operator")]
    pub lease_name: String,
    #[arg(long, default_value_t = 15)]
    pub lease_duration_seconds: u64,
    #[arg(long, default_value_t = 5)]
    pub lease_grace_seconds: u64,
    /// Serve /metrics, /healthz and /readyz on this address.
    #[arg(long, env = "AGENTS_METRICS_ADDR", default_value = "127.0.0.1:8080")]
    pub metrics_addr: String,
    /// Reconcile every session that is not final at least this often (a
    /// safety net under the watches; a step with nothing to do writes nothing).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub resync_seconds: u64,
    /// At most this many resync reconciles a second.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub resync_rate: u32,
    /// /healthz and /readyz fail once a watch or the API probe has failed for
    /// longer than this, so the kubelet restarts an operator cut off from its
    /// API server.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub stall_seconds: u64,
    /// Most tool calls one model reply may ask for; a reply over it fails
    /// its session before anything of it is kept or run.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_calls_per_reply: u32,
    /// Agents may use only Secrets labelled agents-exe.io/usable-by-agents=true
    /// (false: any Secret of the session's namespace, as whoever may create
    /// Sessions there could then send any of them to a URL of their choosing).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub secrets_need_label: bool,
    /// Delete finished sessions (Succeeded or Failed) this many seconds after
    /// they finish, where their spec.ttlSecondsAfterFinished says nothing.
    /// Unset: they are kept.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
    pub finished_session_ttl_seconds: Option<u64>,
    /// Reconciles running at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_concurrent_reconciles: u16,
    /// Reconciles of one namespace's sessions running at once, so no
    /// namespace holds every slot (a step runs the model and runSync tools,
    /// which may be slow). Default: three quarters of
    /// --max-concurrent-reconciles, at least 1.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_reconciles_per_namespace: Option<u16>,
    /// runAsync calls of one namespace running at once; more wait their
    /// turn. Each may hold a reply of up to 8 MiB, so this bounds what one
    /// namespace's background work takes of the operator's memory.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_background_runs_per_namespace: u16,
    /// Requests a second this operator sends its API server at most, on
    /// average (0: no client-side limit; the API server's Priority and
    /// Fairness, which the chart configures, queues a burst instead).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub api_qps: u32,
    /// Requests sent at once before --api-qps paces them (default: twice
    /// --api-qps).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub api_burst: Option<u32>,
    /// Kubernetes Events written a second at most, on average. Events are
    /// written off the reconcile path from a queue of 1000; under a burst,
    /// what does not fit is dropped (agents_events_dropped_total).
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub event_qps: u32,
    /// Events written at once before --event-qps paces them.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub event_burst: u32,
    /// Log lines as `text` or `json` (also AGENTS_LOG_FORMAT).
    #[arg(long, value_parser = ["text", "json"])]
    pub log_format: Option<String>,
}

#[derive(Args, Debug, Clone)]
pub struct StoreArgs {
    /// Where sessions live: `sqlite:PATH` (embedded) or `kube` (the cluster of
    /// the current kubeconfig context).
    #[arg(
        long,
        env = "AGENTS_STORE",
        default_value = "sqlite:./agents.db",
        global = true
    )]
    pub store: String,
    /// Namespace, for the `kube` store.
    #[arg(long, short = 'n', env = "AGENTS_NAMESPACE", global = true)]
    pub namespace: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Readable on a terminal.
    #[default]
    Text,
    /// One JSON object per line, for machines.
    Json,
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// YAML holding a Session (with an inline agent or an agentRef) and any
    /// Agents it refers to; the same YAML `kubectl apply` takes.
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Subcommand, Debug, Clone)]
pub enum SessionCommand {
    /// List sessions with their phase and pending calls.
    List {
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Show a session's conversation and its open calls.
    Show {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Show a session and its sub-agent sessions (`--store kube`): each
    /// one's phase, the call that made it, its depth and its usage.
    Tree {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// List the deferred calls of a session, with their tokens and what each waits for.
    Pending {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Hold a session: no model or tool call starts until `resume`.
    Pause {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Release a paused session and drive it on (standalone: until it
    /// succeeds, fails or yields again).
    Resume {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Fork a session: a new session starts with SRC's conversation up to
    /// and including agent turn N and that turn's recorded results (never
    /// run again), then takes --message and goes on under its own keys.
    /// Calls still open at turn N start afresh in the fork. SRC is only
    /// read, in any phase. Standalone the fork is driven at once; in a
    /// cluster it is a Session with spec.forkFrom that the operator drives.
    Fork {
        /// The session to fork.
        source: String,
        /// The agent turn the fork starts after (1 is the first).
        #[arg(long = "at-turn")]
        at_turn: u32,
        /// The fork's name (default: SRC-fork-tN).
        #[arg(long)]
        name: Option<String>,
        /// The fork's next user message.
        #[arg(long)]
        message: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Retry a session that failed (for example because its model kept
    /// failing): it runs again from its last checkpoint.
    Retry {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Complete a deferred call with its result. A second, different result
    /// for the same token is refused.
    Complete {
        /// The continuation token (see `agents session pending`).
        token: String,
        /// A file holding the result, as `--result-file` takes it (the
        /// plan's `agents session complete TOKEN RESULT_FILE`).
        #[arg(value_name = "RESULT_FILE", conflicts_with = "text")]
        result_file_arg: Option<PathBuf>,
        /// A file holding the result: a tool response as JSON
        /// (`{"type":"text","content":"..."}`), a result envelope, or plain text.
        #[arg(
            long,
            conflicts_with = "text",
            required_unless_present_any = ["text", "result_file_arg"]
        )]
        result_file: Option<PathBuf>,
        /// The result as plain text.
        #[arg(long)]
        text: Option<String>,
        /// Complete with an error result the model is told about.
        #[arg(long)]
        error: bool,
        /// Who completes it (recorded with the result).
        /// Who decides (standalone: default $USER); in a cluster, your
        /// user name as the API server knows it, which is the default.
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Answer an MCP task's request for input (the call waits for
    /// `mcpTask`, and `agents session show` prints what it asks). The
    /// operator hands the answers to the server with `tasks/update`.
    Answer {
        /// The continuation token.
        token: String,
        /// The answers: an `inputResponses` object, one entry per key the
        /// task asks under, e.g. `{"q1": {"action": "accept", "content": {"ok": true}}}`.
        answers: String,
        /// Who answers; in a cluster, your user name as the API server
        /// knows it, which is the default.
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Run again a call whose outcome is unknown (`waitingFor: outcome`:
    /// a tool that is not idempotent, whose run's driver died before it
    /// answered). Check first that it did not take effect; otherwise
    /// complete it with the real result (`agents session complete`).
    RunAgain {
        /// The continuation token (see `agents session pending`).
        token: String,
        /// Who answers (standalone: default $USER); in a cluster, your
        /// user name as the API server knows it, which is the default.
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Approve a call that waits for approval; it then runs per its policy.
    /// A session's question about its budget (`waitingFor: budget`) is
    /// approved with a raise: `--raise tokens=200000`.
    Approve {
        token: String,
        /// Run the call with these arguments (a JSON object) instead of
        /// the model's, where its policy has `approval.allowEdit`.
        #[arg(long)]
        args_file: Option<std::path::PathBuf>,
        /// A new bound for a limit the session reached (`onExceed: ask`):
        /// `tokens=N`, `cost=D` (in the pricing currency) or
        /// `toolCalls=N`; repeat for several.
        #[arg(long, value_name = "LIMIT=VALUE")]
        raise: Vec<String>,
        /// Who decides (standalone: default $USER); in a cluster, your
        /// user name as the API server knows it, which is the default.
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Deny a call that waits for approval; the model is told it was denied.
    Deny {
        token: String,
        /// Why, for the model.
        #[arg(long)]
        reason: Option<String>,
        /// Who decides (standalone: default $USER); in a cluster, your
        /// user name as the API server knows it, which is the default.
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Act as an external worker: run the session's pending isolated calls as
    /// local processes (envelope on stdin, result on stdout) and complete them.
    RunIsolated {
        session: String,
        /// Give up on a call after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout_seconds: u64,
        /// Where tools with an image run: podman, docker, none, or a path to
        /// either's client. Default: podman, then docker, found on PATH. Such
        /// tools never run on the host.
        #[arg(long, env = "AGENTS_CONTAINER_ENGINE")]
        container_engine: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Write a session as one JSON document (format
    /// agents-exe.io/session-export, version 1) on stdout: its spec and
    /// agent, the whole conversation, calls, results, usage, lineage and
    /// open waits. Secrets appear by reference only.
    Export {
        session: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Read a session export into a store (`--store sqlite:PATH` or
    /// `--store kube -n NS`); its open calls wait there, under tokens
    /// derived from its name.
    Import {
        /// The export file (`agents session export NAME > FILE`).
        #[arg(long, short = 'f')]
        file: PathBuf,
        /// Import under this name instead of the exported one.
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Run a recorded session again (an export file, or a session of
    /// --store) through an agent, standalone: its user messages go to the
    /// model; a tool call matching a recorded one (same tool and
    /// arguments, in order) gets the recorded result and runs nothing.
    /// Exit 0 when every turn matches, 4 when not.
    Replay {
        /// An export file, or a session name in --store.
        source: String,
        /// The agent to replay through (YAML as `agents run` takes it);
        /// default: the recorded agent.
        #[arg(long)]
        agent: Option<PathBuf>,
        /// The model to replay through instead of the agent's: a YAML file
        /// holding an Agent's `model:` section (`provider: openai`,
        /// `openai: {baseUrl, model, apiKeySecretRef}`, ...).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Require the same arguments too, not only the same tools in the
        /// same order.
        #[arg(long)]
        strict: bool,
        /// Run calls that have no recorded result (default: they get an
        /// error result and nothing runs).
        #[arg(long)]
        run_unmatched: bool,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, short = 'o', value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
}

/// Runs the command line; errors are printed by the caller.
pub fn main() -> ExitCode {
    let cli = Cli::parse_from(plugin_aware_args());
    // The operator's logs are its output; a CLI command's are noise unless asked for.
    match &cli.command {
        Command::Operator(args) => {
            logging::init("info", args.log_format.as_deref() == Some("json"))
        }
        _ => logging::init("warn", false),
    }
    // Spans of the steps this process takes; flushed when it ends.
    let _telemetry = match &cli.command {
        Command::Operator(_) => crate::telemetry::install_from_env("agents-operator"),
        Command::Run(_) | Command::Session(_) => crate::telemetry::install_from_env("agents"),
        _ => crate::telemetry::Telemetry::off(),
    };
    let result = match cli.command {
        Command::Crds => {
            out::text(&crate::api::crds_yaml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Run(args) => run_cmd::run(args),
        Command::Session(cmd) => session_cmd::run(cmd),
        Command::Operator(args) => operator_cmd::run(*args),
        Command::Ui(args) => ui::run(args),
        Command::ToolExec(args) => return tool_exec::run(args),
        Command::Docs(cmd) => docs_cmd::run(cmd),
        Command::Version => {
            out::text(&format!("agents {VERSION}\n"));
            Ok(ExitCode::SUCCESS)
        }
        Command::Completion { shell } => {
            out::text(&completion_script(shell));
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            out::err_line(&format!("error: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// As the kubectl plugin the binary is `kubectl-agents`; help should say
/// `kubectl agents`.
fn plugin_aware_args() -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(first) = args.first() {
        let is_plugin = std::path::Path::new(first)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("kubectl-agents"));
        if is_plugin && std::env::var_os("AGENTS_STORE").is_none() {
            // As `kubectl agents` the cluster is the default store; clap
            // reads the default from this variable.
            std::env::set_var("AGENTS_STORE", "kube");
        }
        args[0] = if is_plugin {
            "kubectl agents".into()
        } else {
            "agents".into()
        };
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn http_tool_allowed_urls_repeat_or_split_at_commas() {
        let cli = Cli::try_parse_from([
            "agents",
            "operator",
            "--http-tool-allowed-urls=https://a.example/*,http://127.0.0.1:*/*",
            "--http-tool-allowed-urls",
            "https://b.example/v1/*",
        ])
        .unwrap();
        let Command::Operator(args) = cli.command else {
            panic!("not the operator")
        };
        assert_eq!(
            args.http_tool_allowed_urls,
            [
                "https://a.example/*",
                "http://127.0.0.1:*/*",
                "https://b.example/v1/*"
            ]
        );
    }

    #[test]
    fn complete_needs_exactly_one_result_source() {
        let parse = |a: &[&str]| Cli::try_parse_from(a);
        assert!(parse(&["agents", "session", "complete", "tok"]).is_err());
        assert!(parse(&["agents", "session", "complete", "tok", "--text", "x"]).is_ok());
        assert!(parse(&[
            "agents",
            "session",
            "complete",
            "tok",
            "--text",
            "x",
            "--result-file",
            "f"
        ])
        .is_err());
        assert!(parse(&["agents", "session", "complete", "tok", "result.json"]).is_ok());
        assert!(parse(&["agents", "session", "complete", "tok", "f", "--text", "x"]).is_err());
    }
}
