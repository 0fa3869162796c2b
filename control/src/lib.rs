//! railyard's control plane (DESIGN.md §6).
//!
//! This crate will own the endpoint lifecycle (a sans-IO state machine driven by events and
//! `now`), the handshake wire format, the segment directory and the failure policy. It talks
//! to pollers only by sending commands over rings; it must never touch a queue pair,
//! completion queue or address handle itself, and its state machines must not read the
//! clock, open sockets or draw randomness of their own.
//!
//! The crate is a placeholder until the control-plane issue lands.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
