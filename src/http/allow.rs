//! The URLs the operator may call for a tenant: its allow-lists, one for
//! http tools, MCP servers and webhooks (`--http-tool-allowed-urls`, chart
//! value `operator.httpToolAllowedUrls`) and one for models
//! (`--model-allowed-urls`, chart value `operator.modelAllowedUrls`).
//! Unset, any URL may be called.
//!
//! A pattern is a URL with `*` in it: `https://api.internal.example/*`,
//! `http://127.0.0.1:*/*`, `https://*.svc.example/v1/*`. It is matched
//! part by part against the URL as the client parsed it (the very value
//! the request goes to), never as text, so what the URL *says* cannot
//! differ from where it *goes*:
//!
//! - **scheme**: `http` or `https`, exactly.
//! - **host**: compared as the URL parser writes it (lowercase, IDNA in
//!   punycode, IPv4 in dotted decimal whatever form it was written in).
//!   Userinfo is no part of the host: `http://allowed.host@evil/` goes to
//!   `evil`, and is matched as `evil`. In the host a `*` matches within one
//!   label and never across a `.`: `*.example.com` matches `a.example.com`,
//!   not `example.com`, `a.b.example.com` or `example.com.evil.net`. A
//!   pattern whose labels are digits and `*` (`10.0.0.*`) matches IPv4
//!   addresses only, never a domain such as `10.0.0.com`; a domain pattern
//!   never matches an address. IPv6 addresses are matched exactly
//!   (`http://[::1]:*/*`). A final dot (a name resolved without search
//!   domains) is part of the host: in the pattern and the URL, or neither.
//! - **port**: none in the pattern means the scheme's default (80, 443),
//!   as in the URL: `https://h/*` and `https://h:443/*` are one pattern. `*`
//!   is any port.
//! - **path**: none means `/` only; `*` matches anything, `/` included
//!   (`/v1/*` is everything under `/v1/`). Dot segments are resolved first,
//!   also encoded ones (`%2e%2e`), and a path holding an encoded `/`, `\` or
//!   `.` must match as written and as decoded, so `/v1/..%2Fadmin` does not
//!   pass for a path under `/v1/`.
//! - the query is not matched; userinfo, `?` and `#` have no place in a
//!   pattern.

use reqwest::Url;
use std::net::Ipv4Addr;

/// The operator flag that sets the http tools' list, for messages.
pub const FLAG: &str = "--http-tool-allowed-urls";
/// The chart value that sets the http tools' list, for messages.
pub const CHART_VALUE: &str = "operator.httpToolAllowedUrls";

/// Which of the operator's lists a list is: its messages name its flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Purpose {
    /// http tools, MCP servers and notification webhooks.
    #[default]
    HttpTools,
    /// The chat-completions endpoints of OpenAI-compatible models.
    Models,
}

impl Purpose {
    pub fn flag(self) -> &'static str {
        match self {
            Purpose::HttpTools => FLAG,
            Purpose::Models => "--model-allowed-urls",
        }
    }

    pub fn chart_value(self) -> &'static str {
        match self {
            Purpose::HttpTools => CHART_VALUE,
            Purpose::Models => "operator.modelAllowedUrls",
        }
    }

    /// What the list holds, for messages.
    fn holds(self) -> &'static str {
        match self {
            Purpose::HttpTools => "URLs http tools may call",
            Purpose::Models => "URLs models may be called at",
        }
    }
}

/// The URL patterns the operator may call for one purpose. Empty lists
/// are not built: no list means any URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedUrls {
    patterns: Vec<UrlPattern>,
    purpose: Purpose,
}

impl AllowedUrls {
    /// The http tools' list of `patterns`, or an error naming the first bad one.
    pub fn parse<S: AsRef<str>>(patterns: &[S]) -> Result<AllowedUrls, String> {
        Self::parse_for(Purpose::HttpTools, patterns)
    }

    /// The list of `patterns` for `purpose`, or an error naming the first
    /// bad one.
    pub fn parse_for<S: AsRef<str>>(
        purpose: Purpose,
        patterns: &[S],
    ) -> Result<AllowedUrls, String> {
        let patterns = patterns
            .iter()
            .map(|p| UrlPattern::parse(p.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if patterns.is_empty() {
            return Err(format!("the allow-list of {} is empty", purpose.holds()));
        }
        Ok(AllowedUrls { patterns, purpose })
    }

    /// Whether `url` matches a pattern of the list.
    pub fn allows(&self, url: &Url) -> bool {
        self.patterns.iter().any(|p| p.matches(url))
    }

    /// Whether the URL text `url` parses and matches a pattern.
    pub fn allows_str(&self, url: &str) -> bool {
        Url::parse(url).is_ok_and(|u| self.allows(&u))
    }

    /// The patterns as they were given.
    pub fn patterns(&self) -> impl Iterator<Item = &str> {
        self.patterns.iter().map(|p| p.text.as_str())
    }

    /// Why `url` may not be called, for an error result: which URL, and
    /// which list (flag and chart value) does not hold it.
    pub fn not_listed(&self, url: &str) -> String {
        let listed: Vec<&str> = self.patterns().collect();
        let listed = listed.join(", ");
        let clipped = super::clip(&listed, 1000);
        let more = if clipped.len() < listed.len() {
            ", …"
        } else {
            ""
        };
        format!(
            "{:?} is not on the operator's allow-list of {} ({}, chart value {}), \
             which holds: {clipped}{more}; no request was sent to it",
            super::clip(url, 300),
            self.purpose.holds(),
            self.purpose.flag(),
            self.purpose.chart_value(),
        )
    }
}

/// One pattern, parsed into the parts a URL is matched by.
#[derive(Clone, Debug, PartialEq, Eq)]
struct UrlPattern {
    /// As given, for messages.
    text: String,
    scheme: &'static str,
    host: HostPattern,
    /// `None`: any port.
    port: Option<u16>,
    /// Starts with `/`; `*` matches anything.
    path: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum HostPattern {
    /// No `*`: the host as the URL parser writes it.
    Exact(String),
    /// Labels with `*`, each matched against one label of the host;
    /// `absolute`: written with a final dot, which the host must have too.
    Labels {
        labels: Vec<String>,
        ipv4: bool,
        absolute: bool,
    },
}

impl UrlPattern {
    fn parse(text: &str) -> Result<UrlPattern, String> {
        let bad = |why: String| {
            format!(
                "{text:?} is not a URL pattern: {why} (for example https://api.example.com/* \
                 or http://127.0.0.1:*/*)"
            )
        };
        let trimmed = text.trim();
        let Some((scheme, rest)) = trimmed.split_once("://") else {
            return Err(bad("it has no http:// or https://".into()));
        };
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => "http",
            "https" => "https",
            _ => return Err(bad("its scheme must be http or https".into())),
        };
        if let Some(c) = rest
            .chars()
            .find(|c| matches!(c, '?' | '#' | '@' | '\\') || c.is_whitespace() || c.is_control())
        {
            return Err(bad(format!(
                "{c:?} has no place in it (userinfo, a query and a fragment are not matched)"
            )));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, "/"),
        };
        let (host, port) = split_port(authority).map_err(&bad)?;
        let port = match port {
            None => Some(if scheme == "https" { 443 } else { 80 }),
            Some("*") => None,
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 && !p.starts_with('+') => Some(n),
                _ => return Err(bad(format!("port {p:?} is neither a port number nor *"))),
            },
        };
        let host = host_pattern(scheme, host).map_err(&bad)?;
        let path = Url::parse(&format!("http://x{path}"))
            .map(|u| u.path().to_string())
            .map_err(|e| bad(format!("its path {path:?} does not parse: {e}")))?;
        Ok(UrlPattern {
            text: trimmed.to_string(),
            scheme,
            host,
            port,
            path,
        })
    }

    fn matches(&self, url: &Url) -> bool {
        url.scheme() == self.scheme
            && self
                .port
                .is_none_or(|p| url.port_or_known_default() == Some(p))
            && url.host_str().is_some_and(|h| self.host.matches(h))
            && path_views(url).is_some_and(|views| views.iter().all(|p| glob(&self.path, p)))
    }
}

/// `host[:port]` or `[v6][:port]`.
fn split_port(authority: &str) -> Result<(&str, Option<&str>), String> {
    let (host, after) = if authority.starts_with('[') {
        match authority.find(']') {
            Some(i) => authority.split_at(i + 1),
            None => return Err("its IPv6 address has no closing ]".into()),
        }
    } else {
        match authority.find(':') {
            Some(i) => authority.split_at(i),
            None => (authority, ""),
        }
    };
    if host.is_empty() {
        return Err("it has no host".into());
    }
    match after {
        "" => Ok((host, None)),
        _ => match after.strip_prefix(':') {
            Some(p) if !p.is_empty() => Ok((host, Some(p))),
            _ => Err(format!("{after:?} after the host is no :port")),
        },
    }
}

fn host_pattern(scheme: &str, host: &str) -> Result<HostPattern, String> {
    if !host.contains('*') {
        return Url::parse(&format!("{scheme}://{host}/"))
            .ok()
            .and_then(|u| u.host_str().map(str::to_string))
            .map(HostPattern::Exact)
            .ok_or_else(|| format!("its host {host:?} is not a host name or address"));
    }
    if host.starts_with('[') {
        return Err("a * in an IPv6 address is not supported; list each address".into());
    }
    let lower = host.to_ascii_lowercase();
    let (name, absolute) = match lower.strip_suffix('.') {
        Some(name) => (name, true),
        None => (lower.as_str(), false),
    };
    let labels: Vec<String> = name.split('.').map(String::from).collect();
    for l in &labels {
        let ok = !l.is_empty()
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'*'));
        if !ok {
            return Err(format!(
                "its host label {l:?} is not a DNS label with * (letters, digits, - and _; \
                 write other names in punycode)"
            ));
        }
    }
    let numeric = |l: &String| l.bytes().all(|b| b.is_ascii_digit() || b == b'*');
    let ipv4 = labels.iter().all(numeric) && labels.iter().any(|l| l != "*");
    if ipv4 {
        if labels.len() != 4 || absolute {
            return Err("an IPv4 pattern has four parts, e.g. 10.0.0.*".into());
        }
        if let Some(l) = labels
            .iter()
            .filter(|l| !l.contains('*'))
            .find(|l| l.parse::<u8>().map(|n| n.to_string()) != Ok(l.to_string()))
        {
            return Err(format!("{l:?} is not a part of an IPv4 address (0 to 255)"));
        }
    }
    Ok(HostPattern::Labels {
        labels,
        ipv4,
        absolute,
    })
}

impl HostPattern {
    /// `host` as [`Url::host_str`] gives it.
    fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(h) => h == host,
            HostPattern::Labels {
                labels,
                ipv4,
                absolute,
            } => {
                let is_ipv4 = host.parse::<Ipv4Addr>().is_ok();
                if is_ipv4 != *ipv4 || host.starts_with('[') {
                    return false;
                }
                let name = match (host.strip_suffix('.'), absolute) {
                    (Some(name), true) => name,
                    (None, false) => host,
                    _ => return false,
                };
                let parts: Vec<&str> = name.split('.').collect();
                parts.len() == labels.len()
                    && labels
                        .iter()
                        .zip(&parts)
                        .all(|(l, p)| !p.is_empty() && glob(l, p))
            }
        }
    }
}

/// The path as the URL holds it, and, when it holds an encoded `/`, `\` or
/// `.`, as a server that decodes them would see it (dot segments resolved
/// again). `None` when the decoded view does not parse: refused.
fn path_views(url: &Url) -> Option<Vec<String>> {
    let path = url.path();
    let lower = path.to_ascii_lowercase();
    if !["%2f", "%5c", "%2e"].iter().any(|e| lower.contains(e)) {
        return Some(vec![path.to_string()]);
    }
    let mut decoded = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(i) = rest.find('%') {
        decoded.push_str(&rest[..i]);
        let code = rest.get(i..i + 3).map(str::to_ascii_lowercase);
        let (text, skip) = match code.as_deref() {
            Some("%2f") => ("/", 3),
            Some("%5c") => ("\\", 3),
            Some("%2e") => (".", 3),
            _ => ("%", 1),
        };
        decoded.push_str(text);
        rest = &rest[i + skip..];
    }
    decoded.push_str(rest);
    let again = Url::parse(&format!("http://x{decoded}")).ok()?;
    Some(vec![path.to_string(), again.path().to_string()])
}

/// `*` matches any run of bytes (none included); every other byte itself.
/// Backtracks to the last `*` only: at most pattern × text steps, never
/// exponential.
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|b| *b == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(patterns: &[&str]) -> AllowedUrls {
        AllowedUrls::parse(patterns).unwrap()
    }

    fn allowed(patterns: &[&str], url: &str) -> bool {
        list(patterns).allows_str(url)
    }

    #[test]
    fn scheme_host_port_and_path_each_match() {
        let p = &["https://api.internal.example/*"];
        assert!(allowed(p, "https://api.internal.example/"));
        assert!(allowed(p, "https://api.internal.example/v1/x?q=1#f"));
        assert!(allowed(p, "https://API.Internal.EXAMPLE:443/v1"));
        assert!(allowed(p, "HTTPS://api.internal.example"));
        assert!(!allowed(p, "http://api.internal.example/"), "scheme");
        assert!(!allowed(p, "https://api.internal.example:8443/"), "port");
        assert!(!allowed(p, "https://api2.internal.example/"), "host");
        // The default port, written or not, in the pattern or the URL.
        assert!(allowed(&["https://h:443/*"], "https://h/x"));
        assert!(allowed(&["http://h/*"], "http://h:80/x"));
        assert!(!allowed(&["http://h/*"], "http://h:443/x"));
        // Any port.
        let any = &["http://127.0.0.1:*/*"];
        assert!(allowed(any, "http://127.0.0.1:8080/tool"));
        assert!(allowed(any, "http://127.0.0.1/"));
        assert!(!allowed(any, "https://127.0.0.1:8080/"));
        assert!(!allowed(any, "http://127.0.0.2:8080/"));
        // No path: the root only; a path: as written, `*` past any `/`.
        assert!(allowed(&["https://h"], "https://h/"));
        assert!(!allowed(&["https://h"], "https://h/x"));
        let v1 = &["https://h/v1/*"];
        assert!(allowed(v1, "https://h/v1/a/b"));
        assert!(!allowed(v1, "https://h/v1"));
        assert!(!allowed(v1, "https://h/v2/a"));
        assert!(allowed(&["https://h/v1/*/items"], "https://h/v1/a/items"));
        assert!(!allowed(
            &["https://h/v1/*/items"],
            "https://h/v1/a/items/x"
        ));
        // Any pattern of the list.
        assert!(allowed(&["https://a/*", "https://b/*"], "https://b/x"));
    }

    #[test]
    fn userinfo_is_no_part_of_the_host() {
        let p = &["http://allowed.host/*"];
        assert!(!allowed(p, "http://allowed.host@evil/"));
        assert!(!allowed(p, "http://allowed.host:80@evil/"));
        assert!(!allowed(p, "http://allowed.host%40evil/"));
        assert!(!allowed(
            &["http://127.0.0.1:*/*"],
            "http://127.0.0.1:1@10.0.0.1:2/"
        ));
        // The other way round it goes to the allowed host, and may.
        assert!(allowed(p, "http://evil@allowed.host/x"));
        // A backslash is a slash to the parser (and to the client).
        assert!(allowed(p, "http://allowed.host\\@evil/"));
        assert!(!allowed(&["http://evil/*"], "http://allowed.host\\@evil/"));
    }

    #[test]
    fn a_host_star_stays_within_its_label() {
        let p = &["https://*.example.com/*"];
        assert!(allowed(p, "https://a.example.com/"));
        assert!(allowed(p, "https://A-1.EXAMPLE.com/"));
        assert!(!allowed(p, "https://example.com/"));
        assert!(!allowed(p, "https://.example.com/"));
        assert!(!allowed(p, "https://a.b.example.com/"));
        assert!(!allowed(p, "https://a.example.com.evil.net/"));
        assert!(!allowed(p, "https://evil.net/.example.com/"));
        assert!(!allowed(p, "https://a.example.com./"));
        // A host is not a prefix or a suffix of another.
        let h = &["http://allowed.host/*"];
        assert!(!allowed(h, "http://allowed.host.evil.com/"));
        assert!(!allowed(h, "http://notallowed.host/"));
        assert!(!allowed(h, "http://allowed.host./"));
        // A final dot (no search domains) is kept, and must be in both.
        let dot = &["http://allowed.host./*"];
        assert!(allowed(dot, "http://ALLOWED.host./x"));
        assert!(!allowed(dot, "http://allowed.host/x"));
        let star_dot = &["https://*.example.com./*"];
        assert!(allowed(star_dot, "https://a.example.com./"));
        assert!(!allowed(star_dot, "https://a.example.com/"));
        assert!(!allowed(star_dot, "https://a.example.com../"));
        let mid = &["https://api-*.example.com/*"];
        assert!(allowed(mid, "https://api-eu.example.com/"));
        assert!(!allowed(mid, "https://api-eu.evil.com.example.com/"));
        // A star host is one label, not every host.
        assert!(allowed(&["http://*:*/*"], "http://localhost:9/"));
        assert!(!allowed(&["http://*:*/*"], "http://a.b:9/"));
        // IDNA: the host as the client writes it.
        assert!(allowed(
            &["https://bücher.example/*"],
            "https://xn--bcher-kva.example/"
        ));
        assert!(allowed(
            &["https://xn--bcher-kva.example/*"],
            "https://BÜCHER.example/"
        ));
    }

    #[test]
    fn addresses_match_as_addresses() {
        let net = &["http://10.0.0.*:*/*"];
        assert!(allowed(net, "http://10.0.0.7:8080/"));
        assert!(
            !allowed(net, "http://10.0.0.com/"),
            "a domain is no address"
        );
        assert!(!allowed(net, "http://10.0.1.7/"));
        // The forms an IPv4 address can be written in are one address.
        let one = &["http://127.0.0.1:*/*"];
        assert!(allowed(one, "http://2130706433:1/"));
        assert!(allowed(one, "http://0x7f.1:1/"));
        assert!(allowed(one, "http://127.1:1/"));
        assert!(!allowed(&["http://2130706433/*"], "http://localhost/"));
        // A domain pattern matches no address.
        assert!(!allowed(&["http://*.*.*.*:*/*"], "http://10.0.0.1/"));
        assert!(!allowed(&["http://*/*"], "http://[::1]/"));
        // IPv6, exactly.
        let v6 = &["http://[::1]:*/*"];
        assert!(allowed(v6, "http://[0:0::1]:99/"));
        assert!(!allowed(v6, "http://[::2]:99/"));
    }

    #[test]
    fn paths_are_matched_resolved_and_decoded() {
        let v1 = &["https://h/v1/*"];
        assert!(!allowed(v1, "https://h/v1/../admin"));
        assert!(!allowed(v1, "https://h/v1/%2e%2e/admin"));
        assert!(!allowed(v1, "https://h/v1/..%2Fadmin"));
        assert!(!allowed(v1, "https://h/v1/..%5cadmin"));
        assert!(!allowed(v1, "https://h/v1/%2E%2E%2fadmin"));
        assert!(allowed(v1, "https://h/v1/a%2Fb"));
        assert!(allowed(v1, "https://h/v1/100%25"));
        assert!(allowed(&["https://h/*"], "https://h/v1/..%2F..%2Fadmin"));
    }

    #[test]
    fn bad_patterns_are_refused_naming_them() {
        for (pattern, why) in [
            ("api.example.com/*", "no http:// or https://"),
            ("ftp://h/*", "scheme must be http or https"),
            ("http://user@h/*", "'@' has no place"),
            ("http://h/*?q=1", "'?' has no place"),
            ("http://h/#x", "'#' has no place"),
            ("http://h:x/*", "port \"x\""),
            ("http://h:/*", "is no :port"),
            ("http://h:0/*", "port \"0\""),
            ("http:///*", "no host"),
            ("http://[::*]/*", "IPv6"),
            ("http://10.*/*", "four parts"),
            ("http://300.0.0.*/*", "\"300\""),
            ("http://a..b*/*", "host label \"\""),
            ("http://a b/*", "' ' has no place"),
        ] {
            let e = AllowedUrls::parse(&[pattern]).unwrap_err();
            assert!(e.contains(why) && e.contains(pattern), "{pattern}: {e}");
        }
        assert!(AllowedUrls::parse::<&str>(&[]).is_err());
    }

    #[test]
    fn the_refusal_names_the_url_the_flag_and_the_chart_value() {
        let m = list(&["https://a/*"]).not_listed("http://b/x");
        assert!(
            m.starts_with("\"http://b/x\" is not on the operator's allow-list"),
            "{m}"
        );
        assert!(m.contains(FLAG) && m.contains(CHART_VALUE), "{m}");
        assert!(m.contains("which holds: https://a/*"), "{m}");
        let models = AllowedUrls::parse_for(Purpose::Models, &["https://a/*"]).unwrap();
        let m = models.not_listed("http://b/x");
        assert!(
            m.starts_with(
                "\"http://b/x\" is not on the operator's allow-list of URLs models may be called at \
                 (--model-allowed-urls, chart value operator.modelAllowedUrls)"
            ),
            "{m}"
        );
    }

    #[test]
    fn globs_never_blow_up() {
        assert!(glob("a*b*c", "aXXbYYc"));
        assert!(!glob("a*b*c", "aXXbYY"));
        assert!(glob("*", ""));
        let long = "a".repeat(10_000);
        assert!(!glob(&format!("{}b", "*a".repeat(50)), &long));
    }
}
