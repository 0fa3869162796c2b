//! Admission and proof: which connections are accepted, dialed, evicted or closed, what a
//! Hello and the proof of the cluster secret must show before a peer is admitted, and which
//! frames an admitted connection's peer may send.

use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

use tracing::field::{Empty, display};

#[cfg(feature = "sabotage")]
use railyard_dataplane::sabotage::{self, Protection};
use railyard_dataplane::{EndpointId, Epoch};

use super::state::{Action, Conn, ConnId, Core, EVICTABLE_AFTER, MAX_HELD, PeerInfo, warning};
use crate::auth::{self, ClusterSecret, Role, Transcript};
#[cfg(feature = "sabotage")]
use crate::endpoint::Incarnation;
use crate::endpoint::Input;
use crate::error::ControlError;
use crate::rail::RailFabric;
use crate::shared::bump;
use crate::warn::{WarningKind, control_warning};
use crate::wire::{MAC_LEN, Message, NONCE_LEN};

impl<F: RailFabric> Core<F> {
    /// With [`Protection::IncarnationCheck`] off (sabotage builds only), a process that
    /// answers at an address this side dialed is taken for the incarnation that answered
    /// there before — the address treated as an identity. Returns the incarnation the Hello
    /// is then taken to say.
    #[cfg(feature = "sabotage")]
    pub(super) fn mistake_identity(&mut self, conn: ConnId, said: Incarnation) -> Incarnation {
        if !sabotage::is_off(Protection::IncarnationCheck) {
            return said;
        }
        let Some(state) = self.conns.get(&conn).filter(|state| state.dialed) else {
            return said;
        };
        match self.listeners.get(&state.addr) {
            Some(&before) if before != said && state.peer.is_none() => {
                self.mistaken.insert(said, before);
                before
            }
            _ => said,
        }
    }

    /// What a mistaken newcomer says about itself is read as its predecessor's (sabotage).
    #[cfg(feature = "sabotage")]
    pub(super) fn mistake_incoming(&self, mut message: Message) -> Message {
        let mistake = |incarnation: &mut Incarnation| {
            if let Some(&before) = self.mistaken.get(incarnation) {
                *incarnation = before;
            }
        };
        match &mut message {
            Message::Descriptor(descriptor) => mistake(&mut descriptor.incarnation),
            Message::ConnectQpReply { key, .. } | Message::ConnectQpQueued { key, .. } => {
                mistake(&mut key.target)
            }
            _ => {}
        }
        message
    }

    /// What is addressed to a mistaken predecessor goes to its newcomer (sabotage).
    #[cfg(feature = "sabotage")]
    pub(super) fn undo_mistaken_identity(&self, mut message: Message) -> Message {
        let undo = |incarnation: &mut Incarnation| {
            if let Some((&newcomer, _)) = self.mistaken.iter().find(|(_, b)| **b == *incarnation) {
                *incarnation = newcomer;
            }
        };
        match &mut message {
            Message::ConnectQp { key, .. } | Message::RetireQp { key, .. } => undo(&mut key.target),
            Message::Notify { target, .. } => undo(target),
            _ => {}
        }
        message
    }

    /// This side's Hello on `conn` (its nonce is the connection's own).
    pub(super) fn hello(&self, conn: ConnId) -> Message {
        Message::Hello {
            name: self.me.name.clone(),
            incarnation: self.me.incarnation,
            host: self.me.host,
            listen: self.me.local_addr.to_string(),
            nonce: self
                .conns
                .get(&conn)
                .map_or([0; NONCE_LEN], |state| state.nonce),
            encrypt: self.me.encrypt_control,
        }
    }

    /// This side's session keys for the connection whose Hellos are `dialer` and
    /// `listener`, queued for the driver right after this side's Auth.
    fn protect(
        &mut self,
        conn: ConnId,
        secret: &ClusterSecret,
        dialer: &Message,
        listener: &Message,
    ) {
        let role = if self.conns.get(&conn).is_some_and(|state| state.dialed) {
            Role::Dialer
        } else {
            Role::Listener
        };
        if let Some(keys) = secret.session_keys_for(role, dialer, listener) {
            self.actions.push_back(Action::Protect {
                conn,
                keys: Box::new(keys),
            });
        }
    }

    // ---- connections -------------------------------------------------------------------

    /// Whether the listener may take another connection: fewer than
    /// [`Policy::max_connections`](crate::policy::Policy::max_connections) accepted, and either fewer than
    /// [`Policy::max_handshakes`](crate::policy::Policy::max_handshakes) of them before their Hello or the oldest of those silent
    /// for [`EVICTABLE_AFTER`] — [`Self::accepted`] then closes it to make room, so a flood
    /// of silent connections churns but cannot keep a peer that speaks out.
    pub(crate) fn may_accept(&self, now: Instant) -> bool {
        let mut accepted = 0;
        let mut silent = 0;
        let mut evictable = false;
        for conn in self.conns.values().filter(|conn| !conn.dialed) {
            accepted += 1;
            if conn.peer.is_none() {
                silent += 1;
                evictable |= self.evictable(conn, now);
            }
        }
        let room_for_one_more = silent < self.policy.max_handshakes || evictable;
        accepted < self.policy.max_connections && room_for_one_more
    }

    /// Whether the not-yet-admitted connection `conn` may make room for a newer one: one
    /// that said nothing after [`EVICTABLE_AFTER`]; one whose proof of the cluster secret is
    /// under way only after half the connect timeout, so that a member a long round trip
    /// away is not pushed out by a flood of Hellos.
    pub(super) fn evictable(&self, conn: &Conn, now: Instant) -> bool {
        let grace = if conn.unproven.is_some() {
            self.policy.connect_timeout / 2
        } else {
            EVICTABLE_AFTER
        };
        now.duration_since(conn.opened) >= grace
    }

    pub(super) fn new_conn(&mut self, addr: SocketAddr, dialed: bool, now: Instant) -> ConnId {
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        // A root: a connection opened while an endpoint's span is entered is not part of
        // that endpoint's life (nor the other way round).
        let span = tracing::info_span!(
            target: "railyard::control",
            parent: None,
            "handshake",
            engine = %self.me.name,
            addr = %addr,
            dialed,
            peer = Empty,
            incarnation = Empty,
        );
        span.in_scope(|| {
            tracing::debug!(target: "railyard::control", "control connection opened");
        });
        self.conns.insert(
            id,
            Conn {
                addr,
                dialed,
                local_ip: None,
                peer: None,
                nonce: auth::nonce(),
                unproven: None,
                held: Vec::new(),
                descriptors_asked: 0,
                opened: now,
                last_heard: now,
                last_ping: None,
                span,
            },
        );
        id
    }

    /// The driver accepted a connection from `addr` on local address `local_ip`.
    pub(crate) fn accepted(&mut self, addr: SocketAddr, local_ip: IpAddr, now: Instant) -> ConnId {
        let conn = self.new_conn(addr, false, now);
        if let Some(state) = self.conns.get_mut(&conn) {
            state.local_ip = Some(local_ip);
        }
        let silent = || {
            self.conns
                .iter()
                .filter(|(_, state)| !state.dialed && state.peer.is_none())
        };
        if silent().count() > self.policy.max_handshakes {
            // Only one past its eviction grace (never the new one); those that said nothing
            // go before those whose proof is under way.
            if let Some(oldest) = silent()
                .filter(|(_, state)| self.evictable(state, now))
                .min_by_key(|(id, state)| (state.unproven.is_some(), state.opened, **id))
                .map(|(&id, _)| id)
            {
                let reason = format!(
                    "more than {} connections have not said Hello; the oldest goes",
                    self.policy.max_handshakes
                );
                self.refuse(oldest, &reason, now);
            }
        }
        conn
    }

    /// The driver started the dial of `conn` from local address `local_ip`.
    pub(crate) fn dialed(&mut self, conn: ConnId, local_ip: IpAddr) {
        if let Some(state) = self.conns.get_mut(&conn) {
            state.local_ip = Some(local_ip);
        }
    }

    /// The open dialed connection to `addr`, dialing it if there is none: Hello and
    /// GetDescriptor go first.
    pub(super) fn conn_to(&mut self, addr: SocketAddr, now: Instant) -> ConnId {
        if let Some(&conn) = self.dialed.get(&addr) {
            return conn;
        }
        let conn = self.new_conn(addr, true, now);
        let timeout = self.policy.liveness_timeout;
        if let Some(heard) = self
            .heard_before
            .remove(&addr)
            .filter(|&heard| now.saturating_duration_since(heard) < timeout)
        {
            if let Some(state) = self.conns.get_mut(&conn) {
                state.last_heard = heard;
            }
        }
        self.dialed.insert(addr, conn);
        self.actions.push_back(Action::Dial { conn, addr });
        self.send(conn, self.hello(conn));
        self.ask_descriptor(conn);
        conn
    }

    /// The driver saw `conn` close or fail (`reason`): handshakes waiting on it fail.
    pub(crate) fn closed(&mut self, conn: ConnId, reason: &str, now: Instant) {
        let Some(state) = self.conns.remove(&conn) else {
            return;
        };
        state.span.in_scope(|| {
            tracing::info!(target: "railyard::control", reason, "control connection closed");
        });
        self.actions.push_back(Action::Close { conn });
        if self.dialed.get(&state.addr) == Some(&conn) {
            self.dialed.remove(&state.addr);
            // Only a connection that heard its peer says when it was last heard.
            if state.peer.is_some() {
                self.heard_before.insert(state.addr, state.last_heard);
            }
        }
        let (failed, still_waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|waiting| waiting.conn == conn);
        self.waiting = still_waiting;
        let reason = if state.peer.is_none() && state.unproven.is_some() {
            format!(
                "{reason}, before the cluster secret was proven both ways (has the peer the same \
                 secret?)"
            )
        } else {
            reason.to_string()
        };
        for waiting in failed {
            let _ = waiting.reply.send(Err(ControlError::Unreachable {
                addr: state.addr,
                reason: reason.clone(),
            }));
        }
        let failing: Vec<(u16, EndpointId, Epoch)> = self
            .active
            .iter()
            .filter_map(|(&(rail, id), active)| {
                let pending = active.pending.as_ref()?;
                (pending.conn == conn).then_some((rail, id, pending.epoch))
            })
            .collect();
        for (rail, id, epoch) in failing {
            self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
        }
        // Nobody waits for the answers to what came on it.
        self.unanswered.retain(|waiting| waiting.conn != conn);
        if let Some(peer) = state.peer {
            self.forget_if_unused(peer);
        }
        self.send_waiting_handshakes(now);
    }

    /// Closes `conn` for breaking a bound or the protocol: counted, and a warning names the
    /// peer.
    pub(crate) fn refuse(&mut self, conn: ConnId, reason: &str, now: Instant) {
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        let peer = state
            .peer
            .and_then(|peer| self.peers.get(&peer))
            .map(|info| info.name.as_str());
        bump(&self.shared.counters.connections_closed);
        state.span.in_scope(|| {
            warning!(
                self,
                Connection,
                addr = %state.addr,
                peer,
                incarnation = state.peer.map(display),
                reason,
                "closing a control connection that broke a bound or the protocol"
            );
        });
        self.closed(conn, reason, now);
    }

    /// Sends Bye on every connection (the driver flushes them before stopping).
    pub(crate) fn say_goodbye(&mut self) {
        // With a secret, a Bye before the proof reads as a stranger's: those connections
        // just close.
        let proof_required = self.me.secret.is_some();
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, state)| !proof_required || state.peer.is_some())
            .map(|(&conn, _)| conn)
            .collect();
        for conn in conns {
            self.send(conn, Message::Bye);
        }
    }

    // ---- messages ----------------------------------------------------------------------

    /// A whole message arrived on `conn`.
    pub(crate) fn received(&mut self, conn: ConnId, message: Message, now: Instant) {
        #[cfg(feature = "sabotage")]
        let message = self.mistake_incoming(message);
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        state.last_heard = now;
        let speaker = state.peer;
        let span = state.span.clone();
        let _entered = span.enter();
        let handshake = matches!(
            message,
            Message::Hello { .. } | Message::Auth { .. } | Message::Bye
        );
        if speaker.is_none() && !handshake {
            if self.me.secret.is_some() {
                return self.auth_failed(
                    conn,
                    "a message before the cluster secret was proven",
                    now,
                );
            }
            return self.refuse(conn, "a message before Hello", now);
        }
        match message {
            Message::Hello { .. } => self.on_hello(conn, message, now),
            Message::Auth { mac } => self.on_auth(conn, &mac, now),
            Message::GetDescriptor => {
                let descriptor = self.local_descriptor();
                self.send(conn, Message::Descriptor(descriptor));
            }
            Message::Descriptor(descriptor) => self.on_descriptor(conn, descriptor, now),
            Message::ConnectQp {
                key,
                epoch,
                handshake,
                side,
            } => self.on_connect_qp(conn, key, epoch, handshake, side),
            Message::ConnectQpQueued {
                key,
                epoch,
                handshake,
                ahead: _,
            } => self.on_connect_queued(conn, key, (epoch, handshake), now),
            Message::ConnectQpReply {
                key,
                epoch,
                handshake,
                fence,
                result,
            } => self.on_connect_reply(conn, key, (epoch, handshake), fence, result, now),
            Message::RetireQp {
                key,
                epoch: _,
                qp_num,
            } => self.on_retire_qp(conn, key, qp_num),
            Message::Notify { target, bytes } => self.on_notify(conn, target, bytes),
            Message::Bye if speaker.is_none() && self.me.secret.is_some() => {
                self.auth_failed(conn, "goodbye before the cluster secret was proven", now);
            }
            Message::Bye => self.closed(conn, "the peer said goodbye", now),
            Message::Ping { nonce } => self.send(conn, Message::Pong { nonce }),
            // Heard: that is all a Pong is for.
            Message::Pong { .. } => {}
        }
        // A reply or a closed connection may have made room for a waiting handshake.
        self.send_waiting_handshakes(now);
    }

    /// With a cluster secret, closes connections whose peer said Hello but has not proven
    /// the secret within [`Policy::connect_timeout`](crate::policy::Policy::connect_timeout) of their opening (`auth_failures`): a
    /// peer that says Hello and nothing more holds a connection no longer than that. (Those
    /// that said nothing at all, a dead host among them, time out as before.) Also closes
    /// connections on which more messages waited for the proof than [`MAX_HELD`].
    pub(super) fn expire_unproven(&mut self, now: Instant) {
        if self.me.secret.is_none() {
            return;
        }
        let late: Vec<(ConnId, bool)> = self
            .conns
            .iter()
            .filter(|(_, conn)| {
                conn.held.len() > MAX_HELD
                    || (conn.unproven.is_some()
                        && now.duration_since(conn.opened) >= self.policy.connect_timeout)
            })
            .map(|(&id, conn)| (id, conn.held.len() > MAX_HELD))
            .collect();
        for (conn, overflowed) in late {
            if overflowed {
                let reason = format!(
                    "more than {MAX_HELD} messages waited for the peer to prove the cluster secret"
                );
                self.refuse(conn, &reason, now);
            } else {
                self.auth_failed(
                    conn,
                    "no proof of the cluster secret within the connect timeout",
                    now,
                );
            }
        }
    }

    /// A Hello on `conn`. Without a cluster secret its peer is admitted at once; with one,
    /// the Hellos are exchanged first and the peer is admitted once both proofs are in
    /// ([`Self::on_auth`]).
    pub(super) fn on_hello(&mut self, conn: ConnId, hello: Message, now: Instant) {
        let Message::Hello { incarnation, .. } = hello else {
            return;
        };
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        let said = match (state.peer, &state.unproven) {
            (Some(peer), _) => Some(peer),
            (None, Some(Message::Hello { incarnation, .. })) => Some(*incarnation),
            (None, _) => None,
        };
        match said {
            Some(known) if known != incarnation => {
                let reason = format!("a second Hello as {incarnation} after {known}");
                return self.refuse(conn, &reason, now);
            }
            Some(_) => return,
            None => {}
        }
        let (dialed, addr) = (state.dialed, state.addr);
        let reflected = matches!(&hello, Message::Hello { nonce, .. }
            if self.conns.iter().any(|(&other, state)| other != conn && state.nonce == *nonce));
        if reflected && self.me.secret.is_some() {
            // A Hello this process sent on another connection, handed back to it.
            return self.auth_failed(conn, "this process's own Hello, reflected", now);
        }
        if !dialed {
            self.send(conn, self.hello(conn));
        }
        let Some(secret) = self.me.secret.clone() else {
            return self.admit(conn, hello, now);
        };
        if let Some(state) = self.conns.get_mut(&conn) {
            state.unproven = Some(hello.clone());
        }
        if dialed {
            // The listener's Hello is in: the dialer proves first, for the address it dialed.
            let mine = self.hello(conn);
            let transcript = Transcript {
                dialer_hello: &mine,
                listener_hello: &hello,
                dialed: addr,
            };
            let proof = auth::prove(&secret, Role::Dialer, &transcript);
            self.send(conn, Message::Auth { mac: proof });
            self.protect(conn, &secret, &mine, &hello);
        }
    }

    /// The addresses a dialer may have dialed to reach this side on accepted connection
    /// `state`: the connection's own local address at the listener's port, and the handshake
    /// address this process announces.
    pub(super) fn reached_at(&self, state: &Conn) -> Vec<SocketAddr> {
        let port = self.me.local_addr.port();
        let mut addresses: Vec<SocketAddr> = state
            .local_ip
            .map(|ip| SocketAddr::new(ip, port))
            .into_iter()
            .collect();
        if !addresses.contains(&self.me.local_addr) {
            addresses.push(self.me.local_addr);
        }
        addresses
    }

    /// A proof of the cluster secret on `conn`: checked against both Hellos; the listener
    /// answers a good one with its own, and either side admits the peer once the other's
    /// proof is good. Anything else closes the connection.
    pub(super) fn on_auth(&mut self, conn: ConnId, proof: &[u8; MAC_LEN], now: Instant) {
        let Some(secret) = self.me.secret.clone() else {
            return self.refuse(conn, "an Auth, but this process has no cluster secret", now);
        };
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        let Some(theirs) = state.unproven.clone() else {
            return self.auth_failed(conn, "an Auth before Hello, or a second one", now);
        };
        let mine = self.hello(conn);
        let proven = if state.dialed {
            let transcript = Transcript {
                dialer_hello: &mine,
                listener_hello: &theirs,
                dialed: state.addr,
            };
            auth::verify(&secret, Role::Listener, &transcript, proof).then_some(transcript)
        } else {
            self.reached_at(state).into_iter().find_map(|dialed| {
                let transcript = Transcript {
                    dialer_hello: &theirs,
                    listener_hello: &mine,
                    dialed,
                };
                auth::verify(&secret, Role::Dialer, &transcript, proof).then_some(transcript)
            })
        };
        let Some(transcript) = proven else {
            return self.auth_failed(conn, "a wrong proof of the cluster secret", now);
        };
        if !state.dialed {
            let answer = auth::prove(&secret, Role::Listener, &transcript);
            self.send(conn, Message::Auth { mac: answer });
            self.protect(conn, &secret, &theirs, &mine);
        }
        if let Some(state) = self.conns.get_mut(&conn) {
            state.unproven = None;
        }
        self.admit(conn, theirs, now);
    }

    /// Closes `conn`, whose peer did not prove the cluster secret: counted apart, and a
    /// warning names the address.
    pub(super) fn auth_failed(&mut self, conn: ConnId, reason: &str, now: Instant) {
        self.close_unauthenticated(
            conn,
            reason,
            "its peer did not prove the cluster secret",
            now,
        );
    }

    /// A frame on `conn` after the handshake failed its check ([`crate::session`]): someone
    /// on the path changed, dropped, replayed, reordered or injected frames (or the peer is
    /// broken). Nothing in it was believed; the connection closes without an answer, the
    /// failure is counted with the failed proofs, and a warning of kind `auth` names the
    /// address. The peer's endpoints reconnect on a new connection as after any close.
    pub(crate) fn tampered(&mut self, conn: ConnId, reason: &str, now: Instant) {
        self.close_unauthenticated(conn, reason, "a frame failed its authentication check", now);
    }

    /// Closes `conn` for `failure` of authentication: counted in `auth_failures`, with a
    /// warning of kind `auth` that names the address.
    fn close_unauthenticated(&mut self, conn: ConnId, reason: &str, failure: &str, now: Instant) {
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        bump(&self.shared.counters.auth_failures);
        state.span.in_scope(|| {
            warning!(
                self,
                Auth,
                addr = %state.addr,
                reason,
                "closing a control connection: {failure}"
            );
        });
        self.closed(conn, reason, now);
    }

    /// The peer of `conn`, whose Hello was `hello`, is who it said (and, with a cluster
    /// secret, a member): it is known from now on, and what waited for it goes out.
    pub(super) fn admit(&mut self, conn: ConnId, hello: Message, now: Instant) {
        let Message::Hello {
            name,
            incarnation,
            host,
            listen,
            ..
        } = hello
        else {
            return;
        };
        #[cfg(feature = "sabotage")]
        let incarnation = self.mistake_identity(conn, incarnation);
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        state.peer = Some(incarnation);
        state.span.record("peer", name.as_str());
        state.span.record("incarnation", display(incarnation));
        tracing::info!(target: "railyard::control", listen, "peer said Hello");
        let (dialed, addr) = (state.dialed, state.addr);
        let held = std::mem::take(&mut state.held);
        for message in held {
            self.send(conn, message);
        }
        let listen = if dialed {
            Some(addr)
        } else {
            announced_listener(&listen, addr)
        };
        self.peers
            .insert(incarnation, PeerInfo { name, host, listen });
        if dialed {
            self.listener_at(addr, incarnation, now);
        }
        self.resolve_waiting(now);
    }
}

/// Where a peer that connected from `source` says it listens (`announced`, from its Hello):
/// an unspecified IP is the one it connects from; a loopback address from another host, or
/// nothing parseable, says nothing.
fn announced_listener(announced: &str, source: SocketAddr) -> Option<SocketAddr> {
    let announced: SocketAddr = announced.parse().ok()?;
    if announced.ip().is_unspecified() {
        return Some(SocketAddr::new(source.ip(), announced.port()));
    }
    if announced.ip().is_loopback() && !source.ip().is_loopback() {
        return None;
    }
    Some(announced)
}
