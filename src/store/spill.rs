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
//! - Tool-call arguments and agent text (the answer too) over
//!   [`INLINE_TEXT_BYTES`] move the same way; the string keeps the same
//!   marker as JSON text. A string that merely looks like a marker (a model
//!   can write anything) is spilled too, so an inline marker is always one
//!   this module wrote.
//! - When the status still exceeds its [`Budget`], the oldest turns move
//!   into blobs too, in chunks whose boundaries depend only on the turns
//!   before them (turns never change), so a chunk, once written, is written
//!   again with the same name and content: blobs are immutable and
//!   content-named, and re-creating one is a no-op. The last
//!   [`KEEP_RECENT_TURNS`] go last, only when the status is over budget
//!   without them.
//!
//! Blobs become immutable ConfigMaps owned by the Session (garbage collected
//! with it); this module only decides what goes where.

use crate::api::session::{ArchivedTurnsStatus, SessionStatus};
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::future::Future;
use std::io::{Read, Write};

/// What the Session status is packed down to when it can be: far under
/// etcd's limit, and small, because the API server decodes, converts and
/// encodes the whole object on every status write (a long session's
/// writes cost what a short one's do; older turns live in blobs written
/// once).
pub const STATUS_BUDGET_BYTES: usize = 48 * 1024;
/// The most a status may take once everything that can spill has.
pub const MAX_STATUS_BYTES: usize = 1024 * 1024;
/// The most a whole Session object (metadata, spec, status) may take as
/// stored: etcd refuses requests over 1,572,864 bytes, and the request
/// carries the key, `apiVersion` and `kind`, and the write's own
/// managedFields entry besides (a few KiB at most).
pub const MAX_OBJECT_BYTES: usize = 1_540_000;
/// Results larger than this (as JSON) live in blobs.
pub const INLINE_RESULT_BYTES: usize = 16 * 1024;
/// Tool-call arguments and agent text larger than this live in blobs.
pub const INLINE_TEXT_BYTES: usize = 16 * 1024;
/// Largest blob: a ConfigMap holds at most 1 MiB of data, and its JSON
/// form (base64) is a third larger; 512 KiB keeps that under 700 KB.
pub const BLOB_BYTES: usize = 512 * 1024;
/// Most bytes one spilled value may take, packed or unpacked. The blobs
/// are named by whoever wrote the marker, so reading them is bounded before
/// anything is held: a result (at most `maxResultBytes`, 8 MiB by default)
/// fits with room to spare.
pub const MAX_SPILLED_BYTES: usize = 24 * 1024 * 1024;
/// Target size of one archived chunk of turns (before compression): half
/// the status budget, so the turns of a chunk still filling fit in the
/// status beside the recent ones and are archived only once complete.
pub const CHUNK_BYTES: usize = STATUS_BUDGET_BYTES / 2;
/// Turns kept in the status while it fits its budget, for `kubectl get -o
/// yaml` readers; archived too when it does not.
pub const KEEP_RECENT_TURNS: usize = 8;

/// A blob to store: `name` is derived from the content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    pub name: String,
    pub data: Vec<u8>,
}

/// Where a spilled value went: `{"spilled": marker}` takes its place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Marker {
    blobs: Vec<String>,
    sha256: String,
    bytes: u64,
}

/// A spilled string's stand-in, `{"spilled": {...}}` as JSON text.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpilledText {
    spilled: Marker,
}

/// What a Session's status may take beside the rest of its object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// [`pack`] archives turns until the status fits this.
    pub target: usize,
    /// A packed status over this is refused before it is sent.
    pub limit: usize,
    /// The spec's size as stored.
    pub spec: usize,
    /// The metadata's size as stored (managedFields included).
    pub metadata: usize,
}

impl Budget {
    /// The budget beside a spec and metadata of these stored sizes: etcd
    /// refuses the whole object, so a large spec leaves less room.
    pub fn beside(spec: usize, metadata: usize) -> Budget {
        let limit = MAX_OBJECT_BYTES
            .saturating_sub(spec + metadata)
            .min(MAX_STATUS_BYTES);
        Budget {
            target: limit.min(STATUS_BUDGET_BYTES),
            limit,
            spec,
            metadata,
        }
    }

    /// Whether a packed status of `size` bytes may be written; if not, why.
    pub fn admit(&self, size: usize) -> Result<(), String> {
        if size <= self.limit {
            return Ok(());
        }
        let mut why = format!(
            "its status takes {size} bytes with all that can spill moved out, and there is room for {}: its spec takes {} bytes and its metadata {}, and a Session object may take {MAX_OBJECT_BYTES} (its status at most {MAX_STATUS_BYTES})",
            self.limit, self.spec, self.metadata
        );
        if self.spec > MAX_OBJECT_BYTES / 2 {
            why.push_str(". Make the spec smaller: fewer or shorter messages, a shorter prompt, the agent in an Agent object");
        }
        Err(why)
    }
}

/// The bytes `value` takes as the API server stores it: its JSON, where
/// Go writes `<`, `>`, `&`, U+2028 and U+2029 as six-byte escapes.
pub fn stored_bytes<T: Serialize + ?Sized>(value: &T) -> usize {
    let json = serde_json::to_string(value).unwrap_or_default();
    let html = json.bytes().filter(|b| b"<>&".contains(b)).count();
    let separators = json.matches(['\u{2028}', '\u{2029}']).count();
    json.len() + 5 * html + 3 * separators
}

fn json_len<T: Serialize + ?Sized>(value: &T) -> usize {
    serde_json::to_vec(value).map(|v| v.len()).unwrap_or(0)
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
    let prefix = blob_prefix(session);
    match piece {
        Some(i) => format!("{prefix}-{kind}-{}-{i}", &sha[..16]),
        None => format!("{prefix}-{kind}-{}", &sha[..16]),
    }
}

/// What every blob name of `session` starts with.
fn blob_prefix(session: &str) -> String {
    let prefix: String = session.chars().take(200).collect();
    prefix.trim_end_matches(['-', '.']).to_string()
}

/// Compresses `bytes` into blobs; returns the marker that replaces them.
fn spill(session: &str, kind: &str, bytes: &[u8], out: &mut Vec<Blob>) -> Marker {
    let sha = sha256_hex(bytes);
    let packed = gzip(bytes);
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
    Marker {
        blobs: names,
        sha256: sha,
        bytes: bytes.len() as u64,
    }
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

/// The marker `text` stands for, if it is one.
fn marker_in(text: &str) -> Option<Marker> {
    if !text.trim_start().starts_with('{') || !text.contains("spilled") {
        return None;
    }
    serde_json::from_str::<SpilledText>(text)
        .ok()
        .map(|s| s.spilled)
}

/// Moves a long string (or one that looks like a marker) into blobs of
/// `kind`, leaving the marker as its text.
fn spill_text(session: &str, kind: &str, text: &mut String, out: &mut Vec<Blob>) {
    if text.len() <= INLINE_TEXT_BYTES && marker_in(text).is_none() {
        return;
    }
    let marker = spill(session, kind, text.as_bytes(), out);
    *text = json!({ "spilled": marker }).to_string();
}

/// The items of the array at `key` in `v`, if any.
fn items<'a>(v: &'a mut Value, key: &str) -> impl Iterator<Item = &'a mut Value> {
    v.get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
}

/// The turns still inline in `status.state`.
fn inline_turns(status: &mut SessionStatus) -> Option<&mut Vec<Value>> {
    status.state.as_mut()?.get_mut("turns")?.as_array_mut()
}

/// The string at `key` in `v`, if it is one.
fn text_at<'a>(v: &'a mut Value, key: &str) -> Option<&'a mut String> {
    match v.get_mut(key) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn spill_turn(session: &str, turn: &mut Value, out: &mut Vec<Blob>) {
    for r in items(turn, "toolResults") {
        if let Some(result) = r.get_mut("result") {
            spill_result(session, result, out);
        }
    }
    for c in items(turn, "toolCalls") {
        if let Some(arguments) = text_at(c, "arguments") {
            spill_text(session, "a", arguments, out);
        }
    }
    if let Some(text) = text_at(turn, "text") {
        spill_text(session, "x", text, out);
    }
}

/// Spills every large result, argument and text, wherever it is.
fn spill_values(status: &mut SessionStatus, session: &str, out: &mut Vec<Blob>) {
    for turn in inline_turns(status).into_iter().flatten() {
        spill_turn(session, turn, out);
    }
    let open = status.state.as_mut().and_then(|s| s.get_mut("open"));
    for c in open.into_iter().flat_map(|o| items(o, "calls")) {
        if let Some(arguments) = c
            .get_mut("call")
            .and_then(|call| text_at(call, "arguments"))
        {
            spill_text(session, "a", arguments, out);
        }
        if let Some(r) = c.get_mut("result") {
            spill_result(session, r, out);
        }
    }
    if let Some(answer) = status.answer.as_mut() {
        // The last agent text: the same blob.
        spill_text(session, "x", answer, out);
    }
}

/// How many of `turns` (at least one) make the next chunk.
fn chunk_len(turns: &[Value]) -> usize {
    let mut bytes = 0;
    turns
        .iter()
        .take_while(|t| {
            bytes += json_len(t);
            bytes <= CHUNK_BYTES
        })
        .count()
        .max(1)
}

/// The sizes of the complete chunks `turns` (all of a session's, from its
/// first) fall into: runs of at most [`CHUNK_BYTES`] (a larger turn alone).
/// A chunk is complete once the turn after it exists; its boundaries
/// depend only on the turns up to that one, so at every later write it has
/// the same turns, and so the same blob name and content.
fn complete_chunks(turns: &[Value]) -> Vec<(usize, usize)> {
    let mut chunks = Vec::new();
    let (mut len, mut bytes) = (0, 0);
    for turn in turns {
        let size = json_len(turn) + 1;
        if len > 0 && bytes + size > CHUNK_BYTES {
            chunks.push((len, bytes));
            (len, bytes) = (0, 0);
        }
        len += 1;
        bytes += size;
    }
    chunks
}

fn archive(
    session: &str,
    first_turn: u32,
    chunk: &[Value],
    out: &mut Vec<Blob>,
) -> ArchivedTurnsStatus {
    let json = serde_json::to_vec(chunk).expect("turns serialise");
    let marker = spill(session, "t", &json, out);
    ArchivedTurnsStatus {
        first_turn,
        turns: chunk.len() as u32,
        blobs: marker.blobs,
        sha256: marker.sha256,
    }
}

/// Archives the oldest turns while the status is over `target`: complete
/// chunks first (each written once for the session's life), the
/// [`KEEP_RECENT_TURNS`] last turns kept; then, only if recent turns alone
/// are over it, chunk by chunk down to none (the open turn stays, as do the
/// fields that are not turns).
fn archive_turns(
    status: &mut SessionStatus,
    session: &str,
    target: usize,
    first_turn: u32,
    out: &mut Vec<Blob>,
) {
    let mut first_turn = archive_complete_chunks(status, session, target, first_turn, out);
    for keep in [KEEP_RECENT_TURNS, 0] {
        loop {
            let inline = inline_turns(status).map_or(0, |t| t.len());
            if inline <= keep || stored_bytes(status) <= target {
                break;
            }
            let turns = inline_turns(status).expect("turns counted above");
            let n = chunk_len(&turns[..inline - keep]);
            let chunk: Vec<Value> = turns.drain(..n).collect();
            status
                .archived_turns
                .push(archive(session, first_turn, &chunk, out));
            first_turn += n as u32;
        }
    }
}

/// The complete chunks before the recent turns, oldest first, while the
/// status is over `target` (its size counted down, not measured again per
/// chunk: a long session has many). The inline turns start at turn
/// `first_turn` of the conversation; returns the first turn left inline.
fn archive_complete_chunks(
    status: &mut SessionStatus,
    session: &str,
    target: usize,
    first_turn: u32,
    out: &mut Vec<Blob>,
) -> u32 {
    let Some(turns) = inline_turns(status) else {
        return first_turn;
    };
    let archivable = turns.len().saturating_sub(KEEP_RECENT_TURNS);
    let chunks = complete_chunks(turns);
    let mut size = stored_bytes(status);
    let (mut went, mut archived) = (0usize, Vec::new());
    let mut turns_left = inline_turns(status).expect("turns seen above");
    for (len, bytes) in chunks {
        if size <= target || went + len > archivable {
            break;
        }
        let chunk: Vec<Value> = turns_left.drain(..len).collect();
        let entry = archive(session, first_turn + went as u32, &chunk, out);
        size = (size + json_len(&entry)).saturating_sub(bytes);
        archived.push(entry);
        went += len;
        turns_left = inline_turns(status).expect("turns seen above");
    }
    status.archived_turns.extend(archived);
    first_turn + went as u32
}

/// Keeps the chunks `earlier` (the status this write replaces) archived,
/// as they are, when they still describe `status`' conversation: they run
/// from its first turn without a gap, name this session's blobs, and cover
/// no more turns than it has. Turns are only ever appended within a
/// session, so the turns they cover are the ones they hold; a long
/// session's write then serialises, hashes and compresses its recent turns
/// only, not every turn again. Returns the first turn left inline (0 when
/// nothing was kept).
fn keep_archived(
    status: &mut SessionStatus,
    session: &str,
    earlier: &[ArchivedTurnsStatus],
) -> u32 {
    let ours = format!("{}-t-", blob_prefix(session));
    let mut covered = 0u32;
    for chunk in earlier {
        let named_ours =
            !chunk.blobs.is_empty() && chunk.blobs.iter().all(|b| b.starts_with(&ours));
        if chunk.first_turn != covered || chunk.turns == 0 || !named_ours {
            return 0;
        }
        covered += chunk.turns;
    }
    match inline_turns(status) {
        Some(turns) if covered > 0 && covered as usize <= turns.len() => {
            turns.drain(..covered as usize);
            status.archived_turns = earlier.to_vec();
            covered
        }
        _ => 0,
    }
}

/// Moves large values, then old turns, out of `status` (as built from the
/// state: nothing spilled or archived yet) until it fits `target` or no
/// turn is left; returns the blobs the store must create (idempotently)
/// before writing the status.
pub fn pack(status: &mut SessionStatus, session: &str, target: usize) -> Vec<Blob> {
    pack_over(status, session, target, &[])
}

/// [`pack`], keeping the chunks of old turns that `earlier`, the archived
/// chunks of the stored status this write replaces, already hold (see
/// [`keep_archived`]; the caller passes them only for the very version the
/// session was read from).
pub fn pack_over(
    status: &mut SessionStatus,
    session: &str,
    target: usize,
    earlier: &[ArchivedTurnsStatus],
) -> Vec<Blob> {
    let mut blobs = Vec::new();
    let first_turn = keep_archived(status, session, earlier);
    spill_values(status, session, &mut blobs);
    archive_turns(status, session, target, first_turn, &mut blobs);
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

async fn unspill_text<F, Fut>(text: &mut String, fetch: &F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    let Some(marker) = marker_in(text) else {
        return Ok(());
    };
    let bytes = read_blobs(&marker.blobs, &marker.sha256, fetch).await?;
    *text = String::from_utf8(bytes)
        .map_err(|_| format!("spilled text in {} is not UTF-8", marker.blobs.join(", ")))?;
    Ok(())
}

async fn unspill_turn<F, Fut>(turn: &mut Value, fetch: &F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    for r in items(turn, "toolResults") {
        if let Some(result) = r.get_mut("result") {
            unspill_result(result, fetch).await?;
        }
    }
    for c in items(turn, "toolCalls") {
        if let Some(arguments) = text_at(c, "arguments") {
            unspill_text(arguments, fetch).await?;
        }
    }
    if let Some(text) = text_at(turn, "text") {
        unspill_text(text, fetch).await?;
    }
    Ok(())
}

/// Puts the archived turns back in front of the inline ones.
async fn unarchive<F, Fut>(status: &mut SessionStatus, fetch: &F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    let mut turns = Vec::new();
    for a in std::mem::take(&mut status.archived_turns) {
        let json = read_blobs(&a.blobs, &a.sha256, fetch).await?;
        // Chunks written before the state moved into `status.state` hold
        // turns in the same form: they read alike.
        let chunk: Vec<Value> = serde_json::from_slice(&json).map_err(|e| {
            format!(
                "archived turns in {} are not readable: {e}",
                a.blobs.join(", ")
            )
        })?;
        turns.extend(chunk);
    }
    if let Some(inline) = inline_turns(status) {
        turns.append(inline);
        *inline = turns;
    } else if let Some(state) = status.state.as_mut().and_then(Value::as_object_mut) {
        state.insert("turns".into(), Value::Array(turns));
    }
    Ok(())
}

/// Puts back what [`pack`] moved out, reading blobs through `fetch`.
pub async fn unpack<F, Fut>(status: &mut SessionStatus, fetch: F) -> Result<(), String>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, String>>,
{
    unarchive(status, &fetch).await?;
    for turn in inline_turns(status).into_iter().flatten() {
        unspill_turn(turn, &fetch).await?;
    }
    let open = status.state.as_mut().and_then(|s| s.get_mut("open"));
    for c in open.into_iter().flat_map(|o| items(o, "calls")) {
        if let Some(arguments) = c
            .get_mut("call")
            .and_then(|call| text_at(call, "arguments"))
        {
            unspill_text(arguments, &fetch).await?;
        }
        if let Some(r) = c.get_mut("result") {
            unspill_result(r, &fetch).await?;
        }
    }
    if let Some(answer) = status.answer.as_mut() {
        unspill_text(answer, &fetch).await?;
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
    use crate::api::stored::{session_state, session_status};
    use crate::core::conversation::{AgentTurn, ToolResultEntry, UserTurn};
    use crate::core::{CallId, Millis, SessionId, SessionState, ToolResult, Turn};
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// A long conversation with one 5 MB result; each reply and the
    /// result keep their times, archived and spilled with them.
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
                        started_at: Some(Millis(1_000 * i64::from(i))),
                        finished_at: Some(Millis(1_000 * i64::from(i) + 250)),
                    }]
                } else {
                    Vec::new()
                },
            }));
            s.turns.push(Turn::Agent(AgentTurn {
                text: Some(format!("answer {i}")),
                asked_at: Some(Millis(1_000 * i64::from(i) + 300)),
                replied_at: Some(Millis(1_000 * i64::from(i) + 900)),
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

    /// Incompressible text of `n` bytes: hex of hashes, numbered by `seed`.
    fn noise(seed: u32, n: usize) -> String {
        let mut s = String::with_capacity(n + 64);
        let mut i = 0u32;
        while s.len() < n {
            s.push_str(&sha256_hex(&[seed.to_be_bytes(), i.to_be_bytes()].concat()));
            i += 1;
        }
        s.truncate(n);
        s
    }

    fn big_call(turn: u32, i: u32) -> crate::core::ToolCall {
        crate::core::ToolCall {
            model_call_id: format!("m{turn}-{i}"),
            name: "echo".into(),
            arguments: json!({ "text": noise(turn * 100 + i, 300_000) }).to_string(),
        }
    }

    /// Four agent turns, each with a 300 KB argument and 100 KB of text, and
    /// an open turn whose calls carry the last turn's arguments.
    fn chatty_state() -> SessionState {
        let mut s = SessionState::new(SessionId("chatty".into()));
        for turn in 1..=4u32 {
            s.turns.push(Turn::User(UserTurn {
                message: Some(format!("go on {turn}")),
                tool_results: Vec::new(),
            }));
            s.turns.push(Turn::Agent(AgentTurn {
                text: Some(noise(turn, 100_000)),
                tool_calls: vec![big_call(turn, 0)],
                ..Default::default()
            }));
        }
        s.open = Some(crate::core::session::PartialUserTurn {
            turn: 4,
            calls: vec![crate::core::TrackedToolCall::new(
                CallId::new(4, 0),
                big_call(4, 0),
                Default::default(),
            )],
        });
        s.phase = crate::core::Phase::RunningTools;
        s
    }

    /// `status` unpacked from `blobs`.
    fn unpacked(mut status: SessionStatus, blobs: Vec<Blob>) -> Result<SessionStatus, String> {
        let store: BTreeMap<String, Vec<u8>> =
            blobs.into_iter().map(|b| (b.name, b.data)).collect();
        run(unpack(&mut status, |name| {
            let data = store.get(&name).cloned();
            async move { data.ok_or_else(|| format!("no blob {name}")) }
        }))?;
        Ok(status)
    }

    /// How many turns are inline in the status.
    fn inline(status: &SessionStatus) -> usize {
        let turns = status.state.as_ref().and_then(|s| s["turns"].as_array());
        turns.map_or(0, Vec::len)
    }

    fn strings_of(status: &SessionStatus) -> Vec<String> {
        let state = status.state.clone().unwrap_or_default();
        let text = |v: &Value| v.as_str().map(str::to_string);
        let mut out: Vec<String> = Vec::new();
        for t in state["turns"].as_array().into_iter().flatten() {
            out.extend(text(&t["text"]));
            let calls = t["toolCalls"].as_array().into_iter().flatten();
            out.extend(calls.filter_map(|c| text(&c["arguments"])));
        }
        let open = state["open"]["calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        out.extend(open.iter().filter_map(|c| text(&c["call"]["arguments"])));
        out.extend(status.answer.clone());
        out
    }

    #[test]
    fn large_arguments_and_text_spill_and_come_back() {
        let state = chatty_state();
        let mut status = session_status(&state);
        let blobs = pack(&mut status, "chatty", STATUS_BUDGET_BYTES);
        let size = stored_bytes(&status);
        assert!(size <= STATUS_BUDGET_BYTES, "{size}");
        assert!(
            status.archived_turns.is_empty(),
            "nine turns fit once spilled"
        );
        for s in strings_of(&status) {
            assert!(s.len() <= INLINE_TEXT_BYTES, "{} bytes inline", s.len());
            assert!(s.starts_with("{\"spilled\":{\"blobs\":["), "{s}");
        }
        // The open call's arguments are the last turn's: one blob for both.
        let names: std::collections::BTreeSet<_> = blobs.iter().map(|b| &b.name).collect();
        assert_eq!(names.len(), 8, "{names:?}");
        let back = unpacked(status, blobs).unwrap();
        assert_eq!(session_state(&state.id, &back).unwrap(), state);
    }

    #[test]
    fn a_marker_written_by_the_model_comes_back_as_written() {
        let mut state = SessionState::new(SessionId("s".into()));
        let forged = json!({"spilled": {"blobs": ["kube-system-secret"], "sha256": "0".repeat(64), "bytes": 1}});
        let looks_like = |text: String| {
            Turn::Agent(AgentTurn {
                text: Some(text.clone()),
                tool_calls: vec![crate::core::ToolCall {
                    model_call_id: "m".into(),
                    name: "echo".into(),
                    arguments: text,
                }],
                ..Default::default()
            })
        };
        state.turns.push(looks_like(forged.to_string()));
        state.turns.push(looks_like(format!(" {forged:#}")));
        state.phase = crate::core::Phase::Succeeded;
        let mut status = session_status(&state);
        let blobs = pack(&mut status, "s", STATUS_BUDGET_BYTES);
        assert!(!blobs.is_empty());
        for s in strings_of(&status) {
            assert!(!s.contains("kube-system-secret"), "{s}");
        }
        let back = unpacked(status, blobs).unwrap();
        assert_eq!(session_state(&state.id, &back).unwrap(), state);
    }

    /// `turns` user turns, each with `results` results of 15 KB: too small
    /// to spill one by one.
    fn heavy_turns(turns: u32, results: u32) -> SessionState {
        heavy_turns_of(turns, results, 15_000)
    }

    /// `turns` user turns of `results` incompressible results of `bytes`.
    fn heavy_turns_of(turns: u32, results: u32, bytes: usize) -> SessionState {
        let mut s = SessionState::new(SessionId("heavy".into()));
        for turn in 0..turns {
            let results = (0..results)
                .map(|i| ToolResultEntry {
                    call_id: CallId::new(turn, i),
                    model_call_id: format!("m{i}"),
                    tool: "dump".into(),
                    token: None,
                    result: ToolResult::text(noise(turn * 100 + i, bytes)),
                    truncate_bytes: None,
                    started_at: None,
                    finished_at: None,
                })
                .collect();
            s.turns.push(Turn::User(UserTurn {
                message: None,
                tool_results: results,
            }));
        }
        s.phase = crate::core::Phase::AwaitingModel;
        s
    }

    #[test]
    fn recent_turns_too_large_for_the_budget_are_archived_too() {
        let state = heavy_turns(10, 20);
        let mut status = session_status(&state);
        let blobs = pack(&mut status, "heavy", STATUS_BUDGET_BYTES);
        let size = stored_bytes(&status);
        assert!(size <= STATUS_BUDGET_BYTES, "{size}");
        assert!(inline(&status) < KEEP_RECENT_TURNS, "{}", inline(&status));
        let archived: u32 = status.archived_turns.iter().map(|a| a.turns).sum();
        assert_eq!(archived as usize + inline(&status), 10);
        let back = unpacked(status, blobs).unwrap();
        assert_eq!(session_state(&state.id, &back).unwrap(), state);
    }

    #[test]
    fn a_growing_session_writes_each_chunk_of_old_turns_once() {
        let mut names = std::collections::BTreeSet::new();
        let mut blob_bytes = 0;
        let (mut most_status, mut last) = (0, None::<(SessionStatus, SessionState)>);
        let mut all = Vec::new();
        for turns in 1..=300 {
            let state = heavy_turns_of(turns, 1, 2_000);
            let mut status = session_status(&state);
            // As the store writes: over the status the last write stored.
            let earlier = last.as_ref().map(|(s, _)| s.archived_turns.clone());
            let blobs = pack_over(
                &mut status,
                "long",
                STATUS_BUDGET_BYTES,
                &earlier.unwrap_or_default(),
            );
            most_status = most_status.max(stored_bytes(&status));
            for blob in &blobs {
                if names.insert(blob.name.clone()) {
                    blob_bytes += blob.data.len();
                }
            }
            all.extend(blobs);
            last = Some((status, state));
        }
        let (status, state) = last.unwrap();
        let chunks = status.archived_turns.len();
        assert!(chunks > 10, "{chunks} chunks");
        assert_eq!(
            (names.len(), all.len()),
            (chunks, chunks),
            "each archived chunk is one blob, compressed and written once for the session's life"
        );
        assert!(most_status <= STATUS_BUDGET_BYTES, "{most_status}");
        // Incompressible 2 KB results: what is stored stays near the turns' own size.
        assert!(blob_bytes < 300 * 2_300, "{blob_bytes} bytes of blobs");
        let back = unpacked(status, all).unwrap();
        assert_eq!(session_state(&state.id, &back).unwrap(), state);
    }

    #[test]
    fn a_write_keeps_the_chunks_the_status_it_replaces_archived() {
        let earlier_state = heavy_turns_of(200, 1, 2_000);
        let mut earlier = session_status(&earlier_state);
        let earlier_blobs = pack(&mut earlier, "long", STATUS_BUDGET_BYTES);
        assert!(earlier.archived_turns.len() > 5);
        let state = heavy_turns_of(210, 1, 2_000);
        let mut fresh = session_status(&state);
        let fresh_blobs = pack(&mut fresh, "long", STATUS_BUDGET_BYTES);
        let mut kept = session_status(&state);
        let kept_blobs = pack_over(
            &mut kept,
            "long",
            STATUS_BUDGET_BYTES,
            &earlier.archived_turns,
        );
        // The same status as packing every turn again, without compressing
        // the earlier chunks again: only chunks completed since are blobs.
        assert_eq!(kept, fresh);
        let earlier_names: Vec<&String> = earlier_blobs.iter().map(|b| &b.name).collect();
        assert!(kept_blobs.iter().all(|b| !earlier_names.contains(&&b.name)));
        assert!(
            kept_blobs.len() < fresh_blobs.len(),
            "{} of {}",
            kept_blobs.len(),
            fresh_blobs.len()
        );
        let mut all = earlier_blobs;
        all.extend(kept_blobs);
        let back = unpacked(kept, all).unwrap();
        assert_eq!(session_state(&state.id, &back).unwrap(), state);
    }

    #[test]
    fn earlier_chunks_that_do_not_describe_the_conversation_are_not_kept() {
        let mut earlier = session_status(&heavy_turns_of(200, 1, 2_000));
        pack(&mut earlier, "long", STATUS_BUDGET_BYTES);
        let chunks = earlier.archived_turns;
        let fewer_turns = heavy_turns_of(20, 1, 2_000);
        let mut gap = chunks.clone();
        gap.remove(0);
        let mut empty = chunks.clone();
        empty[0].blobs.clear();
        let cases = [
            (
                "more turns than the session has",
                &fewer_turns,
                chunks.clone(),
                "long",
            ),
            (
                "not from the first turn",
                &heavy_turns_of(210, 1, 2_000),
                gap,
                "long",
            ),
            (
                "another session's blobs",
                &heavy_turns_of(210, 1, 2_000),
                chunks.clone(),
                "other",
            ),
            (
                "a chunk without blobs",
                &heavy_turns_of(210, 1, 2_000),
                empty,
                "long",
            ),
        ];
        for (case, state, earlier, session) in cases {
            let mut fresh = session_status(state);
            let fresh_blobs = pack(&mut fresh, session, STATUS_BUDGET_BYTES);
            let mut packed = session_status(state);
            let blobs = pack_over(&mut packed, session, STATUS_BUDGET_BYTES, &earlier);
            assert_eq!(packed, fresh, "{case}");
            assert_eq!(blobs, fresh_blobs, "{case}");
        }
    }

    #[test]
    fn recent_turns_stay_while_they_fit() {
        // Twelve turns of 5 KB: the oldest four go, eight fit.
        let state = heavy_turns_of(12, 1, 5_000);
        let mut status = session_status(&state);
        pack(&mut status, "heavy", STATUS_BUDGET_BYTES);
        assert!(!status.archived_turns.is_empty());
        assert_eq!(inline(&status), KEEP_RECENT_TURNS);
    }

    #[test]
    fn a_large_spec_leaves_less_room_for_the_status() {
        let roomy = Budget::beside(2_000, 1_000);
        assert_eq!(
            (roomy.target, roomy.limit),
            (STATUS_BUDGET_BYTES, MAX_STATUS_BYTES)
        );
        let tight = Budget::beside(1_500_000, 2_000);
        assert_eq!(tight.limit, MAX_OBJECT_BYTES - 1_502_000);
        assert_eq!(tight.target, tight.limit);
        // The heavy turns pack into what the spec leaves, archiving all.
        let state = heavy_turns(10, 20);
        let mut status = session_status(&state);
        let blobs = pack(&mut status, "heavy", tight.target);
        let size = stored_bytes(&status);
        assert!(tight.admit(size).is_ok(), "{size} > {}", tight.limit);
        assert_eq!(inline(&status), 0);
        let back = unpacked(status, blobs).unwrap();
        assert_eq!(session_state(&state.id, &back).unwrap(), state);
    }

    #[test]
    fn a_spec_that_leaves_no_room_is_refused_saying_so() {
        let full = Budget::beside(1_539_500, 900);
        let mut status = session_status(&heavy_turns(1, 20));
        pack(&mut status, "heavy", full.target);
        let why = full.admit(stored_bytes(&status)).unwrap_err();
        assert!(why.contains("its spec takes 1539500 bytes"), "{why}");
        assert!(why.contains("Make the spec smaller"), "{why}");
        let why = Budget::beside(1_000, 900)
            .admit(MAX_STATUS_BYTES + 1)
            .unwrap_err();
        assert!(!why.contains("Make the spec smaller"), "{why}");
    }

    #[test]
    fn stored_size_counts_what_go_escapes() {
        assert_eq!(stored_bytes("a<b>&"), "\"a<b>&\"".len() + 3 * 5);
        assert_eq!(stored_bytes("\u{2028}"), 2 + 3 + 3);
        assert_eq!(stored_bytes("\u{8}\n"), "\"\\b\\n\"".len());
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
