//! Switches that turn one protection off, so that a test can prove the chaos scenario that
//! guards it reports the loss. They exist only with the crate feature `sabotage`, which
//! `make test` enables and `make run`, `make bench` and release builds do not; without it
//! [`is_off`] is a constant `false` and the protections cannot be switched off at all.

/// A protection a switch can turn off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// The poller's epoch rule: a slice older than its endpoint's queue pair is posted as it
    /// is instead of re-prepared (stale addresses and keys reach the fabric).
    EpochCheck,
    /// Idempotent ConnectQp replies: a repeated request replaces the passive queue pair.
    IdempotentReplies,
    /// Liveness: silent control connections are never declared unreachable.
    Liveness,
}

#[cfg(feature = "sabotage")]
mod switches {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::Protection;

    static OFF: [AtomicBool; 3] = [const { AtomicBool::new(false) }; 3];

    fn switch(protection: Protection) -> &'static AtomicBool {
        &OFF[protection as usize]
    }

    pub(super) fn is_off(protection: Protection) -> bool {
        switch(protection).load(Ordering::Relaxed)
    }

    pub(super) fn set(protection: Protection, off: bool) {
        switch(protection).store(off, Ordering::Relaxed);
    }
}

/// Whether `protection` is switched off (never, without the `sabotage` feature).
#[inline]
pub fn is_off(protection: Protection) -> bool {
    #[cfg(feature = "sabotage")]
    return switches::is_off(protection);
    #[cfg(not(feature = "sabotage"))]
    {
        let _ = protection;
        false
    }
}

/// Turns `protection` off for this process until the guard is dropped.
#[cfg(feature = "sabotage")]
#[must_use = "the protection is back on when the guard drops"]
pub fn turn_off(protection: Protection) -> Sabotaged {
    switches::set(protection, true);
    Sabotaged(protection)
}

/// Turns its protection back on when dropped.
#[cfg(feature = "sabotage")]
#[derive(Debug)]
pub struct Sabotaged(Protection);

#[cfg(feature = "sabotage")]
impl Drop for Sabotaged {
    fn drop(&mut self) {
        switches::set(self.0, false);
    }
}
