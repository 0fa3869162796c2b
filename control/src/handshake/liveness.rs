//! Liveness: which peers are alive — pings and silence, redials, an address answered by a new
//! incarnation, what a cluster directory reports — and the timers that tick it all.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Instant;

use railyard_dataplane::EndpointId;
use railyard_dataplane::sabotage::{self, Protection};

use super::state::{ConnId, Core, FOOTPRINT_EVERY, warning};
use crate::endpoint::{Incarnation, Input, Phase};
use crate::rail::RailFabric;
use crate::shared::bump;
use crate::warn::{WarningKind, control_warning};
use crate::wire::Message;

impl<F: RailFabric> Core<F> {
    /// Forgets what `peer`'s Hello and descriptor said, and where it listens, once nothing
    /// refers to it any more — no connection, endpoint or target queue pair — so that peers
    /// that come and go (or a flood of Hellos) cost nothing lasting. (With nothing of it
    /// left, there is nothing to retire when another process takes its address.)
    pub(super) fn forget_if_unused(&mut self, peer: Incarnation) {
        let used = self.conns.values().any(|conn| conn.peer == Some(peer))
            || self.active.values().any(|a| a.machine.key().peer == peer)
            || self.passive.keys().any(|key| key.initiator == peer);
        if !used {
            self.peers.remove(&peer);
            self.forget_descriptor(peer);
            self.listeners.retain(|_, listener| *listener != peer);
        }
    }

    /// Pings quiet connections; a peer that has said nothing for
    /// [`Policy::liveness_timeout`](crate::policy::Policy::liveness_timeout) is unreachable: its connection closes and, if this side
    /// dialed it, the endpoints to it at that address open their circuits at once.
    pub(super) fn check_liveness(&mut self, now: Instant) {
        if sabotage::is_off(Protection::Liveness) {
            return;
        }
        let timeout = self.policy.liveness_timeout;
        self.heard_before
            .retain(|_, &mut heard| now.saturating_duration_since(heard) < timeout);
        self.redial_live_peers(now);
        let mut quiet = Vec::new();
        let mut silent = Vec::new();
        for (&id, conn) in &self.conns {
            let heard = now.duration_since(conn.last_heard);
            // A dialed connection to a listener this side has endpoints to must say Hello
            // within the same bound (a stopped process's kernel still accepts the connect).
            let peer = match conn.peer {
                Some(peer) => peer,
                None if conn.dialed => match self.listeners.get(&conn.addr) {
                    Some(&listener) => listener,
                    None => continue,
                },
                None => continue,
            };
            if heard >= self.policy.liveness_timeout {
                silent.push((id, peer, conn.addr, conn.dialed, heard));
            } else if conn.peer.is_some()
                && heard >= self.policy.keepalive_interval
                && conn
                    .last_ping
                    .is_none_or(|at| now.duration_since(at) >= self.policy.keepalive_interval)
            {
                quiet.push(id);
            }
        }
        for id in quiet {
            let nonce = self.rng.next_u64();
            if let Some(conn) = self.conns.get_mut(&id) {
                conn.last_ping = Some(now);
            }
            self.send(id, Message::Ping { nonce });
        }
        for (id, peer, addr, dialed, heard) in silent {
            if dialed {
                let endpoints: Vec<(u16, EndpointId)> = self
                    .active
                    .iter()
                    .filter(|(_, a)| {
                        a.addr == addr
                            && a.machine.key().peer == peer
                            && a.machine.phase() != Phase::Retired
                    })
                    .map(|(&key, _)| key)
                    .collect();
                if !endpoints.is_empty() {
                    self.shared.record_detection(heard);
                    let name = self.peer_name(peer);
                    warning!(
                        self,
                        Retire,
                        peer = %name,
                        incarnation = %peer,
                        addr = %addr,
                        silent = ?heard,
                        "peer unreachable: silent past the liveness timeout; failing its work fast"
                    );
                }
                for (rail, endpoint) in endpoints {
                    self.handle_input(rail, endpoint, Input::PeerUnreachable, now);
                }
            }
            self.closed(id, "no answer within the liveness timeout", now);
        }
    }

    /// Dials again the listeners of peers with endpoints that carry traffic (ready, or
    /// backing off) but no control connection — it closed under them (a stall of either
    /// side, a refusal): without one, nothing would notice the peer stop. An endpoint whose
    /// circuit is open dials when its cooldown ends.
    pub(super) fn redial_live_peers(&mut self, now: Instant) {
        let interval = self.policy.keepalive_interval;
        let orphaned: BTreeSet<SocketAddr> = self
            .active
            .values()
            .filter(|a| matches!(a.machine.phase(), Phase::Ready | Phase::Backoff))
            .map(|a| a.addr)
            .filter(|addr| !self.dialed.contains_key(addr))
            .filter(|addr| {
                self.redialed
                    .get(addr)
                    .is_none_or(|&at| now.duration_since(at) >= interval)
            })
            .collect();
        self.redialed
            .retain(|_, at| now.duration_since(*at) < interval);
        for addr in orphaned {
            self.redialed.insert(addr, now);
            self.conn_to(addr, now);
        }
    }

    /// The driver read bytes from `conn`: the peer is alive even if its frame is not whole
    /// yet (a large descriptor on a slow link).
    pub(crate) fn heard(&mut self, conn: ConnId, now: Instant) {
        if let Some(state) = self.conns.get_mut(&conn) {
            state.last_heard = now;
        }
    }

    /// The one place a restart is detected: `incarnation` answered at `addr`, an address this
    /// side dialed. If another incarnation listened there before, it is gone. (What a peer
    /// announces in its own Hello is only a hint of where to probe it: two containers
    /// behind one NAT, or loopback addresses on two hosts, can announce the same one.)
    pub(super) fn listener_at(&mut self, addr: SocketAddr, incarnation: Incarnation, now: Instant) {
        match self.listeners.insert(addr, incarnation) {
            Some(old) if old != incarnation => {
                let name = self.peer_name(incarnation);
                self.peer_replaced(old, incarnation, name, addr, now);
            }
            _ => {}
        }
    }

    /// Everything of `old` goes: its active endpoints fail with `PeerRestarted`, its passive
    /// queue pairs are dropped. Fresh endpoints to `new` at `addr`, on the same rails, take
    /// the retired ones' place (an application that asks for the peer again gets them;
    /// nothing meant for `old` ever reaches them).
    pub(super) fn peer_replaced(
        &mut self,
        old: Incarnation,
        new: Incarnation,
        name: String,
        addr: SocketAddr,
        now: Instant,
    ) {
        bump(&self.shared.counters.peer_restarts);
        warning!(
            self,
            Retire,
            peer = %name,
            incarnation = %old,
            successor = %new,
            addr = %addr,
            "peer restarted: a new incarnation listens at its address; retiring its endpoints"
        );
        let stale: Vec<(u16, EndpointId, u16)> = self
            .active
            .iter()
            .filter(|(_, a)| a.machine.key().peer == old && a.machine.phase() != Phase::Retired)
            .map(|(&(rail, id), a)| (rail, id, a.machine.key().remote_rail))
            .collect();
        for &(rail, id, _) in &stale {
            self.handle_input(rail, id, Input::PeerRestarted, now);
        }
        for (rail, _, remote_rail) in stale {
            self.endpoint_for(name.clone(), new, addr, rail, remote_rail, now);
        }
        self.forget_incarnation(old);
    }

    /// Drops what this side keeps for a peer incarnation that is gone: its Hello, its
    /// descriptor and the passive queue pairs it connected (teardowns).
    pub(super) fn forget_incarnation(&mut self, gone: Incarnation) {
        self.peers.remove(&gone);
        self.forget_descriptor(gone);
        let before = self.passive.len();
        self.passive.retain(|key, _| key.initiator != gone);
        for _ in self.passive.len()..before {
            bump(&self.shared.counters.teardowns);
        }
    }

    /// A cluster directory saw `name` change: the same consequences as when a dialed
    /// address answers with a new incarnation; for a peer that is simply gone, its
    /// endpoints retire with `PeerUnavailable` (nothing waits for a transport timeout).
    pub(crate) fn peer_changed(&mut self, name: &str, change: PeerChange, now: Instant) {
        match change {
            PeerChange::Restarted { old, new, addr } => {
                let known = self.peers.contains_key(&old)
                    || self.active.values().any(|a| {
                        a.machine.key().peer == old && a.machine.phase() != Phase::Retired
                    });
                match self.listeners.get(&addr) {
                    // A Hello there already said who listens now (`new` itself, or a third
                    // process): the event changes nothing there; `old` is gone all the same.
                    Some(&current) if current != old => {
                        if known && current != new {
                            // A third process listens there: `old` is gone for good.
                            for (rail, id) in self.endpoints_of(old) {
                                self.handle_input(rail, id, Input::PeerRestarted, now);
                            }
                            self.forget_incarnation(old);
                        } else if known {
                            self.peer_replaced(old, new, name.to_string(), addr, now);
                        }
                    }
                    _ => {
                        self.listeners.insert(addr, new);
                        if known {
                            self.peer_replaced(old, new, name.to_string(), addr, now);
                        }
                    }
                }
            }
            PeerChange::Gone { incarnation } => self.peer_gone(name, incarnation, now),
            PeerChange::Returned { incarnation } => {
                for (rail, id) in self.endpoints_of(incarnation) {
                    self.handle_input(rail, id, Input::PeerReturned, now);
                }
            }
        }
    }

    /// The directory lost `incarnation`'s lease and nothing replaced it: its endpoints fail
    /// new work fast (their circuits open) without waiting for a transport timeout — unless
    /// its control connection is alive, which says more than the directory. Nothing is
    /// forgotten: a healthy process that lost its lease claims its name again, and then
    /// [`PeerChange::Returned`] tries its endpoints at once.
    pub(super) fn peer_gone(&mut self, name: &str, incarnation: Incarnation, now: Instant) {
        // A peer this side heard from within the liveness timeout is alive whatever etcd
        // says (it lost etcd, not its peers): transfers never depend on the directory, and
        // liveness fails its work fast if it does stop.
        let alive: BTreeSet<SocketAddr> = self
            .conns
            .values()
            .filter(|conn| {
                conn.dialed
                    && conn.peer == Some(incarnation)
                    && now.duration_since(conn.last_heard) < self.policy.liveness_timeout
            })
            .map(|conn| conn.addr)
            .collect();
        let gone: Vec<(u16, EndpointId)> = self
            .endpoints_of(incarnation)
            .into_iter()
            .filter(|key| {
                self.active
                    .get(key)
                    .is_some_and(|active| !alive.contains(&active.addr))
            })
            .collect();
        if !gone.is_empty() {
            warning!(
                self,
                Circuit,
                peer = name,
                incarnation = %incarnation,
                "peer lost its directory lease; failing its work fast"
            );
        }
        for (rail, id) in gone {
            self.handle_input(rail, id, Input::PeerGone, now);
        }
    }

    /// The live endpoints to `incarnation`.
    pub(super) fn endpoints_of(&self, incarnation: Incarnation) -> Vec<(u16, EndpointId)> {
        self.active
            .iter()
            .filter(|(_, a)| {
                a.machine.key().peer == incarnation && a.machine.phase() != Phase::Retired
            })
            .map(|(&key, _)| key)
            .collect()
    }

    /// Timers: endpoint deadlines, connects waiting too long, accepted connections silent
    /// past the connect timeout; then the immediates that arrived on passive queue pairs.
    pub(crate) fn tick(&mut self, now: Instant) {
        self.expire_unproven(now);
        let due: Vec<(u16, EndpointId)> = self
            .active
            .iter()
            .filter(|(_, a)| a.machine.next_timeout().is_some_and(|t| t <= now))
            .map(|(&k, _)| k)
            .collect();
        for (rail, id) in due {
            if let Some(active) = self.active.get_mut(&(rail, id)) {
                let connecting = active.machine.phase() == Phase::Connecting;
                active.machine.handle_timeout(now);
                if connecting && active.machine.phase() != Phase::Connecting {
                    bump(&self.shared.counters.handshake_failures);
                }
            }
            self.drive(rail, id, now);
        }
        self.expire_waiting(now);
        let silent: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.peer.is_none() && now.duration_since(c.opened) > self.policy.connect_timeout
            })
            .map(|(&id, _)| id)
            .collect();
        for conn in silent {
            self.closed(conn, "no handshake within the connect timeout", now);
        }
        self.check_liveness(now);
        self.expire_orphaned_queue_pairs(now);
        self.tend_room(now);
        self.send_waiting_handshakes(now);
        self.take_immediates();
        self.publish_gauges(now);
    }

    /// The gauges of [`ControlStats`](crate::ControlStats): handshakes in flight and peers
    /// known at every tick, the peer table's footprint once a second (it walks the tables).
    fn publish_gauges(&mut self, now: Instant) {
        let counters = &self.shared.counters;
        counters
            .handshakes_in_flight
            .store(self.handshakes.len() as u64, Ordering::Relaxed);
        counters
            .known_peers
            .store(self.peers.len() as u64, Ordering::Relaxed);
        if self.footprint_at.is_none_or(|at| now >= at) {
            self.footprint_at = Some(now + FOOTPRINT_EVERY);
            let bytes = self.footprint() as u64;
            self.shared
                .counters
                .control_state_bytes
                .store(bytes, Ordering::Relaxed);
        }
    }
}

/// What a cluster directory learned about a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerChange {
    /// `old` was replaced by `new`, which listens at `addr`.
    Restarted {
        /// The incarnation that is gone.
        old: Incarnation,
        /// The one that replaced it.
        new: Incarnation,
        /// The new one's handshake address.
        addr: SocketAddr,
    },
    /// `incarnation`'s lease is gone and nothing replaced it: it died, stalled or lost the
    /// directory. Its endpoints fail fast until it returns or a new incarnation replaces it.
    Gone {
        /// The incarnation that is gone.
        incarnation: Incarnation,
    },
    /// `incarnation`, reported gone, holds its name again (a healthy process re-claimed it).
    Returned {
        /// The incarnation that is back.
        incarnation: Incarnation,
    },
}
