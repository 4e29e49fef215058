//! The `Agent` resource: a model, a system prompt, tools and a policy.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use super::{conditions_schema, free_form, free_form_object};

/// An agent definition: which model answers, with which tools, under which
/// tool-call policy. Sessions refer to it by name or embed it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agents-exe.io",
    version = "v1alpha1",
    kind = "Agent",
    doc = "An agent definition: model, system prompt, tools and tool-call policy.",
    namespaced,
    status = "AgentStatus",
    shortname = "agent",
    category = "agents-exe",
    printcolumn = r#"{"name":"Provider","type":"string","jsonPath":".spec.model.provider","description":"Model provider"}"#,
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model.openai.model","description":"Model name (openai provider)"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status","description":"Whether the operator accepted the agent"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AgentSpec {
    /// What the agent does, in a sentence or two: the description an
    /// `agent` tool calling this Agent shows the model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 4096))]
    pub description: String,
    /// The model that answers the conversation.
    pub model: ModelSpec,
    /// Instructions sent as the system message before the conversation.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub system_prompt: String,
    /// The tools the model may call. Calls to other names are answered with
    /// an error the model can act on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub tools: Vec<ToolSpec>,
    /// How each tool call runs: now, in the background, isolated, or after
    /// an outside party answers.
    #[serde(default)]
    pub policy: PolicySpec,
    /// Non-secret parameters copied into every call's context snapshot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
    /// Largest tool result, in bytes, kept and sent to the model; a larger
    /// result is cut to this size and the model is told it was cut.
    /// Default 8 MiB (8388608). A rule's `truncateBytes` cuts further.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16_777_216))]
    pub max_result_bytes: Option<u64>,
    /// Whom the operator tells when a call starts waiting for a person (an
    /// approval, or a `defer` call's outside result): once per waiting call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifySpec>,
    /// The deepest a tree of sub-agents started by this agent's sessions
    /// may grow (a root session is depth 0). Default 4; the operator's
    /// `--max-sub-agent-depth` caps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 64))]
    pub max_depth: Option<u32>,
    /// Children (sub-agent sessions) of one session that run at once; the
    /// other calls wait their turn. Default 8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub max_children: Option<u32>,
}

/// Where calls that wait for a person are announced.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NotifySpec {
    /// A Slack-compatible webhook: one JSON POST per waiting call, with a
    /// one-line `text` and the call's session, token, tool, arguments (cut
    /// to 2 KiB), reason, what it waits for and how to move it on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookSpec>,
}

/// A URL the operator POSTs notifications to.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct WebhookSpec {
    /// `http` or `https` URL; where the operator lists the URLs http tools
    /// may call (`--http-tool-allowed-urls`), it must be one of them.
    #[schemars(length(min = 1, max = 2048))]
    pub url: String,
    /// Headers sent besides `Content-Type` and `Idempotency-Key`: a value,
    /// or a Secret key the user opts into (label
    /// `agents-exe.io/usable-by-agents=true`). Never logged or written to
    /// status or Events.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub headers: Vec<EnvVar>,
}

/// Default of `spec.maxResultBytes`: 8 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: u64 = 8 * 1024 * 1024;
/// Default of `spec.model.timeoutSeconds`.
pub const DEFAULT_MODEL_TIMEOUT_SECONDS: u32 = 60;
/// Default of `spec.model.maxRetries`.
pub const DEFAULT_MODEL_MAX_RETRIES: u32 = 4;

impl AgentSpec {
    /// `spec.maxResultBytes`, or its default.
    pub fn max_result_bytes(&self) -> u64 {
        self.max_result_bytes.unwrap_or(DEFAULT_MAX_RESULT_BYTES)
    }
}

/// What the operator found when it last read the agent.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    /// `Ready`: True when the operator accepted the agent (policy, tools
    /// and model are valid); False with reason `InvalidAgent` and a message
    /// naming the bad field otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The MCP servers as last listed: the revision spoken, and how many
    /// tools each offers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServerStatus>,
    /// The tools MCP servers offer the model, with their input schemas
    /// (bounded: see `schemaOmitted`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_tools: Vec<McpToolStatus>,
}

/// One MCP server of the agent, as last listed.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct McpServerStatus {
    /// The entry's `name`.
    pub name: String,
    /// The MCP protocol revision spoken with it: `2026-07-28` (stateless),
    /// or the session-based one it answered `initialize` with.
    pub protocol_version: String,
    /// Tools offered to the model.
    pub tools: u32,
}

/// One tool an MCP server offers the model.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct McpToolStatus {
    /// The tool's name: what the model calls and policy rules match.
    pub name: String,
    /// The `name` of the mcp entry that offers it.
    pub server: String,
    /// Its description (the first 1 KiB).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// Its JSON Schema of arguments, as the server lists it; left out
    /// (with `schemaOmitted`) past 4 KiB, or once the statuses' schemas
    /// hold 64 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub input_schema: Option<Value>,
    /// The schema was too large for the status (the model still gets it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub schema_omitted: bool,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum ModelProvider {
    /// Any endpoint speaking the OpenAI chat-completions wire format
    /// (OpenAI, Azure OpenAI, Ollama, vLLM, Gemini's compatible endpoint).
    Openai,
    /// Anthropic's Messages API.
    Anthropic,
    /// Replays a fixed list of replies: deterministic agent tests.
    Scripted,
}

/// The model. Set `provider` and the matching section.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.openai) ? 1 : 0) + (has(self.anthropic) ? 1 : 0) + (has(self.scripted) ? 1 : 0) == 1 && (self.provider == 'openai' ? has(self.openai) : self.provider == 'anthropic' ? has(self.anthropic) : has(self.scripted))").message("set the section matching spec.model.provider, and no other: `openai` for provider openai, `anthropic` for provider anthropic, `scripted` for provider scripted"))]
pub struct ModelSpec {
    /// `openai`, `anthropic` or `scripted`.
    pub provider: ModelProvider,
    /// Settings for an OpenAI-compatible endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub openai: Option<OpenAiModel>,
    /// Settings for Anthropic's Messages API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anthropic: Option<AnthropicModel>,
    /// The replies a scripted model gives, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scripted: Option<ScriptedModel>,
    /// Seconds one model request may take before it is abandoned and
    /// retried. Default 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: Option<u32>,
    /// Retries of a failed model request (connection error, timeout, 5xx,
    /// a reply that is not a completion) before the session fails.
    /// Default 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 10))]
    pub max_retries: Option<u32>,
    /// What the model's tokens cost; each turn's usage gets its cost, and
    /// `spec.limits.cost` of a session needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pricing: Option<super::budget::PricingSpec>,
}

impl ModelSpec {
    /// `timeoutSeconds`, or its default.
    pub fn timeout_seconds(&self) -> u32 {
        self.timeout_seconds
            .unwrap_or(DEFAULT_MODEL_TIMEOUT_SECONDS)
    }
    /// `maxRetries`, or its default.
    pub fn max_retries(&self) -> u32 {
        self.max_retries.unwrap_or(DEFAULT_MODEL_MAX_RETRIES)
    }

    /// The Secret holding the provider's API key, if the spec names one,
    /// with the field that names it (for messages).
    pub fn api_key_secret_ref(&self) -> Option<(&SecretKeyRef, &'static str)> {
        match self.provider {
            ModelProvider::Openai => self
                .openai
                .as_ref()?
                .api_key_secret_ref
                .as_ref()
                .map(|r| (r, "spec.model.openai.apiKeySecretRef")),
            ModelProvider::Anthropic => self
                .anthropic
                .as_ref()?
                .api_key_secret_ref
                .as_ref()
                .map(|r| (r, "spec.model.anthropic.apiKeySecretRef")),
            ModelProvider::Scripted => None,
        }
    }

    /// The field that says where the provider's API is (for messages).
    pub fn base_url_field(&self) -> &'static str {
        match self.provider {
            ModelProvider::Openai => "spec.model.openai.baseUrl",
            ModelProvider::Anthropic => "spec.model.anthropic.baseUrl",
            ModelProvider::Scripted => "spec.model.scripted",
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OpenAiModel {
    /// Base URL of the API, e.g. `https://api.openai.com/v1` or a local server.
    pub base_url: String,
    /// Model name sent with each request.
    pub model: String,
    /// The Secret key holding the API key. The key is read when calling the
    /// model and never written to status, events or logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<SecretKeyRef>,
    /// Azure OpenAI: send the key as the `api-key` header (instead of
    /// `Authorization: Bearer`) and add the `api-version` query. Set
    /// `baseUrl` to the deployment,
    /// `https://RESOURCE.openai.azure.com/openai/deployments/DEPLOYMENT`
    /// (or to `https://RESOURCE.openai.azure.com/openai/v1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub azure: Option<AzureOpenAi>,
}

/// How Azure OpenAI differs from OpenAI.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AzureOpenAi {
    /// The `api-version` query parameter of each request, e.g.
    /// `2024-10-21`. Deployment URLs need it; the v1 API
    /// (`.../openai/v1`) takes none, so leave it out there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub api_version: Option<String>,
}

/// Anthropic's Messages API (`POST {baseUrl}/v1/messages`, with the
/// `anthropic-version: 2023-06-01` and `x-api-key` headers).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AnthropicModel {
    /// The API root, without `/v1`. Default `https://api.anthropic.com`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Model name sent with each request, e.g. `claude-sonnet-4-5`.
    pub model: String,
    /// The most output tokens one reply may have (the API's required
    /// `max_tokens`). A reply cut at this limit fails the session with a
    /// message to raise it. Default 4096.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_tokens: Option<u32>,
    /// The Secret key holding the API key (sent as `x-api-key`). The key is
    /// read when calling the model and never written to status, events or
    /// logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<SecretKeyRef>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Secret name, in the session's namespace.
    pub name: String,
    /// Key within the Secret.
    pub key: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScriptedModel {
    /// One reply per model turn; the session fails if it asks for more.
    pub replies: Vec<ScriptedReply>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScriptedReply {
    /// The reply's text. A reply with text and no tool calls is the final answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Tool calls the model makes in this turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ScriptedToolCall>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScriptedToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments: a JSON object (or, to test bad input, a string sent as is).
    #[serde(default)]
    #[schemars(schema_with = "free_form")]
    pub arguments: Value,
}

/// A tool. Give its name and exactly one of `builtin`, `http`,
/// `container`, `mcp`, `agent`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.builtin) ? 1 : 0) + (has(self.http) ? 1 : 0) + (has(self.container) ? 1 : 0) + (has(self.mcp) ? 1 : 0) + (has(self.agent) ? 1 : 0) == 1").message("a tool needs exactly one of builtin, http, container, mcp, agent"))]
pub struct ToolSpec {
    /// Name the model calls the tool by. For an `mcp` entry, the server's
    /// name (for messages and the status); its tools keep their own names.
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// JSON Schema of the arguments, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub parameters: Option<Value>,
    /// A tool built into the runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<BuiltinTool>,
    /// A tool behind an HTTP endpoint: the arguments are POSTed as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpTool>,
    /// A tool in a container image: always runs isolated (a Job in a
    /// cluster, a child process standalone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerTool>,
    /// An MCP server: each tool it lists (or each that `tools` names) is a
    /// tool of the agent, under its own name; `description` and
    /// `parameters` come from the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<McpServerSpec>,
    /// Whether the tool honours the idempotency key it is sent (the
    /// `Idempotency-Key` header, the envelope's `idempotencyKey`): a run
    /// whose driver died without a result is then sent again under the
    /// same key, and the tool does its work once. Unset: `true`, except
    /// for an MCP server's tools, where the server's `idempotentHint` and
    /// `destructiveHint` annotations decide (this setting overrides them).
    /// `false`: such a run is never sent again on its own; see
    /// `onUnknownOutcome`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotent: Option<bool>,
    /// For a tool that is not idempotent: what happens when a run's
    /// outcome is unknown (its driver died or lost its claim before a
    /// result came back). `ask` (the default): the call waits for a
    /// person (`waitingFor: outcome`), who completes it with the real
    /// result or answers `agents session run-again TOKEN`; `fail`: the
    /// model gets an error result saying the outcome is unknown; `retry`:
    /// sent again under the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_unknown_outcome: Option<crate::core::session::OnUnknownOutcome>,
    /// Another Agent of the namespace, as a tool: each call runs as a child
    /// Session of that Agent, whose final answer is the call's result. The
    /// model calls it with `{"prompt": "..."}` plus any `parameters`
    /// declared here; `name` may be left empty (the Agent's name) and
    /// `description` too (the Agent's `spec.description`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentToolRef>,
}

/// The name the model calls `tool` by: its own, or for an `agent` tool
/// left unnamed, the Agent's.
pub fn tool_name(tool: &ToolSpec) -> &str {
    match &tool.agent {
        Some(a) if tool.name.is_empty() => &a.agent_ref,
        _ => &tool.name,
    }
}

/// The Agent an `agent` tool calls.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AgentToolRef {
    /// Name of an Agent in the same namespace.
    #[serde(rename = "ref")]
    #[schemars(length(min = 1, max = 253))]
    pub agent_ref: String,
}

/// A Model Context Protocol server. Give `url` (Streamable HTTP), or,
/// for `agents run` only, `command` (a child process speaking stdio).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.url) != has(self.command)").message("an mcp server needs exactly one of url and command"))]
pub struct McpServerSpec {
    /// The server's Streamable HTTP endpoint, e.g.
    /// `http://weather.tools.svc:8000/mcp`. Where the operator lists the
    /// URLs tools may call (`--http-tool-allowed-urls`), it must be one of
    /// them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub url: Option<String>,
    /// Standalone (`agents run`) only: the command that starts the server,
    /// which speaks MCP on stdin and stdout. It gets a clean environment:
    /// `PATH`, `HOME`, `LANG` and `env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub command: Option<Vec<String>>,
    /// The only environment variables a `command` server gets besides
    /// `PATH`, `HOME` and `LANG`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<EnvVar>,
    /// The tools to offer the model, by their names on the server; unset:
    /// all it lists. A name the server does not list makes the agent not
    /// Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(min = 1, max = 64)))]
    pub tools: Vec<String>,
    /// The only headers sent besides the protocol's own: a value, or a
    /// Secret key the user opts into (label
    /// `agents-exe.io/usable-by-agents=true`), as for http tools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub headers: Vec<EnvVar>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BuiltinTool {
    /// The builtin's name, e.g. `echo`.
    pub function: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HttpTool {
    /// URL the arguments are POSTed to.
    pub url: String,
    /// The only headers sent besides `Content-Type` and
    /// `Idempotency-Key`: a value, or a Secret key the user opts into.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub headers: Vec<EnvVar>,
}

/// A name with a literal value or a value from a Secret key (the Kubernetes
/// `EnvVar` shape). Only what a tool definition names reaches the tool.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.value) != has(self.valueFrom)").message("give exactly one of value and valueFrom"))]
pub struct EnvVar {
    /// Variable (or header) name.
    #[schemars(length(min = 1, max = 256))]
    pub name: String,
    /// A literal, non-secret value; it is stored with the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Where a secret value comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<EnvVarSource>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EnvVarSource {
    /// A key of a Secret in the session's namespace (standalone: the
    /// environment variable `AGENTS_SECRET_<NAME>_<KEY>` of the process).
    pub secret_key_ref: SecretKeyRef,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ContainerTool {
    /// Image to run (a Job's container). Tags other than `latest` are
    /// pulled only if missing.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub image: String,
    /// Command; receives the call envelope on stdin and writes the result
    /// (plain text or a result envelope) on stdout.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Arguments after the command. Never built from model output.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Resource limits, e.g. `{cpu: 500m, memory: 128Mi}`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
    /// The only environment variables the tool gets besides `PATH`, `HOME`,
    /// `LANG` and `AGENTS_TOKEN`: never the runner's own environment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<EnvVar>,
}

#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
#[serde(rename_all = "camelCase")]
pub enum DispositionMode {
    /// Run now, inside the step.
    #[default]
    RunSync,
    /// Run in the background; the session yields until it is done.
    RunAsync,
    /// Run isolated: a Job in a cluster, a child process standalone.
    RunIsolated,
    /// Wait for an outside party (a person, an external worker).
    Defer,
    /// Run as a child Session (a call of an `agent` tool). Recorded on
    /// calls only: a rule cannot choose it.
    SubAgent,
}

/// `approval: true`, or an approval policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApprovalSetting {
    /// `true`: any one person RBAC lets decide; `false`: no approval.
    Any(bool),
    /// Named approvers, a quorum, a timeout.
    Policy(ApprovalPolicySpec),
    /// What was written, and why it is no approval setting: kept, never a
    /// deserialisation error, so one tenant's typo cannot break the
    /// operator's watch of every Agent; the Ready condition says why.
    Invalid {
        written: serde_json::Value,
        why: String,
    },
}

impl ApprovalSetting {
    pub fn is_off(&self) -> bool {
        matches!(self, ApprovalSetting::Any(false))
    }
}

impl Default for ApprovalSetting {
    fn default() -> Self {
        ApprovalSetting::Any(false)
    }
}

impl Serialize for ApprovalSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ApprovalSetting::Any(b) => s.serialize_bool(*b),
            ApprovalSetting::Policy(p) => p.serialize(s),
            ApprovalSetting::Invalid { written, .. } => written.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ApprovalSetting {
    /// A boolean or a policy object; anything else is kept as `Invalid`
    /// with the reason (a typo in the object is named).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let written = serde_json::Value::deserialize(d)?;
        Ok(match written {
            serde_json::Value::Bool(b) => ApprovalSetting::Any(b),
            serde_json::Value::Object(_) => match serde_json::from_value(written.clone()) {
                Ok(p) => ApprovalSetting::Policy(p),
                Err(e) => ApprovalSetting::Invalid {
                    written,
                    why: e.to_string(),
                },
            },
            _ => ApprovalSetting::Invalid {
                why: format!(
                    "approval is true, false or a policy object ({{approvers, quorum, timeoutSeconds, onTimeout, allowEdit}}), not {written}"
                ),
                written,
            },
        })
    }
}

/// A boolean or an object: the API server keeps it as written (a CEL rule
/// cannot see a field without a type); the operator checks it and says
/// what is wrong in the Agent's (or Session's) Ready condition.
fn approval_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "description": "true: wait for one approve/deny decision before running. Or {approvers: {users, groups, serviceAccounts}, quorum, timeoutSeconds, onTimeout: deny|approve|fail, allowEdit}.",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// Who may approve a call, how many must agree, and what a timeout does.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApprovalPolicySpec {
    /// Who may decide; none listed: anyone RBAC lets write decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvers: Option<ApproversSpec>,
    /// Different people who must approve (default 1); one denial denies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub quorum: Option<u32>,
    /// How long the call waits for the quorum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 31_536_000))]
    pub timeout_seconds: Option<u64>,
    /// What the timeout does: `deny` (default; the model is told),
    /// `approve` (the call runs) or `fail` (the session fails).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeoutMode>,
    /// Approvers may replace the call's arguments.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_edit: bool,
}

/// Named approvers: a decision counts when its author is one of them.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproversSpec {
    /// User names, as the API server authenticates them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 253)))]
    pub users: Vec<String>,
    /// Groups whose members may decide.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 253)))]
    pub groups: Vec<String>,
    /// Service accounts: `name` (the session's namespace) or `namespace/name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 317)))]
    pub service_accounts: Vec<String>,
}

#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
#[serde(rename_all = "camelCase")]
pub enum OnTimeoutMode {
    #[default]
    Deny,
    Approve,
    Fail,
}

/// Declares a struct whose fields end with the decorators: the one list
/// of them, for `DecoratorsSpec` and for a rule, which writes them beside
/// its other fields.
macro_rules! with_decorators {
    ($(#[$meta:meta])* pub struct $name:ident { $($fields:tt)* }) => {
        $(#[$meta])*
        pub struct $name {
            $($fields)*
            /// `true`: wait for one approve/deny decision before running. An
            /// object: who may decide, how many must agree, and what a timeout
            /// does.
            #[serde(default, skip_serializing_if = "ApprovalSetting::is_off")]
            #[schemars(schema_with = "approval_schema")]
            pub approval: ApprovalSetting,
            /// Give up after this many seconds (run time, or wait when deferred).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(range(min = 1, max = 31_536_000))]
            pub timeout_seconds: Option<u64>,
            /// Extra attempts after a failure, with exponential backoff from 1 s.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(range(max = 20))]
            pub retries: Option<u32>,
            /// Reuse a result for the same tool and arguments (never when the
            /// context holds secrets).
            #[serde(default, skip_serializing_if = "std::ops::Not::not")]
            pub cache: bool,
            /// Cap results at this many bytes.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(range(min = 1, max = 16_777_216))]
            pub truncate_bytes: Option<u64>,
        }
    };
}

with_decorators! {
    /// Wrappers around a disposition.
    #[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
    #[serde(rename_all = "camelCase")]
    pub struct DecoratorsSpec {}
}

// The decorators, written beside the rule's other fields. Not
// `#[serde(flatten)]`: a flattened struct swallows unknown keys unseen, so
// `aproval: true` would run a call without approval.
with_decorators! {
    /// One policy rule. The first rule whose `tool` glob matches decides.
    #[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
    #[serde(rename_all = "camelCase")]
    pub struct RuleSpec {
        /// Glob over tool names: `*`, `?`, `[abc]`.
        pub tool: String,
        /// How matching calls run.
        pub disposition: DispositionMode,
        /// Why calls wait (for `defer`), shown to whoever completes them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub reason: Option<String>,
        /// Where `runIsolated` calls run; container tools bring their own.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub isolation: Option<ContainerTool>,
    }
}

impl RuleSpec {
    /// The rule's decorators.
    pub fn decorators(&self) -> DecoratorsSpec {
        DecoratorsSpec {
            approval: self.approval.clone(),
            timeout_seconds: self.timeout_seconds,
            retries: self.retries,
            cache: self.cache,
            truncate_bytes: self.truncate_bytes,
        }
    }
}

/// The tool-call policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicySpec {
    /// Disposition of calls no rule matches.
    #[serde(default)]
    pub default: DispositionMode,
    /// Decorators of calls no rule matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_decorators: Option<DecoratorsSpec>,
    /// Rules, first match wins.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<RuleSpec>,
}
