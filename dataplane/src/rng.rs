//! A small seedable random generator, for everything that must repeat for a seed: fault
//! plans here, reconnect jitter in the control plane. Nothing in railyard draws ambient
//! randomness on a path whose outcome a test checks. And a keyed hasher for tables whose
//! iteration order must repeat for a seed too.

use std::hash::{BuildHasher, DefaultHasher, Hasher};

/// SplitMix64 (Steele, Lea and Flood): 64 bits of state, good statistical quality, and the
/// same stream for the same seed everywhere.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound`, by multiply-shift; 0 when `bound` is 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }
}

/// The hasher of a state machine's tables: SipHash with a key written first. Iteration over
/// such a table (timers, retirements, evictions) depends only on the key and on what
/// happened: a simulation keys it with its seed and replays bit for bit; a running process
/// keys it at random ([`KeyedHasher::random`]), so peers cannot choose keys that collide.
#[derive(Clone, Copy, Debug)]
pub struct KeyedHasher(pub u64);

impl KeyedHasher {
    /// A hasher keyed at random.
    pub fn random() -> Self {
        Self(crate::entropy::random_u64())
    }
}

impl BuildHasher for KeyedHasher {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut hasher = DefaultHasher::new();
        hasher.write_u64(self.0);
        hasher
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_bounds_hold() {
        let (mut a, mut b) = (SplitMix64::new(5), SplitMix64::new(5));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut c = SplitMix64::new(6);
        assert_ne!(SplitMix64::new(5).next_u64(), c.next_u64());
        assert!((0..1000).all(|_| c.below(7) < 7));
        assert_eq!(c.below(0), 0);
    }

    #[test]
    fn a_keyed_hasher_hashes_alike_for_one_key_only() {
        let (a, b, c) = (KeyedHasher(9), KeyedHasher(9), KeyedHasher(10));
        assert_eq!(a.hash_one("key"), b.hash_one("key"));
        assert_ne!(a.hash_one("key"), c.hash_one("key"));
    }
}
