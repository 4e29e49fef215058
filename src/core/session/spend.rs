//! The session's budget checks: what happens when work would start past
//! a limit (`spec.limits.tokens`, `cost`, `toolCalls` with `onExceed`),
//! and the question to a person that `onExceed: ask` makes of it.

use super::{Action, ContinuationSpec, Session, WakeOutcome};
use crate::core::budget::{Budget, BudgetStop, OnExceed, Raise, Spend};
use crate::core::conversation::ToolCall;
use crate::core::envelope::{idempotency_key, ContextSnapshot};
use crate::core::ids::{CallId, ContinuationToken};
use crate::core::policy::{AppliedPolicy, Decorators, Disposition};
use crate::core::time::Millis;
use crate::core::{ToolResult, WaitingFor};
use serde::{Deserialize, Serialize};

/// The name a budget question's continuation shows as its tool.
pub const BUDGET_TOOL: &str = "budget";

/// The call index a budget question's continuation names (it is no call
/// of the turn: its token, `<session>-budget-<n>`, is what counts).
const BUDGET_CALL_INDEX: u32 = 999_999;

/// A question to a person about a limit (`onExceed: ask`): the
/// continuation `token` waits for their decision on `stop`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetAsk {
    /// The continuation that waits for the decision.
    pub token: ContinuationToken,
    /// The limit reached, the spend and the limit.
    pub stop: BudgetStop,
}

impl Session {
    /// What the session has spent so far.
    pub(super) fn spend(&self) -> Spend {
        Spend {
            usage: self.state.usage,
            tool_calls: self.state.tool_calls,
        }
    }

    /// The limits in force: `spec.limits` with what people raised.
    pub(super) fn budget(&self) -> Budget {
        self.config.budget.raised(&self.state.budget_raise)
    }

    /// What is left of the limits in force: a child started now spends
    /// at most this.
    pub(super) fn budget_left(&self) -> Option<crate::core::budget::BudgetLeft> {
        self.budget().left(&self.spend())
    }

    /// A child about to be started is bounded by what is left.
    pub(super) fn bound_child(&self, action: &mut Action) {
        if let Action::StartSubAgent { child, .. } = action {
            child.budget = self.budget_left();
        }
    }

    /// The namespace Budgets that select the session: true when none is
    /// spent. A spent one is recorded (`budget_exhausted`, stored at once)
    /// and lifted when the driver sees it raised or started over.
    pub(super) fn shared_budgets_checked(&mut self) -> bool {
        let own = self.state.usage.less(&self.state.children_usage);
        let own = crate::core::shared_budget::OwnSpend {
            tokens: own.total(),
            cost_micros: own.cost_micros,
        };
        let spent = crate::core::shared_budget::first_spent(&self.config.shared_budgets, own);
        if self.state.budget_exhausted != spent {
            self.state.budget_exhausted = spent;
            self.push(Action::Checkpoint);
        }
        self.state.budget_exhausted.is_none()
    }

    /// Applies the outcome of a budget check; true when the work may start.
    /// A stop fails the session, holds it (`budget_stop`, stored at once)
    /// or asks a person (`budget_ask`); a check that passes with
    /// `starting` work lifts a hold (the limit was raised).
    pub(super) fn budget_checked(&mut self, stop: Option<BudgetStop>, starting: bool) -> bool {
        let Some(stop) = stop else {
            if starting && self.state.budget_stop.take().is_some() {
                self.push(Action::Checkpoint);
            }
            return true;
        };
        match self.config.budget.on_exceed {
            OnExceed::Fail => self.fail(stop.message),
            OnExceed::Pause => {
                if self.state.budget_stop.as_ref() != Some(&stop) {
                    self.state.budget_stop = Some(stop);
                    self.push(Action::Checkpoint);
                }
            }
            OnExceed::Ask => self.ask_about(stop),
        }
        false
    }

    /// Asks a person about `stop`, once: while a question is open, a
    /// later check waits for its answer instead of asking again.
    fn ask_about(&mut self, stop: BudgetStop) {
        if self.state.budget_ask.is_some() {
            return;
        }
        let n = self.state.budget_asks;
        let token = ContinuationToken::for_budget_ask(&self.state.id, n);
        self.state.budget_asks += 1;
        self.state.budget_ask = Some(BudgetAsk {
            token: token.clone(),
            stop: stop.clone(),
        });
        let spec = self.budget_question(token, &stop);
        // The question is committed before its continuation is made, so
        // a crash between the two makes it again under the same token.
        self.push(Action::Checkpoint);
        self.push(Action::EnsureContinuation(spec));
    }

    /// The open question's continuation (made again, or adopted, at each
    /// plan: a crash may have come between the question and its object).
    pub(super) fn ensure_budget_question(&mut self) {
        if let Some(ask) = self.state.budget_ask.clone() {
            let spec = self.budget_question(ask.token, &ask.stop);
            self.push(Action::EnsureContinuation(spec));
        }
    }

    /// The continuation of a question about `stop`: shown as a call of
    /// the tool `budget`, whose arguments are the limit and the spend,
    /// deferred for a person's decision.
    fn budget_question(&self, token: ContinuationToken, stop: &BudgetStop) -> ContinuationSpec {
        let turn = self.state.agent_turns;
        let call_id = CallId::new(turn, BUDGET_CALL_INDEX);
        let arguments = serde_json::json!({
            "limit": stop.limit,
            "used": stop.used,
            "allowed": stop.allowed,
            "spend": crate::core::budget::spend_text(&self.spend(), self.config.budget.currency.as_deref()),
        });
        let decorators = Decorators {
            approval: true,
            ..Decorators::default()
        };
        ContinuationSpec {
            session: self.state.id.clone(),
            call_id,
            tool_call: ToolCall {
                model_call_id: token.0.clone(),
                name: BUDGET_TOOL.into(),
                arguments: arguments.to_string(),
            },
            policy: AppliedPolicy {
                disposition: Disposition::Defer {
                    reason: stop.message.clone(),
                },
                decorators,
                rule: None,
            },
            waiting_for: WaitingFor::Budget,
            reason: Some(stop.message.clone()),
            context: ContextSnapshot {
                session: self.state.id.clone(),
                turn,
                call_id,
                agent: self.config.agent.clone(),
                idempotency_key: idempotency_key(&self.state.id, &self.config.scope, &token),
                params: Default::default(),
                call_stack: Vec::new(),
            },
            cache_key: None,
            token,
            expires_at: None,
        }
    }

    /// A person answered the open question: approved, the raise is kept
    /// and the session goes on (a raise that does not lift the limit asks
    /// again); denied, the session fails, saying who and why. Either way
    /// the continuation gets its result, so it no longer shows as open.
    pub(super) fn on_budget_decided(
        &mut self,
        token: &ContinuationToken,
        (approved, by, reason): (bool, String, Option<String>),
        raise: Raise,
        now: Millis,
    ) -> WakeOutcome {
        let open = self.state.budget_ask.as_ref().map(|a| &a.token);
        if open != Some(token) {
            return WakeOutcome::Unknown;
        }
        let ask = self.state.budget_ask.take().expect("the open question");
        let result = if approved {
            self.state.budget_raise = self.state.budget_raise.merged(raise);
            ToolResult::text(format!("approved by {by}: raise {}", raise_text(&raise)))
        } else {
            let why = reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            self.fail(format!(
                "{by} denied going past the limit{why} ({})",
                ask.stop.message
            ));
            ToolResult::error(format!("denied by {by}{why}"))
        };
        self.push(Action::Checkpoint);
        self.push(Action::RecordResult {
            token: token.clone(),
            result,
            by: crate::core::acceptance::ENGINE_BY.into(),
        });
        if approved {
            self.replan(now);
        }
        WakeOutcome::Applied
    }
}

fn raise_text(raise: &Raise) -> String {
    match raise.text() {
        t if t.is_empty() => "nothing".into(),
        t => t,
    }
}
