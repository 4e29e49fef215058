//! What every remote model client shares: one bounded HTTP attempt and
//! the classification of its outcome.
//!
//! One POST per call, bounded by the agent's timeout. Failures are
//! classified, not retried here: 408, 429, 5xx (Anthropic's 529 among
//! them), network trouble, timeouts and a 200 whose body is not the reply
//! the provider promises are retryable (with the endpoint's `Retry-After`,
//! if any); other statuses are not.
//!
//! The endpoint is the user's choice, so what it sends is bounded as it
//! streams: a reply over [`MAX_MODEL_REPLY_BYTES`] is a permanent failure
//! (read no further, never re-asked), an error body is read only as far as
//! it is quoted, and a redirect to another host is refused. These are the
//! bounds `crate::tools::http` puts on the http tools; the layers keep the
//! two adapters apart, so each holds its few lines.
//!
//! The API key never appears in `Debug` output or in error messages.

use super::ModelError;
use crate::http::allow::AllowedUrls;
use crate::http::{self, clip};
use reqwest::header::HeaderValue;
use reqwest::StatusCode;
use serde_json::Value;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The longest wait a `Retry-After` header can impose; a larger value is
/// cut to this, so a misconfigured endpoint cannot park a session for days.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);

/// The request timeout for an agent that sets none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// At most this many bytes of a body are quoted in an error message.
pub(super) const QUOTE_BYTES: usize = 200;

/// The longest chat-completion reply read. A model's longest answers
/// (some 128k output tokens, about half a MiB of text) fit many times
/// over, with room for JSON escapes; parsed, a reply may take several
/// times its size, and the operator holds every namespace's model calls
/// under one memory limit. A longer reply is a permanent failure of the
/// call: reading stops at this size, and the endpoint is not asked again.
pub const MAX_MODEL_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// How the API key goes with each request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum KeyHeader {
    /// `Authorization: Bearer KEY` (OpenAI and most compatible servers).
    Bearer,
    /// The key alone as this header's value (Anthropic's `x-api-key`,
    /// Azure OpenAI's `api-key`).
    Named(&'static str),
}

/// What a provider's messages say about it: where its settings are in the
/// Agent spec (`spec.model.openai`) and what a good reply is called ("a
/// chat completion").
#[derive(Clone, Copy, Debug)]
pub(super) struct Wire {
    pub section: &'static str,
    pub reply: &'static str,
}

/// The HTTP side of a model client: timeout, key, redirect policy and the
/// operator's list of model URLs.
#[derive(Clone)]
pub(super) struct Endpoint {
    /// How long one request may take, from connecting to the last byte.
    pub timeout: Duration,
    api_key: Option<String>,
    http: reqwest::Client,
    /// The operator's list of model URLs (`--model-allowed-urls`); none:
    /// any URL.
    allowed: Option<Arc<AllowedUrls>>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("timeout", &self.timeout)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Endpoint {
    /// `timeout` bounds each request. An empty key counts as no key.
    pub fn new(api_key: Option<String>, timeout: Duration) -> Self {
        Endpoint {
            timeout,
            // Never to another host: the API key goes with each request.
            http: http_client(timeout, http::redirect_policy()),
            api_key: api_key.filter(|k| !k.is_empty()),
            allowed: None,
        }
    }

    /// Held to the operator's list of model URLs: an endpoint off the
    /// list is never sent a request (nor the key), and a redirect is
    /// followed only to a listed URL of the same origin.
    pub fn with_allowed_urls(mut self, allowed: Option<Arc<AllowedUrls>>) -> Self {
        if let Some(list) = &allowed {
            self.http = http_client(self.timeout, http::redirect_policy_within(list.clone()));
        }
        self.allowed = allowed;
        self
    }

    /// With the API key `key` (an empty one counts as none).
    pub fn with_api_key(mut self, key: Option<String>) -> Self {
        self.api_key = key.filter(|k| !k.is_empty());
        self
    }

    /// Why the operator's list refuses `url`, if it does.
    pub fn not_allowed(&self, url: &str) -> Option<String> {
        let list = self.allowed.as_ref()?;
        (!list.allows_str(url)).then(|| list.not_listed(url))
    }

    /// One POST of `body` to `url` with the key (as `key_header` says)
    /// and `headers`; a success body goes through `parse`. See the module
    /// doc for how failures are classified.
    pub async fn post<T>(
        &self,
        url: &str,
        key_header: KeyHeader,
        headers: &[(&str, &str)],
        body: &Value,
        wire: Wire,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ModelError> {
        let key = self.api_key.as_deref();
        let mut request = self.http.post(url).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request = match (key, key_header) {
            (None, _) => request,
            (Some(key), KeyHeader::Bearer) => request.bearer_auth(key),
            (Some(key), KeyHeader::Named(name)) => match HeaderValue::from_str(key) {
                // Sensitive, as `bearer_auth` marks its header: kept out of
                // reqwest's and hyper's debug output.
                Ok(mut value) => {
                    value.set_sensitive(true);
                    request.header(name, value)
                }
                Err(_) => {
                    return Err(ModelError::permanent(format!(
                        "the API key holds characters no HTTP header may carry; check {}.apiKeySecretRef",
                        wire.section
                    )))
                }
            },
        };
        let result = match self.exchange(request, url, wire).await {
            Ok(reply) => classify(url, &reply, key, wire, parse),
            Err(e) => Err(e),
        };
        // Belt and braces: whatever text reached the message, not the key.
        result.map_err(|mut e| {
            e.message = redact(&e.message, key);
            e
        })
    }

    /// Sends `request` and reads its reply within the bounds.
    async fn exchange(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
        wire: Wire,
    ) -> Result<Reply, ModelError> {
        let mut response = request
            .send()
            .await
            .map_err(|e| self.transport_error(url, &e))?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        if status.is_redirection() {
            return Err(redirect_refused(url, &response, wire));
        }
        if let Some(n) = response
            .content_length()
            .filter(|n| status.is_success() && *n > MAX_MODEL_REPLY_BYTES as u64)
        {
            return Err(too_long(
                url,
                status,
                &format!(
                    "announced a reply of {n} bytes (Content-Length), more than the \
                     {MAX_MODEL_REPLY_BYTES} bytes ({} MiB) a model reply may hold; none \
                     of it was read",
                    MAX_MODEL_REPLY_BYTES >> 20
                ),
                wire,
            ));
        }
        let limit = if status.is_success() {
            MAX_MODEL_REPLY_BYTES
        } else {
            http::ERROR_BODY_BYTES
        };
        let body = match http::read_at_most(&mut response, limit).await {
            Ok(body) => body,
            Err(http::BodyError::Transport(e)) => return Err(self.transport_error(url, &e)),
            // A reply this client cannot read now, it cannot read again.
            Err(e) => {
                return Err(ModelError::permanent(format!(
                    "POST {url} answered {status}, but {e}; check {}.baseUrl",
                    wire.section
                )))
            }
        };
        if body.cut && status.is_success() {
            return Err(too_long(
                url,
                status,
                &format!(
                    "sent a reply of more than {MAX_MODEL_REPLY_BYTES} bytes ({} MiB){}, \
                     the most a model reply may hold; reading stopped there",
                    MAX_MODEL_REPLY_BYTES >> 20,
                    body.encoding
                        .map(|e| format!(" once {e}-decoded (or as sent)"))
                        .unwrap_or_default()
                ),
                wire,
            ));
        }
        Ok(Reply {
            status,
            retry_after,
            body: body.bytes,
            cut: body.cut,
        })
    }

    fn transport_error(&self, url: &str, e: &reqwest::Error) -> ModelError {
        if e.is_timeout() {
            ModelError::retryable(format!(
                "POST {url} gave no complete answer within {:?}, the agent's model timeout; the endpoint may be overloaded or hung",
                self.timeout
            ))
        } else {
            ModelError::retryable(format!("POST {url} failed: {}", error_chain(e)))
        }
    }
}

/// A response, read within its bounds. `cut`: the body went on past what
/// was read.
pub(super) struct Reply {
    pub status: StatusCode,
    pub retry_after: Option<Duration>,
    pub body: Vec<u8>,
    pub cut: bool,
}

/// The client of every request: `timeout` on each, redirects by `policy`.
fn http_client(timeout: Duration, policy: reqwest::redirect::Policy) -> reqwest::Client {
    http::client_builder()
        .timeout(timeout)
        .redirect(policy)
        .build()
        .expect("a default HTTP client builds")
}

/// A reply over [`MAX_MODEL_REPLY_BYTES`]: permanent, so it is not asked
/// (and billed) again.
fn too_long(url: &str, status: StatusCode, what: &str, wire: Wire) -> ModelError {
    ModelError::permanent(format!(
        "POST {url} answered {status} but {what}; no model sends such {}, so \
         it is not retried: check {}.baseUrl",
        wire.reply, wire.section
    ))
}

/// A 3xx the client did not follow: to another scheme, host or port, or
/// one too many.
fn redirect_refused(url: &str, response: &reqwest::Response, wire: Wire) -> ModelError {
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(|l| format!(" to {:?}", clip(l, QUOTE_BYTES)))
        .unwrap_or_default();
    ModelError::permanent(format!(
        "POST {url} answered {}, a redirect{location}, which was not followed: redirects are \
         followed only to the same scheme, host and port, at most {} times, so \
         that the API key never goes to another host; check {}.baseUrl",
        response.status(),
        http::MAX_REDIRECTS,
        wire.section
    ))
}

/// Turns a response into the parsed reply or a classified error. Pure, so
/// every branch is unit-tested without a server.
pub(super) fn classify<T>(
    url: &str,
    reply: &Reply,
    key: Option<&str>,
    wire: Wire,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, ModelError> {
    let Reply {
        status,
        retry_after,
        ref body,
        cut,
    } = *reply;
    if status.is_success() {
        let parsed = std::str::from_utf8(body)
            .map_err(|_| "the body is not UTF-8 text".to_string())
            .and_then(parse);
        return parsed.map_err(|what| ModelError {
            message: format!(
                "POST {url} answered {status}, but not with {}: {}; body: {}",
                wire.reply,
                redact(&what, key),
                quote(body, cut, key)
            ),
            retryable: true,
            retry_after,
        });
    }
    let code = status.as_u16();
    let retryable = matches!(code, 408 | 429) || status.is_server_error();
    let said = match server_message(body, key) {
        Some(m) => format!(": {m}"),
        None => format!("; body: {}", quote(body, cut, key)),
    };
    let section = wire.section;
    let hint = match code {
        401 | 403 => format!(
            "; check the API key (the Secret named by {section}.apiKeySecretRef) and what it may use"
        ),
        404 => format!("; check {section}.baseUrl and {section}.model"),
        429 => "; the endpoint is rate limiting".into(),
        529 => "; the endpoint is overloaded".into(),
        _ if retryable => String::new(),
        _ => "; the endpoint refused the request, so it is not retried".into(),
    };
    Err(ModelError {
        message: format!("POST {url} answered {status}{said}{hint}"),
        retryable,
        retry_after: retry_after.filter(|_| retryable),
    })
}

/// The error message a server put in its JSON body, if any, clipped.
fn server_message(body: &[u8], key: Option<&str>) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let text = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .map(str::to_string)
    };
    let m = text(v.pointer("/error/message"))
        .or_else(|| text(v.get("error")))
        .or_else(|| text(v.get("message")))
        .or_else(|| text(v.get("detail")))?;
    let m = redact(&m, key);
    let cut = clip(&m, QUOTE_BYTES);
    Some(if cut.len() < m.len() {
        format!("{cut}…")
    } else {
        m
    })
}

/// At most [`QUOTE_BYTES`] of a body, quoted and escaped, with the key
/// removed before cutting (so no prefix of it survives either). `more`:
/// the body went on past these bytes, unread.
fn quote(body: &[u8], more: bool, key: Option<&str>) -> String {
    if body.is_empty() && !more {
        return "empty".into();
    }
    let text = redact(&String::from_utf8_lossy(body), key);
    let cut = clip(&text, QUOTE_BYTES);
    let size = if more {
        format!("more than {} bytes", body.len())
    } else {
        format!("{} bytes", body.len())
    };
    if cut.len() < text.len() || more {
        format!("{cut:?}… ({size} in all, the first {} shown)", cut.len())
    } else {
        format!("{cut:?}")
    }
}

fn redact(s: &str, key: Option<&str>) -> String {
    match key {
        Some(k) if !k.is_empty() && s.contains(k) => s.replace(k, "<redacted>"),
        _ => s.to_string(),
    }
}

/// The error and its sources, without reqwest's repeat of the URL (our
/// message already names it).
fn error_chain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(u) = e.url() {
        text = text
            .replace(&format!(" for url ({u})"), "")
            .replace(&format!(" ({u})"), "");
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.ends_with(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// A `Retry-After` value (delay seconds, or an HTTP-date in IMF-fixdate
/// form) as a wait from `now`, capped at [`MAX_RETRY_AFTER`]. A date in the
/// past means no wait; a value that is neither form is ignored (`None`).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let wait = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a long time": capped below.
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        parse_http_date(value)?
            .duration_since(now)
            .unwrap_or(Duration::ZERO)
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// IMF-fixdate, `Sun, 06 Nov 1994 08:49:37 GMT`: the form RFC 9110 has
/// servers send.
fn parse_http_date(s: &str) -> Option<SystemTime> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (_weekday, rest) = s.split_once(", ")?;
    let parts: Vec<&str> = rest.split(' ').collect();
    let [day, month, year, time, "GMT"] = parts[..] else {
        return None;
    };
    let number = |s: &str| -> Option<u64> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let day = number(day)?;
    let month = MONTHS.iter().position(|m| *m == month)? as u64 + 1;
    let year = number(year)?;
    let hms: Vec<u64> = time.split(':').map(number).collect::<Option<_>>()?;
    let [h, m, sec] = hms[..] else {
        return None;
    };
    if !(1..=31).contains(&day) || year < 1970 || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    let secs = days_since_epoch(year, month, day) * 86_400 + h * 3600 + m * 60 + sec;
    UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

/// Days from 1970-01-01 to a proleptic Gregorian date (year >= 1970).
fn days_since_epoch(year: u64, month: u64, day: u64) -> u64 {
    // Counts from 0000-03-01 so the leap day ends the year (H. Hinnant).
    let y = if month <= 2 { year - 1 } else { year };
    let (era, yoe) = (y / 400, y % 400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::AgentTurn;
    use crate::model::parse_completion;

    /// [`classify`] as the OpenAI-compatible client calls it.
    fn classify_completion(
        url: &str,
        status: StatusCode,
        retry_after: Option<Duration>,
        body: &[u8],
        cut: bool,
        key: Option<&str>,
    ) -> Result<AgentTurn, ModelError> {
        let reply = Reply {
            status,
            retry_after,
            body: body.to_vec(),
            cut,
        };
        let wire = Wire {
            section: "spec.model.openai",
            reply: "a chat completion",
        };
        classify(url, &reply, key, wire, parse_completion)
    }

    #[test]
    fn responses_are_classified() {
        let url = "http://x/v1/chat/completions";
        let wait = Some(Duration::from_secs(3));
        let c = |status: u16, body: &str| {
            classify_completion(
                url,
                StatusCode::from_u16(status).unwrap(),
                wait,
                body.as_bytes(),
                false,
                Some("sk-secret"),
            )
        };
        for status in [408, 429, 500, 502, 503, 504, 529] {
            let e = c(status, "").unwrap_err();
            assert!(e.retryable, "{status} is retryable");
            assert_eq!(e.retry_after, wait, "{status} keeps Retry-After");
            assert!(e.message.contains(&status.to_string()), "{e}");
        }
        for status in [400, 401, 403, 404, 422] {
            let e = c(status, "").unwrap_err();
            assert!(!e.retryable, "{status} is not retryable");
            assert_eq!(e.retry_after, None);
        }
        // The server's own message, without the key it echoed.
        let e = c(
            401,
            r#"{"error":{"message":"Incorrect API key provided: sk-secret","type":"invalid_request_error"}}"#,
        )
        .unwrap_err();
        assert!(
            e.message
                .contains("401 Unauthorized: Incorrect API key provided: <redacted>"),
            "{e}"
        );
        assert!(e.message.contains("check the API key"), "{e}");
        assert!(!e.message.contains("sk-secret"), "{e}");
        // A 200 that is not a completion is retryable, quoting at most 200 bytes.
        let long = format!("<html>{}sk-secret</html>", "x".repeat(195));
        let e = c(200, &long).unwrap_err();
        assert!(e.retryable);
        assert!(
            e.message
                .contains("not with a chat completion: the body is not JSON"),
            "{e}"
        );
        assert!(
            e.message.contains(&format!("{} bytes in all", long.len())),
            "{e}"
        );
        assert!(!e.message.contains(&"x".repeat(196)), "{e}");
        assert!(
            !e.message.contains("sk-"),
            "no prefix of the key either: {e}"
        );
        let e = c(200, r#"{"choices":[]}"#).unwrap_err();
        assert!(e.retryable);
        assert!(e.message.contains("`choices` is empty"), "{e}");
        assert!(c(200, r#"{"choices":[{"message":{"content":"hi"}}]}"#).is_ok());
        // A multi-byte character at the cut is not split.
        let e = c(500, &"é".repeat(150)).unwrap_err();
        assert!(
            e.message.contains("300 bytes in all, the first 200 shown"),
            "{e}"
        );
    }

    #[test]
    fn an_error_body_read_only_in_part_says_so() {
        let e = classify_completion(
            "http://x/v1/chat/completions",
            StatusCode::BAD_GATEWAY,
            None,
            "<html>".repeat(100).as_bytes(),
            true,
            None,
        )
        .unwrap_err();
        assert!(e.retryable);
        assert!(
            e.message
                .contains("(more than 600 bytes in all, the first 200 shown)"),
            "{e}"
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates_and_is_capped() {
        // 1994-11-06T08:49:37Z
        let now = UNIX_EPOCH + Duration::from_secs(784_111_777);
        let p = |v: &str| parse_retry_after(v, now);
        assert_eq!(p("7"), Some(Duration::from_secs(7)));
        assert_eq!(p(" 0 "), Some(Duration::ZERO));
        assert_eq!(p("86400"), Some(MAX_RETRY_AFTER));
        assert_eq!(p("99999999999999999999999"), Some(MAX_RETRY_AFTER));
        assert_eq!(
            p("Sun, 06 Nov 1994 08:50:07 GMT"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(p("Sun, 06 Nov 1994 08:49:00 GMT"), Some(Duration::ZERO));
        assert_eq!(p("Mon, 07 Nov 1994 08:49:37 GMT"), Some(MAX_RETRY_AFTER));
        assert_eq!(
            parse_http_date("Thu, 29 Feb 2024 00:00:00 GMT"),
            Some(UNIX_EPOCH + Duration::from_secs(1_709_164_800))
        );
        for bad in [
            "",
            "-1",
            "1.5",
            "soon",
            "Sun, 06 Nov 1994 08:49:37 CET",
            "Sun, 32 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(p(bad), None, "{bad:?}");
        }
    }
}
