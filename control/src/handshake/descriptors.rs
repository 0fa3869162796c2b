//! Descriptors: asking peers for their segment descriptors, taking the answers, and turning an
//! application's connect that waits for a descriptor into an endpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::Instant;

use railyard_dataplane::rng::SplitMix64;
use railyard_dataplane::{EndpointId, Epoch};

use super::state::{Active, ConnId, Core, Waiting};
use crate::descriptor::SegmentDescriptor;
use crate::directory::Directory;
use crate::endpoint::{Endpoint, EndpointKey, Incarnation, Input, Phase};
use crate::error::ControlError;
use crate::rail::RailFabric;
use crate::shared::EndpointView;
use crate::wire::Message;

impl<F: RailFabric> Core<F> {
    /// This process's segment descriptor as it stands.
    pub(crate) fn local_descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.me.name.clone(),
            incarnation: self.me.incarnation,
            handshake_addr: self.me.local_addr.to_string(),
            rails: self.fabrics.iter().map(RailFabric::describe).collect(),
            regions: self.shared.regions(),
        }
    }

    /// Asks for the peer's descriptor on `conn`; connects waiting on it wait for the answer.
    pub(super) fn ask_descriptor(&mut self, conn: ConnId) {
        if let Some(state) = self.conns.get_mut(&conn) {
            state.descriptors_asked += 1;
            self.send(conn, Message::GetDescriptor);
        }
    }

    /// Forgets `peer`'s descriptor, and what the rails' fabrics learnt from it.
    pub(super) fn forget_descriptor(&mut self, peer: Incarnation) {
        // Stale or not: a peer that crashed had its descriptor invalidated by the reconnect
        // attempts before its restart was seen.
        if let Some(descriptor) = self.descriptors.forget(peer) {
            for fabric in &self.fabrics {
                fabric.forget_descriptor(&descriptor);
            }
        }
    }

    pub(super) fn on_descriptor(
        &mut self,
        conn: ConnId,
        descriptor: SegmentDescriptor,
        now: Instant,
    ) {
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        let incarnation = descriptor.incarnation;
        if state.descriptors_asked == 0 {
            return self.refuse(conn, "a descriptor nobody asked for", now);
        }
        if state.peer != Some(incarnation) {
            let reason = format!("a descriptor of {incarnation} from another incarnation");
            return self.refuse(conn, &reason, now);
        }
        state.descriptors_asked -= 1;
        for fabric in &self.fabrics {
            fabric.learn_descriptor(&descriptor);
        }
        let fresh = self.descriptors.record(descriptor);
        for active in self.active.values() {
            if active.machine.key().peer == incarnation {
                active.view.set_descriptor(fresh.clone());
            }
        }
        self.resolve_waiting(now);
    }

    /// The application wants an endpoint from `local_rail` to `remote_rail` of the process
    /// listening at `addr`; the answer goes to `reply` once its Hello and descriptor are in.
    pub(crate) fn connect(
        &mut self,
        addr: SocketAddr,
        local_rail: u16,
        remote_rail: u16,
        reply: Sender<Result<Arc<EndpointView>, ControlError>>,
        now: Instant,
    ) {
        if usize::from(local_rail) >= self.fabrics.len() {
            let _ = reply.send(Err(ControlError::UnknownRail {
                rail: local_rail,
                rails: self.fabrics.len(),
            }));
            return;
        }
        // The answer carries the peer's current descriptor, even for an endpoint that
        // exists already: its regions may have changed since it was last fetched.
        let fresh = !self.dialed.contains_key(&addr);
        let conn = self.conn_to(addr, now);
        if !fresh {
            self.ask_descriptor(conn);
        }
        self.waiting.push(Waiting {
            conn,
            local_rail,
            remote_rail,
            reply,
            deadline: now + self.policy.connect_timeout,
        });
        self.resolve_waiting(now);
    }

    /// Asks incarnation `peer`, dialed at `addr`, for its descriptor again; its endpoints'
    /// views take the answer. Nothing happens without a live dialed connection to that
    /// incarnation (a reconnect fetches the descriptor anyway).
    pub(crate) fn refresh_descriptor(&mut self, addr: SocketAddr, peer: Incarnation) {
        let Some(&conn) = self.dialed.get(&addr) else {
            return;
        };
        if self.conns.get(&conn).and_then(|state| state.peer) != Some(peer) {
            return;
        }
        self.descriptors.invalidate(peer);
        self.ask_descriptor(conn);
    }

    /// Turns connects whose peer is known into endpoints.
    pub(super) fn resolve_waiting(&mut self, now: Instant) {
        let mut still_waiting = Vec::new();
        for waiting in std::mem::take(&mut self.waiting) {
            let known = self.conns.get(&waiting.conn).and_then(|conn| {
                let incarnation = conn.peer?;
                (conn.descriptors_asked == 0).then_some((incarnation, conn.addr))
            });
            match known {
                Some((incarnation, addr)) => {
                    let name = self.peer_name(incarnation);
                    let view = self.endpoint_for(
                        name,
                        incarnation,
                        addr,
                        waiting.local_rail,
                        waiting.remote_rail,
                        now,
                    );
                    let _ = waiting.reply.send(Ok(view));
                }
                None => still_waiting.push(waiting),
            }
        }
        self.waiting = still_waiting;
    }

    pub(super) fn expire_waiting(&mut self, now: Instant) {
        let (expired, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| now >= w.deadline);
        self.waiting = kept;
        for waiting in expired {
            let addr = self
                .conns
                .get(&waiting.conn)
                .map_or(self.me.local_addr, |c| c.addr);
            let _ = waiting.reply.send(Err(ControlError::Unreachable {
                addr,
                reason: "no handshake within the connect timeout".into(),
            }));
        }
    }

    /// The endpoint for a peer incarnation and rails, created if new.
    pub(super) fn endpoint_for(
        &mut self,
        peer_name: String,
        incarnation: Incarnation,
        addr: SocketAddr,
        local_rail: u16,
        remote_rail: u16,
        now: Instant,
    ) -> Arc<EndpointView> {
        let key = EndpointKey {
            peer: incarnation,
            local_rail,
            remote_rail,
        };
        if let Some(id) = self.by_key.get(&key) {
            if let Some(active) = self.active.get(&(local_rail, *id)) {
                if active.machine.phase() != Phase::Retired {
                    return active.view.clone();
                }
            }
        }
        let id = match self
            .free_ids
            .iter()
            .position(|&(rail, _)| rail == local_rail)
        {
            Some(position) => self.free_ids.swap_remove(position).1,
            None => EndpointId(self.shared.endpoint_slots(local_rail) as u32),
        };
        let first_epoch = self
            .next_epochs
            .get(&(local_rail, id))
            .copied()
            .unwrap_or(Epoch::FIRST);
        let view = Arc::new(EndpointView::new(
            id,
            key,
            peer_name,
            first_epoch,
            self.descriptors.lookup(incarnation),
        ));
        self.shared.publish(local_rail, id, Some(view.clone()));
        let seed = self.rng.next_u64();
        let mut machine = Endpoint::new(key, self.policy.clone(), SplitMix64::new(seed));
        machine.start_at(first_epoch);
        self.by_key.insert(key, id);
        let span = tracing::info_span!(
            target: "railyard::control",
            parent: None,
            "endpoint",
            engine = %self.me.name,
            peer = %view.peer_name,
            incarnation = %incarnation,
            addr = %addr,
            rail = local_rail,
            remote_rail,
            endpoint = id.0,
        );
        span.in_scope(|| {
            tracing::info!(
                target: "railyard::control",
                first_epoch = first_epoch.get(),
                "endpoint opened"
            );
        });
        self.active.insert(
            (local_rail, id),
            Active {
                machine,
                view: view.clone(),
                addr,
                pending: None,
                offered: None,
                published: None,
                fence: None,
                span,
                parked: false,
                parking: None,
                wants_room: false,
                last_wanted: now,
            },
        );
        self.acquire_queue_pair(local_rail, id, Input::ConnectWanted, now);
        view
    }
}
