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
    /// Peer identity: a process answering at an address this side dialed is taken for the
    /// incarnation that answered there before (an address treated as an identity), so that
    /// incarnation's endpoints carry on into the newcomer.
    IncarnationCheck,
    /// Idle-only eviction: a poller told to park an endpoint frees its queue pair even with
    /// work queued or in flight on it (that work is flushed and fails).
    IdleEviction,
    /// Handshake admission: every ConnectQp goes out at once and a target answers every
    /// one it received in order (superseded or retired ones too) without telling the
    /// initiator it waits, so a burst's tail times out and asks again.
    HandshakeAdmission,
    /// The store's read fail-over: a read whose first replica fails is not tried on the
    /// next one.
    StoreReadFailover,
    /// The store master's leader fencing: its journal is written whatever the term, and a
    /// leader whose lease lapsed goes on serving.
    StoreLeaderFencing,
    /// The store master's term fences: a new master's rebuilt segments take replicas at
    /// once, before earlier terms' writers are fenced there (their late writes land on
    /// space the new term handed out again).
    StoreTermFences,
}

#[cfg(feature = "sabotage")]
impl Protection {
    /// Every protection a switch can turn off.
    pub const ALL: [Self; 9] = [
        Self::EpochCheck,
        Self::IdempotentReplies,
        Self::Liveness,
        Self::IncarnationCheck,
        Self::IdleEviction,
        Self::HandshakeAdmission,
        Self::StoreReadFailover,
        Self::StoreLeaderFencing,
        Self::StoreTermFences,
    ];

    /// Its name in [`ENV`].
    pub fn name(self) -> &'static str {
        match self {
            Self::EpochCheck => "epoch-check",
            Self::IdempotentReplies => "idempotent-replies",
            Self::Liveness => "liveness",
            Self::IncarnationCheck => "incarnation-check",
            Self::IdleEviction => "idle-eviction",
            Self::HandshakeAdmission => "handshake-admission",
            Self::StoreReadFailover => "store-read-failover",
            Self::StoreLeaderFencing => "store-leader-fencing",
            Self::StoreTermFences => "store-term-fences",
        }
    }
}

#[cfg(feature = "sabotage")]
/// The environment variable that carries the switched-off protections (comma-separated
/// names) to the processes a sabotaged test starts: a sabotage build reads it with
/// [`turn_off_from_env`] (`railyard serve`, `railyard master` and `railyard store` do), any
/// other build ignores it.
pub const ENV: &str = "RAILYARD_SABOTAGE";

/// The protections switched off in this process, as [`ENV`] carries them.
#[cfg(feature = "sabotage")]
pub fn switched_off() -> String {
    Protection::ALL
        .into_iter()
        .filter(|&protection| is_off(protection))
        .map(Protection::name)
        .collect::<Vec<_>>()
        .join(",")
}

/// Switches off, for the rest of this process, the protections [`ENV`] names.
#[cfg(feature = "sabotage")]
pub fn turn_off_from_env() {
    let named = std::env::var(ENV).unwrap_or_default();
    for protection in Protection::ALL {
        if named.split(',').any(|name| name == protection.name()) {
            switches::set(protection, true);
        }
    }
}

#[cfg(feature = "sabotage")]
mod switches {
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::sabotage::Protection;

    static OFF: [AtomicBool; Protection::ALL.len()] =
        [const { AtomicBool::new(false) }; Protection::ALL.len()];

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
