//! A fake of the outside world for operator tests: one OpenAI-compatible
//! model and the http tools, behind tagged listeners, counting what they
//! are asked (model turns per session, side effects per idempotency key,
//! and who asked).
//!
//! The model script: turn 0 asks for `now` and `later`, the turns up to
//! `turns - 2` ask for `now`, the last one answers "done". A session's user
//! message is `work <session name>`.

use super::http::{Request, Response, Server};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the fake model and tool servers saw.
#[derive(Default)]
struct Seen {
    /// (session, turn) -> requests.
    turns: BTreeMap<(String, usize), u32>,
    /// Idempotency key -> requests.
    keys: BTreeMap<String, u32>,
    /// (session, turn) -> the listeners that took it, in order.
    turn_senders: BTreeMap<(String, usize), Vec<String>>,
    /// Idempotency key -> the listeners that took it, in order.
    senders: BTreeMap<String, Vec<String>>,
    /// (who, when) of every request: the listener that took it.
    /// (listener, when, path and key) of every request.
    log: Vec<(String, Instant, String)>,
}

/// One OpenAI-compatible model and the http tools, behind any number of
/// listeners ("ports"), each tagged: an operator given a listener as its
/// HTTP proxy is told apart from another by the tag.
#[derive(Clone)]
pub struct World {
    seen: Arc<Mutex<Seen>>,
    /// Model turns per session: turn 0 asks for `now` and `later`, turns
    /// up to `turns - 2` ask for `now`, the last answers.
    turns: usize,
    later_delay: Duration,
    /// How long the model takes to answer.
    model_delay: Duration,
    pub in_flight: Arc<AtomicUsize>,
}

impl World {
    pub fn new(turns: usize, later_delay: Duration) -> World {
        World {
            seen: Arc::default(),
            turns,
            later_delay,
            model_delay: Duration::from_millis(150),
            in_flight: Arc::default(),
        }
    }

    /// The same world with a model that takes `delay` to answer.
    pub fn with_model_delay(mut self, delay: Duration) -> World {
        self.model_delay = delay;
        self
    }

    /// A listener tagged `tag`; returns its port.
    pub fn listen(&self, tag: &str) -> u16 {
        let (world, tag) = (self.clone(), tag.to_string());
        Server::start(move |req| world.serve(req, &tag)).port
    }

    fn serve(&self, req: &Request, tag: &str) -> Response {
        let key = req.header("idempotency-key").unwrap_or("").to_string();
        // As a proxy the target is absolute: `req.path` is its path.
        let path = &req.path;
        self.seen.lock().unwrap().log.push((
            tag.to_string(),
            Instant::now(),
            format!("{path} {key}"),
        ));
        let reply = if path.ends_with("/chat/completions") {
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            let reply = self.model(&req.body, tag);
            std::thread::sleep(self.model_delay);
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            reply
        } else {
            let mut seen = self.seen.lock().unwrap();
            *seen.keys.entry(key.clone()).or_insert(0) += 1;
            seen.senders.entry(key).or_default().push(tag.to_string());
            drop(seen);
            std::thread::sleep(if path.ends_with("/later") {
                self.later_delay
            } else {
                Duration::from_millis(50)
            });
            r#"{"ok":true}"#.to_string()
        };
        Response::json(200, reply)
    }

    fn model(&self, body: &[u8], tag: &str) -> String {
        let req: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let messages = req["messages"].as_array().cloned().unwrap_or_default();
        let session = messages
            .iter()
            .find(|m| m["role"] == "user")
            .and_then(|m| m["content"].as_str())
            .and_then(|c| c.strip_prefix("work "))
            .unwrap_or("?")
            .to_string();
        let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
        let mut seen = self.seen.lock().unwrap();
        *seen.turns.entry((session.clone(), turn)).or_insert(0) += 1;
        seen.turn_senders
            .entry((session, turn))
            .or_default()
            .push(tag.to_string());
        drop(seen);
        let call = |id: String, name: &str| {
            serde_json::json!({"id": id, "type": "function",
                "function": {"name": name, "arguments": format!("{{\"turn\":{turn}}}")}})
        };
        let message = if turn + 1 >= self.turns {
            serde_json::json!({"role": "assistant", "content": "done"})
        } else if turn == 0 {
            serde_json::json!({"role": "assistant", "content": null,
                "tool_calls": [call(format!("n{turn}"), "now"), call(format!("l{turn}"), "later")]})
        } else {
            serde_json::json!({"role": "assistant", "content": null,
                "tool_calls": [call(format!("n{turn}"), "now")]})
        };
        serde_json::json!({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
            .to_string()
    }

    pub fn turns_seen(&self) -> BTreeMap<(String, usize), u32> {
        self.seen.lock().unwrap().turns.clone()
    }

    pub fn keys_seen(&self) -> BTreeMap<String, u32> {
        self.seen.lock().unwrap().keys.clone()
    }

    /// Requests taken by listener `tag` after `since`.
    pub fn requests_by_after(&self, tag: &str, since: Instant) -> usize {
        self.requests_after(tag, since).len()
    }

    /// What listener `tag` was asked after `since` (path and key).
    pub fn requests_after(&self, tag: &str, since: Instant) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|(t, at, _)| t == tag && *at > since)
            .map(|(_, at, what)| format!("{what} at +{:?}", at.duration_since(since)))
            .collect()
    }

    /// Every session asked each model turn once, and sent each call's side
    /// effect once under its own key; `allowed_repeats` turns may have been
    /// asked twice, and side effects whose senders `handover` allows sent
    /// twice (work cut off by a pause of the process that started it, taken
    /// over under the same key by the next one).
    pub fn check(&self, sessions: &[String], allowed_repeats: usize) {
        self.check_with(sessions, allowed_repeats, |_| false)
    }

    pub fn check_with(
        &self,
        sessions: &[String],
        allowed_repeats: usize,
        handover: impl Fn(&[String]) -> bool,
    ) {
        let turns = self.turns_seen();
        let keys = self.keys_seen();
        let turn_senders = self.seen.lock().unwrap().turn_senders.clone();
        let mut repeated = Vec::new();
        for s in sessions {
            for t in 0..self.turns {
                let key = (s.clone(), t);
                match turns.get(&key) {
                    Some(1) => {}
                    Some(_) if handover(&turn_senders[&key]) => {}
                    Some(n) => repeated.push(format!("{s} turn {t}: {n} times")),
                    None => panic!("{s} turn {t} was never asked: {turns:?}"),
                }
            }
        }
        assert!(
            repeated.len() <= allowed_repeats,
            "model turns asked more than once: {repeated:?}"
        );
        // Calls: `now` on every turn but the last, `later` on turn 0.
        let calls_per_session = self.turns;
        let senders = self.seen.lock().unwrap().senders.clone();
        let sent_again: Vec<_> = keys
            .iter()
            .filter(|(k, n)| **n > 1 && !handover(&senders[*k]))
            .collect();
        let taken_over = keys.iter().filter(|(_, n)| **n > 1).count() - sent_again.len();
        eprintln!(
            "{} sessions: {} model requests, {} distinct keys, repeated turns {repeated:?}, keys sent again {sent_again:?}, keys taken over by the next driver {taken_over}",
            sessions.len(),
            turns.values().sum::<u32>(),
            keys.len()
        );
        for s in sessions {
            let mine: BTreeSet<&String> = keys
                .keys()
                .filter(|k| k.contains(&format!("/{s}/")))
                .collect();
            assert_eq!(
                mine.len(),
                calls_per_session,
                "{s}: one key per call: {mine:?}"
            );
        }
        assert!(
            sent_again.is_empty(),
            "every side effect once: {sent_again:?}"
        );
    }
}

/// `n` Sessions `<prefix><i>` of Agent `agent`, each saying "go", as
/// YAML documents (each begins with `---`).
pub fn sessions(agent: &str, prefix: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: {prefix}{i}}}\nspec: {{agentRef: {{name: {agent}}}, messages: [go]}}\n"))
        .collect()
}

/// An Agent `flow` with built-in tools: `now` (runSync) and `later`
/// (runAsync), then `answer`. It needs no server.
pub fn builtin_flow_agent(answer: &str) -> String {
    format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: flow}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: now, arguments: {{what: "the first thing"}}}}
            - {{name: later, arguments: {{what: "the second thing"}}}}
        - text: {answer}
  tools:
    - {{name: now, builtin: {{function: echo}}}}
    - {{name: later, builtin: {{function: echo}}}}
  policy:
    default: runSync
    rules:
      - {{tool: later, disposition: runAsync}}
"#
    )
}

/// An Agent `waits` whose one call waits for an outside party (`defer`),
/// then says "thanks".
pub const WAITING_AGENT: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: waits}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {name: ask, arguments: {what: "a number"}}
        - text: thanks
  tools:
    - {name: ask, builtin: {function: echo}}
  policy:
    default: defer
"#;

/// An Agent `worker` calling `now` (runSync) and `later` (runAsync) at the
/// http tools on `port`, and `sessions` Sessions `s<i>` of it ("work <i>").
pub fn flow_manifests(port: u16, sessions: usize) -> String {
    let mut out = format!(
        r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {{name: worker}}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {{name: now, arguments: {{step: 1}}}}
            - {{name: later, arguments: {{step: 2}}}}
        - toolCalls:
            - {{name: now, arguments: {{step: 3}}}}
        - text: finished
  tools:
    - {{name: now, http: {{url: "http://127.0.0.1:{port}/now"}}}}
    - {{name: later, http: {{url: "http://127.0.0.1:{port}/later"}}}}
  policy:
    default: runSync
    rules:
      - {{tool: later, disposition: runAsync}}
"#
    );
    for i in 0..sessions {
        out.push_str(&format!(
            "---\napiVersion: agents-exe.io/v1alpha1\nkind: Session\nmetadata: {{name: s{i}}}\nspec:\n  agentRef: {{name: worker}}\n  messages: [\"work {i}\"]\n"
        ));
    }
    out
}

/// A chat-completions server for a one-call payment flow: asks for one
/// `pay` call, then answers "done"; keeps the tool messages it is sent
/// (what the model saw).
#[allow(dead_code)]
pub fn pay_model_server() -> (Server, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tool_messages = seen.clone();
    let server = Server::start(move |req: &Request| {
        let req = req.json();
        let messages = req["messages"].as_array().cloned().unwrap_or_default();
        let tools: Vec<String> = messages
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| m["content"].to_string())
            .collect();
        let message = if tools.is_empty() {
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "pay", "arguments": "{\"eur\":5}"}}
            ]})
        } else {
            tool_messages.lock().unwrap().extend(tools);
            serde_json::json!({"role": "assistant", "content": "done"})
        };
        Response::json(
            200,
            serde_json::json!({"choices": [{"index": 0, "message": message}]}).to_string(),
        )
    });
    (server, seen)
}

/// A payment server that holds its first request for `hold` (the driver
/// is killed meanwhile) and answers later ones at once.
#[allow(dead_code)]
pub fn held_payment_server(hold: Duration) -> Server {
    let first = Arc::new(Mutex::new(true));
    Server::start(move |_req: &Request| {
        if std::mem::replace(&mut *first.lock().unwrap(), false) {
            std::thread::sleep(hold);
        }
        Response::json(200, r#"{"paid":true}"#)
    })
}

/// A chat-completions server that always asks for one `echo` call and
/// reports usage: 600 prompt tokens (200 of them cached) and 100
/// completion tokens a turn; counts its requests (budget tests).
#[allow(dead_code)]
pub fn usage_model_server() -> (Server, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let server = Server::start(move |_req: &Request| {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        let message = serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": format!("c{n}"), "type": "function",
             "function": {"name": "echo", "arguments": "{\"n\":1}"}}
        ]});
        let body = serde_json::json!({
            "choices": [{"index": 0, "message": message}],
            "usage": {"prompt_tokens": 600, "completion_tokens": 100,
                      "prompt_tokens_details": {"cached_tokens": 200}}
        });
        Response::json(200, body.to_string())
    });
    (server, calls)
}
