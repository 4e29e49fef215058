//! Sub-agent calls under `agents run`: not run in this process yet, so the
//! model gets an error result that says where they run, and the session
//! goes on (no wait for ever, nothing half made). A bad prompt is refused
//! before that, with a message the model can act on.

use crate::support;

use support::scratch::*;

const PLANNER: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: researcher}
spec:
  description: Looks things up.
  model: {provider: scripted, scripted: {replies: [{text: "facts"}]}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: planner}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {name: researcher, arguments: {prompt: "find facts"}}
            - {name: researcher, arguments: {topic: "no prompt"}}
        - text: planned
  tools:
    - name: researcher
      agent: {ref: researcher}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: plan}
spec: {agentRef: {name: planner}, messages: [go]}
"#;

#[test]
fn an_agent_tool_call_under_agents_run_is_an_error_result_that_says_why() {
    let s = Scratch::new("subagents");
    let file = s.path("planner.yaml");
    std::fs::write(&file, PLANNER).unwrap();
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let out = run.ok();
    assert!(out.contains("session plan succeeded"), "{out}");
    let show = s.run(&["session", "show", "plan", "-o", "json"]);
    let text = show.ok().to_string();
    assert!(
        text.contains("does not run sub-agents yet"),
        "the first call's result says why: {text}"
    );
    assert!(
        text.contains(r#"needs a \"prompt\" argument"#),
        "the second call is refused: {text}"
    );
}
