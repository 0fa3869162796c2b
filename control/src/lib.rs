//! railyard's control plane (DESIGN.md §6).
//!
//! This crate owns the endpoint lifecycle ([`endpoint`]: a sans-IO state machine driven by
//! events and `now`) and its failure [`policy`]. It talks to pollers only by sending commands
//! over rings; it must never touch a queue pair, completion queue or address handle itself,
//! and its state machines must not read the clock, open sockets or draw randomness of their
//! own.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod descriptor;
pub mod directory;
pub mod endpoint;
pub mod policy;
pub mod wire;

pub use descriptor::{RailDescriptor, RegionDescriptor, SegmentDescriptor};
pub use directory::{Directory, P2pDirectory};
pub use endpoint::{Endpoint, EndpointKey, EndpointStats, Incarnation, Input, Output, Phase};
pub use policy::Policy;
pub use wire::{FrameDecoder, Message, WireError};
