//! Cache keys: the tool name plus SHA-256 of the canonical arguments, so the
//! same call made with keys in another order hits the same entry.

use super::conversation::ToolCall;
use super::ids::hex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CacheKey {
    pub tool: String,
    /// SHA-256 over the scope, the tool's definition fingerprint and the
    /// canonical arguments (the name is kept for stored keys).
    pub arguments_sha256: String,
}

/// Where a cached result may be shared: one namespace (standalone: one
/// store), and only while the tool's definition (image and command, or URL)
/// is unchanged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheScope {
    pub namespace: String,
    /// Tool name -> fingerprint of its definition.
    pub fingerprints: std::collections::BTreeMap<String, String>,
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.tool, self.arguments_sha256)
    }
}

/// The key for `call`, or `None` when the call must not be cached: its
/// context holds secrets, or its arguments are not a JSON object.
pub fn cache_key(
    call: &ToolCall,
    context_has_secrets: bool,
    scope: &CacheScope,
) -> Option<CacheKey> {
    if context_has_secrets {
        return None;
    }
    let args = call.parsed_arguments().ok()?;
    let canonical = canonical_json(&Value::Object(args));
    let fingerprint = scope
        .fingerprints
        .get(&call.name)
        .map(String::as_str)
        .unwrap_or("");
    let mut h = Sha256::new();
    // Length-prefixed parts, so no two (scope, fingerprint, args) collide.
    for part in [scope.namespace.as_str(), fingerprint, canonical.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    Some(CacheKey {
        tool: call.name.clone(),
        arguments_sha256: hex(&h.finalize()),
    })
}

/// A fingerprint of a tool definition: any change to what runs (image,
/// command, URL) gives another one.
pub fn fingerprint(definition: &Value) -> String {
    hex(&Sha256::digest(canonical_json(definition).as_bytes()))[..16].to_string()
}

/// JSON text with object keys sorted at every depth and no whitespace.
/// Written out explicitly because serde_json's map order depends on a
/// crate feature that any dependency may switch on.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(args: &str) -> ToolCall {
        ToolCall {
            model_call_id: "x".into(),
            name: "search".into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn key_ignores_argument_order_and_whitespace() {
        let s = CacheScope::default();
        let a = cache_key(
            &call(r#"{"q":"rust","opts":{"b":1,"a":[1,{"z":0,"y":1}]}}"#),
            false,
            &s,
        );
        let b = cache_key(
            &call(r#"{ "opts": {"a":[1,{"y":1,"z":0}],"b":1}, "q": "rust" }"#),
            false,
            &s,
        );
        assert_eq!(a, b);
        assert_eq!(a.as_ref().unwrap().arguments_sha256.len(), 64);
        assert_ne!(a, cache_key(&call(r#"{"q":"go"}"#), false, &s));
    }

    #[test]
    fn keys_are_scoped_to_namespace_and_tool_definition() {
        let c = call(r#"{"q":"rust"}"#);
        let base = CacheScope::default();
        let other_ns = CacheScope {
            namespace: "team-b".into(),
            ..CacheScope::default()
        };
        let changed_tool = CacheScope {
            fingerprints: [("search".to_string(), "v2".to_string())].into(),
            ..CacheScope::default()
        };
        let k = cache_key(&c, false, &base);
        assert_ne!(k, cache_key(&c, false, &other_ns));
        assert_ne!(k, cache_key(&c, false, &changed_tool));
    }

    #[test]
    fn secrets_or_malformed_arguments_are_not_cacheable() {
        let s = CacheScope::default();
        assert_eq!(cache_key(&call(r#"{"q":"rust"}"#), true, &s), None);
        assert_eq!(cache_key(&call("{not json"), false, &s), None);
    }
}
