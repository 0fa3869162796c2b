//! Randomness from the kernel, for what must differ between processes and moments and is
//! never replayed from a seed: incarnations, first packet sequence numbers, the secret of a
//! region table's keys, connection tokens. (What a seed must repeat draws from
//! [`crate::rng`].)

/// 64 bits from the kernel's random source.
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY:
    // - `bytes` is writable for its length; getrandom writes at most that many bytes.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if filled == bytes.len() as isize {
        u64::from_le_bytes(bytes)
    } else {
        // No entropy source: still distinct per process and moment.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        now ^ (u64::from(std::process::id()) << 32)
    }
}
