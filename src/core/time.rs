//! Time is an input: the core never reads a clock. Drivers pass `now`
//! with every event, and the core answers with when it next needs waking.

use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(transparent)]
pub struct Millis(pub i64);

impl Millis {
    pub fn plus_secs(self, secs: u64) -> Millis {
        // `as i64` would wrap a huge u64 negative: a timeout of 2^63 s
        // would then lie in 1970 and fire at once.
        let secs = i64::try_from(secs).unwrap_or(i64::MAX);
        Millis(self.0.saturating_add(secs.saturating_mul(1000)))
    }
    pub fn plus_millis(self, ms: u64) -> Millis {
        Millis(self.0.saturating_add(i64::try_from(ms).unwrap_or(i64::MAX)))
    }
    /// Rounds up to a whole second. Scheduled times are kept this way
    /// because Kubernetes timestamps carry seconds only, so a status round
    /// trip loses nothing (a timer fires at most a second late).
    pub fn ceil_to_second(self) -> Millis {
        Millis(self.0.div_euclid(1000) * 1000 + if self.0.rem_euclid(1000) > 0 { 1000 } else { 0 })
    }

    /// `YYYY-MM-DDTHH:MM:SSZ`, for messages people and models read.
    pub fn utc(self) -> String {
        let secs = self.0.div_euclid(1000);
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        // Civil from days (Howard Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        let y = yoe + era * 400 + i64::from(m <= 2);
        let (h, min, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
        format!("{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}Z")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_durations_saturate_in_the_future() {
        let t = Millis(1_700_000_000_000);
        assert_eq!(t.plus_secs(u64::MAX), Millis(i64::MAX));
        assert_eq!(t.plus_secs(1 << 63), Millis(i64::MAX));
        assert_eq!(t.plus_millis(u64::MAX), Millis(i64::MAX));
        assert_eq!(t.plus_secs(2), Millis(1_700_000_002_000));
    }

    #[test]
    fn utc_is_rfc3339() {
        assert_eq!(Millis(1_700_000_000_999).utc(), "2023-11-14T22:13:20Z");
        assert_eq!(Millis(0).utc(), "1970-01-01T00:00:00Z");
    }
}
