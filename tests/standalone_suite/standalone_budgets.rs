//! Budgets in `agents run` (issue 31, item 6 without `ask`): an
//! OpenAI-compatible fake that reports usage (with cached prompt tokens);
//! the session's turns get their cost, and the limits stop work before it
//! starts: `fail` fails the session naming the limit and the spend,
//! `pause` holds it with no further model call or tool run.

use crate::support;

use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use support::http::Server;
use support::scratch::*;

fn usage_model() -> (Server, Arc<AtomicUsize>) {
    support::fake::usage_model_server()
}

fn definition(model: u16, limits: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: spend}}
spec:
  messages: ["echo for ever"]
  limits: {limits}
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "http://127.0.0.1:{model}/v1", model: test}}
      pricing: {{inputPerMTok: 2, cachedInputPerMTok: 1, outputPerMTok: 10, currency: EUR}}
    tools:
      - {{name: echo, builtin: {{function: echo}}}}
"#
    )
}

fn shown(s: &Scratch) -> Value {
    let out = s.run(&["session", "show", "spend", "-o", "json"]);
    let last = out.ok().lines().last().unwrap_or_default().to_string();
    serde_json::from_str(&last).unwrap_or_else(|_| panic!("{}", out.stdout))
}

#[test]
fn fail_stops_at_the_token_limit_with_the_turns_priced() {
    let (model, calls) = usage_model();
    let s = Scratch::new("budget-fail");
    let file = s.write("spend.yaml", &definition(model.port, "{tokens: 1000}"));
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let all = format!("{}{}", run.stdout, run.stderr);
    // 700 spent after turn 1 (< 1000): turn 2 starts, ends at 1400, and
    // its tool run does not start.
    assert!(
        all.contains("tokens limit: spent 1400 of 1000 (onExceed: fail)"),
        "{all}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "no third model call");
    let shown = shown(&s);
    let usage = &shown["session"]["usage"];
    assert_eq!(usage["promptTokens"], 1200, "{shown}");
    assert_eq!(usage["cachedPromptTokens"], 400, "{shown}");
    // Per turn: 400 x 2 + 200 x 1 + 100 x 10 micro-units (prices per M).
    assert_eq!(usage["costMicros"], 2 * 2000, "{shown}");
    assert_eq!(shown["session"]["phase"], "Failed", "{shown}");
    let text = s.run(&["session", "show", "spend"]);
    assert!(
        text.ok()
            .contains("spend: 1400 tokens (400 cached), cost 0.004 EUR, 1 tool call"),
        "{}",
        text.stdout
    );
}

#[test]
fn pause_holds_at_the_tool_call_limit_and_resume_does_not_pass_it() {
    let (model, calls) = usage_model();
    let s = Scratch::new("budget-pause");
    let file = s.write(
        "spend.yaml",
        &definition(model.port, "{toolCalls: 1, onExceed: pause}"),
    );
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    assert!(
        run.stdout
            .contains("is held: the session reached its tool calls limit: spent 1 of 1"),
        "{}{}",
        run.stdout,
        run.stderr
    );
    // Turn 1's call ran; turn 2's call would be the second run.
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let shown = shown(&s);
    let text = shown.to_string();
    assert!(
        text.contains("budgetStop") && text.contains("toolCalls"),
        "{shown}"
    );
    assert_ne!(shown["session"]["phase"], "Failed", "{shown}");
    let text = s.run(&["session", "show", "spend"]);
    assert!(
        text.ok()
            .contains("held: the session reached its tool calls limit"),
        "{}",
        text.stdout
    );
    s.run(&["session", "resume", "spend"]).ok();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "held: nothing new started");
}

#[test]
fn a_negative_price_is_refused_saying_which_field() {
    let s = Scratch::new("budget-bad");
    let bad = definition(1, "{tokens: 10}").replace("inputPerMTok: 2,", "inputPerMTok: -2,");
    let file = s.write("spend.yaml", &bad);
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    run.fails_with("inputPerMTok");
}
