use super::*;
use crate::core::policy::Decorators;

#[test]
fn continuation_spec_round_trips() {
    let spec = ContinuationSpec {
        token: ContinuationToken("s-t1-c0".into()),
        session: SessionId("s".into()),
        call_id: CallId::new(1, 0),
        tool_call: ToolCall {
            model_call_id: "m".into(),
            name: "bash".into(),
            arguments: "{}".into(),
        },
        policy: AppliedPolicy {
            disposition: Disposition::RunIsolated {
                spec: IsolationSpec {
                    image: "busybox:ci".into(),
                    ..Default::default()
                },
            },
            decorators: Decorators {
                retries: 2,
                cache: true,
                ..Default::default()
            },
            rule: Some(1),
        },
        waiting_for: WaitingFor::Isolated,
        reason: None,
        context: ContextSnapshot {
            session: SessionId("s".into()),
            turn: 1,
            call_id: CallId::new(1, 0),
            agent: Some("a".into()),
            idempotency_key: "s/t1-c0".into(),
            params: [("region".to_string(), "eu".to_string())].into(),
            call_stack: Vec::new(),
        },
        cache_key: Some(CacheKey {
            tool: "bash".into(),
            arguments_sha256: "ab".repeat(32),
        }),
        expires_at: Some(Millis(1_700_000_000_000)),
    };
    let api = continuation_spec(&spec);
    let mut status = ContinuationStatus::default();
    set_continuation_wait(&mut status, &spec);
    let json = serde_json::to_string(&(api, status)).unwrap();
    let (back, status): (ContinuationSpecApi, ContinuationStatus) =
        serde_json::from_str(&json).unwrap();
    assert_eq!(
        core_continuation_spec(&spec.token, &back, Some(&status)).unwrap(),
        spec
    );
    // Without a status yet, the wait follows from the spec.
    let derived = core_continuation_spec(&spec.token, &back, None).unwrap();
    assert_eq!(derived.waiting_for, WaitingFor::Isolated);
    let mut approval = back.clone();
    approval.policy.decorators.approval = true;
    let derived = core_continuation_spec(&spec.token, &approval, None).unwrap();
    assert_eq!(derived.waiting_for, WaitingFor::Approval);
}
