//! Page frame and text helpers: every text that reaches a page goes
//! through [`escape`], every text a tenant wrote is clipped ([`clip`]).

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, LOCATION};
use hyper::{Request, Response, StatusCode};

/// A form is small: a token, a reason, edited arguments, answers.
const MAX_FORM_BYTES: usize = 256 * 1024;

/// The console's policy: nothing from elsewhere, no script at all (the
/// pages use none), styles only from the page itself, forms only to it.
pub const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

pub type Page = Response<Full<Bytes>>;

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em;max-width:80em}table{border-collapse:collapse}\
td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}pre{background:#f4f4f4;padding:.5em;white-space:pre-wrap}\
.error{background:#fee;border:1px solid #c00;padding:.6em}form{display:inline-block;margin:.3em}nav a{margin-right:1em}\
.muted{color:#666}.turn{border-left:3px solid #ccc;margin:.6em 0;padding:.2em .8em}.user{border-color:#37c}.agent{border-color:#3a3}\
code{background:#f4f4f4}.filters input,.filters select{margin-right:.6em}";

/// A whole page: the navigation, a title and `body` (already HTML).
pub fn page(status: StatusCode, title: &str, body: &str) -> Page {
    let html = format!(
        "<!doctype html><html><head><meta charset=utf-8><title>{t}</title><style>{STYLE}</style></head>\
         <body><nav><a href=\"/\">Waiting calls</a><a href=\"/sessions\">Sessions</a></nav><h1>{t}</h1>{body}</body></html>",
        t = escape(title)
    );
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/html; charset=utf-8")
        .header("X-Frame-Options", "DENY")
        .header("X-Content-Type-Options", "nosniff")
        .header("Referrer-Policy", "no-referrer")
        .header("Content-Security-Policy", CSP)
        .body(Full::new(Bytes::from(html)))
        .expect("a valid response")
}

pub fn error_page(status: StatusCode, message: &str) -> Page {
    page(
        status,
        "Not done",
        &format!(
            "<p class=error id=error>{}</p><p><a href=\"/\">back to the waiting calls</a></p>",
            escape(message)
        ),
    )
}

/// After a form did its work: back to `to` (a path of this console).
pub fn see_other(to: &str) -> Page {
    Response::builder()
        .status(StatusCode::SEE_OTHER)
        .header(LOCATION, to)
        .body(Full::new(Bytes::new()))
        .expect("a valid response")
}

pub async fn read_form(req: Request<Incoming>) -> Result<Vec<(String, String)>, String> {
    let body = Limited::new(req.into_body(), MAX_FORM_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the form: {e}"))?
        .to_bytes();
    Ok(form_urlencoded::parse(&body).into_owned().collect())
}

/// A form or query field; empty when absent.
pub fn field(pairs: &[(String, String)], name: &str) -> String {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

pub fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("the API server refused: {}", s.message),
        other => other.to_string(),
    }
}

/// Arguments as the model wrote them (a JSON text, maybe quoted twice),
/// pretty-printed where they parse.
pub fn pretty(json_text: &str) -> String {
    let inner = serde_json::from_str::<serde_json::Value>(json_text)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| json_text.to_string());
    serde_json::from_str::<serde_json::Value>(&inner)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or(inner)
}

/// At most `max` bytes of `s` (cut at a character), saying how long it was.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}

/// A query value.
pub fn url(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// A path of this console with its query, escaped for an `href`.
pub fn href(path: &str, query: &[(&str, &str)]) -> String {
    let q: Vec<String> = query
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", url(v)))
        .collect();
    if q.is_empty() {
        return path.to_string();
    }
    escape(&format!("{path}?{}", q.join("&")))
}

/// HTML text and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// How long ago `then` was, as people say it: `45s`, `12m`, `3h`, `2d`.
pub fn age(then_ms: i64, now_ms: i64) -> String {
    let s = (now_ms - then_ms).max(0) / 1000;
    match s {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

/// A duration in milliseconds, short: `850ms`, `4.2s`, `3m10s`, `2h5m`.
pub fn duration(ms: i64) -> String {
    let ms = ms.max(0);
    match ms {
        ms if ms < 1000 => format!("{ms}ms"),
        ms if ms < 60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        ms if ms < 3_600_000 => format!("{}m{}s", ms / 60_000, ms % 60_000 / 1000),
        ms => format!("{}h{}m", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

/// A Kubernetes timestamp in milliseconds since the epoch.
pub fn millis(t: &k8s_openapi::jiff::Timestamp) -> i64 {
    t.as_millisecond()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(
            escape(r#"<script>"x" & 'y'</script>"#),
            "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/script&gt;"
        );
    }

    #[test]
    fn long_text_is_clipped_at_a_character() {
        let s = "é".repeat(3000);
        let c = clip(&s, 2048);
        assert!(c.len() < 2100 && c.ends_with("(6000 bytes)"), "{c}");
        assert_eq!(clip("short", 10), "short");
    }

    #[test]
    fn links_encode_their_query_and_are_escaped() {
        assert_eq!(
            href(
                "/sessions",
                &[("ns", "a b"), ("agent", ""), ("phase", "<x>")]
            ),
            "/sessions?ns=a+b&amp;phase=%3Cx%3E"
        );
        assert_eq!(href("/sessions", &[("ns", "")]), "/sessions");
    }

    #[test]
    fn ages_and_durations_read_as_people_say_them() {
        assert_eq!(age(0, 45_000), "45s");
        assert_eq!(age(0, 12 * 60_000), "12m");
        assert_eq!(age(0, 3 * 3_600_000), "3h");
        assert_eq!(age(0, 3 * 86_400_000), "3d");
        assert_eq!(age(10, 0), "0s");
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(4_200), "4.2s");
        assert_eq!(duration(190_000), "3m10s");
        assert_eq!(duration(7_500_000), "2h5m");
    }
}
