//! `agents session tree NAME`: a session and its sub-agent descendants
//! (the cluster's Sessions linked by `spec.parent`), with each one's
//! phase, the call that made it, its depth and its token usage, and its
//! forks (`spec.forkFrom`), marked as such. On the embedded store, the
//! sessions `agents run` made under it and its forks.

use super::OutputFormat;
use crate::api::Session;
use crate::core::SessionId;
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use serde_json::{json, Value};
use std::process::ExitCode;

/// Lineage deeper than this is not followed (a hand-written `forkFrom`
/// could name a session that names it back).
const MAX_LINEAGE_DEPTH: usize = 64;

/// One session of the tree, its children and forks after it.
fn node(s: &Session, all: &[Session]) -> Value {
    node_at(s, all, 0)
}

fn node_at(s: &Session, all: &[Session], depth: usize) -> Value {
    let status = s.status.as_ref();
    let below = |related: fn(&Session, &Session) -> bool| -> Vec<Value> {
        if depth >= MAX_LINEAGE_DEPTH {
            return Vec::new();
        }
        all.iter()
            .filter(|c| related(c, s))
            .map(|c| node_at(c, all, depth + 1))
            .collect()
    };
    let (children, forks) = (below(is_child_of), below(is_fork_of));
    json!({
        "forkedAtTurn": s.spec.fork_from.as_ref().map(|f| f.turn),
        "forks": forks,
        "name": s.name_any(),
        "agent": s.spec.agent_ref.as_ref().map(|a| a.name.clone()),
        "phase": status.map(|st| format!("{:?}", st.phase)).unwrap_or_else(|| "Pending".into()),
        "callId": s.spec.parent.as_ref().map(|p| p.call_id.clone()),
        "depth": s.spec.parent.as_ref().map_or(0, |p| p.depth),
        "usage": status.map(|st| st.usage).unwrap_or_default(),
        "children": children,
    })
}

/// The tree as indented text, one line a session.
pub fn render(tree: &Value, indent: usize, out: &mut String) {
    let usage = &tree["usage"];
    let tokens = usage["promptTokens"].as_u64().unwrap_or(0)
        + usage["completionTokens"].as_u64().unwrap_or(0);
    let call = tree["callId"]
        .as_str()
        .map(|c| format!(" call {c}"))
        .unwrap_or_default();
    let (fork, at) = match tree["forkedAtTurn"].as_u64() {
        Some(turn) => ("fork ", format!(" forked at turn {turn}")),
        None => ("", String::new()),
    };
    out.push_str(&format!(
        "{}{fork}{} [{}] agent {} depth {}{call}{at} tokens {tokens}\n",
        "  ".repeat(indent),
        tree["name"].as_str().unwrap_or("?"),
        tree["phase"].as_str().unwrap_or("?"),
        tree["agent"].as_str().unwrap_or("inline"),
        tree["depth"],
    ));
    for c in tree["children"].as_array().into_iter().flatten() {
        render(c, indent + 1, out);
    }
    for f in tree["forks"].as_array().into_iter().flatten() {
        render(f, indent + 1, out);
    }
}

/// Whether `fork` was forked from `source`: named by its `spec.forkFrom`,
/// and, once its history is written, by the source's UID too (a source
/// deleted and re-created is another session).
fn is_fork_of(fork: &Session, source: &Session) -> bool {
    let Some(from) = &fork.spec.fork_from else {
        return false;
    };
    let uid = fork
        .status
        .as_ref()
        .and_then(|st| st.forked_from.as_ref())
        .map(|f| f.uid.clone());
    from.session == source.name_any()
        && fork.name_any() != source.name_any()
        && uid.is_none_or(|u| Some(u) == source.uid())
}

/// Whether `child` was made by `parent` (named by it, with its UID).
fn is_child_of(child: &Session, parent: &Session) -> bool {
    child
        .spec
        .parent
        .as_ref()
        .is_some_and(|p| p.name == parent.name_any() && Some(&p.uid) == parent.uid().as_ref())
}

/// `root` and its descendants among `all`, parents before their children,
/// each with its path from `root` (`root`'s own name first).
pub fn subtree<'a>(root: &'a Session, all: &'a [Session]) -> Vec<(Vec<String>, &'a Session)> {
    let mut out = Vec::new();
    let mut todo = vec![(vec![root.name_any()], root)];
    while let Some((path, s)) = todo.pop() {
        let mut kids: Vec<&Session> = all.iter().filter(|c| is_child_of(c, s)).collect();
        kids.sort_by_key(|c| std::cmp::Reverse(c.name_any()));
        for c in kids {
            let mut p = path.clone();
            p.push(c.name_any());
            todo.push((p, c));
        }
        out.push((path, s));
    }
    out
}

/// A session's path from the root of its tree, as `spec.parent` records
/// it (`root > child > grandchild`); just its name for a root.
pub fn path_of(s: &Session) -> String {
    let mut parts: Vec<String> = match &s.spec.parent {
        Some(p) if p.stack.is_empty() => vec![p.name.clone()],
        Some(p) => p.stack.iter().map(|e| e.session.clone()).collect(),
        None => Vec::new(),
    };
    parts.push(s.name_any());
    parts.join(" > ")
}

/// The tree under `name`, from the Sessions of the namespace.
pub fn tree(name: &str, all: &[Session]) -> anyhow::Result<Value> {
    let root = all.iter().find(|s| s.name_any() == name).ok_or_else(|| {
        anyhow::anyhow!("session {name} not found; `kubectl get sessions` lists them")
    })?;
    Ok(node(root, all))
}

pub async fn run(
    name: &str,
    store: &str,
    namespace: Option<&str>,
    output: OutputFormat,
) -> anyhow::Result<ExitCode> {
    if store != "kube" {
        let sel = crate::standalone::commands::StoreSel::new(store, None);
        let opened = crate::standalone::commands::open(&sel).await?;
        let tree =
            crate::standalone::children::tree(opened.as_ref(), &SessionId(name.into())).await?;
        return print(&tree, output);
    }
    let config = kube::Config::infer()
        .await
        .map_err(|e| anyhow::anyhow!("--store kube: no usable kubeconfig ({e})"))?;
    let ns = namespace
        .map(str::to_string)
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config)?;
    let all = Api::<Session>::namespaced(client, &ns)
        .list(&ListParams::default())
        .await?
        .items;
    print(&tree(name, &all)?, output)
}

fn print(tree: &Value, output: OutputFormat) -> anyhow::Result<ExitCode> {
    if output == OutputFormat::Json {
        crate::standalone::out::line(&serde_json::to_string_pretty(tree)?);
    } else {
        let mut out = String::new();
        render(tree, 0, &mut out);
        crate::standalone::out::text(&out);
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(name: &str, uid: &str, parent: Option<(&str, &str, u32)>) -> Session {
        let mut spec = json!({"messages": ["x"], "agentRef": {"name": "a"}});
        if let Some((p, puid, depth)) = parent {
            spec["parent"] = json!({"name": p, "uid": puid, "callId": "t1-c0", "depth": depth});
        }
        let mut s = Session::new(name, serde_json::from_value(spec).unwrap());
        s.metadata.uid = Some(uid.into());
        s
    }

    #[test]
    fn a_sessions_path_comes_from_its_call_stack() {
        let mut s = session("c2", "u2", Some(("c1", "u1", 2)));
        assert_eq!(path_of(&s), "c1 > c2", "no stack: the parent alone");
        s.spec.parent.as_mut().unwrap().stack = serde_json::from_value(json!([
            {"agent": "a", "session": "root", "depth": 0},
            {"agent": "b", "session": "c1", "depth": 1}
        ]))
        .unwrap();
        assert_eq!(path_of(&s), "root > c1 > c2");
        assert_eq!(path_of(&session("root", "u0", None)), "root");
    }

    #[test]
    fn a_tree_shows_each_child_under_its_parent_by_uid() {
        let all = vec![
            session("root", "u0", None),
            session("root-t1-c0", "u1", Some(("root", "u0", 1))),
            session("root-t1-c0-t1-c0", "u2", Some(("root-t1-c0", "u1", 2))),
            // Names a parent of another UID (a re-created root): not ours.
            session("stale", "u3", Some(("root", "old", 1))),
        ];
        let t = tree("root", &all).unwrap();
        let mut text = String::new();
        render(&t, 0, &mut text);
        assert_eq!(
            text,
            "root [Pending] agent a depth 0 tokens 0\n  root-t1-c0 [Pending] agent a depth 1 call t1-c0 tokens 0\n    root-t1-c0-t1-c0 [Pending] agent a depth 2 call t1-c0 tokens 0\n"
        );
        let order: Vec<String> = subtree(&all[0], &all)
            .into_iter()
            .map(|(path, _)| path.join(" > "))
            .collect();
        assert_eq!(
            order,
            [
                "root",
                "root > root-t1-c0",
                "root > root-t1-c0 > root-t1-c0-t1-c0"
            ]
        );
        assert!(tree("nope", &all)
            .unwrap_err()
            .to_string()
            .contains("not found"));
    }

    fn fork(name: &str, uid: &str, source: &str, seeded_from_uid: Option<&str>) -> Session {
        let mut s = session(name, uid, None);
        s.spec.fork_from = Some(crate::api::session::ForkFrom {
            session: source.into(),
            turn: 1,
        });
        if let Some(source_uid) = seeded_from_uid {
            let forked_from = crate::core::fork::ForkedFrom {
                session: source.into(),
                uid: source_uid.into(),
                turn: 1,
            };
            s.status = Some(crate::api::session::SessionStatus {
                forked_from: Some(forked_from),
                ..Default::default()
            });
        }
        s
    }

    #[test]
    fn a_tree_shows_forks_marked_as_forks_by_the_sources_uid() {
        let all = vec![
            session("root", "u0", None),
            session("root-t1-c0", "u1", Some(("root", "u0", 1))),
            fork("f1", "u2", "root", Some("u0")),
            // Not written yet: known by the source's name.
            fork("f2", "u3", "root", None),
            // Forked from an earlier session of that name: not ours.
            fork("stale", "u4", "root", Some("old")),
            fork("f1-again", "u5", "f1", Some("u2")),
        ];
        let t = tree("root", &all).unwrap();
        let mut text = String::new();
        render(&t, 0, &mut text);
        assert_eq!(
            text,
            "root [Pending] agent a depth 0 tokens 0\n  root-t1-c0 [Pending] agent a depth 1 call t1-c0 tokens 0\n  fork f1 [Pending] agent a depth 0 forked at turn 1 tokens 0\n    fork f1-again [Pending] agent a depth 0 forked at turn 1 tokens 0\n  fork f2 [Pending] agent a depth 0 forked at turn 1 tokens 0\n"
        );
        assert_eq!(t["forks"][0]["forkedAtTurn"], 1);
        // A session naming itself is not its own fork.
        let own = vec![fork("me", "u9", "me", None)];
        assert_eq!(tree("me", &own).unwrap()["forks"], json!([]));
    }
}
