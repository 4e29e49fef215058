//! A session's Continuations: listed, created or adopted, their wait fields, and results, decisions and answers written once.

use super::*;

impl KubeStore {
    /// The Continuation object named `token`, if there is one.
    async fn continuation_object(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<Continuation>> {
        self.continuations.get_opt(&token.0).await.map_err(backend)
    }

    /// A Continuation as the engine's record, its spilled result read back. A result that
    /// cannot be read (a bad spill marker, missing or oversized blobs) is
    /// the writer's mistake: that call fails with an error saying so, and
    /// the session carries on.
    pub(crate) async fn read_continuation(
        &self,
        c: &Continuation,
    ) -> StoreResult<ContinuationRecord> {
        let mut c = c.clone();
        let uid = controller_uid(&c).unwrap_or_default();
        if let Some(outcome) = c.status.as_mut().and_then(|s| s.outcome.as_mut()) {
            let unpacked =
                spill::unpack_result(&mut outcome.result, |blob| self.fetch_blob(&uid, blob));
            if let Err(why) = unpacked.await {
                outcome.result = convert::result_value(&malformed(&outcome.completed_by, &why));
            }
        }
        continuation_record(&c)
    }

    /// The continuation named `token` in this namespace.
    pub async fn get_continuation(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>> {
        match self.continuation_object(token).await? {
            None => Ok(None),
            Some(c) => self.read_continuation(&c).await.map(Some),
        }
    }

    /// The continuations of the live session `id` (its current UID), in
    /// call order.
    pub async fn session_continuations(
        &self,
        id: &SessionId,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        let obj = self
            .get_session(id)
            .await?
            .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
        let owner = SessionRef {
            id: id.clone(),
            namespace: self.namespace.clone(),
            uid: obj.uid().unwrap_or_default(),
        };
        self.list_owned(&owner).await
    }

    /// The continuations labelled with session `name`, whatever their
    /// owner: for hints, where only continuations may be readable.
    pub async fn labelled_continuations(
        &self,
        name: &SessionId,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        let list = self
            .continuations
            .list(&ListParams::default().labels(&format!("{SESSION_LABEL}={}", name.0)))
            .await
            .map_err(backend)?;
        let mut out = Vec::new();
        for c in &list.items {
            out.push(self.read_continuation(c).await?);
        }
        Ok(out)
    }

    pub(crate) async fn list_owned(
        &self,
        owner: &SessionRef,
    ) -> StoreResult<Vec<ContinuationRecord>> {
        let items = self.labelled_objects(&owner.id).await?;
        let mut out = Vec::new();
        let mut listed = HashMap::new();
        for c in items {
            if controller_uid(&c).as_deref() != Some(owner.uid.as_str()) {
                continue;
            }
            out.push(self.read_continuation(&c).await?);
            listed.insert(c.name_any(), c);
        }
        *self.listed.lock().expect("listed lock") = listed;
        self.listed_all.store(true, Ordering::SeqCst);
        out.sort_by_key(|r| (r.spec.call_id.turn, r.spec.call_id.index));
        Ok(out)
    }

    /// The Continuations labelled with session `id`: from the operator's
    /// watch when it is new enough for them, else listed by the API server.
    async fn labelled_objects(&self, id: &SessionId) -> StoreResult<Vec<Continuation>> {
        let watched = self.watched.as_ref();
        if let Some(cached) = watched.and_then(|w| w.labelled(&self.namespace, &id.0)) {
            return Ok(cached.iter().map(|c| Continuation::clone(c)).collect());
        }
        let list = self
            .continuations
            .list(&ListParams::default().labels(&format!("{SESSION_LABEL}={}", id.0)))
            .await
            .map_err(backend)?;
        if let Some(w) = watched {
            w.note_listed(&self.namespace, &id.0, &list.items);
        }
        Ok(list.items)
    }

    /// Notes an object the API server answered with (to a write of the
    /// object at version `based_on`, or a read), so that a step does not
    /// take the watch's older copy for the newest.
    fn note_live(&self, c: &Continuation, based_on: Option<&str>) {
        if let Some(w) = &self.watched {
            w.note_live(c, based_on);
        }
    }

    pub(crate) async fn ensure_continuation(
        &self,
        owner: &SessionRef,
        spec: &ContinuationSpec,
        _now: Millis,
    ) -> StoreResult<ContinuationRecord> {
        let name = &spec.token.0;
        // The engine re-ensures every open deferred call each step: one
        // listed in this step needs no call, nor one the watch is new
        // enough for (absent there is absent: a create refused as existing
        // adopts); else read before creating (a refused create is still a
        // write).
        let listed = self.listed.lock().expect("listed lock").get(name).cloned();
        let watched = self
            .watched
            .as_ref()
            .and_then(|w| w.labelled(&self.namespace, &owner.id.0));
        let known = match (listed, watched) {
            (Some(c), _) => Some(c),
            (None, Some(view)) => view
                .iter()
                .find(|c| c.name_any() == *name)
                .map(|c| Continuation::clone(c)),
            (None, None) => {
                let read = self.continuations.get_opt(name).await.map_err(backend)?;
                read.inspect(|c| self.note_live(c, None))
            }
        };
        let existing = match known {
            Some(c) => self.adopt(c, owner)?,
            None => self.create_continuation(owner, spec).await?,
        };
        self.set_wait(existing, spec).await
    }

    /// Creates the continuation, or adopts the one a racing driver created.
    pub(crate) async fn create_continuation(
        &self,
        owner: &SessionRef,
        spec: &ContinuationSpec,
    ) -> StoreResult<Continuation> {
        let name = &spec.token.0;
        let object = Continuation {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([(
                    SESSION_LABEL.to_string(),
                    owner.id.0.clone(),
                )])),
                owner_references: Some(vec![owner_reference(owner)]),
                ..Default::default()
            },
            spec: convert::continuation_spec(spec),
            status: None,
        };
        self.count_write();
        match self
            .continuations
            .create(&PostParams::default(), &object)
            .await
        {
            Ok(created) => {
                debug!(token = %name, session = %owner.id, "continuation created");
                self.note_live(&created, None);
                Ok(created)
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() || s.code == 409 => {
                let current = self
                    .continuations
                    .get_opt(name)
                    .await
                    .map_err(backend)?
                    .ok_or_else(|| {
                        StoreError::Backend(format!(
                            "continuation {name} was deleted while being adopted; try again"
                        ))
                    })?;
                self.note_live(&current, None);
                self.adopt(current, owner)
            }
            Err(e) if exceeded_quota(&e).is_some() => {
                Err(quota_held(format!("the Continuation {name}"), &e))
            }
            Err(e) => Err(backend(e)),
        }
    }

    /// What the call waits for now lives in status: set it when it differs
    /// (a new object, or an approved call now waiting for its runner), and
    /// read the continuation back.
    pub(crate) async fn set_wait(
        &self,
        existing: Continuation,
        spec: &ContinuationSpec,
    ) -> StoreResult<ContinuationRecord> {
        let name = &spec.token.0;
        let status = existing.status.clone().unwrap_or_default();
        let mut wanted = status.clone();
        convert::set_continuation_wait(&mut wanted, spec);
        let same = existing.status.is_some()
            && wanted.waiting_for == status.waiting_for
            && wanted.reason == status.reason
            && wanted.expires_at == status.expires_at;
        if status.outcome.is_some() || same {
            self.note_listed(&existing);
            return self.read_continuation(&existing).await;
        }
        let body = json!({
            "status": {
                "state": "Pending",
                "waitingFor": wanted.waiting_for,
                "reason": wanted.reason,
                "expiresAt": wanted.expires_at,
            }
        });
        self.count_write();
        match self
            .continuations
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(updated) => {
                self.note_live(&updated, existing.resource_version().as_deref());
                self.note_listed(&updated);
                return self.read_continuation(&updated).await;
            }
            // Completed meanwhile (the CEL rules refuse `Pending` next to an
            // outcome): the stored object is what counts.
            Err(kube::Error::Api(s)) if s.code == 422 || is_conflict(&s) => {
                debug!(token = %name, reason = %s.message, "wait fields not written; reading back");
            }
            Err(e) => return Err(backend(e)),
        }
        let current = self
            .continuations
            .get_opt(name)
            .await
            .map_err(backend)?
            .ok_or_else(|| StoreError::UnknownToken(spec.token.clone()))?;
        self.note_live(&current, None);
        self.note_listed(&current);
        self.read_continuation(&current).await
    }

    /// Notes a continuation's newest version in this step's listing.
    pub(crate) fn note_listed(&self, c: &Continuation) {
        self.listed
            .lock()
            .expect("listed lock")
            .insert(c.name_any(), c.clone());
    }

    /// Every continuation the session owns, as this step last saw or wrote
    /// them; `None` when the step did not list them. A continuation given an
    /// outcome in this step is left out: nothing waits on it any more.
    pub fn owned_continuations(&self) -> Option<Vec<Continuation>> {
        if !self.listed_all.load(Ordering::SeqCst) {
            return None;
        }
        let listed = self.listed.lock().expect("listed lock");
        Some(listed.values().cloned().collect())
    }

    /// `c` if its controller owner is this very session (same UID).
    pub(crate) fn adopt(&self, c: Continuation, owner: &SessionRef) -> StoreResult<Continuation> {
        let theirs = controller_uid(&c);
        if theirs.as_deref() == Some(owner.uid.as_str()) {
            return Ok(c);
        }
        Err(StoreError::Backend(format!(
            "continuation {} exists but is not this session's (its controller owner has uid {}; session {} has uid {}), so it is not adopted. A session re-created under the same name waits until the old one's continuations are garbage-collected; delete {} if it stays",
            c.name_any(),
            theirs.unwrap_or_else(|| "none".into()),
            owner.id,
            owner.uid,
            c.name_any()
        )))
    }

    pub(crate) async fn complete_continuation(
        &self,
        token: &ContinuationToken,
        result: &ToolResult,
        by: &str,
        now: Millis,
    ) -> StoreResult<WriteOnce> {
        let judge = |rec: &ContinuationRecord| acceptance::result(&rec.held(), result, by);
        let status = |obj: Continuation, rec: ContinuationRecord| async move {
            let mut value = convert::result_value(result);
            if serde_json::to_vec(&value).map_or(0, |v| v.len()) > CONTINUATION_INLINE_BYTES {
                let owner = SessionRef {
                    id: rec.spec.session.clone(),
                    namespace: self.namespace.clone(),
                    uid: controller_uid(&obj).unwrap_or_default(),
                };
                let prefix = blob_prefix(&owner.id.0, &owner.uid);
                let blobs = spill::pack_result(&prefix, &mut value);
                self.put_blobs(&owner, blobs).await?;
            }
            Ok(json!({
                "state": "Completed",
                "outcome": {
                    "result": value,
                    "completedBy": by,
                    "completedAt": convert::micro_time(now),
                }
            }))
        };
        self.write_once(token, "its result", judge, status).await
    }

    pub(crate) async fn decide_continuation(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<WriteOnce> {
        if let Some(at) = self.own_vote(token, decision).await? {
            return Ok(WriteOnce::AlreadySame {
                by: decision.by.clone(),
                at,
            });
        }
        let judge = |rec: &ContinuationRecord| acceptance::decision(&rec.held(), decision.approved);
        let entry = json!({
            "approved": decision.approved,
            "by": decision.by,
            "reason": decision.reason,
            "decidedAt": convert::time(decision.at),
            "arguments": decision.arguments,
            "raise": decision.raise,
        });
        let status = |obj: Continuation, rec: ContinuationRecord| {
            let entry = entry.clone();
            async move {
                if rec.spec.policy.decorators.approval_policy.is_none() {
                    return Ok(json!({ "decision": entry }));
                }
                let votes = obj.status.map(|s| s.decisions).unwrap_or_default();
                if votes.iter().any(|v| v.by == decision.by) {
                    return Err(StoreError::NotAccepting {
                        token: token.clone(),
                        why: format!(
                            "{} has already decided this call; the policy needs different people",
                            decision.by
                        ),
                    });
                }
                let mut list = serde_json::to_value(&votes).unwrap_or_default();
                if let Some(a) = list.as_array_mut() {
                    a.push(entry);
                }
                Ok(json!({ "decisions": list }))
            }
        };
        self.write_once(token, "its decision", judge, status).await
    }

    /// When this person already cast this same vote on a call decided by
    /// a quorum: a repeat (a CLI trying again after an answer it lost) is
    /// harmless, and tells the time of the vote that counts.
    pub(crate) async fn own_vote(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<Option<Millis>> {
        let Some(obj) = self.continuation_object(token).await? else {
            return Ok(None);
        };
        let votes = obj.status.map(|s| s.decisions).unwrap_or_default();
        Ok(votes
            .iter()
            .find(|v| v.by == decision.by && v.approved == decision.approved)
            .map(|v| convert::millis(&v.decided_at)))
    }

    /// Writes the answers to an MCP task's request for input (replacing
    /// any earlier ones; the server takes only outstanding keys).
    pub async fn answer_continuation(
        &self,
        token: &ContinuationToken,
        answers: &str,
        by: &str,
        now: Millis,
    ) -> StoreResult<()> {
        let body = json!({"status": {"answers": {
            "inputResponses": answers,
            "by": by,
            "answeredAt": convert::time(now),
        }}});
        self.count_write();
        match self
            .continuations
            .patch_status(&token.0, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                Err(StoreError::UnknownToken(token.clone()))
            }
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 403 => {
                Err(StoreError::NotAccepting {
                    token: token.clone(),
                    why: format!("the API server refused the answers: {}", s.message),
                })
            }
            Err(e) => Err(backend(e)),
        }
    }

    /// One write-once write: read the continuation, ask the rules
    /// (`judge`), and patch the `status` part over the version read. A lost
    /// race re-reads; the CRD's rules refusing it (422) are judged again on
    /// what is stored now.
    pub(crate) async fn write_once<J, S, F>(
        &self,
        token: &ContinuationToken,
        what: &str,
        judge: J,
        status: S,
    ) -> StoreResult<WriteOnce>
    where
        J: Fn(&ContinuationRecord) -> Verdict,
        S: Fn(Continuation, ContinuationRecord) -> F,
        F: std::future::Future<Output = StoreResult<Value>>,
    {
        for _ in 0..MAX_RETRIES {
            let Some(obj) = self.continuation_object(token).await? else {
                return Err(StoreError::UnknownToken(token.clone()));
            };
            let rec = self.read_continuation(&obj).await?;
            let verdict = judge(&rec);
            if verdict != Verdict::Write {
                return WriteOnce::judged(token, verdict);
            }
            let version = obj.resource_version();
            let body = json!({
                "metadata": {"resourceVersion": version},
                "status": status(obj, rec).await?,
            });
            self.count_write();
            self.listed.lock().expect("listed lock").remove(&token.0);
            match self
                .continuations
                .patch_status(&token.0, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(written) => {
                    self.note_live(&written, version.as_deref());
                    return Ok(WriteOnce::Recorded);
                }
                Err(kube::Error::Api(s)) if is_conflict(&s) => continue,
                Err(kube::Error::Api(s)) if s.code == 422 => {
                    let rec = self
                        .get_continuation(token)
                        .await?
                        .ok_or_else(|| StoreError::UnknownToken(token.clone()))?;
                    return match judge(&rec) {
                        Verdict::Write => Err(StoreError::NotAccepting {
                            token: token.clone(),
                            why: format!("the API server refused {what}: {}", s.message),
                        }),
                        verdict => WriteOnce::judged(token, verdict),
                    };
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    return Err(StoreError::UnknownToken(token.clone()))
                }
                Err(e) => return Err(backend(e)),
            }
        }
        Err(StoreError::Backend(format!(
            "{token} kept changing while {what} was written ({MAX_RETRIES} tries); try again"
        )))
    }
}
