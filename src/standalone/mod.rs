//! Standalone mode: `agents run` and `agents session ...` on the embedded
//! store, with the process runner for isolated calls.
//!
//! | module | holds |
//! |---|---|
//! | [`definition`] | YAML (`Session` + `Agent`) to an agent definition, with strict field checks; secrets from the environment |
//! | [`yaml_depth`] | the nesting bound a definition file is checked against before it is parsed |
//! | [`children`] | sub-agent calls as child sessions in the same store, driven in the same process; the tree's waits and shape |
//! | [`fork`] | `agents session fork`: a new session from a prefix of another's, checked before anything is written |
//! | [`driver`] | the loop around the core: actions performed, events fed back, checkpoints |
//! | [`progress`] | the engine's events rendered for a terminal (text or JSON lines) |
//! | [`out`] | stdout that a closed pipe never stops |
//! | [`patience`] | a person's write from the CLI tried again while the cluster is away for a moment |
//! | [`commands`] | the CLI's entry points: run, resume, pause, complete, approve, run-isolated, ... |
//! | [`export`], [`import`] | a session carried between stores: the versioned export format, and its import into either store |
//! | [`replay`] | a recorded session run again through an agent, tools served their recorded results |
//! | [`budget_ask`] | what an approval of a session's question about its budget must carry (`--raise`) |
//! | [`any_store`] | the store a command works on: embedded, or the cluster's (`--store kube`) |

pub mod any_store;
pub mod budget_ask;
pub mod children;
pub mod commands;
pub mod definition;
pub mod driver;
pub mod export;
pub mod fork;
pub mod import;
pub mod out;
pub mod patience;
pub mod progress;
pub mod replay;
pub mod yaml_depth;

pub use driver::{drive, DriveOptions, Outcome};
