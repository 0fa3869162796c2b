//! Reproductions of the four production failures of DESIGN.md §1, on the soft fabric with
//! fault plans: each scenario runs its targets as `railyard serve` processes (driven over
//! their stdin: regions, digests of their bytes, counters) and its initiators as whole nodes
//! in this process (rails, pollers, control planes; `handshake-churn` also as `railyard
//! bench` processes), injects its failure deterministically from a seed, and reports what
//! happened as counts. `railyard chaos <scenario>` prints them; the integration tests
//! assert them.
//!
//! | scenario | what it does | what must hold |
//! |---|---|---|
//! | [`storm`] `reconnect-storm` | a LOC_LEN_ERR with stale keys waiting behind it | no stale post, ≤ 1 reconnect, nothing lost |
//! | [`race`] `teardown-race` | full-rate submitters while endpoints are retired and queue pairs fail thousands of times | no crash, nothing lost or resolved twice, no stale post |
//! | [`churn`] `handshake-churn` | one peer repeats its handshake; two peers on one host | no teardown, no reconnect, bounded warnings |
//! | [`replica`] `dead-replica` | four `railyard serve` processes; one is killed, one stopped (no reset); newcomers take their ports | live peers keep ≥ 80 % throughput, the killed one fails fast, the stopped one within 2.5 s, nothing reaches a newcomer |
//!
//! [`soak`] (`railyard chaos soak --duration D [--etcd]`) runs target processes under a
//! seeded mix of kills with port takeovers, stops, queue-pair errors and key rotations (and
//! etcd restarts) for a whole duration.

pub mod churn;
#[cfg(feature = "etcd")]
pub mod etcd_server;
pub mod node;
mod process;
pub mod race;
pub mod replica;
pub mod soak;
pub mod storm;

use std::net::SocketAddr;
use std::time::Duration;

use railyard_control::EndpointView;
use railyard_dataplane::fabric::{MemoryRegion, Opcode};
use railyard_dataplane::{Epoch, SliceSpec};

/// FNV-1a over `bytes`: how scenarios compare what landed in a target process's memory
/// with what was meant to (`railyard serve`'s `digest` command prints it).
pub fn digest(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |hash, &byte| digest_more(hash, byte))
}

/// One more byte into a [`digest`].
pub fn digest_more(hash: u64, byte: u8) -> u64 {
    (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
}

/// Which fabric a scenario's nodes, engines and target processes run on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ChaosFabric {
    /// The soft fabric (between processes of this host), with its own fault plans.
    #[default]
    Soft,
    /// libfabric's `provider` on every rail, its fault plans applied in front of it.
    Ofi {
        /// The provider, e.g. `tcp;ofi_rxm`.
        provider: String,
    },
}

impl ChaosFabric {
    /// The options that put `railyard serve` and `railyard bench` on this fabric.
    pub fn process_options(&self) -> Vec<String> {
        match self {
            Self::Soft => Vec::new(),
            Self::Ofi { provider } => vec![
                "--fabric".into(),
                "ofi".into(),
                "--ofi-provider".into(),
                provider.clone(),
            ],
        }
    }

    /// An engine builder on this fabric.
    pub fn builder(&self, name: impl Into<String>) -> crate::engine::EngineBuilder {
        let builder = crate::engine::Engine::builder(name);
        match self {
            Self::Soft => builder,
            Self::Ofi { provider } => builder
                .fabric(crate::engine::FabricChoice::Ofi)
                .ofi(provider),
        }
    }

    /// Whether a write completes while its target process is stopped: the soft fabric's do
    /// (the initiator writes the target's memory itself). A libfabric provider's do unless
    /// its data progress is manual (`FI_PROGRESS_MANUAL`, read from the provider): then a
    /// write lands only while the target process reads its completion queue, so one in
    /// flight to a stopped target can only resolve by its deadline (earlier, the provider
    /// may still read its source).
    pub fn writes_complete_at_stopped_targets(&self) -> bool {
        match self {
            Self::Soft => true,
            Self::Ofi { provider } => {
                let config = railyard_dataplane::fabric::ofi::OfiConfig {
                    provider: provider.clone(),
                    domain: None,
                };
                // A provider that cannot be asked is held to the stricter promise.
                railyard_dataplane::fabric::ofi::OfiRail::open("progress-probe", &config)
                    .map_or(true, |rail| !rail.manual_progress())
            }
        }
    }

    /// Its name, as `--fabric` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Soft => "soft",
            Self::Ofi { .. } => "ofi",
        }
    }
}

/// Every wait in a scenario ends by this bound.
pub const BOUND: Duration = Duration::from_secs(10);

/// The scenarios, by their command-line names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// [`storm`].
    ReconnectStorm,
    /// [`race`].
    TeardownRace,
    /// [`churn`].
    HandshakeChurn,
    /// [`replica`].
    DeadReplica,
}

impl Scenario {
    /// Every scenario, in the order DESIGN.md lists the failures.
    pub const ALL: [Self; 4] = [
        Self::ReconnectStorm,
        Self::TeardownRace,
        Self::HandshakeChurn,
        Self::DeadReplica,
    ];

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::ReconnectStorm => "reconnect-storm",
            Self::TeardownRace => "teardown-race",
            Self::HandshakeChurn => "handshake-churn",
            Self::DeadReplica => "dead-replica",
        }
    }

    /// The scenario called `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// What a scenario reports: its counts as JSON, and what it promised but did not hold.
#[derive(Debug)]
pub struct Outcome {
    /// The counts (field names are the contract).
    pub counts: serde_json::Value,
    /// Broken promises; empty when the scenario held.
    pub violations: Vec<String>,
}

/// Runs `scenario` with `seed` on `fabric`; `binary` is the `railyard` executable whose
/// `serve` runs the target processes.
///
/// # Errors
/// When the scenario could not run at all (a node did not start, a peer never connected).
pub fn run(
    scenario: Scenario,
    seed: u64,
    binary: &std::path::Path,
    fabric: &ChaosFabric,
) -> anyhow::Result<Outcome> {
    fn outcome<R: serde::Serialize>(
        report: &R,
        violations: Vec<String>,
    ) -> anyhow::Result<Outcome> {
        Ok(Outcome {
            counts: serde_json::to_value(report)?,
            violations,
        })
    }
    match scenario {
        Scenario::ReconnectStorm => {
            let report = storm::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
        Scenario::TeardownRace => {
            let report = race::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
        Scenario::HandshakeChurn => {
            let report = churn::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
        Scenario::DeadReplica => {
            let report = replica::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
    }
}

/// How the requests of a run ended (flattened into each report's JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RequestTally {
    /// Requests submitted.
    pub submitted: u64,
    /// Requests resolved (done or failed) within the bound.
    pub resolved: u64,
    /// Requests done.
    pub done: u64,
    /// Requests failed.
    pub failed: u64,
    /// Requests never resolved.
    pub lost: u64,
}

impl RequestTally {
    /// The tally of `submitted` requests of which `resolved` resolved, `done` successfully.
    pub fn new(submitted: u64, resolved: u64, done: u64) -> Self {
        Self {
            submitted,
            resolved,
            done,
            failed: resolved - done,
            lost: submitted - resolved,
        }
    }
}

/// The bytes of an engine region.
///
/// # Safety
/// No transfer of `region` may be in flight while the slice is used, and the engine that
/// allocated it must outlive the slice.
pub(crate) unsafe fn region_bytes<'a>(region: crate::engine::Region) -> &'a mut [u8] {
    // SAFETY: the region is registered memory of `region.len` bytes owned by the engine,
    // which outlives the slice; the caller keeps transfers away while it is used.
    unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, region.len as usize) }
}

/// Reads `into.len` bytes at `remote` of the process listening at `addr`, through a peer
/// opened afresh (whoever listens there now), into `into`; whether every byte came.
pub(crate) fn read_through_fresh_peer(
    engine: &crate::engine::Engine,
    addr: SocketAddr,
    remote: u64,
    into: crate::engine::Region,
) -> bool {
    let (Ok(peer), Ok(mut submitter)) = (engine.open(&addr.to_string()), engine.submitter()) else {
        return false;
    };
    let read = crate::engine::Transfer {
        op: crate::engine::Op::Read,
        local: into,
        local_offset: 0,
        remote_addr: remote,
        len: into.len,
    };
    let Ok(batch) = submitter.submit(&peer, &[read]) else {
        return false;
    };
    batch.wait(std::time::Instant::now() + railyard_dataplane::DEFAULT_DEADLINE + BOUND);
    batch.outcomes() == vec![Some(railyard_dataplane::RequestOutcome::Done)]
}

fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Fills `bytes` with a pattern that depends on `seed` and the position.
fn fill_pattern(bytes: &mut [u8], seed: u64) {
    let mut state = railyard_dataplane::rng::SplitMix64::new(seed);
    for chunk in bytes.chunks_mut(8) {
        let word = state.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// A WRITE slice of `len` bytes for request `request`: from `local` (region, offset) to
/// `remote` (address, rkey) through `view`'s endpoint, prepared for `epoch` and for the
/// generation `view`'s descriptor gives the remote region (none if it lists no such region:
/// the slice can then only fail).
fn write_slice(
    view: &EndpointView,
    epoch: Epoch,
    request: u32,
    local: (MemoryRegion, u64),
    remote: (u64, u32),
    len: usize,
) -> SliceSpec {
    SliceSpec {
        rail: 0,
        request,
        opcode: Opcode::Write,
        local_addr: local.0.addr + local.1,
        lkey: local.0.lkey,
        remote_addr: remote.0,
        rkey: remote.1,
        len: len as u32,
        imm: 0,
        endpoint: view.id,
        epoch,
        generation: view
            .descriptor()
            .and_then(|descriptor| {
                let region = descriptor.region_for(remote.0, len as u64)?;
                Some(region.generation as u32)
            })
            .unwrap_or(0),
    }
}
