//! What `railyard chaos hicache` runs with, what it reports, and the bounds the report is
//! held to ([`HicacheReport::violations`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

/// The p99 of get batches started during a segment fault.
pub const P99_BOUND: Duration = Duration::from_secs(2);

/// The live part's throughput during a segment fault, as a share of the window before.
pub const THROUGHPUT_BOUND: f64 = 0.8;

/// Until both puts and gets succeed again after the leading master's SIGKILL.
pub const SERVE_AGAIN_BOUND: Duration = Duration::from_secs(3);

/// What to run.
#[derive(Clone, Debug)]
pub struct HicacheConfig {
    /// The `railyard` binary whose `master` and `store` the scenario runs.
    pub binary: PathBuf,
    /// Seeds the victims and the clients' choices.
    pub seed: u64,
    /// How long to go on with rounds of faults (at least one round runs).
    pub duration: Duration,
}

/// One segment fault, measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FaultMeasure {
    /// kill, stop or burst.
    pub fault: &'static str,
    /// The victim: a segment name or a client name.
    pub victim: String,
    /// p99 of get batches in flight during the fault's window, in milliseconds.
    pub p99_get_ms: u64,
    /// The slowest of them, in milliseconds.
    pub max_get_ms: u64,
    /// Get batches it covers (at least one).
    pub gets: u64,
    /// Bytes per second moved in the fault's window over the window before.
    pub live_throughput_ratio: f64,
}

/// What happened, and what must hold.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HicacheReport {
    /// Rounds of the five faults.
    pub rounds: u64,
    /// Client processes.
    pub clients: u64,
    /// Segment processes killed (each replaced by a newcomer under its name and port).
    pub segment_kills: u64,
    /// Segment processes stopped and let go.
    pub segment_stops: u64,
    /// Bursts of transfer errors.
    pub error_bursts: u64,
    /// Leading masters killed.
    pub master_kills: u64,
    /// Leading masters stopped until deposed.
    pub master_stops: u64,
    /// Keys written.
    pub puts_ok: u64,
    /// Writes answered "object not found" (`NotFound`, `PutNotPending`). Must be 0.
    pub puts_answered_not_found: u64,
    /// Keys written with one replica of two: best effort, when one segment took it.
    pub puts_with_one_replica: u64,
    /// Keys whose write failed (a clear error each; the failure itself is no violation).
    pub puts_failed: u64,
    /// Failed writes by the error's kind.
    pub put_errors: BTreeMap<String, u64>,
    /// Keys read and checked.
    pub gets_ok: u64,
    /// Keys whose read failed (judged below).
    pub gets_failed: u64,
    /// Bytes read back checked against their keys.
    pub bytes_checked: u64,
    /// Bytes read that differ from what was written. Must be 0.
    pub wrong_bytes: u64,
    /// Gets that failed although a holder of one of the key's replicas was alive and
    /// running throughout the call. Must be 0.
    pub gets_failed_with_live_replica: u64,
    /// `exists` that answered absent (or failed) in the same case. Must be 0.
    pub exists_wrong_with_live_replica: u64,
    /// Failed reads by the error's kind.
    pub get_errors: BTreeMap<String, u64>,
    /// Gets that failed with every holder of the key's replicas dead or stopped (allowed:
    /// the answer is `NotFound`, not a transfer failure after 60 s).
    pub gets_failed_holders_down: u64,
    /// Of those, failures that did not answer `NotFound` (outside a master's replacement).
    /// Must be 0.
    pub holders_down_not_not_found: u64,
    /// Gets that failed while the master was being replaced (not counted above: no master,
    /// no lease).
    pub gets_failed_during_failover: u64,
    /// The first get counted in `gets_failed_with_live_replica`, for whoever debugs it.
    pub first_wrong_failure: Option<String>,
    /// Each segment fault.
    pub faults: Vec<FaultMeasure>,
    /// The worst p99 of them, in milliseconds (≤ 2000).
    pub worst_p99_get_ms: u64,
    /// The lowest throughput ratio of them (≥ 0.8).
    pub worst_live_throughput_ratio: f64,
    /// After each SIGKILL of the leader: until puts and gets succeed again (ms, ≤ 3000).
    pub serve_again_ms: Vec<u64>,
    /// Masters that stepped down and exited without being killed or stopped (a leader whose
    /// lease renewals did not come back in time: the machine was too busy).
    pub masters_stepped_down: u64,
    /// After each SIGSTOP of the leader: until puts and gets succeed again (ms; no bound
    /// but that they do: a stopped leader is noticed only by its lease).
    pub serve_again_after_stop_ms: Vec<u64>,
    /// Deposed leaders that took a change after they were let go. Must be 0.
    pub deposed_master_acted: u64,
    /// After the run, once every key was removed: writes still in progress. Must be 0.
    pub stuck_puts: u64,
    /// Objects left. Must be 0.
    pub objects_left: u64,
    /// Bytes still reserved in segments. Must be 0.
    pub leaked_bytes: u64,
    /// Removals at the end that failed. Must be 0.
    pub removes_failed: u64,
    /// Client processes that removed their keys and said so at the end (all of them).
    pub clients_done: u64,
}

impl HicacheReport {
    /// The promises broken, in words; empty when every one held.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        let mut check = |held: bool, what: String| {
            if !held {
                broken.push(what);
            }
        };
        check(
            self.wrong_bytes == 0,
            format!("{} wrong bytes read", self.wrong_bytes),
        );
        check(
            self.gets_failed_with_live_replica == 0,
            format!(
                "{} gets failed while a replica's holder was alive ({})",
                self.gets_failed_with_live_replica,
                self.first_wrong_failure.as_deref().unwrap_or("")
            ),
        );
        check(
            self.exists_wrong_with_live_replica == 0,
            format!(
                "{} exists answered absent while a replica's holder was alive",
                self.exists_wrong_with_live_replica
            ),
        );
        check(
            self.holders_down_not_not_found == 0,
            format!(
                "{} gets whose holders were all gone did not answer NotFound",
                self.holders_down_not_not_found
            ),
        );
        check(
            self.puts_answered_not_found == 0,
            format!(
                "{} writes answered \"object not found\"",
                self.puts_answered_not_found
            ),
        );
        for fault in &self.faults {
            check(
                fault.gets > 0,
                format!(
                    "no get measured during the {} of {}",
                    fault.fault, fault.victim
                ),
            );
            check(
                fault.p99_get_ms <= P99_BOUND.as_millis() as u64,
                format!(
                    "p99 get {} ms during the {} of {} (bound {} ms)",
                    fault.p99_get_ms,
                    fault.fault,
                    fault.victim,
                    P99_BOUND.as_millis()
                ),
            );
            check(
                fault.live_throughput_ratio >= THROUGHPUT_BOUND,
                format!(
                    "live throughput {:.2} of before during the {} of {} (bound {THROUGHPUT_BOUND})",
                    fault.live_throughput_ratio, fault.fault, fault.victim
                ),
            );
        }
        for &ms in &self.serve_again_ms {
            check(
                ms <= SERVE_AGAIN_BOUND.as_millis() as u64,
                format!(
                    "served again {ms} ms after the leader's SIGKILL (bound {} ms)",
                    SERVE_AGAIN_BOUND.as_millis()
                ),
            );
        }
        for &ms in &self.serve_again_after_stop_ms {
            check(
                ms < u64::MAX / 2,
                "never served again after the leader's SIGSTOP".to_owned(),
            );
        }
        check(
            self.clients_done == self.clients,
            format!(
                "{} of {} client processes finished their run",
                self.clients_done, self.clients
            ),
        );
        check(
            self.deposed_master_acted == 0,
            format!("{} deposed masters acted", self.deposed_master_acted),
        );
        check(
            self.stuck_puts == 0,
            format!("{} puts stuck", self.stuck_puts),
        );
        check(
            self.objects_left == 0,
            format!("{} objects left", self.objects_left),
        );
        check(
            self.leaked_bytes == 0,
            format!("{} bytes leaked", self.leaked_bytes),
        );
        check(
            self.removes_failed == 0,
            format!("{} removals failed", self.removes_failed),
        );
        broken
    }
}
