//! Polling the MCP tasks calls became: one `tasks/get` per step (the
//! driver comes back at the server's interval), the answers people gave
//! to a request for input delivered first, and the result taken once.

use super::{refuse_logged, EngineError, Ports, Progress, Provenance, StepContext};
use crate::core::call::TaskHandle;
use crate::core::envelope::CallEnvelope;
use crate::core::session::TASK_BY;
use crate::core::{Event, Session};
use crate::ports::TaskPoll;
use tracing::{debug, info};

pub(super) async fn poll(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    session: &mut Session,
    envelope: &CallEnvelope,
    task: &TaskHandle,
    asks: Option<String>,
    replay: &mut Vec<Event>,
) -> Result<(), EngineError> {
    let sid = ctx.sid;
    let answers = match &asks {
        Some(_) => answers(p, ctx, envelope).await?,
        None => None,
    };
    let polled = p
        .tools
        .poll_task(&envelope.tool_call, task, answers.as_deref())
        .await;
    let token = envelope.token.clone();
    let event = match polled {
        TaskPoll::NoNews => return Ok(()),
        TaskPoll::Working => {
            debug!(session = sid, task = %task.id, "MCP task works");
            if asks.is_none() {
                return Ok(());
            }
            Event::TaskAsks { token, asks: None }
        }
        TaskPoll::AsksForInput(new) => {
            if asks.as_deref() == Some(new.as_str()) {
                return Ok(());
            }
            info!(session = sid, task = %task.id, "MCP task asks for input");
            p.observer.observe(&Progress::Note {
                session: sid.to_string(),
                message: format!(
                    "{} ({}) MCP task {} asks for input: {new}; answer with: agents session answer {} '<inputResponses JSON>'",
                    envelope.context.call_id, envelope.tool_call.name, task.id, envelope.token
                ),
            });
            Event::TaskAsks {
                token,
                asks: Some(new),
            }
        }
        TaskPoll::Ended(result) => {
            info!(session = sid, task = %task.id, failed = result.is_error(), "MCP task ended");
            super::perform::observe_result(p, sid, envelope, &result, Provenance::Runner(TASK_BY));
            Event::TaskEnded { token, result }
        }
    };
    replay.push(event.clone());
    refuse_logged(sid, "task poll", session.handle(event, p.clock.now()));
    Ok(())
}

/// What people answered to the task's request for input, from its
/// continuation.
async fn answers(
    p: &Ports<'_>,
    ctx: &StepContext<'_>,
    envelope: &CallEnvelope,
) -> Result<Option<String>, EngineError> {
    let records = super::patiently(p.clock, "the continuations", || {
        p.continuations.list_for(ctx.owner)
    })
    .await?;
    Ok(records
        .into_iter()
        .find(|r| r.token() == &envelope.token)
        .and_then(|r| r.answers))
}
