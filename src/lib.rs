//! agents: durable AI-agent sessions on Kubernetes.
pub mod api;
pub mod cli;
pub mod core;
