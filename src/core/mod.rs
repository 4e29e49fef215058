//! The pure session core: no I/O, no clock, no async.
//!
//! # Where things are
//!
//! | module | holds |
//! |---|---|
//! | [`ids`] | session names, call ids (`t<turn>-c<index>`), continuation tokens |
//! | [`time`] | [`time::Millis`]: time is always a parameter |
//! | [`conversation`] | turns, tool calls as the model issued them, tool responses and results |
//! | [`call`] | the tracked tool call and its state machine (`Ready -> Running \| Deferred \| Completed`, ...) |
//! | [`policy`] | dispositions, decorators, glob rules, `classify` |
//! | [`session`] | the session state machine and scheduler: `handle(event, now)`, `poll_action()`, `poll_timeout()` |
//! | [`acceptance`] | what a continuation accepts from outside: a result, a decision (written once) |
//! | [`cache`] | cache keys over canonical arguments |
//! | [`budget`] | what a model turn costs; limits on tokens, cost and tool calls |
//! | [`shared_budget`] | a namespace's Budgets: periods, the check before each model call |
//! | [`fork`] | a fork's state: a prefix of another session's conversation, open calls made new |
//! | [`envelope`] | the versioned call and result envelopes every runner speaks |
//!
//! # How a driver uses it
//!
//! Load a [`session::SessionState`], build a [`session::Session`] with
//! [`session::Session::restore`], then drain actions and feed back events
//! (see the [`session`] module doc). The operator and `agents run` are two
//! such drivers; tests are a third.

pub mod acceptance;
pub mod budget;
pub mod cache;
pub mod call;
pub mod conditions;
pub mod conversation;
pub mod envelope;
pub mod fork;
pub mod ids;
pub mod policy;
pub mod session;
pub mod shared_budget;
pub mod time;

pub use cache::{CacheKey, CacheScope};
pub use call::{Attempt, CallStage, CallState, Claim, TrackedToolCall, Wait, WaitingFor};
pub use conversation::{
    AgentTurn, TokenUsage, ToolCall, ToolResponse, ToolResult, ToolSchema, Turn, UserTurn,
};
pub use ids::{CallId, ContinuationToken, SessionId};
pub use policy::{AppliedPolicy, Decorators, Disposition, IsolationSpec, Policy, Rule};
pub use session::{
    Action, CoreError, DriverRole, Event, Handled, Limits, Outlook, Phase, Scope, Session,
    SessionConfig, SessionState, WakeOutcome,
};
pub use time::Millis;
