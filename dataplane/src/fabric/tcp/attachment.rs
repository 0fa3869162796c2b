//! [`TcpAttachment`]: what a TCP queue pair's side tells its peer beyond its `QpInfo` — an
//! initiator's kind, a target's address and token — and the bytes that carry it.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use super::error::TcpError;

/// What a queue pair's side tells the peer beyond its [`QpInfo`](crate::fabric::QpInfo).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpAttachment {
    /// An initiator: it dials, so it has nothing to say but which fabric it is.
    Initiator,
    /// A target: where to dial and the token to say in the hello.
    Target {
        /// The target rail's data port.
        addr: SocketAddr,
        /// Names the target queue pair.
        token: u64,
    },
}

const ATTACHMENT_MAGIC: [u8; 4] = *b"RYTC";
const INITIATOR: u8 = 1;
const TARGET: u8 = 2;

impl TcpAttachment {
    /// Bytes of an encoded target attachment (an initiator's is the first 5).
    pub const TARGET_LEN: usize = 4 + 1 + 1 + 16 + 2 + 8;

    /// Whether `bytes` are a TCP attachment (rather than another fabric's).
    pub fn is_tcp(bytes: &[u8]) -> bool {
        bytes.starts_with(&ATTACHMENT_MAGIC)
    }

    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = ATTACHMENT_MAGIC.to_vec();
        match *self {
            Self::Initiator => bytes.push(INITIATOR),
            Self::Target { addr, token } => {
                bytes.push(TARGET);
                let (family, ip) = match addr.ip() {
                    IpAddr::V4(v4) => (4, v4.to_ipv6_mapped().octets()),
                    IpAddr::V6(v6) => (6, v6.octets()),
                };
                bytes.push(family);
                bytes.extend_from_slice(&ip);
                bytes.extend_from_slice(&addr.port().to_le_bytes());
                bytes.extend_from_slice(&token.to_le_bytes());
            }
        }
        bytes
    }

    /// Decodes the wire form.
    ///
    /// # Errors
    /// [`TcpError::Attachment`] naming what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, TcpError> {
        let bad = |what: &str| TcpError::Attachment(what.to_string());
        if !Self::is_tcp(bytes) {
            return Err(bad("not a TCP attachment (bad magic)"));
        }
        match (bytes.get(4), bytes.len()) {
            (Some(&INITIATOR), 5) => Ok(Self::Initiator),
            (Some(&TARGET), Self::TARGET_LEN) => {
                let mut ip = [0; 16];
                ip.copy_from_slice(&bytes[6..22]);
                let ip = match bytes[5] {
                    4 => IpAddr::V4(
                        Ipv6Addr::from(ip)
                            .to_ipv4_mapped()
                            .ok_or_else(|| bad("an IPv4 address that is not IPv4-mapped"))?,
                    ),
                    6 => IpAddr::V6(Ipv6Addr::from(ip)),
                    other => return Err(bad(&format!("unknown address family {other}"))),
                };
                let port = u16::from_le_bytes([bytes[22], bytes[23]]);
                let mut token = [0; 8];
                token.copy_from_slice(&bytes[24..32]);
                Ok(Self::Target {
                    addr: SocketAddr::new(ip, port),
                    token: u64::from_le_bytes(token),
                })
            }
            (Some(&INITIATOR | &TARGET), len) => Err(bad(&format!(
                "{len} bytes is the wrong length for its kind"
            ))),
            (Some(other), _) => Err(bad(&format!("unknown kind {other}"))),
            (None, _) => Err(bad("no kind")),
        }
    }
}
