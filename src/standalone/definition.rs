//! From YAML (the same `Session`/`Agent` manifests `kubectl apply` takes)
//! to a runnable agent: the core's config, a model client and the tools.

pub use crate::agent::{Definition, RunnableAgent};
use crate::api::agent::ModelProvider;
use crate::api::{AgentSpec, SessionSpec};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum DefinitionError {
    #[error("cannot read {path}: {why}")]
    Read { path: String, why: String },
    #[error("{path}: document {doc}: {why}")]
    Invalid {
        path: String,
        doc: usize,
        why: String,
    },
    #[error("{path}: {why}")]
    Semantic { path: String, why: String },
}

/// The largest definition file read: a session's messages at their bounds
/// (500 of 32 KiB) and its agents fit several times over.
pub const MAX_DEFINITION_BYTES: usize = 64 << 20;

/// Reads a file of YAML documents: exactly one `Session`, plus the
/// `Agent`s it may refer to. Unknown fields are errors, not silently
/// dropped: a misspelt `toolCals` must not run an agent without tools.
pub fn load_file(path: &Path) -> Result<Definition, DefinitionError> {
    let shown = path.display().to_string();
    let text = crate::host::read_named_file(path, MAX_DEFINITION_BYTES).map_err(|e| {
        DefinitionError::Read {
            path: shown.clone(),
            why: e.to_string(),
        }
    })?;
    parse(&text, &shown)
}

pub fn parse(text: &str, path: &str) -> Result<Definition, DefinitionError> {
    parse_with_agents(text, path).map(|(def, _)| def)
}

/// Reads a file as [`load_file`] does, with the file's Agents that the
/// session's `agent` tools reach (directly or through each other): what
/// `agents run` keeps beside the session to make its sub-agents.
pub fn load_file_with_agents(path: &Path) -> Result<(Definition, SubAgents), DefinitionError> {
    let shown = path.display().to_string();
    let text = crate::host::read_named_file(path, MAX_DEFINITION_BYTES).map_err(|e| {
        DefinitionError::Read {
            path: shown.clone(),
            why: e.to_string(),
        }
    })?;
    parse_with_agents(&text, &shown)
}

/// The Agents a tree of sub-agents may run, by name.
pub type SubAgents = std::collections::BTreeMap<String, AgentSpec>;

fn parse_with_agents(text: &str, path: &str) -> Result<(Definition, SubAgents), DefinitionError> {
    // Before the parser, which takes time out of proportion on deep nesting.
    super::yaml_depth::check(text).map_err(|e| DefinitionError::Semantic {
        path: path.to_string(),
        why: e.to_string(),
    })?;
    let mut sessions = Vec::new();
    let mut agents = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let doc_no = i + 1;
        let invalid = |why: String| DefinitionError::Invalid {
            path: path.to_string(),
            doc: doc_no,
            why,
        };
        let value = Value::deserialize(doc).map_err(|e| invalid(e.to_string()))?;
        if value.is_null() {
            continue;
        }
        top_level_fields(&value).map_err(invalid)?;
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
        let api_version = value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        let expected = format!("{}/{}", crate::api::GROUP, crate::api::VERSION);
        if api_version != expected {
            return Err(invalid(format!(
                "apiVersion is {api_version:?}; expected {expected:?}"
            )));
        }
        let name = value
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid("metadata.name is missing".into()))?
            .to_string();
        let spec = value
            .get("spec")
            .cloned()
            .ok_or_else(|| invalid(format!("{kind} {name} has no spec")))?;
        if kind == "Session" || kind == "Agent" {
            // The cluster refuses such names too; here they would also end
            // up in printed commands and continuation tokens.
            crate::core::ids::validate_name(kind, &name)
                .map_err(|e| invalid(format!("metadata.name: {e}")))?;
        }
        match kind {
            "Session" => {
                let spec = strict::<SessionSpec>(spec, "spec").map_err(invalid)?;
                // The API server's schema bounds them in a cluster; here, this.
                crate::core::conversation::check_user_messages(&spec.messages).map_err(invalid)?;
                sessions.push((name, spec))
            }
            "Agent" => agents.push((name, strict::<AgentSpec>(spec, "spec").map_err(invalid)?)),
            "Budget" => {
                return Err(invalid(format!(
                    "Budget {name} is a cluster resource: the operator counts a namespace's Sessions against it. `agents run` runs one session; bound it with the Session's spec.limits (tokens, cost) instead, and remove the Budget document (apply it with kubectl)"
                )))
            }
            other => {
                return Err(invalid(format!(
                    "kind {other:?} is not runnable here; expected Session or Agent"
                )))
            }
        }
    }
    let semantic = |why: String| DefinitionError::Semantic {
        path: path.to_string(),
        why,
    };
    let (session, spec) = match sessions.len() {
        1 => sessions.remove(0),
        0 => return Err(semantic("no Session document; `agents run` needs one Session (with an inline agent or an agentRef to an Agent in the same file)".into())),
        n => return Err(semantic(format!("{n} Session documents; put one Session per file"))),
    };
    let lookup = FileAgents(agents);
    let def = futures::executor::block_on(crate::agent::definition(
        &session,
        &spec,
        &lookup,
        "in this file",
    ))
    .map_err(|e| semantic(e.to_string()))?;
    // Build once now so every mistake surfaces before anything is stored.
    def.build(crate::core::Millis(0), &crate::agent::NoSecrets)
        .map_err(semantic)?;
    no_named_approvers(&def.agent).map_err(semantic)?;
    let reached = sub_agents(&def.agent, &lookup).map_err(semantic)?;
    Ok((def, reached))
}

/// The file's Agents that `agent`'s `agent` tools reach, each checked as
/// the session's own agent is (it runs as a child session): an `agent`
/// tool naming an Agent the file lacks is refused here, before anything
/// is stored.
fn sub_agents(agent: &AgentSpec, file: &FileAgents) -> Result<SubAgents, String> {
    let mut reached = SubAgents::new();
    let mut todo: Vec<(String, String)> = called(agent, "the session's agent");
    while let Some((name, caller)) = todo.pop() {
        if reached.contains_key(&name) {
            continue;
        }
        let Some((_, found)) = file.0.iter().find(|(n, _)| *n == name) else {
            return Err(format!(
                "{caller} has an agent tool naming Agent {name:?}, which is not in this file; add that Agent to the file (sub-agents run from the file's Agents)"
            ));
        };
        let mut found = found.clone();
        futures::executor::block_on(crate::agent::subagents::describe_agent_tools(
            &mut found, file,
        ));
        let probe = Definition {
            session: "probe".into(),
            agent_name: Some(name.clone()),
            agent: found.clone(),
            spec: SessionSpec::referring_to(&name),
        };
        probe
            .build(crate::core::Millis(0), &crate::agent::NoSecrets)
            .map_err(|e| format!("Agent {name} (a sub-agent): {e}"))?;
        no_named_approvers(&found).map_err(|e| format!("Agent {name}: {e}"))?;
        todo.extend(called(&found, &format!("Agent {name}")));
        reached.insert(name, found);
    }
    Ok(reached)
}

/// The Agents `agent`'s `agent` tools name, each with who calls it.
fn called(agent: &AgentSpec, caller: &str) -> Vec<(String, String)> {
    agent
        .tools
        .iter()
        .filter_map(|t| t.agent.as_ref())
        .map(|a| (a.agent_ref.clone(), caller.to_string()))
        .collect()
}

/// Standalone has no users to check a decision against: a policy naming
/// approvers or a quorum would look enforced and be not.
fn no_named_approvers(agent: &AgentSpec) -> Result<(), String> {
    use crate::api::agent::ApprovalSetting;
    let policy = &agent.policy;
    let settings = policy
        .default_decorators
        .iter()
        .map(|d| ("policy.defaultDecorators.approval".to_string(), &d.approval))
        .chain(
            policy
                .rules
                .iter()
                .enumerate()
                .map(|(i, r)| (format!("policy.rules[{i}].approval"), &r.approval)),
        );
    for (path, setting) in settings {
        if let ApprovalSetting::Policy(p) = setting {
            if p.approvers.is_some() || p.quorum.is_some_and(|q| q > 1) {
                return Err(format!(
                    "{path}: approvers and quorum are enforced by a cluster's API server, and standalone has no users to check; here use `approval: true` (or timeoutSeconds/onTimeout alone): decisions are signed with --by"
                ));
            }
        }
    }
    Ok(())
}

/// The fields a manifest may have at its top, as `kubectl apply` knows
/// them (`status` is taken and ignored, as the API server does).
const TOP_LEVEL: [&str; 5] = ["apiVersion", "kind", "metadata", "spec", "status"];

/// Refuses a document that is no object, or has an unknown top-level field
/// (a typo such as `spce:` would otherwise run with the defaults).
fn top_level_fields(doc: &Value) -> Result<(), String> {
    let Some(fields) = doc.as_object() else {
        return Err("a document is a mapping with apiVersion, kind, metadata and spec".into());
    };
    match fields.keys().find(|k| !TOP_LEVEL.contains(&k.as_str())) {
        Some(unknown) => Err(format!(
            "unknown field {unknown:?} at the top of the document; a manifest has {}",
            TOP_LEVEL.join(", ")
        )),
        None => Ok(()),
    }
}

/// Deserialises, reporting the first unknown field by its path.
/// Reads a file holding an Agent's `model:` section alone (`provider`,
/// and its settings), as strictly as a whole Agent is read: what
/// `agents session replay --model` puts in the recorded agent's place.
pub fn load_model_file(path: &Path) -> Result<crate::api::agent::ModelSpec, DefinitionError> {
    let shown = path.display().to_string();
    let semantic = |why: String| DefinitionError::Semantic {
        path: shown.clone(),
        why,
    };
    let text = crate::host::read_named_file(path, MAX_DEFINITION_BYTES).map_err(|e| {
        DefinitionError::Read {
            path: shown.clone(),
            why: e.to_string(),
        }
    })?;
    super::yaml_depth::check(&text).map_err(|e| semantic(e.to_string()))?;
    let value: Value = serde_norway::from_str(&text).map_err(|e| semantic(e.to_string()))?;
    strict(value, "model").map_err(semantic)
}

fn strict<T: serde::de::DeserializeOwned>(value: Value, root: &str) -> Result<T, String> {
    let mut unknown = Vec::new();
    let parsed: Result<T, _> = serde_ignored::deserialize(value, |p| unknown.push(field_path(&p)));
    // A misspelt required field shows up as both; the unknown name is the clue.
    if let Some(first) = unknown.first() {
        let also = parsed
            .as_ref()
            .err()
            .map(|e| format!(" ({root}: {e})"))
            .unwrap_or_default();
        return Err(format!(
            "unknown field {root}.{first}; check its spelling against `agents crds` (or `kubectl explain`){also}"
        ));
    }
    parsed.map_err(|e| format!("{root}: {e}"))
}

/// `tools[0].builtin.shell`, as kubectl and the API server name fields:
/// serde_ignored's path without its `?` marks for optional fields.
fn field_path(p: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", field_path(parent)),
        Path::Map { parent, key } => join(field_path(parent), key),
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_path(parent),
    }
}

fn join(parent: String, leaf: &str) -> String {
    if parent.is_empty() {
        leaf.to_string()
    } else {
        format!("{parent}.{leaf}")
    }
}

/// The Agents of one YAML file.
struct FileAgents(Vec<(String, AgentSpec)>);

impl crate::agent::AgentLookup for FileAgents {
    fn agent<'a>(
        &'a self,
        name: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<Option<AgentSpec>, String>> {
        let found = self
            .0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a.clone());
        Box::pin(async move { Ok(found) })
    }
}

/// Standalone, a Secret reference `{name: llm, key: api-key}` is read from
/// the environment variable `AGENTS_SECRET_LLM_API_KEY` (for a model's key,
/// then the provider's usual variable, [`provider_key_env`]): keys never
/// live in the store or the YAML.
pub fn secret_env_name(name: &str, key: &str) -> String {
    crate::core::policy::SecretKeyRef {
        name: name.to_string(),
        key: key.to_string(),
    }
    .env_name()
}

/// Standalone secrets: the environment, as [`secret_env_name`] says.
pub struct EnvSecrets;

impl crate::agent::SecretSource for EnvSecrets {
    fn secret(&self, name: &str, key: &str) -> Option<String> {
        std::env::var(secret_env_name(name, key)).ok()
    }

    fn model_key(&self, name: &str, key: &str, provider: ModelProvider) -> Option<String> {
        self.secret(name, key)
            .or_else(|| std::env::var(provider_key_env(provider)?).ok())
    }
}

/// The variable a provider's own tools read its key from, taken when the
/// Secret's variable is unset; one provider's key never goes to another.
pub fn provider_key_env(provider: ModelProvider) -> Option<&'static str> {
    match provider {
        ModelProvider::Openai => Some("OPENAI_API_KEY"),
        ModelProvider::Anthropic => Some("ANTHROPIC_API_KEY"),
        ModelProvider::Scripted => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: helper}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - text: hi
  tools:
    - name: echo
      builtin: {function: echo}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: s1}
spec:
  agentRef: {name: helper}
  messages: ["hello"]
"#;

    #[test]
    fn a_session_with_an_agent_ref_resolves_in_the_same_file() {
        let d = parse(GOOD, "f.yaml").unwrap();
        assert_eq!(d.session, "s1");
        assert_eq!(d.agent_name.as_deref(), Some("helper"));
    }

    #[test]
    fn bad_documents_say_where_and_what() {
        let typo = GOOD.replace("messages:", "mesages:");
        let e = parse(&typo, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("document 2") && e.contains("mesages"), "{e}");
        let unknown_builtin = GOOD.replace("function: echo", "function: nope");
        let e = parse(&unknown_builtin, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("\"nope\"") && e.contains("builtins"), "{e}");
        let missing_agent = GOOD.replace("agentRef: {name: helper}", "agentRef: {name: other}");
        let e = parse(&missing_agent, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("not in this file"), "{e}");
        let bad_name = GOOD.replace(
            "{name: s1}",
            "{name: 'x;touch PWNED;$(touch PWNED2)/../../y'}",
        );
        let e = parse(&bad_name, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("document 2")
                && e.contains("metadata.name")
                && e.contains("Session name \"x;touch PWNED;$(touch PWNED2)/../../y\"")
                && e.contains("DNS-1123"),
            "{e}"
        );
        let bad_agent = GOOD.replace("{name: helper}", "{name: Helper}");
        let e = parse(&bad_agent, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("Agent name \"Helper\""), "{e}");
        let e = parse("kind: [", "f.yaml").unwrap_err().to_string();
        assert!(e.contains("f.yaml"), "{e}");
        let budget = format!(
            "{GOOD}---\napiVersion: agents-exe.io/v1alpha1\nkind: Budget\nmetadata: {{name: team}}\nspec: {{tokens: 100}}\n"
        );
        let e = parse(&budget, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("Budget team is a cluster resource") && e.contains("spec.limits"),
            "{e}"
        );
        let other = GOOD.replace("kind: Agent", "kind: Widget");
        let e = parse(&other, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("kind \"Widget\" is not runnable here"), "{e}");
    }

    #[test]
    fn messages_are_bounded_as_the_crd_bounds_them() {
        use crate::core::conversation::{MAX_USER_MESSAGES, MAX_USER_MESSAGE_CHARS};
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(crate::api::Session::crd()).unwrap();
        let messages = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
            ["spec"]["properties"]["messages"];
        assert_eq!(messages["maxItems"], MAX_USER_MESSAGES, "{messages}");
        assert_eq!(
            messages["items"]["maxLength"], MAX_USER_MESSAGE_CHARS,
            "{messages}"
        );

        let long = "x".repeat(MAX_USER_MESSAGE_CHARS + 1);
        let text = GOOD.replace(r#"["hello"]"#, &format!(r#"["hello", "{long}"]"#));
        let e = parse(&text, "f.yaml").unwrap_err().to_string();
        assert!(
            e.starts_with("f.yaml: document 2: spec.messages[1] is longer than 32768 characters"),
            "{}",
            crate::http::clip(&e, 300)
        );
        let many = vec!["\"m\""; MAX_USER_MESSAGES + 1].join(", ");
        let text = GOOD.replace(r#"["hello"]"#, &format!("[{many}]"));
        let e = parse(&text, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("spec.messages holds 501 messages, more than the 500"),
            "{e}"
        );
        let most = vec!["\"m\""; MAX_USER_MESSAGES].join(", ");
        parse(
            &GOOD.replace(r#"["hello"]"#, &format!("[{most}]")),
            "f.yaml",
        )
        .unwrap();
    }

    /// Every policy field, set, in an inline agent: the sample the typo
    /// tests below misspell.
    const FULL_POLICY: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: s1}
spec:
  messages: ["hello"]
  limits: {maxTurns: 3, deadlineSeconds: 60}
  agent:
    model:
      provider: scripted
      timeoutSeconds: 5
      maxRetries: 1
      scripted:
        replies:
          - text: hi
            toolCalls: [{name: echo, arguments: {a: 1}}]
    maxResultBytes: 1000
    params: {region: eu}
    tools:
      - name: echo
        builtin: {function: echo}
      - name: web
        http: {url: "http://127.0.0.1:9/x"}
      - name: box
        container: {image: "busybox:ci", command: [/bin/true], limits: {memory: 64Mi}}
    policy:
      default: runSync
      defaultDecorators: {approval: true, timeoutSeconds: 5, retries: 1, cache: true, truncateBytes: 100}
      rules:
        - tool: echo
          disposition: defer
          reason: a person answers
          approval: true
          timeoutSeconds: 5
          retries: 1
          cache: true
          truncateBytes: 100
        - tool: b*
          disposition: runIsolated
          isolation: {image: "busybox:ci", args: [x], limits: {cpu: 100m}}
"#;

    #[test]
    fn unknown_top_level_fields_are_refused() {
        let typo = FULL_POLICY.replacen("spec:", "spce:", 1);
        let e = parse(&typo, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("unknown field \"spce\" at the top"), "{e}");
        let extra = format!("{FULL_POLICY}\nnotes: hello\n");
        let e = parse(&extra, "f.yaml").unwrap_err().to_string();
        assert!(e.contains("unknown field \"notes\""), "{e}");
        // `kubectl get -o yaml` output carries a status: taken and ignored.
        let with_status = format!("{FULL_POLICY}status: {{phase: Running}}\n");
        parse(&with_status, "f.yaml").unwrap();
    }

    #[test]
    fn approvers_are_refused_standalone_and_a_typo_in_the_policy_is_named() {
        let session = |approval: &str| {
            format!(
                r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: s}}
spec:
  messages: ["hi"]
  agent:
    model: {{provider: scripted, scripted: {{replies: [{{text: ok}}]}}}}
    tools: [{{name: t, builtin: {{function: echo}}}}]
    policy:
      rules: [{{tool: t, disposition: runSync, approval: {approval}}}]
"#
            )
        };
        let e = parse(&session("{approvers: {users: [alice]}}"), "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("policy.rules[0].approval") && e.contains("standalone has no users"),
            "{e}"
        );
        let e = parse(&session("{quorum: 2}"), "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("standalone has no users"), "{e}");
        let e = parse(&session("{quorom: 2}"), "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `quorom`"), "{e}");
        parse(&session("{timeoutSeconds: 60, onTimeout: deny}"), "f.yaml").unwrap();
        parse(&session("true"), "f.yaml").unwrap();
    }

    #[test]
    fn misspelt_decorators_are_refused_by_path() {
        let d = parse(FULL_POLICY, "f.yaml").unwrap();
        let rule = &d.agent.policy.rules[0];
        assert!(rule.approval == crate::api::agent::ApprovalSetting::Any(true) && rule.cache);
        assert_eq!(rule.timeout_seconds, Some(5));

        // Today's bug: `aproval` on a rule was dropped unseen, so the call
        // ran without waiting for approval.
        let typo = FULL_POLICY.replace("          approval: true", "          aproval: true");
        let e = parse(&typo, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("unknown field spec.agent.policy.rules[0].aproval"),
            "{e}"
        );
        let typo = FULL_POLICY.replace("          timeoutSeconds: 5", "          timeoutSecond: 5");
        let e = parse(&typo, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("unknown field spec.agent.policy.rules[0].timeoutSecond"),
            "{e}"
        );
        let typo = FULL_POLICY.replace(
            "{approval: true, timeoutSeconds",
            "{aproval: true, timeoutSeconds",
        );
        let e = parse(&typo, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("unknown field spec.agent.policy.defaultDecorators.aproval"),
            "{e}"
        );
        // The same in a separate Agent document.
        let agent = GOOD.replace(
            "  tools:\n",
            "  policy:\n    rules:\n      - {tool: echo, disposition: runAsync, timeoutSecond: 5}\n  tools:\n",
        );
        let e = parse(&agent, "f.yaml").unwrap_err().to_string();
        assert!(
            e.contains("document 1")
                && e.contains("unknown field spec.policy.rules[0].timeoutSecond"),
            "{e}"
        );
    }

    /// JSON pointers of the objects in `value` whose schema names its
    /// fields (not maps, not free-form JSON).
    fn typed_objects(value: &Value, schema: &Value, at: String, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                let Some(props) = schema.get("properties").and_then(Value::as_object) else {
                    return;
                };
                if schema.get("x-kubernetes-preserve-unknown-fields") != Some(&Value::Bool(true)) {
                    out.push(at.clone());
                }
                for (k, v) in map {
                    if let Some(s) = props.get(k) {
                        typed_objects(v, s, format!("{at}/{k}"), out);
                    }
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    typed_objects(v, &schema["items"], format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    /// `agents run` accepts what `kubectl apply` (strict field validation)
    /// accepts: an unknown key in any object the CRD schema types is
    /// refused, wherever it sits (so a future `#[serde(flatten)]` cannot
    /// swallow typos again).
    #[test]
    fn an_unknown_field_is_refused_in_every_typed_object() {
        use kube::core::CustomResourceExt;
        let crd = crate::api::Session::crd();
        let schema = serde_json::to_value(
            &crd.spec.versions[0]
                .schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema,
        )
        .unwrap();
        let doc: Value = serde_norway::from_str(FULL_POLICY).unwrap();
        let mut objects = Vec::new();
        typed_objects(
            &doc["spec"],
            &schema["properties"]["spec"],
            "/spec".into(),
            &mut objects,
        );
        assert!(objects.len() >= 15, "{objects:?}");
        assert!(objects.contains(&"/spec/agent/policy/rules/0".to_string()));
        for at in objects {
            let mut bad = doc.clone();
            bad.pointer_mut(&at)
                .unwrap()
                .as_object_mut()
                .unwrap()
                .insert("zzTypo".into(), Value::Bool(true));
            let text = serde_norway::to_string(&bad).unwrap();
            let e = parse(&text, "f.yaml")
                .err()
                .unwrap_or_else(|| panic!("zzTypo at {at} was accepted"))
                .to_string();
            assert!(e.contains("zzTypo"), "at {at}: {e}");
        }
    }
}
