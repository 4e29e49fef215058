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
