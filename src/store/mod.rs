//! The store adapters: where sessions and continuations live. Two adapters
//! implement the ports (`crate::ports`: the engine's session, continuation
//! and cache ports, and the CLI's admin port): `sqlite` (embedded, the
//! default for `agents run`) and `kube` (custom resources through the API
//! server). Both behave alike:
//!
//! - every session write is a compare-and-swap on an opaque [`Version`]
//!   (a `resourceVersion` in a cluster), so two writers never lose an update;
//! - a continuation is found by its token alone, without knowing its session
//!   (the token is the `Continuation` object name);
//! - a continuation's result and decision are written once; a second write of
//!   the same value is harmless, a different one is refused
//!   (the CEL transition rule in a cluster, a guarded `UPDATE` here).

pub mod kube;
pub mod kube_admin;
pub mod ports;
pub mod spill;
pub mod sqlite;

pub use crate::ports::records::*;
