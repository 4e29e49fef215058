//! Tools whose outcome can be unknown (issue 34, item 1): a claimed run of
//! a tool that is not idempotent, whose holder is gone without a result,
//! is never started again on its own. `ask` waits for a person, `fail`
//! tells the model, `retry` sends it again under the same key.

use agents::core::call::WaitingFor;
use agents::core::session::{tool_rule, OnUnknownOutcome, ToolInfo};
use agents::core::*;
use std::collections::BTreeMap;

const T0: Millis = Millis(1_700_000_000_000);

/// `pay` is the tool under test, with `rule`; it runs per `disposition`.
fn config(holder: &str, rule: Option<OnUnknownOutcome>, disposition: Disposition) -> SessionConfig {
    let mut tools = BTreeMap::new();
    tools.insert(
        "pay".to_string(),
        ToolInfo {
            container: None,
            sub_agent: None,
            unknown_outcome: rule,
        },
    );
    let mut c = SessionConfig {
        tools,
        policy: Policy {
            default: disposition,
            ..Policy::default()
        },
        ..SessionConfig::default()
    };
    c.driver.holder = holder.into();
    c
}

fn drain(s: &mut Session) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

/// Driver `a` has started `pay`: its run is claimed and under way.
fn claimed_by_a(rule: Option<OnUnknownOutcome>, disposition: Disposition) -> (Session, String) {
    let mut s = Session::new(SessionId("demo".into()), config("a", rule, disposition));
    s.handle(Event::UserMessage { text: "pay".into() }, T0)
        .unwrap();
    drain(&mut s);
    let turn = AgentTurn {
        tool_calls: vec![ToolCall {
            model_call_id: "m-1".into(),
            name: "pay".into(),
            arguments: r#"{"eur":5}"#.into(),
        }],
        ..Default::default()
    };
    s.handle(Event::ModelReplied { turn }, T0).unwrap();
    let key = started_key(&drain(&mut s)).expect("a starts the run");
    (s, key)
}

/// The idempotency key of the run an action list starts, if any.
fn started_key(actions: &[Action]) -> Option<String> {
    actions.iter().find_map(|a| match a {
        Action::RunTool {
            idempotency_key, ..
        } => Some(idempotency_key.clone()),
        Action::RunInBackground { envelope, .. } | Action::LaunchIsolated { envelope, .. } => {
            Some(envelope.context.idempotency_key.clone())
        }
        _ => None,
    })
}

/// Driver `b` restores the session, knowing `a` is dead.
fn restored_by_b(a: &Session, rule: Option<OnUnknownOutcome>, d: Disposition) -> Session {
    let mut cfg = config("b", rule, d);
    cfg.driver.dead_holders.insert("a".into());
    Session::restore(a.state().clone(), cfg, T0.plus_secs(1))
}

fn pay(s: &Session) -> &TrackedToolCall {
    &s.state().open.as_ref().expect("the turn is open").calls[0]
}

fn isolated() -> Disposition {
    Disposition::RunIsolated {
        spec: IsolationSpec {
            image: "busybox".into(),
            ..Default::default()
        },
    }
}

#[test]
fn ask_waits_for_a_person_who_gives_the_real_result() {
    for d in [Disposition::RunSync, Disposition::RunAsync, isolated()] {
        let ask = Some(OnUnknownOutcome::Ask);
        let (a, _) = claimed_by_a(ask, d.clone());
        let mut b = restored_by_b(&a, ask, d.clone());
        let actions = drain(&mut b);
        assert_eq!(
            started_key(&actions),
            None,
            "{d:?}: never run again on its own"
        );
        let spec = actions
            .iter()
            .find_map(|x| match x {
                Action::EnsureContinuation(s) => Some(s.clone()),
                _ => None,
            })
            .expect("a continuation shows the attempt");
        assert_eq!(spec.waiting_for, WaitingFor::Outcome);
        assert_eq!(spec.tool_call.arguments, r#"{"eur":5}"#);
        let why = spec.reason.unwrap();
        assert!(
            why.contains("started at about 2023-11-14T22:13") && why.contains("by a"),
            "{why}"
        );
        assert_eq!(b.state().phase, Phase::Waiting);
        // It survives a round trip through the store's form.
        let stored: SessionState =
            serde_json::from_str(&serde_json::to_string(b.state()).unwrap()).unwrap();
        assert_eq!(&stored, b.state());
        // The person's answer reaches the model.
        let sent = ToolResult::text("paid once, receipt 17");
        let woke = b.handle(
            Event::Wake {
                token: spec.token.clone(),
                result: sent.clone(),
                by: "ann".into(),
            },
            T0.plus_secs(2),
        );
        assert_eq!(woke, Ok(Handled::Wake(WakeOutcome::Applied)));
        assert!(
            drain(&mut b).contains(&Action::CallModel { turn: 2 }),
            "{d:?}"
        );
    }
}

#[test]
fn run_again_sends_it_under_the_same_key_once() {
    for d in [Disposition::RunSync, Disposition::RunAsync, isolated()] {
        let ask = Some(OnUnknownOutcome::Ask);
        let (a, key) = claimed_by_a(ask, d.clone());
        let mut b = restored_by_b(&a, ask, d.clone());
        drain(&mut b);
        let token = pay(&b).token().cloned().unwrap();
        // An answer given before this attempt started (an approval, or a
        // "run again" to an earlier loss) is not taken as one to this loss.
        let early = Event::RunAgain {
            token: token.clone(),
            by: "ann".into(),
            decided_at: Millis(T0.0 - 1),
        };
        assert_eq!(
            b.handle(early, T0.plus_secs(2)),
            Ok(Handled::Wake(WakeOutcome::AlreadyCompleted))
        );
        assert_eq!(started_key(&drain(&mut b)), None);
        let again = Event::RunAgain {
            token,
            by: "ann".into(),
            decided_at: T0.plus_secs(2),
        };
        assert_eq!(
            b.handle(again, T0.plus_secs(2)),
            Ok(Handled::Wake(WakeOutcome::Applied))
        );
        assert_eq!(started_key(&drain(&mut b)), Some(key), "{d:?}");
        assert_eq!(pay(&b).claim().map(|c| c.holder.as_str()), Some("b"));
    }
}

#[test]
fn fail_tells_the_model_the_outcome_is_unknown() {
    for d in [Disposition::RunSync, Disposition::RunAsync, isolated()] {
        let fail = Some(OnUnknownOutcome::Fail);
        let (a, _) = claimed_by_a(fail, d.clone());
        let mut b = restored_by_b(&a, fail, d.clone());
        let actions = drain(&mut b);
        assert_eq!(started_key(&actions), None, "{d:?}");
        assert!(actions.contains(&Action::CallModel { turn: 2 }), "{d:?}");
        let Some(Turn::User(u)) = b.state().turns.last() else {
            panic!("the turn closed")
        };
        let ToolResult::Error { message } = &u.tool_results[0].result else {
            panic!("an error result")
        };
        assert!(
            message.contains("unknown") && message.contains("not run again"),
            "{message}"
        );
    }
}

#[test]
fn idempotent_tools_and_retry_are_sent_again_under_the_same_key() {
    for rule in [None, Some(OnUnknownOutcome::Retry)] {
        for d in [Disposition::RunSync, Disposition::RunAsync, isolated()] {
            let (a, key) = claimed_by_a(rule, d.clone());
            let mut b = restored_by_b(&a, rule, d.clone());
            assert_eq!(started_key(&drain(&mut b)), Some(key), "{rule:?} {d:?}");
        }
    }
}

#[test]
fn a_live_holder_keeps_its_run_and_its_own_restart_is_not_a_loss() {
    let ask = Some(OnUnknownOutcome::Ask);
    let (a, key) = claimed_by_a(ask, Disposition::RunSync);
    // b, with a alive and its claim valid: leaves the run alone.
    let mut b = Session::restore(
        a.state().clone(),
        config("b", ask, Disposition::RunSync),
        T0.plus_secs(1),
    );
    let actions = drain(&mut b);
    assert_eq!(started_key(&actions), None);
    assert!(!actions
        .iter()
        .any(|x| matches!(x, Action::EnsureContinuation(_))));
    assert_eq!(pay(&b).state(), CallState::Running);
    // a itself, re-planning its own live claim, carries on as before.
    let mut again = Session::restore(
        a.state().clone(),
        config("a", ask, Disposition::RunSync),
        T0.plus_secs(1),
    );
    assert_eq!(started_key(&drain(&mut again)), Some(key));
}

#[test]
fn the_agents_setting_overrides_the_servers_hint() {
    use OnUnknownOutcome::*;
    assert_eq!(tool_rule(None, None, None), None, "unset: idempotent");
    assert_eq!(
        tool_rule(Some(false), None, None),
        Some(Ask),
        "ask by default"
    );
    assert_eq!(tool_rule(Some(false), None, Some(Fail)), Some(Fail));
    assert_eq!(tool_rule(None, Some(false), Some(Retry)), Some(Retry));
    assert_eq!(tool_rule(Some(true), Some(false), Some(Fail)), None);
    assert_eq!(tool_rule(Some(false), Some(true), None), Some(Ask));
    assert_eq!(tool_rule(None, Some(true), None), None);
}
