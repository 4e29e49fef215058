//! What `agents run` and `agents session ...` do against a store. The CLI
//! parses flags and calls these; each returns the process exit code.

use super::any_store::{load_agent, with_mcp_tools, AnyStore};
use super::children::{self, StoredDefinition};
use super::definition::{self, Definition};
use super::driver::{self, drive, now, preview, sync_input, DriveOptions, Outcome};
use super::patience;
use super::progress::{waiting_for_text, PendingCall, Progress};
use crate::agent::RunnableAgent;
use crate::api::continuation::MAX_ANSWERS_BYTES;
use crate::core::budget::Raise;
use crate::core::envelope::ResultEnvelope;
use crate::core::{
    ContinuationToken, Phase, SessionId, SessionState, ToolResponse, ToolResult, Turn, WaitingFor,
};
use crate::engine::Roles;
use crate::ports::{AdminPort, Versioned};
use crate::runner::ProcessRunner;
use crate::standalone::out;
use crate::standalone::progress::shell_quote;
use crate::standalone::progress::Render;
use crate::store::kube::KubeStore;
use crate::store::sqlite::SqliteStore;
use crate::store::{Decision, SessionInput, SessionRecord, StoreError, WriteOnce};
use anyhow::{anyhow, bail, Context};
use std::path::Path;
use std::process::ExitCode;

/// Exit code when a result was refused because another one was recorded first.
pub const EXIT_ALREADY_COMPLETED: u8 = 3;

/// Where output goes and in which form.
#[derive(Clone, Copy, Debug, Default)]
pub struct Output {
    pub json: bool,
}

impl Output {
    pub fn emit(&self, p: &Progress) {
        p.emit(self.json)
    }
}

/// Which store a command works on: `--store`, and `-n` for the cluster.
#[derive(Clone, Debug, Default)]
pub struct StoreSel {
    pub url: String,
    pub namespace: Option<String>,
}

impl StoreSel {
    pub fn new(url: &str, namespace: Option<&str>) -> Self {
        StoreSel {
            url: url.to_string(),
            namespace: namespace.map(str::to_string),
        }
    }
}

/// Opens the embedded store named by `--store` (`agents run`).
pub fn open_store(url: &str) -> anyhow::Result<SqliteStore> {
    if let Some(path) = url.strip_prefix("sqlite:") {
        if path.is_empty() {
            bail!("--store sqlite: needs a path, e.g. sqlite:./agents.db");
        }
        return Ok(SqliteStore::open(path)?);
    }
    if url == "kube" {
        bail!("`agents run` drives a session on the embedded store; in a cluster, `kubectl apply -f FILE` and the operator runs it (`agents session ... --store kube` follows it)");
    }
    bail!("unknown store {url:?}; use sqlite:PATH (embedded) or kube (the cluster)")
}

/// Opens the store named by `--store` and `-n`.
pub async fn open(sel: &StoreSel) -> anyhow::Result<AnyStore> {
    if sel.url == "kube" {
        return Ok(Box::new(
            KubeStore::from_kubeconfig(sel.namespace.as_deref()).await?,
        ));
    }
    Ok(Box::new(open_store(&sel.url)?))
}

/// `--store` (and `-n`) as typed again in hints; empty for the default.
pub(super) fn store_flag(sel: &StoreSel) -> String {
    let mut flag = if sel.url == "sqlite:./agents.db" {
        String::new()
    } else {
        format!("--store {}", shell_quote(&sel.url))
    };
    if let (true, Some(ns)) = (sel.url == "kube", &sel.namespace) {
        flag.push_str(&format!(" -n {}", shell_quote(ns)));
    }
    flag
}

/// `agents run` and `resume` leave isolated calls to a worker
/// (`agents session run-isolated`).
pub(super) fn options(sel: &StoreSel) -> DriveOptions {
    DriveOptions {
        roles: Some(Roles {
            model: true,
            background: true,
            isolated: false,
        }),
        runner: ProcessRunner::default(),
        container: Default::default(),
        store_flag: store_flag(sel),
        held_by: Vec::new(),
    }
}

pub(super) fn exit_for(outcome: &Outcome) -> ExitCode {
    match outcome {
        Outcome::Failed { .. } => ExitCode::FAILURE,
        _ => ExitCode::SUCCESS,
    }
}

/// `agents run -f FILE`: create (or continue) the session and drive it.
pub async fn run_file(path: &Path, store_url: &str, out: Output) -> anyhow::Result<ExitCode> {
    let (def, sub_agents) = definition::load_file_with_agents(path)?;
    let store = open_store(store_url)?;
    let id = def.session_id();
    let stored = StoredDefinition {
        definition: def,
        sub_agents,
    };
    let agent = match store.load_session(&id).await? {
        None => create_from_file(&store, path, &stored).await?,
        Some(existing) => continue_from_file(&store, store_url, path, &stored, existing).await?,
    };
    let sel = StoreSel::new(store_url, None);
    let outcome = drive(&store, &agent, &id, &options(&sel), &|p| out.emit(p)).await?;
    Ok(exit_for(&outcome))
}

/// A new session from `def`, its MCP servers listed before anything is
/// stored.
async fn create_from_file(
    store: &SqliteStore,
    path: &Path,
    stored: &StoredDefinition,
) -> anyhow::Result<RunnableAgent> {
    let def = &stored.definition;
    let t = now();
    let agent = with_mcp_tools(
        def.build(t, &definition::EnvSecrets)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?,
    )
    .await?;
    let messages = &def.spec.messages;
    if let Some(i) = messages.iter().position(|m| m.trim().is_empty()) {
        bail!(
            "{}: spec.messages[{i}] is empty; send some text",
            path.display()
        );
    }
    // The messages go in with the creation; the engine takes them in.
    let record = SessionRecord {
        state: SessionState::new(def.session_id()),
        input: SessionInput {
            messages: messages.clone(),
            paused: def.spec.paused,
            retry: 0,
        },
        namespace: String::new(),
        uid: uuid::Uuid::new_v4().to_string(),
        definition: stored.to_value(),
        created_at: t,
        updated_at: t,
        trace: None,
    };
    match store.create_session(record).await {
        Ok(_) | Err(StoreError::SessionExists(_)) => Ok(agent),
        Err(e) => Err(e.into()),
    }
}

/// The stored session `def` names: the same agent, and messages that only
/// grow (new ones are stored with the definition that lists them).
async fn continue_from_file(
    store: &SqliteStore,
    store_url: &str,
    path: &Path,
    new: &StoredDefinition,
    existing: Versioned<SessionRecord>,
) -> anyhow::Result<RunnableAgent> {
    let def = &new.definition;
    let id = def.session_id();
    let stored: Definition = serde_json::from_value(existing.value.definition.clone())
        .map_err(|e| anyhow!("session {id}: its stored definition cannot be read: {e}"))?;
    if stored.agent != def.agent || stored.agent_name != def.agent_name {
        bail!(
            "session {id} already exists in {store_url} with a different agent; give this one another metadata.name, or continue the stored one with `agents session resume {id}`"
        );
    }
    if !def
        .spec
        .messages
        .starts_with(&existing.value.input.messages)
    {
        bail!("session {id}: spec.messages is append-only; the file drops or changes messages the stored session already has");
    }
    let agent = with_mcp_tools(
        def.build(existing.value.created_at, &definition::EnvSecrets)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?,
    )
    .await?;
    if def.spec.messages.len() > existing.value.input.messages.len() {
        let mut record = existing.value.clone();
        record.input.messages = def.spec.messages.clone();
        record.definition = new.to_value();
        record.updated_at = now();
        store
            .save_session(&record, &existing.version)
            .await
            .context("adding the new messages")?;
    }
    Ok(agent)
}

pub async fn resume(session: &str, sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let id = SessionId(session.to_string());
    let (_, _, agent) = load_agent(store.as_ref(), &id).await?;
    let agent = stepping(store.as_ref(), agent).await?;
    store.change_input(&id, &|i| i.paused = false).await?;
    if store.operator_driven() {
        out::line(&format!(
            "session {id} resumed (spec.paused is false); the operator drives it on"
        ));
        return Ok(ExitCode::SUCCESS);
    }
    let outcome = drive(store.as_ref(), &agent, &id, &options(sel), &|p| out.emit(p)).await?;
    Ok(exit_for(&outcome))
}

/// The agent as this process steps it: with its MCP servers' tools, unless
/// the operator steps the session (it lists them itself).
async fn stepping(
    store: &dyn crate::ports::AdminPort,
    agent: definition::RunnableAgent,
) -> anyhow::Result<definition::RunnableAgent> {
    if store.operator_driven() {
        return Ok(agent);
    }
    with_mcp_tools(agent).await
}

/// `agents session retry`: a session that failed (its model kept failing,
/// say) runs again from its last checkpoint.
pub async fn retry(session: &str, sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let id = SessionId(session.to_string());
    let (record, _, agent) = load_agent(store.as_ref(), &id).await?;
    if record.state.phase != Phase::Failed {
        bail!(
            "session {id} has not failed (it is {:?}); only a failed session can be retried",
            record.state.phase
        );
    }
    let agent = stepping(store.as_ref(), agent).await?;
    let retry = record.state.retries_taken + 1;
    store.change_input(&id, &move |i| i.retry = retry).await?;
    if store.operator_driven() {
        out::line(&format!(
            "session {id} retries (spec.retry is {}); the operator runs it again from its last checkpoint",
            record.state.retries_taken + 1
        ));
        return Ok(ExitCode::SUCCESS);
    }
    let outcome = drive(store.as_ref(), &agent, &id, &options(sel), &|p| out.emit(p)).await?;
    Ok(exit_for(&outcome))
}

pub async fn pause(session: &str, sel: &StoreSel) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let id = SessionId(session.to_string());
    let (_, _, agent) = load_agent(store.as_ref(), &id).await?;
    store.change_input(&id, &|i| i.paused = true).await?;
    if store.operator_driven() {
        let flag = store_flag(sel);
        out::line(&format!(
            "session {id} paused (spec.paused); the operator stops it after the current step; no model or tool call starts until `agents session resume {id} {flag}`"
        ));
        return Ok(ExitCode::SUCCESS);
    }
    sync_input(store.as_ref(), &agent, &id).await?;
    out::line(&format!(
        "session {id} paused; no model or tool call starts until `agents session resume {id}`"
    ));
    Ok(ExitCode::SUCCESS)
}

pub async fn list(sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let sessions = store.list().await?;
    if out.json {
        out::line(&serde_json::to_string(&sessions)?);
        return Ok(ExitCode::SUCCESS);
    }
    out::line(&format!(
        "{:<32} {:<14} {:>7} PAUSED",
        "SESSION", "PHASE", "PENDING"
    ));
    for s in sessions {
        out::line(&format!(
            "{:<32} {:<14} {:>7} {}",
            s.id.0,
            format!("{:?}", s.phase),
            s.pending,
            if s.paused { "yes" } else { "" }
        ));
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn show(session: &str, sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let id = SessionId(session.to_string());
    let (record, _, agent) = load_agent(store.as_ref(), &id).await?;
    // Show what the session will see: results recorded but not yet applied.
    let state = preview(store.as_ref(), &agent, &id).await?;
    if out.json {
        let continuations = store.list_for(&driver::owner_of(&record)).await?;
        out::line(&format!(
            "{}",
            serde_json::json!({"session": state, "continuations": continuations})
        ));
        return Ok(ExitCode::SUCCESS);
    }
    out::line(&format!(
        "session {id}: {:?}{}",
        state.phase,
        if state.paused { " (paused)" } else { "" }
    ));
    print_conversation(&state);
    let spend = crate::core::budget::Spend {
        usage: state.usage,
        tool_calls: state.tool_calls,
    };
    let currency = agent.config.pricing.as_ref().map(|p| p.currency.as_str());
    out::line(&format!(
        "spend: {}",
        crate::core::budget::spend_text(&spend, currency)
    ));
    if let Some(stop) = &state.budget_stop {
        out::line(&format!("held: {}", stop.message));
    }
    if let Some(ask) = &state.budget_ask {
        out::line(&format!("asks ({}): {}", ask.token, ask.stop.message));
    }
    if let Some(answer) = &state.answer {
        out::line(&format!("answer: {answer}"));
    }
    if let Some(reason) = &state.failure {
        out::line(&format!("failure: {reason}"));
    }
    Ok(ExitCode::SUCCESS)
}

fn print_conversation(state: &SessionState) {
    let mut agent_turn = 0;
    for turn in &state.turns {
        match turn {
            Turn::User(u) => {
                for r in &u.tool_results {
                    out::line(&format!(
                        "  result {} {}: {}",
                        r.call_id,
                        r.tool,
                        r.result.to_model_text().replace('\n', " ⏎ ")
                    ));
                }
                if let Some(m) = &u.message {
                    out::line(&format!("user: {m}"));
                }
            }
            Turn::Agent(a) => {
                agent_turn += 1;
                out::line(&format!(
                    "agent (turn {agent_turn}): {}",
                    a.text.as_deref().unwrap_or("")
                ));
                for (i, c) in a.tool_calls.iter().enumerate() {
                    out::line(&format!(
                        "  call t{agent_turn}-c{i} {}({})",
                        c.name, c.arguments
                    ));
                }
            }
        }
    }
    for c in state.open.iter().flat_map(|o| o.calls.iter()) {
        let what = match (c.result(), c.waiting_for()) {
            (Some(r), _) => format!("done: {}", r.to_model_text().replace('\n', " ⏎ ")),
            (None, Some(w)) => format!("waits for {}", waiting_for_text(w)),
            (None, None) => format!("{:?}", c.state()),
        };
        out::line(&format!(
            "  open {} {} [{}] {what}",
            c.id,
            c.call.name,
            c.policy.disposition.name()
        ));
    }
}

/// The calls of session `id` that wait on someone else (in `sel`), as
/// `pending` lists them, with the session's record.
pub async fn session_waits(
    store: &dyn AdminPort,
    id: &SessionId,
    sel: &StoreSel,
) -> anyhow::Result<(SessionRecord, Vec<PendingCall>)> {
    let (record, _, agent) = load_agent(store, id).await?;
    let records = store.list_for(&driver::owner_of(&record)).await?;
    let state = preview(store, &agent, id).await?;
    let opts = options(sel);
    let waiting = driver::pending_calls(&state, &opts, opts.roles.unwrap_or(Roles::ALL));
    // A call completed in its continuation but not yet resumed is not pending.
    let waiting = waiting
        .into_iter()
        .filter(|p| {
            !records
                .iter()
                .any(|r| r.spec.token.0 == p.token && r.is_completed())
        })
        .collect();
    Ok((record, waiting))
}

/// One wait as `pending` prints it: token, tool and call (then `after`),
/// what it waits for, and the command that answers it.
pub fn wait_line(p: &PendingCall, after: &str) -> String {
    format!(
        "{}  {} ({}){after} waits for {}{}\n  $ {}",
        p.token,
        p.tool,
        p.call,
        p.waiting_for.map(waiting_for_text).unwrap_or("?"),
        p.reason
            .as_ref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default(),
        p.command
    )
}

pub async fn pending(session: &str, sel: &StoreSel, out: Output) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let id = SessionId(session.to_string());
    let (record, mut waiting) = session_waits(store.as_ref(), &id, sel).await?;
    // And the waits of its sub-agent sessions, with their paths.
    let opts = options(sel);
    let roles = opts.roles.unwrap_or(Roles::ALL);
    waiting.extend(children::waits_below(store.as_ref(), &id, &opts, roles).await?);
    if out.json {
        out::line(&serde_json::to_string(&waiting)?);
        return Ok(ExitCode::SUCCESS);
    }
    if waiting.is_empty() {
        out::line(&format!(
            "session {id} has no pending calls ({:?})",
            record.state.phase
        ));
    }
    for p in waiting {
        let path = if p.path.is_empty() {
            String::new()
        } else {
            format!(" in {}", p.path.join(" > "))
        };
        out::line(&wait_line(&p, &path));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads a result: a result envelope, a tool response as JSON, or plain text.
pub fn parse_result(
    text: &str,
    token: &ContinuationToken,
    error: bool,
) -> anyhow::Result<ToolResult> {
    if error {
        return Ok(ToolResult::error(text.trim_end()));
    }
    let trimmed = text.trim();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        // Results are written once: a JSON document with a typo must not
        // be stored as text by mistake.
        let v = serde_json::from_str::<serde_json::Value>(trimmed).map_err(|e| {
            anyhow!(
                "the result starts like JSON but is not valid JSON ({e}); fix it, or send text that starts with a brace as a tool response: {{\"type\":\"text\",\"content\":\"...\"}}"
            )
        })?;
        if v.get("version").is_some() && v.get("status").is_some() {
            return Ok(ResultEnvelope::parse_for(trimmed, token)?);
        }
        if v.get("type").is_some() {
            let response: ToolResponse = serde_json::from_value(v)
                .context("the result looks like a tool response but is not one")?;
            return Ok(ToolResult::ok(response));
        }
    }
    Ok(ToolResult::text(text.trim_end()))
}

/// Opens the store and the continuation behind `token`, or says the token is unknown.
async fn open_continuation(
    sel: &StoreSel,
    token: &str,
) -> anyhow::Result<(
    AnyStore,
    ContinuationToken,
    crate::store::ContinuationRecord,
)> {
    let store = open(sel).await?;
    let token = ContinuationToken(token.to_string());
    let record = find_continuation(store.as_ref(), &token).await?;
    Ok((store, token, record))
}

/// How long a token the operator has not created yet is waited for: the
/// operator commits a wait to the session's status first and creates its
/// continuation right after, so a person (or script) acting on the status
/// can be a moment early.
const NOT_CREATED_YET: std::time::Duration = std::time::Duration::from_secs(8);

/// The continuation behind `token`, or an error saying the token is unknown.
async fn find_continuation(
    store: &dyn AdminPort,
    token: &ContinuationToken,
) -> anyhow::Result<crate::store::ContinuationRecord> {
    let mut record = store.continuation(token).await?;
    if record.is_none() && store.operator_driven() {
        let deadline = std::time::Instant::now() + NOT_CREATED_YET;
        while record.is_none() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            record = store.continuation(token).await?;
        }
    }
    match record {
        Some(r) => Ok(r),
        None if store.operator_driven() => bail!(
            "no continuation with token {token} {} (waited {} s in case the operator was about to create it); `agents session pending SESSION --store kube` (or `kubectl get continuations`) lists the open ones",
            store.place(),
            NOT_CREATED_YET.as_secs()
        ),
        None => Err(StoreError::UnknownToken(token.clone()).into()),
    }
}

/// After an approval under a quorum: how many approvals the call has and
/// needs, while it still waits for more.
async fn quorum_pending(
    store: &AnyStore,
    token: &ContinuationToken,
    approved: bool,
) -> anyhow::Result<Option<String>> {
    let Some(record) = store.continuation(token).await? else {
        return Ok(None);
    };
    let quorum = record
        .spec
        .policy
        .decorators
        .approval_policy
        .as_ref()
        .map_or(1, |p| p.quorum);
    if !approved || quorum <= 1 || record.decision.is_some() {
        return Ok(None);
    }
    Ok(Some(format!(
        "your approval is recorded; {token} needs {quorum} different approvers and waits for the others"
    )))
}

/// Edited arguments are taken only where the call's policy allows edits,
/// and only as a JSON object.
fn check_edit(record: &crate::store::ContinuationRecord, args: &str) -> anyhow::Result<()> {
    match crate::core::acceptance::edit_refusal(&record.spec.policy, args) {
        Some(why) => bail!("{}: {why}", record.token()),
        None => Ok(()),
    }
}

/// The name a decision or result is signed with: `--by`, else who the
/// store says the user is.
async fn signer(store: &AnyStore, by: Option<&str>) -> anyhow::Result<String> {
    match by {
        Some(by) => Ok(by.to_string()),
        None => Ok(store.identity().await?),
    }
}

/// `agents session complete TOKEN`: tried again while the cluster is away
/// for a moment ([`patience`]).
pub async fn complete(
    token: &str,
    result: ToolResult,
    by: Option<&str>,
    sel: &StoreSel,
) -> anyhow::Result<ExitCode> {
    patience::patiently("the result", || complete_once(token, &result, by, sel)).await
}

async fn complete_once(
    token: &str,
    result: &ToolResult,
    by: Option<&str>,
    sel: &StoreSel,
) -> anyhow::Result<ExitCode> {
    let (store, token, record) = open_continuation(sel, token).await?;
    let by = &signer(&store, by).await?;
    if record.spec.waiting_for == WaitingFor::Approval && record.decision.is_none() {
        bail!("{token} waits for an approval, not a result; use `agents session approve {token}` or `agents session deny {token}`");
    }
    let session = record.spec.session.clone();
    match store.complete(&token, result, by, now()).await? {
        WriteOnce::Recorded => {
            out::line(&format!(
                "completed {token} ({})",
                record.spec.tool_call.name
            ));
            print_next_step(&store, &session, sel).await?;
            Ok(ExitCode::SUCCESS)
        }
        WriteOnce::AlreadySame { by, .. } => {
            out::line(&format!(
                "{token} was already completed by {by} with this same result; nothing changed"
            ));
            Ok(ExitCode::SUCCESS)
        }
        WriteOnce::AlreadyDifferent { by, at } => {
            out::err_line(&format!(
                "error: {token} is already completed (by {by} at {}); its result cannot change, this one was not recorded",
                at.utc()
            ));
            Ok(ExitCode::from(EXIT_ALREADY_COMPLETED))
        }
    }
}

pub async fn answer(
    token: &str,
    answers: &str,
    by: Option<&str>,
    sel: &StoreSel,
) -> anyhow::Result<ExitCode> {
    let compact = compact_answers(answers)?;
    let store = open(sel).await?;
    let by = &signer(&store, by).await?;
    let token = ContinuationToken(token.to_string());
    let record = record_answers(store.as_ref(), &token, &compact, by).await?;
    let next = if store.operator_driven() {
        "the operator hands them to the MCP server at its next poll".to_string()
    } else {
        format!(
            "`agents session resume {}` hands them to the MCP server",
            record.spec.session
        )
    };
    out::line(&format!(
        "answered {token} ({}); {next}",
        record.spec.tool_call.name
    ));
    Ok(ExitCode::SUCCESS)
}

/// The answers to an MCP task's request for input, checked and made
/// compact: a non-empty JSON object within the size the CRD takes. Shared
/// by `agents session answer` and the console (`agents ui`).
pub fn compact_answers(answers: &str) -> anyhow::Result<String> {
    let parsed: serde_json::Value = serde_json::from_str(answers).map_err(|e| {
        anyhow::anyhow!("the answers are not JSON ({e}); give an inputResponses object, e.g. '{{\"q1\": {{\"action\": \"accept\", \"content\": {{\"ok\": true}}}}}}'")
    })?;
    if !parsed.is_object() || parsed.as_object().is_some_and(|o| o.is_empty()) {
        bail!("the answers must be a JSON object with one entry per key the task asks under (see `agents session show`)");
    }
    let compact = parsed.to_string();
    if compact.len() > MAX_ANSWERS_BYTES {
        bail!(
            "the answers hold {} bytes; at most {MAX_ANSWERS_BYTES} are taken",
            compact.len()
        );
    }
    Ok(compact)
}

/// Records `compact` answers (see [`compact_answers`]) to the MCP task of
/// the open call `token`, signed `by`: the one path by which the CLI and
/// the console answer. Returns the continuation as it was before.
pub async fn record_answers(
    store: &dyn AdminPort,
    token: &ContinuationToken,
    compact: &str,
    by: &str,
) -> anyhow::Result<crate::store::ContinuationRecord> {
    let record = find_continuation(store, token).await?;
    if record.spec.waiting_for != WaitingFor::McpTask {
        bail!("{token} does not wait on an MCP task; answers go to a task that asks for input (its call waits for mcpTask)");
    }
    if record.is_completed() {
        bail!("{token} is already completed; its task needs no more input");
    }
    store.answer_task(token, compact, by, now()).await?;
    Ok(record)
}

async fn print_next_step(
    store: &AnyStore,
    session: &SessionId,
    sel: &StoreSel,
) -> anyhow::Result<()> {
    let records = match store.continuations_of(session).await {
        Ok(r) => r,
        // In a cluster a completer's Role may not list them: no hint then.
        Err(_) if store.operator_driven() => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let open = records
        .into_iter()
        .filter(|r| !r.is_completed() && r.decision.is_none())
        .count();
    let flag = store_flag(sel);
    let flag = if flag.is_empty() {
        flag
    } else {
        format!(" {flag}")
    };
    if open == 0 && store.operator_driven() {
        out::line(&format!(
            "no call of session {session} waits any more; the operator takes it on (kubectl get session {session} -w)"
        ));
    } else if open == 0 {
        // A sub-agent session runs on with its tree: resume the root.
        let root = children::root_of(store.as_ref(), session).await;
        out::line(&format!(
            "no call of session {session} waits any more: agents session resume {root}{flag}"
        ));
    } else {
        out::line(&format!("{open} call(s) of session {session} still wait (agents session pending {session}{flag})"));
    }
    Ok(())
}

/// `agents session approve|deny TOKEN`: tried again while the cluster is
/// away for a moment ([`patience`]).
pub async fn decide(
    token: &str,
    approved: bool,
    reason: Option<String>,
    by: Option<&str>,
    (arguments, raise): (Option<String>, Option<Raise>),
    sel: &StoreSel,
) -> anyhow::Result<ExitCode> {
    patience::patiently("the decision", || {
        decide_once(
            token,
            approved,
            reason.clone(),
            by,
            (arguments.clone(), raise),
            sel,
        )
    })
    .await
}

async fn decide_once(
    token: &str,
    approved: bool,
    reason: Option<String>,
    by: Option<&str>,
    (arguments, raise): (Option<String>, Option<Raise>),
    sel: &StoreSel,
) -> anyhow::Result<ExitCode> {
    let (store, token, record) = open_continuation(sel, token).await?;
    let by = &signer(&store, by).await?;
    if let Some(args) = &arguments {
        check_edit(&record, args)?;
    }
    super::budget_ask::check_raise(&record, approved, raise.as_ref())?;
    let asks_a_person = matches!(
        record.spec.waiting_for,
        WaitingFor::Approval | WaitingFor::Budget
    );
    if !asks_a_person && record.decision.is_none() {
        bail!(
            "{token} does not wait for an approval (it waits for {}); complete it with `agents session complete {token}`",
            waiting_for_text(record.spec.waiting_for)
        );
    }
    let decision = Decision {
        approved,
        by: by.to_string(),
        reason,
        at: now(),
        arguments,
        raise,
    };
    let word = if approved { "approved" } else { "denied" };
    match store.decide(&token, &decision).await? {
        WriteOnce::Recorded => {
            out::line(&format!("{word} {token} ({})", record.spec.tool_call.name));
            let session = &record.spec.session;
            let flag = store_flag(sel);
            if let Some(waiting) = quorum_pending(&store, &token, approved).await? {
                out::line(&waiting);
                return Ok(ExitCode::SUCCESS);
            }
            if store.operator_driven() {
                out::line("the operator acts on it");
                return Ok(ExitCode::SUCCESS);
            }
            let root = children::root_of(store.as_ref(), session).await;
            out::line(&format!(
                "it takes effect when the session runs: agents session resume {root}{}",
                if flag.is_empty() {
                    flag
                } else {
                    format!(" {flag}")
                }
            ));
            Ok(ExitCode::SUCCESS)
        }
        WriteOnce::AlreadySame { by, .. } => {
            out::line(&format!(
                "{token} was already {word} by {by}; nothing changed"
            ));
            Ok(ExitCode::SUCCESS)
        }
        WriteOnce::AlreadyDifferent { by, .. } => {
            out::err_line(&format!("error: {token} was already decided the other way by {by}; a decision cannot change"));
            Ok(ExitCode::from(EXIT_ALREADY_COMPLETED))
        }
    }
}

/// `agents session run-again TOKEN`: the answer "run it again" to a call
/// whose outcome is unknown (`waitingFor: outcome`). It is recorded as an
/// approving decision, which on such a wait means: send the call again,
/// under its same idempotency key.
pub async fn run_again(token: &str, by: Option<&str>, sel: &StoreSel) -> anyhow::Result<ExitCode> {
    let (store, token, record) = open_continuation(sel, token).await?;
    let by = &signer(&store, by).await?;
    if record.spec.waiting_for != WaitingFor::Outcome {
        bail!(
            "{token} does not wait for a person to tell an unknown outcome (it waits for {}); only such a call can be run again by hand",
            waiting_for_text(record.spec.waiting_for)
        );
    }
    if let Some(d) = &record.decision {
        bail!(
            "{token} already holds a decision (by {}, an approval of the call before it ran), and a decision is written once; complete it with the real result instead (`agents session complete {token}`), or with --error to tell the model it did not run",
            d.by
        );
    }
    let decision = Decision {
        approved: true,
        by: by.to_string(),
        reason: Some("run again".into()),
        at: now(),
        arguments: None,
        raise: None,
    };
    match store.decide(&token, &decision).await? {
        WriteOnce::Recorded | WriteOnce::AlreadySame { .. } => {
            out::line(&format!(
                "{token} ({}) runs again under its same idempotency key",
                record.spec.tool_call.name
            ));
            print_next_step(&store, &record.spec.session, sel).await?;
            Ok(ExitCode::SUCCESS)
        }
        WriteOnce::AlreadyDifferent { by, .. } => {
            out::err_line(&format!("error: {token} was already decided the other way by {by}; a decision cannot change"));
            Ok(ExitCode::from(EXIT_ALREADY_COMPLETED))
        }
    }
}

/// `agents session run-isolated SESSION`: an external worker. Steps the
/// session with the process runner, starting isolated runs only: each is
/// claimed before it starts, so workers racing on one session run each
/// call once; the policy's retries apply through the core.
pub async fn run_isolated(
    session: &str,
    timeout_seconds: u64,
    container_engine: Option<String>,
    sel: &StoreSel,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let store = open(sel).await?;
    let id = SessionId(session.to_string());
    let (record, _, mut agent) = load_agent(store.as_ref(), &id).await?;
    let records = store.list_for(&driver::owner_of(&record)).await?;
    if driver::isolated_work(&records).is_empty() {
        out::line(&format!("session {id} has no isolated call waiting to run"));
        return Ok(ExitCode::SUCCESS);
    }
    agent.config.default_tool_timeout_secs = timeout_seconds;
    let opts = DriveOptions {
        roles: Some(Roles {
            model: false,
            background: false,
            isolated: true,
        }),
        runner: ProcessRunner::default(),
        container: crate::runner::container::ContainerRunner::with_engine(container_engine),
        store_flag: store_flag(sel),
        held_by: Vec::new(),
    };
    let quiet_yield = |p: &Progress| {
        if !matches!(p, Progress::Yielded { .. }) {
            out.emit(p)
        }
    };
    drive(store.as_ref(), &agent, &id, &opts, &quiet_yield).await?;
    if !out.json {
        print_next_step(&store, &id, sel).await?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Used by tests and the benchmark: the phase of a stored session.
pub async fn phase_of(store: &dyn AdminPort, id: &SessionId) -> anyhow::Result<Phase> {
    Ok(store
        .load(id)
        .await?
        .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?
        .value
        .state
        .phase)
}
