//! The handshake wire format: versioned binary frames over TCP.
//!
//! A frame is a 12-byte header — magic `RYCP`, version (u16), message type (u16), body
//! length (u32, at most [`MAX_BODY`]) — then the body. All integers are little-endian;
//! strings and byte strings are a u32 length then the bytes, each with its own bound;
//! lists are a u32 count then the items, and a count that the rest of the body could not
//! hold is refused before anything is allocated.
//!
//! After the handshake of a process with a cluster secret, each frame is followed by a
//! [`TAG_LEN`]-byte tag and its body may be encrypted ([`crate::session`]); the header's
//! length counts the body only. [`FrameDecoder::protect`] turns the checking on.
//!
//! The decoder is total: every byte string yields a message, "need more bytes", or a
//! [`WireError`] naming what is wrong — never a panic and never an allocation larger than
//! the body bound ([`FrameDecoder`] refuses an oversized length from the header alone).

use railyard_dataplane::fabric::{Access, QpInfo};

use crate::descriptor::{RailDescriptor, RegionDescriptor, SegmentDescriptor};
use crate::endpoint::Incarnation;
use crate::host::HostId;
use crate::session::{FrameOpener, FrameSealer, TAG_LEN, Unauthentic};

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"RYCP";
/// The protocol version this build speaks. Version 9 protects every frame after the
/// handshake ([`crate::session`]) and says in its Hello whether it wants encryption.
pub const VERSION: u16 = 9;
/// Header bytes.
pub const HEADER_LEN: usize = 12;
/// Largest body accepted.
pub const MAX_BODY: usize = 1 << 20;
/// Longest name or address string.
pub const MAX_STRING: usize = 4096;
/// Most bytes one notification carries (the body also holds the target and a length).
pub const MAX_NOTIFY: usize = MAX_BODY - 12;
/// Longest fabric attachment.
pub const MAX_ATTACHMENT: usize = 1024;
/// Bytes of a Hello's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an Auth's MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// Which endpoint a ConnectQp is for: the dialer's incarnation, the listener incarnation the
/// dialer means (a process that took over the address refuses what was meant for its
/// predecessor), and the two rails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireKey {
    /// The dialing process.
    pub initiator: Incarnation,
    /// The listening process the dialer means.
    pub target: Incarnation,
    /// The dialer's rail.
    pub initiator_rail: u16,
    /// The listener's rail.
    pub target_rail: u16,
}

/// A queue pair's side of a connection: verbs' info plus fabric-specific bytes (the soft
/// fabric's attachment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpSide {
    /// QP number, LID, GID, PSN, path MTU.
    pub info: QpInfo,
    /// What else the fabric needs to connect (empty for verbs).
    pub attachment: Vec<u8>,
}

/// One handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Who is speaking: the process's name, incarnation, host and handshake listener.
    Hello {
        /// Segment name.
        name: String,
        /// Process incarnation.
        incarnation: Incarnation,
        /// Its host and PID namespace (which fabric can reach it).
        host: HostId,
        /// Where its handshake listener is, as it bound it (an unspecified IP means the
        /// address the connection comes from); empty when it does not listen. A new
        /// incarnation announcing an address means the one that listened there is gone.
        listen: String,
        /// Fresh random bytes for this connection: with a cluster secret, each side's
        /// [`Message::Auth`] covers both sides' Hellos, nonces included, so a recorded
        /// handshake proves nothing on another connection. They also salt the connection's
        /// session keys.
        nonce: [u8; NONCE_LEN],
        /// The sender wants frames after the handshake encrypted (`--encrypt-control`);
        /// either side asking is enough.
        encrypt: bool,
    },
    /// Proof of the cluster secret (sent only when the process has one): HMAC-SHA256 under
    /// the secret over the role of the sender and both sides' Hellos of this connection
    /// ([`crate::auth`]). The dialer proves first; nothing but Hello, Auth and Bye is
    /// accepted before both sides have.
    Auth {
        /// The MAC.
        mac: [u8; MAC_LEN],
    },
    /// Asks for the listener's segment descriptor.
    GetDescriptor,
    /// The listener's segment descriptor.
    Descriptor(SegmentDescriptor),
    /// Connect a queue pair for an endpoint at an epoch.
    ConnectQp {
        /// The endpoint.
        key: WireKey,
        /// The epoch of the dialer's queue pair.
        epoch: u64,
        /// Random per attempt: the reply names it, so it reaches only the endpoint that
        /// asked, and only while it still waits for this attempt.
        handshake: u64,
        /// The dialer's queue pair.
        side: QpSide,
    },
    /// The answer to a ConnectQp: the listener's queue pair, or why not.
    ConnectQpReply {
        /// The endpoint.
        key: WireKey,
        /// The epoch asked for.
        epoch: u64,
        /// The request's handshake id.
        handshake: u64,
        /// The listener's fence generation for the dialer: bumped each time the listener
        /// revoked it. A dialer that sees it change between two of its queue pairs fails
        /// every slice prepared before the new one (`Revoked`).
        fence: u64,
        /// The listener's side, or the reason it refused.
        result: Result<QpSide, String>,
    },
    /// The listener has more ConnectQps in progress than it works on at once: this one
    /// waits its turn behind `ahead` others, and the dialer stops its handshake timeout
    /// until the reply comes (within its queue timeout). Sent only for a ConnectQp that
    /// waits; the reply follows in order.
    ConnectQpQueued {
        /// The endpoint.
        key: WireKey,
        /// The epoch asked for.
        epoch: u64,
        /// The request's handshake id.
        handshake: u64,
        /// ConnectQps the listener will answer first.
        ahead: u32,
    },
    /// The dialer took its queue pair `qp_num` for the endpoint out of service (it failed,
    /// timed out, or the endpoint retired): the listener drops the passive queue pair
    /// connected to it, if that is still the one, so that nothing still buffered from it
    /// executes. Idempotent; ignored for any other queue pair.
    RetireQp {
        /// The endpoint.
        key: WireKey,
        /// The epoch of the dialer's queue pair.
        epoch: u64,
        /// The dialer's queue-pair number (as its ConnectQp named it).
        qp_num: u32,
    },
    /// Application bytes for one listener incarnation: a process that took over the
    /// address refuses what was meant for its predecessor.
    Notify {
        /// The incarnation the sender means.
        target: Incarnation,
        /// What it says.
        bytes: Vec<u8>,
    },
    /// The sender is closing the connection.
    Bye,
    /// Are you there? Sent on a connection that has been quiet; answered with [`Self::Pong`].
    Ping {
        /// Echoed in the answer.
        nonce: u64,
    },
    /// The answer to a [`Self::Ping`].
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
}

/// Why bytes are not a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a railyard control-plane frame.
    #[error("not a railyard handshake frame (magic {found:02x?})")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A version this build does not speak.
    #[error(
        "the peer speaks control protocol version {found} and this build speaks {VERSION}: run the same railyard release on every member{}",
        if *found < 9 { " (versions before 9 do not authenticate frames after the handshake)" } else { "" }
    )]
    Version {
        /// The version found.
        found: u16,
    },
    /// A body longer than [`MAX_BODY`].
    #[error("frame body of {len} bytes exceeds the {MAX_BODY}-byte bound")]
    TooLong {
        /// The length in the header.
        len: u32,
    },
    /// An unknown message type.
    #[error("unknown message type {found}")]
    UnknownType {
        /// The type found.
        found: u16,
    },
    /// The body ends inside a field.
    #[error("message body ends inside {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// A field's value is not allowed.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A frame after the handshake failed its check ([`crate::session`]).
    #[error(transparent)]
    Unauthentic(#[from] Unauthentic),
    /// Bytes left over after the message.
    #[error("{extra} bytes after the end of the message")]
    Trailing {
        /// How many.
        extra: usize,
    },
}

const HELLO: u16 = 1;
const GET_DESCRIPTOR: u16 = 2;
const DESCRIPTOR: u16 = 3;
const CONNECT_QP: u16 = 4;
const CONNECT_QP_REPLY: u16 = 5;
const NOTIFY: u16 = 6;
const BYE: u16 = 7;
const RETIRE_QP: u16 = 8;
const PING: u16 = 9;
const PONG: u16 = 10;
const AUTH: u16 = 11;
const CONNECT_QP_QUEUED: u16 = 12;

/// Appends fields to a body.
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
    fn string(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    fn side(&mut self, side: &QpSide) {
        self.0.extend_from_slice(&side.info.encode());
        self.bytes(&side.attachment);
    }
    fn key(&mut self, key: &WireKey) {
        self.u64(key.initiator.0);
        self.u64(key.target.0);
        self.u16(key.initiator_rail);
        self.u16(key.target_rail);
    }
}

/// Reads fields from a body; every read is bounds-checked.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.rest.len() < n {
            return Err(WireError::Truncated { field });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    fn bytes(&mut self, max: usize, field: &'static str) -> Result<Vec<u8>, WireError> {
        let len = self.u32(field)? as usize;
        if len > max {
            return Err(WireError::Invalid {
                field,
                reason: format!("{len} bytes, at most {max} allowed"),
            });
        }
        Ok(self.take(len, field)?.to_vec())
    }
    fn string(&mut self, field: &'static str) -> Result<String, WireError> {
        String::from_utf8(self.bytes(MAX_STRING, field)?).map_err(|_| WireError::Invalid {
            field,
            reason: "not UTF-8".into(),
        })
    }
    /// A list count whose items take at least `item_len` bytes each.
    fn count(&mut self, item_len: usize, field: &'static str) -> Result<usize, WireError> {
        let count = self.u32(field)? as usize;
        if count.saturating_mul(item_len) > self.rest.len() {
            return Err(WireError::Truncated { field });
        }
        Ok(count)
    }
    fn side(&mut self) -> Result<QpSide, WireError> {
        let info =
            QpInfo::decode(self.take(QpInfo::WIRE_LEN, "queue pair info")?).map_err(|error| {
                WireError::Invalid {
                    field: "queue pair info",
                    reason: error.to_string(),
                }
            })?;
        let attachment = self.bytes(MAX_ATTACHMENT, "fabric attachment")?;
        Ok(QpSide { info, attachment })
    }
    fn key(&mut self) -> Result<WireKey, WireError> {
        Ok(WireKey {
            initiator: Incarnation(self.u64("initiator incarnation")?),
            target: Incarnation(self.u64("target incarnation")?),
            initiator_rail: self.u16("initiator rail")?,
            target_rail: self.u16("target rail")?,
        })
    }
    fn finish(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing {
                extra: self.rest.len(),
            })
        }
    }
}

fn write_descriptor(w: &mut Writer, d: &SegmentDescriptor) {
    w.string(&d.name);
    w.u64(d.incarnation.0);
    w.string(&d.handshake_addr);
    w.u32(d.rails.len() as u32);
    for rail in &d.rails {
        w.string(&rail.name);
        w.u8(rail.fabric);
        w.u16(rail.tcp_port);
        w.bytes(&rail.address);
    }
    w.u32(d.regions.len() as u32);
    for region in &d.regions {
        w.u64(region.base);
        w.u64(region.len);
        w.u64(region.generation);
        w.u8(region.access.bits() as u8);
        w.u32(region.rkeys.len() as u32);
        for rkey in &region.rkeys {
            w.u32(*rkey);
        }
    }
}

fn read_descriptor(r: &mut Reader<'_>) -> Result<SegmentDescriptor, WireError> {
    let name = r.string("segment name")?;
    let incarnation = Incarnation(r.u64("incarnation")?);
    let handshake_addr = r.string("handshake address")?;
    let rail_count = r.count(11, "rail count")?;
    let mut rails = Vec::with_capacity(rail_count);
    for _ in 0..rail_count {
        rails.push(RailDescriptor {
            name: r.string("rail name")?,
            fabric: r.u8("rail fabric")?,
            tcp_port: r.u16("rail TCP port")?,
            address: r.bytes(MAX_ATTACHMENT, "rail address")?,
        });
    }
    let region_count = r.count(29, "region count")?;
    let mut regions = Vec::with_capacity(region_count);
    for _ in 0..region_count {
        let base = r.u64("region base")?;
        let len = r.u64("region length")?;
        let generation = r.u64("region generation")?;
        let bits = u32::from(r.u8("region access")?);
        let access = Access::from_bits_truncate(bits);
        if access.bits() != bits {
            return Err(WireError::Invalid {
                field: "region access",
                reason: format!("unknown flags {bits:#x}"),
            });
        }
        let rkey_count = r.count(4, "rkey count")?;
        let mut rkeys = Vec::with_capacity(rkey_count);
        for _ in 0..rkey_count {
            rkeys.push(r.u32("rkey")?);
        }
        if base.checked_add(len).is_none() {
            return Err(WireError::Invalid {
                field: "region",
                reason: format!("{len} bytes at {base:#x} wrap around"),
            });
        }
        regions.push(RegionDescriptor {
            base,
            len,
            rkeys,
            generation,
            access,
        });
    }
    Ok(SegmentDescriptor {
        name,
        incarnation,
        handshake_addr,
        rails,
        regions,
    })
}

impl Message {
    /// The whole frame: header and body.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Writer::default();
        let kind = match self {
            Self::Hello {
                name,
                incarnation,
                host,
                listen,
                nonce,
                encrypt,
            } => {
                body.string(name);
                body.u64(incarnation.0);
                for byte in host.boot_id {
                    body.u8(byte);
                }
                body.u64(host.pid_namespace);
                body.string(listen);
                for &byte in nonce {
                    body.u8(byte);
                }
                body.u8(u8::from(*encrypt));
                HELLO
            }
            Self::Auth { mac } => {
                for &byte in mac {
                    body.u8(byte);
                }
                AUTH
            }
            Self::GetDescriptor => GET_DESCRIPTOR,
            Self::Descriptor(descriptor) => {
                write_descriptor(&mut body, descriptor);
                DESCRIPTOR
            }
            Self::ConnectQp {
                key,
                epoch,
                handshake,
                side,
            } => {
                body.key(key);
                body.u64(*epoch);
                body.u64(*handshake);
                body.side(side);
                CONNECT_QP
            }
            Self::ConnectQpReply {
                key,
                epoch,
                handshake,
                fence,
                result,
            } => {
                body.key(key);
                body.u64(*epoch);
                body.u64(*handshake);
                body.u64(*fence);
                match result {
                    Ok(side) => {
                        body.u8(0);
                        body.side(side);
                    }
                    Err(reason) => {
                        body.u8(1);
                        body.string(reason);
                    }
                }
                CONNECT_QP_REPLY
            }
            Self::ConnectQpQueued {
                key,
                epoch,
                handshake,
                ahead,
            } => {
                body.key(key);
                body.u64(*epoch);
                body.u64(*handshake);
                body.u32(*ahead);
                CONNECT_QP_QUEUED
            }
            Self::RetireQp { key, epoch, qp_num } => {
                body.key(key);
                body.u64(*epoch);
                body.u32(*qp_num);
                RETIRE_QP
            }
            Self::Notify { target, bytes } => {
                body.u64(target.0);
                body.bytes(bytes);
                NOTIFY
            }
            Self::Bye => BYE,
            Self::Ping { nonce } => {
                body.u64(*nonce);
                PING
            }
            Self::Pong { nonce } => {
                body.u64(*nonce);
                PONG
            }
        };
        let mut frame = Vec::with_capacity(HEADER_LEN + body.0.len());
        frame.extend_from_slice(&MAGIC);
        frame.extend_from_slice(&VERSION.to_le_bytes());
        frame.extend_from_slice(&kind.to_le_bytes());
        frame.extend_from_slice(&(body.0.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body.0);
        frame
    }

    /// Reads one message of type `kind` from a whole body.
    ///
    /// # Errors
    /// [`WireError`] naming the field that is wrong.
    pub fn decode_body(kind: u16, body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader { rest: body };
        let message = match kind {
            HELLO => Self::Hello {
                name: r.string("name")?,
                incarnation: Incarnation(r.u64("incarnation")?),
                host: HostId {
                    boot_id: r.array("boot id")?,
                    pid_namespace: r.u64("pid namespace")?,
                },
                listen: r.string("listen address")?,
                nonce: r.array("nonce")?,
                encrypt: match r.u8("encryption flag")? {
                    0 => false,
                    1 => true,
                    other => {
                        return Err(WireError::Invalid {
                            field: "encryption flag",
                            reason: format!("{other} is neither 0 nor 1"),
                        });
                    }
                },
            },
            AUTH => Self::Auth {
                mac: r.array("auth mac")?,
            },
            GET_DESCRIPTOR => Self::GetDescriptor,
            DESCRIPTOR => Self::Descriptor(read_descriptor(&mut r)?),
            CONNECT_QP => Self::ConnectQp {
                key: r.key()?,
                epoch: r.u64("epoch")?,
                handshake: r.u64("handshake id")?,
                side: r.side()?,
            },
            CONNECT_QP_REPLY => {
                let key = r.key()?;
                let epoch = r.u64("epoch")?;
                let handshake = r.u64("handshake id")?;
                let fence = r.u64("fence generation")?;
                let result = match r.u8("reply status")? {
                    0 => Ok(r.side()?),
                    1 => Err(r.string("refusal reason")?),
                    other => {
                        return Err(WireError::Invalid {
                            field: "reply status",
                            reason: format!("{other} is neither 0 (ok) nor 1 (refused)"),
                        });
                    }
                };
                Self::ConnectQpReply {
                    key,
                    epoch,
                    handshake,
                    fence,
                    result,
                }
            }
            CONNECT_QP_QUEUED => Self::ConnectQpQueued {
                key: r.key()?,
                epoch: r.u64("epoch")?,
                handshake: r.u64("handshake id")?,
                ahead: r.u32("handshakes ahead")?,
            },
            RETIRE_QP => Self::RetireQp {
                key: r.key()?,
                epoch: r.u64("epoch")?,
                qp_num: r.u32("queue pair number")?,
            },
            NOTIFY => Self::Notify {
                target: Incarnation(r.u64("target incarnation")?),
                bytes: r.bytes(MAX_BODY, "notify bytes")?,
            },
            BYE => Self::Bye,
            PING => Self::Ping {
                nonce: r.u64("nonce")?,
            },
            PONG => Self::Pong {
                nonce: r.u64("nonce")?,
            },
            found => return Err(WireError::UnknownType { found }),
        };
        r.finish()?;
        Ok(message)
    }
}

/// Checks a frame header; returns (message type, body length).
///
/// # Errors
/// Bad magic, unsupported version or an oversized body.
pub fn decode_header(header: &[u8; HEADER_LEN]) -> Result<(u16, usize), WireError> {
    let magic = [header[0], header[1], header[2], header[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION {
        return Err(WireError::Version { found: version });
    }
    let kind = u16::from_le_bytes([header[6], header[7]]);
    let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if len as usize > MAX_BODY {
        return Err(WireError::TooLong { len });
    }
    Ok((kind, len as usize))
}

impl FrameSealer {
    /// Protects `frame` (a whole frame as [`Message::encode`] made it): encrypts its body if
    /// the session encrypts, and appends the tag. Frames must be sealed in the order they
    /// are written.
    pub fn seal(&mut self, frame: &mut Vec<u8>) {
        debug_assert!(frame.len() >= HEADER_LEN, "a whole frame");
        let (header, body) = frame.split_at_mut(HEADER_LEN);
        let tag = self.seal_parts(header, body);
        frame.extend_from_slice(&tag);
    }
}

/// Splits a byte stream into messages. Holds at most one whole frame's worth of bytes
/// ([`FRAME_BOUND`]): the reader asks [`Self::room`] how much it may push, and decodes before
/// reading more. Decoding a message costs its own length (a cursor moves; the buffer is
/// compacted once per push), and an emptied buffer gives back what it grew beyond
/// [`Self::KEPT_CAPACITY`].
#[derive(Debug)]
pub struct FrameDecoder {
    buffer: Vec<u8>,
    /// Where the next undecoded byte is.
    start: usize,
    /// The largest body the next frame may declare.
    max_body: usize,
    /// Checks each frame's tag, once the handshake has protected the stream.
    opener: Option<FrameOpener>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self {
            buffer: Vec::new(),
            start: 0,
            max_body: MAX_BODY,
            opener: None,
        }
    }
}

/// The largest body a Hello can have (a name and an address of [`MAX_STRING`] bytes and the
/// fixed fields): what a connection's first frame may declare.
pub const MAX_HELLO_BODY: usize = 2 * (4 + MAX_STRING) + 8 + 16 + 8 + NONCE_LEN + 1;

/// The most bytes a [`FrameDecoder`] buffers: one header, the largest body and a tag.
pub const FRAME_BOUND: usize = HEADER_LEN + MAX_BODY + TAG_LEN;

impl FrameDecoder {
    /// Capacity an empty decoder keeps; more is released.
    pub const KEPT_CAPACITY: usize = 64 * 1024;

    /// Appends bytes read from the stream.
    ///
    /// # Errors
    /// [`WireError::TooLong`] (and nothing is kept) when the buffer would exceed
    /// [`FRAME_BOUND`]: the reader pushed more than [`Self::room`] allowed.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), WireError> {
        if bytes.len() > self.room() {
            return Err(WireError::TooLong {
                len: u32::try_from(self.buffered() + bytes.len()).unwrap_or(u32::MAX),
            });
        }
        if self.start > 0 {
            self.buffer.drain(..self.start);
            self.start = 0;
        }
        self.buffer.extend_from_slice(bytes);
        Ok(())
    }

    fn buffered(&self) -> usize {
        self.buffer.len() - self.start
    }

    /// Bounds the body the following frames may declare (at most [`MAX_BODY`]): before a
    /// peer has said Hello, a frame larger than a Hello is refused from its header alone.
    pub fn set_max_body(&mut self, max_body: usize) {
        self.max_body = max_body.min(MAX_BODY);
    }

    /// From the next frame on, each frame is followed by a tag that `opener` must accept
    /// (and its body is decrypted if the session encrypts).
    pub fn protect(&mut self, opener: FrameOpener) {
        self.opener = Some(opener);
    }

    /// How many more bytes [`Self::push`] accepts.
    pub fn room(&self) -> usize {
        FRAME_BOUND - self.buffered()
    }

    /// Whether part of a frame is buffered.
    pub fn is_partial(&self) -> bool {
        self.buffered() > 0
    }

    /// The next whole message, `Ok(None)` when more bytes are needed.
    ///
    /// # Errors
    /// The first malformed frame, or the first that fails its check
    /// ([`WireError::Unauthentic`]); the stream cannot be trusted after it.
    pub fn next_message(&mut self) -> Result<Option<Message>, WireError> {
        let rest = &mut self.buffer[self.start..];
        let Some(header) = rest.first_chunk::<HEADER_LEN>().copied() else {
            return Ok(None);
        };
        let checked = decode_header(&header).and_then(|(kind, len)| {
            if len > self.max_body {
                return Err(WireError::TooLong { len: len as u32 });
            }
            Ok((kind, len))
        });
        let (kind, len) = match (checked, &mut self.opener) {
            (Ok(header), _) => header,
            // Once frames are protected, a magic or version no sender writes was changed on
            // the path. (A length beyond the bound stays what it says: a peer may send a
            // descriptor too large to take.)
            (Err(WireError::BadMagic { .. } | WireError::Version { .. }), Some(opener)) => {
                return Err(opener.refuse().into());
            }
            (Err(error), _) => return Err(error),
        };
        let tag_len = if self.opener.is_some() { TAG_LEN } else { 0 };
        let Some(frame) = rest.get_mut(..HEADER_LEN + len + tag_len) else {
            return Ok(None);
        };
        let (body, tag) = frame[HEADER_LEN..].split_at_mut(len);
        if let Some(opener) = &mut self.opener {
            let tag = (&*tag).try_into().unwrap_or_else(|_| unreachable!());
            opener.open(&header, body, tag)?;
        }
        let message = Message::decode_body(kind, body);
        self.start += HEADER_LEN + len + tag_len;
        if self.start == self.buffer.len() {
            self.buffer.clear();
            self.buffer.shrink_to(Self::KEPT_CAPACITY);
            self.start = 0;
        }
        message.map(Some)
    }

    /// Decodes exactly one whole frame.
    ///
    /// # Errors
    /// A malformed frame, a partial one, or bytes after it.
    pub fn decode_frame(bytes: &[u8]) -> Result<Message, WireError> {
        let mut decoder = Self::default();
        decoder.push(bytes)?;
        let message = decoder
            .next_message()?
            .ok_or(WireError::Truncated { field: "frame" })?;
        if decoder.is_partial() {
            return Err(WireError::Trailing {
                extra: decoder.buffered(),
            });
        }
        Ok(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn qp_info() -> impl Strategy<Value = QpInfo> {
        (
            1u32..1 << 24,
            any::<u16>(),
            any::<[u8; 16]>(),
            0u32..1 << 24,
            0usize..5,
        )
            .prop_map(|(qp_num, lid, gid, psn, mtu)| QpInfo {
                qp_num,
                lid,
                gid,
                psn,
                path_mtu: railyard_dataplane::fabric::PATH_MTUS[mtu],
            })
    }

    fn side() -> impl Strategy<Value = QpSide> {
        (qp_info(), prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(info, attachment)| QpSide { info, attachment })
    }

    fn key() -> impl Strategy<Value = WireKey> {
        (any::<u64>(), any::<u64>(), any::<u16>(), any::<u16>()).prop_map(|(i, t, a, b)| WireKey {
            initiator: Incarnation(i),
            target: Incarnation(t),
            initiator_rail: a,
            target_rail: b,
        })
    }

    fn descriptor() -> impl Strategy<Value = SegmentDescriptor> {
        let rail = (
            "[a-z0-9_]{0,12}",
            any::<u8>(),
            any::<u16>(),
            prop::collection::vec(any::<u8>(), 0..24),
        )
            .prop_map(|(name, fabric, tcp_port, address)| RailDescriptor {
                name,
                fabric,
                tcp_port,
                address,
            });
        let region = (
            0u64..1 << 47,
            0u64..1 << 40,
            any::<u64>(),
            prop::collection::vec(any::<u32>(), 0..4),
        )
            .prop_map(|(base, len, generation, rkeys)| RegionDescriptor {
                access: Access::from_bits_truncate(generation as u32),
                base,
                len,
                rkeys,
                generation,
            });
        (
            "\\PC{0,16}",
            any::<u64>(),
            "[0-9.:]{0,21}",
            prop::collection::vec(rail, 0..4),
            prop::collection::vec(region, 0..6),
        )
            .prop_map(|(name, incarnation, handshake_addr, rails, regions)| {
                SegmentDescriptor {
                    name,
                    incarnation: Incarnation(incarnation),
                    handshake_addr,
                    rails,
                    regions,
                }
            })
    }

    fn message() -> impl Strategy<Value = Message> {
        prop_oneof![
            (
                "\\PC{0,24}",
                any::<u64>(),
                any::<[u8; 16]>(),
                any::<u64>(),
                "[0-9.:]{0,21}",
                any::<[u8; NONCE_LEN]>(),
                any::<bool>(),
            )
                .prop_map(
                    |(name, i, boot_id, pid_namespace, listen, nonce, encrypt)| {
                        Message::Hello {
                            name,
                            incarnation: Incarnation(i),
                            host: HostId {
                                boot_id,
                                pid_namespace,
                            },
                            listen,
                            nonce,
                            encrypt,
                        }
                    }
                ),
            any::<[u8; MAC_LEN]>().prop_map(|mac| Message::Auth { mac }),
            Just(Message::GetDescriptor),
            descriptor().prop_map(Message::Descriptor),
            (key(), any::<u64>(), any::<u64>(), side()).prop_map(
                |(key, epoch, handshake, side)| Message::ConnectQp {
                    key,
                    epoch,
                    handshake,
                    side,
                }
            ),
            (key(), any::<u64>(), any::<u64>(), any::<u64>(), side()).prop_map(
                |(key, epoch, handshake, fence, side)| Message::ConnectQpReply {
                    key,
                    epoch,
                    handshake,
                    fence,
                    result: Ok(side),
                }
            ),
            (
                key(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                "\\PC{0,40}"
            )
                .prop_map(|(key, epoch, handshake, fence, reason)| {
                    Message::ConnectQpReply {
                        key,
                        epoch,
                        handshake,
                        fence,
                        result: Err(reason),
                    }
                }),
            (key(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
                |(key, epoch, handshake, ahead)| Message::ConnectQpQueued {
                    key,
                    epoch,
                    handshake,
                    ahead,
                }
            ),
            (key(), any::<u64>(), any::<u32>())
                .prop_map(|(key, epoch, qp_num)| { Message::RetireQp { key, epoch, qp_num } }),
            (any::<u64>(), prop::collection::vec(any::<u8>(), 0..128)).prop_map(
                |(target, bytes)| Message::Notify {
                    target: Incarnation(target),
                    bytes,
                }
            ),
            Just(Message::Bye),
            any::<u64>().prop_map(|nonce| Message::Ping { nonce }),
            any::<u64>().prop_map(|nonce| Message::Pong { nonce }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips(message in message()) {
            let frame = message.encode();
            prop_assert_eq!(FrameDecoder::decode_frame(&frame), Ok(message));
        }

        #[test]
        fn any_bytes_decode_to_a_message_or_an_error(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(message) = FrameDecoder::decode_frame(&bytes) {
                prop_assert_eq!(message.encode(), bytes.clone(), "decoding is canonical");
            }
            let mut decoder = FrameDecoder::default();
            decoder.push(&bytes).unwrap();
            let _ = decoder.next_message();
        }

        #[test]
        fn any_body_of_any_type_decodes_or_errs(kind in 0u16..12, body in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = Message::decode_body(kind, &body);
        }

        #[test]
        fn every_truncation_asks_for_more_and_every_corruption_is_caught_or_harmless(
            message in message(),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            bits in 1u8..=255,
        ) {
            let frame = message.encode();
            let cut = cut.index(frame.len());
            let mut decoder = FrameDecoder::default();
            decoder.push(&frame[..cut]).unwrap();
            prop_assert_eq!(decoder.next_message(), Ok(None));
            decoder.push(&frame[cut..]).unwrap();
            prop_assert_eq!(decoder.next_message(), Ok(Some(message)));
            let mut corrupt = frame.clone();
            corrupt[flip.index(frame.len())] ^= bits;
            if let Ok(decoded) = FrameDecoder::decode_frame(&corrupt) {
                prop_assert_eq!(decoded.encode(), corrupt, "a corruption that decodes is canonical");
            }
        }
    }

    #[test]
    fn an_oversized_length_is_refused_from_the_header_alone() {
        let mut frame = Message::Bye.encode();
        frame[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut decoder = FrameDecoder::default();
        decoder.push(&frame).unwrap();
        assert_eq!(
            decoder.next_message(),
            Err(WireError::TooLong { len: u32::MAX })
        );
    }

    #[test]
    fn the_largest_notification_fills_the_largest_body_and_a_byte_more_is_refused() {
        let largest = Message::Notify {
            target: Incarnation(1),
            bytes: vec![5; MAX_NOTIFY],
        };
        let frame = largest.encode();
        assert_eq!(frame.len(), HEADER_LEN + MAX_BODY);
        assert_eq!(FrameDecoder::decode_frame(&frame), Ok(largest));
        let over = Message::Notify {
            target: Incarnation(1),
            bytes: vec![5; MAX_NOTIFY + 1],
        }
        .encode();
        let header: [u8; HEADER_LEN] = over[..HEADER_LEN].try_into().unwrap();
        assert_eq!(
            decode_header(&header),
            Err(WireError::TooLong {
                len: MAX_BODY as u32 + 1
            })
        );
    }

    #[test]
    fn bytes_after_a_message_are_refused() {
        for message in [Message::Bye, Message::GetDescriptor] {
            let mut frame = message.encode();
            frame.push(0);
            let len = (frame.len() - HEADER_LEN) as u32;
            frame[8..12].copy_from_slice(&len.to_le_bytes());
            assert_eq!(
                FrameDecoder::decode_frame(&frame),
                Err(WireError::Trailing { extra: 1 }),
                "{message:?}"
            );
        }
    }

    #[test]
    fn a_bounded_decoder_refuses_a_larger_frame_from_its_header() {
        let hello = Message::Hello {
            name: "n".repeat(MAX_STRING),
            incarnation: Incarnation(1),
            host: HostId::default(),
            listen: "1".repeat(MAX_STRING),
            nonce: [7; NONCE_LEN],
            encrypt: true,
        }
        .encode();
        assert_eq!(
            hello.len(),
            HEADER_LEN + MAX_HELLO_BODY,
            "the largest Hello fits"
        );
        let mut decoder = FrameDecoder::default();
        decoder.set_max_body(MAX_HELLO_BODY);
        decoder.push(&hello).unwrap();
        assert!(matches!(
            decoder.next_message(),
            Ok(Some(Message::Hello { .. }))
        ));
        let notify = Message::Notify {
            target: Incarnation(1),
            bytes: vec![0; MAX_HELLO_BODY],
        }
        .encode();
        decoder.push(&notify[..HEADER_LEN]).unwrap();
        assert_eq!(
            decoder.next_message(),
            Err(WireError::TooLong {
                len: (MAX_HELLO_BODY + 12) as u32
            })
        );
    }

    #[test]
    fn the_decoder_holds_at_most_one_frame() {
        let mut decoder = FrameDecoder::default();
        decoder.push(&vec![0u8; FRAME_BOUND - 1]).unwrap();
        assert_eq!(decoder.room(), 1);
        assert!(decoder.is_partial());
        assert_eq!(
            decoder.push(&[0, 0]),
            Err(WireError::TooLong {
                len: FRAME_BOUND as u32 + 1
            })
        );
        assert_eq!(decoder.room(), 1, "a refused push keeps nothing");
        let frame = Message::Bye.encode();
        let mut decoder = FrameDecoder::default();
        decoder.push(&frame).unwrap();
        assert_eq!(decoder.next_message(), Ok(Some(Message::Bye)));
        assert!(!decoder.is_partial());
        assert_eq!(decoder.room(), FRAME_BOUND);
    }

    #[test]
    fn the_decoder_takes_exactly_one_frame_bound_and_keeps_only_undecoded_bytes() {
        let mut decoder = FrameDecoder::default();
        assert_eq!(decoder.room(), HEADER_LEN + MAX_BODY + TAG_LEN);
        decoder
            .push(&vec![0u8; HEADER_LEN + MAX_BODY + TAG_LEN - 1])
            .unwrap();
        decoder.push(&[0]).unwrap();
        assert_eq!(decoder.room(), 0, "exactly the room is taken");

        // A stream read in pieces that never end on a frame boundary: each push compacts,
        // so the buffer holds what is not decoded yet and no more.
        let frame = Message::Ping { nonce: 7 }.encode();
        let stream: Vec<u8> = std::iter::repeat_n(frame.as_slice(), 200)
            .flatten()
            .copied()
            .collect();
        let mut decoder = FrameDecoder::default();
        let mut decoded = 0;
        for piece in stream.chunks(frame.len() + 5) {
            decoder.push(piece).unwrap();
            while let Some(message) = decoder.next_message().unwrap() {
                assert_eq!(message, Message::Ping { nonce: 7 });
                decoded += 1;
            }
            let undecoded = decoder.buffered();
            assert!(undecoded < frame.len());
            assert_eq!(decoder.room(), FRAME_BOUND - undecoded);
            assert!(decoder.buffer.len() < 2 * frame.len() + 5, "compacted");
        }
        assert_eq!(decoded, 200);
        assert!(!decoder.is_partial());
    }

    #[test]
    fn an_emptied_decoder_keeps_its_working_capacity_and_gives_back_the_rest() {
        let mut decoder = FrameDecoder::default();
        let large = Message::Notify {
            target: Incarnation(1),
            bytes: vec![1; 4 * FrameDecoder::KEPT_CAPACITY],
        };
        decoder.push(&large.encode()).unwrap();
        assert_eq!(decoder.next_message(), Ok(Some(large)));
        let kept = decoder.buffer.capacity();
        assert!(
            (FrameDecoder::KEPT_CAPACITY..2 * FrameDecoder::KEPT_CAPACITY).contains(&kept),
            "{kept}"
        );
        assert_eq!(FrameDecoder::KEPT_CAPACITY, 64 * 1024);
    }

    #[test]
    fn a_list_count_larger_than_the_body_is_refused_before_allocating() {
        let mut w = Writer::default();
        w.string("peer");
        w.u64(1);
        w.string("127.0.0.1:1");
        w.u32(u32::MAX); // rails
        assert_eq!(
            Message::decode_body(DESCRIPTOR, &w.0),
            Err(WireError::Truncated {
                field: "rail count"
            })
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let mut frame = Message::GetDescriptor.encode();
        frame[4] = 8;
        let refused = FrameDecoder::decode_frame(&frame);
        assert_eq!(refused, Err(WireError::Version { found: 8 }));
        let said = refused.expect_err("refused").to_string();
        assert!(
            said.contains("version 8") && said.contains("before 9 do not authenticate"),
            "{said}"
        );
        frame[4] = 10;
        assert_eq!(
            FrameDecoder::decode_frame(&frame),
            Err(WireError::Version { found: 10 })
        );
        assert!(matches!(
            FrameDecoder::decode_frame(b"GET / HTTP/1.1\r\n"),
            Err(WireError::BadMagic { .. })
        ));
        let mut bye = Message::Bye.encode();
        bye[6] = 99;
        assert_eq!(
            FrameDecoder::decode_frame(&bye),
            Err(WireError::UnknownType { found: 99 })
        );
    }
}
