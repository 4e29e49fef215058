//! What the core's budget tests share (core_budgets, core_budget_ask): a
//! session with a `lookup` tool, started with one message, and the model
//! replies and tool results that move it.

use agents::core::budget::Budget;
use agents::core::session::ToolInfo;
use agents::core::*;
use std::collections::BTreeMap;

pub const T0: Millis = Millis(1_700_000_000_000);

/// A session config with the `lookup` tool and `budget`.
pub fn with_lookup(budget: Budget) -> SessionConfig {
    let mut tools = BTreeMap::new();
    tools.insert("lookup".to_string(), ToolInfo::default());
    SessionConfig {
        tools,
        budget,
        ..SessionConfig::default()
    }
}

pub fn drain(s: &mut Session) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

pub fn calls_model(actions: &[Action]) -> bool {
    actions
        .iter()
        .any(|a| matches!(a, Action::CallModel { .. }))
}

pub fn tool_runs(actions: &[Action]) -> Vec<CallId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::RunTool { call, .. } => Some(*call),
            _ => None,
        })
        .collect()
}

pub fn started(config: SessionConfig) -> Session {
    let mut s = Session::new(SessionId("demo".into()), config);
    let text = "go".to_string();
    s.handle(Event::UserMessage { text }, T0).unwrap();
    assert!(calls_model(&drain(&mut s)));
    s
}

/// The model asks for `calls` lookups, having used `prompt` + `completion` tokens.
pub fn reply(s: &mut Session, calls: usize, prompt: u64, completion: u64) -> Vec<Action> {
    let tool_calls = (0..calls)
        .map(|i| ToolCall {
            model_call_id: format!("m-{i}"),
            name: "lookup".into(),
            arguments: "{}".into(),
        })
        .collect();
    let usage = TokenUsage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        ..TokenUsage::default()
    };
    let text = (calls == 0).then(|| "done".to_string());
    let turn = AgentTurn {
        text,
        tool_calls,
        usage,
        asked_at: None,
        replied_at: None,
    };
    s.handle(Event::ModelReplied { turn }, T0).unwrap();
    drain(s)
}

pub fn finish(s: &mut Session, call: CallId) -> Vec<Action> {
    let result = ToolResult::text("ok");
    let event = Event::ToolFinished {
        call,
        result,
        from_cache: false,
    };
    s.handle(event, T0).unwrap();
    drain(s)
}
