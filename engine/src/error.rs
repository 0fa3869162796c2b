//! The Engine's errors: one enum per family of operations, each naming the offending
//! range, peer or rail.

use std::net::SocketAddr;
use std::time::Duration;

use railyard_control::ControlError;

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The fabric asked for cannot run here.
    #[error("the {fabric} fabric is not available: {reason}")]
    FabricUnavailable {
        /// The fabric.
        fabric: &'static str,
        /// Why.
        reason: String,
    },
    /// A rail's device could not open.
    #[error("cannot open rail {rail}: {reason}")]
    Rail {
        /// The rail.
        rail: usize,
        /// Why.
        reason: String,
    },
    /// A rail's poller could not start.
    #[error("cannot start the poller of rail {rail}: {reason}")]
    Poller {
        /// The rail.
        rail: usize,
        /// Why.
        reason: String,
    },
    /// The control plane could not start.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
    /// The directory could not start (etcd unreachable, name taken, no etcd support).
    #[error("directory: {0}")]
    Directory(String),
}

/// Why memory could not be allocated, registered or deregistered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Zero bytes, or a range that wraps.
    #[error("cannot register {len} bytes at {addr:#x}: empty or wrapping range")]
    BadRange {
        /// Start asked for.
        addr: u64,
        /// Length asked for.
        len: u64,
    },
    /// The range is not readable and writable memory mapped in this process: device
    /// memory (only host memory is supported), or nothing at all.
    #[error(
        "cannot register {len} bytes at {addr:#x}: not readable and writable host memory of \
         this process (device memory is not supported)"
    )]
    NotHostMemory {
        /// Start asked for.
        addr: u64,
        /// Length asked for.
        len: u64,
    },
    /// Two ranges of one [`Engine::register_many`](crate::Engine::register_many) call
    /// overlap without being equal.
    #[error(
        "cannot register {len} bytes at {addr:#x}: it overlaps {other_len} bytes at \
         {other_addr:#x} of the same call"
    )]
    RangesOverlap {
        /// Start of one range.
        addr: u64,
        /// Its length.
        len: u64,
        /// Start of the other.
        other_addr: u64,
        /// Its length.
        other_len: u64,
    },
    /// The range overlaps a registered region without being exactly it.
    #[error(
        "cannot register {len} bytes at {addr:#x}: overlaps region {region} ({region_len} \
         bytes at {region_addr:#x}); deregister it first or register exactly its range"
    )]
    Overlaps {
        /// Start asked for.
        addr: u64,
        /// Length asked for.
        len: u64,
        /// The region it overlaps.
        region: u64,
        /// That region's start.
        region_addr: u64,
        /// That region's length.
        region_len: u64,
    },
    /// A rail refused the registration.
    #[error("rail {rail} refused the registration of {len} bytes at {addr:#x}: {reason}")]
    Register {
        /// The rail.
        rail: usize,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        reason: String,
    },
    /// The memory could not be allocated.
    #[error("cannot allocate {len} bytes: {reason}")]
    Alloc {
        /// Length asked for.
        len: u64,
        /// Why.
        reason: String,
    },
    /// The NUMA node does not exist or the memory could not be bound to it.
    #[error("cannot bind {len} bytes to NUMA node {node}: {reason}")]
    Bind {
        /// The node.
        node: u32,
        /// Length.
        len: u64,
        /// Why.
        reason: String,
    },
    /// No such region (never registered, or deregistered already).
    #[error("region {id} is not registered with this engine")]
    UnknownRegion {
        /// The region's id.
        id: u64,
    },
    /// Deregistration withdrew the region's keys, but a poller or a peer process was still
    /// inside it when the wait ended (a stopped peer, say). The region stays mapped and
    /// withdrawn; call `deregister` again to wait again.
    #[error(
        "region {id} ({len} bytes at {addr:#x}) is withdrawn but still in use by a poller or peer after {waited:?}; deregister it again later"
    )]
    Busy {
        /// The region's id.
        id: u64,
        /// Its start.
        addr: u64,
        /// Its length.
        len: u64,
        /// How long deregistration waited.
        waited: Duration,
    },
    /// A rail refused to withdraw the region's registration (the provider's error): that
    /// rail may still let peers reach the memory, so it stays mapped and is never freed
    /// while registered there. Call `deregister` again to try again.
    #[error(
        "region {id} ({len} bytes at {addr:#x}) could not be withdrawn from rail {rail}: {reason}; it stays registered there, deregister it again later"
    )]
    Withdraw {
        /// The region's id.
        id: u64,
        /// Its start.
        addr: u64,
        /// Its length.
        len: u64,
        /// The rail that refused.
        rail: usize,
        /// Its error.
        reason: String,
    },
}

/// Why [`Engine::revoke`](super::Engine::revoke) could not finish.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RevokeError {
    /// The engine's control plane has stopped.
    #[error("the control plane has stopped")]
    Stopped,
    /// The engine's control plane did not answer in time (it is stuck).
    #[error("the control plane did not answer")]
    Unresponsive,
    /// Queue pairs of the peer were taken out of service, but a poller or a peer process
    /// had not let go of `queue_pairs` of them when the wait ended (a stopped process, say).
    /// They stay out of service; what they had already started may still finish. Revoking
    /// the peer again waits for them again.
    #[error(
        "{queue_pairs} queue pair(s) of incarnation {peer} still in use after {waited:?}: a poller or the peer process is stopped or stuck"
    )]
    Busy {
        /// The peer.
        peer: railyard_control::Incarnation,
        /// Queue pairs not yet let go of.
        queue_pairs: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The engine's fabric cannot fence a peer: its NIC executes the peer's requests by key
    /// alone, and taking them out of service for one peer is not implemented there. Nothing
    /// was changed. Deregister the memory instead (a withdrawn region is a fence on every
    /// fabric).
    #[error(
        "revoking a peer is not supported on the {fabric} fabric; deregister the memory instead"
    )]
    Unsupported {
        /// The fabric.
        fabric: &'static str,
    },
}

/// Why a peer could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// The peer could not be reached or did not answer its handshake.
    #[error("cannot open peer {addr}: {reason}")]
    Unreachable {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The name does not parse as an address (the p2p directory knows peers by address).
    #[error("{name:?} is not a peer address (host:port)")]
    BadAddress {
        /// What was given.
        name: String,
    },
    /// A segment name the directory cannot resolve.
    #[error("no peer named {name:?}: {reason}")]
    UnknownName {
        /// The name.
        name: String,
        /// Why.
        reason: String,
    },
    /// An open of the same session failed moments ago
    /// ([`FAILED_OPEN_KEPT`](super::FAILED_OPEN_KEPT)); it is not tried again yet.
    #[error("cannot open peer {target}: {reason} (an open failed just now)")]
    RecentlyFailed {
        /// The session.
        target: String,
        /// Why that open failed.
        reason: String,
    },
    /// The control plane stopped.
    #[error(transparent)]
    Control(#[from] ControlError),
}

/// Why a submission was refused. Nothing was queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// A transfer of zero bytes.
    #[error("transfer {transfer} moves zero bytes")]
    Empty {
        /// Its index in the submission.
        transfer: usize,
    },
    /// The local range is not inside its region.
    #[error(
        "transfer {transfer}: local range {offset:#x}+{len} is outside region {region} \
         ({region_len} bytes)"
    )]
    LocalRange {
        /// Its index in the submission.
        transfer: usize,
        /// The region's id.
        region: u64,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The local region is not registered (any more).
    #[error("transfer {transfer}: region {region} is not registered with this engine")]
    UnknownRegion {
        /// Its index in the submission.
        transfer: usize,
        /// The region's id.
        region: u64,
    },
    /// No registered region holds the local range (a transfer named by raw addresses).
    #[error("transfer {transfer}: local range {addr:#x}+{len} is not inside one registered region")]
    LocalUnregistered {
        /// Its index in the submission.
        transfer: usize,
        /// Local start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The remote range is not inside one region the peer registered.
    #[error(
        "transfer {transfer}: remote range {addr:#x}+{len} is not inside one region of peer \
         {peer}"
    )]
    RemoteRange {
        /// Its index in the submission.
        transfer: usize,
        /// The peer's name.
        peer: String,
        /// Remote start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// No rail to the peer has a queue pair yet.
    #[error("peer {peer} is not connected on any rail")]
    NotConnected {
        /// The peer's name.
        peer: String,
    },
    /// A rail's poller stopped.
    #[error("rail {rail}'s poller has stopped")]
    PollerStopped {
        /// The rail.
        rail: usize,
    },
    /// A notification larger than one control frame carries
    /// ([`railyard_control::wire::MAX_NOTIFY`]).
    #[error("a notification of {len} bytes is larger than the {max} bytes one can carry")]
    NotificationTooLarge {
        /// Its length.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    /// A prepared submission's index lists differ in length.
    #[error("{local} local indices but {remote} remote indices: they go in pairs")]
    IndicesMismatch {
        /// Local indices given.
        local: usize,
        /// Remote indices given.
        remote: usize,
    },
    /// An index past the end of its prepared list.
    #[error("pair {position}: {side} index {index} is outside its list of {len} descriptors")]
    IndexOutOfRange {
        /// `local` or `remote`.
        side: &'static str,
        /// The pair's position in the index lists.
        position: usize,
        /// The index.
        index: usize,
        /// The list's length.
        len: usize,
    },
    /// A pair of prepared descriptors of different lengths.
    #[error("pair {position}: the local descriptor has {local} bytes, the remote one {remote}")]
    LengthMismatch {
        /// The pair's position in the index lists.
        position: usize,
        /// The local descriptor's length.
        local: u64,
        /// The remote descriptor's length.
        remote: u64,
    },
    /// A prepared list that may no longer be posted.
    #[error("the {side} list is stale: {reason}")]
    StaleList {
        /// `local` or `remote`.
        side: &'static str,
        /// Why, in words.
        reason: String,
    },
    /// A list prepared by (or for a peer opened by) another engine.
    #[error("the {side} list was prepared by another engine than {engine}")]
    ForeignList {
        /// `local` or `remote`.
        side: &'static str,
        /// This engine's name.
        engine: String,
    },
    /// A prepared submission of more slices than one request counts.
    #[error("{slices} slices; one prepared submission takes at most {max}")]
    TooManyDescriptors {
        /// Slices it would be.
        slices: usize,
        /// The most allowed.
        max: usize,
    },
}

/// Why a list of ranges could not be prepared ([`Engine::prepare_local`],
/// [`Peer::prepare`]).
///
/// [`Engine::prepare_local`]: crate::Engine::prepare_local
/// [`Peer::prepare`]: crate::Peer::prepare
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// A range of zero bytes.
    #[error("descriptor {index} has zero bytes")]
    Empty {
        /// Its index in the list.
        index: usize,
    },
    /// No registered region of this engine holds the range.
    #[error("descriptor {index}: local range {addr:#x}+{len} is not inside one registered region")]
    LocalUnregistered {
        /// Its index in the list.
        index: usize,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// No region of the peer's descriptor holds the range.
    #[error(
        "descriptor {index}: remote range {addr:#x}+{len} is not inside one region of peer {peer}"
    )]
    RemoteRange {
        /// Its index in the list.
        index: usize,
        /// The peer's name.
        peer: String,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
}
