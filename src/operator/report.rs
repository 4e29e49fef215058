//! The report stage of a reconcile, pure: what a step's result tells the
//! outside. The conditions (with their transition times), the Events, the
//! metrics and when to look again are decided here; the store applies the
//! conditions with its status writes, the Event sink writes the Events.
//! The Session and the Agent controllers both report through it.

use super::events;
use crate::core::conditions::{self, Condition, Status};
use crate::core::{Millis, SessionState, WaitingFor};
use crate::engine::{Progress, Provenance, StepOutcome};
use crate::observe::{Metrics, TOOL_COMPLETED, TOOL_DEFERRED, TOOL_FAILED};
use crate::ports::StatusReport;
use kube::runtime::controller::Action;
use kube::runtime::events::Event;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// A session waiting only on the outside is looked at again after this
/// long even without a watch event (deadlines come from the engine).
pub const IDLE_RECHECK: Duration = Duration::from_secs(300);

/// The operator's `Ready` condition: whether the session's agent resolved
/// and is valid.
pub fn ready(status: Status, reason: &str, message: String) -> Condition {
    Condition::new("Ready", status, reason, message)
}

/// A Session's conditions: the state's own plus the operator's `Ready`.
pub struct SessionConditions {
    pub ready: Condition,
}

impl StatusReport for SessionConditions {
    fn conditions(
        &self,
        state: &SessionState,
        previous: &[Condition],
        generation: Option<i64>,
        now: Millis,
    ) -> Vec<Condition> {
        let mut next = conditions::of(state);
        next.push(self.ready.clone());
        conditions::settle(previous, next, generation, now)
    }
}

/// An Agent's conditions: its `Ready`, stamped against the stored ones.
pub fn agent_conditions(
    ready: Condition,
    previous: &[Condition],
    generation: Option<i64>,
    now: Millis,
) -> Vec<Condition> {
    conditions::settle(previous, vec![ready], generation, now)
}

/// The sessions above which the announced waits are forgotten at once (a
/// bound; finished sessions forget theirs anyway).
const MAX_ANNOUNCED_SESSIONS: usize = 100_000;

/// Waits already announced as Events, per session UID (token and what it
/// waits for): every step re-ensures open continuations, which is no news.
#[derive(Default)]
pub struct Announced(HashMap<String, HashSet<String>>);

impl Announced {
    /// `progress` without the waits `uid` announced before; a finished
    /// session's waits are forgotten.
    pub fn news(&mut self, uid: &str, mut progress: Vec<Progress>) -> Vec<Progress> {
        if self.0.len() > MAX_ANNOUNCED_SESSIONS {
            self.0.clear();
        }
        let ended = progress
            .iter()
            .any(|p| matches!(p, Progress::Finished { .. } | Progress::Failed { .. }));
        if ended {
            self.0.remove(uid);
            return progress;
        }
        let waits = self.0.entry(uid.to_string()).or_default();
        progress.retain(|p| match p {
            Progress::Deferred {
                token, waiting_for, ..
            } => waits.insert(format!("{token}/{waiting_for:?}")),
            _ => true,
        });
        progress
    }
}

/// The Events for a step: what it observed, then how it ended.
pub fn step_events(progress: &[Progress], outcome: &StepOutcome, wrote: bool) -> Vec<Event> {
    let mut out = events::for_progress(progress, wrote);
    out.extend(events::for_outcome(outcome, wrote));
    out
}

/// Who spent, as the token and cost counters label it.
pub struct SpendLabels {
    pub namespace: String,
    pub agent: String,
    pub model: String,
}

/// A model turn's tokens and cost in the operator's spend counters.
pub fn count_spend(metrics: &Metrics, labels: &SpendLabels, p: &Progress) {
    if let Progress::AgentTurn { usage, .. } = p {
        metrics.spent(&labels.namespace, &labels.agent, &labels.model, usage);
    }
}

/// One engine event in the operator's metrics.
pub fn count(metrics: &Metrics, p: &Progress) {
    match p {
        Progress::AgentTurn { .. } => metrics.model_call(true),
        Progress::Woke { waited_ms, .. } => metrics.wake_latency(Duration::from_millis(*waited_ms)),
        Progress::ModelError { .. } => metrics.model_call(false),
        Progress::ToolResult { result, by, .. } => {
            let outcome = if result.is_error() {
                TOOL_FAILED
            } else {
                TOOL_COMPLETED
            };
            metrics.tool_call(ran_as(by), outcome);
        }
        Progress::Deferred { waiting_for, .. } => {
            metrics.tool_call(deferred_as(*waiting_for), TOOL_DEFERRED)
        }
        _ => {}
    }
}

/// How a result came, as the metrics label it: a result from outside
/// counts as `external`, whatever name its writer gave.
fn ran_as(by: &Provenance) -> &str {
    match by {
        Provenance::RunSync => "runSync",
        Provenance::Cache => "cache",
        Provenance::Runner(label) => label,
        Provenance::Outside(_) => "external",
    }
}

fn deferred_as(waiting_for: WaitingFor) -> &'static str {
    match waiting_for {
        WaitingFor::Approval => "approval",
        WaitingFor::Background => "runAsync",
        WaitingFor::Isolated => "runIsolated",
        WaitingFor::External => "defer",
        WaitingFor::McpTask => "mcpTask",
        WaitingFor::SubAgent => "subAgent",
        WaitingFor::Outcome => "outcome",
        WaitingFor::Budget => "budget",
    }
}

/// When to look at the session again. A finished one kept for `ttl`
/// seconds is looked at once its status says when it finished; a
/// notification to retry, or a Job held by a quota, comes back no later
/// than `look_again`;
/// otherwise at the engine's time ([`requeue_after`]).
pub fn requeue(
    outcome: &StepOutcome,
    ttl: Option<u64>,
    look_again: Option<Duration>,
    now: Millis,
) -> Action {
    let finished = matches!(
        outcome,
        StepOutcome::Succeeded { .. } | StepOutcome::Failed { .. }
    );
    match (ttl, look_again) {
        (Some(secs), _) if finished => Action::requeue(Duration::from_secs(secs.max(1))),
        (_, Some(retry)) => {
            Action::requeue(requeue_after(outcome, now).map_or(retry, |d| d.min(retry)))
        }
        _ => match requeue_after(outcome, now) {
            Some(d) => Action::requeue(d),
            None => Action::await_change(),
        },
    }
}

/// The engine's time to look again (deadlines, backoff), at most
/// [`IDLE_RECHECK`] from now; `None` for a final or idle session (an edit
/// or the resync brings it back).
pub fn requeue_after(outcome: &StepOutcome, now: Millis) -> Option<Duration> {
    match outcome {
        StepOutcome::Busy { at } => Some(until(now, *at).min(IDLE_RECHECK)),
        StepOutcome::Waiting { wake_at, .. } => Some(
            wake_at
                .map(|at| until(now, at))
                .unwrap_or(IDLE_RECHECK)
                .min(IDLE_RECHECK),
        ),
        StepOutcome::Succeeded { .. }
        | StepOutcome::Failed { .. }
        | StepOutcome::Paused
        | StepOutcome::Idle => None,
    }
}

pub fn outcome_name(o: &StepOutcome) -> &'static str {
    match o {
        StepOutcome::Succeeded { .. } => "succeeded",
        StepOutcome::Failed { .. } => "failed",
        StepOutcome::Paused => "paused",
        StepOutcome::Idle => "idle",
        StepOutcome::Busy { .. } => "busy",
        StepOutcome::Waiting { .. } => "waiting",
    }
}

/// From `now` until `at`, at least a tenth of a second (no busy loop).
fn until(now: Millis, at: Millis) -> Duration {
    Duration::from_millis((at.0 - now.0).max(100) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{Phase, SessionId};

    fn ready_true() -> Condition {
        ready(
            Status::True,
            "AgentResolved",
            "agent a resolved and valid".into(),
        )
    }

    fn of_type<'a>(cs: &'a [Condition], t: &str) -> &'a Condition {
        cs.iter().find(|c| c.type_ == t).expect(t)
    }

    #[test]
    fn a_session_reports_its_state_and_ready_and_keeps_another_writers_conditions() {
        let mut state = SessionState::new(SessionId("s".into()));
        state.phase = Phase::Succeeded;
        let theirs = Condition::new("Audited", Status::True, "ByTeam", "kept");
        let report = SessionConditions {
            ready: ready_true(),
        };
        let out = report.conditions(&state, std::slice::from_ref(&theirs), Some(3), Millis(7));
        assert_eq!(of_type(&out, "Succeeded").status, Status::True);
        assert_eq!(of_type(&out, "Ready").reason, "AgentResolved");
        assert_eq!(of_type(&out, "Ready").observed_generation, Some(3));
        assert_eq!(of_type(&out, "Ready").last_transition, Millis(7));
        assert_eq!(of_type(&out, "Audited"), &theirs);
    }

    #[test]
    fn ready_keeps_its_transition_time_while_its_status_holds() {
        let first = agent_conditions(ready_true(), &[], Some(1), Millis(1000));
        let again = agent_conditions(ready_true(), &first, Some(2), Millis(9000));
        assert_eq!(again[0].last_transition, Millis(1000));
        let broken = ready(Status::False, "AgentNotFound", "gone".into());
        let after = agent_conditions(broken, &again, Some(2), Millis(9500));
        assert_eq!(after[0].last_transition, Millis(9500));
    }

    fn deferred(token: &str) -> Progress {
        Progress::Deferred {
            session: "s".into(),
            call: "c".into(),
            tool: "t".into(),
            token: token.into(),
            waiting_for: WaitingFor::Approval,
            reason: None,
        }
    }

    #[test]
    fn a_wait_is_news_once_and_a_finished_session_forgets_its_waits() {
        let mut announced = Announced::default();
        assert_eq!(announced.news("u", vec![deferred("k1")]).len(), 1);
        assert!(announced.news("u", vec![deferred("k1")]).is_empty());
        assert_eq!(announced.news("other", vec![deferred("k1")]).len(), 1);
        let finished = Progress::Finished {
            session: "s".into(),
            answer: "done".into(),
        };
        assert_eq!(announced.news("u", vec![finished]).len(), 1);
        assert!(!announced.0.contains_key("u"));
        assert_eq!(announced.news("u", vec![deferred("k1")]).len(), 1);
    }

    #[test]
    fn requeue_follows_retention_then_notification_then_the_engine() {
        let now = Millis(1_000);
        let done = StepOutcome::Succeeded { answer: "a".into() };
        let waiting = StepOutcome::Waiting {
            pending: vec![],
            wake_at: Some(Millis(61_000)),
        };
        let secs = Duration::from_secs;
        assert_eq!(requeue(&done, Some(0), None, now), Action::requeue(secs(1)));
        assert_eq!(requeue(&done, None, None, now), Action::await_change());
        assert_eq!(
            requeue(&waiting, None, Some(secs(5)), now),
            Action::requeue(secs(5))
        );
        assert_eq!(
            requeue(&waiting, None, Some(secs(600)), now),
            Action::requeue(secs(60))
        );
        let idle_wait = StepOutcome::Waiting {
            pending: vec![],
            wake_at: None,
        };
        assert_eq!(
            requeue(&idle_wait, None, None, now),
            Action::requeue(IDLE_RECHECK)
        );
        let soon = StepOutcome::Busy { at: Millis(1_010) };
        assert_eq!(
            requeue_after(&soon, now),
            Some(Duration::from_millis(100)),
            "never a busy loop"
        );
    }
}
