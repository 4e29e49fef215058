//! The protocol between the Job runner ([`super::job`]) and its in-pod
//! wrapper (`agents tool-exec`): how the wrapper reports a call's result,
//! and how the runner reads it back from the tool container's
//! termination message and log. Both sides live here, so neither depends
//! on the other's internals.
//!
//! - The wrapper writes its report to the termination log
//!   ([`TERMINATION_LOG`]): the result envelope itself when it fits in
//!   [`TERMINATION_MESSAGE_LIMIT`], else a [`ResultInLog`] pointer (hash,
//!   length) while the envelope goes to stderr, hence the container log,
//!   as a framed block ([`frame`]); see [`report`]. Stderr, not stdout:
//!   the tool's stderr goes through the same pipe before it, so the block
//!   is always the log's last lines (two pipes are read by the runtime in
//!   no fixed order, and a flood of stderr could land after the block and
//!   push it out of the tail the runner reads).
//! - A wrapper that fails itself (not the tool) exits with
//!   [`WRAPPER_FAILED`] and leaves its reason as the termination message
//!   ([`failure_message`]).
//! - The runner reads a termination message with [`read_message`] and a
//!   block in the log with [`result_from_log`].

use super::harness::{claimed_result, parse_result};
use crate::core::envelope::ResultEnvelope;
use crate::core::{ContinuationToken, ToolResult};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Where the wrapper writes its report (the tool container's
/// `terminationMessagePath`).
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// The kubelet keeps at most this much of a termination message.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// The most a tool may print as its result. The kubelet rotates container
/// logs at 10 MiB by default, and the log is where large results travel.
pub const MAX_RESULT_BYTES: usize = 8 * 1024 * 1024;

/// What the termination message says when the result is in the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResultInLog {
    pub result_in_log: bool,
    /// Lowercase hex SHA-256 of the result envelope's JSON.
    pub sha256: String,
    pub bytes: usize,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::core::ids::hex(&Sha256::digest(bytes))
}

fn frame_begin(token: &ContinuationToken, sha: &str, bytes: usize) -> String {
    format!("----- agents result {token} sha256={sha} bytes={bytes} -----")
}

fn frame_end(token: &ContinuationToken) -> String {
    format!("----- end agents result {token} -----")
}

/// Longest line of a framed block: well under the 16 KiB at which the
/// runtime splits log lines.
pub const FRAME_LINE_BYTES: usize = 4096;

/// The block the wrapper prints when the result is too large for the
/// termination message: a begin line (token, hash, length), the JSON in
/// lines of at most 4 KiB (cut at character boundaries; JSON from serde has
/// no raw newlines), an end line. It starts with a newline so it never
/// continues a line the tool left open.
pub fn frame(token: &ContinuationToken, json: &str) -> String {
    let mut out = String::with_capacity(json.len() + json.len() / FRAME_LINE_BYTES + 200);
    out.push('\n');
    out.push_str(&frame_begin(
        token,
        &sha256_hex(json.as_bytes()),
        json.len(),
    ));
    out.push('\n');
    let mut rest = json;
    while !rest.is_empty() {
        let mut cut = rest.len().min(FRAME_LINE_BYTES);
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        out.push_str(&rest[..cut]);
        out.push('\n');
        rest = &rest[cut..];
    }
    out.push_str(&frame_end(token));
    out.push('\n');
    out
}

/// The JSON of the last complete block for `token` announced with `sha`
/// and `bytes`, checked against both.
pub fn unframe(
    log: &str,
    token: &ContinuationToken,
    sha: &str,
    bytes: usize,
) -> Result<String, String> {
    let begin = frame_begin(token, sha, bytes);
    let end = frame_end(token);
    let mut found: Option<String> = None;
    let mut current: Option<String> = None;
    for line in log.lines() {
        if line == begin {
            current = Some(String::with_capacity(bytes));
        } else if line == end {
            if let Some(block) = current.take() {
                found = Some(block);
            }
        } else if let Some(block) = current.as_mut() {
            block.push_str(line);
        }
    }
    let Some(json) = found else {
        return Err(format!(
            "the result block for {token} (sha256 {sha}) is not in the tool's log; \
             the log may have been rotated or the pod removed"
        ));
    };
    let got = sha256_hex(json.as_bytes());
    if json.len() != bytes || got != sha {
        return Err(format!(
            "the result block in the tool's log is damaged: {} bytes with sha256 {got}, \
             announced {bytes} bytes with sha256 {sha}",
            json.len()
        ));
    }
    Ok(json)
}

/// What the wrapper reports for `result`: the termination message, and the
/// block to print on stderr when the result does not fit in it.
pub fn report(token: &ContinuationToken, result: &ToolResult) -> (String, Option<String>) {
    let json = serde_json::to_string(&ResultEnvelope::from_result(token.clone(), result))
        .expect("result envelopes serialise");
    if json.len() <= TERMINATION_MESSAGE_LIMIT {
        return (json, None);
    }
    let pointer = ResultInLog {
        result_in_log: true,
        sha256: sha256_hex(json.as_bytes()),
        bytes: json.len(),
    };
    let block = frame(token, &json);
    (
        serde_json::to_string(&pointer).expect("serialises"),
        Some(block),
    )
}

/// How a termination message reads.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// The result itself (or an error result if the envelope is bad).
    Result(ToolResult),
    /// The result is in the log.
    InLog(ResultInLog),
    /// Not from a wrapper that reported: its own failure text, or nothing.
    Other(String),
}

pub fn read_message(message: &str, token: &ContinuationToken) -> Message {
    let text = message.trim();
    if text.starts_with('{') {
        if let Ok(pointer) = serde_json::from_str::<ResultInLog>(text) {
            if pointer.result_in_log {
                return Message::InLog(pointer);
            }
        }
        if let Some(result) = claimed_result(text, token) {
            return Message::Result(result);
        }
    }
    Message::Other(text.to_string())
}

/// The result a block in `log` carries, as announced by `pointer`; an
/// error result when the block is missing, damaged or not a valid result
/// envelope for `token`.
pub fn result_from_log(log: &str, token: &ContinuationToken, pointer: &ResultInLog) -> ToolResult {
    match unframe(log, token, &pointer.sha256, pointer.bytes) {
        Ok(json) => parse_result(&json, token),
        Err(e) => ToolResult::error(e),
    }
}

/// The wrapper failed (not the tool): exit status 64 (EX_USAGE), as Argo's.
pub const WRAPPER_FAILED: u8 = 64;

/// The termination message of a wrapper that failed: its reason, cut well
/// within what the kubelet keeps.
pub fn failure_message(reason: &str) -> String {
    reason.chars().take(TERMINATION_MESSAGE_LIMIT / 4).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> ContinuationToken {
        ContinuationToken("demo-t1-c0".into())
    }

    #[test]
    fn frames_round_trip_and_damage_is_caught() {
        let t = token();
        let json = format!("{{\"x\":\"{}é\"}}", "a".repeat(10_000));
        let block = frame(&t, &json);
        assert!(block.lines().all(|l| l.len() <= FRAME_LINE_BYTES + 100));
        let sha = sha256_hex(json.as_bytes());
        let log = format!("some stderr\nno newline at the end{block}more\n");
        assert_eq!(unframe(&log, &t, &sha, json.len()).unwrap(), json);
        let damaged = log.replacen("aaaa", "aaab", 1);
        let e = unframe(&damaged, &t, &sha, json.len()).unwrap_err();
        assert!(e.contains("damaged"), "{e}");
        let e = unframe("nothing", &t, &sha, json.len()).unwrap_err();
        assert!(e.contains("not in the tool's log"), "{e}");
        // Another call's block is not ours.
        let other = ContinuationToken("demo-t1-c1".into());
        assert!(unframe(&log, &other, &sha, json.len()).is_err());
    }

    #[test]
    fn small_results_go_in_the_message_large_ones_in_the_log() {
        let t = token();
        let (msg, block) = report(&t, &ToolResult::text("hi"));
        assert!(block.is_none());
        assert_eq!(
            read_message(&msg, &t),
            Message::Result(ToolResult::text("hi"))
        );
        let big = ToolResult::text("z".repeat(20_000));
        let (msg, block) = report(&t, &big);
        assert!(msg.len() < 200, "{msg}");
        let Message::InLog(p) = read_message(&msg, &t) else {
            panic!("{msg}")
        };
        let json = unframe(&block.unwrap(), &t, &p.sha256, p.bytes).unwrap();
        assert_eq!(ResultEnvelope::parse_for(&json, &t).unwrap(), big);
        // A message for another token is an error result, not a success.
        let other = ContinuationToken("other-t1-c0".into());
        let (msg, _) = report(&other, &ToolResult::text("hi"));
        assert!(
            matches!(read_message(&msg, &t), Message::Result(ToolResult::Error { message }) if message.contains("token"))
        );
        assert_eq!(
            read_message("cannot read the envelope", &t),
            Message::Other("cannot read the envelope".into())
        );
    }
}
