//! Bounded HTTP for every server a user chose: the `http` tool kind and
//! the OpenAI-compatible model client (`crate::model`) both read through
//! these (capped bodies, same-origin redirects only).
//!
//! The operator serves every namespace from one pod with a memory limit,
//! so nothing a tenant's server sends is held whole before it is measured:
//!
//! - a body is read as a stream, and reading stops at a cap; a
//!   `Content-Length` above the cap is refused before any of it is read;
//! - an error (non-2xx) body is read only as far as
//!   [`ERROR_BODY_BYTES`], enough to quote it;
//! - a response head is bounded by hyper's HTTP/1 parser (at most 100
//!   headers in about 400 KiB; a larger head fails the request), and
//!   HTTP/2 is not compiled in;
//! - replies are asked for uncompressed (`Accept-Encoding: identity`,
//!   [`client_builder`]). One sent compressed anyway is decoded here,
//!   while it streams, when it is `gzip` or `deflate`: the cap counts the
//!   decoded bytes (and the bytes sent), so a small reply that inflates
//!   to a GiB stops at the cap. Any other encoding (`br`, `zstd`, two
//!   stacked) is an error that names it ([`BodyError::Unsupported`]);
//!   compressed bytes are never handed on as if they were the reply.
//!   reqwest's own decompression is not used: it asks every server for
//!   compression, passes encodings it does not know through as bytes, and
//!   hides from the cap which encoding inflated the reply. Brotli is not
//!   decoded: its decoder may take a 16 MiB window for any reply, however
//!   small, more than most of the caps here;
//! - redirects are followed only within the origin (scheme, host and port)
//!   of the URL asked, at most [`MAX_REDIRECTS`] times, so a server cannot
//!   bounce the runtime, and the secret headers it sends, to another host
//!   (an internal address, say). The 3xx itself comes back to the caller,
//!   which says so in its error ([`redirect_refused`]);
//! - where the operator lists the URLs http tools may call
//!   ([`allow::AllowedUrls`]), a redirect is followed only to a listed URL
//!   ([`redirect_policy_within`]).

pub mod allow;
mod decode;

use reqwest::redirect::{Attempt, Policy};
use reqwest::Response;
use std::sync::Arc;

/// At most this many bytes of an error (non-2xx) body are read: enough for
/// a JSON error object from any API, little enough that a hostile server's
/// "error page" costs nothing. The rest is never read.
pub const ERROR_BODY_BYTES: usize = 64 * 1024;

/// Redirects followed at most, each within the origin first asked.
pub const MAX_REDIRECTS: usize = 5;

/// The redirect policy of every client here: follow a redirect only to the
/// scheme, host and port first asked, at most [`MAX_REDIRECTS`] times; else
/// hand the 3xx back unfollowed.
pub fn redirect_policy() -> Policy {
    Policy::custom(|attempt| follow_within_origin(attempt, None))
}

/// [`redirect_policy`], and only to a URL that `allowed` lists: the
/// origin stays, but the path may change, and the list may name paths.
pub fn redirect_policy_within(allowed: Arc<allow::AllowedUrls>) -> Policy {
    Policy::custom(move |attempt| follow_within_origin(attempt, Some(&allowed)))
}

fn follow_within_origin(
    attempt: Attempt<'_>,
    allowed: Option<&allow::AllowedUrls>,
) -> reqwest::redirect::Action {
    let first = attempt.previous().first().map(|u| u.origin());
    let same_origin = first.is_some_and(|o| o == attempt.url().origin());
    let listed = allowed.is_none_or(|list| list.allows(attempt.url()));
    if same_origin && listed && attempt.previous().len() <= MAX_REDIRECTS {
        attempt.follow()
    } else {
        attempt.stop()
    }
}

/// The error text for a 3xx that [`redirect_policy`] did not follow.
pub fn redirect_refused(method_url: &str, response: &Response) -> String {
    let status = response.status();
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(|l| format!(" to {:?}", clip(l, 200)))
        .unwrap_or_default();
    format!(
        "{method_url} answered {status}, a redirect{location}, which was not followed: \
         redirects are followed only to the same scheme, host and port, at most \
         {MAX_REDIRECTS} times, so that headers (secrets among them) never go to another \
         host; set the URL to the final address"
    )
}

/// A client builder for every client here: it asks for replies
/// uncompressed (see the module doc).
pub fn client_builder() -> reqwest::ClientBuilder {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::ACCEPT_ENCODING,
        reqwest::header::HeaderValue::from_static("identity"),
    );
    reqwest::Client::builder().default_headers(headers)
}

/// A body read up to a limit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limited {
    /// At most the limit's bytes, from the start of the (decoded) body.
    pub bytes: Vec<u8>,
    /// More followed (or was announced) that was not read.
    pub cut: bool,
    /// The `Content-Encoding` it was decoded from; `None`: sent as is.
    pub encoding: Option<&'static str>,
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("{0}")]
    Transport(#[from] reqwest::Error),
    /// A `Content-Encoding` not decoded here; nothing of the body was read.
    #[error(
        "the reply is encoded as {0:?} (Content-Encoding), which is not decoded here: \
         replies are asked for uncompressed (Accept-Encoding: identity), and gzip and \
         deflate are decoded; have the server answer uncompressed"
    )]
    Unsupported(String),
    /// The body says it is `encoding` but does not decode as such.
    #[error("the reply does not decode as {encoding} (its Content-Encoding): {why}")]
    Undecodable { encoding: &'static str, why: String },
}

/// Reads `response`'s body, keeping at most `limit` bytes (decoded, when
/// the server compressed it); once more arrives, stops reading (the rest
/// is never received) and marks the body cut. Memory stays within `limit`
/// plus one chunk (and a decoder's 32 KiB window), whatever the server
/// sends or announces.
pub async fn read_at_most(response: &mut Response, limit: usize) -> Result<Limited, BodyError> {
    let announced = response.content_length();
    let capacity = announced.map_or(8 * 1024, |n| n.min(limit as u64) as usize);
    let mut reader = BodyReader::new(response, limit)?;
    let mut out = Limited {
        bytes: Vec::with_capacity(capacity),
        cut: false,
        encoding: reader.encoding(),
    };
    loop {
        match reader.next(response).await? {
            Piece::Data(data) => out.bytes.extend_from_slice(&data),
            Piece::Over => {
                out.cut = true;
                return Ok(out);
            }
            Piece::End => return Ok(out),
        }
    }
}

/// A piece of a body from [`BodyReader::next`].
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// The next bytes, decoded.
    Data(Vec<u8>),
    /// The body goes on past the limit (decoded, or as sent); nothing more
    /// is read.
    Over,
    /// The body ended within the limit.
    End,
}

/// A response body read as it streams, decoded from its
/// `Content-Encoding`, and at most `limit` bytes of it: the decoded bytes
/// and, for a compressed body, the bytes sent too.
pub struct BodyReader {
    decoder: Option<decode::Decoder>,
    limit: usize,
    /// Decoded bytes handed out.
    given: usize,
    /// Bytes received, compressed.
    sent: usize,
    over: bool,
}

impl BodyReader {
    /// A reader of `response`'s body, or the error naming an encoding
    /// that is not decoded here.
    pub fn new(response: &Response, limit: usize) -> Result<BodyReader, BodyError> {
        Ok(BodyReader {
            decoder: decode::Decoder::for_response(response)?,
            limit,
            given: 0,
            sent: 0,
            over: false,
        })
    }

    /// The encoding it decodes; `None`: the body comes as is.
    pub fn encoding(&self) -> Option<&'static str> {
        self.decoder.as_ref().map(decode::Decoder::name)
    }

    /// The next piece of the decoded body.
    pub async fn next(&mut self, response: &mut Response) -> Result<Piece, BodyError> {
        loop {
            if self.over {
                return Ok(Piece::Over);
            }
            let room = self.limit - self.given;
            let chunk = response.chunk().await?;
            let data = match (&mut self.decoder, chunk) {
                (None, None) => return Ok(Piece::End),
                (None, Some(chunk)) => chunk.to_vec(),
                (Some(decoder), None) => {
                    let rest = decoder.finish(room)?;
                    if rest.is_empty() {
                        return Ok(Piece::End);
                    }
                    rest
                }
                (Some(decoder), Some(chunk)) => {
                    self.sent += chunk.len();
                    if self.sent > self.limit {
                        self.over = true;
                        continue;
                    }
                    decoder.push(&chunk, room)?
                }
            };
            if data.len() > room {
                self.over = true;
            }
            let data = if self.over {
                data[..room].to_vec()
            } else {
                data
            };
            self.given += data.len();
            if !data.is_empty() {
                return Ok(Piece::Data(data));
            }
        }
    }
}

/// Why a body was refused, for a message: `what` is "an http tool's reply"
/// or "a model reply".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TooLarge {
    /// `Content-Length` said so; nothing was read.
    Announced(u64),
    /// More than the cap arrived; reading stopped there.
    Streamed,
    /// A compressed reply (`gzip`, `deflate`) decoded, or sent, to more
    /// than the cap; decoding stopped there.
    Decoded(&'static str),
}

impl TooLarge {
    /// "announced a reply of N bytes (Content-Length), more than the C bytes
    /// {what} may hold; none of it was read" and its streamed sibling.
    pub fn describe(self, what: &str, cap: usize) -> String {
        match self {
            TooLarge::Announced(n) => format!(
                "announced a reply of {n} bytes (Content-Length), more than the {cap} bytes ({}) {what} may hold; none of it was read",
                human(cap)
            ),
            TooLarge::Streamed => format!(
                "sent a reply of more than {cap} bytes ({}), the most {what} may hold; reading stopped there and the reply was dropped",
                human(cap)
            ),
            TooLarge::Decoded(encoding) => format!(
                "sent a {encoding}-compressed reply of more than {cap} bytes ({}) once decoded (or as sent), the most {what} may hold; decoding stopped there and the reply was dropped",
                human(cap)
            ),
        }
    }
}

/// Reads a success body whole (decoded), if it is at most `cap` bytes.
pub async fn read_capped(
    response: &mut Response,
    cap: usize,
) -> Result<Result<Vec<u8>, TooLarge>, BodyError> {
    if let Some(n) = response.content_length().filter(|n| *n > cap as u64) {
        return Ok(Err(TooLarge::Announced(n)));
    }
    let body = read_at_most(response, cap).await?;
    Ok(match (body.cut, body.encoding) {
        (false, _) => Ok(body.bytes),
        (true, None) => Err(TooLarge::Streamed),
        (true, Some(encoding)) => Err(TooLarge::Decoded(encoding)),
    })
}

/// `n` bytes in the largest binary unit that divides it, for messages.
pub fn human(n: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (size, unit) in UNITS {
        if n >= size && n.is_multiple_of(size) {
            return format!("{} {unit}", n / size);
        }
    }
    format!("{n} bytes")
}

/// The longest prefix of `s` of at most `max` bytes that ends on a
/// character boundary.
pub fn clip(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use reqwest::StatusCode;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Serves every connection with `head` and then `body_bytes` bytes of
    /// `x` (generated, never held), counting requests.
    pub(crate) async fn server(head: String, body_bytes: usize) -> (u16, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let count = hits.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                let head = head.clone();
                tokio::spawn(async move {
                    read_request(&mut sock).await;
                    if sock.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    let chunk = vec![b'x'; 64 * 1024];
                    let mut left = body_bytes;
                    while left > 0 {
                        let n = left.min(chunk.len());
                        if sock.write_all(&chunk[..n]).await.is_err() {
                            return;
                        }
                        left -= n;
                    }
                });
            }
        });
        (port, hits)
    }

    /// Reads one request: its head, then as many bytes as it announced.
    pub(crate) async fn read_request(sock: &mut tokio::net::TcpStream) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    return buf;
                }
            }
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return buf,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn client() -> reqwest::Client {
        reqwest::Client::builder()
            .redirect(redirect_policy())
            .build()
            .unwrap()
    }

    /// `{}` POSTed to the loopback server on `port`.
    async fn post_empty(port: u16) -> reqwest::Response {
        client()
            .post(format!("http://127.0.0.1:{port}/"))
            .body("{}")
            .send()
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn bodies_are_read_up_to_the_cap_and_no_further() {
        let close = "HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n".to_string();
        let (port, _) = server(close.clone(), 100).await;
        let url = format!("http://127.0.0.1:{port}/");
        let mut r = client().get(&url).send().await.unwrap();
        assert_eq!(read_capped(&mut r, 100).await.unwrap().unwrap().len(), 100);
        let mut r = client().get(&url).send().await.unwrap();
        assert_eq!(
            read_capped(&mut r, 99).await.unwrap(),
            Err(TooLarge::Streamed)
        );
        // 64 MiB streamed, 1 KiB kept.
        let (port, _) = server(close, 64 << 20).await;
        let url = format!("http://127.0.0.1:{port}/");
        let mut r = client().get(&url).send().await.unwrap();
        let body = read_at_most(&mut r, 1024).await.unwrap();
        assert!(body.cut);
        assert_eq!(body.bytes.len(), 1024);
        assert!(body.bytes.capacity() <= 8 * 1024);
        // A Content-Length above the cap is refused unread.
        let announced = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", 1u64 << 40);
        let (port, _) = server(announced, 1024).await;
        let url = format!("http://127.0.0.1:{port}/");
        let mut r = client().get(&url).send().await.unwrap();
        assert_eq!(
            read_capped(&mut r, 1 << 20).await.unwrap(),
            Err(TooLarge::Announced(1 << 40))
        );
    }

    #[tokio::test]
    async fn redirects_stay_within_the_origin() {
        let (other, other_hits) = server(
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n".to_string(),
            2,
        )
        .await;
        // 127.0.0.1 and localhost are one machine but two hosts.
        let away = format!(
            "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://localhost:{other}/x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        let (port, _) = server(away, 0).await;
        let url = format!("http://127.0.0.1:{port}/");
        let r = client().post(&url).body("{}").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::TEMPORARY_REDIRECT);
        let message = redirect_refused(&format!("POST {url}"), &r);
        assert!(
            message.contains(&format!(
                "a redirect to \"http://localhost:{other}/x\", which was not followed"
            )),
            "{message}"
        );
        // A port is part of the origin too.
        let port_away = format!(
            "HTTP/1.1 308 Permanent Redirect\r\nlocation: http://127.0.0.1:{other}/x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        let (port, _) = server(port_away, 0).await;
        let r = post_empty(port).await;
        assert_eq!(r.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(other_hits.load(Ordering::SeqCst), 0);
        // Within the origin, a redirect is followed; a loop ends.
        let looping =
            "HTTP/1.1 307 Temporary Redirect\r\nlocation: /again\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                .to_string();
        let (port, hits) = server(looping, 0).await;
        let r = post_empty(port).await;
        assert_eq!(r.status(), StatusCode::TEMPORARY_REDIRECT);
        assert_eq!(hits.load(Ordering::SeqCst), MAX_REDIRECTS + 1);
    }

    #[tokio::test]
    async fn a_huge_response_head_fails_the_request() {
        let junk = "x".repeat(8 * 1024);
        let mut head = "HTTP/1.1 200 OK\r\n".to_string();
        for i in 0..1024 {
            head.push_str(&format!("x-junk-{i}: {junk}\r\n"));
        }
        head.push_str("content-length: 0\r\n\r\n");
        let (port, _) = server(head, 0).await;
        let e = client()
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .unwrap_err();
        assert!(format!("{e:?}").contains("Parse(TooLarge)"), "{e:?}");
    }

    /// Serves every connection with `head` and then `body`, its first
    /// byte alone (a decoder must wait for more before it can tell).
    async fn serve_bytes(head: String, body: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let (head, body) = (head.clone(), body.clone());
                tokio::spawn(async move {
                    read_request(&mut sock).await;
                    let _ = sock.write_all(head.as_bytes()).await;
                    let (first, rest) = body.split_at(body.len().min(1));
                    let _ = sock.write_all(first).await;
                    let _ = sock.flush().await;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    let _ = sock.write_all(rest).await;
                });
            }
        });
        format!("http://127.0.0.1:{port}/")
    }

    fn encoded(encoding: &str) -> String {
        format!("HTTP/1.1 200 OK\r\ncontent-encoding: {encoding}\r\nconnection: close\r\n\r\n")
    }

    fn compress(kind: &str, data: &[u8]) -> Vec<u8> {
        use flate2::write::{DeflateEncoder, GzEncoder, ZlibEncoder};
        use std::io::Write;
        let level = flate2::Compression::default();
        match kind {
            "gzip" => {
                let mut e = GzEncoder::new(Vec::new(), level);
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            "zlib" => {
                let mut e = ZlibEncoder::new(Vec::new(), level);
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            _ => {
                let mut e = DeflateEncoder::new(Vec::new(), level);
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
        }
    }

    #[tokio::test]
    async fn compressed_bodies_are_decoded_and_the_cap_counts_decoded_bytes() {
        let json = br#"{"text": "hello"}"#.repeat(1000);
        let cases = [
            ("gzip", "gzip", "gzip"),
            ("x-gzip", "gzip", "gzip"),
            ("identity, gzip", "gzip", "gzip"),
            ("deflate", "zlib", "deflate"),
            ("deflate", "raw", "deflate"),
        ];
        for (header, kind, name) in cases {
            let url = serve_bytes(encoded(header), compress(kind, &json)).await;
            let mut r = client().get(&url).send().await.unwrap();
            let body = read_capped(&mut r, 1 << 20).await.unwrap();
            assert_eq!(body.as_deref(), Ok(&json[..]), "{header} ({kind})");
            let mut r = client().get(&url).send().await.unwrap();
            let cut = read_at_most(&mut r, 100).await.unwrap();
            assert_eq!(cut.bytes, json[..100], "{header} ({kind})");
            assert!(cut.cut && cut.encoding == Some(name), "{header}: {cut:?}");
            let mut r = client().get(&url).send().await.unwrap();
            assert_eq!(
                read_capped(&mut r, json.len() - 1).await.unwrap(),
                Err(TooLarge::Decoded(name))
            );
        }
        let message = TooLarge::Decoded("gzip").describe("an http tool's reply", 1 << 20);
        assert!(
            message.starts_with(
                "sent a gzip-compressed reply of more than 1048576 bytes (1 MiB) once decoded"
            ),
            "{message}"
        );
    }

    #[tokio::test]
    async fn encodings_not_decoded_here_are_named_and_garbage_is_refused() {
        for (header, named) in [("br", "br"), ("gzip, br", "gzip, br"), ("zstd", "zstd")] {
            let url = serve_bytes(encoded(header), b"\x28\xb5\x2f\xfd".to_vec()).await;
            let mut r = client().get(&url).send().await.unwrap();
            match read_at_most(&mut r, 1024).await {
                Err(e @ BodyError::Unsupported(_)) => {
                    let text = e.to_string();
                    assert!(
                        text.contains(&format!("encoded as {named:?} (Content-Encoding)")),
                        "{text}"
                    );
                }
                other => panic!("{header}: {other:?}"),
            }
        }
        let url = serve_bytes(encoded("gzip"), b"plain text, not gzip".to_vec()).await;
        let mut r = client().get(&url).send().await.unwrap();
        match read_capped(&mut r, 1024).await {
            Err(BodyError::Undecodable {
                encoding: "gzip", ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // Every client here asks for replies uncompressed.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let asked = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let request = read_request(&mut sock).await;
            let _ = sock
                .write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                .await;
            String::from_utf8_lossy(&request).to_ascii_lowercase()
        });
        let c = client_builder().build().unwrap();
        c.get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .unwrap();
        let request = asked.await.unwrap();
        assert!(
            request.contains("accept-encoding: identity\r\n"),
            "{request}"
        );
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(8 << 20), "8 MiB");
        assert_eq!(human(64 * 1024), "64 KiB");
        assert_eq!(human(1000), "1000 bytes");
        assert_eq!(clip("éé", 3), "é");
    }
}
