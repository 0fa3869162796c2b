//! Retirement: endpoints and queue pairs taken out of service — retired, announced with
//! RetireQp, revoked behind a fence, drained, or left behind by an initiator that is gone.

use std::collections::BTreeSet;
use std::time::Instant;

use railyard_dataplane::{EndpointId, Epoch};

use super::state::{ConnId, Core, Orphan, Passive, warning};
use crate::endpoint::{Incarnation, Input, Phase};
use crate::rail::{RailFabric, Revocation};
use crate::shared::bump;
use crate::warn::{WarningKind, control_warning};
use crate::wire::{Message, WireKey};

impl<F: RailFabric> Core<F> {
    /// The initiator of a passive queue pair retired it: drop it if it is still that one,
    /// so nothing buffered from it executes. Only the initiator itself may say so.
    pub(super) fn on_retire_qp(&mut self, conn: ConnId, key: WireKey, qp_num: u32) {
        let speaker = self.conns.get(&conn).and_then(|state| state.peer);
        if speaker != Some(key.initiator) || key.target != self.me.incarnation {
            return;
        }
        // Given up before its turn came: it is never answered, so nothing is connected to
        // a queue pair its initiator has taken out of service.
        self.forget_unanswered(key, qp_num);
        let still_that_one = self
            .passive
            .get(&key)
            .is_some_and(|passive| passive.remote_qp_num == qp_num);
        if let Some(passive) = still_that_one.then(|| self.passive.remove(&key)).flatten() {
            self.revoke_passive(key, passive);
        }
    }

    // ---- the target's side of a handshake ----------------------------------------------

    /// Tells the target that our queue pair of `epoch` (or any, with `None`) for endpoint
    /// `id` is out of service, so that it executes nothing more it buffered from it.
    pub(super) fn announce_retired_qp(
        &mut self,
        rail: u16,
        id: EndpointId,
        epoch: Option<Epoch>,
        now: Instant,
    ) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        let Some((offered_epoch, qp_num)) = active.offered else {
            return;
        };
        if epoch.is_some_and(|epoch| epoch != offered_epoch) {
            return;
        }
        active.offered = None;
        let (key, addr) = (active.machine.key(), active.addr);
        let message = Message::RetireQp {
            key: WireKey {
                initiator: self.me.incarnation,
                target: key.peer,
                initiator_rail: key.local_rail,
                target_rail: key.remote_rail,
            },
            epoch: offered_epoch.get(),
            qp_num,
        };
        // Dialing if needed: a queue pair the target keeps would still execute what it
        // buffered from it.
        let conn = self.conn_to(addr, now);
        self.send(conn, message);
    }

    // ---- application requests ----------------------------------------------------------

    /// The application retires an endpoint.
    pub(crate) fn retire(&mut self, rail: u16, id: EndpointId, now: Instant) {
        self.handle_input(rail, id, Input::Retire, now);
    }

    /// Fences `peer` (the application's revoke): bumps its fence generation, then takes
    /// every passive queue pair of it out of service.
    pub(crate) fn revoke(&mut self, peer: Incarnation) -> Vec<Revocation> {
        // Before anything else: every reply from now on tells the peer it was fenced.
        *self.fences.entry(peer).or_default() += 1;
        self.take_down_passive(peer)
    }

    /// Takes every passive queue pair of `peer` out of service, without fencing it: its
    /// work retries on new queue pairs as after any transport failure.
    pub(super) fn take_down_passive(&mut self, peer: Incarnation) -> Vec<Revocation> {
        let keys: Vec<WireKey> = self
            .passive
            .keys()
            .filter(|key| key.initiator == peer)
            .copied()
            .collect();
        keys.into_iter()
            .filter_map(|key| {
                let passive = self.passive.remove(&key)?;
                Some(self.revoke_passive(key, passive))
            })
            .collect()
    }

    pub(super) fn revoke_passive(
        &mut self,
        key: WireKey,
        mut passive: Passive<F::Connected>,
    ) -> Revocation {
        bump(&self.shared.counters.passive_retired);
        // Immediates that arrived before are the application's: deliver them first.
        let _ = self.deliver_immediates(key, &mut passive.qp);
        match self.fabrics.get(usize::from(key.target_rail)) {
            Some(fabric) => fabric.revoke(passive.qp),
            // Unreachable: passive queue pairs exist only on rails that exist.
            None => Revocation::done(),
        }
    }

    // ---- endpoints ---------------------------------------------------------------------

    /// A retired endpoint has nothing in flight: its id may be reused.
    pub(super) fn drained(&mut self, rail: u16, id: EndpointId) {
        let Some(active) = self.active.get(&(rail, id)) else {
            return;
        };
        if active.machine.phase() != Phase::Retired {
            return;
        }
        let next = active.machine.epoch().map_or(Epoch::FIRST, Epoch::next);
        let key = active.machine.key();
        active.span.in_scope(|| {
            tracing::info!(
                target: "railyard::control",
                "endpoint drained: nothing in flight, its id is free"
            );
        });
        self.active.remove(&(rail, id));
        if self.by_key.get(&key) == Some(&id) {
            self.by_key.remove(&key);
        }
        self.next_epochs.insert((rail, id), next);
        self.shared.publish(rail, id, None);
        self.free_ids.push((rail, id));
        self.forget_if_unused(key.peer);
    }

    /// Takes out of service the target queue pairs of initiators that have had no control
    /// connection for [`Policy::passive_linger`](crate::policy::Policy::passive_linger) — a crashed initiator cannot say RetireQp —
    /// unless a probe of the listener it announced reaches it again: a live initiator whose
    /// connection dropped keeps them.
    pub(super) fn expire_orphaned_queue_pairs(&mut self, now: Instant) {
        if self.passive.is_empty() && self.orphans.is_empty() {
            return;
        }
        let connected: BTreeSet<Incarnation> =
            self.conns.values().filter_map(|conn| conn.peer).collect();
        let orphaned: BTreeSet<Incarnation> = self
            .passive
            .keys()
            .map(|key| key.initiator)
            .filter(|initiator| !connected.contains(initiator))
            .collect();
        self.orphans
            .retain(|initiator, _| orphaned.contains(initiator));
        for initiator in orphaned {
            let orphan = *self.orphans.entry(initiator).or_insert(Orphan {
                since: now,
                probed: None,
            });
            if now.duration_since(orphan.since) < self.policy.passive_linger {
                continue;
            }
            let listen = self.peers.get(&initiator).and_then(|peer| peer.listen);
            match (orphan.probed, listen) {
                (None, Some(listen)) => {
                    // Its Hello, if it answers, makes it connected again.
                    self.conn_to(listen, now);
                    if let Some(orphan) = self.orphans.get_mut(&initiator) {
                        orphan.probed = Some(now);
                    }
                    continue;
                }
                (Some(probed), _) if now.duration_since(probed) < self.policy.connect_timeout => {
                    continue;
                }
                _ => {}
            }
            self.orphans.remove(&initiator);
            // Not a fence: an initiator that comes back retries its work as usual.
            let revoked = self.take_down_passive(initiator).len();
            let name = self.peer_name(initiator);
            warning!(
                self,
                Retire,
                peer = %name,
                incarnation = %initiator,
                queue_pairs = revoked,
                linger = ?self.policy.passive_linger,
                "initiator gone: no connection, and no answer at its listener; its queue pairs here go"
            );
            self.forget_if_unused(initiator);
        }
    }
}
