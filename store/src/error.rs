//! The store's one error type: which key (or segment) it concerns, what went wrong, and the
//! Mooncake Store error code that means the same.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The longest key, in bytes of UTF-8.
pub const MAX_KEY_LEN: usize = 256;

/// A store operation failed for `key` (empty when the operation names no key: mounting or
/// unmounting a segment).
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
#[error("{}{kind}", if key.is_empty() { String::new() } else { format!("key {key:?}: ") })]
pub struct StoreError {
    /// The key the operation was about.
    pub key: String,
    /// What went wrong.
    pub kind: StoreErrorKind,
}

impl StoreError {
    /// `kind` for `key`.
    pub fn new(key: &str, kind: StoreErrorKind) -> Self {
        Self {
            key: key.to_owned(),
            kind,
        }
    }

    /// Mooncake Store's error code for the same failure (its `ErrorCode`, `types.h`).
    pub fn code(&self) -> i32 {
        self.kind.code()
    }
}

/// What went wrong, one variant per cause a caller may act on.
#[derive(Clone, Debug, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum StoreErrorKind {
    /// The key is empty.
    #[error("empty key")]
    EmptyKey,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("key of {len} bytes; at most {MAX_KEY_LEN}")]
    KeyTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A value of 0 bytes.
    #[error("value of 0 bytes")]
    EmptyValue,
    /// The value does not fit in any segment mounted.
    #[error("value of {size} bytes is larger than the largest segment ({largest} bytes)")]
    ValueTooLarge {
        /// The value's size.
        size: u64,
        /// The largest segment's capacity (0: none is mounted).
        largest: u64,
    },
    /// More replicas than segments that could ever hold the value.
    #[error("{asked} replicas asked for, {segments} segments take writes of this size")]
    TooManyReplicas {
        /// Replicas asked for.
        asked: usize,
        /// Segments that take writes and are at least as large as the value.
        segments: usize,
    },
    /// Right after the master failed over, the segments that could hold the replicas do not
    /// take writes yet: their owners have not spoken to the new master, or the earlier
    /// term's writers are not fenced there yet. A write waits for them (within its
    /// deadline) before it answers this.
    #[error(
        "{asked} replicas asked for, {ready} segments take writes yet (the master just failed over)"
    )]
    SegmentsNotReady {
        /// Replicas asked for.
        asked: usize,
        /// Segments that take writes now.
        ready: usize,
    },
    /// A replica count of 0.
    #[error("replica_num is 0")]
    NoReplicas,
    /// No complete object has this key.
    #[error("object not found")]
    NotFound,
    /// The key already names an object, complete or being written.
    #[error("object already exists")]
    AlreadyExists,
    /// A reader holds a lease on the object: not removed (without force).
    #[error("object has a lease")]
    HasLease,
    /// The object is being written: not readable, removable or replaceable yet.
    #[error("object is being written (replica not ready)")]
    NotReady,
    /// Not enough free space on enough segments, even after eviction.
    #[error("no space for {replicas} replicas of {size} bytes")]
    NoSpace {
        /// The value's size.
        size: u64,
        /// Replicas asked for.
        replicas: usize,
    },
    /// The write is no longer pending: it ended, was revoked, or passed the put timeout and
    /// was abandoned.
    #[error("no write in progress with this id (ended, revoked or timed out)")]
    PutNotPending,
    /// The write passed the master's put timeout before put-end: it was abandoned, its
    /// space fenced.
    #[error("the write passed the put timeout and was abandoned")]
    PutTimedOut,
    /// A segment the write had a replica in went away (its process died, or it was
    /// unmounted) before put-end: the write was abandoned. Writing it again places it on
    /// live segments.
    #[error("segment {segment:?} holding a replica of the write went away")]
    ReplicaLost {
        /// The segment.
        segment: String,
    },
    /// The object was removed by force while the write was in progress: the write was
    /// abandoned.
    #[error("the object was removed by force while being written")]
    PutRemoved,
    /// The write was placed by an earlier master, which failed over before put-end: write
    /// it again.
    #[error("the write was placed by an earlier master (it failed over); write it again")]
    MasterChanged,
    /// The write was started by another client.
    #[error("the write belongs to another client")]
    NotWriter,
    /// No segment of that name or id is mounted.
    #[error("segment {segment:?} is not mounted")]
    UnknownSegment {
        /// The segment.
        segment: String,
    },
    /// A segment of that name is mounted already.
    #[error("segment {segment:?} is mounted already")]
    SegmentExists {
        /// The segment.
        segment: String,
    },
    /// A segment that cannot be mounted (empty, too large, overflowing the address space).
    #[error("segment {segment:?} cannot be mounted: {reason}")]
    InvalidSegment {
        /// The segment.
        segment: String,
        /// Why.
        reason: String,
    },
    /// An argument that cannot work: a range outside its region or not registered, a
    /// buffer smaller than the value, as many keys as values expected.
    #[error("invalid argument: {detail}")]
    InvalidArgument {
        /// What is wrong.
        detail: String,
    },
    /// A read's lease ended before its transfer did: what it read may have been replaced.
    #[error("lease expired before the data transfer completed")]
    LeaseExpired,
    /// Moving the bytes through the engine failed.
    #[error("transfer failed: {detail}")]
    TransferFailed {
        /// The engine's reason.
        detail: String,
    },
    /// The master did not answer.
    #[error("master unreachable: {detail}")]
    MasterUnreachable {
        /// Why.
        detail: String,
    },
}

impl StoreErrorKind {
    /// Mooncake Store's error code for the same failure.
    pub fn code(&self) -> i32 {
        match self {
            Self::EmptyKey | Self::KeyTooLong { .. } => -400, // INVALID_KEY
            Self::EmptyValue
            | Self::NoReplicas
            | Self::InvalidSegment { .. }
            | Self::InvalidArgument { .. } => -600, // INVALID_PARAMS
            Self::NotWriter => -601,                          // ILLEGAL_CLIENT
            Self::PutRemoved => -700,                         // INVALID_WRITE
            Self::MasterChanged => -900,                      // RPC_FAIL
            Self::NotReady => -703,                           // REPLICA_IS_NOT_READY
            Self::NotFound | Self::PutNotPending => -704,     // OBJECT_NOT_FOUND
            Self::AlreadyExists => -705,                      // OBJECT_ALREADY_EXISTS
            Self::HasLease => -706,                           // OBJECT_HAS_LEASE
            Self::LeaseExpired | Self::PutTimedOut => -707,   // LEASE_EXPIRED
            Self::ReplicaLost { .. } => -712,                 // REPLICA_IS_GONE
            // Mooncake's allocator answers these when no segment set can take the value.
            Self::NoSpace { .. }
            | Self::SegmentsNotReady { .. }
            | Self::ValueTooLarge { .. }
            | Self::TooManyReplicas { .. } => -200, // NO_AVAILABLE_HANDLE
            Self::UnknownSegment { .. } => -101, // SEGMENT_NOT_FOUND
            Self::SegmentExists { .. } => -102,  // SEGMENT_ALREADY_EXISTS
            Self::TransferFailed { .. } => -800, // TRANSFER_FAIL
            Self::MasterUnreachable { .. } => -900, // RPC_FAIL
        }
    }
}

/// Checks that `key` can name an object.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() {
        return Err(StoreError::new(key, StoreErrorKind::EmptyKey));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(StoreError::new(
            key,
            StoreErrorKind::KeyTooLong { len: key.len() },
        ));
    }
    Ok(())
}
