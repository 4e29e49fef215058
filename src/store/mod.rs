//! The store port: where sessions and continuations live.
//!
//! Two adapters sit behind [`Store`]: `sqlite` (embedded, the default for
//! `agents run`) and, with the operator work, `kube` (custom resources through
//! the API server). The trait is shaped for the second so both behave alike:
//!
//! - every session write is a compare-and-swap on an opaque [`Version`]
//!   (a `resourceVersion` in a cluster), so two writers never lose an update;
//! - a continuation is found by its token alone, without knowing its session
//!   (the token is the `Continuation` object name);
//! - a continuation's result and decision are written once; a second write of
//!   the same value is harmless, a different one is refused
//!   (the CEL transition rule in a cluster, a guarded `UPDATE` here).

pub mod kube;
pub mod ports;
pub mod spill;
pub mod sqlite;

use crate::core::session::ContinuationSpec;
use crate::core::{CacheKey, Millis};
use crate::core::{ContinuationToken, SessionId, ToolResult};
pub use crate::ports::records::*;

/// The store port. Async because the `kube` adapter talks to the API
/// server; the embedded adapter answers at once.
// Drivers await these on one task, so the futures need no `Send` bound yet.
#[allow(async_fn_in_trait)]
pub trait Store {
    /// Creates a session; refuses when the id is taken.
    async fn create_session(&self, record: SessionRecord) -> StoreResult<Version>;

    async fn load_session(&self, id: &SessionId) -> StoreResult<Option<Versioned<SessionRecord>>>;

    /// Replaces the session if it is still at `expected`; returns the new
    /// version, or [`StoreError::Conflict`].
    async fn save_session(
        &self,
        record: &SessionRecord,
        expected: &Version,
    ) -> StoreResult<Version>;

    async fn list_sessions(&self) -> StoreResult<Vec<SessionSummary>>;

    /// Creates the continuation, or adopts the existing one (same token);
    /// an open one takes the spec's new `waiting_for` (an approved call
    /// moves from waiting for approval to waiting for its runner).
    async fn ensure_continuation(
        &self,
        spec: &ContinuationSpec,
        now: Millis,
    ) -> StoreResult<ContinuationRecord>;

    async fn get_continuation(
        &self,
        token: &ContinuationToken,
    ) -> StoreResult<Option<ContinuationRecord>>;

    /// Every continuation of a session, in call order.
    async fn session_continuations(&self, id: &SessionId) -> StoreResult<Vec<ContinuationRecord>>;

    /// Writes the result once ([`WriteOnce`]); unknown tokens are an error.
    async fn complete_continuation(
        &self,
        token: &ContinuationToken,
        result: &ToolResult,
        by: &str,
        now: Millis,
    ) -> StoreResult<WriteOnce>;

    /// Writes an approve/deny decision once.
    async fn decide_continuation(
        &self,
        token: &ContinuationToken,
        decision: &Decision,
    ) -> StoreResult<WriteOnce>;

    async fn cache_get(&self, key: &CacheKey) -> StoreResult<Option<ToolResult>>;

    async fn cache_put(&self, key: &CacheKey, result: &ToolResult, now: Millis) -> StoreResult<()>;
}
