//! `agent` tools: another Agent offered to the model as a tool, and the
//! lineage (depth, call stack, limits) a session takes from `spec.parent`.

use super::AgentLookup;
use crate::api::agent::{tool_name, ToolSpec};
use crate::api::session::{AgentRef, ParentRef};
use crate::api::{AgentSpec, SessionSpec};
use crate::core::session::subagent::{ChildPlan, Lineage, DEFAULT_MAX_CHILDREN, DEFAULT_MAX_DEPTH};
use crate::core::{Millis, SessionConfig};
use crate::tools::{ToolDef, ToolKind};
use serde_json::{json, Value};

/// Gives every `agent` tool without a description its Agent's
/// `spec.description`. An Agent that cannot be read keeps a plain one: the
/// call then ends with an error result naming it.
pub async fn describe_agent_tools(agent: &mut AgentSpec, lookup: &dyn AgentLookup) {
    for tool in agent.tools.iter_mut() {
        let Some(target) = &tool.agent else { continue };
        if !tool.description.is_empty() {
            continue;
        }
        if let Ok(Some(found)) = lookup.agent(&target.agent_ref).await {
            tool.description = found.description;
        }
    }
}

/// The arguments an `agent` tool takes: `prompt`, and the properties the
/// entry declares (passed on to the child after the prompt).
fn parameters(declared: Option<&Value>) -> Value {
    let mut schema = declared
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({"type": "object"}));
    let props = schema
        .as_object_mut()
        .expect("an object")
        .entry("properties")
        .or_insert_with(|| json!({}));
    if let Some(props) = props.as_object_mut() {
        props.insert(
            "prompt".into(),
            json!({"type": "string", "description": "What the agent should do: its first message."}),
        );
    }
    let required = schema
        .as_object_mut()
        .expect("an object")
        .entry("required")
        .or_insert_with(|| json!([]));
    if let Some(list) = required.as_array_mut() {
        if !list.iter().any(|v| v == "prompt") {
            list.push(json!("prompt"));
        }
    }
    schema
}

/// An `agent` tool as the model sees it. It never runs in the step: the
/// core sends its calls to a child Session.
pub fn tool_def(t: &ToolSpec) -> ToolDef {
    let agent = t.agent.as_ref().map(|a| a.agent_ref.as_str()).unwrap_or("");
    let description = if t.description.is_empty() {
        format!("Ask the {agent} agent to do a task; its final answer is the result.")
    } else {
        t.description.clone()
    };
    ToolDef {
        name: tool_name(t).to_string(),
        description,
        parameters: Some(parameters(t.parameters.as_ref())),
        kind: ToolKind::Container,
    }
}

/// The session's place in its tree: from `spec.parent` (set by the
/// operator on a child), with the Agent's limits, `cap` bounding the depth.
pub fn lineage(agent: &AgentSpec, parent: Option<&ParentRef>, cap: u32) -> Lineage {
    Lineage {
        depth: parent.map_or(0, |p| p.depth),
        ancestors: parent.map(|p| p.stack.clone()).unwrap_or_default(),
        max_depth: agent.max_depth.unwrap_or(DEFAULT_MAX_DEPTH).min(cap),
        max_children: agent.max_children.unwrap_or(DEFAULT_MAX_CHILDREN).max(1),
        trace_parent: parent.and_then(|p| p.traceparent.clone()),
    }
}

/// Applies the lineage, the parent's deadline where it comes first, and
/// what the parent had left of its limits where that is less.
pub fn apply(config: &mut SessionConfig, agent: &AgentSpec, parent: Option<&ParentRef>, cap: u32) {
    config.lineage = lineage(agent, parent, cap);
    if let Some(d) = parent.and_then(|p| p.deadline_ms).map(Millis) {
        config.limits.deadline = Some(config.limits.deadline.map_or(d, |own| own.min(d)));
    }
    if let Some(left) = parent.and_then(|p| p.budget.as_ref()) {
        let currency = config.pricing.as_ref().map(|p| p.currency.as_str());
        config.budget = config.budget.bounded_by(left, currency);
    }
}

/// The `spec.parent` of the child `plan` makes under the session whose
/// UID is `parent_uid`.
pub fn parent_ref(plan: &ChildPlan, parent_uid: &str) -> ParentRef {
    ParentRef {
        name: plan.parent.0.clone(),
        uid: parent_uid.to_string(),
        call_id: plan.call_id.to_string(),
        depth: plan.depth,
        stack: plan.stack.clone(),
        deadline_ms: plan.deadline.map(|d| d.0),
        traceparent: plan.traceparent.clone(),
        budget: plan.budget.clone(),
    }
}

/// The spec of the child session `plan` makes: the called Agent by
/// reference, the prompt as its one message, its place in the tree; paused
/// when its parent is.
pub fn child_spec(plan: &ChildPlan, parent_uid: &str, paused: bool) -> SessionSpec {
    SessionSpec {
        agent_ref: Some(AgentRef {
            name: plan.agent.clone(),
        }),
        agent: None,
        messages: vec![plan.prompt.clone()],
        paused,
        limits: None,
        retry: None,
        ttl_seconds_after_finished: None,
        parent: Some(parent_ref(plan, parent_uid)),
        fork_from: None,
    }
}

/// The root of the tree a session of `spec` is in: the first on its call
/// stack, or the session itself.
pub fn root_of(session: &str, spec: &SessionSpec) -> String {
    spec.parent
        .as_ref()
        .and_then(|p| p.stack.first())
        .map_or_else(|| session.to_string(), |e| e.session.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(yaml: &str) -> ToolSpec {
        serde_norway::from_str(yaml).unwrap()
    }

    #[test]
    fn an_agent_tool_takes_a_prompt_and_its_declared_parameters() {
        let t = tool("name: researcher\nagent: {ref: researcher}\nparameters: {type: object, properties: {detail: {type: string}}}\n");
        let def = tool_def(&t);
        assert_eq!(def.name, "researcher");
        assert!(
            def.description.contains("researcher agent"),
            "{}",
            def.description
        );
        let p = def.parameters.unwrap();
        assert_eq!(p["properties"]["prompt"]["type"], "string");
        assert_eq!(p["properties"]["detail"]["type"], "string");
        assert_eq!(p["required"], json!(["prompt"]));
    }

    /// Session `root`'s call `t1-c0`, at depth 1, with no deadline or
    /// budget.
    fn root_parent() -> ParentRef {
        ParentRef {
            name: "root".into(),
            uid: "u".into(),
            call_id: "t1-c0".into(),
            depth: 1,
            stack: Vec::new(),
            deadline_ms: None,
            traceparent: None,
            budget: None,
        }
    }

    #[test]
    fn lineage_comes_from_spec_parent_and_the_cap_bounds_max_depth() {
        let agent: AgentSpec =
            serde_norway::from_str("model: {provider: scripted}\nmaxDepth: 9\n").unwrap();
        let parent = ParentRef {
            deadline_ms: Some(5_000),
            ..root_parent()
        };
        let l = lineage(&agent, Some(&parent), 6);
        assert_eq!((l.depth, l.max_depth, l.max_children), (1, 6, 8));
        let mut config = SessionConfig::default();
        config.limits.deadline = Some(Millis(9_000));
        apply(&mut config, &agent, Some(&parent), 6);
        assert_eq!(
            config.limits.deadline,
            Some(Millis(5_000)),
            "the parent's comes first"
        );
    }

    #[test]
    fn a_child_spends_at_most_what_its_parent_had_left() {
        use crate::core::budget::{Budget, BudgetLeft, OnExceed};
        let agent: AgentSpec = serde_norway::from_str("model: {provider: scripted}\n").unwrap();
        let left = BudgetLeft {
            tokens: Some(300),
            cost_micros: Some(5),
            currency: Some("USD".into()),
            tool_calls: Some(2),
            on_exceed: OnExceed::Ask,
        };
        let parent = ParentRef {
            budget: Some(left),
            ..root_parent()
        };
        // No limits of its own, no prices: tokens and tool calls bound it,
        // and it asks as its parent does; cost it cannot count.
        let mut config = SessionConfig::default();
        apply(&mut config, &agent, Some(&parent), 6);
        assert_eq!(
            (
                config.budget.tokens,
                config.budget.cost_micros,
                config.budget.tool_calls
            ),
            (Some(300), None, Some(2))
        );
        assert_eq!(config.budget.on_exceed, OnExceed::Ask);
        // Its own lower limit stays, and its own onExceed.
        let mut config = SessionConfig {
            budget: Budget {
                tokens: Some(100),
                ..Budget::default()
            },
            ..SessionConfig::default()
        };
        apply(&mut config, &agent, Some(&parent), 6);
        assert_eq!(config.budget.tokens, Some(100));
        assert_eq!(config.budget.on_exceed, OnExceed::Fail);
    }
}
