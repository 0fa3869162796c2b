//! A small seedable random generator, for everything that must repeat for a seed: fault
//! plans here, reconnect jitter in the control plane. Nothing in railyard draws ambient
//! randomness on a path whose outcome a test checks.

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
}
