//! The CRDs on a real API server: the quickstart Session is accepted, the
//! CEL rules refuse bad specs with their messages, `spec.messages` is
//! append-only element by element, a Continuation's spec never changes and
//! its outcome and decision are each written once, a success result waits
//! for approval, typos are refused by `kubectl apply`, the `agents-exe`
//! category lists the three kinds while `kubectl get agents` lists Agents,
//! an Agent reports conditions in its status, and a Session's
//! `status.state` is stored exactly as written.
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use agents::api::continuation::{ContinuationState, DecisionStatus, OutcomeStatus};
use agents::api::convert;
use agents::api::{Agent, Continuation, ContinuationStatus, Session};
use agents::core::session::ContinuationSpec as CoreContinuationSpec;
use agents::core::*;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use support::scratch::Scratch;
use support::TestNamespace;

fn quickstart() -> Session {
    serde_norway::from_str(include_str!("../../examples/quickstart.yaml")).unwrap()
}

fn refusal(e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message,
        other => panic!("expected the API server to refuse, got {other}"),
    }
}

#[tokio::test]
async fn sessions_are_validated_by_the_api_server() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-session").await;
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);

    let created = api
        .create(&PostParams::default(), &quickstart())
        .await
        .unwrap();
    assert_eq!(
        created.spec,
        quickstart().spec,
        "the quickstart is stored as written"
    );

    // A name too long to label the session's children is refused at once.
    let mut long = quickstart();
    long.metadata.name = Some("s".repeat(70));
    let msg = refusal(api.create(&PostParams::default(), &long).await.unwrap_err());
    assert!(msg.contains("at most 63 characters"), "{msg}");
    let mut longest = quickstart();
    longest.metadata.name = Some("s".repeat(63));
    api.create(&PostParams::default(), &longest).await.unwrap();

    let mut both = quickstart();
    both.metadata.name = Some("both".into());
    both.spec.agent_ref = Some(agents::api::session::AgentRef { name: "x".into() });
    let msg = refusal(api.create(&PostParams::default(), &both).await.unwrap_err());
    assert!(msg.contains("set exactly one of spec.agentRef"), "{msg}");

    let mut wrong_model = quickstart();
    wrong_model.metadata.name = Some("wrong-model".into());
    wrong_model.spec.agent.as_mut().unwrap().model.provider =
        agents::api::agent::ModelProvider::Openai;
    let msg = refusal(
        api.create(&PostParams::default(), &wrong_model)
            .await
            .unwrap_err(),
    );
    assert!(
        msg.contains("set the section matching spec.model.provider"),
        "{msg}"
    );

    // Appending continues the conversation; removing a message is refused.
    let append = json!({"spec": {"messages": ["Check the weather, tell ops, and report disk usage.", "And the time?"]}});
    api.patch(
        "quickstart",
        &PatchParams::default(),
        &Patch::Merge(&append),
    )
    .await
    .unwrap();
    let shrink = json!({"spec": {"messages": ["only one"]}});
    let msg = refusal(
        api.patch(
            "quickstart",
            &PatchParams::default(),
            &Patch::Merge(&shrink),
        )
        .await
        .unwrap_err(),
    );
    assert!(msg.contains("append-only"), "{msg}");
    // Same length, an earlier message changed: refused too.
    let edit =
        json!({"spec": {"messages": ["Check the weather and nothing else.", "And the time?"]}});
    let msg = refusal(
        api.patch("quickstart", &PatchParams::default(), &Patch::Merge(&edit))
            .await
            .unwrap_err(),
    );
    assert!(msg.contains("append-only"), "{msg}");
    let stored = api.get("quickstart").await.unwrap();
    assert_eq!(
        stored.spec.messages[0],
        "Check the weather, tell ops, and report disk usage."
    );

    // spec.retry only goes up.
    for (retry, ok) in [(1, true), (2, true), (1, false)] {
        let r = api
            .patch(
                "quickstart",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"retry": retry}})),
            )
            .await;
        match (r, ok) {
            (Ok(_), true) => {}
            (Err(e), false) => {
                let msg = refusal(e);
                assert!(msg.contains("spec.retry only goes up"), "{msg}");
            }
            (r, _) => panic!("retry {retry}: expected ok={ok}, got {:?}", r.map(|_| ())),
        }
    }
    ns.delete(&client).await;
}

/// A Session's `status.state` is kept exactly as written: the API server
/// neither prunes a field its CRD does not name (one a newer operator
/// writes while the installed CRD is older) nor fills in defaults.
#[tokio::test]
async fn a_session_s_state_is_stored_as_written() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-state").await;
    let api: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    api.create(&PostParams::default(), &quickstart())
        .await
        .unwrap();
    let state = json!({
        "phase": "AwaitingModel",
        "messagesTaken": 1,
        "turns": [{"role": "user", "message": "hi", "fromANewerOperator": {"kept": [1, 2]}}],
        "aFieldNoCrdNames": "kept too",
    });
    api.patch_status(
        "quickstart",
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"phase": "AwaitingModel", "state": state}})),
    )
    .await
    .unwrap();
    let stored = api.get_status("quickstart").await.unwrap();
    assert_eq!(stored.status.unwrap().state, Some(state));
    ns.delete(&client).await;
}

fn continuation(token: &ContinuationToken, approval: bool) -> Continuation {
    let session = SessionId("quickstart".into());
    let call = CallId::new(1, 1);
    let core = CoreContinuationSpec {
        token: token.clone(),
        session: session.clone(),
        call_id: call,
        tool_call: ToolCall {
            model_call_id: "m-2".into(),
            name: "send_email".into(),
            arguments: r#"{"to":"ops@example.org"}"#.into(),
        },
        policy: AppliedPolicy {
            disposition: Disposition::Defer {
                reason: "a person sends emails".into(),
            },
            decorators: agents::core::policy::Decorators {
                approval,
                ..Default::default()
            },
            ..Default::default()
        },
        waiting_for: if approval {
            WaitingFor::Approval
        } else {
            WaitingFor::External
        },
        reason: Some("a person sends emails".into()),
        context: agents::core::envelope::ContextSnapshot {
            session,
            turn: 1,
            call_id: call,
            agent: None,
            idempotency_key: "quickstart/t1-c1".into(),
            params: Default::default(),
            call_stack: Vec::new(),
        },
        cache_key: None,
        expires_at: None,
    };
    Continuation::new(token.as_str(), convert::continuation_spec(&core))
}

fn outcome_patch(result: &ToolResult, by: &str, at: &str) -> serde_json::Value {
    json!({"status": {
        "state": "Completed",
        "outcome": {
            "result": convert::result_value(result),
            "completedBy": by,
            "completedAt": at,
        },
    }})
}

fn decision_patch(approved: bool, by: &str) -> serde_json::Value {
    json!({"status": {"decision": {
        "approved": approved,
        "by": by,
        "decidedAt": "2025-01-01T00:00:00Z",
    }}})
}

const AT: &str = "2025-01-01T00:00:00Z";

#[tokio::test]
async fn a_continuation_outcome_is_written_once() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-cont").await;
    let api: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let token = ContinuationToken::for_call(&SessionId("quickstart".into()), CallId::new(1, 1));
    api.create(&PostParams::default(), &continuation(&token, false))
        .await
        .unwrap();
    let pp = PatchParams::default();

    // What the call waits for is status, written after creation.
    api.patch_status(
        token.as_str(),
        &pp,
        &Patch::Merge(
            &json!({"status": {"waitingFor": "external", "reason": "a person sends emails"}}),
        ),
    )
    .await
    .unwrap();

    // The spec never changes after creation.
    let msg = refusal(
        api.patch(
            token.as_str(),
            &pp,
            &Patch::Merge(
                &json!({"spec": {"toolCall": {"arguments": "{\"to\":\"ceo@example.org\"}"}}}),
            ),
        )
        .await
        .unwrap_err(),
    );
    assert!(msg.contains("cannot change after creation"), "{msg}");

    // Completed without an outcome (or the reverse) is refused.
    let msg = refusal(
        api.patch_status(
            token.as_str(),
            &pp,
            &Patch::Merge(&json!({"status": {"state": "Completed"}})),
        )
        .await
        .unwrap_err(),
    );
    assert!(msg.contains("write them together"), "{msg}");
    // A result that is not a tool result is refused.
    let msg = refusal(
        api.patch_status(
            token.as_str(),
            &pp,
            &Patch::Merge(&json!({"status": {"state": "Completed", "outcome": {
                "result": {"status": "error"}, "completedBy": "alice", "completedAt": AT}}})),
        )
        .await
        .unwrap_err(),
    );
    assert!(msg.contains("a result is {status: success"), "{msg}");

    let sent = ToolResult::ok(ToolResponse::Json {
        content: json!({"delivered": true, "ids": [1, 2]}),
    });
    api.patch_status(
        token.as_str(),
        &pp,
        &Patch::Merge(&outcome_patch(&sent, "alice", AT)),
    )
    .await
    .unwrap();
    // The same outcome again is harmless.
    api.patch_status(
        token.as_str(),
        &pp,
        &Patch::Merge(&outcome_patch(&sent, "alice", AT)),
    )
    .await
    .unwrap();
    // A different result, another completedBy, another time, or removing
    // the outcome: each refused, with a message that says why.
    let other = ToolResult::ok(ToolResponse::Json {
        content: json!({"delivered": true, "ids": [1, 3]}),
    });
    for patch in [
        outcome_patch(&other, "alice", AT),
        outcome_patch(&ToolResult::text("not sent"), "alice", AT),
        outcome_patch(&sent, "bob", AT),
        outcome_patch(&sent, "alice", "2025-01-01T00:00:01Z"),
        json!({"status": {"state": "Pending", "outcome": null}}),
    ] {
        let msg = refusal(
            api.patch_status(token.as_str(), &pp, &Patch::Merge(&patch))
                .await
                .unwrap_err(),
        );
        assert!(msg.contains("already completed"), "{patch}: {msg}");
    }

    // Another writer's status fields (server-side apply, own field manager)
    // do not clobber the outcome.
    let operator = json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Continuation",
        "status": {"attempts": 1, "state": "Completed"},
    });
    api.patch_status(
        token.as_str(),
        &PatchParams::apply("agents-operator").force(),
        &Patch::Apply(&operator),
    )
    .await
    .unwrap();
    let stored: ContinuationStatus = api
        .get_status(token.as_str())
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(stored.state, ContinuationState::Completed);
    assert_eq!(stored.attempts, 1);
    let OutcomeStatus {
        result,
        completed_by,
        ..
    } = stored.outcome.clone().unwrap();
    assert_eq!(completed_by, "alice");
    assert_eq!(
        convert::tool_result(&result, "status.outcome.result").unwrap(),
        sent
    );
    // The stored spec and status map back to the core's continuation.
    let back = api.get(token.as_str()).await.unwrap();
    let core = convert::core_continuation_spec(&token, &back.spec, back.status.as_ref()).unwrap();
    assert_eq!(core.waiting_for, WaitingFor::External);
    assert_eq!(core.reason.as_deref(), Some("a person sends emails"));
    ns.delete(&client).await;
}

#[tokio::test]
async fn a_success_result_waits_for_the_approval() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-approval").await;
    let api: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let pp = PatchParams::default();
    let sent = ToolResult::text("sent");
    let create = |name: &str| {
        let token = ContinuationToken(name.to_string());
        let api = api.clone();
        async move {
            api.create(&PostParams::default(), &continuation(&token, true))
                .await
                .unwrap();
            token
        }
    };

    // No decision yet: a success result is refused, an error (a timeout)
    // is accepted.
    let pending = create("pending").await;
    let msg = refusal(
        api.patch_status(
            pending.as_str(),
            &pp,
            &Patch::Merge(&outcome_patch(&sent, "alice", AT)),
        )
        .await
        .unwrap_err(),
    );
    assert!(
        msg.contains("needs an approval before a success result"),
        "{msg}"
    );
    let timeout = ToolResult::error("timed out after 5s waiting for an approval");
    api.patch_status(
        pending.as_str(),
        &pp,
        &Patch::Merge(&outcome_patch(&timeout, "agents", AT)),
    )
    .await
    .unwrap();

    // Denied: only the denial's error is accepted; the decision is final.
    let denied = create("denied").await;
    api.patch_status(
        denied.as_str(),
        &pp,
        &Patch::Merge(&decision_patch(false, "bob")),
    )
    .await
    .unwrap();
    let msg = refusal(
        api.patch_status(
            denied.as_str(),
            &pp,
            &Patch::Merge(&decision_patch(true, "bob")),
        )
        .await
        .unwrap_err(),
    );
    assert!(msg.contains("already decided"), "{msg}");
    let msg = refusal(
        api.patch_status(
            denied.as_str(),
            &pp,
            &Patch::Merge(&outcome_patch(&sent, "alice", AT)),
        )
        .await
        .unwrap_err(),
    );
    assert!(
        msg.contains("needs an approval before a success result"),
        "{msg}"
    );
    api.patch_status(
        denied.as_str(),
        &pp,
        &Patch::Merge(&outcome_patch(
            &ToolResult::error("denied by bob"),
            "bob",
            AT,
        )),
    )
    .await
    .unwrap();

    // Approved: the success result is accepted.
    let approved = create("approved").await;
    api.patch_status(
        approved.as_str(),
        &pp,
        &Patch::Merge(&decision_patch(true, "bob")),
    )
    .await
    .unwrap();
    api.patch_status(
        approved.as_str(),
        &pp,
        &Patch::Merge(&outcome_patch(&sent, "alice", AT)),
    )
    .await
    .unwrap();
    let stored = api
        .get_status(approved.as_str())
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(
        stored.decision,
        Some(DecisionStatus {
            approved: true,
            by: "bob".into(),
            reason: None,
            decided_at: serde_json::from_value(json!(AT)).unwrap(),
            arguments: None,
            raise: None,
        })
    );
    ns.delete(&client).await;
}

const AGENT: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: helper}
spec:
  model:
    provider: scripted
    scripted: {replies: [{text: hi}]}
"#;

#[tokio::test]
async fn kubectl_refuses_typos_and_lists_kinds_by_category() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-kubectl").await;
    // Its own discovery cache, so no stale category from an older CRD.
    let scratch = Scratch::new("crd");
    let cache = scratch.path("cache");
    let cache_dir = format!("--cache-dir={}", cache.display());
    let quickstart = include_str!("../../examples/quickstart.yaml");

    // A misspelt decorator on a rule: strict field validation (kubectl's
    // default) refuses it and names the field.
    for (typo, field) in [
        (
            "          timeoutSeconds: 60",
            "spec.agent.policy.rules[1].timeoutSecond",
        ),
        (
            "          reason: a person sends emails",
            "spec.agent.policy.rules[0].aproval",
        ),
    ] {
        let bad = match field.rsplit('.').next().unwrap() {
            "timeoutSecond" => quickstart.replace(typo, "          timeoutSecond: 60"),
            _ => quickstart.replace(typo, &format!("{typo}\n          aproval: true")),
        };
        assert_ne!(bad, quickstart);
        let file = scratch.write("typo.yaml", &bad);
        let out = support::kubectl([
            "apply",
            "-n",
            &ns.name,
            &cache_dir,
            "-f",
            file.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a typo was applied: {stderr}");
        assert!(
            stderr.contains("unknown field") && stderr.contains(field),
            "{stderr}"
        );
    }
    let sessions: Api<Session> = Api::namespaced(client.clone(), &ns.name);
    assert!(sessions.get_opt("quickstart").await.unwrap().is_none());

    // The valid Session and an Agent apply.
    let file = scratch.write("quickstart.yaml", quickstart);
    support::kubectl_ok([
        "apply",
        "-n",
        &ns.name,
        &cache_dir,
        "-f",
        file.to_str().unwrap(),
    ]);
    let file = scratch.write("agent.yaml", AGENT);
    support::kubectl_ok([
        "apply",
        "-n",
        &ns.name,
        &cache_dir,
        "-f",
        file.to_str().unwrap(),
    ]);
    let token = ContinuationToken::for_call(&SessionId("quickstart".into()), CallId::new(1, 1));
    Api::<Continuation>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &continuation(&token, false))
        .await
        .unwrap();

    // `kubectl get agents` lists Agents only; the category lists all three.
    let names = |what: &str| {
        let mut v: Vec<String> =
            support::kubectl_ok(["get", what, "-n", &ns.name, &cache_dir, "-o", "name"])
                .lines()
                .map(str::to_string)
                .collect();
        v.sort();
        v
    };
    assert_eq!(names("agents"), ["agent.agents-exe.io/helper"]);
    assert_eq!(
        names(agents::api::CATEGORY),
        [
            "agent.agents-exe.io/helper".to_string(),
            format!("continuation.agents-exe.io/{token}"),
            "session.agents-exe.io/quickstart".to_string(),
        ]
    );
    ns.delete(&client).await;
}

#[tokio::test]
async fn an_agent_reports_conditions_in_its_status() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-agent").await;
    let api: Api<Agent> = Api::namespaced(client.clone(), &ns.name);
    let agent: Agent = serde_norway::from_str(AGENT).unwrap();
    let created = api.create(&PostParams::default(), &agent).await.unwrap();
    let generation = created.metadata.generation.unwrap();
    let condition = |reason: &str, message: &str| {
        json!({"status": {
            "observedGeneration": generation,
            "conditions": [{
                "type": "Ready", "status": "False", "reason": reason,
                "message": message, "lastTransitionTime": AT,
                "observedGeneration": generation,
            }],
        }})
    };
    let pp = PatchParams::default();
    api.patch_status(
        "helper",
        &pp,
        &Patch::Merge(&condition(
            "InvalidAgent",
            "spec.policy.rules[0].tool: invalid glob",
        )),
    )
    .await
    .unwrap();
    let status = api.get_status("helper").await.unwrap().status.unwrap();
    assert_eq!(status.observed_generation, Some(generation));
    assert_eq!(status.conditions[0].reason, "InvalidAgent");
    // The status subresource: a spec write does not touch the status, and
    // a status write does not touch the spec.
    api.patch(
        "helper",
        &pp,
        &Patch::Merge(&json!({"spec": {"systemPrompt": "be brief"}, "status": {"conditions": []}})),
    )
    .await
    .unwrap();
    assert_eq!(
        api.get("helper")
            .await
            .unwrap()
            .status
            .unwrap()
            .conditions
            .len(),
        1
    );
    // Conditions follow metav1.Condition: a reason with spaces, an unknown
    // status or an overlong message is refused.
    for (patch, what) in [
        (condition("not camel case", "x"), "reason"),
        (condition("Ok", &"x".repeat(32769)), "message"),
        (
            json!({"status": {"conditions": [{"type": "Ready", "status": "Maybe", "reason": "Ok", "message": "", "lastTransitionTime": AT}]}}),
            "status",
        ),
    ] {
        let msg = refusal(
            api.patch_status("helper", &pp, &Patch::Merge(&patch))
                .await
                .unwrap_err(),
        );
        assert!(msg.contains(what), "{what}: {msg}");
    }
    ns.delete(&client).await;
}

/// Every way of writing a Continuation's status, with and without a
/// `resourceVersion`: none removes or changes a decision or an outcome
/// once written (a rule on `status` alone misses `{"status": null}`).
#[tokio::test]
async fn no_patch_shape_erases_a_decision_or_an_outcome() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-erase").await;
    let api: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let token = ContinuationToken::for_call(&SessionId("quickstart".into()), CallId::new(1, 1));
    api.create(&PostParams::default(), &continuation(&token, true))
        .await
        .unwrap();
    let pp = PatchParams::default();
    let name = token.as_str();
    api.patch_status(name, &pp, &Patch::Merge(&decision_patch(false, "ann")))
        .await
        .unwrap();
    let denial = ToolResult::error("denied by ann");
    api.patch_status(
        name,
        &pp,
        &Patch::Merge(&outcome_patch(&denial, "agents", AT)),
    )
    .await
    .unwrap();
    let written = api.get_status(name).await.unwrap().status.unwrap();

    let current = api.get_status(name).await.unwrap();
    let mut bare = current.clone();
    bare.status = Some(ContinuationStatus::default());
    let mut bare_unversioned = bare.clone();
    bare_unversioned.metadata.resource_version = None;
    let mut approved = current.clone();
    approved
        .status
        .as_mut()
        .unwrap()
        .decision
        .as_mut()
        .unwrap()
        .approved = true;
    approved.status.as_mut().unwrap().outcome = None;
    approved.status.as_mut().unwrap().state = ContinuationState::Pending;
    let rv = current.metadata.resource_version.clone().unwrap();
    let attempts: Vec<(&str, Patch<serde_json::Value>)> = vec![
        ("merge status null", Patch::Merge(json!({"status": null}))),
        (
            "merge status null at its version",
            Patch::Merge(json!({"metadata": {"resourceVersion": rv}, "status": null})),
        ),
        (
            "merge outcome and decision null",
            Patch::Merge(
                json!({"status": {"state": "Pending", "outcome": null, "decision": null}}),
            ),
        ),
        (
            "json patch remove status",
            Patch::Json(
                serde_json::from_value(json!([{"op": "remove", "path": "/status"}])).unwrap(),
            ),
        ),
        (
            "json patch remove outcome",
            Patch::Json(
                serde_json::from_value(json!([
                    {"op": "remove", "path": "/status/outcome"},
                    {"op": "replace", "path": "/status/state", "value": "Pending"}
                ]))
                .unwrap(),
            ),
        ),
        (
            "json patch replace decision",
            Patch::Json(
                serde_json::from_value(json!([
                    {"op": "replace", "path": "/status/decision/approved", "value": true}
                ]))
                .unwrap(),
            ),
        ),
    ];
    for (what, patch) in attempts {
        let outcome = api.patch_status(name, &pp, &patch).await;
        let now = api.get_status(name).await.unwrap().status.unwrap();
        assert_eq!(now.outcome, written.outcome, "{what}: {outcome:?}");
        assert_eq!(now.decision, written.decision, "{what}: {outcome:?}");
        assert!(outcome.is_err(), "{what} was accepted");
    }
    // Server-side apply by the writer that set them, with an empty status.
    let apply = json!({
        "apiVersion": "agents-exe.io/v1alpha1",
        "kind": "Continuation",
        "status": {"state": "Pending"},
    });
    let applied = api
        .patch_status(
            name,
            &PatchParams::apply("kubectl-edit").force(),
            &Patch::Apply(&apply),
        )
        .await;
    let now = api.get_status(name).await.unwrap().status.unwrap();
    assert_eq!(now.outcome, written.outcome, "apply: {applied:?}");
    assert_eq!(now.decision, written.decision, "apply: {applied:?}");
    // Replacing the status (PUT), with and without a resourceVersion.
    for (what, obj) in [
        ("replace with an empty status", &bare),
        ("replace unversioned", &bare_unversioned),
        ("replace with an approval", &approved),
    ] {
        let replaced = api.replace_status(name, &PostParams::default(), obj).await;
        let now = api.get_status(name).await.unwrap().status.unwrap();
        assert_eq!(now.outcome, written.outcome, "{what}: {replaced:?}");
        assert_eq!(now.decision, written.decision, "{what}: {replaced:?}");
        assert!(replaced.is_err(), "{what} was accepted");
    }
    ns.delete(&client).await;
}

/// A call the operator runs (here runAsync, behind an approval) takes no
/// result from outside, approved or not: only its run completes it.
#[tokio::test]
async fn an_outside_result_needs_a_deferred_call() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-outside").await;
    let api: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let token = ContinuationToken::for_call(&SessionId("quickstart".into()), CallId::new(1, 1));
    let mut runs = continuation(&token, true);
    runs.spec.policy.disposition = agents::api::agent::DispositionMode::RunAsync;
    runs.spec.policy.reason = None;
    api.create(&PostParams::default(), &runs).await.unwrap();
    let pp = PatchParams::default();
    let name = token.as_str();
    api.patch_status(name, &pp, &Patch::Merge(&decision_patch(true, "ann")))
        .await
        .unwrap();
    let made_up = ToolResult::text("sent (not really)");
    for by in ["mallory", "ann"] {
        let msg = refusal(
            api.patch_status(name, &pp, &Patch::Merge(&outcome_patch(&made_up, by, AT)))
                .await
                .unwrap_err(),
        );
        assert!(msg.contains("only its run completes it"), "{by}: {msg}");
    }
    // The operator's own record of the run is taken.
    let ran = ToolResult::text("sent");
    api.patch_status(name, &pp, &Patch::Merge(&outcome_patch(&ran, "agents", AT)))
        .await
        .unwrap();
    ns.delete(&client).await;
}
