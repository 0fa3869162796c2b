//! Endpoints and their epochs: which endpoint a slice is for, and which incarnation of its
//! queue pair it was prepared for.

use std::fmt;

/// Identifies an endpoint (one peer rail) within a poller. Dense small numbers chosen by the
/// owner of endpoints; the poller indexes a table by them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u32);

/// The generation of an endpoint's queue pair. Every reconnect gives the endpoint a newer
/// epoch; a slice carries the epoch it was prepared for (addresses, lengths and keys are
/// only valid for that incarnation of the remote side).
///
/// The epoch rule: a poller never posts a slice whose epoch [is older
/// than](Epoch::is_older_than) its endpoint's current epoch; it re-prepares or fails it. A
/// slice whose epoch is *newer* than the endpoint's (the control plane announced a reconnect
/// the poller has not applied yet) waits in the endpoint's backlog. Epochs never wrap:
/// 2^64 reconnects do not happen.
///
/// There is deliberately no `Ord`: code says which comparison it means.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Epoch(u64);

impl Epoch {
    /// The epoch of an endpoint's first queue pair.
    pub const FIRST: Self = Self(1);

    /// An epoch from its number (as carried in handshakes).
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// Its number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The epoch after this one.
    #[must_use]
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// Whether a slice of this epoch is stale for an endpoint at `current`.
    pub const fn is_older_than(self, current: Self) -> bool {
        self.0 < current.0
    }

    /// Whether this epoch is ahead of `current` (announced, not yet applied).
    pub const fn is_newer_than(self, current: Self) -> bool {
        self.0 > current.0
    }
}

impl fmt::Debug for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch {}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_newer_and_equal_are_distinct() {
        let first = Epoch::FIRST;
        let second = first.next();
        assert!(first.is_older_than(second) && !second.is_older_than(first));
        assert!(second.is_newer_than(first) && !first.is_newer_than(second));
        assert!(!first.is_older_than(first) && !first.is_newer_than(first));
        assert_eq!(second.get(), 2);
    }

    #[test]
    fn messages_name_the_epoch_by_its_number() {
        assert_eq!(Epoch::new(3).to_string(), "epoch 3");
    }
}
