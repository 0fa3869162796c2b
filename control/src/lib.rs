//! railyard's control plane (DESIGN.md §6).
//!
//! This crate owns:
//! - the endpoint lifecycle ([`endpoint`]: a sans-IO state machine driven by events and
//!   `now`) and its failure [`policy`];
//! - the handshake [`wire`] format and segment [`descriptor`]s, with the p2p [`directory`];
//! - the control thread: the application's handle ([`plane`]), the I/O driver that owns
//!   sockets and rings (`driver`), and under it the sans-IO peer table and handshake
//!   state machine (`handshake`); what the thread shares with the application and pollers
//!   ([`shared`]); warnings as `tracing` events with fields ([`warn`]); what it needs of a rail's fabric
//!   ([`rail`]), and which host a peer is on ([`host`]), which decides the fabric that
//!   reaches it;
//! - with feature `etcd`, the cluster directory on etcd (`etcd`).
//!
//! - cluster authentication ([`auth`]): a shared secret proven on every control connection,
//!   and the session keys that protect every frame after it ([`session`]).
//!
//! It talks to pollers only by sending commands over rings and reading their events; it
//! never touches a queue pair a poller owns, and its state machines do not read the clock or
//! open sockets; their randomness is seeded, except the nonces that authentication needs
//! fresh from the kernel.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod auth;
pub mod descriptor;
pub mod directory;
mod driver;
pub mod endpoint;
pub mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
mod handshake;
pub mod host;
pub mod plane;
pub mod policy;
pub mod rail;
pub mod session;
pub mod shared;
pub mod sim;
pub mod warn;
pub mod wire;

pub use auth::{ClusterSecret, SecretError};
pub use descriptor::{RailDescriptor, RegionDescriptor, SegmentDescriptor};
pub use directory::{Directory, P2pDirectory};
pub use endpoint::{Endpoint, EndpointKey, EndpointStats, Incarnation, Input, Output, Phase};
pub use host::HostId;
pub use plane::{
    ControlConfig, ControlError, ControlPlane, ControlRail, ControlShared, ControlStats,
    DirectoryWarning, EndpointView, Notification, NotificationBody, PeerChange, PeerEvents,
};
pub use policy::Policy;
pub use rail::{
    HostMode, HostRail, OfiConnected, OfiHalf, OfiTag, PeerLink, RailFabric, Revocation,
};
pub use shared::{TIME_BUCKET_BOUNDS_US, TimeHistogram};
pub use warn::WarningKind;
pub use wire::{FrameDecoder, Message, WireError};
