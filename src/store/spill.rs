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
        // The entry must say where its turns go: a write keeps the entries
        // as they are (`keep_archived`) and takes their counts for true.
        if a.first_turn as usize != turns.len() || a.turns as usize != chunk.len() {
            return Err(format!(
                "archived turns in {} say turns {} to {}, but hold {} turns from turn {}",
                a.blobs.join(", "),
                a.first_turn,
                u64::from(a.first_turn) + u64::from(a.turns),
                chunk.len(),
                turns.len()
            ));
        }
        turns.extend(chunk);
    }
    let Some(state) = status.state.as_mut().and_then(Value::as_object_mut) else {
        return Ok(());
    };
    match state.get_mut("turns") {
        Some(Value::Array(inline)) => {
            turns.append(inline);
            *inline = turns;
        }
        // Every turn archived: the state leaves out an empty list.
        None => {
            state.insert("turns".into(), Value::Array(turns));
        }
        // Taken for an empty list, it would start the conversation over.
        Some(other) => {
            return Err(format!(
                "status.state.turns is {}, not a list of turns",
                crate::core::conversation::json_kind(other)
            ))
        }
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
mod tests;
