//! What the master and its clients say to each other after the handshake: requests, replies
//! and the events the master pushes (fences, finished unmounts), each frame a 4-byte
//! little-endian length and a `postcard` body.
//!
//! A connection opens with the control plane's own handshake (`Hello`, then with a cluster
//! secret `Auth` both ways, [`railyard_engine::control::auth`]), so the master admits exactly
//! the processes a railyard peer would. With a secret, every frame after it carries a tag
//! under the connection's session keys, with a sequence number
//! ([`railyard_engine::control::session`]): a frame changed, dropped, replayed, reordered
//! or injected on the path fails its check and closes the connection.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use railyard_engine::control::session::{FrameOpener, FrameSealer, TAG_LEN};

use serde::{Deserialize, Serialize};

use crate::config::ReplicaConfig;
use crate::error::StoreError;
use crate::master::{
    ClientId, FenceId, MasterStats, PutId, PutTicket, ReplicaDescriptor, SegmentId, SegmentSpec,
};

/// The protocol's version, in the first frame after the handshake.
pub const PROTOCOL_VERSION: u32 = 2;

/// The largest frame either side accepts (a batch of many keys).
pub const MAX_FRAME: usize = 64 << 20;

/// How much of a frame's body is set aside at a time while it arrives.
const READ_CHUNK: usize = 64 << 10;

/// One value of a batch put-start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutItem {
    /// The key.
    pub key: String,
    /// The value's size in bytes.
    pub size: u64,
}

/// A complete object's replicas and how long the reader's lease lasts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLease {
    /// The value's size.
    pub size: u64,
    /// Its complete replicas.
    pub replicas: Vec<ReplicaDescriptor>,
    /// The lease, from when the master answered.
    pub lease: Duration,
}

/// A request to the master. Batch requests answer one result per item.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// The first frame: the client's protocol version.
    Open {
        /// [`PROTOCOL_VERSION`].
        version: u32,
    },
    /// Mount a segment the client contributes.
    Mount(SegmentSpec),
    /// Start unmounting a segment ([`crate::master::MasterCore::unmount_segment`]).
    Unmount {
        /// The segment.
        segment: SegmentId,
        /// Time for readers pointed at it to finish.
        grace: Duration,
    },
    /// Place replicas for each value (upsert: over a complete object too).
    PutStart {
        /// The values.
        items: Vec<PutItem>,
        /// How every one of them is replicated.
        config: ReplicaConfig,
        /// Replace complete objects.
        upsert: bool,
        /// Handshake addresses of holders not to place on: dead as far as the client's
        /// engine can tell, which the master may not know yet.
        avoid: Vec<String>,
    },
    /// The writes are complete.
    PutEnd {
        /// (key, write) pairs.
        items: Vec<(String, PutId)>,
    },
    /// The writes failed; every transfer of them has resolved.
    PutRevoke {
        /// (key, write) pairs.
        items: Vec<(String, PutId)>,
    },
    /// Complete replicas and a lease, per key.
    Get {
        /// The keys.
        keys: Vec<String>,
    },
    /// Whether each key names a complete object.
    Exists {
        /// The keys.
        keys: Vec<String>,
    },
    /// Remove each key.
    Remove {
        /// The keys.
        keys: Vec<String>,
        /// Despite leases and writes in progress.
        force: bool,
    },
    /// Remove every object `Remove` would.
    RemoveAll {
        /// Despite leases and writes in progress.
        force: bool,
    },
    /// Keys of complete objects.
    Keys,
    /// What the master holds.
    Stats,
    /// The client, as the owner of a segment, fenced a zombie writer.
    Fenced {
        /// The fence.
        fence: FenceId,
    },
    /// The client attached to a new master with none of its writes (placed by an earlier
    /// one) in flight: no owner needs to fence it.
    Quiesced,
    /// Nothing: the client is alive (sent every [`KEEPALIVE`], the master's only sign of
    /// life from an idle member).
    Ping,
}

/// How often a client speaks to the master when it has nothing else to say: a quarter of
/// the master's default silence bound, as the control plane's keepalives are of its
/// liveness timeout.
pub const KEEPALIVE: Duration = Duration::from_millis(250);

/// How long a client hears nothing from its master (every ping is answered) before it
/// takes it for stopped and attaches again: the control plane's liveness timeout.
pub const MASTER_SILENCE: Duration = Duration::from_millis(1500);

impl Request {
    /// Its name in metrics (`put_start`, `get`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Open { .. } => "open",
            Self::Mount(_) => "mount",
            Self::Unmount { .. } => "unmount",
            Self::PutStart { .. } => "put_start",
            Self::PutEnd { .. } => "put_end",
            Self::PutRevoke { .. } => "put_revoke",
            Self::Get { .. } => "get",
            Self::Exists { .. } => "exists",
            Self::Remove { .. } => "remove",
            Self::RemoveAll { .. } => "remove_all",
            Self::Keys => "keys",
            Self::Stats => "stats",
            Self::Fenced { .. } => "fenced",
            Self::Ping => "ping",
            Self::Quiesced => "quiesced",
        }
    }
}

/// The master's answer to one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// To `Open`: the master's version and the id it knows the client by.
    Opened {
        /// The master's [`PROTOCOL_VERSION`].
        version: u32,
        /// The client (its engine incarnation, from its Hello).
        client: ClientId,
    },
    /// To `Mount`.
    Mounted(Result<SegmentId, StoreError>),
    /// To `Unmount`, `Fenced`.
    Done(Result<(), StoreError>),
    /// To `PutStart`.
    Tickets(Vec<Result<PutTicket, StoreError>>),
    /// To `PutEnd`, `PutRevoke`, `Remove`.
    Each(Vec<Result<(), StoreError>>),
    /// To `Get`.
    Leases(Vec<Result<WireLease, StoreError>>),
    /// To `Exists`.
    Exists(Vec<Result<bool, StoreError>>),
    /// To `RemoveAll`.
    Removed(u64),
    /// To `Keys`.
    Keys(Vec<String>),
    /// To `Stats`.
    Stats(Box<MasterStats>),
    /// The request could not be read or is not allowed on this connection.
    Refused(String),
}

/// A frame from the client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToMaster {
    /// Echoed in the reply.
    pub id: u64,
    /// The request.
    pub request: Request,
}

/// A frame from the master.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ToClient {
    /// The answer to request `id`.
    Reply {
        /// The request's id.
        id: u64,
        /// The answer.
        reply: Reply,
    },
    /// The client owns `segment`: revoke `writer` on its engine, then send
    /// [`Request::Fenced`].
    Fence {
        /// The fence.
        fence: FenceId,
        /// The segment written.
        segment: SegmentId,
        /// The zombie writer.
        writer: ClientId,
    },
    /// The client's segment is unmounted: its memory may be deregistered.
    Unmounted {
        /// The segment.
        segment: SegmentId,
    },
}

/// A connection's write half: its stream and, with a cluster secret, what seals its frames
/// in the order they are written.
pub struct FrameWriter<W = TcpStream> {
    stream: W,
    sealer: Option<FrameSealer>,
}

impl<W: Write> FrameWriter<W> {
    /// Frames written to `stream`, sealed by `sealer` if the connection has session keys.
    pub fn new(stream: W, sealer: Option<FrameSealer>) -> Self {
        Self { stream, sealer }
    }

    /// Writes `value` as one frame: its length, its body and, with session keys, its tag.
    ///
    /// # Errors
    /// The value cannot be encoded, is larger than [`MAX_FRAME`], or the write failed
    /// (perhaps halfway: the connection is no good any more).
    pub fn write<T: Serialize>(&mut self, value: &T) -> io::Result<()> {
        let body = postcard::to_stdvec(value)
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
        if body.len() > MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a frame of {} bytes; at most {MAX_FRAME}", body.len()),
            ));
        }
        let len = (body.len() as u32).to_le_bytes();
        let mut frame = Vec::with_capacity(len.len() + body.len() + TAG_LEN);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&body);
        if let Some(sealer) = &mut self.sealer {
            let tag = sealer.seal_parts(&len, &mut frame[len.len()..]);
            frame.extend_from_slice(&tag);
        }
        self.stream.write_all(&frame)
    }

    /// What the frames were written to.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.stream
    }
}

impl FrameWriter<TcpStream> {
    /// Closes the connection both ways.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// What a frame that failed its check is read as: `PermissionDenied`, told apart from a
/// malformed frame (`InvalidData`) and from the connection ending.
pub fn is_unauthentic(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::PermissionDenied
}

/// Reads one frame, checked by `opener` if the connection has session keys; a malformed or
/// oversized one is an `InvalidData` error, one that fails its check a `PermissionDenied`
/// one ([`is_unauthentic`]).
pub fn read_frame<T: for<'de> Deserialize<'de>>(
    stream: &mut impl Read,
    opener: Option<&mut FrameOpener>,
) -> io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let body_len = u32::from_le_bytes(len) as usize;
    if body_len > MAX_FRAME {
        // With session keys no sender writes such a length: it was changed on the path.
        let kind = match opener {
            Some(_) => io::ErrorKind::PermissionDenied,
            None => io::ErrorKind::InvalidData,
        };
        return Err(io::Error::new(
            kind,
            format!("a frame of {body_len} bytes; at most {MAX_FRAME}"),
        ));
    }
    // Grown a chunk at a time as bytes arrive, not allocated at the length the header
    // claims: before the tag is checked that length is the sender's word, and a peer that
    // claims 64 MiB and sends nothing must cost nothing.
    let mut body = Vec::new();
    while body.len() < body_len {
        let start = body.len();
        body.resize(start + (body_len - start).min(READ_CHUNK), 0);
        stream.read_exact(&mut body[start..])?;
    }
    if let Some(opener) = opener {
        let mut tag = [0u8; TAG_LEN];
        stream.read_exact(&mut tag)?;
        opener
            .open(&len, &mut body, &tag)
            .map_err(|unauthentic| io::Error::new(io::ErrorKind::PermissionDenied, unauthentic))?;
    }
    postcard::from_bytes(&body).map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))
}

#[cfg(test)]
#[path = "protocol_tests.rs"]
mod tests;
