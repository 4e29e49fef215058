//! The scripted provider: replays the agent's scripted replies, one per
//! agent turn. The reply depends only on how many agent turns the history
//! holds, so a replay after a crash gives the same answer.

use super::{ModelError, ModelRequest};
use crate::core::{AgentTurn, TokenUsage, ToolCall, Turn};
use serde_json::Value;

/// One scripted reply: text, tool calls, or both.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScriptedReply {
    pub text: Option<String>,
    /// Tool name and JSON arguments.
    pub tool_calls: Vec<(String, Value)>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScriptedModel {
    pub replies: Vec<ScriptedReply>,
}

impl ScriptedModel {
    pub fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        let turn = req
            .turns
            .iter()
            .filter(|t| matches!(t, Turn::Agent(_)))
            .count();
        let Some(reply) = self.replies.get(turn) else {
            return Err(ModelError::permanent(format!(
                "the scripted model has {} replies and none left for agent turn {}; add replies to spec.model.scripted.replies",
                self.replies.len(),
                turn + 1
            )));
        };
        Ok(AgentTurn {
            text: reply.text.clone(),
            tool_calls: reply
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, (name, args))| ToolCall {
                    model_call_id: format!("call_{}_{i}", turn + 1),
                    name: name.clone(),
                    // A string is sent as is, so tests can feed malformed JSON.
                    arguments: match args {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    },
                })
                .collect(),
            usage: TokenUsage::default(),
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::UserTurn;
    use serde_json::json;

    #[test]
    fn scripted_replies_follow_the_agent_turn_count() {
        let m = ScriptedModel {
            replies: vec![
                ScriptedReply {
                    text: None,
                    tool_calls: vec![("echo".into(), json!({"text": "hi"}))],
                },
                ScriptedReply {
                    text: Some("done".into()),
                    tool_calls: vec![],
                },
            ],
        };
        let mut turns = vec![Turn::User(UserTurn {
            message: Some("go".into()),
            tool_results: vec![],
        })];
        let req = |turns: &[Turn]| {
            m.reply(&ModelRequest {
                system_prompt: "",
                turns,
                tools: &[],
            })
        };
        let first = req(&turns).unwrap();
        assert_eq!(first.tool_calls[0].arguments, r#"{"text":"hi"}"#);
        assert_eq!(req(&turns).unwrap(), first, "a replay gives the same reply");
        turns.push(Turn::Agent(first));
        assert_eq!(req(&turns).unwrap().text.as_deref(), Some("done"));
        turns.push(Turn::Agent(AgentTurn::default()));
        let err = req(&turns).unwrap_err();
        assert!(!err.retryable);
        assert_eq!(err.retry_after, None);
        assert!(err.message.contains("none left for agent turn 3"), "{err}");
    }
}
