//! What a write asks of its replicas ([`ReplicaConfig`]) and the master's limits and timers
//! ([`MasterPolicy`]).

use serde::{Deserialize, Serialize};

use std::time::Duration;

/// How many replicas a write asks for and how they are kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaConfig {
    /// Replicas of the object, each on a different segment (and, when the cluster has them,
    /// on different hosts). At least 1.
    pub replica_num: usize,
    /// Segments (by name) to place replicas on first, in order, while they have room.
    pub preferred_segments: Vec<String>,
    /// Keep the object from eviction, after every unpinned object, for this long after its
    /// write completes.
    pub soft_pin: Option<Duration>,
    /// Never evict the object; only `remove` frees it.
    pub hard_pin: bool,
    /// Fewer replicas than `replica_num` (at least one) when fewer segments can take one —
    /// some are suspected, draining, avoided or too small — instead of failing with
    /// `TooManyReplicas` (Mooncake Store's placement does this). Ask
    /// [`Store::batch_put_from_counted`](crate::Store::batch_put_from_counted) how many
    /// were written.
    pub best_effort: bool,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            replica_num: 1,
            preferred_segments: Vec::new(),
            soft_pin: None,
            hard_pin: false,
            best_effort: false,
        }
    }
}

/// The master's limits and timers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MasterPolicy {
    /// How long a read's lease keeps the object from eviction and from `remove` without
    /// force (5 s).
    pub lease_ttl: Duration,
    /// Usage of all segments' space above which the master evicts (0.90).
    pub eviction_high_watermark: f64,
    /// Share of all segments' space one eviction frees (0.05).
    pub eviction_ratio: f64,
    /// How long a write may stay between put-start and put-end (30 s). Past it the write is
    /// abandoned and its space is handed out again only behind a fence of the writer.
    pub put_timeout: Duration,
    /// How long a member that contributes a segment may stay silent before it is suspected
    /// (1.5 s, the control plane's liveness timeout; members speak every quarter of it).
    pub member_silence: Duration,
    /// How long a suspected member keeps its data (10 s): heard again within it, its
    /// segments serve as before; past it, they are gone.
    pub suspect_grace: Duration,
}

impl Default for MasterPolicy {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(5),
            eviction_high_watermark: 0.90,
            eviction_ratio: 0.05,
            put_timeout: Duration::from_secs(30),
            member_silence: Duration::from_millis(1500),
            suspect_grace: Duration::from_secs(10),
        }
    }
}
