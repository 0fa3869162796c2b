//! The libfabric fabric: EFA in production, and libfabric's software providers
//! (`tcp;ofi_rxm`, `shm`, `sockets`) where there is no EFA. The only module that touches
//! libfabric (through `railyard-ofi-sys`).
//!
//! # The model on libfabric
//! A rail is one provider domain with one reliable-datagram endpoint (`FI_EP_RDM`), one
//! completion queue and one address vector ([`OfiRail`]). A "queue pair" of the verbs model
//! is (this endpoint, a peer's `fi_addr_t`, an epoch): the control plane stages the peer's
//! endpoint address (its `fi_getname`, carried in the handshake) for an endpoint and epoch,
//! and the rail's poller, in [`Fabric::connect`](super::Fabric::connect), inserts it into
//! the address vector. Only the poller touches the endpoint, the completion queue and the
//! address vector ([`OfiFabric`]); the control plane and the application register memory
//! (the domain is opened `FI_THREAD_SAFE`).
//!
//! Every work request completes into the completion queue (`fi_cq_read`; errors through
//! `fi_cq_readerr`, mapped to verbs' statuses). `-FI_EAGAIN` from a post is backpressure:
//! the poller progresses the completion queue and the rest of the list waits
//! ([`FabricError::SendQueueFull`](super::FabricError::SendQueueFull)), never a failure.
//! Retiring a queue pair stops new posts at once; its address-vector entry is removed only
//! once every operation that names it has completed, and those completions are reported
//! flushed (the bytes of a flushed WRITE may have landed; none is still in flight).
//!
//! # Memory registration
//! [`OfiRail::register`] honours the provider's `mr_mode`: with `FI_MR_PROV_KEY` the
//! provider picks the key (it must fit the 32 bits railyard's descriptors carry), otherwise
//! railyard does; with `FI_MR_LOCAL` the local descriptor (`fi_mr_desc`) goes with every
//! request (looked up by the lkey railyard assigns); with `FI_MR_ENDPOINT` the region is
//! bound to the endpoint and enabled; without `FI_MR_VIRT_ADDR` peers address a region by
//! offset from its start, which the poller computes from the regions the peer announced
//! ([`OfiRail::learn_remote_regions`]). Every request is checked against this process's
//! registrations (local key, range, access) and the peer's announced regions before it is
//! posted: the provider sees only requests it should accept.
//!
//! # Immediates
//! An immediate is remote CQ data: the high 32 bits carry the tag the target gave the
//! connection, the low 32 the value. Providers whose CQ data is narrower than 8 bytes
//! (`efa` carries 4) cannot tag it: a WRITE_WITH_IMM fails there with REM_INV_REQ_ERR
//! before it is posted (use notifications on the control connection).
//!
//! # Progress
//! Providers with manual data progress (`tcp;ofi_rxm`) move a peer's RMA into this
//! process's memory only while this side reads its completion queue: [`OfiFabric`]'s
//! `serve` does, every poller round, and says it is serving while the rail has memory
//! peers may access, so the poller yields instead of parking. Before libfabric starts,
//! railyard sets `FI_OFI_RXM_CM_PROGRESS_INTERVAL=0` (unless it is set): `ofi_rxm` then
//! handles its connection events on every empty completion-queue read, so a connection the
//! target closed is gone before the endpoint's next queue pair posts ([`settle_parameters`]
//! says why, and when a program must call it itself).

mod fabric;
mod rail;
mod status;

pub use fabric::OfiFabric;
pub use rail::{OfiConfig, OfiError, OfiPeer, OfiRail, providers, settle_parameters};
