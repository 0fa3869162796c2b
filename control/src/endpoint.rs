//! The endpoint lifecycle: a pure state machine per endpoint (local rail → one rail of one
//! peer incarnation).
//!
//! Inputs are [`Input`]s and timeouts, each with `now`; outputs are [`Output`] commands for
//! the caller to carry out (create and hand over queue pairs, retire, open or close the
//! circuit) and the next timeout ([`Endpoint::next_timeout`]). Nothing here reads a clock,
//! opens a socket or draws ambient randomness: the jitter generator is seeded by the caller.
//! So a test replays a reconnect storm with virtual time in microseconds, and the same seed
//! gives the same decisions.
//!
//! ```text
//!  Idle ──wanted──▶ Connecting(e) ──done──▶ Ready(e) ──work-request error──▶ Connecting(e+1)
//!                     │    ▲                  │                                  (at once,
//!              failed/│    │timer             │transport error                   no flap)
//!              timeout▼    │                  ▼
//!                    Backoff ◀────────── (flap? count it; 3 in 30 s ──▶ CircuitOpen)
//!                                                          CircuitOpen ──cooldown──▶ Connecting
//!        any live state ──peer unreachable (no Pong)──▶    (on probation: the first
//!                                                          success closes it for good)
//! ```
//!
//! Who is charged: a work-request error (LOC_LEN, LOC_PROT, REM_ACCESS, REM_INV_REQ) is the
//! slice's fault — the queue pair is replaced at once, no flap is counted, and the descriptor
//! is refreshed so the slice can be re-prepared once; but beyond
//! [`Policy::free_work_request_errors`] within [`Policy::work_request_window`] they back off
//! (up to that window, still no flap), so a run of persistently bad slices cannot replace
//! queue pairs back to back, nor open the circuit on the good slices behind them. A transport error (RETRY_EXC, a flush
//! on a live queue pair, QP fatal) or a failed handshake is the peer's: it backs off with
//! full jitter, and counts as a flap when the queue pair had been ready for less than
//! [`Policy::flap_after_ready`] (a failed handshake always does). Enough flaps open the
//! circuit: the poller fails the endpoint's slices with `PeerUnavailable` until a cooldown
//! (doubling each time) has passed and a new queue pair has carried a successful completion.

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

use railyard_dataplane::fabric::WcStatus;
use railyard_dataplane::rng::SplitMix64;
use railyard_dataplane::{Epoch, FailReason};

use crate::policy::Policy;

/// A process's random identity, chosen at start: a restarted process is a new incarnation,
/// even on the same host and port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(pub u64);

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What identifies an endpoint: never a host or port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    /// The peer process.
    pub peer: Incarnation,
    /// Our rail.
    pub local_rail: u16,
    /// The peer's rail.
    pub remote_rail: u16,
}

impl fmt::Display for EndpointKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rail {} → {}/rail {}",
            self.local_rail, self.peer, self.remote_rail
        )
    }
}

/// What happened, as the endpoint learns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// The application wants traffic to flow to this endpoint.
    ConnectWanted,
    /// The handshake for `epoch` finished: a connected queue pair is ready to hand over.
    HandshakeDone {
        /// Its epoch.
        epoch: Epoch,
    },
    /// The handshake for `epoch` failed (dial refused, timeout, rejection), or the poller
    /// could not adopt its queue pair.
    HandshakeFailed {
        /// Its epoch.
        epoch: Epoch,
    },
    /// The queue pair of `epoch` failed with an error completion.
    QpError {
        /// Its epoch.
        epoch: Epoch,
        /// The status.
        status: WcStatus,
    },
    /// The queue pair of `epoch` raised QP_FATAL.
    QpFatal {
        /// Its epoch.
        epoch: Epoch,
    },
    /// The first successful completion on the queue pair of `epoch`.
    Confirmed {
        /// Its epoch.
        epoch: Epoch,
    },
    /// The peer came back as a new incarnation: this endpoint is for the old one.
    PeerRestarted,
    /// A cluster directory lost the peer's lease (it died, stalled, or lost etcd): new work
    /// fails fast until it is back. Not terminal: a lease lost by a healthy process is
    /// claimed again.
    PeerGone,
    /// The directory sees the same incarnation again (it claimed its name anew): try a
    /// queue pair now instead of waiting out the cooldown.
    PeerReturned,
    /// The peer stopped answering on its control connection (no Pong within the liveness
    /// timeout): it may be stopped, partitioned or dead without a reset.
    PeerUnreachable,
    /// The application no longer wants the endpoint.
    Retire,
    /// The handshake of `epoch` waits its turn (at this side's cap on handshakes out, or at
    /// the target's on handshakes in): its timeout becomes the queue timeout.
    HandshakeQueued {
        /// Its epoch.
        epoch: Epoch,
    },
    /// The handshake of `epoch` that waited here is sent now: its timeout is the connect
    /// timeout again.
    HandshakeSent {
        /// Its epoch.
        epoch: Epoch,
    },
    /// Its queue pair was freed while it was idle (parked, to stay within the rail's queue
    /// pairs) and traffic wants it again: connect a new one at the next epoch. Not a
    /// failure: nothing is counted against the peer.
    Wake,
}

/// What the caller must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Dial the peer if no connection is open, create a queue pair and run the ConnectQp
    /// handshake for `epoch`; answer with [`Input::HandshakeDone`] or
    /// [`Input::HandshakeFailed`].
    CreateQp {
        /// The epoch the new queue pair gets.
        epoch: Epoch,
    },
    /// Hand the connected queue pair of `epoch` to the poller (AddEndpoint / BumpEpoch).
    ConnectQp {
        /// Its epoch.
        epoch: Epoch,
    },
    /// Fetch the peer's descriptor again before slices are re-prepared: a work request
    /// named keys or ranges the peer refused.
    RefreshDescriptor,
    /// Retire the endpoint in the poller; its slices fail with `reason`.
    RetireEndpoint {
        /// What its slices fail with.
        reason: FailReason,
    },
    /// Open the circuit: the poller fails the backlog and new slices with `PeerUnavailable`.
    OpenCircuit,
    /// Close the circuit: slices flow again.
    CloseCircuit,
    /// The peer is unreachable: take the current queue pair out of service (the circuit is
    /// open), so that what is posted on it is flushed and fails with `PeerUnavailable`.
    Unreachable,
}

/// Where an endpoint stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Nothing wanted yet.
    Idle,
    /// A handshake is running for an epoch.
    Connecting,
    /// A queue pair carries traffic.
    Ready,
    /// Waiting before reconnecting.
    Backoff,
    /// Failing fast until the cooldown ends.
    CircuitOpen,
    /// Gone for good.
    Retired,
}

impl Phase {
    /// Every phase.
    pub const ALL: [Phase; 6] = [
        Self::Idle,
        Self::Connecting,
        Self::Ready,
        Self::Backoff,
        Self::CircuitOpen,
        Self::Retired,
    ];

    /// Its name in snake case (the `state` label of the endpoint metric).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Connecting => "connecting",
            Self::Ready => "ready",
            Self::Backoff => "backoff",
            Self::CircuitOpen => "circuit_open",
            Self::Retired => "retired",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    Connecting { epoch: Epoch, deadline: Instant },
    Ready { epoch: Epoch, since: Instant },
    Backoff { until: Instant },
    CircuitOpen { until: Instant },
    Retired,
}

/// What an endpoint has done, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Queue pairs created after the first.
    pub reconnects: u64,
    /// Of those, made at once for a work-request error (no backoff, no flap).
    pub work_request_reconnects: u64,
    /// Transport failures that counted as flaps.
    pub flaps: u64,
    /// Times the circuit opened.
    pub circuit_openings: u64,
    /// Inputs about an epoch that is not the current one (ignored).
    pub stale_inputs: u64,
}

/// One endpoint's lifecycle. See the module docs.
#[derive(Debug)]
pub struct Endpoint {
    key: EndpointKey,
    policy: Policy,
    rng: SplitMix64,
    state: State,
    /// The epoch of the newest queue pair asked for.
    epoch: Option<Epoch>,
    /// The epoch of the first queue pair.
    first_epoch: Epoch,
    /// Consecutive reconnects without a confirmed queue pair (the backoff exponent).
    attempt: u32,
    /// Flap times inside the window.
    flaps: VecDeque<Instant>,
    /// Work-request errors inside the window.
    work_request_errors: VecDeque<Instant>,
    /// Circuit openings since it last closed for good (the cooldown exponent).
    openings: u32,
    /// The circuit was open and a trial queue pair is in use: its first success closes the
    /// circuit for good, its failure reopens it.
    probation: bool,
    outputs: VecDeque<Output>,
    stats: EndpointStats,
}

impl Endpoint {
    /// A new, idle endpoint; `rng` seeds its reconnect jitter.
    pub fn new(key: EndpointKey, policy: Policy, rng: SplitMix64) -> Self {
        Self {
            key,
            policy,
            rng,
            state: State::Idle,
            epoch: None,
            first_epoch: Epoch::FIRST,
            attempt: 0,
            flaps: VecDeque::new(),
            work_request_errors: VecDeque::new(),
            openings: 0,
            probation: false,
            outputs: VecDeque::new(),
            stats: EndpointStats::default(),
        }
    }

    /// Makes the first queue pair's epoch `epoch` instead of [`Epoch::FIRST`]: an endpoint
    /// that takes over the id of a retired one continues its epochs, so slices prepared for
    /// the old one are always older. Only before the first queue pair is asked for.
    pub fn start_at(&mut self, epoch: Epoch) {
        if self.epoch.is_none() {
            self.first_epoch = epoch;
        }
    }

    /// Its key.
    pub fn key(&self) -> EndpointKey {
        self.key
    }

    /// Whether its circuit is half-open: a queue pair after the cooldown that has not yet
    /// carried a success.
    pub fn on_probation(&self) -> bool {
        self.probation
    }

    /// Where it stands.
    pub fn phase(&self) -> Phase {
        match self.state {
            State::Idle => Phase::Idle,
            State::Connecting { .. } => Phase::Connecting,
            State::Ready { .. } => Phase::Ready,
            State::Backoff { .. } => Phase::Backoff,
            State::CircuitOpen { .. } => Phase::CircuitOpen,
            State::Retired => Phase::Retired,
        }
    }

    /// The epoch of the newest queue pair asked for.
    pub fn epoch(&self) -> Option<Epoch> {
        self.epoch
    }

    /// What it has done.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// The next command to carry out, oldest first.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When [`Self::handle_timeout`] must be called next, if at all.
    pub fn next_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Connecting { deadline, .. } => Some(deadline),
            State::Backoff { until } | State::CircuitOpen { until } => Some(until),
            State::Idle | State::Ready { .. } | State::Retired => None,
        }
    }

    /// Acts on a timeout that is due at `now` (earlier calls change nothing).
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            State::Connecting { deadline, .. } if now >= deadline => {
                self.transport_failure(now, true);
            }
            State::Backoff { until } if now >= until => self.create_qp(now),
            State::CircuitOpen { until } if now >= until => {
                self.probation = true;
                self.create_qp(now);
            }
            _ => {}
        }
    }

    /// Acts on `input` at `now`.
    pub fn handle(&mut self, input: Input, now: Instant) {
        if self.state == State::Retired {
            return;
        }
        match input {
            Input::ConnectWanted => {
                if self.state == State::Idle {
                    self.create_qp(now);
                }
            }
            Input::HandshakeDone { epoch } => match self.state {
                State::Connecting { epoch: current, .. } if current == epoch => {
                    self.state = State::Ready { epoch, since: now };
                    self.outputs.push_back(Output::ConnectQp { epoch });
                    if self.probation {
                        // Half-open: let traffic try the new queue pair.
                        self.outputs.push_back(Output::CloseCircuit);
                    }
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::HandshakeFailed { epoch } => match self.state {
                State::Connecting { epoch: current, .. } if current == epoch => {
                    self.transport_failure(now, true);
                }
                // The poller could not adopt a queue pair it was handed.
                State::Ready { epoch: current, .. } if current == epoch => {
                    self.transport_failure(now, true);
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::QpError { epoch, status } => match self.state {
                State::Ready {
                    epoch: current,
                    since,
                } if current == epoch => {
                    if status.is_work_request_error() {
                        self.work_request_error(now);
                    } else {
                        let flap = now.duration_since(since) < self.policy.flap_after_ready;
                        self.transport_failure(now, flap);
                    }
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::QpFatal { epoch } => match self.state {
                State::Ready {
                    epoch: current,
                    since,
                } if current == epoch => {
                    let flap = now.duration_since(since) < self.policy.flap_after_ready;
                    self.transport_failure(now, flap);
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::Confirmed { epoch } => match self.state {
                State::Ready { epoch: current, .. } if current == epoch => {
                    self.attempt = 0;
                    if self.probation {
                        self.probation = false;
                        self.openings = 0;
                    }
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::PeerUnreachable => match self.state {
                State::Idle => self.stats.stale_inputs += 1,
                // Open already (a lost lease, flaps): the cooldown stands, but what is
                // posted on the queue pair must still be flushed.
                State::CircuitOpen { .. } => self.outputs.push_back(Output::Unreachable),
                _ => {
                    self.open_circuit(now);
                    self.outputs.push_back(Output::Unreachable);
                }
            },
            Input::PeerRestarted => self.retire(FailReason::PeerRestarted),
            Input::PeerGone => match self.state {
                State::Idle | State::CircuitOpen { .. } => self.stats.stale_inputs += 1,
                _ => self.open_circuit(now),
            },
            Input::PeerReturned => match self.state {
                State::CircuitOpen { .. } => {
                    self.probation = true;
                    self.create_qp(now);
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::HandshakeQueued { epoch } => match &mut self.state {
                State::Connecting {
                    epoch: current,
                    deadline,
                } if *current == epoch => {
                    *deadline = (*deadline).max(now + self.policy.handshake_queue_timeout);
                }
                _ => self.stats.stale_inputs += 1,
            },
            Input::HandshakeSent { epoch } => match &mut self.state {
                State::Connecting {
                    epoch: current,
                    deadline,
                } if *current == epoch => *deadline = now + self.policy.connect_timeout,
                _ => self.stats.stale_inputs += 1,
            },
            Input::Retire => self.retire(FailReason::EndpointRetired),
            Input::Wake => match self.state {
                State::Ready { .. } => self.create_qp(now),
                _ => self.stats.stale_inputs += 1,
            },
        }
    }

    fn retire(&mut self, reason: FailReason) {
        self.state = State::Retired;
        self.outputs.push_back(Output::RetireEndpoint { reason });
    }

    /// A slice's own work request was wrong: refresh the descriptor and replace the queue
    /// pair — at once while such errors are rare, else after a backoff that grows up to
    /// [`Policy::work_request_window`] (no flap: a bad slice never opens the circuit on the
    /// good ones).
    fn work_request_error(&mut self, now: Instant) {
        self.outputs.push_back(Output::RefreshDescriptor);
        self.work_request_errors.push_back(now);
        while self
            .work_request_errors
            .front()
            .is_some_and(|&at| now.duration_since(at) > self.policy.work_request_window)
        {
            self.work_request_errors.pop_front();
        }
        let free = self.policy.free_work_request_errors as usize;
        let excess = self.work_request_errors.len().saturating_sub(free);
        if excess == 0 {
            self.stats.work_request_reconnects += 1;
            return self.create_qp(now);
        }
        // The slices' fault, not the peer's: no flap, so the circuit stays closed and good
        // slices keep flowing between replacements; but each replacement waits longer, up
        // to the window.
        let bound = self
            .policy
            .backoff_bound(excess as u32 - 1)
            .min(self.policy.work_request_window);
        let jitter = self.rng.below(bound.as_nanos() as u64 + 1);
        self.state = State::Backoff {
            until: now + std::time::Duration::from_nanos(jitter),
        };
    }

    /// Fails fast for a cooldown (doubling with each opening), then tries a queue pair on
    /// probation.
    fn open_circuit(&mut self, now: Instant) {
        let cooldown = self.policy.cooldown(self.openings);
        self.openings = self.openings.saturating_add(1);
        self.probation = false;
        self.flaps.clear();
        self.stats.circuit_openings += 1;
        self.state = State::CircuitOpen {
            until: now + cooldown,
        };
        self.outputs.push_back(Output::OpenCircuit);
    }

    /// Asks for a queue pair at the next epoch.
    fn create_qp(&mut self, now: Instant) {
        let epoch = self.epoch.map_or(self.first_epoch, Epoch::next);
        if self.epoch.is_some() {
            self.stats.reconnects += 1;
        }
        self.epoch = Some(epoch);
        self.state = State::Connecting {
            epoch,
            deadline: now + self.policy.connect_timeout,
        };
        self.outputs.push_back(Output::CreateQp { epoch });
    }

    /// The peer failed us: count the flap, then back off or open the circuit.
    fn transport_failure(&mut self, now: Instant, flap: bool) {
        if flap {
            self.stats.flaps += 1;
            self.flaps.push_back(now);
        }
        while self
            .flaps
            .front()
            .is_some_and(|&at| now.duration_since(at) > self.policy.flap_window)
        {
            self.flaps.pop_front();
        }
        let reopen = self.probation;
        if reopen || self.flaps.len() >= self.policy.flaps_to_open as usize {
            return self.open_circuit(now);
        }
        let bound = self.policy.backoff_bound(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let jitter = self.rng.below(bound.as_nanos() as u64 + 1);
        self.state = State::Backoff {
            until: now + std::time::Duration::from_nanos(jitter),
        };
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const KEY: EndpointKey = EndpointKey {
        peer: Incarnation(0xabc),
        local_rail: 0,
        remote_rail: 1,
    };

    fn endpoint(seed: u64) -> Endpoint {
        Endpoint::new(KEY, Policy::default(), SplitMix64::new(seed))
    }

    fn outputs(endpoint: &mut Endpoint) -> Vec<Output> {
        std::iter::from_fn(|| endpoint.poll_output()).collect()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Connects `endpoint` at `now` through one handshake; returns its epoch.
    fn connect(endpoint: &mut Endpoint, now: Instant) -> Epoch {
        let out = outputs(endpoint);
        let Some(Output::CreateQp { epoch }) = out.last().copied() else {
            panic!("expected a queue pair to be created: {out:?}");
        };
        endpoint.handle(Input::HandshakeDone { epoch }, now);
        assert!(outputs(endpoint).contains(&Output::ConnectQp { epoch }));
        epoch
    }

    /// Runs the timer until it creates a queue pair; returns when.
    fn run_timer(endpoint: &mut Endpoint) -> Instant {
        let at = endpoint.next_timeout().expect("a timer");
        endpoint.handle_timeout(at);
        at
    }

    /// Feeds `input` to `e` at `now` and asserts it was taken for stale: nothing changes,
    /// nothing is asked, and it is counted.
    fn assert_stale(e: &mut Endpoint, input: Input, now: Instant) {
        let (phase, epoch, before) = (e.phase(), e.epoch(), e.stats());
        e.handle(input, now);
        assert_eq!(e.phase(), phase, "{input:?}");
        assert_eq!(e.epoch(), epoch, "{input:?}");
        assert_eq!(outputs(e), [], "{input:?}");
        let after = e.stats();
        assert_eq!(after.stale_inputs, before.stale_inputs + 1, "{input:?}");
        assert_eq!(
            (after.flaps, after.reconnects),
            (before.flaps, before.reconnects),
            "{input:?}"
        );
    }

    /// Every input that names an epoch, for `epoch`.
    fn inputs_for(epoch: Epoch) -> [Input; 8] {
        [
            Input::HandshakeQueued { epoch },
            Input::HandshakeSent { epoch },
            Input::HandshakeDone { epoch },
            Input::HandshakeFailed { epoch },
            Input::QpError {
                epoch,
                status: WcStatus::RetryExcErr,
            },
            Input::QpError {
                epoch,
                status: WcStatus::LocLenErr,
            },
            Input::QpFatal { epoch },
            Input::Confirmed { epoch },
        ]
    }

    #[test]
    fn inputs_for_an_older_epoch_change_nothing_in_any_phase() {
        let t0 = Instant::now();
        let mut e = endpoint(3);
        e.handle(Input::ConnectWanted, t0);
        let old = connect(&mut e, t0);
        // A work-request error moves it to a new queue pair, still connecting.
        e.handle(
            Input::QpError {
                epoch: old,
                status: WcStatus::LocLenErr,
            },
            t0 + ms(1),
        );
        let new = old.next();
        assert_eq!(
            outputs(&mut e),
            [Output::RefreshDescriptor, Output::CreateQp { epoch: new }]
        );
        for input in inputs_for(old) {
            assert_stale(&mut e, input, t0 + ms(2));
        }
        assert_eq!(e.phase(), Phase::Connecting);
        e.handle(Input::HandshakeDone { epoch: new }, t0 + ms(3));
        assert_eq!(outputs(&mut e), [Output::ConnectQp { epoch: new }]);
        assert_eq!(e.phase(), Phase::Ready);
        // Ready at the new epoch: the old one's events are stale as well.
        for input in inputs_for(old) {
            assert_stale(&mut e, input, t0 + ms(4));
        }
        // And so are a newer epoch's, which nothing asked for.
        assert_stale(&mut e, Input::QpFatal { epoch: new.next() }, t0 + ms(5));
        assert_eq!((e.phase(), e.epoch()), (Phase::Ready, Some(new)));
    }

    #[test]
    fn a_queued_handshake_waits_out_the_queue_timeout_and_a_sent_one_the_connect_timeout() {
        let t0 = Instant::now();
        let mut e = endpoint(11);
        e.handle(Input::ConnectWanted, t0);
        let [Output::CreateQp { epoch }] = outputs(&mut e)[..] else {
            panic!("expected a queue pair to be created");
        };
        let policy = Policy::default();
        e.handle(Input::HandshakeQueued { epoch }, t0 + ms(1));
        assert_eq!(
            e.next_timeout(),
            Some(t0 + ms(1) + policy.handshake_queue_timeout)
        );
        // Past the connect timeout it still waits its turn.
        e.handle_timeout(t0 + policy.connect_timeout + ms(1));
        assert_eq!(e.phase(), Phase::Connecting);
        assert_eq!(outputs(&mut e), []);
        // Its turn: the connect timeout runs from the moment it is sent.
        let sent = t0 + ms(5000);
        e.handle(Input::HandshakeSent { epoch }, sent);
        assert_eq!(e.next_timeout(), Some(sent + policy.connect_timeout));
        e.handle_timeout(sent + policy.connect_timeout);
        assert_eq!(e.phase(), Phase::Backoff);
        assert_eq!(e.stats().flaps, 1);
    }

    #[test]
    fn an_endpoint_reusing_an_id_continues_its_epochs() {
        let t0 = Instant::now();
        let mut e = endpoint(4);
        let continued = Epoch::new(7);
        e.start_at(continued);
        e.handle(Input::ConnectWanted, t0);
        assert_eq!(outputs(&mut e), [Output::CreateQp { epoch: continued }]);
        // A slice or event of the id's previous occupant is older: stale.
        assert_stale(
            &mut e,
            Input::HandshakeDone {
                epoch: Epoch::FIRST,
            },
            t0,
        );
        e.handle(Input::HandshakeDone { epoch: continued }, t0);
        assert_eq!(outputs(&mut e), [Output::ConnectQp { epoch: continued }]);
        assert!(Epoch::FIRST.is_older_than(continued));
        // Once a queue pair was asked for, start_at changes nothing.
        e.start_at(Epoch::new(100));
        e.handle(
            Input::QpError {
                epoch: continued,
                status: WcStatus::LocLenErr,
            },
            t0 + ms(1),
        );
        assert_eq!(
            outputs(&mut e),
            [
                Output::RefreshDescriptor,
                Output::CreateQp {
                    epoch: continued.next()
                }
            ]
        );
    }

    #[test]
    fn a_work_request_error_reconnects_at_once_without_a_flap() {
        let t0 = Instant::now();
        let mut e = endpoint(1);
        e.handle(Input::ConnectWanted, t0);
        let first = connect(&mut e, t0);
        assert_eq!(first, Epoch::FIRST);
        e.handle(
            Input::QpError {
                epoch: first,
                status: WcStatus::LocLenErr,
            },
            t0 + ms(1),
        );
        assert_eq!(
            outputs(&mut e),
            [
                Output::RefreshDescriptor,
                Output::CreateQp {
                    epoch: first.next()
                }
            ]
        );
        assert_eq!(e.stats().flaps, 0);
        assert_eq!(e.stats().reconnects, 1);
        // The flush completions of the old queue pair arrive late: ignored.
        e.handle(
            Input::QpError {
                epoch: first,
                status: WcStatus::WrFlushErr,
            },
            t0 + ms(2),
        );
        assert_eq!(e.phase(), Phase::Connecting);
        assert_eq!(e.stats().stale_inputs, 1);
    }

    #[test]
    fn transport_errors_back_off_with_full_jitter_and_three_flaps_open_the_circuit() {
        let t0 = Instant::now();
        let mut e = endpoint(7);
        e.handle(Input::ConnectWanted, t0);
        let mut now = t0;
        let mut epoch = connect(&mut e, now);
        for flap in 1..=2 {
            e.handle(
                Input::QpError {
                    epoch,
                    status: WcStatus::RetryExcErr,
                },
                now + ms(100),
            );
            assert_eq!(e.phase(), Phase::Backoff);
            let at = e.next_timeout().expect("backoff timer");
            let bound = Policy::default().backoff_bound(flap - 1);
            assert!(
                at.duration_since(now + ms(100)) <= bound,
                "full jitter within the bound"
            );
            now = run_timer(&mut e);
            epoch = connect(&mut e, now);
        }
        e.handle(Input::QpFatal { epoch }, now + ms(100));
        assert_eq!(e.phase(), Phase::CircuitOpen);
        assert_eq!(outputs(&mut e), [Output::OpenCircuit]);
        assert_eq!(e.stats().flaps, 3);
        let open_until = e.next_timeout().expect("cooldown");
        assert_eq!(open_until, now + ms(100) + Duration::from_secs(5));

        // After the cooldown a trial queue pair lets traffic through; its failure reopens
        // the circuit for twice as long.
        e.handle_timeout(open_until);
        let trial = match outputs(&mut e).as_slice() {
            [Output::CreateQp { epoch }] => *epoch,
            other => panic!("{other:?}"),
        };
        e.handle(Input::HandshakeDone { epoch: trial }, open_until);
        assert_eq!(
            outputs(&mut e),
            [Output::ConnectQp { epoch: trial }, Output::CloseCircuit]
        );
        e.handle(
            Input::QpError {
                epoch: trial,
                status: WcStatus::RetryExcErr,
            },
            open_until + Duration::from_secs(2),
        );
        assert_eq!(outputs(&mut e), [Output::OpenCircuit]);
        assert_eq!(
            e.next_timeout(),
            Some(open_until + Duration::from_secs(2) + Duration::from_secs(10))
        );

        // The next trial succeeds: the circuit closes for good and the cooldown resets.
        let reopened = e.next_timeout().expect("cooldown");
        e.handle_timeout(reopened);
        let trial = match outputs(&mut e).as_slice() {
            [Output::CreateQp { epoch }] => *epoch,
            other => panic!("{other:?}"),
        };
        e.handle(Input::HandshakeDone { epoch: trial }, reopened);
        e.handle(Input::Confirmed { epoch: trial }, reopened + ms(1));
        assert_eq!(e.phase(), Phase::Ready);
        assert_eq!(e.stats().circuit_openings, 2);
    }

    #[test]
    fn a_queue_pair_that_lived_long_is_not_a_flap() {
        let t0 = Instant::now();
        let mut e = endpoint(3);
        e.handle(Input::ConnectWanted, t0);
        let mut now = t0;
        for _ in 0..10 {
            let epoch = connect(&mut e, now);
            e.handle(Input::Confirmed { epoch }, now);
            now += Duration::from_secs(2);
            e.handle(
                Input::QpError {
                    epoch,
                    status: WcStatus::RetryExcErr,
                },
                now,
            );
            let delay = e.next_timeout().expect("backoff").duration_since(now);
            assert!(
                delay <= ms(10),
                "a confirmed queue pair resets the backoff: {delay:?}"
            );
            now = run_timer(&mut e);
        }
        assert_eq!(e.stats().flaps, 0);
        assert_eq!(e.stats().circuit_openings, 0);
    }

    #[test]
    fn failed_handshakes_are_flaps_and_a_dead_peer_opens_the_circuit_quickly() {
        let t0 = Instant::now();
        let mut e = endpoint(11);
        e.handle(Input::ConnectWanted, t0);
        let mut now = t0;
        for _ in 0..3 {
            let Some(Output::CreateQp { epoch }) = outputs(&mut e).last().copied() else {
                panic!("no queue pair asked for");
            };
            e.handle(Input::HandshakeFailed { epoch }, now);
            if e.phase() == Phase::Backoff {
                now = run_timer(&mut e);
            }
        }
        assert_eq!(e.phase(), Phase::CircuitOpen);
        assert!(
            now.duration_since(t0) < ms(40),
            "10 + 20 ms of backoff at most"
        );
        // A handshake that never answers times out the same way.
        let mut slow = endpoint(12);
        slow.handle(Input::ConnectWanted, t0);
        let deadline = slow.next_timeout().expect("connect timeout");
        assert_eq!(deadline, t0 + Duration::from_secs(2));
        slow.handle_timeout(deadline);
        assert_eq!(slow.phase(), Phase::Backoff);
    }

    #[test]
    fn the_same_seed_makes_the_same_decisions() {
        let run = |seed| {
            let t0 = Instant::now();
            let mut e = endpoint(seed);
            e.handle(Input::ConnectWanted, t0);
            let mut timeline = Vec::new();
            let mut now = t0;
            for _ in 0..6 {
                let epoch = connect(&mut e, now);
                e.handle(
                    Input::QpError {
                        epoch,
                        status: WcStatus::RetryExcErr,
                    },
                    now + Duration::from_secs(2),
                );
                now = run_timer(&mut e);
                timeline.push(now.duration_since(t0));
            }
            timeline
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn a_restarted_peer_retires_the_endpoint_with_peer_restarted() {
        let t0 = Instant::now();
        let mut e = endpoint(1);
        e.handle(Input::ConnectWanted, t0);
        connect(&mut e, t0);
        e.handle(Input::PeerRestarted, t0);
        assert_eq!(
            outputs(&mut e),
            [Output::RetireEndpoint {
                reason: FailReason::PeerRestarted
            }]
        );
        e.handle(Input::ConnectWanted, t0);
        assert_eq!(outputs(&mut e), []);
        assert_eq!(e.phase(), Phase::Retired);
        assert_eq!(e.next_timeout(), None);
    }

    #[test]
    fn a_lease_lost_opens_the_circuit_and_the_same_incarnation_back_closes_it() {
        let t0 = Instant::now();
        let mut e = endpoint(1);
        e.handle(Input::ConnectWanted, t0);
        connect(&mut e, t0);
        e.handle(Input::PeerGone, t0 + ms(5000));
        assert_eq!(outputs(&mut e), [Output::OpenCircuit]);
        assert_eq!(
            e.phase(),
            Phase::CircuitOpen,
            "not retired: it may come back"
        );
        // Back long before the cooldown: a trial queue pair at once.
        e.handle(Input::PeerReturned, t0 + ms(5100));
        let epoch = connect(&mut e, t0 + ms(5100));
        assert_eq!(epoch, Epoch::new(2));
        e.handle(Input::Confirmed { epoch }, t0 + ms(5101));
        assert_eq!(e.phase(), Phase::Ready);
        e.handle(Input::PeerReturned, t0 + ms(5200));
        assert!(outputs(&mut e).is_empty(), "only an open circuit is closed");
    }

    #[test]
    fn an_unreachable_peer_opens_the_circuit_at_once_and_is_tried_again_after_the_cooldown() {
        let t0 = Instant::now();
        let mut e = endpoint(1);
        e.handle(Input::ConnectWanted, t0);
        connect(&mut e, t0);
        let long_lived = t0 + ms(60_000);
        e.handle(Input::PeerUnreachable, long_lived);
        assert_eq!(outputs(&mut e), [Output::OpenCircuit, Output::Unreachable]);
        assert_eq!(e.phase(), Phase::CircuitOpen);
        assert_eq!(e.stats().circuit_openings, 1);
        // Open already: the queue pair is taken down again, the cooldown stands.
        e.handle(Input::PeerUnreachable, long_lived + ms(100));
        assert_eq!(outputs(&mut e), [Output::Unreachable]);
        assert_eq!(e.stats().circuit_openings, 1);
        assert_eq!(
            e.next_timeout(),
            Some(long_lived + Policy::default().cooldown_min)
        );
        let probation = run_timer(&mut e);
        let epoch = connect(&mut e, probation);
        e.handle(Input::Confirmed { epoch }, probation);
        assert_eq!(e.phase(), Phase::Ready);
        // Back: the next opening starts from the shortest cooldown again.
        e.handle(Input::PeerUnreachable, probation + ms(1));
        assert_eq!(
            e.next_timeout(),
            Some(probation + ms(1) + Policy::default().cooldown_min)
        );
        // Connecting or backing off, it opens just the same; idle, nothing to open.
        let mut idle = endpoint(2);
        idle.handle(Input::PeerUnreachable, t0);
        assert!(outputs(&mut idle).is_empty());
        assert_eq!(idle.phase(), Phase::Idle);
    }

    #[test]
    fn repeated_work_request_errors_back_off_but_never_open_the_circuit() {
        let t0 = Instant::now();
        let mut e = endpoint(1);
        e.handle(Input::ConnectWanted, t0);
        let mut now = t0;
        let mut epoch = connect(&mut e, now);
        // Two are free: the queue pair is replaced at once.
        for _ in 0..2 {
            now += ms(1);
            bad_slice(&mut e, epoch, now);
            epoch = connect(&mut e, now);
        }
        // The third within the window backs off; no flap.
        now += ms(1);
        bad_slice(&mut e, epoch, now);
        assert_eq!(outputs(&mut e), [Output::RefreshDescriptor]);
        assert_eq!(e.phase(), Phase::Backoff);
        // Persistently bad: replacements keep backing off, never faster than the backoff
        // allows and never slower than the window; the circuit never opens.
        let mut replacements = 0;
        let end = now + ms(10_000);
        while now < end {
            if e.phase() == Phase::Backoff {
                now = run_timer(&mut e);
            }
            epoch = connect(&mut e, now);
            replacements += 1;
            bad_slice(&mut e, epoch, now);
            assert_ne!(e.phase(), Phase::CircuitOpen);
        }
        assert_eq!(e.stats().flaps, 0);
        assert_eq!(e.stats().circuit_openings, 0);
        assert!(
            (10..=200).contains(&replacements),
            "{replacements} replacements in 10 s of bad slices"
        );
        // A window later, one is free again.
        let mut fresh = endpoint(2);
        fresh.handle(Input::ConnectWanted, t0);
        let first = connect(&mut fresh, t0);
        bad_slice(&mut fresh, first, t0);
        let second = connect(&mut fresh, t0);
        bad_slice(&mut fresh, second, t0);
        let third = connect(&mut fresh, t0);
        bad_slice(
            &mut fresh,
            third,
            t0 + Policy::default().work_request_window + ms(1),
        );
        assert_eq!(
            fresh.phase(),
            Phase::Connecting,
            "the first two left the window"
        );
    }

    #[test]
    fn names_in_logs_and_metric_labels() {
        assert_eq!(Incarnation(0xabc).to_string(), "0000000000000abc");
        assert_eq!(KEY.to_string(), "rail 0 → 0000000000000abc/rail 1");
        let labels: Vec<_> = Phase::ALL.iter().map(|phase| phase.as_str()).collect();
        assert_eq!(
            labels,
            [
                "idle",
                "connecting",
                "ready",
                "backoff",
                "circuit_open",
                "retired"
            ]
        );
    }

    #[test]
    fn a_timer_called_before_it_is_due_changes_nothing() {
        let t0 = Instant::now();
        let early = |e: &mut Endpoint| {
            let due = e.next_timeout().expect("a timer");
            let (phase, epoch) = (e.phase(), e.epoch());
            e.handle_timeout(due - Duration::from_nanos(1));
            assert_eq!((e.phase(), e.epoch()), (phase, epoch), "{phase:?}");
            assert_eq!(outputs(e), [], "{phase:?}");
        };
        let mut e = endpoint(5);
        e.handle(Input::ConnectWanted, t0);
        let _ = outputs(&mut e);
        assert_eq!(e.phase(), Phase::Connecting);
        early(&mut e);
        let epoch = e.epoch().expect("an epoch");
        e.handle(Input::HandshakeFailed { epoch }, t0);
        assert_eq!(e.phase(), Phase::Backoff);
        early(&mut e);
        e.handle(Input::PeerUnreachable, t0);
        let _ = outputs(&mut e);
        assert_eq!(e.phase(), Phase::CircuitOpen);
        early(&mut e);
        // Due: each acts.
        run_timer(&mut e);
        assert_eq!(e.phase(), Phase::Connecting);
        run_timer(&mut e);
        assert_eq!(e.phase(), Phase::CircuitOpen, "a failed probation reopens");
    }

    #[test]
    fn a_queue_pair_the_poller_could_not_adopt_is_a_failure_of_its_epoch() {
        let t0 = Instant::now();
        let mut e = endpoint(6);
        e.handle(Input::ConnectWanted, t0);
        let epoch = connect(&mut e, t0);
        e.handle(Input::HandshakeFailed { epoch }, t0 + ms(1));
        assert_eq!(e.phase(), Phase::Backoff);
        assert_eq!(e.stats().flaps, 1);
        assert_eq!(e.stats().stale_inputs, 0);
    }

    #[test]
    fn a_failure_exactly_flap_after_ready_is_not_a_flap() {
        let t0 = Instant::now();
        let after = Policy::default().flap_after_ready;
        let failures = |epoch| {
            [
                Input::QpError {
                    epoch,
                    status: WcStatus::RetryExcErr,
                },
                Input::QpFatal { epoch },
            ]
        };
        for (index, input) in failures(Epoch::FIRST).into_iter().enumerate() {
            for (lived, flap) in [(after - Duration::from_nanos(1), 1), (after, 0)] {
                let mut e = endpoint(7 + index as u64);
                e.handle(Input::ConnectWanted, t0);
                let epoch = connect(&mut e, t0);
                assert_eq!(epoch, Epoch::FIRST);
                e.handle(input, t0 + lived);
                assert_eq!(e.phase(), Phase::Backoff, "{input:?}");
                assert_eq!(e.stats().flaps, flap, "{input:?} after {lived:?}");
            }
        }
    }

    /// A work-request error on `epoch` at `now` (the slice's fault, not the peer's).
    fn bad_slice(e: &mut Endpoint, epoch: Epoch, now: Instant) {
        let status = WcStatus::RemAccessErr;
        e.handle(Input::QpError { epoch, status }, now);
    }

    /// A transport error on `epoch` at `now` (the peer's fault).
    fn peer_failed(e: &mut Endpoint, epoch: Epoch, now: Instant) {
        let status = WcStatus::RetryExcErr;
        e.handle(Input::QpError { epoch, status }, now);
    }

    #[test]
    fn news_about_the_peer_that_does_not_apply_is_counted_stale() {
        let t0 = Instant::now();
        let mut e = endpoint(8);
        for input in [Input::PeerUnreachable, Input::PeerGone, Input::PeerReturned] {
            assert_stale(&mut e, input, t0);
        }
        assert_eq!(e.phase(), Phase::Idle);
        e.handle(Input::ConnectWanted, t0);
        connect(&mut e, t0);
        assert_stale(&mut e, Input::PeerReturned, t0);
        e.handle(Input::PeerGone, t0);
        assert_eq!(outputs(&mut e), [Output::OpenCircuit]);
        // Gone again while open: the cooldown stands.
        let cooldown = e.next_timeout();
        assert_stale(&mut e, Input::PeerGone, t0 + ms(1));
        assert_eq!(e.next_timeout(), cooldown);
        assert_eq!(e.stats().circuit_openings, 1);
        assert_eq!(e.stats().stale_inputs, 5);
    }

    #[test]
    fn a_bad_slice_exactly_a_window_ago_still_counts_against_the_free_ones() {
        let t0 = Instant::now();
        let window = Policy::default().work_request_window;
        let mut e = endpoint(9);
        e.handle(Input::ConnectWanted, t0);
        let mut epoch = connect(&mut e, t0);
        for _ in 0..2 {
            bad_slice(&mut e, epoch, t0);
            epoch = connect(&mut e, t0);
        }
        assert_eq!(e.stats().work_request_reconnects, 2, "both free");
        bad_slice(&mut e, epoch, t0 + window);
        assert_eq!(
            e.phase(),
            Phase::Backoff,
            "the first two are still in the window"
        );
        assert_eq!(e.stats().work_request_reconnects, 2);
    }

    #[test]
    fn backoffs_lie_ahead_within_the_bound_of_their_attempt() {
        let policy = Policy::default();
        let t0 = Instant::now();
        let mut widest = (Duration::ZERO, Duration::ZERO);
        for seed in 0..200 {
            // The peer's fault, first attempt: within backoff_bound(0).
            let mut e = endpoint(seed);
            e.handle(Input::ConnectWanted, t0);
            let epoch = connect(&mut e, t0);
            peer_failed(&mut e, epoch, t0 + ms(1));
            let wait = e.next_timeout().expect("a backoff") - (t0 + ms(1));
            assert!(wait <= policy.backoff_bound(0), "seed {seed}: {wait:?}");
            widest.0 = widest.0.max(wait);

            // One bad slice past the free ones: within backoff_bound(0) as well.
            let mut e = endpoint(seed);
            e.handle(Input::ConnectWanted, t0);
            let mut epoch = connect(&mut e, t0);
            for _ in 0..2 {
                bad_slice(&mut e, epoch, t0);
                epoch = connect(&mut e, t0);
            }
            bad_slice(&mut e, epoch, t0);
            let wait = e.next_timeout().expect("a backoff") - t0;
            assert!(wait <= policy.backoff_bound(0), "seed {seed}: {wait:?}");
            widest.1 = widest.1.max(wait);
        }
        // Full jitter: the waits spread over the bound (they are not all at its start).
        let half = policy.backoff_bound(0) / 2;
        assert!(widest.0 > half && widest.1 > half, "{widest:?}");
    }

    #[test]
    fn a_zero_backoff_retries_at_once() {
        let t0 = Instant::now();
        let policy = Policy {
            backoff_min: Duration::ZERO,
            ..Policy::default()
        };
        let mut e = Endpoint::new(KEY, policy, SplitMix64::new(1));
        e.handle(Input::ConnectWanted, t0);
        let mut epoch = connect(&mut e, t0);
        peer_failed(&mut e, epoch, t0);
        assert_eq!(e.next_timeout(), Some(t0));
        run_timer(&mut e);
        epoch = connect(&mut e, t0);
        for _ in 0..2 {
            bad_slice(&mut e, epoch, t0);
            epoch = connect(&mut e, t0);
        }
        bad_slice(&mut e, epoch, t0);
        assert_eq!(e.phase(), Phase::Backoff, "past the free ones");
        assert_eq!(e.next_timeout(), Some(t0));
    }

    #[test]
    fn a_flap_exactly_a_window_ago_still_counts_toward_opening_the_circuit() {
        let t0 = Instant::now();
        let window = Policy::default().flap_window;
        let mut e = endpoint(10);
        e.handle(Input::ConnectWanted, t0);
        let mut epoch = connect(&mut e, t0);
        let first = t0 + ms(100);
        peer_failed(&mut e, epoch, first);
        let retry = run_timer(&mut e);
        epoch = connect(&mut e, retry);
        peer_failed(&mut e, epoch, retry + ms(100));
        run_timer(&mut e);
        // The third queue pair is up for half a second (a flap) and fails exactly a window
        // after the first.
        let third = first + window;
        epoch = connect(&mut e, third - ms(500));
        peer_failed(&mut e, epoch, third);
        assert_eq!(e.stats().flaps, 3);
        assert_eq!(e.phase(), Phase::CircuitOpen);
    }
}
