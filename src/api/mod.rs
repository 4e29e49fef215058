//! The custom resources, group `agents-exe.io`, version `v1alpha1`:
//! [`Agent`], [`Session`] and [`Continuation`]. The CRDs in `crds/` are
//! generated from these types (`agents crds`). [`convert`] is the one place
//! that maps them to and from the core's types.

pub mod agent;
pub mod continuation;
pub mod convert;
pub mod session;

pub use agent::{Agent, AgentSpec};
pub use continuation::{Continuation, ContinuationSpec, ContinuationStatus};
pub use session::{Session, SessionSpec, SessionStatus};

use kube::core::CustomResourceExt;
use schemars::{json_schema, Schema, SchemaGenerator};

pub const GROUP: &str = "agents-exe.io";
pub const VERSION: &str = "v1alpha1";

/// Free-form JSON: tool arguments and results.
pub(crate) fn free_form(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// A free-form JSON object: tool results and schemas. Typed as an object
/// so CEL rules can compare it (an untyped field is invisible to CEL).
pub(crate) fn free_form_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// Standard conditions, merged by `type`.
pub(crate) fn conditions_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": { "type": "string", "format": "date-time", "description": "When the condition last changed status." },
                "message": { "type": "string", "description": "Human-readable detail." },
                "observedGeneration": { "type": "integer", "format": "int64", "description": "The generation the condition reflects." },
                "reason": { "type": "string", "description": "CamelCase reason for the last transition." },
                "status": { "type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown." },
                "type": { "type": "string", "description": "Condition type, e.g. Succeeded." }
            }
        }
    })
}

/// The CRDs as one multi-document YAML, as `crds/` holds them.
pub fn crds_yaml() -> String {
    let crds = [Agent::crd(), Session::crd(), Continuation::crd()];
    crds.iter()
        .map(|c| serde_norway::to_string(c).expect("CRDs serialise"))
        .map(|y| format!("---\n{y}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn undocumented(schema: &Value, path: &str, out: &mut Vec<String>) {
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                let here = format!("{path}.{k}");
                if v.get("description").is_none() {
                    out.push(here.clone());
                }
                undocumented(v, &here, out);
            }
        }
        if let Some(items) = schema.get("items") {
            undocumented(items, &format!("{path}[]"), out);
        }
    }

    #[test]
    fn every_field_is_documented_and_has_printer_columns() {
        for crd in [Agent::crd(), Session::crd(), Continuation::crd()] {
            let kind = crd.spec.names.kind.clone();
            let v = &crd.spec.versions[0];
            let schema =
                serde_json::to_value(&v.schema.as_ref().unwrap().open_api_v3_schema).unwrap();
            let mut missing = Vec::new();
            for top in ["spec", "status"] {
                if let Some(s) = schema["properties"].get(top) {
                    if s.get("description").is_none() {
                        missing.push(format!("{kind}.{top}"));
                    }
                    undocumented(s, &format!("{kind}.{top}"), &mut missing);
                }
            }
            assert!(
                missing.is_empty(),
                "fields without description: {missing:?}"
            );
            let columns = v.additional_printer_columns.as_ref().map_or(0, Vec::len);
            assert!(columns >= 3, "{kind} has {columns} printer columns");
            assert!(!crd
                .spec
                .names
                .short_names
                .clone()
                .unwrap_or_default()
                .is_empty());
        }
    }

    #[test]
    fn cel_rules_guard_results_and_one_of_fields() {
        let yaml = crds_yaml();
        for rule in [
            "!has(oldSelf.result) || (has(self.result) && self.result == oldSelf.result)",
            "has(self.agentRef) != has(self.agent)",
            "size(self) >= size(oldSelf)",
        ] {
            assert!(yaml.contains(rule), "missing CEL rule {rule}");
        }
        assert!(Session::crd().spec.versions[0]
            .subresources
            .as_ref()
            .unwrap()
            .status
            .is_some());
        assert!(Continuation::crd().spec.versions[0]
            .subresources
            .as_ref()
            .unwrap()
            .status
            .is_some());
    }

    #[test]
    fn checked_in_crds_match_the_types() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/agents-exe.io.yaml");
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == crds_yaml(),
            "crds/agents-exe.io.yaml is out of date: run `cargo run -- crds > crds/agents-exe.io.yaml`"
        );
        let chart = path
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("charts/agents/crds/agents-exe.io.yaml");
        assert!(
            std::fs::read_to_string(chart).unwrap_or_default() == on_disk,
            "charts/agents/crds/ differs from crds/: copy crds/agents-exe.io.yaml there"
        );
    }
}
