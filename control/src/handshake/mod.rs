//! The control plane's sans-IO core: the peer table and the handshake state machine.
//!
//! [`Core`] is fed what happened — a connection accepted or dialed, a message received on
//! connection `c`, a connection closed, an application request, a poller event, the time —
//! and answers with [`Action`]s for the I/O driver ([`crate::driver`]) to carry out: dial,
//! send a frame, close, command a poller. It reads no clock, owns no socket
//! and draws randomness only from its seeded generator (and each connection's Hello nonce
//! from the kernel), so every interleaving can be replayed in a unit test on virtual time.
//! It calls the rails' fabrics ([`RailFabric`](crate::rail::RailFabric))
//! directly: creating, connecting, staging and revoking queue pairs are synchronous and
//! non-blocking.
//!
//! # Identity
//! A peer is an incarnation reached at an address; its name is a label. Two live processes
//! with the same name are two peers. The one place a restart is detected is
//! [`Core::listener_at`]: an address this side dialed answered with a new incarnation, so
//! the old one no longer listens there — its endpoints retire (`PeerRestarted`), fresh ones
//! to the new incarnation take their place, and the queue pairs it connected here go. A
//! cluster directory, whose names are exclusive claims, reports the same through
//! [`Core::peer_changed`]. What a peer announces as its listener is only where to probe it:
//! an initiator that has had no connection for [`Policy::passive_linger`](crate::policy::Policy::passive_linger) is dialed there,
//! and its queue pairs here go unless the same incarnation answers.
//!
//! # Authentication
//! With a cluster secret ([`crate::auth`]), a connection's peer is admitted — known by its
//! incarnation, answered, sent anything but Hello, Auth and Bye — only once both sides have
//! proven the secret over both Hellos; until then what this side would send waits on the
//! connection, and anything else the peer sends closes it (`auth_failures`).
//!
//! # Handshakes
//! Every ConnectQp carries a fresh handshake id and the target's incarnation. Its reply is
//! applied only if it arrives on the connection the request went out on, names that id, and
//! the endpoint still waits for exactly that attempt; anything else is a stray reply,
//! counted and ignored. An endpoint that leaves the attempt (retired, timed out, moved to a
//! newer epoch) cancels it. A ConnectQp is answered only for the incarnation that said
//! Hello on that connection; a notification is delivered only if it names this incarnation.
//!
//! # Handshake admission
//! ConnectQps take turns on both sides, within caps on those in progress per target and
//! per initiator; one that waits is told so and stops its handshake timeout (`turns.rs`).
//!
//! # Queue pairs per rail
//! At most [`Policy::max_endpoints_per_rail`](crate::policy::Policy::max_endpoints_per_rail)
//! endpoints of a rail hold a queue pair; room is made by parking idle endpoints, which the
//! poller alone can vouch for (`eviction.rs`).
//!
//! # Determinism
//! Its tables hash with its seed and its sets are ordered, so what it does depends only on
//! the seed and what it was fed: [`crate::sim`] replays thousands of cores bit for bit.
//!
//! # Log events
//! Warnings go out as `tracing` events with fields ([`crate::warn`]). Each control
//! connection has a `handshake` span (its address, and once it said Hello the peer's name
//! and incarnation) and each endpoint an `endpoint` span (peer, incarnation, address, rail,
//! id), both at level `info` and entered while the core works on them: with
//! `railyard=info`, one search for an incarnation shows its connections, queue pairs and
//! retirement in order.

mod admission;
mod descriptors;
mod eviction;
mod liveness;
mod queue_pairs;
mod retirement;
mod state;
mod turns;

pub use liveness::PeerChange;
pub(crate) use state::{Action, ConnId, Core, Identity};

#[cfg(test)]
mod tests;
