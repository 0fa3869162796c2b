//! What goes over a TCP fabric connection, byte for byte (all little-endian).
//!
//! A connection opens with a [`Hello`] from the dialer: which target queue pair it is for
//! (the token the target handed out at ConnectQp) or that it is a raw sink (the bench's
//! ceiling). Then the initiator sends [`RequestHeader`]s, a WRITE's payload right after its
//! header, and the target answers each request, in order, with a [`ReplyHeader`], a READ's
//! data right after its header. Decoders are total: a malformed frame is an error naming the
//! field, never a panic.

use crate::fabric::WcStatus;

/// First bytes of every hello.
pub(crate) const HELLO_MAGIC: [u8; 8] = *b"RYTCPv01";
/// Bytes of a hello.
pub(crate) const HELLO_LEN: usize = 24;
/// Bytes of a request header.
pub(crate) const REQUEST_LEN: usize = 32;
/// Bytes of a reply header.
pub(crate) const REPLY_LEN: usize = 16;

/// What a dialed connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hello {
    /// Carries an initiator's requests to the target queue pair that handed out `token`.
    QueuePair {
        /// The target's token.
        token: u64,
    },
    /// A plain byte stream the target reads and discards (the bench's raw ceiling).
    Sink,
}

const HELLO_QUEUE_PAIR: u64 = 1;
const HELLO_SINK: u64 = 2;

impl Hello {
    pub(crate) fn encode(self) -> [u8; HELLO_LEN] {
        let (kind, token) = match self {
            Self::QueuePair { token } => (HELLO_QUEUE_PAIR, token),
            Self::Sink => (HELLO_SINK, 0),
        };
        let mut bytes = [0; HELLO_LEN];
        bytes[..8].copy_from_slice(&HELLO_MAGIC);
        bytes[8..16].copy_from_slice(&kind.to_le_bytes());
        bytes[16..].copy_from_slice(&token.to_le_bytes());
        bytes
    }

    pub(crate) fn decode(bytes: &[u8; HELLO_LEN]) -> Result<Self, String> {
        if bytes[..8] != HELLO_MAGIC {
            return Err("not a railyard TCP fabric hello (bad magic)".into());
        }
        let kind = u64::from_le_bytes(word(bytes, 8));
        let token = u64::from_le_bytes(word(bytes, 16));
        match kind {
            HELLO_QUEUE_PAIR => Ok(Self::QueuePair { token }),
            HELLO_SINK if token == 0 => Ok(Self::Sink),
            HELLO_SINK => Err("a sink hello with a token".into()),
            other => Err(format!("unknown hello kind {other}")),
        }
    }
}

/// What a request asks of the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestOp {
    /// Payload follows; the target writes it at `remote_addr`.
    Write,
    /// As `Write`, then the immediate is delivered to the target queue pair's owner.
    WriteWithImm,
    /// The target answers with `len` bytes from `remote_addr`.
    Read,
}

/// One request's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestHeader {
    pub(crate) op: RequestOp,
    pub(crate) len: u32,
    pub(crate) wr_id: u64,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) imm: u32,
}

impl RequestHeader {
    pub(crate) fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut bytes = [0; REQUEST_LEN];
        bytes[0] = match self.op {
            RequestOp::Write => 1,
            RequestOp::WriteWithImm => 2,
            RequestOp::Read => 3,
        };
        bytes[4..8].copy_from_slice(&self.len.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.wr_id.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.remote_addr.to_le_bytes());
        bytes[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.imm.to_le_bytes());
        bytes
    }

    pub(crate) fn decode(bytes: &[u8; REQUEST_LEN]) -> Result<Self, String> {
        let op = match bytes[0] {
            1 => RequestOp::Write,
            2 => RequestOp::WriteWithImm,
            3 => RequestOp::Read,
            other => return Err(format!("request: unknown op {other}")),
        };
        if bytes[1..4] != [0; 3] {
            return Err("request: reserved bytes are not zero".into());
        }
        Ok(Self {
            op,
            len: u32::from_le_bytes(word(bytes, 4)),
            wr_id: u64::from_le_bytes(word(bytes, 8)),
            remote_addr: u64::from_le_bytes(word(bytes, 16)),
            rkey: u32::from_le_bytes(word(bytes, 24)),
            imm: u32::from_le_bytes(word(bytes, 28)),
        })
    }
}

/// One reply's header: the outcome of the request with `wr_id`; for a successful READ, `len`
/// bytes of data follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReplyHeader {
    pub(crate) status: WcStatus,
    pub(crate) len: u32,
    pub(crate) wr_id: u64,
}

/// The statuses a target can answer with.
const REPLY_STATUSES: [WcStatus; 3] = [
    WcStatus::Success,
    WcStatus::RemAccessErr,
    WcStatus::RemInvReqErr,
];

impl ReplyHeader {
    pub(crate) fn encode(&self) -> [u8; REPLY_LEN] {
        let mut bytes = [0; REPLY_LEN];
        bytes[0] = REPLY_STATUSES
            .iter()
            .position(|s| *s == self.status)
            .map_or(u8::MAX, |index| index as u8);
        bytes[4..8].copy_from_slice(&self.len.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.wr_id.to_le_bytes());
        bytes
    }

    pub(crate) fn decode(bytes: &[u8; REPLY_LEN]) -> Result<Self, String> {
        let status = *REPLY_STATUSES
            .get(usize::from(bytes[0]))
            .ok_or_else(|| format!("reply: unknown status {}", bytes[0]))?;
        if bytes[1..4] != [0; 3] {
            return Err("reply: reserved bytes are not zero".into());
        }
        Ok(Self {
            status,
            len: u32::from_le_bytes(word(bytes, 4)),
            wr_id: u64::from_le_bytes(word(bytes, 8)),
        })
    }
}

fn word<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_malformed_ones_are_named() {
        for hello in [Hello::QueuePair { token: 0xDEAD_BEEF }, Hello::Sink] {
            assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        }
        let mut bad = Hello::Sink.encode();
        bad[0] = b'X';
        assert!(Hello::decode(&bad).unwrap_err().contains("magic"));
        bad = Hello::Sink.encode();
        bad[8] = 9;
        assert!(Hello::decode(&bad).unwrap_err().contains("kind 9"));

        for op in [RequestOp::Write, RequestOp::WriteWithImm, RequestOp::Read] {
            let header = RequestHeader {
                op,
                len: 65536,
                wr_id: 0x0102_0304_0506_0708,
                remote_addr: 0x7f00_dead_0000,
                rkey: 0x1234,
                imm: 0xFEED,
            };
            assert_eq!(RequestHeader::decode(&header.encode()), Ok(header));
        }
        let mut bad = [0u8; REQUEST_LEN];
        bad[0] = 7;
        assert!(RequestHeader::decode(&bad).unwrap_err().contains("op 7"));
        bad[0] = 1;
        bad[2] = 1;
        assert!(
            RequestHeader::decode(&bad)
                .unwrap_err()
                .contains("reserved")
        );

        for status in REPLY_STATUSES {
            let reply = ReplyHeader {
                status,
                len: 4096,
                wr_id: 42,
            };
            assert_eq!(ReplyHeader::decode(&reply.encode()), Ok(reply));
        }
        let mut bad = [0u8; REPLY_LEN];
        bad[0] = 200;
        assert!(
            ReplyHeader::decode(&bad)
                .unwrap_err()
                .contains("status 200")
        );
    }
}
