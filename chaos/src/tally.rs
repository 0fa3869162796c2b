//! How the requests of a scenario's run ended, as every report counts them.

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
