//! The trace port: what one engine step did, as plain records, for an
//! exporter to turn into spans (OpenTelemetry, in `telemetry`). The engine
//! fills them from its own progress events (`engine::trace`); nothing here
//! knows an SDK, and a driver without tracing passes [`NoTraces`].
//!
//! One step is one `invoke_agent` span with `chat` and `execute_tool`
//! children. Steps of one session share a trace: the step span's context
//! is stored on the session ([`TraceContext::traceparent`]), and the next
//! step, minutes or days later, starts a new span in that trace with a
//! link to it. No span stays open across a wait.

use crate::core::{Millis, TokenUsage};
use std::fmt::Write as _;

/// The W3C trace context of a step span: the session's trace id and the
/// span id of its latest step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceContext {
    /// `00-<trace id>-<span id>-<flags>`, as the `traceparent` header.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            u8::from(self.sampled)
        )
    }

    /// A `traceparent` of version 00 with non-zero ids; anything else is
    /// `None` (a hand-edited status starts a new trace).
    pub fn parse(text: &str) -> Option<TraceContext> {
        let mut parts = text.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let trace_id: [u8; 16] = unhex(trace)?.try_into().ok()?;
        let span_id: [u8; 8] = unhex(span)?.try_into().ok()?;
        let flags = unhex(flags)?;
        let valid = trace_id != [0; 16] && span_id != [0; 8] && flags.len() == 1;
        valid.then_some(TraceContext {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    /// This context's trace with `other`'s span: a later step of the same
    /// session.
    pub fn in_trace_of(self, other: Option<&TraceContext>) -> TraceContext {
        match other {
            Some(o) => TraceContext {
                trace_id: o.trace_id,
                sampled: o.sampled,
                ..self
            },
            None => self,
        }
    }

    /// The span, in this trace, of `session`'s call `call` to a sub-agent:
    /// its id derived from the trace and the call, so the parent's step
    /// that takes the answer and the child that joins under it agree on it
    /// without storing it.
    pub fn sub_agent_call(&self, session: &str, call: &str) -> TraceContext {
        use sha2::{Digest, Sha256};
        let digest = Sha256::new()
            .chain_update(self.trace_id)
            .chain_update(session.as_bytes())
            .chain_update([0])
            .chain_update(call.as_bytes())
            .finalize();
        let mut span_id: [u8; 8] = digest[..8].try_into().expect("8 of 32 bytes");
        if span_id == [0; 8] {
            span_id[7] = 1;
        }
        TraceContext { span_id, ..*self }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    let lower = text
        .bytes()
        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
    if !text.len().is_multiple_of(2) || !lower {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// Which model a step asks: `gen_ai.provider.name` and
/// `gen_ai.request.model`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    pub provider: String,
    pub model: String,
}

impl Default for ModelIdentity {
    fn default() -> Self {
        ModelIdentity {
            provider: "unknown".into(),
            model: "unknown".into(),
        }
    }
}

/// Where a tool result in a step came from. Only `Executed` is an
/// execution: the others report a result that was had without running the
/// tool now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResultSource {
    /// The tool ran for this step, by this runner (`runSync`, `runAsync`,
    /// `job`, `process`, ...).
    Executed { runner: String },
    /// Served from the result cache.
    Cache,
    /// The engine's own result, written before a crash and adopted now.
    Replayed,
    /// Written by an outside party (a person, a worker) under this name.
    Outside { by: String },
}

impl ResultSource {
    /// The value of `agents.result.source`.
    pub fn label(&self) -> &'static str {
        match self {
            ResultSource::Executed { .. } => "executed",
            ResultSource::Cache => "cache",
            ResultSource::Replayed => "replayed",
            ResultSource::Outside { .. } => "outside",
        }
    }
}

/// One model call of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatSpan {
    pub turn: u32,
    pub model: ModelIdentity,
    pub started: Millis,
    pub ended: Millis,
    /// What the reply reported; `None` when it reported none.
    pub usage: Option<TokenUsage>,
    pub error: Option<String>,
}

/// One tool result taken in by a step.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpan {
    /// The span's id when it is fixed in advance (a sub-agent call, whose
    /// child joins under it); `None`: the exporter makes one.
    pub span_id: Option<[u8; 8]>,
    pub tool: String,
    /// The deterministic call id (`t1-c0`).
    pub call: String,
    /// The model's own id for the call.
    pub model_call_id: String,
    pub source: ResultSource,
    pub started: Millis,
    pub ended: Millis,
    pub error: Option<String>,
    /// Only when the exporter records content, idempotency keys removed.
    pub arguments: Option<String>,
    pub result: Option<String>,
}

/// A call that began to wait in this step (a span event, not a span).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeferredCall {
    pub call: String,
    pub tool: String,
    pub waiting_for: String,
    pub at: Millis,
}

/// Everything one step did, ready to export.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTrace {
    pub context: TraceContext,
    /// The parent's span for the call that made this session (a sub-agent
    /// child): the step span goes under it.
    pub parent: Option<TraceContext>,
    /// The span of the session's step before this one.
    pub previous: Option<TraceContext>,
    pub session: String,
    pub namespace: String,
    /// `gen_ai.conversation.id`: the session's unique id.
    pub conversation: String,
    pub agent: Option<String>,
    pub started: Millis,
    pub ended: Millis,
    /// How the step left the session: `waiting`, `succeeded`, ...
    pub outcome: String,
    /// The step's error, or why the session failed.
    pub failure: Option<String>,
    /// Checkpoints the step wrote.
    pub writes: u32,
    pub chats: Vec<ChatSpan>,
    pub tools: Vec<ToolSpan>,
    pub deferred: Vec<DeferredCall>,
}

/// Where finished steps go.
pub trait TracePort: Send + Sync {
    /// A fresh context (new trace and span ids) for a step span, or `None`
    /// when tracing is off: then the engine records and stores nothing.
    fn fresh_context(&self) -> Option<TraceContext>;
    /// Whether tool arguments and results go into spans (opt-in).
    fn records_content(&self) -> bool {
        false
    }
    /// Hands a finished step over. Must not block or fail the step: an
    /// exporter queues it, and drops it when its queue is full.
    fn export(&self, step: StepTrace);
}

/// Tracing off.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoTraces;

impl TracePort for NoTraces {
    fn fresh_context(&self) -> Option<TraceContext> {
        None
    }
    fn export(&self, _: StepTrace) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_bad_ones_are_refused() {
        let c = TraceContext {
            trace_id: [0xab; 16],
            span_id: [0x01; 8],
            sampled: true,
        };
        let text = c.traceparent();
        assert_eq!(
            text,
            "00-abababababababababababababababab-0101010101010101-01"
        );
        assert_eq!(TraceContext::parse(&text), Some(c));
        for bad in [
            "",
            "00-abab-0101010101010101-01",
            "01-abababababababababababababababab-0101010101010101-01",
            "00-00000000000000000000000000000000-0101010101010101-01",
            "00-abababababababababababababababab-0000000000000000-01",
            "00-ABABABABABABABABABABABABABABABAB-0101010101010101-01",
            "00-abababababababababababababababab-0101010101010101-01-x",
            "00-abababababababababababababababab-010101010101010g-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_later_step_keeps_the_sessions_trace_and_its_own_span() {
        let first =
            TraceContext::parse("00-11111111111111111111111111111111-2222222222222222-01").unwrap();
        let fresh =
            TraceContext::parse("00-33333333333333333333333333333333-4444444444444444-01").unwrap();
        let next = fresh.in_trace_of(Some(&first));
        assert_eq!(next.trace_id, first.trace_id);
        assert_eq!(next.span_id, fresh.span_id);
        assert_eq!(fresh.in_trace_of(None), fresh);
    }
}
