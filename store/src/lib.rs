//! railyard's KV-cache store: objects (a UTF-8 key and a value) kept as replicas in memory
//! segments that member processes contribute, placed and tracked by a master that holds
//! only metadata and never touches data.
//!
//! The store is the layer above the engine (`railyard-engine`): clients ask the master where
//! to put or find an object, then move the bytes themselves, zero-copy through the engine,
//! client to segment. Nothing below this crate knows about it.
//!
//! - [`master`]: the master's sans-IO core — segments and their free space, objects and
//!   their replicas, two-phase writes, leases, pins and eviction — fed requests and the
//!   time, answering with results and [`master::MasterAction`]s.
//! - [`config`]: what a write asks for ([`ReplicaConfig`]) and how the master behaves
//!   ([`MasterPolicy`]).
//! - [`error`]: one error enum naming the key and the cause, with Mooncake Store's codes.
//! - [`protocol`]: the frames between master and clients, after railyard's handshake.
//! - [`server`]: the master as a service ([`MasterServer`], `railyard master`).
//! - [`client`]: [`Store`], a process's client: mount segments, put and get objects
//!   through its engine, batches with one result per key.
//!
//! ```
//! use std::num::NonZeroUsize;
//! use railyard_engine::{Engine, RailChoice};
//! use railyard_store::{MasterConfig, MasterPolicy, MasterServer, ReplicaConfig, Store, StoreOptions};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The master: metadata only (`railyard master` runs the same as a process).
//! let master = MasterServer::start(MasterConfig {
//!     listen: "127.0.0.1:0".parse()?,
//!     policy: MasterPolicy::default(),
//!     secret: None,
//!     name: "master".into(),
//!     election: None,
//!     advertise: None,
//! })?;
//! let engine = |name: &str| {
//!     Engine::builder(name).rails(RailChoice::Count(NonZeroUsize::MIN)).build()
//! };
//! // A member contributes 16 MiB of memory as a segment...
//! let decode = engine("decode-0")?;
//! let member = Store::connect(&decode, StoreOptions::new(master.addr().to_string()))?;
//! member.mount(16 << 20)?;
//! // ...and any client puts and gets values through its own engine.
//! let prefill = engine("prefill-0")?;
//! let client = Store::connect(&prefill, StoreOptions::new(master.addr().to_string()))?;
//! client.put("layer0/block7", b"kv bytes", &ReplicaConfig::default())?;
//! assert_eq!(client.get("layer0/block7")?, b"kv bytes");
//! assert!(client.exists("layer0/block7")?);
//! client.remove("layer0/block7", true)?;
//! # Ok(()) }
//! ```
//!
//! # Thread safety
//! [`master::MasterCore`] is a plain state machine (`Send`, not shared): one thread owns it
//! ([`MasterServer`] keeps it behind a lock). [`Store`] is `Send + Sync`.
//!
//! # Resource cleanup
//! Dropping a [`master::MasterCore`] forgets its metadata; segments' memory belongs to the
//! processes that mounted it.

pub mod client;
// Writes a leader's journal: only an etcd build elects leaders.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
mod committer;
pub mod config;
pub mod error;
#[cfg(feature = "etcd")]
pub mod failover;
mod handshake;
pub mod master;
mod metrics;
pub mod protocol;
pub mod server;
pub mod sim;
mod time;

pub use client::{LocalRange, Store, StoreOptions};
pub use config::{MasterPolicy, ReplicaConfig};
pub use error::{StoreError, StoreErrorKind};
pub use server::{MasterConfig, MasterServer};
