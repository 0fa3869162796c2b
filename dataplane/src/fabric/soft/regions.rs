//! Region tables: what a soft device has registered, in shared memory it owns, so that peers
//! check every work request against the live registration as a NIC checks its MTT.
//!
//! The table lives in a sealed memfd. The owner writes it; peers receive the descriptor at
//! handshake and map it read-only. Each entry is guarded by a sequence counter (a seqlock):
//! the owner makes it odd, rewrites the entry, makes it even again; a reader retries while it
//! is odd or changed under it, so it never sees a torn entry, and a deregistration is seen by
//! the next work request that names the key. A reader gives up after a bounded number of
//! retries (an owner that died mid-update) and treats the key as unknown.
//!
//! Layout (little-endian 64-bit words): a 64-byte header `[magic, version | capacity << 32,
//! owner pid, incarnation]`, then `capacity` 64-byte entries `[sequence, key | access << 32,
//! base, len, memfd + 1]`. Key 0 marks a free entry. The last word names the descriptor
//! (in the owner's process) of the memfd backing a region the engine allocated, from offset
//! 0, or 0 for other memory: a peer may map such a region and copy into it directly.
//!
//! Keys are `generation << INDEX_BITS | index`: the index finds the entry at once, and the
//! generation makes a key stale as soon as it is deregistered, even after the entry is
//! reused. An entry's n-th registration gets generation `P(entry, n)`, where `P` is a
//! permutation of the 20-bit numbers keyed by a secret the table draws from the kernel (a
//! small Feistel network), never 0: so a key does not come back before its entry was
//! registered a million times more — a request prepared against an old registration is
//! refused, never taken by a new one at the same entry (the target's half of the memory
//! fences) — and still no key says anything of another, nor of another table's.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{Ordering, fence};
use std::sync::{Mutex, PoisonError};

use super::sys::{self, Mapping};
use crate::fabric::Access;

/// First word of a region table.
const MAGIC: u64 = u64::from_le_bytes(*b"RYREGTAB");
const VERSION: u64 = 1;
const HEADER_LEN: usize = 64;
const ENTRY_LEN: usize = 64;
const INDEX_BITS: u32 = 12;
/// Registrations one device can hold at once.
pub const CAPACITY: usize = 1 << INDEX_BITS;
const GENERATION_LIMIT: u32 = 1 << (32 - INDEX_BITS);
/// Reader retries before a busy entry counts as unknown.
const READ_RETRIES: u32 = 10_000;

/// One live registration as a reader sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Registration {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    /// The owner's descriptor of the memfd behind the region, if the engine allocated it.
    pub(crate) memfd: Option<i32>,
}

impl Registration {
    /// Whether `[addr, addr + len)` lies inside the registration.
    pub(crate) fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// All entries are in use.
    #[error("the device's region table is full ({CAPACITY} registrations)")]
    TableFull,
    /// Empty, null or wrapping range.
    #[error("cannot register {len} bytes at {addr:#x}: the range is empty, null or wraps")]
    BadRange {
        /// Start asked for.
        addr: u64,
        /// Length asked for.
        len: u64,
    },
    /// The key names no live registration of this device.
    #[error("key {key:#x} names no live registration of this device")]
    UnknownKey {
        /// The key given.
        key: u32,
    },
}

fn entry_offset(index: usize) -> usize {
    HEADER_LEN + index * ENTRY_LEN
}

fn table_len(capacity: usize) -> usize {
    entry_offset(capacity)
}

/// Reads entry `key` of the table in `map` under its seqlock. `None` when the key is not
/// live (or the entry stayed busy past the retry bound).
fn lookup(map: &Mapping, capacity: usize, key: u32) -> Option<Registration> {
    let index = (key & (CAPACITY as u32 - 1)) as usize;
    if key == 0 || index >= capacity {
        return None;
    }
    let word = |n: usize| map.atomic(entry_offset(index) + n * 8);
    let (sequence, key_access, base, len, memfd) =
        (word(0)?, word(1)?, word(2)?, word(3)?, word(4)?);
    for _ in 0..READ_RETRIES {
        // Relaxed loads only: the peer's mapping is read-only. The Acquire fences give the
        // seqlock its order: the first one keeps the field loads after the first sequence
        // load, the second keeps them before the second sequence load.
        let before = sequence.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if before % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let (entry_key_access, entry_base, entry_len, entry_memfd) = (
            key_access.load(Ordering::Relaxed),
            base.load(Ordering::Relaxed),
            len.load(Ordering::Relaxed),
            memfd.load(Ordering::Relaxed),
        );
        fence(Ordering::Acquire);
        if sequence.load(Ordering::Relaxed) != before {
            continue;
        }
        if entry_key_access as u32 != key {
            return None;
        }
        return Some(Registration {
            base: entry_base,
            len: entry_len,
            access: Access::from_bits_truncate((entry_key_access >> 32) as u32),
            memfd: entry_memfd
                .checked_sub(1)
                .and_then(|fd| i32::try_from(fd).ok()),
        });
    }
    None
}

#[derive(Debug)]
struct Slots {
    free: Vec<u16>,
    /// Each entry's registrations so far (modulo [`GENERATION_LIMIT`]).
    registrations: Vec<u32>,
    /// The key of this table's permutation of generations.
    secret: u64,
}

/// The generation of `entry`'s registration number `count` (below [`GENERATION_LIMIT`]):
/// a four-round Feistel network on its two 10-bit halves, whose round function mixes
/// `secret`, the entry and the round. A bijection for each entry whatever the function.
fn permute(secret: u64, entry: u16, count: u32) -> u32 {
    const HALF: u32 = (32 - INDEX_BITS) / 2;
    const MASK: u32 = (1 << HALF) - 1;
    let (mut left, mut right) = ((count >> HALF) & MASK, count & MASK);
    for round in 0..4u64 {
        let seed = secret ^ (u64::from(entry) << 32) ^ (round << 48) ^ u64::from(right);
        let mixed = crate::rng::SplitMix64::new(seed).next_u64() as u32;
        (left, right) = (right, left ^ (mixed & MASK));
    }
    (left << HALF) | right
}

/// The owner's side: registers and deregisters. Shared by the threads of one process.
#[derive(Debug)]
pub(crate) struct RegionTable {
    fd: OwnedFd,
    map: Mapping,
    slots: Mutex<Slots>,
    /// The owner process, as written in the header.
    pub(crate) owner_pid: u32,
    /// The owning device's incarnation, as written in the header.
    pub(crate) incarnation: u64,
}

impl RegionTable {
    /// A new, empty table in a new memfd.
    pub(crate) fn new(owner_pid: u32, incarnation: u64) -> io::Result<Self> {
        let len = table_len(CAPACITY);
        let fd = sys::sealed_memfd("railyard-regions", len)?;
        let map = Mapping::new(fd.as_fd(), len, true)?;
        let header = |n: usize| map.atomic(n * 8).ok_or(io::ErrorKind::InvalidData);
        // Relaxed: nobody else has the table yet; the descriptor is handed over later
        // through a socket, which orders these stores before any peer's loads.
        header(1)?.store(VERSION | (CAPACITY as u64) << 32, Ordering::Relaxed);
        header(2)?.store(u64::from(owner_pid), Ordering::Relaxed);
        header(3)?.store(incarnation, Ordering::Relaxed);
        header(0)?.store(MAGIC, Ordering::Relaxed);
        Ok(Self {
            fd,
            map,
            owner_pid,
            incarnation,
            slots: Mutex::new(Slots {
                free: (0..CAPACITY as u16).rev().collect(),
                registrations: vec![0; CAPACITY],
                secret: crate::entropy::random_u64(),
            }),
        })
    }

    /// The descriptor to hand to peers.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where the table's first word (the magic) lives in this process: peers read it with
    /// `process_vm_readv` to prove they may access this process and that it is who it says.
    pub(crate) fn probe_addr(&self) -> u64 {
        self.map.addr()
    }

    fn write_entry(&self, index: usize, key_access: u64, base: u64, len: u64, memfd: u64) {
        let word = |n: usize| self.map.atomic(entry_offset(index) + n * 8);
        let (Some(sequence), Some(key_word), Some(base_word), Some(len_word), Some(memfd_word)) =
            (word(0), word(1), word(2), word(3), word(4))
        else {
            unreachable!("entry {index} lies inside the table by construction");
        };
        // Seqlock write (single writer: callers hold `slots`). Odd sequence first, Release
        // fence so the field stores cannot move before it; the final Release store keeps
        // them before the even sequence.
        let sequence_now = sequence.load(Ordering::Relaxed);
        sequence.store(sequence_now + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        key_word.store(key_access, Ordering::Relaxed);
        base_word.store(base, Ordering::Relaxed);
        len_word.store(len, Ordering::Relaxed);
        memfd_word.store(memfd, Ordering::Relaxed);
        sequence.store(sequence_now + 2, Ordering::Release);
    }

    /// Publishes a registration; returns its key. `memfd`: this process's descriptor of the
    /// memfd mapped at `addr` from offset 0, when the engine allocated the region.
    pub(crate) fn register(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        memfd: Option<i32>,
    ) -> Result<u32, RegionError> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(RegionError::BadRange { addr, len });
        }
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let index = slots.free.pop().ok_or(RegionError::TableFull)?;
        let generation = loop {
            let count = &mut slots.registrations[usize::from(index)];
            let this = *count;
            *count = (this + 1) % GENERATION_LIMIT;
            // 0 would make key 0 (a free entry) for index 0: skipped.
            let drawn = permute(slots.secret, index, this);
            if drawn != 0 {
                break drawn;
            }
        };
        let key = generation << INDEX_BITS | u32::from(index);
        self.write_entry(
            usize::from(index),
            u64::from(key) | u64::from(access.bits()) << 32,
            addr,
            len,
            memfd.map_or(0, |fd| fd as u64 + 1),
        );
        Ok(key)
    }

    /// Withdraws a registration: the next work request naming `key` fails.
    pub(crate) fn deregister(&self, key: u32) -> Result<(), RegionError> {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if self.lookup(key).is_none() {
            return Err(RegionError::UnknownKey { key });
        }
        let index = key & (CAPACITY as u32 - 1);
        self.write_entry(index as usize, 0, 0, 0, 0);
        slots.free.push(index as u16);
        Ok(())
    }

    /// The live registration `key`, if any.
    pub(crate) fn lookup(&self, key: u32) -> Option<Registration> {
        lookup(&self.map, CAPACITY, key)
    }
}

/// A peer's table, mapped read-only.
#[derive(Debug)]
pub(crate) struct RemoteTable {
    map: Mapping,
    capacity: usize,
    /// The owner's incarnation, from the header.
    pub(crate) incarnation: u64,
    /// The owner's pid, from the header.
    pub(crate) owner_pid: u32,
}

/// Why a peer's table was refused.
#[derive(Debug, thiserror::Error)]
pub enum RemoteTableError {
    /// Not a sealed memfd: the owner could shrink it under us.
    #[error("the peer's region table is not a memfd sealed against shrinking")]
    NotSealed,
    /// Too short, bad magic or version, or a capacity that does not fit.
    #[error("the peer's region table is malformed: {0}")]
    Malformed(&'static str),
    /// Mapping failed.
    #[error("cannot map the peer's region table: {0}")]
    Map(#[source] io::Error),
}

impl RemoteTable {
    /// Maps a peer's table from the descriptor it sent, checking seals and header.
    pub(crate) fn map(fd: OwnedFd) -> Result<Self, RemoteTableError> {
        let len = sys::sealed_len(fd.as_fd())
            .map_err(RemoteTableError::Map)?
            .ok_or(RemoteTableError::NotSealed)?;
        if len < HEADER_LEN as u64 || len > table_len(CAPACITY) as u64 {
            return Err(RemoteTableError::Malformed("its length is not a table's"));
        }
        let map = Mapping::new(fd.as_fd(), len as usize, false).map_err(RemoteTableError::Map)?;
        let header = |n: usize| map.atomic(n * 8).map(|w| w.load(Ordering::Relaxed));
        // Acquire: the header words were written before the descriptor was sent.
        fence(Ordering::Acquire);
        if header(0) != Some(MAGIC) {
            return Err(RemoteTableError::Malformed("bad magic"));
        }
        let version_capacity = header(1).unwrap_or_default();
        if version_capacity & 0xffff_ffff != VERSION {
            return Err(RemoteTableError::Malformed("unknown version"));
        }
        let capacity = (version_capacity >> 32) as usize;
        if capacity == 0 || capacity > CAPACITY || table_len(capacity) as u64 > len {
            return Err(RemoteTableError::Malformed(
                "capacity does not fit its length",
            ));
        }
        Ok(Self {
            capacity,
            owner_pid: header(2).unwrap_or_default() as u32,
            incarnation: header(3).unwrap_or_default(),
            map,
        })
    }

    /// The live registration `key`, if any.
    pub(crate) fn lookup(&self, key: u32) -> Option<Registration> {
        lookup(&self.map, self.capacity, key)
    }
}

/// The 8-byte table magic, for probes.
pub(crate) const PROBE_WORD: u64 = MAGIC;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn table() -> RegionTable {
        RegionTable::new(std::process::id(), 7).expect("memfd")
    }

    #[test]
    fn keys_are_drawn_afresh_for_every_registration() {
        let table = table();
        let mut generations = Vec::new();
        for _ in 0..64 {
            let key = table.register(0x1000, 64, Access::ALL, None).expect("room");
            generations.push(key >> INDEX_BITS);
            table.deregister(key).expect("registered");
        }
        for pair in generations.windows(2) {
            assert_ne!(pair[0], pair[1], "a re-registration gets a new key");
        }
        assert!(generations.iter().all(|&g| g != 0 && g < GENERATION_LIMIT));
        // Not a counter, nor a function of the entry: 64 draws of 20 bits in a row
        // (chance of this by luck: below one in a million).
        let ascending = generations.windows(2).all(|pair| pair[1] == pair[0] + 1);
        assert!(!ascending, "{generations:?}");
        let other = table.register(0x2000, 64, Access::ALL, None).expect("room");
        let again = table.register(0x3000, 64, Access::ALL, None).expect("room");
        assert_ne!(
            other >> INDEX_BITS,
            again >> INDEX_BITS,
            "entries' keys are unrelated"
        );
    }

    #[test]
    fn an_entrys_keys_do_not_come_back() {
        let table = table();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20_000 {
            let key = table.register(0x1000, 64, Access::ALL, None).expect("room");
            assert!(seen.insert(key), "key {key:#x} came back");
            table.deregister(key).expect("registered");
        }
        // The permutation itself: every generation of an entry once, 0 among them.
        let all: std::collections::HashSet<u32> = (0..GENERATION_LIMIT)
            .map(|count| permute(0x5eed, 3, count))
            .collect();
        assert_eq!(all.len(), GENERATION_LIMIT as usize);
        assert!(all.iter().all(|&g| g < GENERATION_LIMIT));
    }

    #[test]
    fn register_lookup_deregister() {
        let table = table();
        let key = table
            .register(0x1000, 4096, Access::REMOTE_WRITE, None)
            .expect("room");
        let found = table.lookup(key).expect("live");
        assert_eq!((found.base, found.len), (0x1000, 4096));
        assert!(found.access.contains(Access::REMOTE_WRITE));
        assert!(!found.access.contains(Access::REMOTE_READ));
        assert!(found.covers(0x1000, 4096) && !found.covers(0x1001, 4096));
        table.deregister(key).expect("live");
        assert_eq!(table.lookup(key), None);
        assert_eq!(table.deregister(key), Err(RegionError::UnknownKey { key }));
    }

    #[test]
    fn a_reused_entry_gets_a_new_key() {
        let table = table();
        let first = table.register(0x1000, 64, Access::ALL, None).expect("room");
        table.deregister(first).expect("live");
        let second = table
            .register(0x2000, 64, Access::ALL, Some(5))
            .expect("room");
        assert_eq!(first & 0xfff, second & 0xfff, "same entry reused");
        assert_ne!(first, second);
        assert_eq!(table.lookup(first), None);
        assert_eq!(table.lookup(second).map(|r| r.base), Some(0x2000));
        assert_eq!(table.lookup(second).and_then(|r| r.memfd), Some(5));
    }

    #[test]
    fn bad_ranges_and_a_full_table_are_refused() {
        let table = table();
        assert!(matches!(
            table.register(0, 8, Access::ALL, None),
            Err(RegionError::BadRange { .. })
        ));
        assert!(matches!(
            table.register(8, 0, Access::ALL, None),
            Err(RegionError::BadRange { .. })
        ));
        assert!(matches!(
            table.register(u64::MAX - 4, 8, Access::ALL, None),
            Err(RegionError::BadRange { .. })
        ));
        for n in 0..CAPACITY as u64 {
            table
                .register(0x1000 + n, 1, Access::ALL, None)
                .expect("room");
        }
        assert_eq!(
            table.register(0x1000, 1, Access::ALL, None),
            Err(RegionError::TableFull)
        );
    }

    #[test]
    fn a_peer_mapping_sees_registrations_and_deregistrations() {
        let table = table();
        let fd = table.fd().try_clone_to_owned().expect("dup");
        let remote = RemoteTable::map(fd).expect("valid table");
        assert_eq!(
            (remote.owner_pid, remote.incarnation),
            (std::process::id(), 7)
        );
        let key = table
            .register(0x4000, 100, Access::REMOTE_READ, None)
            .expect("room");
        assert_eq!(remote.lookup(key).map(|r| r.len), Some(100));
        table.deregister(key).expect("live");
        assert_eq!(remote.lookup(key), None);
    }

    #[test]
    fn an_unsealed_descriptor_is_refused() {
        let file = std::fs::File::open("/proc/self/exe").expect("own binary");
        let fd = OwnedFd::from(file);
        assert!(matches!(
            RemoteTable::map(fd),
            Err(RemoteTableError::NotSealed)
        ));
    }
}
