//! The recorded results, and the tool and runner adapters that serve
//! them: a call that matches a recorded one (same tool, same arguments,
//! the first unused in recorded order) gets the recorded result and runs
//! nothing. A call with no match gets an error result, or runs for real
//! under `--run-unmatched`.

use crate::core::envelope::CallEnvelope;
use crate::core::{SessionState, ToolCall, ToolResult, Turn};
use crate::engine::{RunKind, RunStatus, RunnerPort};
use crate::ports::{ToolPort, ToolRun};
use crate::tools::Toolbox;
use futures::future::BoxFuture;
use serde::Serialize;
use serde_json::Value;
use std::sync::Mutex;
use std::time::Duration;

pub use crate::ports::REPLAY_RUNS;

/// One recorded call and its result.
#[derive(Clone, Debug)]
pub struct RecordedCall {
    pub name: String,
    pub arguments: String,
    pub result: ToolResult,
}

/// How one call of the replay was answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Served {
    /// The recorded result of a matching call.
    Recorded,
    /// No recorded call matched; it was not run.
    Unmatched,
    /// No recorded call matched; it ran (`--run-unmatched`).
    Ran,
}

/// The recording and what the replay took of it.
pub struct Recording {
    calls: Vec<RecordedCall>,
    used: Mutex<Vec<bool>>,
    /// Every call the replay made, in order: tool, arguments, how served.
    pub log: Mutex<Vec<(String, String, Served)>>,
}

impl Recording {
    /// The results of `state`'s turns, in recorded order.
    pub fn of(state: &SessionState) -> Recording {
        let mut calls = Vec::new();
        let mut asked: Vec<ToolCall> = Vec::new();
        for turn in &state.turns {
            match turn {
                Turn::Agent(a) => asked = a.tool_calls.clone(),
                Turn::User(u) => calls.extend(u.tool_results.iter().filter_map(|r| {
                    let call = asked.iter().find(|c| c.model_call_id == r.model_call_id)?;
                    Some(RecordedCall {
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                        result: r.result.clone(),
                    })
                })),
            }
        }
        let used = Mutex::new(vec![false; calls.len()]);
        Recording {
            calls,
            used,
            log: Mutex::default(),
        }
    }

    /// The recorded result for `call`, taken so no later call gets it.
    pub fn take(&self, call: &ToolCall) -> Option<ToolResult> {
        let mut used = self.used.lock().expect("replay lock");
        let found = self.calls.iter().enumerate().find(|(i, c)| {
            !used[*i] && c.name == call.name && same_arguments(&c.arguments, &call.arguments)
        })?;
        used[found.0] = true;
        Some(found.1.result.clone())
    }

    pub fn note(&self, call: &ToolCall, served: Served) {
        self.log.lock().expect("replay lock").push((
            call.name.clone(),
            call.arguments.clone(),
            served,
        ));
    }

    /// How the latest call like `call` was served.
    pub fn last_served(&self, call: &ToolCall) -> Option<Served> {
        let log = self.log.lock().expect("replay lock");
        log.iter()
            .rev()
            .find(|(name, args, _)| *name == call.name && *args == call.arguments)
            .map(|(_, _, served)| served.clone())
    }

    /// `call`'s recorded result, if one is left.
    pub fn serve(&self, call: &ToolCall) -> Option<ToolResult> {
        match self.take(call) {
            Some(result) => {
                self.note(call, Served::Recorded);
                Some(result)
            }
            None => None,
        }
    }
}

/// Arguments compared as JSON where both parse (key order and spacing do
/// not count), else as text.
pub fn same_arguments(a: &str, b: &str) -> bool {
    match (
        serde_json::from_str::<Value>(a),
        serde_json::from_str::<Value>(b),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// The error a call without a recorded result gets when it is not run.
pub fn unmatched_result(call: &ToolCall) -> ToolResult {
    ToolResult::error(format!(
        "replay: no recorded result for {}({}); nothing was run (--run-unmatched runs it)",
        call.name, call.arguments
    ))
}

/// `runSync` tools: recorded results; unmatched calls run only with
/// `real` (the agent's own tools).
pub struct ReplayTools<'a> {
    pub recording: &'a Recording,
    pub real: Option<&'a Toolbox>,
}

impl ToolPort for ReplayTools<'_> {
    fn run<'a>(
        &'a self,
        call: &'a ToolCall,
        idempotency_key: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, ToolRun> {
        Box::pin(async move {
            if let Some(result) = self.recording.serve(call) {
                return ToolRun::Done(result);
            }
            match self.real {
                Some(tools) => {
                    self.recording.note(call, Served::Ran);
                    tools.start(call, idempotency_key, Some(timeout)).await
                }
                None => {
                    self.recording.note(call, Served::Unmatched);
                    ToolRun::Done(unmatched_result(call))
                }
            }
        })
    }

    fn served_by(&self, call: &ToolCall) -> Option<&'static str> {
        self.recording
            .last_served(call)
            .filter(|s| *s == Served::Recorded)
            .map(|_| REPLAY_RUNS)
    }
}

/// Background, isolated and sub-agent calls: recorded results too, so no
/// process, container or child session starts. Unmatched ones with
/// `--run-unmatched` run as background calls of the agent's tools.
pub struct ReplayRunner<'a> {
    pub tools: ReplayTools<'a>,
}

impl RunnerPort for ReplayRunner<'_> {
    fn start<'a>(
        &'a self,
        _kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        _attempt: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, RunStatus> {
        Box::pin(async move {
            let key = &envelope.context.idempotency_key;
            match self.tools.run(&envelope.tool_call, key, timeout).await {
                ToolRun::Done(result) => RunStatus::Finished(result),
                ToolRun::Task(task) => RunStatus::Task(task),
            }
        })
    }

    fn label(&self, _kind: RunKind<'_>) -> &'static str {
        REPLAY_RUNS
    }
}
