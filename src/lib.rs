//! agents: durable AI-agent sessions on Kubernetes.
//!
//! The layers, top to bottom; an import only points down
//! (`tests/layers.rs` checks it):
//!
//! | layer | modules |
//! |---|---|
//! | surface | [`cli`] |
//! | drivers (never each other) | [`operator`] (with [`lease`], [`observe`]), [`standalone`] |
//! | one step, one agent | [`engine`], [`agent`] |
//! | adapters (implement ports) | [`store`], [`runner`], [`model`], [`tools`] (both over [`http`]), [`telemetry`], [`host`] (this process, from the OS) |
//! | ports | [`ports`]: traits and the records they carry |
//! | types | [`api`] (CRDs and their mapping to the core) |
//! | pure | [`core`] |
pub mod agent;
pub mod api;
pub mod cli;
pub mod core;
pub mod engine;
pub mod host;
pub mod http;
pub mod lease;
pub mod model;
pub mod observe;
pub mod operator;
pub mod ports;
pub mod runner;
pub mod standalone;
pub mod store;
pub mod telemetry;
pub mod tools;
