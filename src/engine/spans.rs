//! A step's spans, built from what the step reports. The recorder stands
//! between the step and the driver's observer: it passes every event on,
//! times the ones that make spans on the step's clock, and hands the
//! whole step to the [`TracePort`] when the step ends. Which results are
//! executions comes from the events' provenance, so a cached, replayed or
//! outside result is never reported as a run.
//!
//! The step's trace context goes into the session's checkpoints (see
//! `Checkpointer`): the next step joins the same trace and links to this
//! step's span. With tracing off ([`crate::ports::NoTraces`]) nothing is
//! recorded or stored.

use super::events::{waiting_for_text, Progress, Provenance, Work};
use super::{AgentRuntime, EngineError, Observer, Ports, StepReport};
use crate::core::acceptance::{CACHE_BY, ENGINE_BY};
use crate::core::envelope::idempotency_key;
use crate::core::session::Outlook;
use crate::core::{Millis, Scope, SessionId, TokenUsage, ToolResult};
use crate::ports::trace::{ChatSpan, DeferredCall, ResultSource, StepTrace, ToolSpan};
use crate::ports::{Clock, ModelIdentity, SessionRecord, TraceContext, TracePort, REPLAY_RUNS};
use std::sync::Mutex;

/// What a step reported so far.
#[derive(Default)]
struct Recording {
    started: Millis,
    session: String,
    namespace: String,
    uid: String,
    previous: Option<TraceContext>,
    context: Option<TraceContext>,
    /// The parent's span this (child) session's steps go under.
    parent: Option<TraceContext>,
    chat_began: Option<(u32, Millis)>,
    tool_began: Option<(String, Millis)>,
    chats: Vec<ChatSpan>,
    tools: Vec<ToolSpan>,
    deferred: Vec<DeferredCall>,
}

pub(super) struct StepRecorder<'a> {
    port: &'a dyn TracePort,
    clock: &'a dyn Clock,
    forward: &'a dyn Observer,
    model: ModelIdentity,
    agent: Option<String>,
    content: bool,
    /// The ids this step's span gets; `None`: tracing is off.
    fresh: Option<TraceContext>,
    /// A sub-agent child's: the parent's span for the call that made it.
    tree_parent: Option<TraceContext>,
    /// The agent's `agent` tools: a call of one has a span id derived in
    /// advance, whichever way its answer comes back.
    sub_agent_tools: std::collections::BTreeSet<String>,
    recording: Mutex<Recording>,
}

impl<'a> StepRecorder<'a> {
    pub(super) fn new(p: &Ports<'a>, agent: &AgentRuntime) -> Self {
        let fresh = p.tracer.fresh_context();
        StepRecorder {
            port: p.tracer,
            clock: p.clock,
            forward: p.observer,
            model: if fresh.is_some() {
                p.model.identity()
            } else {
                ModelIdentity::default()
            },
            agent: agent.config.agent.clone(),
            content: fresh.is_some() && p.tracer.records_content(),
            fresh,
            sub_agent_tools: agent
                .config
                .tools
                .iter()
                .filter(|(_, info)| info.sub_agent.is_some())
                .map(|(name, _)| name.clone())
                .collect(),
            tree_parent: agent
                .config
                .lineage
                .trace_parent
                .as_deref()
                .and_then(TraceContext::parse),
            recording: Mutex::new(Recording {
                started: p.clock.now(),
                ..Default::default()
            }),
        }
    }

    fn recording(&self) -> std::sync::MutexGuard<'_, Recording> {
        self.recording.lock().expect("step recording")
    }

    /// Joins the trace `record` carries (or starts one); returns the
    /// `traceparent` the step's checkpoints store, `None` when tracing is
    /// off. Called on every load (a lost compare-and-swap reloads): the
    /// link goes to the step this one built on.
    pub(super) fn begin(&self, record: &SessionRecord) -> Option<String> {
        let fresh = self.fresh?;
        let previous = record.trace.as_deref().and_then(TraceContext::parse);
        // A child's first step joins its parent's trace; later ones the
        // trace their first one began.
        let joined = previous.or(self.tree_parent);
        let context = fresh.in_trace_of(joined.as_ref());
        let parent = self.tree_parent.filter(|p| p.trace_id == context.trace_id);
        let mut r = self.recording();
        r.parent = parent;
        r.session = record.state.id.0.clone();
        r.namespace = record.namespace.clone();
        r.uid = record.uid.clone();
        r.previous = previous;
        r.context = Some(context);
        Some(context.traceparent())
    }

    /// Exports the step, unless it did nothing (no write, no span): a look
    /// at a session that waits is not a step worth a span.
    pub(super) fn finish(&self, result: &Result<StepReport, EngineError>) {
        let mut r = self.recording();
        let Some(context) = r.context else {
            return;
        };
        let (outcome, failure, writes) = match result {
            Ok(report) => (
                outcome_label(&report.outcome),
                match &report.outcome {
                    Outlook::Failed { reason } => Some(reason.clone()),
                    _ => None,
                },
                report.writes,
            ),
            Err(e) => ("error", Some(e.to_string()), 0),
        };
        let quiet = r.chats.is_empty() && r.tools.is_empty() && r.deferred.is_empty();
        if writes == 0 && quiet && failure.is_none() {
            return;
        }
        let conversation = if r.uid.is_empty() {
            r.session.clone()
        } else {
            r.uid.clone()
        };
        self.port.export(StepTrace {
            context,
            parent: r.parent,
            previous: r.previous,
            session: std::mem::take(&mut r.session),
            namespace: std::mem::take(&mut r.namespace),
            conversation,
            agent: self.agent.clone(),
            started: r.started,
            ended: self.clock.now(),
            outcome: outcome.to_string(),
            failure,
            writes,
            chats: std::mem::take(&mut r.chats),
            tools: std::mem::take(&mut r.tools),
            deferred: std::mem::take(&mut r.deferred),
        });
    }

    fn record(&self, progress: &Progress) {
        let now = self.clock.now();
        let mut r = self.recording();
        match progress {
            Progress::AgentTurn { turn, usage, .. } => {
                let chat = self.chat(&mut r, *turn, now, Some(*usage), None);
                r.chats.push(chat);
            }
            Progress::ModelError { error, .. } => {
                let turn = r.chat_began.map_or(0, |(turn, _)| turn);
                let chat = self.chat(&mut r, turn, now, None, Some(error.clone()));
                r.chats.push(chat);
            }
            Progress::ToolResult { .. } => {
                let tool = self.tool(&mut r, progress, now);
                r.tools.extend(tool);
            }
            Progress::Deferred {
                call,
                tool,
                waiting_for,
                ..
            } => r.deferred.push(DeferredCall {
                call: call.clone(),
                tool: tool.clone(),
                waiting_for: waiting_for_text(*waiting_for).to_string(),
                at: now,
            }),
            _ => {}
        }
    }

    fn chat(
        &self,
        r: &mut Recording,
        turn: u32,
        now: Millis,
        usage: Option<TokenUsage>,
        error: Option<String>,
    ) -> ChatSpan {
        ChatSpan {
            turn,
            model: self.model.clone(),
            started: r.chat_began.take().map_or(now, |(_, at)| at),
            ended: now,
            usage: usage.filter(|u| u.total() > 0),
            error,
        }
    }

    fn tool(&self, r: &mut Recording, progress: &Progress, now: Millis) -> Option<ToolSpan> {
        let Progress::ToolResult {
            call,
            tool,
            result,
            by,
            model_call_id,
            arguments,
            ..
        } = progress
        else {
            return None;
        };
        let started = match r.tool_began.take() {
            Some((began, at)) if &began == call => at,
            _ => now,
        };
        let scrub = |text: &str| scrub_keys(text, r, call);
        let content = self
            .content
            .then(|| (scrub(arguments), scrub(&result.to_model_text())));
        let (arguments, result_text) = content.unzip();
        // The error text is the tool's output too: content.
        let error = error_of(result).map(|message| match self.content {
            true => scrub(&message),
            false => "the tool answered with an error".to_string(),
        });
        // A sub-agent call's span has the id its child was given, whether
        // its runner or the call's Continuation brought the answer.
        let span_id = r
            .context
            .filter(|_| self.sub_agent_tools.contains(tool))
            .map(|context| context.sub_agent_call(&r.session, call).span_id);
        Some(ToolSpan {
            span_id,
            tool: tool.clone(),
            call: call.clone(),
            model_call_id: model_call_id.clone(),
            source: source_of(by),
            started,
            ended: now,
            error,
            arguments,
            result: result_text,
        })
    }
}

impl Observer for StepRecorder<'_> {
    fn observe(&self, progress: &Progress) {
        if self.fresh.is_some() {
            self.record(progress);
        }
        self.forward.observe(progress);
    }

    fn began(&self, work: &Work<'_>) {
        if self.fresh.is_some() {
            let now = self.clock.now();
            let mut r = self.recording();
            match work {
                Work::ModelCall { turn } => r.chat_began = Some((*turn, now)),
                Work::Tool { call } => r.tool_began = Some((call.to_string(), now)),
            }
        }
        self.forward.began(work);
    }
}

/// Where a result came from, as traces tell it: results the engine wrote
/// itself before a crash (`agents`) are replays, the cache's are cache hits.
fn source_of(by: &Provenance) -> ResultSource {
    match by {
        Provenance::Runner(label) if *label == REPLAY_RUNS => ResultSource::Replayed,
        Provenance::RunSync | Provenance::Runner(_) => ResultSource::Executed {
            runner: by.label().to_string(),
        },
        Provenance::Cache => ResultSource::Cache,
        Provenance::Outside(name) if name == ENGINE_BY => ResultSource::Replayed,
        Provenance::Outside(name) if name == CACHE_BY => ResultSource::Cache,
        Provenance::Outside(name) => ResultSource::Outside { by: name.clone() },
    }
}

fn error_of(result: &ToolResult) -> Option<String> {
    match result {
        ToolResult::Error { message } => Some(message.clone()),
        _ => None,
    }
}

/// `text` with the session's idempotency keys replaced: a tool may echo
/// its key, and keys never go into spans.
fn scrub_keys(text: &str, r: &Recording, call: &str) -> String {
    let scope = Scope {
        namespace: r.namespace.clone(),
        uid: r.uid.clone(),
    };
    let session = SessionId(r.session.clone());
    let key = idempotency_key(&session, &scope, &call);
    let prefix = key.strip_suffix(call).unwrap_or(&key);
    text.replace(&key, "[idempotency key]")
        .replace(prefix, "[idempotency key of the session]/")
}

fn outcome_label(outcome: &Outlook) -> &'static str {
    match outcome {
        Outlook::Succeeded { .. } => "succeeded",
        Outlook::Failed { .. } => "failed",
        Outlook::Paused => "paused",
        Outlook::Idle => "idle",
        Outlook::Busy { .. } => "busy",
        Outlook::Waiting { .. } => "waiting",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_the_engine_or_the_cache_wrote_are_not_runs() {
        let cases = [
            (Provenance::RunSync, "executed"),
            (Provenance::Runner(REPLAY_RUNS), "replayed"),
            (Provenance::Runner("job"), "executed"),
            (Provenance::Cache, "cache"),
            (Provenance::Outside(ENGINE_BY.into()), "replayed"),
            (Provenance::Outside(CACHE_BY.into()), "cache"),
            (Provenance::Outside("alice".into()), "outside"),
        ];
        for (by, label) in cases {
            assert_eq!(source_of(&by).label(), label, "{by:?}");
        }
    }

    #[test]
    fn every_idempotency_key_of_the_session_is_scrubbed() {
        let r = Recording {
            session: "s".into(),
            namespace: "ns".into(),
            uid: "u".into(),
            ..Default::default()
        };
        let text = r#"{"key":"ns/s/u/t1-c0","other":"ns/s/u/t2-c1"}"#;
        let clean = scrub_keys(text, &r, "t1-c0");
        assert!(!clean.contains("ns/s/u/"), "{clean}");
        assert!(clean.contains("[idempotency key]"), "{clean}");
    }
}
