//! railyard's data plane (DESIGN.md §3–§5).
//!
//! This crate will own the SPSC rings between application threads and pollers, slices and
//! their epochs, the per-rail pollers, completion accounting and the fabrics (soft and
//! verbs). A rail's poller is the only code that touches that rail's queue pairs, completion
//! queue and endpoints. It knows nothing of topology or of the control plane.
//!
//! The crate is a placeholder until the dataplane issue lands.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
