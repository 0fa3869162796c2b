//! The bytes the scenarios write and how they compare what landed: seeded fill patterns and
//! FNV-1a digests (`railyard serve`'s `digest` command prints the same).

/// FNV-1a over `bytes`: how scenarios compare what landed in a target process's memory
/// with what was meant to (`railyard serve`'s `digest` command prints it).
pub fn digest(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |hash, &byte| digest_more(hash, byte))
}

/// One more byte into a [`digest`].
pub fn digest_more(hash: u64, byte: u8) -> u64 {
    (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
}

/// Fills `bytes` with a pattern that depends on `seed` and the position.
pub(crate) fn fill_pattern(bytes: &mut [u8], seed: u64) {
    let mut state = railyard_engine::dataplane::rng::SplitMix64::new(seed);
    for chunk in bytes.chunks_mut(8) {
        let word = state.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}
