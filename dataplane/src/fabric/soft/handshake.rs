//! Connecting soft queue pairs: the exchange of [`QpInfo`] and shared-memory descriptors over
//! a Unix socket.
//!
//! The dialer sends a HELLO frame with its queue pair's info, the access it grants, its
//! device incarnation, its pid and the address of its region table's magic, with two
//! descriptors attached (SCM_RIGHTS): its region table and its queue pair's inbox. The
//! listener checks the frame, checks that the claimed pid is the one the kernel reports for
//! the socket (SO_PEERCRED), maps the table read-only and the inbox read-write, proves it
//! can reach the dialer's memory by reading the magic with `process_vm_readv`, brings its own
//! queue pair to RTS and answers ACCEPT with the same contents; the dialer makes the same
//! checks. Any failure answers REJECT with the reason, and the dialer reports it. Every
//! step is bounded by [`SoftConfig::handshake_timeout`](super::SoftConfig).
//!
//! Frame (256 bytes, little-endian): magic `RYSHAKE1`, kind (1 HELLO, 2 ACCEPT, 3 REJECT),
//! access bits, [`QpInfo`] (32 bytes), incarnation, probe address, pid, then for REJECT a
//! reason of up to 184 bytes of UTF-8 at byte 72.

use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::device::SoftDevice;
use super::error::SoftError;
use super::qp::{Peer, PeerFacts, SoftQp};
use super::sys;
use crate::fabric::{Access, QpInfo};

const MAGIC: [u8; 8] = *b"RYSHAKE1";
const FRAME_LEN: usize = 256;
const REASON_AT: usize = 72;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Hello = 1,
    Accept = 2,
    Reject = 3,
}

/// One side's half of the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frame {
    kind: Kind,
    access: Access,
    info: QpInfo,
    incarnation: u64,
    probe_addr: u64,
    pid: u32,
}

impl Frame {
    fn encode(&self) -> [u8; FRAME_LEN] {
        let mut out = [0u8; FRAME_LEN];
        out[0..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&(self.kind as u32).to_le_bytes());
        out[12..16].copy_from_slice(&self.access.bits().to_le_bytes());
        out[16..48].copy_from_slice(&self.info.encode());
        out[48..56].copy_from_slice(&self.incarnation.to_le_bytes());
        out[56..64].copy_from_slice(&self.probe_addr.to_le_bytes());
        out[64..68].copy_from_slice(&self.pid.to_le_bytes());
        out
    }

    /// Reads a frame; `Err` holds what is wrong with it.
    fn decode(bytes: &[u8; FRAME_LEN]) -> Result<Self, String> {
        if bytes[0..8] != MAGIC {
            return Err("not a railyard soft-fabric handshake (bad magic)".into());
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let kind = match u32_at(8) {
            1 => Kind::Hello,
            2 => Kind::Accept,
            3 => {
                let reason = &bytes[REASON_AT..];
                let end = reason.iter().position(|&b| b == 0).unwrap_or(reason.len());
                return Err(format!(
                    "the peer rejected the handshake: {}",
                    String::from_utf8_lossy(&reason[..end])
                ));
            }
            other => return Err(format!("unknown handshake frame kind {other}")),
        };
        let info = QpInfo::decode(&bytes[16..48]).map_err(|error| error.to_string())?;
        Ok(Self {
            kind,
            access: Access::from_bits_truncate(u32_at(12)),
            info,
            incarnation: u64_at(48),
            probe_addr: u64_at(56),
            pid: u32_at(64),
        })
    }
}

fn reject_frame(reason: &str) -> [u8; FRAME_LEN] {
    let mut out = [0u8; FRAME_LEN];
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&(Kind::Reject as u32).to_le_bytes());
    let mut end = reason.len().min(FRAME_LEN - REASON_AT);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    out[REASON_AT..REASON_AT + end].copy_from_slice(&reason.as_bytes()[..end]);
    out
}

/// Accepts soft-fabric handshakes on a Unix socket path. The socket file is removed when the
/// listener is dropped.
#[derive(Debug)]
pub struct SoftListener {
    device: SoftDevice,
    listener: UnixListener,
    path: PathBuf,
}

impl SoftListener {
    /// Listens on `path` (which must not exist).
    ///
    /// # Errors
    /// [`SoftError::Io`] when the socket cannot be bound.
    pub fn bind(device: &SoftDevice, path: impl AsRef<Path>) -> Result<Self, SoftError> {
        let path = path.as_ref().to_path_buf();
        let listener = UnixListener::bind(&path).map_err(|source| SoftError::Io {
            what: "bind the handshake socket",
            source,
        })?;
        Ok(Self {
            device: device.clone(),
            listener,
            path,
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for one peer, completes its handshake and returns the connected (RTS) queue
    /// pair, through which the peer may do `access`.
    ///
    /// # Errors
    /// [`SoftError::Io`] when accepting fails; [`SoftError::Handshake`] or
    /// [`SoftError::ProbeRefused`] when the peer's handshake is refused (it is told why).
    pub fn accept(&self, access: Access) -> Result<SoftQp, SoftError> {
        let (stream, _) = self.listener.accept().map_err(|source| SoftError::Io {
            what: "accept a handshake connection",
            source,
        })?;
        let peer_name = self.path.display().to_string();
        let failed = |reason: String| SoftError::Handshake {
            peer: peer_name.clone(),
            reason,
        };
        set_timeouts(&self.device, &stream).map_err(|e| failed(e.to_string()))?;
        let mut bytes = [0u8; FRAME_LEN];
        let fds = sys::recv_with_fds(&stream, &mut bytes)
            .map_err(|error| failed(format!("reading the peer's hello: {error}")))?;
        let result = Frame::decode(&bytes)
            .and_then(|hello| {
                if hello.kind == Kind::Hello {
                    Ok(hello)
                } else {
                    Err("expected a hello frame".to_string())
                }
            })
            .map_err(failed)
            .and_then(|hello| {
                let mut qp = self.device.create_qp(access)?;
                qp.modify_to_init()?;
                let peer = attach(&self.device, &stream, &hello, fds, &peer_name)?;
                qp.modify_to_rtr(peer)?;
                qp.modify_to_rts()?;
                Ok(qp)
            });
        match result {
            Ok(qp) => {
                send_frame(&self.device, &stream, Kind::Accept, &qp)
                    .map_err(|e| failed(format!("sending the accept: {e}")))?;
                Ok(qp)
            }
            Err(error) => {
                // Best effort: the peer learns why; our error is the one that matters here.
                let _ = (&stream).write_all(&reject_frame(&error.to_string()));
                Err(error)
            }
        }
    }
}

impl Drop for SoftListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn set_timeouts(device: &SoftDevice, stream: &UnixStream) -> io::Result<()> {
    let timeout = Some(device.config().handshake_timeout);
    stream.set_read_timeout(timeout)?;
    stream.set_write_timeout(timeout)
}

fn send_frame(device: &SoftDevice, stream: &UnixStream, kind: Kind, qp: &SoftQp) -> io::Result<()> {
    let frame = Frame {
        kind,
        access: qp.access(),
        info: qp.info(),
        incarnation: device.incarnation(),
        probe_addr: device.table().probe_addr(),
        pid: device.pid(),
    };
    sys::send_with_fds(
        stream,
        &frame.encode(),
        &[device.table().fd(), qp.inbox_fd().as_fd()],
    )
}

/// Checks the peer's frame and descriptors and builds our view of the peer.
fn attach(
    device: &SoftDevice,
    stream: &UnixStream,
    frame: &Frame,
    fds: Vec<OwnedFd>,
    peer_name: &str,
) -> Result<Peer, SoftError> {
    let failed = |reason: String| SoftError::Handshake {
        peer: peer_name.to_string(),
        reason,
    };
    let kernel_pid = sys::peer_pid(stream).map_err(|e| failed(format!("SO_PEERCRED: {e}")))?;
    if i64::from(kernel_pid) != i64::from(frame.pid) {
        return Err(failed(format!(
            "the peer claims pid {} but the kernel says {kernel_pid}",
            frame.pid
        )));
    }
    let [table_fd, inbox_fd]: [OwnedFd; 2] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
        failed(format!(
            "expected 2 descriptors (region table, inbox), got {}",
            fds.len()
        ))
    })?;
    Peer::attach(
        &PeerFacts {
            info: frame.info,
            access: frame.access,
            pid: frame.pid,
            incarnation: frame.incarnation,
            probe_addr: frame.probe_addr,
        },
        table_fd,
        inbox_fd,
        device.pid(),
    )
    .map_err(|error| match error {
        SoftError::Handshake { reason, .. } => failed(reason),
        other => other,
    })
}

/// Connects a new queue pair (through which the peer may do `access`) to the listener at
/// `path`, and returns it in RTS.
///
/// # Errors
/// [`SoftError::Io`] when the socket cannot be reached; [`SoftError::Handshake`] when the
/// peer rejects us or answers nonsense; [`SoftError::ProbeRefused`] when its memory cannot be
/// accessed.
pub fn dial(
    device: &SoftDevice,
    path: impl AsRef<Path>,
    access: Access,
) -> Result<SoftQp, SoftError> {
    let path = path.as_ref();
    let peer_name = path.display().to_string();
    let failed = |reason: String| SoftError::Handshake {
        peer: peer_name.clone(),
        reason,
    };
    let stream = UnixStream::connect(path).map_err(|e| failed(format!("connect: {e}")))?;
    set_timeouts(device, &stream).map_err(|e| failed(e.to_string()))?;
    let mut qp = device.create_qp(access)?;
    qp.modify_to_init()?;
    send_frame(device, &stream, Kind::Hello, &qp)
        .map_err(|e| failed(format!("sending the hello: {e}")))?;
    let mut bytes = [0u8; FRAME_LEN];
    let fds = sys::recv_with_fds(&stream, &mut bytes)
        .map_err(|e| failed(format!("reading the answer: {e}")))?;
    let accept = Frame::decode(&bytes).map_err(&failed)?;
    if accept.kind != Kind::Accept {
        return Err(failed("expected an accept frame".into()));
    }
    let peer = attach(device, &stream, &accept, fds, &peer_name)?;
    qp.modify_to_rtr(peer)?;
    qp.modify_to_rts()?;
    Ok(qp)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_named() {
        let frame = Frame {
            kind: Kind::Hello,
            access: Access::REMOTE_WRITE,
            info: QpInfo {
                qp_num: 5,
                lid: 0,
                gid: [1; 16],
                psn: 0x12_3456,
                path_mtu: 4096,
            },
            incarnation: 77,
            probe_addr: 0x7f00_0000,
            pid: 1234,
        };
        assert_eq!(Frame::decode(&frame.encode()), Ok(frame));
        let mut bad = frame.encode();
        bad[0] = b'X';
        assert!(Frame::decode(&bad).unwrap_err().contains("bad magic"));
        let mut bad = frame.encode();
        bad[44..48].copy_from_slice(&1000u32.to_le_bytes());
        assert!(Frame::decode(&bad).unwrap_err().contains("path MTU 1000"));
        let reject = reject_frame("the region table is malformed");
        assert_eq!(
            Frame::decode(&reject).unwrap_err(),
            "the peer rejected the handshake: the region table is malformed"
        );
        let long = "é".repeat(200);
        let truncated = Frame::decode(&reject_frame(&long)).unwrap_err();
        assert!(
            truncated.ends_with(&"é".repeat(92)),
            "cut at a character boundary"
        );
    }
}
