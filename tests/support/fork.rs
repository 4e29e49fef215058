//! What the fork tests (`agents run` and the operator) share: an http tool
//! server that counts requests by `Idempotency-Key`, and the checks a fork
//! of `src` at turn 1 named `f` must pass.

use super::http::{Response, Server};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Requests by `Idempotency-Key`: the path and how many times.
pub type Keys = Arc<Mutex<BTreeMap<String, (String, usize)>>>;

/// A tool server counting requests by key; answers `body(path)` (JSON).
pub fn keyed_tool_server(body: impl Fn(&str) -> String + Send + Sync + 'static) -> (Server, Keys) {
    let keys: Keys = Default::default();
    let counted = keys.clone();
    let server = Server::start(move |req| {
        let key = req.header("idempotency-key").unwrap_or("").to_string();
        let mut keys = counted.lock().unwrap();
        keys.entry(key).or_insert((req.path.clone(), 0)).1 += 1;
        Response::json(200, body(&req.path))
    });
    (server, keys)
}

/// No key was sent twice: nothing ran again.
pub fn assert_each_key_once(keys: &BTreeMap<String, (String, usize)>) {
    assert!(
        keys.values().all(|(_, n)| *n == 1),
        "each key once: {keys:?}"
    );
}

/// `agents session tree src` shows the fork `f`, done, and where it forked.
pub fn assert_tree_shows_fork_f(tree: &str) {
    assert!(
        tree.contains("fork f [Succeeded]") && tree.contains("forked at turn 1"),
        "{tree}"
    );
}
