//! The failure policy: every number the endpoint lifecycle uses, with the defaults the
//! design names. Plain data; the state machine in [`crate::endpoint`] reads it.

use std::time::Duration;

/// How endpoints reconnect, count flaps and open circuits, and what one connection may
/// cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// First reconnect delay bound (full jitter: the delay is uniform in `0..bound`).
    pub backoff_min: Duration,
    /// Largest reconnect delay bound.
    pub backoff_max: Duration,
    /// A queue pair that fails (transport) within this long of becoming ready is a flap; so
    /// is a handshake that fails.
    pub flap_after_ready: Duration,
    /// Flaps within [`Self::flap_window`] that open the circuit.
    pub flaps_to_open: u32,
    /// The window flaps are counted in.
    pub flap_window: Duration,
    /// Work-request errors (the slice's fault: a bad key, length or range) within
    /// [`Self::work_request_window`] that replace the queue pair at once; more back off
    /// (up to the window; no flap, so the circuit stays closed for the good slices), so
    /// persistently bad slices cannot replace queue pairs back to back. Default 2.
    pub free_work_request_errors: u32,
    /// See [`Self::free_work_request_errors`]. Default 1 s.
    pub work_request_window: Duration,
    /// First circuit cooldown; each reopening doubles it.
    pub cooldown_min: Duration,
    /// Largest circuit cooldown.
    pub cooldown_max: Duration,
    /// How long a dial and handshake may take; also how long an accepted connection may
    /// stay silent before its Hello.
    pub connect_timeout: Duration,
    /// Accepted connections that may be mid-handshake (before their Hello) at once; more
    /// wait in the kernel's backlog. Default 64.
    pub max_handshakes: usize,
    /// Accepted connections at once; more wait in the kernel's backlog. Default 1024.
    pub max_connections: usize,
    /// Bytes queued for one connection that the peer has not read; beyond this the peer is
    /// closed (it does not read). Default 4 MiB: four of the largest frames.
    pub max_queued_output: usize,
    /// How long a frame that has begun may take to arrive whole, and how long queued output
    /// may wait without the peer taking a byte; a peer that trickles, never finishes a
    /// frame or stops reading is closed. Default 10 s.
    pub frame_timeout: Duration,
    /// Target queue pairs one initiator incarnation may hold here; its next ConnectQp is
    /// refused. Default 256 (16 rails on each side).
    pub max_queue_pairs_per_peer: usize,
    /// Target queue pairs all initiators together may hold here. Default 16 384.
    pub max_target_queue_pairs: usize,
    /// Endpoints of one rail that may hold a queue pair (or be connecting one) at once.
    /// Beyond it, idle endpoints are parked — their queue pairs freed, never one with work
    /// queued or in flight — and connect again at the next epoch when traffic wants them;
    /// an endpoint that finds every other one busy waits for room (counted in
    /// `endpoint_waits`). Default 1 024.
    pub max_endpoints_per_rail: usize,
    /// ConnectQps this process, as a target, answers per turn of its control loop, and how
    /// many may wait for their answer before the initiators of the rest are told to wait
    /// their turn (`ConnectQpQueued`) — which stops their handshake timeout: a burst of
    /// initiators is answered in order instead of timing out and asking again (a
    /// reconnect storm). Default 64.
    pub max_handshakes_per_target: usize,
    /// ConnectQps this process, as an initiator, has out at once (to all targets); more
    /// wait here in order, their handshake timeout stopped. Default 64.
    pub max_handshakes_per_initiator: usize,
    /// How long a handshake may wait its turn (at either cap) before it fails. Default
    /// 30 s; an application's own deadlines still bound its transfers.
    pub handshake_queue_timeout: Duration,
    /// A control connection quiet this long is sent a Ping. Default 250 ms.
    pub keepalive_interval: Duration,
    /// A peer that has said nothing (not even a Pong) on its control connection this long
    /// is unreachable: the connection closes and, if this side dialed it, the endpoints to
    /// it open their circuits at once (their work fails with `PeerUnavailable`). Default
    /// 1.5 s.
    pub liveness_timeout: Duration,
    /// How long the target queue pairs of an initiator with no control connection left are
    /// kept before they are taken out of service (a crashed initiator leaves them
    /// otherwise). Default 30 s.
    pub passive_linger: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_secs(5),
            flap_after_ready: Duration::from_secs(1),
            flaps_to_open: 3,
            flap_window: Duration::from_secs(30),
            free_work_request_errors: 2,
            work_request_window: Duration::from_secs(1),
            cooldown_min: Duration::from_secs(5),
            cooldown_max: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(2),
            max_handshakes: 64,
            max_connections: 1024,
            max_queued_output: 4 << 20,
            frame_timeout: Duration::from_secs(10),
            max_queue_pairs_per_peer: 256,
            max_target_queue_pairs: 16 * 1024,
            max_endpoints_per_rail: 1024,
            max_handshakes_per_target: 64,
            max_handshakes_per_initiator: 64,
            handshake_queue_timeout: Duration::from_secs(30),
            passive_linger: Duration::from_secs(30),
            keepalive_interval: Duration::from_millis(250),
            liveness_timeout: Duration::from_millis(1500),
        }
    }
}

impl Policy {
    /// The delay bound of reconnect attempt `attempt` (0 = first): `backoff_min · 2^attempt`,
    /// at most `backoff_max`.
    pub fn backoff_bound(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.backoff_min
            .checked_mul(factor)
            .map_or(self.backoff_max, |bound| bound.min(self.backoff_max))
    }

    /// The cooldown of the circuit's `opening`-th opening (0 = first), doubled each time up
    /// to `cooldown_max`.
    pub fn cooldown(&self, opening: u32) -> Duration {
        let factor = 1u32.checked_shl(opening.min(31)).unwrap_or(u32::MAX);
        self.cooldown_min
            .checked_mul(factor)
            .map_or(self.cooldown_max, |cooldown| {
                cooldown.min(self.cooldown_max)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_and_cooldown_double_up_to_their_caps() {
        let policy = Policy::default();
        assert_eq!(policy.backoff_bound(0), Duration::from_millis(10));
        assert_eq!(policy.backoff_bound(3), Duration::from_millis(80));
        assert_eq!(policy.backoff_bound(9), Duration::from_secs(5));
        assert_eq!(policy.backoff_bound(u32::MAX), Duration::from_secs(5));
        assert_eq!(policy.cooldown(0), Duration::from_secs(5));
        assert_eq!(policy.cooldown(1), Duration::from_secs(10));
        assert_eq!(policy.cooldown(6), Duration::from_secs(300));
        assert_eq!(policy.cooldown(100), Duration::from_secs(300));
    }
}
