//! A step's record ([`StepTrace`]) as OpenTelemetry spans, per the GenAI
//! semantic conventions: `invoke_agent {agent}` for the step, `chat
//! {model}` for each model call and `execute_tool {tool}` for each tool
//! result under it. Spans are built after the step with the times it
//! recorded, with the ids it stored on the session, and leave through the
//! SDK's batch processor (OTLP over HTTP/protobuf).
//!
//! What never goes in: idempotency keys (scrubbed from content by the
//! engine), header values, API keys, the call envelope. Tool arguments and
//! results only when content recording is on.

use super::TraceSettings;
use crate::core::Millis;
use crate::ports::trace::{ChatSpan, ResultSource, StepTrace, ToolSpan};
use crate::ports::{TraceContext, TracePort};
use opentelemetry::trace::{
    Link, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use std::time::{Duration, SystemTime};

/// The OTLP exporter and the tracer that feeds it.
pub struct OtelTraces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    ids: RandomIdGenerator,
    content: bool,
}

impl std::fmt::Debug for OtelTraces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtelTraces")
            .field("content", &self.content)
            .finish_non_exhaustive()
    }
}

impl OtelTraces {
    /// The exporter reads its endpoint, headers and timeout from the
    /// `OTEL_EXPORTER_OTLP_*` variables; the batch processor its queue
    /// from `OTEL_BSP_*`; the provider its sampler from `OTEL_TRACES_SAMPLER`.
    pub fn new(settings: &TraceSettings) -> Result<OtelTraces, String> {
        use opentelemetry_otlp::{Protocol, WithExportConfig as _};
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()
            .map_err(|e| format!("the OTLP exporter for {}: {e}", settings.endpoint))?;
        let mut resource = Resource::builder()
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
        if let Some(name) = &settings.default_service {
            resource = resource.with_service_name(name.clone());
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        Ok(OtelTraces {
            tracer: provider.tracer("agents"),
            provider,
            ids: RandomIdGenerator::default(),
            content: settings.record_content,
        })
    }

    /// Exports what is queued and stops (bounded by the exporter's timeout).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("OpenTelemetry exporter shutdown: {e}");
        }
    }
}

impl TracePort for OtelTraces {
    fn fresh_context(&self) -> Option<TraceContext> {
        Some(TraceContext {
            trace_id: self.ids.new_trace_id().to_bytes(),
            span_id: self.ids.new_span_id().to_bytes(),
            sampled: true,
        })
    }

    fn records_content(&self) -> bool {
        self.content
    }

    fn export(&self, step: StepTrace) {
        // A sub-agent child's steps go under its parent's call span.
        let root = match &step.parent {
            Some(parent) => Context::new().with_remote_span_context(span_context(parent)),
            None => Context::new(),
        };
        let span = self.tracer.build_with_context(step_span(&step), &root);
        let cx = root.with_span(span);
        for chat in &step.chats {
            let mut span = self.tracer.build_with_context(chat_span(chat, &step), &cx);
            opentelemetry::trace::Span::end_with_timestamp(&mut span, time(chat.ended));
        }
        for tool in &step.tools {
            let mut span = self.tracer.build_with_context(tool_span(tool, &step), &cx);
            opentelemetry::trace::Span::end_with_timestamp(&mut span, time(tool.ended));
        }
        cx.span().end_with_timestamp(time(step.ended));
    }
}

fn time(at: Millis) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(at.0.max(0) as u64)
}

fn span_context(c: &TraceContext) -> SpanContext {
    let flags = if c.sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    SpanContext::new(
        TraceId::from_bytes(c.trace_id),
        SpanId::from_bytes(c.span_id),
        flags,
        true,
        TraceState::default(),
    )
}

/// Attributes every span of a step carries.
fn session_attributes(step: &StepTrace) -> Vec<KeyValue> {
    let mut out = vec![
        KeyValue::new("gen_ai.conversation.id", step.conversation.clone()),
        KeyValue::new("agents.session", step.session.clone()),
    ];
    if !step.namespace.is_empty() {
        out.push(KeyValue::new("k8s.namespace.name", step.namespace.clone()));
    }
    out
}

/// `invoke_agent {agent}`: a root span in the session's trace (its ids
/// are the ones stored on the session), linked to the step before it; a
/// sub-agent child's is under its parent's `execute_tool` span instead.
fn step_span(step: &StepTrace) -> SpanBuilder {
    let name = match &step.agent {
        Some(agent) => format!("invoke_agent {agent}"),
        None => "invoke_agent".to_string(),
    };
    let mut attributes = vec![
        KeyValue::new("gen_ai.operation.name", "invoke_agent"),
        KeyValue::new("agents.step.outcome", step.outcome.clone()),
        KeyValue::new("agents.step.writes", i64::from(step.writes)),
    ];
    if let Some(agent) = &step.agent {
        attributes.push(KeyValue::new("gen_ai.agent.name", agent.clone()));
    }
    attributes.extend(session_attributes(step));
    let links = step
        .previous
        .iter()
        .map(|p| {
            let kind = KeyValue::new("agents.link", "previous_step");
            Link::new(span_context(p), vec![kind], 0)
        })
        .collect();
    let events = step
        .deferred
        .iter()
        .map(|d| {
            let attrs = vec![
                KeyValue::new("agents.call.id", d.call.clone()),
                KeyValue::new("gen_ai.tool.name", d.tool.clone()),
                KeyValue::new("agents.waiting_for", d.waiting_for.clone()),
            ];
            opentelemetry::trace::Event::new("agents.call.deferred", time(d.at), attrs, 0)
        })
        .collect();
    let mut builder = SpanBuilder::from_name(name)
        .with_trace_id(TraceId::from_bytes(step.context.trace_id))
        .with_span_id(SpanId::from_bytes(step.context.span_id))
        .with_kind(SpanKind::Internal)
        .with_start_time(time(step.started))
        .with_attributes(attributes)
        .with_links(links)
        .with_events(events);
    if let Some(why) = &step.failure {
        builder = builder.with_status(Status::error(why.clone()));
    }
    builder
}

/// `chat {model}`.
fn chat_span(chat: &ChatSpan, step: &StepTrace) -> SpanBuilder {
    let mut attributes = vec![
        KeyValue::new("gen_ai.operation.name", "chat"),
        KeyValue::new("gen_ai.provider.name", chat.model.provider.clone()),
        KeyValue::new("gen_ai.request.model", chat.model.model.clone()),
        KeyValue::new("agents.turn", i64::from(chat.turn)),
    ];
    if let Some(usage) = chat.usage {
        attributes.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            usage.prompt_tokens as i64,
        ));
        attributes.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            usage.completion_tokens as i64,
        ));
    }
    attributes.extend(session_attributes(step));
    let mut builder = SpanBuilder::from_name(format!("chat {}", chat.model.model))
        .with_kind(SpanKind::Client)
        .with_start_time(time(chat.started));
    if let Some(error) = &chat.error {
        attributes.push(KeyValue::new("error.type", "model_error"));
        builder = builder.with_status(Status::error(error.clone()));
    }
    builder.with_attributes(attributes)
}

/// `execute_tool {tool}`; `agents.result.source` says whether the tool ran
/// now (`executed`) or its result was had otherwise.
fn tool_span(tool: &ToolSpan, step: &StepTrace) -> SpanBuilder {
    let mut attributes = vec![
        KeyValue::new("gen_ai.operation.name", "execute_tool"),
        KeyValue::new("gen_ai.tool.name", tool.tool.clone()),
        KeyValue::new("gen_ai.tool.call.id", tool.model_call_id.clone()),
        KeyValue::new("gen_ai.tool.type", "function"),
        KeyValue::new("agents.call.id", tool.call.clone()),
        KeyValue::new("agents.result.source", tool.source.label()),
    ];
    match &tool.source {
        ResultSource::Executed { runner } => {
            attributes.push(KeyValue::new("agents.tool.runner", runner.clone()))
        }
        ResultSource::Outside { by } => {
            attributes.push(KeyValue::new("agents.result.completed_by", by.clone()))
        }
        ResultSource::Cache | ResultSource::Replayed => {}
    }
    if let Some(arguments) = &tool.arguments {
        attributes.push(KeyValue::new(
            "gen_ai.tool.call.arguments",
            arguments.clone(),
        ));
    }
    if let Some(result) = &tool.result {
        attributes.push(KeyValue::new("gen_ai.tool.call.result", result.clone()));
    }
    attributes.extend(session_attributes(step));
    let mut builder = SpanBuilder::from_name(format!("execute_tool {}", tool.tool))
        .with_kind(SpanKind::Internal)
        .with_start_time(time(tool.started));
    if let Some(id) = tool.span_id {
        builder = builder.with_span_id(SpanId::from_bytes(id));
    }
    if let Some(error) = &tool.error {
        attributes.push(KeyValue::new("error.type", "tool_error"));
        builder = builder.with_status(Status::error(error.clone()));
    }
    builder.with_attributes(attributes)
}
