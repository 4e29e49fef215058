//! Sub-agents: a call of an `agent` tool runs as a child Session.
//!
//! The core decides everything about the child (its name, prompt, depth,
//! call stack and deadline) and refuses a call past the depth limit before
//! anything is claimed; making the child is a driver's effect, through the
//! runner port, after the call's claim is committed.

use super::{CoreError, Event, Handled, Session, SessionConfig, TrackedToolCall};
use crate::core::call::{Attempt, CallStage, Wait};
use crate::core::conversation::TokenUsage;
use crate::core::ids::{CallId, ContinuationToken, SessionId, MAX_NAME_LEN};
use crate::core::policy::Disposition;
use crate::core::time::Millis;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How deep a tree may grow when the Agent says nothing (the root is 0).
pub const DEFAULT_MAX_DEPTH: u32 = 4;
/// Children of one session that run at once when the Agent says nothing.
pub const DEFAULT_MAX_CHILDREN: u32 = 8;

/// One session on the way from the root: who runs it and how deep it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StackEntry {
    /// The Agent the session runs (`inline` for an inline agent).
    pub agent: String,
    /// The session's name.
    pub session: String,
    /// Its depth: the root is 0.
    pub depth: u32,
}

/// Where a session sits in its tree, and the limits it passes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lineage {
    /// This session's depth: the root is 0.
    pub depth: u32,
    /// The sessions above this one, the root first.
    pub ancestors: Vec<StackEntry>,
    /// The deepest a descendant may be.
    pub max_depth: u32,
    /// Children that run at once; the rest wait their turn.
    pub max_children: u32,
    /// The `traceparent` of the parent's span for the call that made this
    /// session: its step spans go under it.
    pub trace_parent: Option<String>,
}

impl Default for Lineage {
    fn default() -> Self {
        Lineage {
            depth: 0,
            ancestors: Vec::new(),
            max_depth: DEFAULT_MAX_DEPTH,
            max_children: DEFAULT_MAX_CHILDREN,
            trace_parent: None,
        }
    }
}

/// The child Session a sub-agent call makes: decided here, made by the
/// driver (created if absent, adopted when its owner is this session).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChildPlan {
    /// Deterministic: the parent, the call and (for a retry) the attempt.
    pub name: String,
    /// The Agent the child runs.
    pub agent: String,
    /// The child's first message.
    pub prompt: String,
    pub parent: SessionId,
    pub call_id: CallId,
    /// The child's depth.
    pub depth: u32,
    /// The call stack down to the parent (root first), for the child's
    /// context snapshots and its own depth checks.
    pub stack: Vec<StackEntry>,
    /// The parent's deadline: the child must end by then too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Millis>,
    /// The W3C `traceparent` of the parent's span for this call, when
    /// traces are exported (the engine sets it): the child's steps join
    /// that trace under it, so a tree is one trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// What the parent has left of its limits: the child spends at most
    /// this (set by the parent's session as the child is started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::core::budget::BudgetLeft>,
}

/// The child's name: the call's token (`<parent>-t<turn>-c<call>`, cut
/// with a hash where too long), and `-a<n>` for the n-th attempt after
/// the first (a retry makes a new child).
pub fn child_name(parent: &SessionId, call: CallId, attempt: u32) -> String {
    let token = ContinuationToken::for_call(parent, call).0;
    if attempt <= 1 {
        return token;
    }
    let suffix = format!("-a{attempt}");
    if token.len() + suffix.len() <= MAX_NAME_LEN {
        return format!("{token}{suffix}");
    }
    // Cut further: the token's own hash and call suffix stay unique.
    let hashed = ContinuationToken::for_call(&SessionId(format!("{}{suffix}", parent.0)), call).0;
    let keep = MAX_NAME_LEN - suffix.len();
    format!("{}{suffix}", &hashed[..hashed.len().min(keep)])
        .replace("--", "-")
        .trim_matches('-')
        .to_string()
}

/// This session as an entry of its children's stacks.
fn own_entry(config: &SessionConfig, session: &SessionId) -> StackEntry {
    StackEntry {
        agent: config.agent.clone().unwrap_or_else(|| "inline".into()),
        session: session.0.clone(),
        depth: config.lineage.depth,
    }
}

/// The chain from the root to a child running `agent`, for messages.
fn chain(config: &SessionConfig, session: &SessionId, agent: &str) -> String {
    let mut parts: Vec<String> = config
        .lineage
        .ancestors
        .iter()
        .chain(std::iter::once(&own_entry(config, session)))
        .map(|e| format!("{} ({})", e.agent, e.session))
        .collect();
    parts.push(agent.to_string());
    parts.join(" -> ")
}

/// Why a call of the `agent` tool calling `agent` cannot make a child:
/// a missing or non-string `prompt`, or a depth past the limit (a cycle
/// is named as one). The model is told and can correct itself.
pub fn refuse_reason(
    config: &SessionConfig,
    session: &SessionId,
    agent: &str,
    arguments: &Value,
) -> Option<String> {
    match arguments.get("prompt") {
        Some(Value::String(p)) if !p.trim().is_empty() => {}
        Some(Value::String(_)) => {
            return Some(format!(
                "the {agent} agent needs a non-empty \"prompt\" string; call it again with {{\"prompt\": \"what {agent} should do\"}}"
            ))
        }
        Some(other) => {
            return Some(format!(
                "\"prompt\" must be a string, not {other}; call {agent} again with {{\"prompt\": \"...\"}}"
            ))
        }
        None => {
            return Some(format!(
                "the {agent} agent needs a \"prompt\" argument (a string); call it again with {{\"prompt\": \"what {agent} should do\"}}"
            ))
        }
    }
    let depth = config.lineage.depth + 1;
    if depth <= config.lineage.max_depth {
        return None;
    }
    let cycle = config.agent.as_deref() == Some(agent)
        || config.lineage.ancestors.iter().any(|e| e.agent == agent);
    let what = if cycle {
        format!("a cycle: {agent} is already on the call stack")
    } else {
        "too deep".to_string()
    };
    Some(format!(
        "sub-agent call refused ({what}): a child at depth {depth} passes maxDepth {}; the chain is {}. Answer without calling {agent}, or raise spec.maxDepth of the Agent",
        config.lineage.max_depth,
        chain(config, session, agent)
    ))
}

/// The first message of the child: the prompt, and any other arguments
/// the tool declares, as JSON after it.
fn first_message(arguments: &Value) -> String {
    let prompt = arguments
        .get("prompt")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let rest: serde_json::Map<String, Value> = arguments
        .as_object()
        .map(|o| {
            o.iter()
                .filter(|(k, _)| k.as_str() != "prompt")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    if rest.is_empty() {
        prompt
    } else {
        format!("{prompt}\n\nParameters: {}", Value::Object(rest))
    }
}

/// The child `call` (a deferred call of an `agent` tool) makes on its
/// current attempt.
pub fn plan(
    session: &SessionId,
    config: &SessionConfig,
    call: &TrackedToolCall,
    agent: &str,
) -> ChildPlan {
    let arguments = Value::Object(call.effective_call().parsed_arguments().unwrap_or_default());
    let mut stack = config.lineage.ancestors.clone();
    stack.push(own_entry(config, session));
    ChildPlan {
        name: child_name(session, call.id, call.attempts),
        agent: agent.to_string(),
        prompt: first_message(&arguments),
        parent: session.clone(),
        call_id: call.id,
        depth: config.lineage.depth + 1,
        stack,
        deadline: config.limits.deadline,
        traceparent: None,
        budget: None,
    }
}

/// Children of these calls that run now: sub-agent waits holding a claim.
pub fn running_children(calls: &[TrackedToolCall]) -> u32 {
    calls
        .iter()
        .filter(|c| {
            matches!(
                c.stage(),
                CallStage::Deferred {
                    wait: Wait::SubAgent(Attempt::Claimed(_)),
                    ..
                }
            )
        })
        .count() as u32
}

/// A sub-agent call whose child has not started (or retries): it takes a
/// place among the running children when it starts.
pub fn is_new_child(call: &TrackedToolCall) -> bool {
    matches!(
        call.stage(),
        CallStage::Deferred {
            wait: Wait::SubAgent(Attempt::Unclaimed | Attempt::RetryAt(_)),
            ..
        }
    )
}

/// The call stack a call of this session carries: the ancestors and this
/// session; empty for a root that is in no tree.
pub fn call_stack(config: &SessionConfig, session: &SessionId) -> Vec<StackEntry> {
    if config.lineage.depth == 0 {
        return Vec::new();
    }
    let mut stack = config.lineage.ancestors.clone();
    stack.push(own_entry(config, session));
    stack
}

impl Session {
    /// The child the open sub-agent call under `token` makes on its
    /// current attempt (for a driver that reads the child again).
    pub fn child_plan(&self, token: &ContinuationToken) -> Option<ChildPlan> {
        let call = self.state.find_call(token)?;
        match &call.policy.disposition {
            Disposition::SubAgent { agent } => {
                let mut child = plan(&self.state.id, &self.config, call, agent);
                child.budget = self.budget_left();
                Some(child)
            }
            _ => None,
        }
    }

    /// A sub-agent call's answer (`AttemptFinished` from the runner, or
    /// `Wake` from its continuation after a crash), with the child's final
    /// usage. The usage is added to this session's only when this event is
    /// what ends the call: the state that ends the call is the state that
    /// holds the child's tokens, so they are counted once across crashes
    /// (a replayed step starts again from the state before).
    pub(super) fn take_child_answer(
        &mut self,
        event: Event,
        usage: TokenUsage,
        now: Millis,
    ) -> Result<Handled, CoreError> {
        let token = match &event {
            Event::AttemptFinished { token, .. } | Event::Wake { token, .. } => token.clone(),
            // Not an answer: nothing to count.
            _ => return self.handle(event, now),
        };
        let open_before = self
            .state
            .find_call(&token)
            .is_some_and(|c| !c.state().is_final());
        // Counted before the answer is handled, so that the budget check
        // of the work it lets start (the next model call) sees the child's
        // spend; taken back when the answer did not end the call.
        let before = (self.state.usage, self.state.children_usage);
        if open_before {
            self.state.usage.add(usage);
            self.state.children_usage.add(usage);
        }
        let handled = self.handle(event, now);
        // A call that ended leaves the open turn once all its turn's calls did.
        let ended = self
            .state
            .find_call(&token)
            .is_none_or(|c| c.state().is_final());
        if handled.is_err() || !ended {
            (self.state.usage, self.state.children_usage) = before;
        }
        handled
    }
}
