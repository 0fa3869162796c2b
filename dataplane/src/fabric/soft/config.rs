//! [`SoftConfig`]: how a soft device behaves — how soon a dead peer is noticed, how long a
//! full receiver is waited for, how deep a send queue is and how long a handshake may take.

use std::time::Duration;

/// How a soft device behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftConfig {
    /// How often, at most, a queue pair with queued work checks that its peer process lives.
    /// A dead peer is reported (RETRY_EXC_ERR) within this much of the next poll.
    pub liveness_interval: Duration,
    /// How long a WRITE_WITH_IMM waits for room in the receiver's inbox before
    /// RETRY_EXC_ERR.
    pub peer_timeout: Duration,
    /// Work requests a queue pair queues before `post` refuses more (verbs' `max_send_wr`).
    pub send_queue_depth: usize,
    /// Longest a handshake may take, per step.
    pub handshake_timeout: Duration,
}

impl Default for SoftConfig {
    fn default() -> Self {
        Self {
            liveness_interval: Duration::from_millis(1),
            peer_timeout: Duration::from_millis(200),
            send_queue_depth: 16 * 1024,
            handshake_timeout: Duration::from_secs(2),
        }
    }
}
