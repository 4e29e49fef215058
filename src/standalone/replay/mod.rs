//! `agents session replay`: a recorded session (an export file, or a
//! session of a store) run again, standalone, through the given agent:
//! its user messages go to the model, and each tool call is served the
//! recorded result of a matching call instead of running. The engine is
//! the usual one; only its tool and runner ports are the replay's
//! ([`served`]), over a scratch SQLite store that is removed afterwards.
//!
//! Exit codes: 0 when every agent turn made the same calls as recorded
//! (the same tools in the same order; `--strict`: the same arguments too)
//! and every call had a recorded result; [`EXIT_REPLAY_DIFFERS`] when not;
//! 1 on an error (a bad file, an agent that cannot be built).

pub mod report;
pub mod served;

use super::commands::{open, StoreSel};
use super::definition::{self, Definition, EnvSecrets, RunnableAgent};
use super::driver::{now, owner_of, runtime};
use super::export::{export_session, parse_export, SessionExport};
use crate::agent::AgentModel;
use crate::core::{SessionId, SessionState, WaitingFor};
use crate::engine::{self, Holder, Ports, Roles, StepOutcome};
use crate::ports::{Clock, ContinuationPort, Decision, SessionInput, SessionPort, SystemClock};
use crate::standalone::out;
use crate::store::sqlite::SqliteStore;
use crate::store::SessionRecord;
use anyhow::{anyhow, Context};
use served::{unmatched_result, Recording, ReplayRunner, ReplayTools, Served, REPLAY_RUNS};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Exit code of a replay that did not match the recording.
pub const EXIT_REPLAY_DIFFERS: u8 = 4;
/// Steps a replay takes at most (a model that never ends).
const MAX_STEPS: usize = 200;

#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// The agent to replay through (YAML as `agents run` takes it);
    /// default: the recorded one.
    pub agent: Option<PathBuf>,
    /// The model to replay through, in the agent's place (an Agent's
    /// `model:` section as YAML).
    pub model: Option<PathBuf>,
    pub strict: bool,
    pub run_unmatched: bool,
    pub json: bool,
}

pub async fn replay(
    source: &str,
    sel: &StoreSel,
    opts: &ReplayOptions,
) -> anyhow::Result<ExitCode> {
    let recorded = load_source(source, sel).await?;
    let id = SessionId(recorded.source.name.clone());
    let mut def = match &opts.agent {
        Some(file) => definition::load_file(file)?,
        None => recorded.definition.clone(),
    };
    if let Some(file) = &opts.model {
        def.agent.model = definition::load_model_file(file)?;
    }
    let agent = def
        .build(now(), &EnvSecrets)
        .map_err(|e| anyhow!("the replay's agent: {e}"))?;
    let scratch = Scratch::new()?;
    scratch
        .store
        .create_session(record(&recorded, &id, def))
        .await?;
    let recording = Recording::of(&recorded.state);
    let state = run(&scratch.store, &agent, &id, &recording, opts.run_unmatched).await?;
    let log = recording.log.lock().expect("replay lock").clone();
    let report = report::compare(&recorded.state, &state, &log, opts.strict);
    if opts.json {
        out::line(&serde_json::to_string(&report)?);
    } else {
        out::text(&report::text(&report));
    }
    Ok(match report.passed {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(EXIT_REPLAY_DIFFERS),
    })
}

/// An export file when `source` names one, else a session of the store.
async fn load_source(source: &str, sel: &StoreSel) -> anyhow::Result<SessionExport> {
    let path = Path::new(source);
    if path.is_file() {
        let text = crate::host::read_named_file(path, crate::standalone::export::MAX_EXPORT_BYTES)
            .with_context(|| format!("reading {source}"))?;
        return parse_export(&text, source);
    }
    crate::core::ids::validate_name("session", source)
        .map_err(|e| anyhow!("{source} is neither an export file nor a session name: {e}"))?;
    let store = open(sel).await?;
    export_session(store.as_ref(), &SessionId(source.into()), "").await
}

/// The replay's session: the recorded user messages, the given agent.
fn record(recorded: &SessionExport, id: &SessionId, mut def: Definition) -> SessionRecord {
    def.session = id.0.clone();
    def.spec.messages = recorded.input.messages.clone();
    let t = now();
    SessionRecord {
        state: SessionState::new(id.clone()),
        input: SessionInput {
            messages: recorded.input.messages.clone(),
            paused: false,
            retry: 0,
        },
        namespace: String::new(),
        uid: uuid::Uuid::new_v4().to_string(),
        definition: serde_json::to_value(&def).expect("a definition serialises"),
        created_at: t,
        updated_at: t,
        trace: None,
    }
}

/// Steps the replay until it ends, answering its waits from the
/// recording; its state at the end.
async fn run(
    store: &SqliteStore,
    agent: &RunnableAgent,
    id: &SessionId,
    recording: &Recording,
    run_unmatched: bool,
) -> anyhow::Result<SessionState> {
    let rt = runtime(agent);
    let holder = Holder::named(REPLAY_RUNS);
    let model = AgentModel(&agent.model);
    let real = run_unmatched.then_some(&agent.toolbox);
    let tools = ReplayTools { recording, real };
    let runner = ReplayRunner {
        tools: ReplayTools { recording, real },
    };
    let quiet = |_: &crate::engine::Progress| {};
    let ports = Ports::over_store(store, &model, &tools, &runner, &quiet)
        .traced(crate::telemetry::tracer());
    for _ in 0..MAX_STEPS {
        let step = engine::step(&ports, id, &rt, &holder, Roles::ALL).await?;
        match step.outcome {
            StepOutcome::Busy { at } => {
                let soon = crate::core::Millis(SystemClock.now().0 + 1000);
                SystemClock.sleep_until(at.min(soon)).await;
            }
            StepOutcome::Waiting { .. } if answer_waits(store, id, recording).await? => {}
            _ => return Ok(step.state),
        }
    }
    Err(anyhow!("the replay took {MAX_STEPS} steps without ending"))
}

/// Answers what the replay waits for: approvals are given, outside
/// results served from the recording. False when nothing was answered.
async fn answer_waits(
    store: &SqliteStore,
    id: &SessionId,
    recording: &Recording,
) -> anyhow::Result<bool> {
    let loaded = SessionPort::load(store, id)
        .await?
        .ok_or_else(|| anyhow!("the replay's session went missing"))?;
    let open = store.list_for(&owner_of(&loaded.value)).await?;
    let mut answered = false;
    for c in open.iter().filter(|c| !c.is_completed()) {
        let token = &c.spec.token;
        if c.spec.waiting_for == WaitingFor::Approval && c.decision.is_none() {
            let decision = Decision {
                approved: true,
                by: REPLAY_RUNS.into(),
                reason: None,
                at: now(),
                arguments: None,
                raise: None,
            };
            store.decide(token, &decision).await?;
        } else {
            let call = &c.spec.tool_call;
            let result = recording.serve(call).unwrap_or_else(|| {
                recording.note(call, Served::Unmatched);
                unmatched_result(call)
            });
            store.complete(token, &result, REPLAY_RUNS, now()).await?;
        }
        answered = true;
    }
    Ok(answered)
}

/// The replay's own store, removed when the replay ends.
struct Scratch {
    path: PathBuf,
    store: SqliteStore,
}

impl Scratch {
    fn new() -> anyhow::Result<Scratch> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!("agents-replay-{}-{nanos}.db", std::process::id());
        let path = std::env::temp_dir().join(name);
        let store = SqliteStore::open(&path)?;
        Ok(Scratch { path, store })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}
