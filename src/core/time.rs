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
    /// Rounds up to a whole second. Scheduled times are kept this way
    /// because Kubernetes timestamps carry seconds only, so a status round
    /// trip loses nothing (a timer fires at most a second late).
    pub fn ceil_to_second(self) -> Millis {
        Millis(self.0.div_euclid(1000) * 1000 + if self.0.rem_euclid(1000) > 0 { 1000 } else { 0 })
    }
}
