//! Standalone mode: `agents run` and `agents session ...` on the embedded
//! store, with the process runner for isolated calls.
//!
//! | module | holds |
//! |---|---|
//! | [`definition`] | YAML (`Session` + `Agent`) to a runnable agent, with strict field checks |
//! | [`driver`] | the loop around the core: actions performed, events fed back, checkpoints |
//! | [`progress`] | what a run prints (text or JSON lines) |
//! | [`commands`] | the CLI's entry points: run, resume, pause, complete, approve, run-isolated, ... |
//! | [`any_store`] | the store a command works on: embedded, or the cluster's (`--store kube`) |

pub mod any_store;
pub mod commands;
pub mod definition;
pub mod driver;
pub mod progress;

pub use driver::{drive, DriveOptions, Outcome};
