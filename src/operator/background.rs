//! `runAsync` in the operator: each attempt runs as a tokio task outside
//! the reconcile; its end triggers a reconcile of its Session, whose step
//! (re-issuing `start` for the call this holder claims) takes the result.
//!
//! Runs are keyed by (session UID, token, attempt): a second `start` of a
//! run under way adopts it, so no attempt runs twice in this process. After
//! a restart the map is empty: the engine sees the dead holder's claim (an
//! earlier instance of this identity), claims the call again and starts it
//! under the same idempotency key.
//!
//! A Session that is deleted (or re-created under its name, with a new UID)
//! takes its runs with it: a janitor aborts them and drops their results.
//!
//! One namespace's runs execute at most `per_namespace` at once; the rest
//! wait their turn (still in flight to the engine). Each run may hold a
//! reply of up to the reply bound, so this bounds what one tenant's
//! background work can take of the operator's memory and connections.

use crate::api::Session;
use crate::core::envelope::CallEnvelope;
use crate::core::{SessionState, ToolResult, WaitingFor};
use crate::engine::{RunKind, RunStatus, RunnerPort, ToolRun};
use crate::tools::Toolbox;
use futures::future::BoxFuture;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use tracing::{debug, info};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct RunKey {
    uid: String,
    token: String,
    attempt: u32,
}

enum Run {
    InFlight(AbortHandle),
    Finished(ToolRun),
}

fn status_of(run: &ToolRun) -> RunStatus {
    match run {
        ToolRun::Done(result) => RunStatus::Finished(result.clone()),
        ToolRun::Task(task) => RunStatus::Task(task.clone()),
    }
}

/// The operator's background runs, shared by every reconcile.
pub struct Background {
    runs: Mutex<HashMap<RunKey, Run>>,
    wake: UnboundedSender<ObjectRef<Session>>,
    /// Runs of one namespace that execute at once.
    per_namespace: usize,
    gates: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl Background {
    /// `wake` feeds `Controller::reconcile_on`.
    pub fn new(wake: UnboundedSender<ObjectRef<Session>>, per_namespace: usize) -> Self {
        Background {
            runs: Mutex::new(HashMap::new()),
            wake,
            per_namespace: per_namespace.max(1),
            gates: Mutex::default(),
        }
    }

    /// The gate of `namespace`'s runs.
    fn gate(&self, namespace: &str) -> Arc<Semaphore> {
        let mut gates = self.gates.lock().expect("gates lock");
        gates
            .entry(namespace.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_namespace)))
            .clone()
    }

    fn start(
        self: &Arc<Self>,
        session: &ObjectRef<Session>,
        uid: &str,
        tools: &Arc<Toolbox>,
        envelope: &CallEnvelope,
        attempt: u32,
        timeout: Duration,
    ) -> RunStatus {
        let key = RunKey {
            uid: uid.to_string(),
            token: envelope.token.0.clone(),
            attempt,
        };
        let mut runs = self.runs.lock().expect("runs lock");
        match runs.get(&key) {
            Some(Run::Finished(run)) => return status_of(run),
            Some(Run::InFlight(_)) => return RunStatus::InFlight,
            None => {}
        }
        let this = Arc::clone(self);
        let tools = Arc::clone(tools);
        let call = envelope.tool_call.clone();
        let idempotency_key = envelope.context.idempotency_key.clone();
        let session = session.clone();
        let task_key = key.clone();
        let gate = self.gate(session.namespace.as_deref().unwrap_or_default());
        info!(session = %session, token = %key.token, attempt, tool = %call.name, "background run started");
        let task = tokio::spawn(async move {
            // Never closed: a permit always comes, in turn.
            let _turn = gate.acquire_owned().await;
            let result = tools.start(&call, &idempotency_key, Some(timeout)).await;
            let ok = !matches!(result, ToolRun::Done(ToolResult::Error { .. }));
            this.runs
                .lock()
                .expect("runs lock")
                .insert(task_key.clone(), Run::Finished(result));
            info!(session = %session, token = %task_key.token, attempt = task_key.attempt, ok, "background run finished");
            // The step that takes the result runs at once, not at a requeue.
            let _ = this.wake.send(session);
        });
        runs.insert(key, Run::InFlight(task.abort_handle()));
        RunStatus::InFlight
    }

    /// The run's result if it has ended here; starts nothing.
    fn collect(&self, uid: &str, envelope: &CallEnvelope, attempt: u32) -> RunStatus {
        let key = RunKey {
            uid: uid.to_string(),
            token: envelope.token.0.clone(),
            attempt,
        };
        match self.runs.lock().expect("runs lock").get(&key) {
            Some(Run::Finished(run)) => status_of(run),
            _ => RunStatus::InFlight,
        }
    }

    /// Drops finished results of `uid` that its state no longer waits for
    /// (the step recorded them).
    pub fn prune(&self, uid: &str, state: &SessionState) {
        let waiting: HashSet<&str> = state
            .pending()
            .into_iter()
            .filter(|c| c.waiting_for() == Some(WaitingFor::Background))
            .filter_map(|c| c.token().map(|t| t.0.as_str()))
            .collect();
        self.runs.lock().expect("runs lock").retain(|k, run| {
            k.uid != uid || matches!(run, Run::InFlight(_)) || waiting.contains(k.token.as_str())
        });
    }

    /// Aborts and forgets the runs of sessions that no longer exist.
    pub fn sweep(&self, sessions: &Store<Session>) {
        // A run waiting at a gate or holding its permit keeps a clone of
        // it; a gate with none is made again when needed.
        self.gates
            .lock()
            .expect("gates lock")
            .retain(|_, g| Arc::strong_count(g) > 1);
        let live: HashSet<String> = sessions.state().iter().filter_map(|s| s.uid()).collect();
        let mut runs = self.runs.lock().expect("runs lock");
        runs.retain(|k, run| {
            if live.contains(&k.uid) {
                return true;
            }
            if let Run::InFlight(handle) = run {
                info!(uid = %k.uid, token = %k.token, "session deleted; its background run is stopped");
                handle.abort();
            } else {
                debug!(uid = %k.uid, token = %k.token, "session deleted; its background result is dropped");
            }
            false
        });
    }

    /// Runs in flight (for tests and logs).
    pub fn in_flight(&self) -> usize {
        self.runs
            .lock()
            .expect("runs lock")
            .values()
            .filter(|r| matches!(r, Run::InFlight(_)))
            .count()
    }
}

/// The runner port one reconcile uses: background runs for this session;
/// isolated calls are left to a worker (`agents session run-isolated
/// --store kube`) until the Job runner comes.
pub struct SessionRunner {
    pub background: Arc<Background>,
    pub session: ObjectRef<Session>,
    pub uid: String,
    pub tools: Arc<Toolbox>,
    /// Isolated calls as Jobs, in the session's namespace (none: they wait
    /// for an outside worker).
    pub jobs: Option<crate::runner::job::JobRunner>,
    /// Sub-agent calls' child Sessions.
    pub children: super::children::Children,
}

impl RunnerPort for SessionRunner {
    fn start<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, RunStatus> {
        match kind {
            RunKind::Background => {
                let status = self.background.start(
                    &self.session,
                    &self.uid,
                    &self.tools,
                    envelope,
                    attempt,
                    timeout,
                );
                Box::pin(async move { status })
            }
            RunKind::SubAgent(child) => Box::pin(self.children.start(child, &envelope.token)),
            RunKind::Isolated(spec) => match &self.jobs {
                Some(jobs) => jobs.start(kind, envelope, attempt, timeout),
                // Without a Job runner the roles exclude isolated runs;
                // should one come, it stays with whoever claims it.
                None => {
                    let _ = spec;
                    Box::pin(async { RunStatus::InFlight })
                }
            },
        }
    }

    fn collect<'a>(
        &'a self,
        kind: RunKind<'a>,
        envelope: &'a CallEnvelope,
        attempt: u32,
    ) -> BoxFuture<'a, RunStatus> {
        match (kind, &self.jobs) {
            (RunKind::SubAgent(child), _) => Box::pin(self.children.collect(child)),
            (RunKind::Background, _) => {
                let status = self.background.collect(&self.uid, envelope, attempt);
                Box::pin(async move { status })
            }
            (RunKind::Isolated(_), Some(jobs)) => jobs.collect(kind, envelope, attempt),
            (RunKind::Isolated(_), None) => Box::pin(async { RunStatus::InFlight }),
        }
    }

    fn release<'a>(&'a self, token: &'a crate::core::ContinuationToken) -> BoxFuture<'a, ()> {
        match &self.jobs {
            Some(jobs) => jobs.release(token),
            None => Box::pin(async {}),
        }
    }

    fn release_child<'a>(&'a self, token: &'a crate::core::ContinuationToken) -> BoxFuture<'a, ()> {
        Box::pin(self.children.release(token))
    }

    fn child_usage<'a>(
        &'a self,
        child: &'a crate::core::session::subagent::ChildPlan,
    ) -> BoxFuture<'a, Option<crate::core::TokenUsage>> {
        Box::pin(self.children.usage(child))
    }

    fn label(&self, kind: RunKind<'_>) -> &'static str {
        match kind {
            RunKind::Background => "runAsync",
            RunKind::Isolated(_) => "job",
            RunKind::SubAgent(_) => crate::ports::SUB_AGENT_RUNS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespaces_runs_share_one_gate_and_an_idle_gate_goes() {
        let (wake, _woken) = tokio::sync::mpsc::unbounded_channel();
        let background = Background::new(wake, 2);
        let held = background.gate("a");
        assert!(Arc::ptr_eq(&held, &background.gate("a")));
        assert_eq!(background.gate("b").available_permits(), 2);
        let (sessions, _writer) = kube::runtime::reflector::store::<Session>();
        background.sweep(&sessions);
        let gates = background.gates.lock().unwrap();
        assert!(gates.contains_key("a"), "a run holds it");
        assert!(!gates.contains_key("b"), "nobody holds it");
    }
}
