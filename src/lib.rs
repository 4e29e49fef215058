//! agents: durable AI-agent sessions on Kubernetes.
pub mod core;
