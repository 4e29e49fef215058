//! `agents session import`: an export ([`super::export`]) written into
//! the embedded store or the cluster, under its own name or a new one.
//!
//! The state goes in as it was; the waits of its open calls go in as the
//! target store keeps them (a wait row standalone, a Continuation owned
//! by the Session in a cluster), named by tokens derived from the new
//! name, with any result or decision they had already received. On the
//! cluster the Session is created paused, so the operator starts nothing
//! before its state is written (over the created version), and released
//! after, when the export was not paused itself.

use super::children::StoredDefinition;
use super::commands::{open_store, StoreSel};
use super::export::{open_tokens, parse_export, SessionExport};
use crate::core::envelope::idempotency_key;
use crate::core::session::{ContinuationSpec, Scope};
use crate::core::{ContinuationToken, SessionId, SessionState};
use crate::ports::{
    AdminPort, ContinuationRecord, SessionPort, SessionRecord, SessionRef, StoreError, Version,
};
use crate::standalone::out;
use crate::store::kube::KubeStore;
use anyhow::{anyhow, bail, Context};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

/// An export made ready for its new place: named `id`, its tokens
/// derived from that name, and the waits of its open calls.
struct Moved {
    id: SessionId,
    export: SessionExport,
    carried: Vec<ContinuationRecord>,
}

pub async fn import(file: &Path, name: Option<&str>, sel: &StoreSel) -> anyhow::Result<ExitCode> {
    let shown = file.display().to_string();
    let text = crate::host::read_named_file(file, super::export::MAX_EXPORT_BYTES)
        .with_context(|| format!("reading {shown}"))?;
    let export = parse_export(&text, &shown)?;
    let id = SessionId(name.unwrap_or(&export.source.name).to_string());
    crate::core::ids::validate_name("session", &id.0).map_err(anyhow::Error::msg)?;
    let moved = retarget(export, &id)?;
    let place = if sel.url == "kube" {
        into_cluster(&moved, sel).await?
    } else {
        into_sqlite(&moved, &sel.url).await?
    };
    report(&moved, &place);
    Ok(ExitCode::SUCCESS)
}

fn report(moved: &Moved, place: &str) {
    let source = &moved.export.source;
    out::line(&format!(
        "imported session {} {place} (from {} {}), {:?}",
        moved.id, source.store, source.name, moved.export.state.phase
    ));
    for c in &moved.carried {
        let state = if c.is_completed() {
            "has its result"
        } else {
            "waits"
        };
        out::line(&format!(
            "  {} {} ({}) {state}",
            ContinuationToken::for_call(&moved.id, c.spec.call_id),
            c.spec.tool_call.name,
            c.spec.call_id
        ));
    }
}

/// The export renamed to `id`: the state's tokens follow the name (a
/// token is derived from it), and the continuations of its open calls
/// are kept, retargeted later, once the new session's scope is known.
fn retarget(mut export: SessionExport, id: &SessionId) -> anyhow::Result<Moved> {
    let open = open_tokens(&export.state);
    let carried: Vec<ContinuationRecord> = std::mem::take(&mut export.continuations)
        .into_iter()
        .filter(|c| open.contains(&c.spec.token))
        .collect();
    if export.state.id != *id {
        export.state = renamed(&export.state, id)?;
    }
    export.definition.session = id.0.clone();
    export.definition.spec.messages = export.input.messages.clone();
    // A session moved alone is a root where it lands, and its history is in
    // its state already (a fork's `forkedFrom` included): the operator must
    // not fork it again. The export keeps where it came from (`lineage`).
    export.definition.spec.parent = None;
    export.definition.spec.fork_from = None;
    Ok(Moved {
        id: id.clone(),
        export,
        carried,
    })
}

/// `state` under the name `id`, every token of the old name replaced by
/// the same call's token under the new one.
fn renamed(state: &SessionState, id: &SessionId) -> anyhow::Result<SessionState> {
    let mut value = serde_json::to_value(state)?;
    let mut map = BTreeMap::new();
    let open = state.open.iter().flat_map(|o| o.calls.iter()).map(|c| c.id);
    let results = state.turns.iter().flat_map(|t| match t {
        crate::core::Turn::User(u) => u.tool_results.iter().map(|r| r.call_id).collect(),
        crate::core::Turn::Agent(_) => Vec::new(),
    });
    for call in open.chain(results) {
        map.insert(
            ContinuationToken::for_call(&state.id, call).0,
            ContinuationToken::for_call(id, call).0,
        );
    }
    replace_tokens(&mut value, &map);
    let mut state: SessionState = serde_json::from_value(value)
        .map_err(|e| anyhow!("the renamed state cannot be read back: {e}"))?;
    state.id = id.clone();
    Ok(state)
}

fn replace_tokens(value: &mut Value, map: &BTreeMap<String, String>) {
    match value {
        Value::Object(fields) => {
            for (key, v) in fields.iter_mut() {
                match v {
                    Value::String(s) if key == "token" => {
                        if let Some(new) = map.get(s.as_str()) {
                            *s = new.clone();
                        }
                    }
                    other => replace_tokens(other, map),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| replace_tokens(v, map)),
        _ => {}
    }
}

/// A continuation's spec for the session `owner`: its token, session and
/// idempotency key derived anew. The cache key is dropped: it is scoped
/// to where the session was.
fn retarget_spec(spec: &ContinuationSpec, owner: &SessionRef) -> ContinuationSpec {
    let scope = Scope {
        namespace: owner.namespace.clone(),
        uid: owner.uid.clone(),
    };
    let mut spec = spec.clone();
    spec.token = ContinuationToken::for_call(&owner.id, spec.call_id);
    spec.session = owner.id.clone();
    spec.context.session = owner.id.clone();
    spec.context.idempotency_key = idempotency_key(&owner.id, &scope, &spec.call_id);
    spec.cache_key = None;
    spec
}

/// Makes the waits of the open calls in `store`, with what they had
/// received; `signer` signs them where the store allows only its
/// authenticated user (the cluster).
async fn write_continuations(
    store: &dyn AdminPort,
    owner: &SessionRef,
    carried: &[ContinuationRecord],
    signer: Option<&str>,
) -> anyhow::Result<()> {
    let now = super::driver::now();
    for c in carried {
        let spec = retarget_spec(&c.spec, owner);
        store.ensure(owner, &spec, c.created_at).await?;
        if let Some(decision) = &c.decision {
            let mut decision = decision.clone();
            if let Some(by) = signer {
                decision.by = by.to_string();
            }
            store.decide(&spec.token, &decision).await?;
        }
        if let Some(result) = &c.result {
            let by = signer.or(c.completed_by.as_deref()).unwrap_or("import");
            let at = c.completed_at.unwrap_or(now);
            store.complete(&spec.token, result, by, at).await?;
        }
    }
    Ok(())
}

fn record_for(moved: &Moved, namespace: &str, uid: &str) -> SessionRecord {
    let export = &moved.export;
    let definition = StoredDefinition {
        definition: export.definition.clone(),
        sub_agents: export.sub_agents.clone(),
    };
    SessionRecord {
        state: export.state.clone(),
        input: export.input.clone(),
        namespace: namespace.to_string(),
        uid: uid.to_string(),
        definition: definition.to_value(),
        created_at: export.created_at,
        updated_at: super::driver::now(),
        trace: None,
    }
}

fn name_taken(id: &SessionId, place: &str) -> anyhow::Error {
    anyhow!("session {id} already exists {place}; import it under another name with --name NEW, or delete the existing one first")
}

async fn into_sqlite(moved: &Moved, url: &str) -> anyhow::Result<String> {
    let store = open_store(url)?;
    let place = format!("in {url}");
    let record = record_for(moved, "", &uuid::Uuid::new_v4().to_string());
    match store.create_session(record.clone()).await {
        Err(StoreError::SessionExists(_)) => return Err(name_taken(&moved.id, &place)),
        other => other?,
    };
    let owner = super::driver::owner_of(&record);
    write_continuations(&store, &owner, &moved.carried, None).await?;
    Ok(place)
}

async fn into_cluster(moved: &Moved, sel: &StoreSel) -> anyhow::Result<String> {
    let store = KubeStore::from_kubeconfig(sel.namespace.as_deref()).await?;
    let place = store.place();
    let created = create_paused(&store, moved, &place).await?;
    let owner = SessionRef {
        id: moved.id.clone(),
        namespace: store.namespace().to_string(),
        uid: created.metadata.uid.clone().unwrap_or_default(),
    };
    let version = Version(
        created
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default(),
    );
    if let Err(e) = fill_cluster(&store, moved, &owner, version).await {
        // Nothing half-made stays: the Session owns what was written.
        let _ = store
            .sessions_api()
            .delete(&moved.id.0, &Default::default())
            .await;
        return Err(e.context(format!(
            "importing session {} {place}; nothing was kept",
            moved.id
        )));
    }
    Ok(place)
}

/// The Session, paused so that the operator starts nothing before its
/// state is in place.
async fn create_paused(
    store: &KubeStore,
    moved: &Moved,
    place: &str,
) -> anyhow::Result<crate::api::Session> {
    let mut spec = moved.export.definition.spec.clone();
    spec.paused = true;
    spec.retry = (moved.export.input.retry > 0).then_some(moved.export.input.retry);
    let object = crate::api::Session::new(&moved.id.0, spec);
    match store
        .sessions_api()
        .create(&Default::default(), &object)
        .await
    {
        Ok(created) => Ok(created),
        Err(kube::Error::Api(s)) if s.code == 409 => Err(name_taken(&moved.id, place)),
        Err(e) => Err(anyhow!("creating Session {} {place}: {e}", moved.id)),
    }
}

async fn fill_cluster(
    store: &KubeStore,
    moved: &Moved,
    owner: &SessionRef,
    version: Version,
) -> anyhow::Result<()> {
    let mut record = record_for(moved, &owner.namespace, &owner.uid);
    record.input.paused = true;
    write_state(store, &record, version).await?;
    let signer = AdminPort::identity(store).await?;
    write_continuations(store, owner, &moved.carried, Some(&signer)).await?;
    if !moved.export.input.paused {
        store.change_input(&moved.id, &|i| i.paused = false).await?;
    }
    Ok(())
}

/// Writes the state over `version`. The operator may have written the
/// paused Session's status meanwhile (taking in its messages, its
/// conditions): that is overwritten, at the version read, as long as it
/// has no agent turn, which nothing but the import may give it here.
async fn write_state(
    store: &KubeStore,
    record: &SessionRecord,
    mut version: Version,
) -> anyhow::Result<()> {
    let id = &record.state.id;
    for _ in 0..8 {
        match store.save(record, &version).await {
            Ok(_) => return Ok(()),
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let current = store
            .load(id)
            .await?
            .ok_or_else(|| StoreError::SessionNotFound(id.clone()))?;
        if current.value.state.agent_turns > 0 {
            bail!("session {id} took a model turn before its imported state was written");
        }
        version = current.version;
    }
    bail!("session {id} kept changing while its imported state was written; try again")
}
