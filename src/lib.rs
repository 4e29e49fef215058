//! agents: durable AI-agent sessions on Kubernetes.
pub mod api;
pub mod cli;
pub mod core;
pub mod engine;
pub mod lease;
pub mod model;
pub mod observe;
pub mod operator;
pub mod runner;
pub mod standalone;
pub mod store;
pub mod tools;
