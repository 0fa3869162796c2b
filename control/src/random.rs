//! 64 random bits from the kernel: incarnations, first PSNs, seeds. The one source of
//! randomness the control plane's I/O side uses; its state machines take seeded generators.

/// 64 random bits from `getrandom(2)`; the clock and PID if it fails.
pub(crate) fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY:
    // - `bytes` is writable for its length; getrandom writes at most that many bytes.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if filled != bytes.len() as isize {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return now ^ u64::from(std::process::id()) << 32;
    }
    u64::from_le_bytes(bytes)
}
