//! The tests that need no cluster, one binary (issue 28, item 7): the
//! standalone runner (`agents run`, SQLite, processes, containers, MCP,
//! the OpenAI-compatible client, tracing), the CLI surface, and the
//! engine's fence. Each module is one former `tests/*.rs` file.
//!
//! One module: `cargo test --test standalone_suite standalone_cli::`.

#[path = "../support/mod.rs"]
mod support;

mod cli_surface;
mod engine_fence;
mod standalone_anthropic;
mod standalone_bounded;
mod standalone_budget_ask;
mod standalone_budget_tree;
mod standalone_budgets;
mod standalone_claims;
mod standalone_cli;
mod standalone_container;
mod standalone_crash;
mod standalone_examples;
mod standalone_fork;
mod standalone_hardening;
mod standalone_mcp;
mod standalone_moves;
mod standalone_openai;
mod standalone_outcome;
mod standalone_policies;
mod standalone_replay;
mod standalone_subagents;
mod standalone_tracing;
