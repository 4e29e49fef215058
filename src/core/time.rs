//! Time is an input: the core never reads a clock. Drivers pass `now`
//! with every event, and the core answers with when it next needs waking.

use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Millis(pub i64);

impl Millis {
    pub fn plus_secs(self, secs: u64) -> Millis {
        Millis(self.0.saturating_add((secs as i64).saturating_mul(1000)))
    }
    pub fn plus_millis(self, ms: u64) -> Millis {
        Millis(self.0.saturating_add(ms as i64))
    }
}
