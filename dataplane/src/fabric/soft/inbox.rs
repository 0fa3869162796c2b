//! Receive queues: where a WRITE_WITH_IMM's immediate lands in the target process.
//!
//! Each queue pair owns one inbox: a single-producer single-consumer ring in a sealed memfd.
//! The target creates it and reads it ([`RecvQueue`]); at handshake it hands the descriptor
//! to the initiator, which maps it read-write and is the only producer ([`InboxWriter`]). The
//! initiator pushes an immediate only after the WRITE's data has been copied, with a Release
//! store of the tail, so a target that sees the immediate sees the data.
//!
//! Neither side trusts the other's index: a corrupt index can make the ring look full or
//! yield meaningless entries, never an access outside the mapping (indices are masked).
//!
//! The inbox also carries the queue pair's access fence (see [`super::fence`]): the sender
//! makes its access word odd around every check-and-copy it makes into or out of the owner's
//! memory ([`InboxWriter::enter`], left when its section drops), and the owner sets the revoked
//! word to take the queue pair out of service ([`InboxWatch::revoke`]).
//!
//! Layout (64-bit words): header `[magic, capacity]`, the consumer's head at byte 64, the
//! producer's tail at byte 128 (separate cache lines), the access word at byte 192 and the
//! revoked word at byte 200, entries from byte 256, each `imm | byte_len << 32`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::sys::{self, Mapping};

const MAGIC: u64 = u64::from_le_bytes(*b"RYINBOX1");
const HEAD: usize = 64;
const TAIL: usize = 128;
const ACCESS: usize = 192;
const REVOKED: usize = 200;
const ENTRIES: usize = 256;

/// Immediates a queue pair's inbox holds before a sender must wait (receiver-not-ready).
pub const INBOX_CAPACITY: usize = 4096;

fn inbox_len(capacity: usize) -> usize {
    ENTRIES + capacity * 8
}

/// One WRITE_WITH_IMM that arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvCompletion {
    /// The immediate value.
    pub imm: u32,
    /// Bytes the write carried.
    pub byte_len: u32,
}

/// Words of an inbox mapping, resolved once.
#[derive(Debug)]
struct Words {
    map: Mapping,
    capacity: u64,
}

impl Words {
    fn head(&self) -> &AtomicU64 {
        self.word(HEAD)
    }

    fn tail(&self) -> &AtomicU64 {
        self.word(TAIL)
    }

    fn access(&self) -> &AtomicU64 {
        self.word(ACCESS)
    }

    fn revoked(&self) -> &AtomicU64 {
        self.word(REVOKED)
    }

    fn entry(&self, position: u64) -> &AtomicU64 {
        let index = (position & (self.capacity - 1)) as usize;
        self.word(ENTRIES + index * 8)
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        self.map
            .atomic(offset)
            .unwrap_or_else(|| unreachable!("offset {offset} checked against the length"))
    }
}

/// The receiving side of an inbox, owned by whoever consumes a queue pair's receive
/// completions.
#[derive(Debug)]
pub struct RecvQueue {
    fd: OwnedFd,
    words: Arc<Words>,
}

impl RecvQueue {
    /// A new, empty inbox.
    pub(crate) fn new() -> io::Result<Self> {
        let len = inbox_len(INBOX_CAPACITY);
        let fd = sys::sealed_memfd("railyard-inbox", len)?;
        let map = Mapping::new(fd.as_fd(), len, true)?;
        let words = Words {
            map,
            capacity: INBOX_CAPACITY as u64,
        };
        words
            .word(8)
            .store(INBOX_CAPACITY as u64, Ordering::Relaxed);
        // Relaxed: the descriptor reaches the peer through a socket, which orders these
        // stores before its loads.
        words.word(0).store(MAGIC, Ordering::Relaxed);
        Ok(Self {
            fd,
            words: Arc::new(words),
        })
    }

    /// The owner's view of the inbox's access fence, which outlives the queue.
    pub(crate) fn watch(&self) -> InboxWatch {
        InboxWatch(self.words.clone())
    }

    /// The descriptor to hand to the peer.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Appends up to `max` arrived immediates to `out`, oldest first; returns how many.
    pub fn poll(&mut self, out: &mut Vec<RecvCompletion>, max: usize) -> usize {
        let head = self.words.head().load(Ordering::Relaxed);
        // Acquire: pairs with the sender's Release store of the tail, so the entries (and
        // the data of their writes) are visible.
        let tail = self.words.tail().load(Ordering::Acquire);
        let available = tail.wrapping_sub(head).min(self.words.capacity);
        let count = available.min(max as u64);
        for position in head..head + count {
            let entry = self.words.entry(position).load(Ordering::Relaxed);
            out.push(RecvCompletion {
                imm: entry as u32,
                byte_len: (entry >> 32) as u32,
            });
        }
        // Release: the entries were read before the sender may overwrite them.
        self.words.head().store(head + count, Ordering::Release);
        count as usize
    }
}

/// The owner's side of a queue pair's access fence.
#[derive(Clone, Debug)]
pub(crate) struct InboxWatch(Arc<Words>);

impl InboxWatch {
    /// Takes the queue pair out of service: every check-and-copy the sender starts after it
    /// sees this fails.
    pub(crate) fn revoke(&self) {
        // SeqCst: in the single order with the sender's fence, so that an owner thread that
        // reads it revoked (SeqCst) and then fences knows a sender that missed it is seen
        // inside (`Guests`); the revoking thread's own fence in `Guests::quiesce` orders it
        // as well.
        self.0.revoked().store(1, Ordering::SeqCst);
    }

    /// Whether [`Self::revoke`] was called (by any thread; see there).
    pub(crate) fn is_revoked(&self) -> bool {
        self.0.revoked().load(Ordering::SeqCst) != 0
    }

    /// The sender's access word now: odd while it is inside a check-and-copy. Call after a
    /// SeqCst fence that follows the withdrawal or revocation being fenced.
    pub(crate) fn access(&self) -> u64 {
        // Acquire: pairs with the sender's Release when it leaves, so its copy is over.
        self.0.access().load(Ordering::Acquire)
    }
}

/// A check-and-copy in progress ([`InboxWriter::enter`]); leaves when dropped.
///
/// # Invariants
/// `word` points into the mapping of the [`InboxWriter`] that made it, which outlives the
/// section: the writer lives in the queue pair's peer, borrowed for the whole execution of
/// the work request the section covers.
pub(crate) struct AccessSection {
    word: *const AtomicU64,
    inside: u64,
}

// SAFETY:
// - The pointee is an `AtomicU64` (`Sync`) in a shared mapping; the invariant ties its life to
//   the writer, wherever the section goes.
unsafe impl Send for AccessSection {}

impl Drop for AccessSection {
    fn drop(&mut self) {
        // SAFETY: the word is live (see the type's invariant) and only accessed atomically.
        let word = unsafe { &*self.word };
        // Release: the copy happens before an owner that sees us out unmaps the memory.
        word.store(self.inside.wrapping_add(1), Ordering::Release);
    }
}

/// The sending side: a peer's inbox mapped read-write.
#[derive(Debug)]
pub(crate) struct InboxWriter {
    words: Words,
}

/// Why a peer's inbox was refused.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// Not a sealed memfd.
    #[error("the peer's inbox is not a memfd sealed against shrinking")]
    NotSealed,
    /// Wrong size, magic or capacity.
    #[error("the peer's inbox is malformed")]
    Malformed,
    /// Mapping failed.
    #[error("cannot map the peer's inbox: {0}")]
    Map(#[source] io::Error),
}

impl InboxWriter {
    /// Maps a peer's inbox from the descriptor it sent, checking seals and header.
    pub(crate) fn map(fd: OwnedFd) -> Result<Self, InboxError> {
        let len = sys::sealed_len(fd.as_fd())
            .map_err(InboxError::Map)?
            .ok_or(InboxError::NotSealed)?;
        if len != inbox_len(INBOX_CAPACITY) as u64 {
            return Err(InboxError::Malformed);
        }
        let map = Mapping::new(fd.as_fd(), len as usize, true).map_err(InboxError::Map)?;
        let words = Words {
            map,
            capacity: INBOX_CAPACITY as u64,
        };
        if words.word(0).load(Ordering::Acquire) != MAGIC
            || words.word(8).load(Ordering::Relaxed) != INBOX_CAPACITY as u64
        {
            return Err(InboxError::Malformed);
        }
        Ok(Self { words })
    }

    /// Enters a check-and-copy into or out of the owner's memory, left when the returned
    /// section drops (also while unwinding). Checks of the owner's keys and of
    /// [`Self::is_revoked`] come after.
    pub(crate) fn enter(&self) -> AccessSection {
        let word = self.words.access();
        let inside = word.load(Ordering::Relaxed).wrapping_add(1) | 1;
        word.store(inside, Ordering::Relaxed);
        // SeqCst fence: pairs with the owner's fence between withdrawing a key (or revoking)
        // and reading this word. Either the owner sees us inside and waits, or our checks
        // after this fence see its withdrawal.
        fence(Ordering::SeqCst);
        AccessSection {
            word: std::ptr::from_ref(word),
            inside,
        }
    }

    /// Whether the owner took the queue pair out of service. Read inside a check-and-copy.
    pub(crate) fn is_revoked(&self) -> bool {
        self.words.revoked().load(Ordering::Relaxed) != 0
    }

    /// Whether one more immediate fits (the receiver is ready).
    pub(crate) fn has_room(&self) -> bool {
        let tail = self.words.tail().load(Ordering::Relaxed);
        // Acquire: pairs with the receiver's Release head store; its reads of the slots we
        // are about to reuse are done.
        let head = self.words.head().load(Ordering::Acquire);
        tail.wrapping_sub(head) < self.words.capacity
    }

    /// Delivers one immediate; `false` when the inbox is full (the receiver is not ready).
    pub(crate) fn try_push(&mut self, completion: RecvCompletion) -> bool {
        if !self.has_room() {
            return false;
        }
        let tail = self.words.tail().load(Ordering::Relaxed);
        let entry = u64::from(completion.imm) | u64::from(completion.byte_len) << 32;
        self.words.entry(tail).store(entry, Ordering::Relaxed);
        // Release: the entry, and the data copied before this call, are visible to a
        // receiver that loads the new tail.
        self.words
            .tail()
            .store(tail.wrapping_add(1), Ordering::Release);
        true
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn immediates_arrive_in_order_and_a_full_inbox_refuses() {
        let mut queue = RecvQueue::new().expect("memfd");
        let fd = queue.fd().try_clone_to_owned().expect("dup");
        let mut writer = InboxWriter::map(fd).expect("valid inbox");
        for imm in 0..INBOX_CAPACITY as u32 {
            assert!(writer.try_push(RecvCompletion { imm, byte_len: 8 }));
        }
        assert!(!writer.try_push(RecvCompletion {
            imm: 0,
            byte_len: 0
        }));
        let mut out = Vec::new();
        assert_eq!(queue.poll(&mut out, 3), 3);
        assert_eq!(
            out[2],
            RecvCompletion {
                imm: 2,
                byte_len: 8
            }
        );
        assert!(writer.try_push(RecvCompletion {
            imm: 99,
            byte_len: 1
        }));
        out.clear();
        assert_eq!(queue.poll(&mut out, usize::MAX), INBOX_CAPACITY - 2);
        assert_eq!(
            out.last(),
            Some(&RecvCompletion {
                imm: 99,
                byte_len: 1
            })
        );
    }
}
