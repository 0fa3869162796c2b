//! What both ends of a TCP data connection decide alike: how large a message and one vectored
//! send may be, which errors mean "later", how the bytes of a partial send are accounted, and
//! whether registered memory may still be touched right before a system call.

use std::collections::VecDeque;
use std::io::{self, ErrorKind};

use super::device::TcpDevice;
use crate::fabric::Access;

/// Largest message, as verbs allows.
pub(super) const MAX_MESSAGE: u32 = 1 << 31;

/// Requests one vectored send carries at most (two entries each).
pub const REQUESTS_PER_SEND: usize = 64;

/// The call found nothing to do now (or was interrupted): try again later; not a failure.
pub(super) fn would_block(error: &io::Error) -> bool {
    error.kind() == ErrorKind::WouldBlock || error.kind() == ErrorKind::Interrupted
}

/// Accounts `sent` bytes against `items`, oldest first, of which `front_sent` bytes of the
/// front were already sent; hands each item now wholly sent to `done`.
pub(super) fn account_sent<T>(
    items: &mut VecDeque<T>,
    front_sent: &mut usize,
    mut sent: usize,
    wire_len: impl Fn(&T) -> usize,
    mut done: impl FnMut(T),
) {
    while sent > 0 {
        let Some(front) = items.front() else {
            return;
        };
        let left = wire_len(front) - *front_sent;
        if sent < left {
            *front_sent += sent;
            return;
        }
        sent -= left;
        *front_sent = 0;
        if let Some(item) = items.pop_front() {
            done(item);
        }
    }
}

/// Whether `key` still names a live registration of `device`'s rail that allows `needed`
/// and covers `[addr, addr + len)`. Asked again right before every system call that reads or
/// writes registered memory, so that a withdrawal takes effect from the next call on.
pub(super) fn still_registered(
    device: &TcpDevice,
    key: u32,
    needed: Access,
    addr: u64,
    len: u64,
) -> bool {
    device
        .soft()
        .table()
        .lookup(key)
        .is_some_and(|region| region.access.contains(needed) && region.covers(addr, len))
}
