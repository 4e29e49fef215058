use super::*;
use crate::core::conversation::ToolResultEntry;
use crate::core::{CallId, ToolResult, ToolSchema};

fn model() -> AnthropicModel {
    AnthropicModel::new(
        "http://x/",
        "claude-test",
        1000,
        Some("sk-ant-secret".into()),
        Duration::from_secs(5),
    )
}

fn call(id: &str, arguments: &str) -> ToolCall {
    ToolCall {
        model_call_id: id.into(),
        name: "echo".into(),
        arguments: arguments.into(),
    }
}

fn result(index: u32, id: &str, result: ToolResult) -> ToolResultEntry {
    ToolResultEntry {
        call_id: CallId::new(1, index),
        model_call_id: id.into(),
        tool: "echo".into(),
        token: None,
        result,
        truncate_bytes: None,
        started_at: None,
        finished_at: None,
    }
}

fn user(message: Option<&str>, tool_results: Vec<ToolResultEntry>) -> Turn {
    Turn::User(UserTurn {
        message: message.map(str::to_string),
        tool_results,
    })
}

fn agent(text: Option<&str>, tool_calls: Vec<ToolCall>) -> Turn {
    Turn::Agent(AgentTurn {
        text: text.map(str::to_string),
        tool_calls,
        usage: TokenUsage::default(),
        ..Default::default()
    })
}

fn body(turns: &[Turn], tools: &[ToolSchema]) -> Value {
    model().request_body(&ModelRequest {
        system_prompt: "be brief",
        turns,
        tools,
    })
}

#[test]
fn the_system_prompt_is_top_level_and_tool_results_come_first_in_call_order() {
    let m = model();
    assert!(!format!("{m:?}").contains("sk-ant-secret"));
    assert_eq!(m.url(), "http://x/v1/messages");
    let turns = vec![
        user(Some("q"), vec![]),
        agent(
            Some("Let me look."),
            vec![
                call("c1", r#"{"a":1}"#),
                call("c2", "{oops"),
                call("c3", ""),
            ],
        ),
        // Delivered out of order, one failed: the wire order is the model's.
        user(
            Some("and then?"),
            vec![
                result(2, "c3", ToolResult::text("r3")),
                result(0, "c1", ToolResult::text("r1")),
                result(1, "c2", ToolResult::error("bad arguments")),
            ],
        ),
    ];
    let tools = [ToolSchema {
        name: "echo".into(),
        description: "Echoes.".into(),
        parameters: None,
    }];
    let b = body(&turns, &tools);
    assert_eq!(b["system"], "be brief");
    assert_eq!(b["model"], "claude-test");
    assert_eq!(b["max_tokens"], 1000);
    let messages = b["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"], "no system message");
    assert_eq!(
        messages[0]["content"],
        json!([{"type": "text", "text": "q"}])
    );
    let asked = &messages[1]["content"];
    assert_eq!(asked[0], json!({"type": "text", "text": "Let me look."}));
    assert_eq!(
        asked[1],
        json!({"type": "tool_use", "id": "c1", "name": "echo", "input": {"a": 1}})
    );
    assert_eq!(asked[2]["input"], json!({"arguments": "{oops"}));
    assert_eq!(asked[3]["input"], json!({}));
    let answered = messages[2]["content"].as_array().unwrap();
    let kinds: Vec<(&str, &str)> = answered
        .iter()
        .map(|b| {
            (
                b["type"].as_str().unwrap(),
                b["tool_use_id"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("tool_result", "c1"),
            ("tool_result", "c2"),
            ("tool_result", "c3"),
            ("text", "")
        ]
    );
    assert_eq!(answered[0]["content"], "r1");
    assert_eq!(answered[0].get("is_error"), None);
    assert_eq!(answered[1]["is_error"], true);
    assert_eq!(answered[1]["content"], "error: bad arguments");
    assert_eq!(
        b["tools"],
        json!([{"name": "echo", "description": "Echoes.", "input_schema": {"type": "object"}}])
    );
}

#[test]
fn empty_turns_are_left_out_and_roles_still_alternate() {
    let turns = vec![
        user(Some("hi"), vec![]),
        agent(None, vec![]),
        user(Some("still there?"), vec![]),
        agent(Some(""), vec![]),
        user(None, vec![]),
    ];
    let b = body(&turns, &[]);
    assert_eq!(
        b["messages"],
        json!([{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "text", "text": "still there?"}
        ]}])
    );
    assert_eq!(b.get("tools"), None);
    let no_system = model().request_body(&ModelRequest {
        system_prompt: "",
        turns: &turns,
        tools: &[],
    });
    assert_eq!(no_system.get("system"), None);
}

#[test]
fn a_message_parses_into_text_calls_and_usage_with_cache_tokens() {
    let m = parse_message(
        r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-test",
            "content":[{"type":"thinking","thinking":"hm","signature":"s"},
                       {"type":"text","text":"Two calls."},
                       {"type":"tool_use","id":"toolu_a","name":"echo","input":{"text":"ping"}},
                       {"type":"tool_use","id":"toolu_b","name":"echo","input":{}}],
            "stop_reason":"tool_use","stop_sequence":null,
            "usage":{"input_tokens":10,"output_tokens":7,
                     "cache_creation_input_tokens":100,"cache_read_input_tokens":1000}}"#,
    )
    .unwrap();
    assert_eq!(m.stop_reason.as_deref(), Some("tool_use"));
    assert_eq!(m.cache_creation_input_tokens, 100);
    assert_eq!(m.cache_read_input_tokens, 1000);
    let turn = m.into_turn(1000).unwrap();
    assert_eq!(turn.text.as_deref(), Some("Two calls."));
    assert_eq!(turn.tool_calls[0].model_call_id, "toolu_a");
    assert_eq!(
        Value::Object(turn.tool_calls[0].parsed_arguments().unwrap()),
        json!({"text": "ping"})
    );
    assert_eq!(turn.tool_calls[1].arguments, "{}");
    assert_eq!(
        turn.usage,
        TokenUsage {
            prompt_tokens: 1110,
            completion_tokens: 7,
            cached_prompt_tokens: 1000,
            cost_micros: 0,
        }
    );
    let plain =
        parse_message(r#"{"content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn"}"#)
            .unwrap();
    assert_eq!(plain.turn.usage, TokenUsage::default());
    assert_eq!(plain.into_turn(1).unwrap().text.as_deref(), Some("hi"));
}

#[test]
fn a_stop_reason_that_leaves_nothing_to_act_on_fails_the_call_for_good() {
    let stopped = |reason: &str| {
        parse_message(&format!(
            r#"{{"content":[{{"type":"text","text":"par"}}],"stop_reason":"{reason}"}}"#
        ))
        .unwrap()
        .into_turn(1000)
    };
    for ok in [
        "end_turn",
        "tool_use",
        "stop_sequence",
        "pause_turn_of_the_future",
    ] {
        assert!(stopped(ok).is_ok(), "{ok}");
    }
    let cut = stopped("max_tokens").unwrap_err();
    assert!(!cut.retryable, "{cut}");
    assert!(
        cut.message.contains("max_tokens (1000 output tokens)")
            && cut.message.contains("raise spec.model.anthropic.maxTokens"),
        "{cut}"
    );
    for reason in ["refusal", "model_context_window_exceeded"] {
        let e = stopped(reason).unwrap_err();
        assert!(!e.retryable, "{e}");
    }
}

#[test]
fn a_body_that_is_not_a_message_says_what_is_wrong() {
    let err = |body: &str| parse_message(body).unwrap_err();
    assert!(err("<html>").starts_with("the body is not JSON"));
    assert_eq!(err(r#"{"id":"x"}"#), "the body has no `content`");
    assert_eq!(err(r#"{"content":"hi"}"#), "`content` is not an array");
    assert_eq!(
        err(r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#),
        "the body holds an error instead of `content`: Overloaded"
    );
    assert_eq!(
        err(r#"{"content":[{"text":"x"}]}"#),
        "`content[0]` has no `type`"
    );
    assert_eq!(
        err(r#"{"content":[{"type":"tool_use","id":"t","input":{}}]}"#),
        "`content[0]` (tool_use) has no `name`"
    );
}

#[test]
fn an_endpoint_off_the_operators_list_is_refused_naming_the_field() {
    let list = Some(Arc::new(
        crate::http::allow::AllowedUrls::parse_for(
            crate::http::allow::Purpose::Models,
            &["https://api.anthropic.com/v1/*"],
        )
        .unwrap(),
    ));
    let allowed = AnthropicModel::new(
        DEFAULT_ANTHROPIC_BASE_URL,
        "m",
        1,
        None,
        Duration::from_secs(1),
    )
    .with_allowed_urls(list.clone());
    assert_eq!(allowed.url_not_allowed(), None);
    let elsewhere = model().with_allowed_urls(list);
    let why = elsewhere.url_not_allowed().unwrap();
    assert!(
        why.contains("\"http://x/v1/messages\" is not on the operator's allow-list"),
        "{why}"
    );
    let e = futures::executor::block_on(elsewhere.reply(&ModelRequest {
        system_prompt: "",
        turns: &[],
        tools: &[],
    }))
    .unwrap_err();
    assert!(!e.retryable);
    assert!(
        e.message.ends_with("; check spec.model.anthropic.baseUrl"),
        "{e}"
    );
}
