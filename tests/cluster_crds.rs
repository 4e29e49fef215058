//! The CRDs on a real API server: the quickstart Session is accepted, the
//! CEL rules refuse bad specs with their messages, and a Continuation's
//! result is written once (a second, different result is refused by the
//! API server; another field manager's status writes leave it alone).
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

mod support;

use agents::api::continuation::ContinuationState;
use agents::api::convert;
use agents::api::{Continuation, ContinuationStatus, Session};
use agents::core::session::ContinuationSpec as CoreContinuationSpec;
use agents::core::*;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use support::TestNamespace;

fn quickstart() -> Session {
    serde_norway::from_str(include_str!("../examples/quickstart.yaml")).unwrap()
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
    ns.delete(&client).await;
}

fn continuation(token: &ContinuationToken) -> Continuation {
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
            ..Default::default()
        },
        waiting_for: WaitingFor::External,
        reason: Some("a person sends emails".into()),
        context: agents::core::envelope::ContextSnapshot {
            session,
            turn: 1,
            call_id: call,
            agent: None,
            idempotency_key: "quickstart/t1-c1".into(),
            params: Default::default(),
        },
        cache_key: None,
        expires_at: None,
    };
    Continuation::new(token.as_str(), convert::continuation_spec(&core))
}

fn result_patch(result: &ToolResult, by: &str) -> serde_json::Value {
    json!({"status": {
        "state": "Completed",
        "result": convert::result_value(result),
        "completedBy": by,
    }})
}

#[tokio::test]
async fn a_continuation_result_is_written_once() {
    let Some(client) = support::cluster().await else {
        return;
    };
    support::install_crds(&client).await;
    let ns = TestNamespace::create(&client, "crd-cont").await;
    let api: Api<Continuation> = Api::namespaced(client.clone(), &ns.name);
    let token = ContinuationToken::for_call(&SessionId("quickstart".into()), CallId::new(1, 1));
    api.create(&PostParams::default(), &continuation(&token))
        .await
        .unwrap();

    let sent = ToolResult::ok(ToolResponse::Json {
        content: json!({"delivered": true, "ids": [1, 2]}),
    });
    let pp = PatchParams::default();
    api.patch_status(
        token.as_str(),
        &pp,
        &Patch::Merge(&result_patch(&sent, "alice")),
    )
    .await
    .unwrap();
    // The same result again is harmless.
    api.patch_status(
        token.as_str(),
        &pp,
        &Patch::Merge(&result_patch(&sent, "alice")),
    )
    .await
    .unwrap();
    // A different one is refused, with a message that says why.
    let other = ToolResult::text("not sent");
    let msg = refusal(
        api.patch_status(
            token.as_str(),
            &pp,
            &Patch::Merge(&result_patch(&other, "bob")),
        )
        .await
        .unwrap_err(),
    );
    assert!(msg.contains("already completed"), "{msg}");

    // Another writer's status fields (server-side apply, own field manager)
    // do not clobber the result.
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
    assert_eq!(stored.completed_by.as_deref(), Some("alice"));
    assert_eq!(
        convert::tool_result(stored.result.as_ref().unwrap(), "status.result").unwrap(),
        sent
    );
    // The stored spec maps back to the core's continuation.
    let back = api.get(token.as_str()).await.unwrap();
    let core = convert::core_continuation_spec(&token, &back.spec).unwrap();
    assert_eq!(core.waiting_for, WaitingFor::External);
    ns.delete(&client).await;
}
