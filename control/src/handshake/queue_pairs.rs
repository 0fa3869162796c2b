//! Queue pairs: the ConnectQp handshake on both sides, creating and staging queue pairs,
//! driving each endpoint's state machine into commands for its poller, poller events, and
//! the notifications carried on immediates.

use std::net::SocketAddr;
use std::time::Instant;

use railyard_dataplane::fabric::tcp::TcpAttachment;
use railyard_dataplane::sabotage::{self, Protection};
use railyard_dataplane::{Command, EndpointId, Epoch, Event};

use super::state::{Action, ConnId, Core, Passive, Pending, warning};
use crate::directory::Directory;
use crate::endpoint::{Incarnation, Input, Output, Phase};
use crate::rail::{PeerLink, RailFabric};
use crate::shared::{ControlShared, Notification, NotificationBody, bump};
use crate::warn::{WarningKind, control_warning};
use crate::wire::{Message, QpSide, WireKey};

impl<F: RailFabric> Core<F> {
    pub(super) fn on_notify(&mut self, conn: ConnId, target: Incarnation, bytes: Vec<u8>) {
        let Some(from) = self.conns.get(&conn).and_then(|state| state.peer) else {
            return;
        };
        let name = self.peer_name(from);
        if target != self.me.incarnation {
            bump(&self.shared.counters.notifications_refused);
            warning!(
                self,
                Handshake,
                peer = %name,
                incarnation = %from,
                target = %target,
                "refusing a notification meant for another incarnation"
            );
            return;
        }
        self.shared.deliver([Notification {
            from: name,
            incarnation: from,
            body: NotificationBody::Bytes(bytes),
        }]);
    }

    /// What is known of the peer `incarnation` reached over `conn`.
    pub(super) fn link(&self, conn: ConnId, incarnation: Incarnation) -> PeerLink {
        PeerLink {
            same_host: self
                .peers
                .get(&incarnation)
                .is_some_and(|peer| peer.host.same_host_as(&self.me.host)),
            local_ip: self
                .conns
                .get(&conn)
                .and_then(|state| state.local_ip)
                .unwrap_or(self.me.local_addr.ip()),
        }
    }

    /// Answers a ConnectQp (its turn has come: see `turns.rs`).
    pub(super) fn answer_connect_qp_on(
        &mut self,
        conn: ConnId,
        key: WireKey,
        epoch: u64,
        handshake: u64,
        side: &QpSide,
    ) {
        let speaker = self.conns.get(&conn).and_then(|state| state.peer);
        let result = if speaker == Some(key.initiator) {
            let link = self.link(conn, key.initiator);
            self.answer_connect_qp(key, side, &link, conn)
        } else {
            bump(&self.shared.counters.refused);
            let reason = format!(
                "the queue pair is asked for {} on the connection of {}",
                key.initiator,
                speaker.map_or_else(|| "no one".into(), |s| s.to_string())
            );
            warning!(
                self,
                Handshake,
                incarnation = %key.initiator,
                speaker = speaker.map(display),
                rail = key.target_rail,
                epoch,
                reason,
                "refusing a ConnectQp"
            );
            Err(reason)
        };
        let fence = self.fences.get(&key.initiator).copied().unwrap_or(0);
        self.send(
            conn,
            Message::ConnectQpReply {
                key,
                epoch,
                handshake,
                fence,
                result,
            },
        );
    }

    pub(super) fn answer_connect_qp(
        &mut self,
        key: WireKey,
        side: &QpSide,
        link: &PeerLink,
        conn: ConnId,
    ) -> Result<QpSide, String> {
        if key.target != self.me.incarnation {
            bump(&self.shared.counters.refused);
            return Err(format!(
                "the queue pair is meant for incarnation {}, this process is {}",
                key.target, self.me.incarnation
            ));
        }
        let Some(fabric) = self.fabrics.get(usize::from(key.target_rail)) else {
            bump(&self.shared.counters.refused);
            return Err(format!(
                "rail {} does not exist (this process has {})",
                key.target_rail,
                self.fabrics.len()
            ));
        };
        let existing = self.passive.get(&key);
        if let Some(existing) = existing {
            if existing.remote_qp_num == side.info.qp_num
                && !sabotage::is_off(Protection::IdempotentReplies)
            {
                bump(&self.shared.counters.idempotent_replies);
                return Ok(existing.local.clone());
            }
            if existing.conn > conn {
                bump(&self.shared.counters.refused);
                return Err(
                    "a ConnectQp from an older connection than the queue pair it would replace"
                        .into(),
                );
            }
        } else {
            let of_peer = self
                .passive
                .keys()
                .filter(|held| held.initiator == key.initiator)
                .count();
            if of_peer >= self.policy.max_queue_pairs_per_peer
                || self.passive.len() >= self.policy.max_target_queue_pairs
            {
                bump(&self.shared.counters.refused);
                return Err(format!(
                    "too many queue pairs: {of_peer} of {} held here (at most {} per peer, {} in all)",
                    key.initiator,
                    self.policy.max_queue_pairs_per_peer,
                    self.policy.max_target_queue_pairs
                ));
            }
        }
        let connected = fabric
            .create_target_qp(link, side)
            .and_then(|(qp, local)| Ok((fabric.connect_qp(qp, side)?, local)));
        let (qp, local) = match connected {
            Ok(connected) => connected,
            Err(reason) => {
                bump(&self.shared.counters.refused);
                return Err(reason);
            }
        };
        bump(&self.shared.counters.passive_qps);
        self.count_fabric(&local);
        let replaced = self.passive.insert(
            key,
            Passive {
                qp,
                remote_qp_num: side.info.qp_num,
                local: local.clone(),
                conn,
            },
        );
        if replaced.is_some() {
            bump(&self.shared.counters.teardowns);
        }
        Ok(local)
    }

    /// Counts a new queue pair by fabric (its side's attachment says which).
    pub(super) fn count_fabric(&self, side: &QpSide) {
        if TcpAttachment::is_tcp(&side.attachment) {
            bump(&self.shared.counters.tcp_qps);
        }
    }

    // ---- the initiator's side of a handshake -------------------------------------------

    /// The endpoint waiting for handshake `handshake` at `epoch`, if a message about it on
    /// `conn` for `key` is for that endpoint: it came on the connection the ConnectQp went
    /// out on, from the peer the endpoint is for, and the endpoint still waits for exactly
    /// that attempt.
    pub(super) fn waiting_endpoint(
        &self,
        conn: ConnId,
        key: WireKey,
        epoch: u64,
        handshake: u64,
    ) -> Option<(u16, EndpointId)> {
        let speaker = self.conns.get(&conn).and_then(|state| state.peer);
        let endpoint = self.handshakes.get(&handshake).copied()?;
        let active = self.active.get(&endpoint)?;
        let machine_key = active.machine.key();
        let expected = WireKey {
            initiator: self.me.incarnation,
            target: machine_key.peer,
            initiator_rail: machine_key.local_rail,
            target_rail: machine_key.remote_rail,
        };
        let waits = active.pending.as_ref().is_some_and(|pending| {
            pending.handshake == handshake && pending.conn == conn && pending.epoch.get() == epoch
        });
        (key == expected && speaker == Some(machine_key.peer) && waits).then_some(endpoint)
    }

    /// A ConnectQp reply for `(epoch, handshake)`, with the peer's fence generation for this
    /// side: when it changed since the endpoint's previous queue pair, the peer revoked this
    /// side meanwhile, and every slice prepared for an older epoch fails `Revoked` before
    /// the new queue pair reaches the poller.
    pub(super) fn on_connect_reply(
        &mut self,
        conn: ConnId,
        key: WireKey,
        (epoch, handshake): (u64, u64),
        fence: u64,
        result: Result<QpSide, String>,
        now: Instant,
    ) {
        let Some((rail, id)) = self.waiting_endpoint(conn, key, epoch, handshake) else {
            bump(&self.shared.counters.stray_replies);
            return;
        };
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        self.handshakes.remove(&handshake);
        let Some(pending) = active.pending.take() else {
            return;
        };
        let epoch = pending.epoch;
        if active.fence.is_some_and(|known| known != fence) {
            active.view.revoke_before(epoch);
        }
        active.fence = Some(fence);
        let fabric = &self.fabrics[usize::from(rail)];
        let outcome = result
            .and_then(|side| fabric.connect_qp(pending.qp, &side))
            .and_then(|connected| fabric.stage(id, epoch, connected));
        let span = active.span.clone();
        let _entered = span.enter();
        match outcome {
            Ok(()) => {
                let took = now.saturating_duration_since(pending.sent);
                self.shared.counters.handshake_times.record(took);
                tracing::info!(
                    target: "railyard::control",
                    epoch = epoch.get(),
                    took = ?took,
                    "queue pair connected"
                );
                self.handle_input(rail, id, Input::HandshakeDone { epoch }, now);
            }
            Err(reason) => {
                warning!(
                    self,
                    Handshake,
                    peer = %active.view.peer_name,
                    incarnation = %key.target,
                    endpoint = id.0,
                    rail,
                    epoch = epoch.get(),
                    reason,
                    "the peer refused a queue pair"
                );
                self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        }
    }

    /// Creates a queue pair for `epoch` and sends its ConnectQp with a fresh handshake id
    /// (fetching the descriptor first on a reconnect, on the same ordered connection).
    /// Creates endpoint `id`'s queue pair at `epoch` and offers it to the peer; `woken`: it
    /// ends a park (see `eviction.rs`), which is not a reconnect — nothing failed, nothing
    /// is counted or warned about, and the peer's descriptor is not fetched again.
    pub(super) fn create_qp(
        &mut self,
        rail: u16,
        id: EndpointId,
        epoch: Epoch,
        woken: bool,
        now: Instant,
    ) {
        let Some(active) = self.active.get(&(rail, id)) else {
            return;
        };
        let (addr, key, peer) = (
            active.addr,
            active.machine.key(),
            active.view.peer_name.clone(),
        );
        let reconnect = epoch != active.view.first_epoch && !woken;
        let span = active.span.clone();
        let _entered = span.enter();
        let conn = self.conn_to(addr, now);
        let link = self.link(conn, key.peer);
        let (qp, side) = match self.fabrics[usize::from(rail)].create_qp(&link) {
            Ok(created) => created,
            Err(reason) => {
                warning!(
                    self,
                    Handshake,
                    peer = %peer,
                    incarnation = %key.peer,
                    endpoint = id.0,
                    rail,
                    epoch = epoch.get(),
                    reason,
                    "cannot create a queue pair"
                );
                return self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        };
        bump(&self.shared.counters.active_qps);
        self.count_fabric(&side);
        // The queue pair this one replaces is out of service for good.
        self.announce_retired_qp(rail, id, None, now);
        let qp_num = side.info.qp_num;
        if reconnect {
            bump(&self.shared.counters.reconnects);
            warning!(
                self,
                Reconnect,
                peer = %peer,
                incarnation = %key.peer,
                addr = %addr,
                endpoint = id.0,
                rail,
                epoch = epoch.get(),
                "reconnecting"
            );
            self.descriptors.invalidate(key.peer);
            self.ask_descriptor(conn);
        }
        let handshake = self.rng.next_u64();
        tracing::info!(
            target: "railyard::control",
            epoch = epoch.get(),
            qp_num,
            "queue pair offered"
        );
        self.send(
            conn,
            Message::ConnectQp {
                key: WireKey {
                    initiator: self.me.incarnation,
                    target: key.peer,
                    initiator_rail: key.local_rail,
                    target_rail: key.remote_rail,
                },
                epoch: epoch.get(),
                handshake,
                side,
            },
        );
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        if let Some(replaced) = active.pending.replace(Pending {
            epoch,
            handshake,
            conn,
            qp,
            sent: now,
        }) {
            self.handshakes.remove(&replaced.handshake);
        }
        active.offered = Some((epoch, qp_num));
        self.handshakes.insert(handshake, (rail, id));
    }

    /// Sends `bytes` to incarnation `target` at `addr`.
    pub(crate) fn notify(
        &mut self,
        addr: SocketAddr,
        target: Incarnation,
        bytes: Vec<u8>,
        now: Instant,
    ) {
        let conn = self.conn_to(addr, now);
        self.send(conn, Message::Notify { target, bytes });
    }

    /// A poller reported `event` on rail `rail`.
    pub(crate) fn poller_event(&mut self, rail: u16, event: Event, now: Instant) {
        match event {
            Event::QpFailed {
                endpoint,
                epoch,
                status,
            } => {
                self.announce_retired_qp(rail, endpoint, Some(epoch), now);
                self.handle_input(rail, endpoint, Input::QpError { epoch, status }, now);
            }
            Event::QpFatal { endpoint, epoch } => {
                self.announce_retired_qp(rail, endpoint, Some(epoch), now);
                self.handle_input(rail, endpoint, Input::QpFatal { epoch }, now);
            }
            Event::ConnectFailed {
                endpoint, epoch, ..
            } => {
                self.announce_retired_qp(rail, endpoint, Some(epoch), now);
                self.handle_input(rail, endpoint, Input::HandshakeFailed { epoch }, now);
            }
            Event::Confirmed { endpoint, epoch } => {
                self.handle_input(rail, endpoint, Input::Confirmed { epoch }, now);
            }
            Event::EndpointDrained { endpoint } => self.drained(rail, endpoint),
            Event::Parked { endpoint, epoch } => self.parked(rail, endpoint, epoch, now),
            Event::ParkRefused { endpoint, .. } => self.park_refused(rail, endpoint, now),
            Event::Wanted { endpoint } => self.wanted(rail, endpoint, now),
            _ => {}
        }
    }

    pub(super) fn handle_input(&mut self, rail: u16, id: EndpointId, input: Input, now: Instant) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        if matches!(input, Input::HandshakeFailed { .. }) {
            bump(&self.shared.counters.handshake_failures);
        }
        active.machine.handle(input, now);
        let span = active.span.clone();
        let _entered = span.enter();
        self.drive(rail, id, now);
    }

    /// Carries out an endpoint's outputs, then cancels a handshake it no longer waits for.
    /// Each new phase is published for submitters by an [`Action::Publish`] behind the
    /// commands before it: an endpoint is seen ready only once the poller has the commands
    /// that make it so (a slice sent to it then finds its circuit closed).
    pub(super) fn drive(&mut self, rail: u16, id: EndpointId, now: Instant) {
        loop {
            let Some(active) = self.active.get_mut(&(rail, id)) else {
                return;
            };
            let phase = active.machine.phase();
            let probation = active.machine.on_probation();
            if active.published != Some((phase, probation)) {
                // In order with the commands before it (all of one step's actions run
                // before the next step's).
                active.published = Some((phase, probation));

                let view = active.view.clone();
                self.actions.push_back(Action::Publish {
                    view,
                    phase,
                    probation,
                });
            }
            let Some(output) = active.machine.poll_output() else {
                break;
            };
            match output {
                Output::CreateQp { epoch } => {
                    // Whatever starts a new queue pair (a wake, a backoff, a circuit's
                    // trial) ends a park.
                    let woken = active.parked;
                    if woken {
                        active.parked = false;
                        active.view.set_parked(false);
                    }
                    // Any park asked for is moot: this queue pair replaces the one it named.
                    active.parking = None;
                    self.start_handshake(rail, id, epoch, woken, now);
                }
                Output::ConnectQp { epoch } => {
                    let view = active.view.clone();
                    self.actions
                        .push_back(Action::AddEndpoint { rail, view, epoch });
                }
                Output::RefreshDescriptor => {
                    let (addr, peer) = (active.addr, active.machine.key().peer);
                    self.descriptors.invalidate(peer);
                    if let Some(&conn) = self.dialed.get(&addr) {
                        self.ask_descriptor(conn);
                    }
                }
                Output::RetireEndpoint { reason } => {
                    bump(&self.shared.counters.teardowns);
                    warning!(
                        self,
                        Retire,
                        peer = %active.view.peer_name,
                        incarnation = %active.machine.key().peer,
                        addr = %active.addr,
                        endpoint = id.0,
                        rail,
                        epoch = active.machine.epoch().map(Epoch::get),
                        reason = %reason,
                        "endpoint retired"
                    );
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::RetireEndpoint {
                            endpoint: id,
                            reason,
                        },
                    });
                    self.announce_retired_qp(rail, id, None, now);
                }
                Output::OpenCircuit => {
                    bump(&self.shared.counters.circuit_openings);
                    warning!(
                        self,
                        Circuit,
                        peer = %active.view.peer_name,
                        incarnation = %active.machine.key().peer,
                        addr = %active.addr,
                        endpoint = id.0,
                        rail,
                        "circuit opened: work for the peer fails fast with PeerUnavailable"
                    );
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::SetCircuit {
                            endpoint: id,
                            open: true,
                        },
                    });
                }
                Output::Unreachable => {
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::Unreachable { endpoint: id },
                    });
                    self.announce_retired_qp(rail, id, None, now);
                }
                Output::CloseCircuit => {
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::SetCircuit {
                            endpoint: id,
                            open: false,
                        },
                    });
                }
            }
        }
        self.cancel_abandoned_handshake(rail, id);
    }

    /// An endpoint that is no longer connecting at its pending handshake's epoch (retired,
    /// timed out, moved on) cancels it: a late reply finds no one waiting.
    pub(super) fn cancel_abandoned_handshake(&mut self, rail: u16, id: EndpointId) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        let waiting_for_it = active.pending.as_ref().is_some_and(|pending| {
            active.machine.phase() == Phase::Connecting
                && active.machine.epoch() == Some(pending.epoch)
        });
        if !waiting_for_it {
            if let Some(abandoned) = active.pending.take() {
                self.handshakes.remove(&abandoned.handshake);
            }
        }
    }

    // ---- immediates --------------------------------------------------------------------

    /// Turns the immediates that arrived on passive queue pairs into notifications; drops
    /// passive queue pairs that broke (their initiator sees its side fail and reconnects).
    pub(super) fn take_immediates(&mut self) {
        // Every tick, with thousands of target queue pairs: one pass over them in place,
        // and the table touched again only for those that had something.
        let mut broke = Vec::new();
        for (&key, passive) in &mut self.passive {
            let Some(fabric) = self.fabrics.get(usize::from(key.target_rail)) else {
                continue;
            };
            self.immediates.clear();
            let taken = fabric.take_immediates(&mut passive.qp, &mut self.immediates);
            if !self.immediates.is_empty() {
                let from = self
                    .peers
                    .get(&key.initiator)
                    .map(|info| info.name.as_str());
                hand_over(&self.shared, from, key, &self.immediates);
            }
            if let Err(reason) = taken {
                broke.push((key, reason));
            }
        }
        for (key, reason) in broke {
            if self.passive.remove(&key).is_some() {
                bump(&self.shared.counters.teardowns);
                warning!(
                    self,
                    Handshake,
                    incarnation = %key.initiator,
                    rail = key.target_rail,
                    initiator_rail = key.initiator_rail,
                    reason,
                    "dropping a target queue pair that broke"
                );
            }
        }
    }

    /// Queues the immediates that arrived on `qp` (the passive queue pair of `key`) as
    /// notifications.
    ///
    /// # Errors
    /// The fabric's reason when the queue pair is broken.
    pub(super) fn deliver_immediates(
        &mut self,
        key: WireKey,
        qp: &mut F::Connected,
    ) -> Result<(), String> {
        let Some(fabric) = self.fabrics.get(usize::from(key.target_rail)) else {
            return Ok(());
        };
        self.immediates.clear();
        let taken = fabric.take_immediates(qp, &mut self.immediates);
        if !self.immediates.is_empty() {
            let from = self
                .peers
                .get(&key.initiator)
                .map(|info| info.name.as_str());
            hand_over(&self.shared, from, key, &self.immediates);
        }
        taken
    }
}

/// Hands the immediates taken from `key`'s target queue pair to the application as
/// notifications from its initiator (named `from`, if it said Hello).
fn hand_over(shared: &ControlShared, from: Option<&str>, key: WireKey, immediates: &[u32]) {
    let from = from.unwrap_or_default();
    shared.deliver(immediates.iter().map(|&imm| Notification {
        from: from.to_string(),
        incarnation: key.initiator,
        body: NotificationBody::Immediate(imm),
    }));
}
