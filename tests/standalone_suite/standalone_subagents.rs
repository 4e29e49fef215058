//! Sub-agents under `agents run`: each call of an `agent` tool runs as a
//! child session in the same SQLite store and the same process, and its
//! answer is the call's result. The tree is the cluster test's: a root
//! (planner), 3 children (researchers) and 2 grandchildren (leaves) each,
//! against an OpenAI-compatible fake model; each leaf sends one side
//! effect to an http tool server, which counts them by idempotency key.
//!
//! - the whole tree runs in one `agents run`: every session once, every
//!   model turn once, every side effect once;
//! - a grandchild waiting for an approval makes the process yield; the
//!   wait shows in `pending ROOT` with its path, is approved there, and
//!   `resume ROOT` finishes the tree;
//! - SIGKILLed at random moments several times and resumed: still each
//!   session made once (no second child for a call), each side effect
//!   once under its key, each leaf's answer taken once.

use crate::support;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::http::{Response, Server};
use support::scratch::*;

/// (key) -> times seen: model turns by "first message/turn", side effects
/// by idempotency key.
type Counts = Arc<Mutex<BTreeMap<String, u32>>>;

/// The fake model: the planner asks 3 researchers, each researcher asks
/// 2 leaves, a leaf sends its note (the leaf `root.1.0` the guarded one,
/// when `guard`) and then answers; a caller answers with its calls'
/// results. Sessions are told apart by their first message.
fn model(turns: Counts, guard: bool) -> Server {
    model_with(turns, guard, |_| {})
}

/// [`model`], calling `on_turn` with each turn's "first message/turn"
/// before it answers (to act while that turn is under way).
fn model_with(
    turns: Counts,
    guard: bool,
    on_turn: impl Fn(&str) + Send + Sync + 'static,
) -> Server {
    Server::start(move |req| {
        let body = req.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let text_of = |role: &str| -> String {
            messages
                .iter()
                .find(|m| m["role"] == role)
                .and_then(|m| m["content"].as_str())
                .unwrap_or("?")
                .to_string()
        };
        let (system, first) = (text_of("system"), text_of("user"));
        let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
        *turns
            .lock()
            .unwrap()
            .entry(format!("{first}/{turn}"))
            .or_insert(0) += 1;
        on_turn(&format!("{first}/{turn}"));
        let call = |i: usize, tool: &str, args: Value| {
            json!({"id": format!("call{i}"), "type": "function",
                "function": {"name": tool, "arguments": args.to_string()}})
        };
        let calls = |tool: &str, n: usize| -> Vec<Value> {
            (0..n)
                .map(|i| call(i, tool, json!({"prompt": format!("{first}.{i}")})))
                .collect()
        };
        let results: Vec<String> = messages
            .iter()
            .filter(|m| m["role"] == "tool")
            .filter_map(|m| m["content"].as_str().map(str::to_string))
            .collect();
        let tool_calls =
            |calls: Vec<Value>| json!({"role": "assistant", "content": null, "tool_calls": calls});
        let message = match (system.as_str(), turn) {
            ("planner", 0) => tool_calls(calls("researcher", 3)),
            ("researcher", 0) => tool_calls(calls("leaf", 2)),
            ("leaf", 0) => {
                let tool = if guard && first == "root.1.0" {
                    "guarded"
                } else {
                    "note"
                };
                tool_calls(vec![call(0, tool, json!({"text": first}))])
            }
            ("leaf", _) => json!({"role": "assistant", "content": format!("leaf {first}")}),
            _ => {
                json!({"role": "assistant", "content": format!("{first} [{}]", results.join(" | "))})
            }
        };
        std::thread::sleep(Duration::from_millis(20));
        Response::json(
            200,
            json!({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5}})
            .to_string(),
        )
    })
}

/// The http tool: counts each request under its idempotency key.
fn tool_server(effects: Counts) -> Server {
    Server::start(move |req| {
        let key = req.header("idempotency-key").unwrap_or("none").to_string();
        *effects.lock().unwrap().entry(key).or_insert(0) += 1;
        std::thread::sleep(Duration::from_millis(20));
        Response::json(200, r#"{"ok":true}"#)
    })
}

fn manifests(model: u16, tools: u16) -> String {
    manifests_with(model, tools, "")
}

/// [`manifests`] with `planner_policy` (YAML lines under `spec:`) added to
/// the planner.
fn manifests_with(model: u16, tools: u16, planner_policy: &str) -> String {
    let agent = |name: &str, extra: &str| {
        format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n  description: the {name}\n  systemPrompt: {name}\n  model: {{provider: openai, openai: {{baseUrl: \"http://127.0.0.1:{model}/v1\", model: m}}}}\n{extra}"
        )
    };
    let leaf_tools = format!(
        "  tools:\n  - {{name: note, http: {{url: \"http://127.0.0.1:{tools}/note\"}}}}\n  - {{name: guarded, http: {{url: \"http://127.0.0.1:{tools}/guarded\"}}}}\n  policy:\n    default: runSync\n    rules:\n    - {{tool: guarded, disposition: runSync, approval: true}}\n"
    );
    [
        agent(
            "planner",
            &format!("  tools:\n  - name: researcher\n    agent: {{ref: researcher}}\n{planner_policy}"),
        ),
        agent("researcher", "  tools:\n  - name: leaf\n    agent: {ref: leaf}\n"),
        agent("leaf", &leaf_tools),
        "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {name: root}\nspec: {agentRef: {name: planner}, messages: [root]}\n".to_string(),
    ]
    .concat()
}

/// The last JSON line of a run's output.
fn last_event(out: &str) -> Value {
    serde_json::from_str(out.lines().last().unwrap_or_default()).unwrap_or(Value::Null)
}

/// The tree as `agents session tree root -o json` shows it, flattened:
/// name -> (phase, depth, callId).
fn tree(s: &Scratch) -> BTreeMap<String, (String, u64, String)> {
    let text = s
        .run(&["session", "tree", "root", "-o", "json"])
        .ok()
        .to_string();
    let mut all = BTreeMap::new();
    fn walk(n: &Value, all: &mut BTreeMap<String, (String, u64, String)>) {
        all.insert(
            n["name"].as_str().unwrap().to_string(),
            (
                n["phase"].as_str().unwrap().to_string(),
                n["depth"].as_u64().unwrap(),
                n["callId"].as_str().unwrap_or("").to_string(),
            ),
        );
        for c in n["children"].as_array().unwrap() {
            walk(c, all);
        }
    }
    walk(&serde_json::from_str(&text).unwrap(), &mut all);
    all
}

/// Every session of the tree succeeded, each made once (10, no child of a
/// later attempt), the root's answer quotes each leaf once, and each
/// leaf's side effect went out under one key of its own.
fn check_tree(s: &Scratch, effects: &Counts) {
    let all = tree(s);
    assert_eq!(all.len(), 10, "{all:#?}");
    assert!(all.values().all(|(p, _, _)| p == "Succeeded"), "{all:#?}");
    let depths: Vec<u64> = all.values().map(|(_, d, _)| *d).collect();
    assert_eq!(depths.iter().filter(|d| **d == 2).count(), 6, "{all:#?}");
    assert!(all.contains_key("root-t1-c1-t1-c0"), "{all:#?}");
    let listed = s.run(&["session", "list", "-o", "json"]).ok().to_string();
    let listed: Vec<Value> = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.len(), 10, "each session made once: {listed:?}");
    let show = s
        .run(&["session", "show", "root", "-o", "json"])
        .ok()
        .to_string();
    let answer = serde_json::from_str::<Value>(&show).unwrap()["session"]["answer"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    for i in 0..3 {
        for j in 0..2 {
            let leaf = format!("leaf root.{i}.{j}");
            assert_eq!(answer.matches(&leaf).count(), 1, "root's answer: {answer}");
        }
    }
    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), 6, "one key per leaf's call: {effects:?}");
    assert!(
        effects.keys().all(|k| k.contains("root-t1-c")),
        "keys name the child session: {effects:?}"
    );
}

#[test]
fn a_tree_of_sub_agents_runs_in_one_agents_run() {
    let (turns, effects) = (Counts::default(), Counts::default());
    let (model, tools) = (model(turns.clone(), false), tool_server(effects.clone()));
    let s = Scratch::new("subagents-tree");
    let file = s.write("tree.yaml", &manifests(model.port, tools.port));
    let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
    let out = run.ok();
    assert_eq!(last_event(out)["event"], "finished", "{out}");
    check_tree(&s, &effects);
    let turns = turns.lock().unwrap().clone();
    assert_eq!(turns.len(), 2 + 3 * 2 + 6 * 2, "{turns:?}");
    assert!(turns.values().all(|n| *n == 1), "each turn once: {turns:?}");
    assert!(
        effects.lock().unwrap().values().all(|n| *n == 1),
        "each side effect sent once"
    );
    // A session's usage takes in its children's (as under the operator):
    // a researcher's own 30 and its two leaves' 30 each.
    let text = s.run(&["session", "tree", "root"]).ok().to_string();
    assert!(
        text.contains("  root-t1-c0 [Succeeded] agent researcher depth 1 call t1-c0 tokens 90"),
        "{text}"
    );
}

#[test]
fn a_grandchild_waiting_for_approval_yields_the_tree_until_approved_from_the_root() {
    let (turns, effects) = (Counts::default(), Counts::default());
    let (model, tools) = (model(turns.clone(), true), tool_server(effects.clone()));
    let s = Scratch::new("subagents-wait");
    let file = s.write("tree.yaml", &manifests(model.port, tools.port));
    let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
    let yielded = last_event(run.ok());
    assert_eq!(yielded["event"], "yielded", "{}", run.ok());
    assert_eq!(yielded["session"], "root");
    let pending = yielded["pending"].as_array().unwrap();
    assert_eq!(
        pending.len(),
        1,
        "only the grandchild's approval: {pending:?}"
    );
    assert_eq!(pending[0]["waitingFor"], "approval");
    assert_eq!(
        pending[0]["path"],
        json!(["root", "root-t1-c1", "root-t1-c1-t1-c0"])
    );
    let token = pending[0]["token"].as_str().unwrap().to_string();
    // Every other branch finished meanwhile.
    let all = tree(&s);
    let done = all.values().filter(|(p, _, _)| p == "Succeeded").count();
    assert_eq!(
        done, 7,
        "all but the waiting leaf, its parent and the root: {all:#?}"
    );

    let listed = s.run(&["session", "pending", "root"]).ok().to_string();
    assert!(
        listed.contains(&token) && listed.contains("in root > root-t1-c1 > root-t1-c1-t1-c0"),
        "{listed}"
    );
    let listed = s
        .run(&["session", "pending", "root", "-o", "json"])
        .ok()
        .to_string();
    let listed: Vec<Value> = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["token"], token.as_str());

    let approved = s.run(&["session", "approve", &token]).ok().to_string();
    assert!(
        approved.contains("agents session resume root"),
        "the hint resumes the tree: {approved}"
    );
    let resumed = s.run(&["session", "resume", "root", "-o", "json"]);
    assert_eq!(
        last_event(resumed.ok())["event"],
        "finished",
        "{}",
        resumed.ok()
    );
    check_tree(&s, &effects);
    let turns = turns.lock().unwrap().clone();
    assert!(turns.values().all(|n| *n == 1), "each turn once: {turns:?}");
}

#[test]
fn a_tree_sigkilled_at_random_moments_and_resumed_makes_each_child_and_effect_once() {
    let mut rng = support::rng::Rng::from_env_or_time();
    let kills_wanted = support::sized("AGENTS_SUBAGENT_KILLS", 5);
    let (turns, effects) = (Counts::default(), Counts::default());
    let (model, tools) = (model(turns.clone(), false), tool_server(effects.clone()));
    let s = Scratch::new("subagents-kill");
    let file = s.write("tree.yaml", &manifests(model.port, tools.port));
    let file = file.display().to_string();
    let (mut kills, mut processes) = (0, 0);
    loop {
        processes += 1;
        assert!(processes < 60, "no end after 60 processes");
        let stored = s.path("agents.db").exists()
            && s.run(&["session", "show", "root", "-o", "json"]).code == 0;
        let args: Vec<&str> = if stored {
            vec!["session", "resume", "root", "-o", "json"]
        } else {
            vec!["run", "-f", &file, "-o", "json"]
        };
        let mut child = s.spawn(&args);
        if kills < kills_wanted {
            std::thread::sleep(Duration::from_millis(rng.below(400)));
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap(); // SIGKILL
                kills += 1;
                child.wait().unwrap();
                continue;
            }
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "`agents {}` failed:\n{stdout}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        if last_event(&stdout)["event"] == "finished" {
            break;
        }
    }
    eprintln!("{processes} processes, {kills} SIGKILLed");
    assert!(kills > 0, "the test killed nothing; it proves nothing");
    check_tree(&s, &effects);
    // A model call or a side effect cut by a kill goes again (its result
    // was never recorded), under the same turn and the same key.
    let turns = turns.lock().unwrap().clone();
    assert_eq!(turns.len(), 2 + 3 * 2 + 6 * 2, "{turns:?}");
    assert!(
        turns.values().all(|n| *n as usize <= 1 + kills),
        "{turns:?}"
    );
    let effects = effects.lock().unwrap().clone();
    eprintln!(
        "turns asked again: {:?}",
        turns.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    eprintln!(
        "side effects sent again under their key: {:?}",
        effects.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
}

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
fn a_child_answers_its_call_and_a_call_without_a_prompt_is_refused() {
    let s = Scratch::new("subagents");
    let file = s.write("planner.yaml", PLANNER);
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    let out = run.ok();
    assert!(out.contains("session plan succeeded"), "{out}");
    let show = s.run(&["session", "show", "plan", "-o", "json"]);
    let text = show.ok().to_string();
    assert!(
        text.contains(r#""content":"facts""#) || text.contains("facts"),
        "the first call's result is the child's answer: {text}"
    );
    assert!(
        text.contains(r#"needs a \"prompt\" argument"#),
        "the second call is refused: {text}"
    );
    let child = s.run(&["session", "show", "plan-t1-c0"]).ok().to_string();
    assert!(
        child.contains("Succeeded") && child.contains("answer: facts"),
        "{child}"
    );
}

#[test]
fn an_agent_tool_naming_an_agent_the_file_lacks_is_refused_before_anything_is_stored() {
    let s = Scratch::new("subagents-missing");
    let text = PLANNER.replacen("metadata: {name: researcher}", "metadata: {name: other}", 1);
    let file = s.write("planner.yaml", &text);
    let run = s.run(&["run", "-f", &file.display().to_string()]);
    run.fails_with("has an agent tool naming Agent \"researcher\", which is not in this file");
    assert!(!s.path("agents.db").exists(), "nothing stored");
}

/// Turns a store back into the schema before trees (v2): the new columns
/// and index dropped, the version set back, as a build before this one
/// left it.
fn to_schema_v2(db: &std::path::Path) {
    let c = rusqlite::Connection::open(db).unwrap();
    c.execute_batch(
        "DROP INDEX sessions_by_parent;
         ALTER TABLE sessions DROP COLUMN parent;
         ALTER TABLE sessions DROP COLUMN parent_call;
         ALTER TABLE sessions DROP COLUMN depth;
         ALTER TABLE sessions DROP COLUMN root;
         PRAGMA user_version = 2;",
    )
    .unwrap();
}

fn schema_version(db: &std::path::Path) -> i64 {
    let c = rusqlite::Connection::open(db).unwrap();
    c.query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn a_store_of_the_schema_before_trees_opens_and_its_waiting_session_runs_on() {
    let s = Scratch::new("subagents-migrate");
    let file = repo_file("examples/approval.yaml").display().to_string();
    let run = s.run(&["run", "-f", &file, "-o", "json"]);
    assert_eq!(last_event(run.ok())["event"], "yielded", "{}", run.ok());
    let db = s.path("agents.db");
    to_schema_v2(&db);
    assert_eq!(schema_version(&db), 2);
    // Opened by this build: migrated, the session and its wait intact.
    let pending = s.run(&["session", "pending", "release", "-o", "json"]);
    let pending: Vec<Value> = serde_json::from_str(pending.ok()).unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(schema_version(&db), 3, "the store was migrated");
    let token = pending[0]["token"].as_str().unwrap();
    s.run(&["session", "approve", token]).ok();
    let resumed = s.run(&["session", "resume", "release", "-o", "json"]);
    assert_eq!(
        last_event(resumed.ok())["event"],
        "finished",
        "{}",
        resumed.ok()
    );
    let tree = s.run(&["session", "tree", "release"]).ok().to_string();
    assert!(
        tree.starts_with("release [Succeeded] agent release-helper depth 0"),
        "{tree}"
    );
}

/// An Agent that calls itself: each session asks one child, until the
/// depth limit refuses the call; then it answers.
const RECURSIVE: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: echo}
spec:
  maxDepth: 2
  maxChildren: 1
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {name: echo, arguments: {prompt: "deeper"}}
            - {name: echo, arguments: {prompt: "wider"}}
        - text: done
  tools:
    - name: echo
      agent: {ref: echo}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: top}
spec: {agentRef: {name: echo}, messages: [go]}
"#;

#[test]
fn the_depth_limit_refuses_a_call_naming_the_chain_and_max_children_runs_the_rest_in_turn() {
    let s = Scratch::new("subagents-limits");
    let file = s.write("echo.yaml", RECURSIVE);
    let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
    assert_eq!(last_event(run.ok())["event"], "finished", "{}", run.ok());
    // 1 + 2 + 4 sessions: depth 2 is the deepest; with maxChildren 1 the
    // second call of each waited its turn and ran too.
    let listed = s.run(&["session", "list", "-o", "json"]).ok().to_string();
    let listed: Vec<Value> = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.len(), 7, "{listed:?}");
    assert!(
        listed.iter().all(|l| l["phase"] == "Succeeded"),
        "{listed:?}"
    );
    let deepest = s.run(&["session", "show", "top-t1-c0-t1-c1", "-o", "json"]);
    let text = deepest.ok().to_string();
    assert!(
        text.contains("sub-agent call refused (a cycle: echo is already on the call stack): a child at depth 3 passes maxDepth 2; the chain is echo (top) -> echo (top-t1-c0) -> echo (top-t1-c0-t1-c1) -> echo"),
        "{text}"
    );
}

const FAILING_CHILD: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: broken}
spec:
  model: {provider: scripted, scripted: {replies: []}}
---
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: boss}
spec:
  model: {provider: scripted, scripted: {replies: [{toolCalls: [{name: broken, arguments: {prompt: go}}]}, {text: done}]}}
  tools:
    - name: broken
      agent: {ref: broken}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: root}
spec: {agentRef: {name: boss}, messages: [go]}
"#;

#[test]
fn a_child_that_fails_gives_its_call_an_error_result_naming_it() {
    let s = Scratch::new("subagents-fail");
    let file = s.write("fail.yaml", FAILING_CHILD);
    let out = s
        .run(&["run", "-f", &file.display().to_string()])
        .ok()
        .to_string();
    assert!(out.contains("session root succeeded"), "{out}");
    let show = s.run(&["session", "show", "root"]).ok().to_string();
    assert!(
        show.contains(
            "error: the sub-agent broken (session root-t1-c0) failed: the model call failed"
        ),
        "{show}"
    );
    let tree = s.run(&["session", "tree", "root"]).ok().to_string();
    assert!(
        tree.contains("root-t1-c0 [Failed] agent broken depth 1 call t1-c0"),
        "{tree}"
    );
}

/// `agents session pause root` from another process while a leaf's first
/// model turn is under way: the leaf (driven inside its parent's step,
/// inside the root's) ends its step, and then no session of the tree takes
/// another (the other leaf and researchers are made but not driven), and
/// `agents run` ends paused. `agents
/// session resume root` runs the tree on to its end, each turn asked once.
#[test]
fn a_paused_root_pauses_the_child_under_way_and_resume_runs_the_tree_on() {
    let (turns, effects) = (Counts::default(), Counts::default());
    let s = Scratch::new("subagents-pause");
    let pause = s.cmd(&["session", "pause", "root"]);
    let pause = Mutex::new(Some(pause));
    let model = model_with(turns.clone(), false, move |turn| {
        if turn == "root.0.0/0" {
            if let Some(mut cmd) = pause.lock().unwrap().take() {
                let out = cmd.output().expect("agents session pause");
                assert!(out.status.success(), "{out:?}");
            }
        }
    });
    let tools = tool_server(effects.clone());
    let file = s.write("tree.yaml", &manifests(model.port, tools.port));
    let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
    let out = run.ok();
    assert_eq!(last_event(out)["event"], "paused", "{out}");
    // The leaf's step under way runs to its end (its effect and its
    // answer); no other session takes a step.
    let asked = turns.lock().unwrap().clone();
    let under_way = ["root/0", "root.0/0", "root.0.0/0", "root.0.0/1"];
    assert!(
        asked.keys().all(|t| under_way.contains(&t.as_str())),
        "nothing else steps once the root is paused: {asked:?}"
    );
    assert!(asked.values().all(|n| *n == 1), "{asked:?}");

    let resumed = s.run(&["session", "resume", "root", "-o", "json"]);
    let out = resumed.ok();
    assert_eq!(last_event(out)["event"], "finished", "{out}");
    check_tree(&s, &effects);
    let turns = turns.lock().unwrap().clone();
    assert_eq!(turns.len(), 2 + 3 * 2 + 6 * 2, "{turns:?}");
    assert!(turns.values().all(|n| *n == 1), "each turn once: {turns:?}");
}

/// A `timeoutSeconds` decorator on the `agent` tool bounds the in-process
/// child: the third researcher's model does not answer in time, so its
/// call ends with a timeout the model is told of, the child (still in its
/// first turn) is stopped (`Failed`, saying why) and never asked again,
/// and the root finishes with the other two researchers' answers.
#[test]
fn an_agent_tools_timeout_stops_the_in_process_child_and_tells_the_model() {
    let (turns, effects) = (Counts::default(), Counts::default());
    let model = model_with(turns.clone(), false, |turn| {
        if turn == "root.2/0" {
            std::thread::sleep(Duration::from_secs(10));
        }
    });
    let tools = tool_server(effects.clone());
    let s = Scratch::new("subagents-timeout");
    let policy = "  policy:\n    rules:\n    - {tool: researcher, disposition: runSync, timeoutSeconds: 4}\n";
    let file = s.write("tree.yaml", &manifests_with(model.port, tools.port, policy));
    let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
    let out = run.ok();
    assert_eq!(last_event(out)["event"], "finished", "{out}");
    let show = s
        .run(&["session", "show", "root", "-o", "json"])
        .ok()
        .to_string();
    let answer = serde_json::from_str::<Value>(&show).unwrap()["session"]["answer"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        answer.contains("timed out after 4s waiting for the sub-agent"),
        "the model is told: {answer}"
    );
    assert!(answer.contains("leaf root.1.1"), "{answer}");
    let all = tree(&s);
    assert_eq!(all["root"].0, "Succeeded", "{all:#?}");
    assert_eq!(all["root-t1-c2"].0, "Failed", "{all:#?}");
    assert_eq!(
        all.len(),
        1 + 3 + 4,
        "the stopped child made no leaves: {all:#?}"
    );
    let child = s
        .run(&["session", "show", "root-t1-c2", "-o", "json"])
        .ok()
        .to_string();
    let failure = serde_json::from_str::<Value>(&child).unwrap()["session"]["failure"].clone();
    assert!(
        failure.as_str().unwrap_or_default().contains("timed out"),
        "the child says why it stopped: {child}"
    );
    let turns = turns.lock().unwrap().clone();
    assert!(!turns.contains_key("root.2/1"), "{turns:?}");
    assert!(turns.values().all(|n| *n == 1), "each turn once: {turns:?}");
}
