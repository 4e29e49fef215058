//! The pure core's tests, one binary (issue 28, item 7): the session state
//! machine case by case, and its properties (proptest; the regressions file
//! sits beside the module). Each module is one former `tests/core_*.rs`, but
//! `core_budget_session`: the setup the two budget modules share.

mod core_budget_ask;
mod core_budget_session;
mod core_budgets;
mod core_outcome;
mod core_properties;
mod core_session;
mod core_subagents;
mod core_times;
