//! [`TcpConfig`]: how a TCP device behaves — how long a silent peer and a dial are waited
//! for, its sockets' buffers, how deep a send queue is and whether raw sink streams are served.

use std::time::Duration;

/// How a TCP device behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Longest outstanding work may wait without the peer sending or taking a byte before
    /// it fails with RETRY_EXC_ERR.
    pub peer_timeout: Duration,
    /// Longest a dial (connect and hello) may take; also how long an accepted connection
    /// may take to say hello.
    pub connect_timeout: Duration,
    /// SO_SNDBUF / SO_RCVBUF of data connections; `None` keeps the kernel's autotuning.
    pub socket_buffer: Option<usize>,
    /// Work requests a queue pair queues before `post` refuses more.
    pub send_queue_depth: usize,
    /// Whether a raw byte stream (a sink hello: the bench's ceiling across hosts) is read
    /// and discarded. Off by default: it is not bound to any handshake, and serving it costs
    /// a 64 MiB buffer.
    pub accept_sinks: bool,
    /// Most accepted connections bound to no queue pair (waiting for their hello, or raw
    /// sink streams); beyond it the oldest of them is closed, so that clients that connect
    /// and say nothing can neither exhaust this process's file descriptors nor hold slots
    /// that real peers need. (One accepted less than 20 ms ago is not closed: accepting
    /// pauses instead, so up to 8 more may wait that long; 0 keeps none longer.)
    pub max_half_open: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            peer_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            socket_buffer: None,
            send_queue_depth: 16 * 1024,
            accept_sinks: false,
            max_half_open: 64,
        }
    }
}
