//! A small seeded PRNG for tests that pick random moments or orders.

use std::time::{SystemTime, UNIX_EPOCH};

/// A small deterministic PRNG (xorshift64*), seeded and printed by tests
/// so a failing interleaving can be replayed with `AGENTS_TEST_SEED`.
pub struct Rng(u64);

impl Rng {
    pub fn from_env_or_time() -> Self {
        let seed = std::env::var("AGENTS_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("AGENTS_TEST_SEED={seed}");
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
