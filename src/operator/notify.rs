//! Notifications of calls that wait for a person: an approval, or a
//! `defer` call's outside result.
//!
//! After a step that leaves a session waiting, the operator looks at the
//! session's pending Continuations; each wait (`approval` or `external`)
//! without a delivery marker (`status.notified`) is POSTed once to the
//! agent's `notify.webhook` (or the operator's `--notify-webhook-url`) as a
//! Slack-compatible JSON body. Each attempt is claimed first (the marker
//! written over the version read, before the POST), so of two operators
//! racing one sends; the outcome is written after the answer. A wait
//! marked `Sent` is never sent again, by this process or a restarted one;
//! an operator killed between its claim and the answer sends again after
//! the backoff, with the same `Idempotency-Key`. A failed
//! POST is retried with backoff, at most [`MAX_ATTEMPTS`] times, then the
//! marker says `Failed` and nothing more is sent. An Event on the Session
//! says sent or given up.
//!
//! Header values (Secrets the user opted into) are sent and nothing else:
//! never logged, never written to status or Events; neither is the URL
//! (a Slack webhook URL is itself a credential), only its host.

use super::{publish, read_secret, Context};
use crate::api::agent::{EnvVar, WebhookSpec};
use crate::api::continuation::{ContinuationState, NotifiedStatus, NotifyState};
use crate::api::session::WaitingForName;
use crate::api::{convert, Continuation, Session};
use crate::core::Millis;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// POSTs tried per wait before it is given up.
pub const MAX_ATTEMPTS: u32 = 5;
/// Arguments are quoted up to this many bytes (as JSON text).
pub const MAX_ARGUMENT_BYTES: usize = 2048;
/// One POST may take this long.
const POST_TIMEOUT: Duration = Duration::from_secs(10);
/// Waits notified per step at most; the rest on the next step.
const MAX_PER_STEP: usize = 16;

/// Where a session's waits are announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub webhook: WebhookSpec,
    /// The operator's own `--notify-webhook-url`: trusted, so not held to
    /// the http tools' allow-list.
    pub operator_default: bool,
}

/// The agent's webhook, else the operator's default.
pub fn target(agent: &crate::api::AgentSpec, default_url: Option<&str>) -> Option<Target> {
    match agent.notify.as_ref().and_then(|n| n.webhook.clone()) {
        Some(webhook) => Some(Target {
            webhook,
            operator_default: false,
        }),
        None => default_url.map(|url| Target {
            webhook: WebhookSpec {
                url: url.to_string(),
                headers: Vec::new(),
            },
            operator_default: true,
        }),
    }
}

/// What a continuation waits for, when that is a person.
fn person_wait(c: &Continuation) -> Option<WaitingForName> {
    let status = c.status.as_ref()?;
    if status.outcome.is_some() || status.state != ContinuationState::Pending {
        return None;
    }
    match status.waiting_for? {
        w @ (WaitingForName::Approval | WaitingForName::External | WaitingForName::Budget) => {
            Some(w)
        }
        _ => None,
    }
}

/// What to do about one wait now.
#[derive(Debug, PartialEq, Eq)]
pub enum Due {
    /// POST now; `attempts` were made before.
    Send { attempts: u32 },
    /// A retry, after this long.
    Later(Duration),
    /// Sent, given up, or nothing to announce.
    Nothing,
}

/// Backoff before attempt `attempts + 1`: 1 s, 2 s, 4 s, ... at most 60 s.
pub fn backoff(attempts: u32) -> Duration {
    Duration::from_secs(1u64 << attempts.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// Whether the wait of `c` is to be announced now.
pub fn due(c: &Continuation, now: Millis) -> Due {
    let Some(wait) = person_wait(c) else {
        return Due::Nothing;
    };
    match c.status.as_ref().and_then(|s| s.notified.as_ref()) {
        Some(m) if m.waiting_for == wait => match m.state {
            NotifyState::Sent | NotifyState::Failed => Due::Nothing,
            NotifyState::Retrying if m.attempts >= MAX_ATTEMPTS => Due::Nothing,
            NotifyState::Retrying => {
                let last = convert::millis(&m.last_attempt_at);
                let next = last.0 + backoff(m.attempts).as_millis() as i64;
                if now.0 >= next {
                    Due::Send {
                        attempts: m.attempts,
                    }
                } else {
                    Due::Later(Duration::from_millis((next - now.0) as u64))
                }
            }
        },
        _ => Due::Send { attempts: 0 },
    }
}

/// The first `max` bytes of `s` (at a character boundary), and whether
/// it was cut.
fn cut(s: &str, max: usize) -> (&str, bool) {
    if s.len() <= max {
        return (s, false);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (&s[..end], true)
}

/// How to move the wait on: the approvals page (`approvals.pageUrl`, its
/// `{namespace}`, `{session}` and `{token}` filled in, or given as query
/// parameters), else the CLI command.
pub fn link(
    ns: &str,
    session: &str,
    token: &str,
    wait: WaitingForName,
    page: Option<&str>,
) -> String {
    if let Some(page) = page.filter(|p| !p.is_empty()) {
        if page.contains('{') {
            return page
                .replace("{namespace}", ns)
                .replace("{session}", session)
                .replace("{token}", token);
        }
        let sep = if page.contains('?') { '&' } else { '?' };
        return format!("{page}{sep}namespace={ns}&session={session}&token={token}");
    }
    match wait {
        WaitingForName::Approval => {
            format!("agents session approve {token} --store kube -n {ns}")
        }
        WaitingForName::Budget => {
            format!("agents session approve {token} --raise LIMIT=N --store kube -n {ns}")
        }
        _ => format!("agents session complete {token} --store kube -n {ns} --text ..."),
    }
}

/// The JSON body announcing the wait `wait` of `c` (Slack shows `text`).
/// Built from the Continuation alone: no header, Secret or URL is in it.
pub fn payload(c: &Continuation, ns: &str, wait: WaitingForName, page: Option<&str>) -> Value {
    let token = c.name_any();
    let session = &c.spec.session;
    let tool = &c.spec.tool_call.name;
    let reason = c
        .status
        .as_ref()
        .and_then(|s| s.reason.clone())
        .or_else(|| c.spec.policy.reason.clone());
    let (args, was_cut) = cut(&c.spec.tool_call.arguments, MAX_ARGUMENT_BYTES);
    let arguments = if was_cut {
        format!("{args}… (cut at {MAX_ARGUMENT_BYTES} bytes)")
    } else {
        args.to_string()
    };
    let (waiting_for, what) = match wait {
        WaitingForName::Approval => ("approval", "waits for approval"),
        WaitingForName::Budget => ("budget", "asks to go past a limit"),
        _ => ("external", "waits for an outside result"),
    };
    let link = link(ns, session, &token, wait, page);
    let because = reason
        .as_deref()
        .map(|r| format!(" ({})", one_line(cut(r, 200).0)))
        .unwrap_or_default();
    let text = format!(
        "Session {ns}/{session}: call {} `{tool}` {what}{because}: {link}",
        c.spec.call_id
    );
    json!({
        "text": text,
        "session": session,
        "namespace": ns,
        "token": token,
        "callId": c.spec.call_id,
        "tool": tool,
        "arguments": arguments,
        "reason": reason,
        "waitingFor": waiting_for,
        "link": link,
    })
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The scheme, host and port of `url`, for messages (its path and query
/// may hold a credential).
pub fn host_of(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(u) => u.origin().ascii_serialization(),
        Err(_) => "(not a URL)".into(),
    }
}

/// Announces the due waits of `session`; returns when to look again for a
/// retry, if one is pending. `known` is what the step already listed (and
/// wrote since); without it the continuations are listed here.
pub async fn after_step(
    ctx: &Context,
    session: &Session,
    ns: &str,
    target: &Target,
    known: Option<Vec<Continuation>>,
) -> Option<Duration> {
    let api: Api<Continuation> = Api::namespaced(ctx.client.clone(), ns);
    let items = match known {
        Some(items) => items,
        None => match owned(&api, session).await {
            Ok(items) => items,
            Err(e) => {
                debug!(session = %format!("{ns}/{}", session.name_any()), error = %e, "continuations not listed for notifications");
                return Some(Duration::from_secs(5));
            }
        },
    };
    let now = crate::engine::Clock::now(&crate::engine::SystemClock);
    let mut later: Option<Duration> = None;
    let mut sent = 0;
    for c in items {
        match due(&c, now) {
            Due::Nothing => {}
            Due::Later(d) => later = Some(later.map_or(d, |l| l.min(d))),
            Due::Send { .. } if sent >= MAX_PER_STEP => {
                later = Some(Duration::from_secs(1));
            }
            Due::Send { attempts } => {
                sent += 1;
                if let Some(d) = notify_one(ctx, session, ns, target, &api, c, attempts).await {
                    later = Some(later.map_or(d, |l| l.min(d)));
                }
            }
        }
    }
    later
}

/// The continuations `session` controls (same UID, not merely the label).
async fn owned(api: &Api<Continuation>, session: &Session) -> kube::Result<Vec<Continuation>> {
    let uid = session.uid().unwrap_or_default();
    let label = format!(
        "{}={}",
        crate::store::kube::SESSION_LABEL,
        session.name_any()
    );
    let list = api.list(&ListParams::default().labels(&label)).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|c| {
            c.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && o.uid == uid)
        })
        .collect())
}

/// One POST for the wait of `c`, its marker, and its Event; a retry's
/// wait when it failed and may be tried again.
async fn notify_one(
    ctx: &Context,
    session: &Session,
    ns: &str,
    target: &Target,
    api: &Api<Continuation>,
    c: Continuation,
    attempts: u32,
) -> Option<Duration> {
    let wait = person_wait(&c)?;
    let token = c.name_any();
    let body = payload(&c, ns, wait, ctx.options.approvals_page_url.as_deref());
    let attempts = attempts + 1;
    // The attempt is claimed (committed over the version read) before
    // anything is sent: of two operators racing (a failover), one sends.
    let c = match claim_attempt(api, c, wait, attempts).await {
        Some(claimed) => claimed,
        None => return Some(Duration::from_secs(1)),
    };
    let result = post(ctx, ns, target, &token, &body).await;
    let now = crate::engine::Clock::now(&crate::engine::SystemClock);
    let marker = attempt_marker(wait, attempts, &result, now);
    let key = format!("{ns}/{token}");
    let call = format!(
        "call {} {} (token {token})",
        c.spec.call_id, c.spec.tool_call.name
    );
    if !write_marker(api, c, &marker).await {
        return Some(Duration::from_secs(1));
    }
    let host = host_of(&target.webhook.url);
    match marker.state {
        NotifyState::Sent => {
            info!(continuation = %key, host = %host, "wait notified");
            let e = event(
                EventType::Normal,
                "NotificationSent",
                &token,
                format!(
                    "{call}: its wait for {} was announced to the webhook at {host}",
                    wait_text(wait)
                ),
            );
            publish(ctx, &session.object_ref(&()), e);
            None
        }
        NotifyState::Failed => {
            warn!(continuation = %key, host = %host, attempts, "notification given up");
            let e = event(
                EventType::Warning,
                "NotificationFailed",
                &token,
                format!(
                    "{call}: its wait for {} could not be announced to the webhook at {host} after {attempts} attempts: {}",
                    wait_text(wait),
                    marker.error.as_deref().unwrap_or("")
                ),
            );
            publish(ctx, &session.object_ref(&()), e);
            None
        }
        NotifyState::Retrying => {
            debug!(continuation = %key, host = %host, attempts, "notification failed; will retry");
            Some(backoff(attempts))
        }
    }
}

/// The marker attempt `attempts` leaves: sent, failed for good (the last
/// attempt), or to be retried.
fn attempt_marker(
    wait: WaitingForName,
    attempts: u32,
    result: &Result<(), String>,
    now: Millis,
) -> NotifiedStatus {
    let (state, error) = match result {
        Ok(()) => (NotifyState::Sent, None),
        Err(e) if attempts >= MAX_ATTEMPTS => (NotifyState::Failed, Some(e.clone())),
        Err(e) => (NotifyState::Retrying, Some(e.clone())),
    };
    NotifiedStatus {
        waiting_for: wait,
        state,
        attempts,
        last_attempt_at: convert::time(now),
        at: result.is_ok().then(|| convert::time(now)),
        error: error.map(|e| cut(&e, 1000).0.to_string()),
    }
}

fn wait_text(w: WaitingForName) -> &'static str {
    match w {
        WaitingForName::Approval => "approval",
        WaitingForName::Budget => "a decision on a limit",
        _ => "an outside result",
    }
}

fn event(type_: EventType, reason: &str, token: &str, note: String) -> Event {
    let (note, _) = cut(&note, 1000);
    Event {
        type_,
        reason: reason.into(),
        note: Some(note.to_string()),
        action: format!("Notify/{token}"),
        secondary: None,
    }
}

/// Writes `marker` over the status of `c`, with the resourceVersion read
/// before the POST as precondition. On a conflict, reads again: a marker
/// for the same wait written meanwhile wins (another writer notified);
/// otherwise (a decision, a wait written), writes again. False when it
/// could not be written.
/// Marks attempt `attempts` as under way, over the version of `c` read;
/// the object as written, or `None` when another writer got there first
/// (the next step sees their marker).
async fn claim_attempt(
    api: &Api<Continuation>,
    c: Continuation,
    wait: WaitingForName,
    attempts: u32,
) -> Option<Continuation> {
    let now = crate::engine::Clock::now(&crate::engine::SystemClock);
    let claim = NotifiedStatus {
        waiting_for: wait,
        state: NotifyState::Retrying,
        attempts,
        last_attempt_at: convert::time(now),
        at: None,
        error: None,
    };
    let body = json!({
        "metadata": {"resourceVersion": c.resource_version()},
        "status": {"notified": claim},
    });
    match api
        .patch_status(&c.name_any(), &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        Ok(claimed) => Some(claimed),
        Err(e) => {
            debug!(continuation = %c.name_any(), error = %e, "notification attempt not claimed; the next step looks again");
            None
        }
    }
}

async fn write_marker(
    api: &Api<Continuation>,
    mut c: Continuation,
    marker: &NotifiedStatus,
) -> bool {
    let token = c.name_any();
    for _ in 0..4 {
        let body = json!({
            "metadata": {"resourceVersion": c.resource_version()},
            "status": {"notified": marker},
        });
        match api
            .patch_status(&token, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => return true,
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(&token).await {
                Ok(Some(fresh)) => {
                    let theirs = fresh.status.as_ref().and_then(|s| s.notified.as_ref());
                    if theirs.is_some_and(|t| {
                        t.waiting_for == marker.waiting_for && t.attempts >= marker.attempts
                    }) {
                        return true;
                    }
                    c = fresh;
                }
                Ok(None) => return true,
                Err(e) => {
                    debug!(continuation = %token, error = %e, "notification marker: read back failed");
                    return false;
                }
            },
            Err(kube::Error::Api(s)) if s.code == 404 => return true,
            Err(e) => {
                warn!(continuation = %token, error = %e, "notification marker not written");
                return false;
            }
        }
    }
    false
}

/// The POST; the error (for the marker and Events) names neither the URL
/// nor any header.
async fn post(
    ctx: &Context,
    ns: &str,
    target: &Target,
    token: &str,
    body: &Value,
) -> Result<(), String> {
    // The operator's own default webhook is trusted; a tenant's is held to
    // the URL allow-list, on every redirect too.
    let allowed = if target.operator_default {
        None
    } else {
        ctx.options.http_tool_allowed_urls.clone()
    };
    let url = webhook_url(&target.webhook.url, allowed.as_ref())?;
    let mut request = client(allowed)?
        .post(url)
        .header("Idempotency-Key", format!("notify-{token}"))
        .json(body);
    for h in &target.webhook.headers {
        let (name, value) = header(ctx, ns, h).await?;
        request = request.header(name, value);
    }
    let response = request
        .send()
        .await
        .map_err(|e| format!("POST to the webhook failed: {}", e.without_url()))?;
    judge_reply(response).await
}

fn webhook_url(
    raw: &str,
    allowed: Option<&Arc<crate::http::allow::AllowedUrls>>,
) -> Result<reqwest::Url, String> {
    let url =
        reqwest::Url::parse(raw).map_err(|e| format!("the webhook URL is not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("the webhook URL is neither http nor https".into());
    }
    if let Some(list) = allowed {
        if !list.allows(&url) {
            return Err(format!(
                "the webhook at {} is not among the URLs the operator allows (--http-tool-allowed-urls)",
                url.origin().ascii_serialization()
            ));
        }
    }
    Ok(url)
}

fn client(
    allowed: Option<Arc<crate::http::allow::AllowedUrls>>,
) -> Result<reqwest::Client, String> {
    let policy = match allowed {
        Some(list) => crate::http::redirect_policy_within(list),
        None => crate::http::redirect_policy(),
    };
    reqwest::Client::builder()
        .redirect(policy)
        .timeout(POST_TIMEOUT)
        .build()
        .map_err(|e| format!("no HTTP client: {}", e.without_url()))
}

/// One webhook header, its value read from a Secret when it names one
/// (and then marked sensitive, so it is never logged).
async fn header(
    ctx: &Context,
    ns: &str,
    h: &EnvVar,
) -> Result<(reqwest::header::HeaderName, reqwest::header::HeaderValue), String> {
    let name = reqwest::header::HeaderName::from_bytes(h.name.as_bytes())
        .map_err(|_| format!("header {:?}: not a valid HTTP header name", h.name))?;
    if matches!(name.as_str(), "content-type" | "idempotency-key") {
        return Err(format!("header {:?}: set by the operator itself", h.name));
    }
    let (value, secret) = match (&h.value, &h.value_from) {
        (Some(v), None) => (v.clone(), false),
        (None, Some(from)) => {
            let r = &from.secret_key_ref;
            let v = read_secret(ctx, ns, &r.name, &r.key, "notify.webhook's header")
                .await
                .map_err(|e| e.message)?;
            (v, true)
        }
        _ => {
            return Err(format!(
                "header {:?}: give exactly one of value and valueFrom",
                h.name
            ))
        }
    };
    let mut value = reqwest::header::HeaderValue::from_str(&value).map_err(|_| {
        format!(
            "header {:?}: its value is not a valid HTTP header value",
            h.name
        )
    })?;
    value.set_sensitive(secret);
    Ok((name, value))
}

/// Success, or the status with a short quote of the body.
async fn judge_reply(mut response: reqwest::Response) -> Result<(), String> {
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let quoted = crate::http::read_at_most(&mut response, 512)
        .await
        .map(|b| one_line(&String::from_utf8_lossy(&b.bytes)))
        .unwrap_or_default();
    let quoted = cut(&quoted, 300).0.to_string();
    Err(if quoted.is_empty() {
        format!("the webhook answered {status}")
    } else {
        format!("the webhook answered {status}: {quoted}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::continuation::{ContextSnapshotSpec, ContinuationSpec, ContinuationStatus};
    use crate::api::session::{AppliedPolicyStatus, ToolCallStatus};

    fn continuation(args: &str, wait: WaitingForName) -> Continuation {
        let mut c = Continuation::new(
            "s-t1-c0",
            ContinuationSpec {
                session: "s".into(),
                turn: 1,
                call_id: "t1-c0".into(),
                tool_call: ToolCallStatus {
                    model_call_id: "m0".into(),
                    name: "deploy".into(),
                    arguments: args.into(),
                },
                policy: AppliedPolicyStatus {
                    reason: Some("a person\nsays so".into()),
                    ..Default::default()
                },
                context: ContextSnapshotSpec {
                    session: "s".into(),
                    turn: 1,
                    call_id: "t1-c0".into(),
                    agent: None,
                    idempotency_key: "k".into(),
                    params: Default::default(),
                },
                cache_key: None,
            },
        );
        c.status = Some(ContinuationStatus {
            waiting_for: Some(wait),
            ..Default::default()
        });
        c
    }

    #[test]
    fn the_payload_names_the_wait_and_how_to_move_it_on() {
        let c = continuation(r#"{"env":"prod"}"#, WaitingForName::Approval);
        let p = payload(&c, "team-a", WaitingForName::Approval, None);
        assert_eq!(p["session"], "s");
        assert_eq!(p["namespace"], "team-a");
        assert_eq!(p["token"], "s-t1-c0");
        assert_eq!(p["tool"], "deploy");
        assert_eq!(p["arguments"], r#"{"env":"prod"}"#);
        assert_eq!(p["waitingFor"], "approval");
        assert_eq!(p["reason"], "a person\nsays so");
        assert_eq!(
            p["link"],
            "agents session approve s-t1-c0 --store kube -n team-a"
        );
        let text = p["text"].as_str().unwrap();
        assert!(!text.contains('\n'), "{text}");
        assert!(
            text.contains("team-a/s")
                && text.contains("deploy")
                && text.contains("approve s-t1-c0")
        );
        let p = payload(
            &c,
            "team-a",
            WaitingForName::External,
            Some("https://ui.example/approvals"),
        );
        assert_eq!(p["waitingFor"], "external");
        assert_eq!(
            p["link"],
            "https://ui.example/approvals?namespace=team-a&session=s&token=s-t1-c0"
        );
        let p = payload(
            &c,
            "a",
            WaitingForName::External,
            Some("https://ui/{namespace}/{token}"),
        );
        assert_eq!(p["link"], "https://ui/a/s-t1-c0");
    }

    #[test]
    fn long_arguments_are_cut_at_a_character_boundary() {
        let args = format!("\"{}\"", "é".repeat(5000));
        let c = continuation(&args, WaitingForName::Approval);
        let p = payload(&c, "n", WaitingForName::Approval, None);
        let quoted = p["arguments"].as_str().unwrap();
        assert!(quoted.len() <= MAX_ARGUMENT_BYTES + 64, "{}", quoted.len());
        assert!(quoted.ends_with("(cut at 2048 bytes)"));
        assert!(serde_json::to_string(&p).unwrap().len() < 4096);
    }

    #[test]
    fn nothing_secret_reaches_the_payload_or_messages() {
        let c = continuation("{}", WaitingForName::Approval);
        let p = serde_json::to_string(&payload(&c, "n", WaitingForName::Approval, None)).unwrap();
        assert!(!p.contains("hooks.example") && !p.contains("T0KEN"));
        // Messages name the webhook's origin, never its path or query.
        assert_eq!(
            host_of("https://hooks.example/services/T0KEN?key=T0KEN"),
            "https://hooks.example"
        );
    }

    #[test]
    fn a_wait_is_sent_once_and_retried_with_backoff_up_to_the_cap() {
        let mut c = continuation("{}", WaitingForName::Approval);
        let now = Millis(1_000_000);
        assert_eq!(due(&c, now), Due::Send { attempts: 0 });
        let marker = |state, attempts| NotifiedStatus {
            waiting_for: WaitingForName::Approval,
            state,
            attempts,
            last_attempt_at: convert::time(now),
            at: None,
            error: None,
        };
        c.status.as_mut().unwrap().notified = Some(marker(NotifyState::Sent, 1));
        assert_eq!(due(&c, now), Due::Nothing);
        c.status.as_mut().unwrap().notified = Some(marker(NotifyState::Retrying, 2));
        assert_eq!(due(&c, now), Due::Later(Duration::from_secs(2)));
        assert_eq!(due(&c, Millis(now.0 + 2000)), Due::Send { attempts: 2 });
        c.status.as_mut().unwrap().notified = Some(marker(NotifyState::Failed, MAX_ATTEMPTS));
        assert_eq!(due(&c, Millis(now.0 + 100_000)), Due::Nothing);
        // The same call's next wait (approved, now waiting outside) is news.
        c.status.as_mut().unwrap().waiting_for = Some(WaitingForName::External);
        assert_eq!(due(&c, now), Due::Send { attempts: 0 });
        // Waits for the operator's own runs are nobody's business.
        c.status.as_mut().unwrap().waiting_for = Some(WaitingForName::Background);
        assert_eq!(due(&c, now), Due::Nothing);
    }
}
