//! Identifiers. Everything here is deterministic so a restarted process
//! derives the same names and adopts what already exists.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

/// Longest DNS label Kubernetes accepts; tokens double as label values.
pub const MAX_NAME_LEN: usize = 63;

/// A session's name: the `Session` object name, or the name given to `agents run`.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(transparent)]
pub struct SessionId(pub String);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Our id of one tool call: the agent turn that issued it and its position
/// in that turn. Stable across restarts, and valid inside object names
/// (`t3-c1`). The model's own call id is kept beside it on the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId {
    pub turn: u32,
    pub index: u32,
}

impl CallId {
    pub fn new(turn: u32, index: u32) -> Self {
        CallId { turn, index }
    }
}

impl fmt::Display for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}-c{}", self.turn, self.index)
    }
}

impl std::str::FromStr for CallId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid tool call id {s:?}: expected t<turn>-c<index>, e.g. t1-c0");
        let rest = s.strip_prefix('t').ok_or_else(bad)?;
        let (turn, index) = rest.split_once("-c").ok_or_else(bad)?;
        Ok(CallId {
            turn: turn.parse().map_err(|_| bad())?,
            index: index.parse().map_err(|_| bad())?,
        })
    }
}

impl Serialize for CallId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Stored as its text, `t<turn>-c<index>`.
impl schemars::JsonSchema for CallId {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "CallId".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "pattern": "^t[0-9]+-c[0-9]+$" })
    }
}

impl<'de> Deserialize<'de> for CallId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The handle an outside party uses to complete a deferred call
/// (`agents session complete TOKEN`). It is also the `Continuation` object
/// name, so it maps to exactly one object without knowing the session.
/// It is derived, not random: completing requires write access to the
/// continuation, so the token is an address, not a secret.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(transparent)]
pub struct ContinuationToken(pub String);

impl ContinuationToken {
    /// `<session>-<call>`, shortened with a hash of the session name when it
    /// would not fit in a DNS label.
    pub fn for_call(session: &SessionId, call: CallId) -> Self {
        Self::with_suffix(session, call.to_string())
    }

    /// `<session>-budget-<n>`: the `n`th time the session asked a person
    /// to raise a limit (`onExceed: ask`).
    pub fn for_budget_ask(session: &SessionId, n: u32) -> Self {
        Self::with_suffix(session, format!("budget-{n}"))
    }

    fn with_suffix(session: &SessionId, suffix: String) -> Self {
        let full = format!("{}-{}", session.0, suffix);
        if full.len() <= MAX_NAME_LEN {
            return ContinuationToken(full);
        }
        let hash = hex(&Sha256::digest(session.0.as_bytes()))[..10].to_string();
        let keep = MAX_NAME_LEN - suffix.len() - hash.len() - 2;
        let prefix: String = session.0.chars().take(keep).collect();
        let prefix = prefix.trim_end_matches(['-', '.']);
        ContinuationToken(format!("{prefix}-{hash}-{suffix}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ContinuationToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Longest name a Kubernetes object may have (a DNS-1123 subdomain).
pub const MAX_OBJECT_NAME_LEN: usize = 253;

/// Checks `name` against the Kubernetes rule for object names (a DNS-1123
/// subdomain), as the cluster will: lowercase letters, digits, '-' and '.',
/// starting and ending with a letter or digit, at most 253 characters.
/// Names end up in hints printed as commands and in object names, so
/// nothing else is accepted. `kind` names what is checked, for the message.
pub fn validate_name(kind: &str, name: &str) -> Result<(), String> {
    let rule = "a name must be lowercase letters, digits, '-' or '.', start and end with a letter or digit, and have at most 253 characters (a Kubernetes DNS-1123 subdomain), e.g. my-session-1";
    let bad = |why: &str| Err(format!("{kind} name {name:?} is not valid: {why}; {rule}"));
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > MAX_OBJECT_NAME_LEN {
        return bad(&format!("it has {} characters", name.len()));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.'))
    {
        return bad(&format!("it contains {c:?}"));
    }
    // Each dot-separated label must start and end alphanumeric too.
    for label in name.split('.') {
        let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
        if !alnum(label.chars().next()) || !alnum(label.chars().last()) {
            return bad("each part between dots must start and end with a letter or digit");
        }
    }
    Ok(())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_id_round_trips_as_text() {
        let id = CallId::new(3, 12);
        assert_eq!(id.to_string(), "t3-c12");
        assert_eq!("t3-c12".parse::<CallId>().unwrap(), id);
        assert!("3-12"
            .parse::<CallId>()
            .unwrap_err()
            .contains("t<turn>-c<index>"));
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"t3-c12\"");
        assert_eq!(serde_json::from_str::<CallId>(&json).unwrap(), id);
    }

    #[test]
    fn names_follow_the_kubernetes_rule() {
        for good in [
            "a",
            "demo",
            "my-session-1",
            "a.b-c.d",
            "0x",
            &"a".repeat(253),
        ] {
            assert_eq!(validate_name("Session", good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "Demo",
            "x;touch PWNED;$(touch PWNED2)/../../y",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a.-b",
            "a_b",
            "a b",
            "é",
            &"a".repeat(254),
        ] {
            let e = validate_name("Session", bad).unwrap_err();
            assert!(e.contains("Session name") && e.contains("DNS-1123"), "{e}");
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        // Tokens derived from valid names are valid names themselves.
        let long =
            ContinuationToken::for_call(&SessionId("a.".repeat(40) + "b"), CallId::new(1, 0));
        assert_eq!(validate_name("token", long.as_str()), Ok(()), "{long}");
    }

    #[test]
    fn tokens_are_deterministic_dns_labels() {
        let short = ContinuationToken::for_call(&SessionId("demo".into()), CallId::new(1, 2));
        assert_eq!(short.as_str(), "demo-t1-c2");
        let long_name = "a".repeat(80);
        let a = ContinuationToken::for_call(&SessionId(long_name.clone()), CallId::new(10, 2));
        let b = ContinuationToken::for_call(&SessionId(long_name), CallId::new(10, 2));
        assert_eq!(a, b);
        assert!(a.0.len() <= MAX_NAME_LEN, "{}", a.0);
        assert!(a.0.ends_with("-t10-c2"));
        // Two long names sharing a prefix still get different tokens.
        let c = ContinuationToken::for_call(
            &SessionId(format!("{}b", "a".repeat(79))),
            CallId::new(10, 2),
        );
        assert_ne!(a, c);
    }
}
