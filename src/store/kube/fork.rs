//! A fork in the cluster: a Session with `spec.forkFrom` and the
//! `agents-exe.io/fork-from` label; the operator writes its history.

use super::*;
use crate::api::session::{ForkFrom, FORK_LABEL};

impl KubeStore {
    /// Creates the Session of `fork` (its state already the source's
    /// prefix): the source's agent and limits, the fork's messages, and
    /// `spec.forkFrom`. `SessionExists` when the name is taken.
    pub(crate) async fn create_fork_session(
        &self,
        source: &SessionRecord,
        fork: &SessionRecord,
    ) -> StoreResult<()> {
        let id = fork.state.id.clone();
        let from = fork.state.forked_from.as_ref().ok_or_else(|| {
            StoreError::Backend(format!("session {id} is not a fork: it names no source"))
        })?;
        let source_id = &source.state.id;
        let source_obj = self
            .get_session(source_id)
            .await?
            .ok_or_else(|| StoreError::SessionNotFound(source_id.clone()))?;
        let from = ForkFrom {
            session: from.session.clone(),
            turn: from.turn,
        };
        let mut obj = Session::new(
            &id.0,
            fork_spec(&source_obj.spec, from, fork.input.messages.clone()),
        );
        obj.metadata.labels = Some(BTreeMap::from([(
            FORK_LABEL.to_string(),
            source_id.0.clone(),
        )]));
        self.count_write();
        match self
            .sessions_api()
            .create(&PostParams::default(), &obj)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_already_exists() => Err(StoreError::SessionExists(id)),
            Err(e) => Err(records::backend(e)),
        }
    }
}

/// The spec of a fork of a session with spec `source`: the same agent,
/// limits and retention; its own messages; no parent (a fork is a root of
/// its own, linked to its source by `forkFrom`).
pub fn fork_spec(source: &SessionSpec, from: ForkFrom, messages: Vec<String>) -> SessionSpec {
    SessionSpec {
        agent_ref: source.agent_ref.clone(),
        agent: source.agent.clone(),
        messages,
        paused: false,
        limits: source.limits.clone(),
        retry: None,
        ttl_seconds_after_finished: source.ttl_seconds_after_finished,
        parent: None,
        fork_from: Some(from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forks_spec_keeps_the_agent_and_limits_and_drops_what_was_the_sources_own() {
        let mut source: SessionSpec = serde_json::from_value(json!({
            "agentRef": {"name": "a"},
            "messages": ["old"],
            "paused": true,
            "retry": 2,
            "limits": {"maxTurns": 4},
            "ttlSecondsAfterFinished": 60,
        }))
        .unwrap();
        source.parent =
            serde_json::from_value(json!({"name": "p", "uid": "u", "callId": "t1-c0", "depth": 1}))
                .unwrap();
        let from = ForkFrom {
            session: "src".into(),
            turn: 2,
        };
        let spec = fork_spec(&source, from.clone(), vec!["new".into()]);
        assert_eq!(spec.agent_ref, source.agent_ref);
        assert_eq!(
            (spec.limits, spec.ttl_seconds_after_finished),
            (source.limits, Some(60))
        );
        assert_eq!(spec.messages, ["new"]);
        assert_eq!((spec.paused, spec.retry, spec.parent), (false, None, None));
        assert_eq!(spec.fork_from, Some(from));
    }
}
