//! Keeping every stored object small, however long the session or large
//! its results (etcd refuses requests over about 1.5 MiB).
//!
//! The kube store writes a Session's status through [`pack`] and reads it
//! back through [`unpack`]; the engine, the CLI and the model step always
//! see the whole conversation.
//!
//! - A success result whose JSON exceeds [`INLINE_RESULT_BYTES`] moves into
//!   blobs (gzip, split into pieces of at most [`BLOB_BYTES`]); the status
//!   keeps `{"spilled": {"blobs": [...], "sha256", "bytes"}}` in its place.
//! - When the status still exceeds its budget, the oldest turns move into
//!   blobs too, in chunks whose boundaries depend only on the turns before
//!   them (turns never change), so a chunk, once written, is written again
//!   with the same name and content: blobs are immutable and
//!   content-named, and re-creating one is a no-op.
//!
//! Blobs become immutable ConfigMaps owned by the Session (garbage collected
//! with it); this module only decides what goes where.

use crate::api::session::{ArchivedTurnsStatus, SessionStatus, TurnStatus};
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::future::Future;
use std::io::{Read, Write};

/// The Session status budget: well under etcd's limit, so an object with
/// metadata, spec and status never comes near it.
pub const STATUS_BUDGET_BYTES: usize = 256 * 1024;
/// The most a status may take once everything that can spill has: past
/// it the write is refused before it is sent (etcd takes 1.5 MiB per
/// request, spec and metadata included).
pub const MAX_STATUS_BYTES: usize = 1024 * 1024;
/// Results larger than this (as JSON) live in blobs.
pub const INLINE_RESULT_BYTES: usize = 16 * 1024;
/// Largest blob: a ConfigMap holds at most 1 MiB of data, and its JSON
/// form (base64) is a third larger; 512 KiB keeps that under 700 KB.
pub const BLOB_BYTES: usize = 512 * 1024;
/// Most bytes one spilled value may take, packed or unpacked. The blobs
/// are named by whoever wrote the marker, so reading them is bounded before
/// anything is held: a result (at most `maxResultBytes`, 8 MiB by default)
/// fits with room to spare.
pub const MAX_SPILLED_BYTES: usize = 24 * 1024 * 1024;
/// Target size of one archived chunk of turns (before compression).
pub const CHUNK_BYTES: usize = 128 * 1024;
/// Turns that always stay in the status, for `kubectl get -o yaml` readers.
pub const KEEP_RECENT_TURNS: usize = 8;

/// A blob to store: `name` is derived from the content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    pub name: String,
    pub data: Vec<u8>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).expect("writing to memory");
    e.finish().expect("writing to memory")
}

/// Decompresses at most [`MAX_SPILLED_BYTES`]: a small blob may unpack to
/// gigabytes.
fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    GzDecoder::new(bytes)
        .take(MAX_SPILLED_BYTES as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("a spilled blob is not valid gzip: {e}"))?;
    if out.len() > MAX_SPILLED_BYTES {
        return Err(format!(
            "spilled data unpacks to more than {MAX_SPILLED_BYTES} bytes"
        ));
    }
    Ok(out)
}

/// `<prefix>-<kind>-<hash>[-<i>]`, a valid object name whatever the
/// session's name length.
fn blob_name(session: &str, kind: &str, sha: &str, piece: Option<usize>) -> String {
    let prefix: String = session.chars().take(200).collect();
    let prefix = prefix.trim_end_matches(['-', '.']);
    match piece {
        Some(i) => format!("{prefix}-{kind}-{}-{i}", &sha[..16]),
        None => format!("{prefix}-{kind}-{}", &sha[..16]),
    }
}

/// Compresses `json` into blobs; returns the marker that replaces it.
fn spill(session: &str, kind: &str, json: &[u8], out: &mut Vec<Blob>) -> Value {
    let sha = sha256_hex(json);
    let packed = gzip(json);
    let pieces: Vec<&[u8]> = packed.chunks(BLOB_BYTES).collect();
    let single = pieces.len() == 1;
    let mut names = Vec::new();
    for (i, piece) in pieces.into_iter().enumerate() {
        let name = blob_name(session, kind, &sha, (!single).then_some(i));
        out.push(Blob {
            name: name.clone(),
            data: piece.to_vec(),
        });
        names.push(name);
    }
    json!({"blobs": names, "sha256": sha, "bytes": json.len()})
}

fn spill_result(session: &str, result: &mut Value, out: &mut Vec<Blob>) {
    if result.get("status").and_then(Value::as_str) != Some("success") {
        return;
    }
    let Some(response) = result.get("response") else {
        return;
    };
    if response.get("spilled").is_some() {
        return;
    }
    let text = serde_json::to_vec(response).expect("JSON values serialise");
    if text.len() <= INLINE_RESULT_BYTES {
        return;
    }
    let marker = spill(session, "r", &text, out);
    result["response"] = json!({ "spilled": marker });
}

/// Moves large results and old turns out of `status`; returns the blobs
/// the store must create (idempotently) before writing the status.
pub fn pack(status: &mut SessionStatus, session: &str, budget: usize) -> Vec<Blob> {
    let mut blobs = Vec::new();
    for turn in status.turns.iter_mut() {
        for r in turn.tool_results.iter_mut() {
            spill_result(session, &mut r.result, &mut blobs);
        }
    }
    if let Some(open) = status.open_turn.as_mut() {
        for c in open.calls.iter_mut() {
            if let Some(r) = c.result.as_mut() {
                spill_result(session, r, &mut blobs);
            }
        }
    }
    // Chunks from the first turn on; only full chunks are archived, and only
    // while the status is over budget.
    let size = |s: &SessionStatus| serde_json::to_vec(s).map(|v| v.len()).unwrap_or(0);
    let mut archived: Vec<ArchivedTurnsStatus> = Vec::new();
    let mut turns: std::collections::VecDeque<TurnStatus> =
        std::mem::take(&mut status.turns).into();
    let mut first_turn = 0u32;
    loop {
        status.turns = turns.iter().cloned().collect();
        status.archived_turns = archived.clone();
        if size(status) <= budget || turns.len() <= KEEP_RECENT_TURNS {
            break;
        }
        // The next full chunk, if the turns after it leave enough inline.
        let mut chunk = Vec::new();
        let mut bytes = 0;
        while turns.len() > KEEP_RECENT_TURNS {
            let t = &turns[0];
            let b = serde_json::to_vec(t).map(|v| v.len()).unwrap_or(0);
            if !chunk.is_empty() && bytes + b > CHUNK_BYTES {
                break;
            }
            bytes += b;
            chunk.push(turns.pop_front().expect("checked"));
        }
        let json = serde_json::to_vec(&chunk).expect("turns serialise");
        let marker = spill(session, "t", &json, &mut blobs);
        archived.push(ArchivedTurnsStatus {
            first_turn,
            turns: chunk.len() as u32,
            blobs: marker["blobs"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            sha256: marker["sha256"].as_str().unwrap_or_default().to_string(),
        });
        first_turn += chunk.len() as u32;
    }
    blobs
}

async fn read_blobs<F, Fut>(names: &[String], sha: &str, fetch: &F) -> Result<Vec<u8>, String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    let most = MAX_SPILLED_BYTES.div_ceil(BLOB_BYTES);
    if names.len() > most {
        return Err(format!(
            "a spill marker lists {} blobs; at most {most} hold one value",
            names.len()
        ));
    }
    let mut packed = Vec::new();
    for n in names {
        let data = fetch(n.clone()).await?;
        if packed.len() + data.len() > MAX_SPILLED_BYTES {
            return Err(format!(
                "the blobs {} hold more than {MAX_SPILLED_BYTES} bytes",
                names.join(", ")
            ));
        }
        packed.extend(data);
    }
    let json = gunzip(&packed)?;
    let found = sha256_hex(&json);
    if found != sha {
        return Err(format!(
            "spilled data in {} does not match its checksum (expected {sha}, found {found}); it was changed by hand",
            names.join(", ")
        ));
    }
    Ok(json)
}

async fn unspill_result<F, Fut>(result: &mut Value, fetch: &F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    let Some(marker) = result.get("response").and_then(|r| r.get("spilled")) else {
        return Ok(());
    };
    let names: Vec<String> = marker["blobs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let sha = marker["sha256"].as_str().unwrap_or_default().to_string();
    let json = read_blobs(&names, &sha, fetch).await?;
    result["response"] =
        serde_json::from_slice(&json).map_err(|e| format!("a spilled result is not JSON: {e}"))?;
    Ok(())
}

/// Puts back what [`pack`] moved out, reading blobs through `fetch`.
pub async fn unpack<F, Fut>(status: &mut SessionStatus, fetch: F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    let mut turns = Vec::new();
    for a in std::mem::take(&mut status.archived_turns) {
        let json = read_blobs(&a.blobs, &a.sha256, &fetch).await?;
        let chunk: Vec<TurnStatus> = serde_json::from_slice(&json).map_err(|e| {
            format!(
                "archived turns in {} are not readable: {e}",
                a.blobs.join(", ")
            )
        })?;
        turns.extend(chunk);
    }
    turns.append(&mut status.turns);
    status.turns = turns;
    for turn in status.turns.iter_mut() {
        for r in turn.tool_results.iter_mut() {
            unspill_result(&mut r.result, &fetch).await?;
        }
    }
    if let Some(open) = status.open_turn.as_mut() {
        for c in open.calls.iter_mut() {
            if let Some(r) = c.result.as_mut() {
                unspill_result(r, &fetch).await?;
            }
        }
    }
    Ok(())
}

/// A continuation's result, kept small the same way; `None` when it fits.
pub fn pack_result(session: &str, result: &mut Value) -> Vec<Blob> {
    let mut blobs = Vec::new();
    spill_result(session, result, &mut blobs);
    blobs
}

/// Puts back a continuation's spilled result.
pub async fn unpack_result<F, Fut>(result: &mut Value, fetch: F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    unspill_result(result, &fetch).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::convert::{session_state, session_status};
    use crate::core::conversation::{AgentTurn, ToolResultEntry, UserTurn};
    use crate::core::{CallId, SessionId, SessionState, ToolResult, Turn};
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// A long conversation with one 5 MB result.
    fn long_state(turns: u32) -> SessionState {
        let mut s = SessionState::new(SessionId("long".into()));
        for i in 0..turns {
            s.turns.push(Turn::User(UserTurn {
                message: Some(format!("message {i}: {}", "words ".repeat(200))),
                tool_results: if i == 3 {
                    vec![ToolResultEntry {
                        call_id: CallId::new(i, 0),
                        model_call_id: "m".into(),
                        tool: "dump".into(),
                        token: None,
                        // Barely compressible: a hex stream.
                        result: ToolResult::text(
                            (0..5_000_000u32 / 64)
                                .map(|n| sha256_hex(&n.to_be_bytes()))
                                .collect::<String>(),
                        ),
                        truncate_bytes: None,
                    }]
                } else {
                    Vec::new()
                },
            }));
            s.turns.push(Turn::Agent(AgentTurn {
                text: Some(format!("answer {i}")),
                ..Default::default()
            }));
        }
        s.phase = crate::core::Phase::Succeeded;
        s
    }

    fn run<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_long_session_with_a_huge_result_packs_small_and_comes_back_whole() {
        let state = long_state(300);
        let mut status = session_status(&state);
        let blobs = pack(&mut status, "long", STATUS_BUDGET_BYTES);
        let status_bytes = serde_json::to_vec(&status).unwrap().len();
        assert!(status_bytes <= STATUS_BUDGET_BYTES, "{status_bytes}");
        let largest = blobs.iter().map(|b| b.data.len()).max().unwrap();
        assert!(largest <= BLOB_BYTES, "{largest}");
        assert!(!status.archived_turns.is_empty());
        // Packing again gives the same blobs: nothing new to write.
        let mut again = session_status(&state);
        let blobs_again = pack(&mut again, "long", STATUS_BUDGET_BYTES);
        assert_eq!(blobs, blobs_again);
        let store: BTreeMap<String, Vec<u8>> =
            blobs.into_iter().map(|b| (b.name, b.data)).collect();
        let fetched = Mutex::new(0);
        run(unpack(&mut status, |name| {
            *fetched.lock().unwrap() += 1;
            let data = store.get(&name).cloned();
            async move { data.ok_or_else(|| format!("no blob {name}")) }
        }))
        .unwrap();
        assert_eq!(session_state(&state.id, &status).unwrap(), state);
    }

    #[test]
    fn a_changed_blob_is_refused_by_its_checksum() {
        let state = long_state(5);
        let mut status = session_status(&state);
        let blobs = pack(&mut status, "s", STATUS_BUDGET_BYTES);
        assert!(!blobs.is_empty());
        let forged = gzip(b"{\"type\":\"text\",\"content\":\"forged\"}");
        let err = run(unpack(&mut status, |_| {
            let data = forged.clone();
            async move { Ok(data) }
        }))
        .unwrap_err();
        assert!(err.contains("checksum"), "{err}");
    }

    #[test]
    fn small_sessions_are_left_alone() {
        let state = long_state(2);
        let mut status = session_status(&state);
        // (turn 3 holds the large result; two turns have none)
        let before = status.clone();
        assert!(pack(&mut status, "s", STATUS_BUDGET_BYTES).is_empty());
        assert_eq!(status, before);
    }
}
