//! The custom resources, group `agents-exe.io`, version `v1alpha1`:
//! [`Agent`], [`Session`] and [`Continuation`]. The CRDs in `crds/` are
//! generated from these types (`agents crds`). They meet the core's types
//! in [`convert`], [`agent_map`] (an agent's spec) and [`stored`] (the
//! session's state in its status; [`legacy`] reads the earlier form).

pub mod agent;
pub mod agent_map;
pub mod budget;
pub mod continuation;
pub mod convert;
pub mod legacy;
pub mod namespace_budget;
pub mod quota;
pub mod session;
pub mod stored;

pub use agent::{Agent, AgentSpec, AgentStatus};
pub use continuation::{Continuation, ContinuationSpec, ContinuationStatus};
pub use namespace_budget::{Budget, BudgetSpec, BudgetStatus};
pub use session::{Session, SessionSpec, SessionStatus};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion, JSONSchemaProps,
};
use kube::core::CustomResourceExt;
use schemars::{json_schema, Schema, SchemaGenerator};

pub const GROUP: &str = "agents-exe.io";
pub const VERSION: &str = "v1alpha1";
/// The category of all three kinds: `kubectl get agents-exe` lists them.
/// Not `agents`, the Agent plural, which would make `kubectl get agents`
/// list Sessions and Continuations too.
pub const CATEGORY: &str = "agents-exe";
/// Most conditions a status holds (one per type).
pub const MAX_CONDITIONS: u64 = 16;

/// Free-form JSON: tool arguments and results.
pub(crate) fn free_form(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// A free-form JSON object: tool results and schemas. Typed as an object
/// so CEL rules can compare it (an untyped field is invisible to CEL).
pub(crate) fn free_form_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// Standard conditions, merged by `type`: the schema of `metav1.Condition`
/// (patterns and lengths as the API server's own types declare them).
pub(crate) fn conditions_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": MAX_CONDITIONS,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": { "type": "string", "format": "date-time", "description": "When the condition last changed status." },
                "message": { "type": "string", "maxLength": 32768, "description": "Human-readable detail." },
                "observedGeneration": { "type": "integer", "format": "int64", "minimum": 0, "description": "The generation the condition reflects." },
                "reason": {
                    "type": "string", "minLength": 1, "maxLength": 1024,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                    "description": "CamelCase reason for the last transition."
                },
                "status": { "type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown." },
                "type": {
                    "type": "string", "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                    "description": "Condition type, e.g. Succeeded."
                }
            }
        }
    })
}

/// A tool result: `{status: success, response: {...}}` or
/// `{status: error, message}`. `status` is typed so CEL rules can tell an
/// error from a success; the response stays free-form.
pub(crate) fn tool_result_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": { "type": "string", "enum": ["success", "error"], "description": "`success` (with `response`) or `error` (with `message`)." },
            "response": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": true,
                "description": "What the tool answered: `{type: text, content}`, `{type: json, content}`, `{type: media, mimeType, base64Data}` or `{type: mixed, parts}`."
            },
            "message": { "type": "string", "description": "The error, as the model is told it." }
        },
        "x-kubernetes-validations": [{
            "rule": "self.status == 'error' ? (has(self.message) && !has(self.response)) : (has(self.response) && !has(self.message))",
            "message": "a result is {status: success, response: {...}} or {status: error, message: ...}"
        }]
    })
}

/// The CRDs as installed. A status is an object or absent, never `null`.
///
/// A Session's status is one atomic value: the operator alone writes it,
/// always whole, so the API server need not track who owns each of its
/// fields. Granular, that field set (in `metadata.managedFields`) was over
/// a quarter of a finished session's stored object, kept in etcd, in the
/// watch cache, in every watch event, and computed again on every write.
///
/// Its `status.state` is stored as given (free-form): see
/// [`opaque_state`].
pub fn crds() -> [CustomResourceDefinition; 4] {
    documented_crds().map(|mut crd| {
        if crd.spec.names.kind == "Session" {
            for version in &mut crd.spec.versions {
                if let Some(status) = status_schema(version) {
                    opaque_state(status);
                }
            }
        }
        crd
    })
}

/// The CRDs with every field's schema, `status.state`'s included: what
/// the CRD reference documents.
pub fn documented_crds() -> [CustomResourceDefinition; 4] {
    [
        Agent::crd(),
        Session::crd(),
        Continuation::crd(),
        Budget::crd(),
    ]
    .map(|mut crd| {
        let whole_status = crd.spec.names.kind == "Session";
        for version in &mut crd.spec.versions {
            if let Some(status) = status_schema(version) {
                status.nullable = None;
                if whole_status {
                    status.x_kubernetes_map_type = Some("atomic".into());
                }
            }
        }
        crd
    })
}

fn status_schema(version: &mut CustomResourceDefinitionVersion) -> Option<&mut JSONSchemaProps> {
    version
        .schema
        .as_mut()
        .and_then(|s| s.open_api_v3_schema.as_mut())
        .and_then(|s| s.properties.as_mut())
        .and_then(|p| p.get_mut("status"))
}

/// `status.state` as the API server keeps it: one free-form object. Only
/// the operator writes a Session's status (people may read it, never write
/// it), and it reads the state back strictly (`stored::session_state`,
/// `core::call::flat`), so a field-by-field schema there checked only the
/// operator's own output, at a cost on every write: decoding against the
/// schema and validating each field was a fifth to a third of the API
/// server's CPU for a status write (`cluster_write_cost`). Free-form, the
/// state also keeps every field a newer operator writes when the installed
/// CRD is older (Helm never upgrades a chart's CRDs): typed, the API server
/// would prune the fields it does not know, and the state would lose them.
fn opaque_state(status: &mut JSONSchemaProps) {
    let Some(state) = status.properties.as_mut().and_then(|p| p.get_mut("state")) else {
        return;
    };
    *state = JSONSchemaProps {
        type_: Some("object".into()),
        x_kubernetes_preserve_unknown_fields: Some(true),
        description: state.description.take(),
        ..JSONSchemaProps::default()
    };
}

/// The CRDs as one multi-document YAML, as `crds/` holds them.
pub fn crds_yaml() -> String {
    crds()
        .iter()
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
        for crd in [
            Agent::crd(),
            Session::crd(),
            Continuation::crd(),
            Budget::crd(),
        ] {
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
        let json: String = [Agent::crd(), Session::crd(), Continuation::crd()]
            .iter()
            .map(|c| serde_json::to_string(c).unwrap())
            .collect();
        for rule in [
            "!has(oldSelf.outcome) || (has(self.outcome) && self.outcome == oldSelf.outcome)",
            "!has(oldSelf.decision) || (has(self.decision) && self.decision == oldSelf.decision)",
            "has(self.agentRef) != has(self.agent)",
            session::MESSAGES_APPEND_ONLY,
            continuation::SUCCESS_NEEDS_APPROVAL,
            "self == oldSelf",
        ] {
            assert!(json.contains(rule), "missing CEL rule {rule}");
        }
        for crd in [Agent::crd(), Session::crd(), Continuation::crd()] {
            let kind = &crd.spec.names.kind;
            assert!(
                crd.spec.versions[0]
                    .subresources
                    .as_ref()
                    .and_then(|s| s.status.as_ref())
                    .is_some(),
                "{kind} has no status subresource"
            );
            assert_eq!(
                crd.spec.names.categories.as_deref(),
                Some(&[CATEGORY.to_string()][..]),
                "{kind}"
            );
            // The category must not shadow a kind's own names.
            for name in [
                Some(&crd.spec.names.plural),
                crd.spec.names.singular.as_ref(),
            ]
            .into_iter()
            .flatten()
            {
                assert_ne!(name, CATEGORY);
            }
        }
    }

    fn schema_of(
        crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    ) -> Value {
        serde_json::to_value(
            &crd.spec.versions[0]
                .schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema,
        )
        .unwrap()
    }

    /// The installed Session CRD differs from the documented one in
    /// `status.state` alone, which it keeps free-form (an object, described);
    /// the other kinds are the same.
    #[test]
    fn the_installed_crds_keep_a_session_s_state_as_given() {
        for (installed, documented) in crds().iter().zip(documented_crds().iter()) {
            let (mut installed, mut documented) = (schema_of(installed), schema_of(documented));
            let kind = documented["title"].clone();
            if kind == "Session" {
                let path = "/properties/status/properties/state";
                let state = installed.pointer_mut(path).unwrap().take();
                let typed = documented.pointer_mut(path).unwrap().take();
                assert_eq!(
                    state,
                    serde_json::json!({
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": true,
                        "description": typed["description"],
                    })
                );
                assert!(typed["properties"]["turns"].is_object(), "{typed}");
            }
            assert_eq!(installed, documented, "{kind}");
        }
    }

    /// Paths of every free-form (preserve-unknown-fields) node.
    fn free_form_paths(schema: &Value, path: &str, out: &mut Vec<String>) {
        if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
            out.push(path.to_string());
        }
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                free_form_paths(v, &format!("{path}.{k}"), out);
            }
        }
        if let Some(items) = schema.get("items") {
            free_form_paths(items, &format!("{path}[]"), out);
        }
    }

    /// Strict field validation refuses unknown fields only where the schema
    /// names the fields: only tool data (arguments, schemas, results) may be
    /// free-form, never the policy.
    #[test]
    fn only_tool_data_is_free_form() {
        for crd in [Agent::crd(), Session::crd(), Continuation::crd()] {
            let mut free = Vec::new();
            free_form_paths(&schema_of(&crd), "", &mut free);
            for path in &free {
                let leaf = path.rsplit('.').next().unwrap();
                // `approval` is a boolean or an object, which a structural
                // schema cannot type; the operator reads it strictly
                // (unknown keys are refused in the Ready condition).
                if leaf == "approval" {
                    continue;
                }
                // A Session's status keeps the fields an earlier operator
                // wrote, for reading once (the next write removes them).
                if path == ".status" && crd.spec.names.kind == "Session" {
                    continue;
                }
                assert!(
                    matches!(
                        leaf,
                        "arguments" | "parameters" | "inputSchema" | "result" | "response"
                    ),
                    "{}: {path} is free-form",
                    crd.spec.names.kind
                );
                assert!(!path.contains(".policy"), "{path}");
            }
        }
        // The policy is fully typed in both places it is written.
        let agent = schema_of(&Agent::crd());
        let rule =
            &agent["properties"]["spec"]["properties"]["policy"]["properties"]["rules"]["items"];
        for field in [
            "tool",
            "disposition",
            "reason",
            "isolation",
            "approval",
            "timeoutSeconds",
            "retries",
            "cache",
            "truncateBytes",
        ] {
            assert!(rule["properties"].get(field).is_some(), "rules[].{field}");
        }
    }

    /// Conditions follow `metav1.Condition`, and every list a CEL rule
    /// walks is bounded.
    #[test]
    fn conditions_and_cel_lists_are_bounded() {
        let session = schema_of(&Session::crd());
        let conditions = &session["properties"]["status"]["properties"]["conditions"];
        assert_eq!(conditions["maxItems"], MAX_CONDITIONS);
        let item = &conditions["items"]["properties"];
        assert_eq!(item["type"]["maxLength"], 316);
        assert_eq!(item["reason"]["maxLength"], 1024);
        assert_eq!(
            item["reason"]["pattern"],
            "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
        );
        assert_eq!(item["message"]["maxLength"], 32768);
        let messages = &session["properties"]["spec"]["properties"]["messages"];
        assert_eq!(messages["maxItems"], 500);
        assert_eq!(messages["items"]["maxLength"], 32768);
        let agent = schema_of(&Agent::crd());
        assert_eq!(
            agent["properties"]["status"]["properties"]["conditions"]["maxItems"],
            MAX_CONDITIONS
        );
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
