//! The OpenAI-compatible chat-completions client.
//!
//! One HTTP attempt per call, bounded by the agent's timeout. Failures are
//! classified, not retried here: 408, 429, 5xx, network trouble, timeouts
//! and a 200 whose body is not a completion are retryable (with the
//! endpoint's `Retry-After`, if any); other statuses are not.
//!
//! The endpoint is the user's choice, so what it sends is bounded as it
//! streams: a reply over [`MAX_MODEL_REPLY_BYTES`] is a permanent failure
//! (read no further, never re-asked), an error body is read only as far as
//! it is quoted, and a redirect to another host is refused. These are the
//! bounds `crate::tools::http` puts on the http tools; the layers keep the
//! two adapters apart, so each holds its few lines.

use super::{ModelError, ModelRequest};
use crate::core::{AgentTurn, TokenUsage, ToolCall, Turn, UserTurn};
use crate::http::allow::AllowedUrls;
use crate::http::{self, clip};
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The longest wait a `Retry-After` header can impose; a larger value is
/// cut to this, so a misconfigured endpoint cannot park a session for days.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);

/// The request timeout for an agent that sets none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// At most this many bytes of a body are quoted in an error message.
const QUOTE_BYTES: usize = 200;

/// The longest chat-completion reply read. A model's longest answers
/// (some 128k output tokens, about half a MiB of text) fit many times
/// over, with room for JSON escapes; parsed, a reply may take several
/// times its size, and the operator holds every namespace's model calls
/// under one memory limit. A longer reply is a permanent failure of the
/// call: reading stops at this size, and the endpoint is not asked again.
pub const MAX_MODEL_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// A chat-completions client. The API key never appears in `Debug` output
/// or in error messages.
#[derive(Clone)]
pub struct OpenAiModel {
    pub base_url: String,
    pub model: String,
    /// How long one request may take, from connecting to the last byte.
    pub timeout: Duration,
    api_key: Option<String>,
    http: reqwest::Client,
    /// The operator's list of model URLs (`--model-allowed-urls`); none:
    /// any URL.
    allowed: Option<Arc<AllowedUrls>>,
}

impl fmt::Debug for OpenAiModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiModel")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("timeout", &self.timeout)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl OpenAiModel {
    /// `base_url` is the API root (`https://api.openai.com/v1`); `timeout`
    /// bounds each request. An empty key counts as no key.
    pub fn new(base_url: &str, model: &str, api_key: Option<String>, timeout: Duration) -> Self {
        // Never to another host: the API key goes with each request.
        let http = http_client(timeout, http::redirect_policy());
        OpenAiModel {
            base_url: base_url.trim_end_matches('/').to_string(),
            model: model.to_string(),
            timeout,
            api_key: api_key.filter(|k| !k.is_empty()),
            http,
            allowed: None,
        }
    }

    /// The client held to the operator's list of model URLs: an endpoint
    /// off the list is never sent a request (nor the key), and a redirect
    /// is followed only to a listed URL of the same origin.
    pub fn with_allowed_urls(mut self, allowed: Option<Arc<AllowedUrls>>) -> Self {
        if let Some(list) = &allowed {
            self.http = http_client(self.timeout, http::redirect_policy_within(list.clone()));
        }
        self.allowed = allowed;
        self
    }

    /// The client with the API key `key` (an empty one counts as none).
    pub fn with_api_key(mut self, key: Option<String>) -> Self {
        self.api_key = key.filter(|k| !k.is_empty());
        self
    }

    /// The URL each request goes to.
    pub fn url(&self) -> String {
        format!("{}/chat/completions", self.base_url)
    }

    /// Why the operator's list refuses this client's URL, if it does.
    pub fn url_not_allowed(&self) -> Option<String> {
        let url = self.url();
        let list = self.allowed.as_ref()?;
        (!list.allows_str(&url)).then(|| list.not_listed(&url))
    }

    /// The request body: system prompt, then the turns; tool results go
    /// right after the assistant message that asked for them, as the wire
    /// format requires.
    pub fn request_body(&self, req: &ModelRequest<'_>) -> Value {
        let mut messages = Vec::new();
        if !req.system_prompt.is_empty() {
            messages.push(json!({"role": "system", "content": req.system_prompt}));
        }
        let mut asked: &[ToolCall] = &[];
        for turn in req.turns {
            match turn {
                Turn::Agent(a) => {
                    let mut m = json!({"role": "assistant", "content": a.text});
                    if !a.tool_calls.is_empty() {
                        m["tool_calls"] = a
                            .tool_calls
                            .iter()
                            .map(|c| {
                                json!({
                                    "id": c.model_call_id,
                                    "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments},
                                })
                            })
                            .collect();
                    }
                    messages.push(m);
                    asked = &a.tool_calls;
                }
                Turn::User(u) => {
                    messages.extend(user_turn_messages(u, asked));
                    asked = &[];
                }
            }
        }
        let mut body = json!({"model": self.model, "messages": messages});
        if !req.tools.is_empty() {
            body["tools"] = req
                .tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": t.description,
                            "parameters": t.parameters.clone()
                                .unwrap_or_else(|| json!({"type": "object"})),
                        }
                    })
                })
                .collect();
        }
        body
    }

    /// One attempt; see the module doc for how failures are classified.
    pub async fn reply(&self, req: &ModelRequest<'_>) -> Result<AgentTurn, ModelError> {
        if let Some(why) = self.url_not_allowed() {
            return Err(ModelError::permanent(format!(
                "{why}; check spec.model.openai.baseUrl"
            )));
        }
        let url = self.url();
        let body = self.request_body(req);
        let key = self.api_key.as_deref();
        let mut request = self.http.post(&url).json(&body);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let result = match request.send().await {
            Err(e) => Err(self.transport_error(&url, &e)),
            Ok(mut response) => {
                let status = response.status();
                let retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| parse_retry_after(v, SystemTime::now()));
                if status.is_redirection() {
                    Err(redirect_refused(&url, &response))
                } else if let Some(n) = response
                    .content_length()
                    .filter(|n| status.is_success() && *n > MAX_MODEL_REPLY_BYTES as u64)
                {
                    Err(too_long(
                        &url,
                        status,
                        &format!(
                            "announced a reply of {n} bytes (Content-Length), more than the \
                             {MAX_MODEL_REPLY_BYTES} bytes ({} MiB) a model reply may hold; none \
                             of it was read",
                            MAX_MODEL_REPLY_BYTES >> 20
                        ),
                    ))
                } else {
                    let limit = if status.is_success() {
                        MAX_MODEL_REPLY_BYTES
                    } else {
                        http::ERROR_BODY_BYTES
                    };
                    match http::read_at_most(&mut response, limit).await {
                        Err(http::BodyError::Transport(e)) => Err(self.transport_error(&url, &e)),
                        // A reply this client cannot read now, it cannot read again.
                        Err(e) => Err(ModelError::permanent(format!(
                            "POST {url} answered {status}, but {e}; check spec.model.openai.baseUrl"
                        ))),
                        Ok(body) if body.cut && status.is_success() => Err(too_long(
                            &url,
                            status,
                            &format!(
                                "sent a reply of more than {MAX_MODEL_REPLY_BYTES} bytes ({} MiB){}, \
                                 the most a model reply may hold; reading stopped there",
                                MAX_MODEL_REPLY_BYTES >> 20,
                                body.encoding
                                    .map(|e| format!(" once {e}-decoded (or as sent)"))
                                    .unwrap_or_default()
                            ),
                        )),
                        Ok(body) => classify(&url, status, retry_after, &body.bytes, body.cut, key),
                    }
                }
            }
        };
        // Belt and braces: whatever text reached the message, not the key.
        result.map_err(|mut e| {
            e.message = redact(&e.message, key);
            e
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

/// The client of every request: `timeout` on each, redirects by `policy`.
fn http_client(timeout: Duration, policy: reqwest::redirect::Policy) -> reqwest::Client {
    http::client_builder()
        .timeout(timeout)
        .redirect(policy)
        .build()
        .expect("a default HTTP client builds")
}

/// The user's messages in a turn, in order. The one place that knows how
/// a [`UserTurn`] holds them.
fn user_messages(turn: &UserTurn) -> impl Iterator<Item = &str> {
    turn.message.as_deref().into_iter()
}

/// A reply over [`MAX_MODEL_REPLY_BYTES`]: permanent, so it is not asked
/// (and billed) again.
fn too_long(url: &str, status: StatusCode, what: &str) -> ModelError {
    ModelError::permanent(format!(
        "POST {url} answered {status} but {what}; no model sends such a chat completion, so \
         it is not retried: check spec.model.openai.baseUrl"
    ))
}

/// A 3xx the client did not follow: to another scheme, host or port, or
/// one too many.
fn redirect_refused(url: &str, response: &reqwest::Response) -> ModelError {
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(|l| format!(" to {:?}", clip(l, QUOTE_BYTES)))
        .unwrap_or_default();
    ModelError::permanent(format!(
        "POST {url} answered {}, a redirect{location}, which was not followed: redirects are \
         followed only to the same scheme, host and port, at most {} times, so \
         that the API key never goes to another host; check spec.model.openai.baseUrl",
        response.status(),
        http::MAX_REDIRECTS
    ))
}

/// The wire messages of one user turn: first its tool results, which must
/// directly follow the assistant message that asked for them, in the order
/// the model issued the calls (`asked`); then each user message as its own
/// `user` message, in order.
fn user_turn_messages(turn: &UserTurn, asked: &[ToolCall]) -> Vec<Value> {
    let position = |id: &str| {
        asked
            .iter()
            .position(|c| c.model_call_id == id)
            .unwrap_or(usize::MAX)
    };
    let mut results: Vec<_> = turn.tool_results.iter().collect();
    // Stable, so results for calls not in `asked` keep their order, last.
    results.sort_by_key(|r| position(&r.model_call_id));
    let mut messages: Vec<Value> = results
        .into_iter()
        .map(|r| {
            json!({
                "role": "tool",
                "tool_call_id": r.model_call_id,
                "content": r.result.to_model_text(),
            })
        })
        .collect();
    messages.extend(user_messages(turn).map(|text| json!({"role": "user", "content": text})));
    messages
}

/// Turns a response into a turn or a classified error. Pure, so every
/// branch is unit-tested without a server. `cut`: the body went on past
/// what was read.
fn classify(
    url: &str,
    status: StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
    cut: bool,
    key: Option<&str>,
) -> Result<AgentTurn, ModelError> {
    if status.is_success() {
        let parsed = std::str::from_utf8(body)
            .map_err(|_| "the body is not UTF-8 text".to_string())
            .and_then(parse_completion);
        return parsed.map_err(|what| ModelError {
            message: format!(
                "POST {url} answered {status}, but not with a chat completion: {}; body: {}",
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
    let hint = match code {
        401 | 403 => "; check the API key (the Secret named by spec.model.openai.apiKeySecretRef) and what it may use",
        404 => "; check spec.model.openai.baseUrl and spec.model.openai.model",
        429 => "; the endpoint is rate limiting",
        _ if retryable => "",
        _ => "; the endpoint refused the request, so it is not retried",
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

/// Parses a chat-completions response body; the error says what is
/// missing or wrong.
pub fn parse_completion(body: &str) -> Result<AgentTurn, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("the body is not JSON ({e})"))?;
    let choices = match v.get("choices") {
        Some(Value::Array(c)) => c,
        Some(_) => return Err("`choices` is not an array".into()),
        None => {
            return Err(match v.get("error") {
                Some(e) => format!(
                    "the body holds an error instead of `choices`: {}",
                    e.get("message").and_then(Value::as_str).map_or_else(
                        || clip(&e.to_string(), QUOTE_BYTES).to_string(),
                        |m| clip(m, QUOTE_BYTES).to_string()
                    )
                ),
                None => "the body has no `choices`".into(),
            })
        }
    };
    let first = choices.first().ok_or("`choices` is empty")?;
    let message = match first.get("message") {
        Some(m @ Value::Object(_)) => m,
        _ => return Err("`choices[0]` has no `message` object".into()),
    };
    let text = message
        .get("content")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    let mut tool_calls = Vec::new();
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        for (i, c) in calls.iter().enumerate() {
            let name = c
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or(format!(
                    "`choices[0].message.tool_calls[{i}]` has no `function.name`"
                ))?;
            // Kept as written, even when malformed: the core tells the model.
            let arguments = match c.pointer("/function/arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            tool_calls.push(ToolCall {
                model_call_id: c
                    .get("id")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("call_{i}")),
                name: name.to_string(),
                arguments,
            });
        }
    }
    let usage = TokenUsage {
        prompt_tokens: v
            .pointer("/usage/prompt_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        completion_tokens: v
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    };
    Ok(AgentTurn {
        text,
        tool_calls,
        usage,
    })
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
    use crate::core::conversation::ToolResultEntry;
    use crate::core::{CallId, ToolResult, ToolSchema};

    fn model() -> OpenAiModel {
        OpenAiModel::new(
            "http://x/v1/",
            "m",
            Some("sk-secret".into()),
            Duration::from_secs(5),
        )
    }

    fn call(id: &str) -> ToolCall {
        ToolCall {
            model_call_id: id.into(),
            name: "echo".into(),
            arguments: "{}".into(),
        }
    }

    fn result(index: u32, id: &str) -> ToolResultEntry {
        ToolResultEntry {
            call_id: CallId::new(1, index),
            model_call_id: id.into(),
            tool: "echo".into(),
            token: None,
            result: ToolResult::text(format!("r-{id}")),
            truncate_bytes: None,
        }
    }

    #[test]
    fn the_wire_format_puts_tool_results_after_their_assistant_message_in_call_order() {
        let m = model();
        assert!(!format!("{m:?}").contains("sk-secret"));
        let turns = vec![
            Turn::User(UserTurn {
                message: Some("q".into()),
                tool_results: vec![],
            }),
            Turn::Agent(AgentTurn {
                text: None,
                tool_calls: vec![call("c1"), call("c2"), call("c3")],
                usage: TokenUsage::default(),
            }),
            // Delivered out of order: the wire order is the model's.
            Turn::User(UserTurn {
                message: Some("and then?".into()),
                tool_results: vec![result(2, "c3"), result(0, "c1"), result(1, "c2")],
            }),
        ];
        let tools = [ToolSchema {
            name: "echo".into(),
            description: "Echoes.".into(),
            parameters: None,
        }];
        let body = m.request_body(&ModelRequest {
            system_prompt: "be brief",
            turns: &turns,
            tools: &tools,
        });
        let messages = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "assistant",
                "tool",
                "tool",
                "tool",
                "user"
            ]
        );
        let ids: Vec<&str> = messages[3..6]
            .iter()
            .map(|m| m["tool_call_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["c1", "c2", "c3"]);
        assert_eq!(messages[3]["content"], "r-c1");
        assert_eq!(messages[6]["content"], "and then?");
        assert_eq!(body["tools"][0]["function"]["name"], "echo");
        assert_eq!(body["tools"][0]["function"]["description"], "Echoes.");
        assert_eq!(
            body["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
    }

    #[test]
    fn completions_parse_and_keep_malformed_arguments() {
        let turn = parse_completion(
            r#"{"choices":[{"message":{"content":null,"tool_calls":[
                {"id":"a","type":"function","function":{"name":"echo","arguments":"{oops"}}]}}],
               "usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
        )
        .unwrap();
        assert_eq!(turn.tool_calls[0].arguments, "{oops");
        assert_eq!(turn.usage.total(), 5);
    }

    #[test]
    fn a_body_that_is_not_a_completion_says_what_is_wrong() {
        let err = |body: &str| parse_completion(body).unwrap_err();
        assert!(
            err("<html>").starts_with("the body is not JSON"),
            "{}",
            err("<html>")
        );
        assert_eq!(err(r#"{"choices":[]}"#), "`choices` is empty");
        assert_eq!(err(r#"{"id":"x"}"#), "the body has no `choices`");
        assert_eq!(
            err(r#"{"choices":[{"finish_reason":"stop"}]}"#),
            "`choices[0]` has no `message` object"
        );
        assert_eq!(
            err(r#"{"error":{"message":"overloaded"}}"#),
            "the body holds an error instead of `choices`: overloaded"
        );
        assert!(
            err(r#"{"choices":[{"message":{"tool_calls":[{"id":"a"}]}}]}"#)
                .contains("tool_calls[0]` has no `function.name`")
        );
    }

    #[test]
    fn responses_are_classified() {
        let url = "http://x/v1/chat/completions";
        let wait = Some(Duration::from_secs(3));
        let c = |status: u16, body: &str| {
            classify(
                url,
                StatusCode::from_u16(status).unwrap(),
                wait,
                body.as_bytes(),
                false,
                Some("sk-secret"),
            )
        };
        for status in [408, 429, 500, 502, 503, 504] {
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
        let e = classify(
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
