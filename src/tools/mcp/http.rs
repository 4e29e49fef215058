//! Streamable HTTP: each message is a POST; the answer is one JSON
//! message (`application/json`) or an SSE stream (`text/event-stream`)
//! whose events end with the response. Both are read as streams, bounded.

use super::{rpc_error, McpError, Reply, Route, MAX_MESSAGE_BYTES, MODERN_VERSION};
use crate::core::policy::EnvVarSpec;
use crate::http;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Headers the client sets itself; an `mcp` entry cannot replace them.
pub const RESERVED_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "host",
    "accept",
    "mcp-protocol-version",
    "mcp-session-id",
    "mcp-method",
    "mcp-name",
];

/// A server at a URL, with the headers its entry names (resolved).
pub struct HttpEndpoint {
    url: reqwest::Url,
    client: reqwest::Client,
    headers: HeaderMap,
}

/// The entry's headers with their values (secret ones marked sensitive),
/// and the key of a connection with exactly these values: a hash, never
/// the values themselves.
pub(crate) fn resolve_headers(
    url: &str,
    headers: &[EnvVarSpec],
    lookup: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<(String, HeaderMap), McpError> {
    let mut map = HeaderMap::new();
    let mut hash = Sha256::new();
    for h in headers {
        let value = h
            .resolve(lookup)
            .map_err(|e| McpError::Transport(format!("header {e}")))?;
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| {
            McpError::Transport(format!(
                "header {:?} is not a valid HTTP header name",
                h.name
            ))
        })?;
        let mut v = HeaderValue::from_str(&value).map_err(|_| {
            McpError::Transport(format!(
                "header {:?}: its value is not a valid HTTP header value",
                h.name
            ))
        })?;
        v.set_sensitive(h.secret.is_some());
        hash.update(h.name.as_bytes());
        hash.update([0]);
        hash.update(value.as_bytes());
        hash.update([0]);
        map.append(name, v);
    }
    let digest: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((format!("http {url} {digest}"), map))
}

impl HttpEndpoint {
    pub(crate) fn new(
        url: &str,
        client: reqwest::Client,
        headers: HeaderMap,
    ) -> Result<Self, McpError> {
        let url = reqwest::Url::parse(url)
            .map_err(|e| McpError::Transport(format!("{url:?} is not a URL: {e}")))?;
        Ok(HttpEndpoint {
            url,
            client,
            headers,
        })
    }

    /// POSTs `message`; the response with its id (none for a notification).
    pub(crate) async fn send(&self, message: &Value, route: &Route<'_>) -> Result<Reply, McpError> {
        let mut request = self
            .client
            .post(self.url.clone())
            .headers(self.headers.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("Accept", "application/json, text/event-stream")
            .json(message);
        if let Some(v) = route.version {
            request = request.header("MCP-Protocol-Version", v);
            if v == MODERN_VERSION {
                request = request.header("Mcp-Method", route.method);
                if let Some(name) = route.name {
                    request = request.header("Mcp-Name", name);
                }
            }
        }
        if let Some(s) = route.session {
            request = request.header("Mcp-Session-Id", s);
        }
        let mut response = request
            .send()
            .await
            .map_err(|e| McpError::Transport(format!("POST {} failed: {e}", self.url)))?;
        let status = response.status();
        let session = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if status.is_redirection() {
            return Err(McpError::Transport(http::redirect_refused(
                &format!("POST {}", self.url),
                &response,
            )));
        }
        if status == reqwest::StatusCode::NOT_FOUND && route.session.is_some() {
            return Err(McpError::SessionGone);
        }
        if !status.is_success() {
            return Err(error_reply(&mut response).await);
        }
        let id = message.get("id");
        let Some(id) = id else {
            return Ok(Reply {
                message: None,
                session,
            });
        };
        if status == reqwest::StatusCode::ACCEPTED {
            return Ok(Reply {
                message: None,
                session,
            });
        }
        let message = if is_event_stream(&response) {
            read_events(&mut response, id).await?
        } else {
            read_json(&mut response, id).await?
        };
        Ok(Reply {
            message: Some(message),
            session,
        })
    }
}

fn is_event_stream(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// A non-2xx answer: its JSON-RPC error if the (bounded) body holds one,
/// else the status and the start of the body.
async fn error_reply(response: &mut reqwest::Response) -> McpError {
    let status = response.status().as_u16();
    let body = match http::read_at_most(response, http::ERROR_BODY_BYTES).await {
        Ok(b) => b.bytes,
        Err(e) => {
            return McpError::Transport(format!("HTTP {status}; reading its body failed: {e}"))
        }
    };
    if let Ok(v) = serde_json::from_slice::<Value>(&body) {
        if let Some(error) = v.get("error") {
            return rpc_error(error);
        }
    }
    McpError::Http {
        status,
        body: http::clip(&String::from_utf8_lossy(&body), 500).to_string(),
    }
}

fn too_large(too: http::TooLarge) -> McpError {
    McpError::Transport(too.describe("an MCP server's message", MAX_MESSAGE_BYTES))
}

/// One JSON body: the response to `id` (alone, or in a batch).
async fn read_json(response: &mut reqwest::Response, id: &Value) -> Result<Value, McpError> {
    let body = http::read_capped(response, MAX_MESSAGE_BYTES)
        .await
        .map_err(|e| McpError::Transport(format!("reading the reply failed: {e}")))?
        .map_err(too_large)?;
    let value: Value = serde_json::from_slice(&body).map_err(|e| {
        McpError::Protocol(format!(
            "the reply is not JSON ({e}): {}",
            http::clip(&String::from_utf8_lossy(&body), 300)
        ))
    })?;
    let found = match value {
        Value::Array(all) => all.into_iter().find(|m| m.get("id") == Some(id)),
        one if one.get("id") == Some(id) => Some(one),
        _ => None,
    };
    found.ok_or_else(|| McpError::Protocol("the reply holds no response to the request".into()))
}

/// An SSE stream, read until the event that answers `id`: notifications
/// and requests before it are skipped. At most [`MAX_MESSAGE_BYTES`] are
/// read in all.
async fn read_events(response: &mut reqwest::Response, id: &Value) -> Result<Value, McpError> {
    let mut events = EventReader::default();
    let failed =
        |e: http::BodyError| McpError::Transport(format!("reading the event stream failed: {e}"));
    let mut body = http::BodyReader::new(response, MAX_MESSAGE_BYTES).map_err(failed)?;
    loop {
        let chunk = match body.next(response).await.map_err(failed)? {
            http::Piece::Data(chunk) => chunk,
            http::Piece::Over => {
                return Err(too_large(match body.encoding() {
                    Some(encoding) => http::TooLarge::Decoded(encoding),
                    None => http::TooLarge::Streamed,
                }))
            }
            http::Piece::End => {
                return Err(McpError::Transport(
                    "the server ended the event stream without answering the request".into(),
                ))
            }
        };
        for data in events.push(&chunk) {
            let Ok(message) = serde_json::from_str::<Value>(&data) else {
                continue;
            };
            if message.get("id") == Some(id)
                && (message.get("result").is_some() || message.get("error").is_some())
            {
                return Ok(message);
            }
        }
    }
}

/// Splits an SSE byte stream into the `data` of its events.
#[derive(Default)]
struct EventReader {
    line: Vec<u8>,
    data: String,
}

impl EventReader {
    /// The data of every event `chunk` completes.
    fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        let mut done = Vec::new();
        for &b in chunk {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            let line = std::mem::take(&mut self.line);
            let line =
                String::from_utf8_lossy(line.strip_suffix(b"\r").unwrap_or(&line)).into_owned();
            if line.is_empty() {
                if !self.data.is_empty() {
                    done.push(std::mem::take(&mut self.data));
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                if !self.data.is_empty() {
                    self.data.push('\n');
                }
                self.data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_on_blank_lines_across_chunks() {
        let mut r = EventReader::default();
        assert!(r
            .push(b"id: 1\r\ndata:\r\n\r\nevent: message\r\ndata: {\"a\"")
            .is_empty());
        assert_eq!(
            r.push(b":1}\r\n\r\ndata: x\ndata: y\n\n"),
            ["{\"a\":1}", "x\ny"]
        );
    }
}
