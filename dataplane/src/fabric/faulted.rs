//! A fault plan at the boundary of any fabric: [`Faulted`] wraps a fabric that has no fault
//! plan of its own (libfabric's) and produces a [`FaultPlan`](super::faults::FaultPlan)'s
//! failures in front of it, as the soft and TCP fabrics produce them inside: the same rules,
//! counted per queue pair in the order requests are posted, so the same seed fails the same
//! requests.
//!
//! A request a rule fails never reaches the inner fabric: it completes with the rule's
//! status, and its queue pair is then in error as verbs' would be — every later request
//! posted on it completes flushed without reaching the inner fabric either. `QpFatal` does
//! the same and raises [`AsyncEvent::QpFatal`]. `Delay` holds the inner fabric's completions
//! back (in order, per queue pair). `Stall` refuses posts as a full send queue does, so the
//! poller keeps the slices and retries; nothing fails because of it. Requests already handed
//! to the inner fabric complete as it completes them.
//!
//! The wrapper lives on the poller thread with the fabric it wraps; an empty plan costs one
//! atomic load per post and nothing per completion.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::delayed::DelayedCompletions;
use super::faults::{FaultHandle, FaultView, QpFaultState, Verdict};
use super::{
    AsyncEvent, Fabric, FabricError, FabricLimits, PostError, QpNum, WcStatus, WorkCompletion,
    WorkRequest, WrId,
};
use crate::{EndpointId, Epoch};

/// One queue pair's fault state.
#[derive(Debug)]
struct FaultedQp {
    faults: QpFaultState,
    /// A rule failed one of its requests: it is in error, as a verbs queue pair would be.
    broken: bool,
}

/// A fabric with a fault plan in front of it: see the module docs.
#[derive(Debug)]
pub struct Faulted<F> {
    inner: F,
    view: FaultView,
    qps: HashMap<QpNum, FaultedQp>,
    /// Queue pairs connected so far (the next one's ordinal).
    adopted: u32,
    /// Completions made here (failed and flushed requests) and delayed ones now due.
    ready: VecDeque<WorkCompletion>,
    /// QP-fatal events raised here.
    events: VecDeque<AsyncEvent>,
    /// How long each delayed request's completion is held once the inner fabric reports it.
    delays: HashMap<WrId, Duration>,
    /// Completions held back, per queue pair, in the order the inner fabric reported them.
    held: HashMap<QpNum, DelayedCompletions>,
    /// Scratch for the inner fabric's completions while some are held.
    polled: Vec<WorkCompletion>,
}

impl<F: Fabric> Faulted<F> {
    /// Wraps `inner`; `faults` changes the plan while it runs.
    pub fn new(inner: F, faults: FaultHandle) -> Self {
        Self {
            inner,
            view: FaultView::new(faults),
            qps: HashMap::new(),
            adopted: 0,
            ready: VecDeque::new(),
            events: VecDeque::new(),
            delays: HashMap::new(),
            held: HashMap::new(),
            polled: Vec::new(),
        }
    }

    /// The wrapped fabric.
    pub fn inner(&self) -> &F {
        &self.inner
    }

    /// Completes `requests` here with `status` (they never reach the inner fabric).
    fn complete_here(&mut self, qp: QpNum, requests: &[WorkRequest], status: WcStatus) {
        self.ready.extend(
            requests
                .iter()
                .map(|request| WorkCompletion::of(request, qp, status)),
        );
    }

    /// Moves held completions that are due to `ready`, and forgets emptied holds of queue
    /// pairs that are gone.
    fn release_held(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let now = Instant::now();
        for held in self.held.values_mut() {
            held.release(now, &mut self.ready);
        }
        let qps = &self.qps;
        self.held
            .retain(|qp, held| !held.is_empty() || qps.contains_key(qp));
    }
}

impl<F: Fabric> Fabric for Faulted<F> {
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let qp = self.inner.connect(endpoint, epoch)?;
        self.view.refresh();
        let faults = QpFaultState::new(self.view.plan.seed, self.adopted, Some(endpoint));
        self.adopted = self.adopted.wrapping_add(1);
        self.qps.insert(
            qp,
            FaultedQp {
                faults,
                broken: false,
            },
        );
        Ok(qp)
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        self.view.refresh();
        let Some(state) = self.qps.get_mut(&qp) else {
            // Not ours (never connected, or retired): the inner fabric says so.
            return self.inner.post(qp, requests);
        };
        if state.broken {
            self.complete_here(qp, requests, WcStatus::WrFlushErr);
            return Ok(());
        }
        if state.faults.stalled(&self.view.plan) {
            return Err(PostError {
                posted: 0,
                error: FabricError::SendQueueFull { qp },
            });
        }
        // Judge in order up to the first request a rule fails; the ones before it go to the
        // inner fabric in one post.
        let mut failure = None;
        let mut judged = 0;
        for request in requests {
            judged += 1;
            match state.faults.judge(&self.view.plan) {
                Verdict::Execute { delay } => {
                    if !delay.is_zero() {
                        self.delays.insert(request.wr_id, delay);
                    }
                }
                Verdict::Fail(status) => {
                    failure = Some(Some(status));
                    break;
                }
                Verdict::Fatal => {
                    failure = Some(None);
                    break;
                }
            }
        }
        let executed = judged - usize::from(failure.is_some());
        if executed > 0 {
            if let Err(refused) = self.inner.post(qp, &requests[..executed]) {
                // Those the inner fabric did not take were not executed: they are judged
                // again when the poller posts them again.
                let untaken = judged - refused.posted;
                if let Some(state) = self.qps.get_mut(&qp) {
                    state.faults.unjudge(untaken as u64);
                }
                for request in &requests[refused.posted..executed] {
                    self.delays.remove(&request.wr_id);
                }
                return Err(refused);
            }
        }
        let Some(failure) = failure else {
            return Ok(());
        };
        if let Some(state) = self.qps.get_mut(&qp) {
            state.broken = true;
        }
        let status = failure.unwrap_or_else(|| {
            self.events.push_back(AsyncEvent::QpFatal { qp });
            WcStatus::WrFlushErr
        });
        self.complete_here(qp, &requests[executed..=executed], status);
        self.complete_here(qp, &requests[executed + 1..], WcStatus::WrFlushErr);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        self.release_held();
        let start = out.len();
        let here = max.min(self.ready.len());
        out.extend(self.ready.drain(..here));
        let room = max - here;
        if room == 0 {
            return here;
        }
        if self.delays.is_empty() && self.held.is_empty() {
            return here + self.inner.poll(out, room);
        }
        let mut polled = std::mem::take(&mut self.polled);
        polled.clear();
        self.inner.poll(&mut polled, room);
        let now = Instant::now();
        for completion in polled.drain(..) {
            let delay = self.delays.remove(&completion.wr_id).unwrap_or_default();
            let held = self.held.entry(completion.qp).or_default();
            held.emit(completion, now + delay, &mut self.ready);
        }
        self.polled = polled;
        let more = (max - (out.len() - start)).min(self.ready.len());
        out.extend(self.ready.drain(..more));
        out.len() - start
    }

    fn retire(&mut self, qp: QpNum) {
        self.qps.remove(&qp);
        self.inner.retire(qp);
    }

    fn serve(&mut self) -> bool {
        self.inner.serve()
    }

    fn serving(&self) -> bool {
        self.inner.serving()
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front().or_else(|| self.inner.poll_event())
    }

    fn limits(&self) -> FabricLimits {
        self.inner.limits()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::fabric::faults::{Fault, FaultPlan, QpMatch};
    use crate::fabric::scripted::{ScriptHandle, ScriptedFabric};
    use crate::fabric::{Opcode, QpNum};

    fn request(n: u64) -> WorkRequest {
        WorkRequest {
            wr_id: WrId(n),
            opcode: Opcode::Write,
            local_addr: 0x1000,
            lkey: 1,
            remote_addr: 0x2000,
            rkey: 2,
            len: 64,
            imm: 0,
            signaled: true,
            epoch: Epoch::FIRST,
        }
    }

    fn requests(range: std::ops::Range<u64>) -> Vec<WorkRequest> {
        range.map(request).collect()
    }

    fn faulted(plan: FaultPlan) -> (Faulted<ScriptedFabric>, ScriptHandle, FaultHandle, QpNum) {
        let (inner, script) = ScriptedFabric::new();
        let faults = FaultHandle::default();
        faults.set(plan);
        let mut fabric = Faulted::new(inner, faults.clone());
        let qp = fabric
            .connect(EndpointId(7), Epoch::FIRST)
            .expect("the scripted fabric connects");
        (fabric, script, faults, qp)
    }

    /// Every completion the fabric has now, as (request id, status).
    fn drain(fabric: &mut Faulted<ScriptedFabric>) -> Vec<(u64, WcStatus)> {
        let mut out = Vec::new();
        while fabric.poll(&mut out, 4) > 0 {}
        out.iter().map(|c| (c.wr_id.0, c.status)).collect()
    }

    #[test]
    fn a_failed_request_never_reaches_the_fabric_and_flushes_what_follows() {
        let plan = FaultPlan::new(1).with(Fault::FailNth {
            on: QpMatch::Any,
            nth: 3,
            status: WcStatus::LocLenErr,
        });
        let (mut fabric, script, _, qp) = faulted(plan);
        fabric.post(qp, &requests(1..6)).expect("posted");
        fabric.post(qp, &requests(6..8)).expect("posted");
        let reached: Vec<u64> = script.posted().iter().map(|p| p.request.wr_id.0).collect();
        assert_eq!(
            reached,
            vec![1, 2],
            "only the requests before the failed one"
        );
        let mut completions = drain(&mut fabric);
        completions.sort_unstable_by_key(|&(id, _)| id);
        use WcStatus::{LocLenErr, Success, WrFlushErr};
        assert_eq!(
            completions,
            vec![
                (1, Success),
                (2, Success),
                (3, LocLenErr),
                (4, WrFlushErr),
                (5, WrFlushErr),
                (6, WrFlushErr),
                (7, WrFlushErr)
            ]
        );
    }

    #[test]
    fn qp_fatal_raises_its_event_and_a_new_queue_pair_starts_clean() {
        let plan = FaultPlan::new(1).with(Fault::QpFatal {
            on: QpMatch::Ordinal(0),
            after: 1,
        });
        let (mut fabric, script, _, qp) = faulted(plan);
        fabric.post(qp, &requests(1..4)).expect("posted");
        assert_eq!(fabric.poll_event(), Some(AsyncEvent::QpFatal { qp }));
        assert_eq!(fabric.poll_event(), None);
        fabric.retire(qp);
        let next = fabric
            .connect(EndpointId(7), Epoch::FIRST.next())
            .expect("connects");
        fabric.post(next, &requests(10..13)).expect("posted");
        assert_eq!(
            script.posted().len(),
            4,
            "one before the fatal, three after"
        );
        let failed = drain(&mut fabric)
            .into_iter()
            .filter(|&(_, status)| status != WcStatus::Success)
            .count();
        assert_eq!(failed, 2, "the request at the fatal and the one behind it");
    }

    #[test]
    fn a_refused_post_is_judged_again_when_it_comes_back() {
        let plan = FaultPlan::new(1).with(Fault::FailNth {
            on: QpMatch::Any,
            nth: 3,
            status: WcStatus::RemAccessErr,
        });
        let (mut fabric, script, _, qp) = faulted(plan);
        script.set_limits(FabricLimits {
            send_queue: 1,
            ..FabricLimits::UNLIMITED
        });
        script.hold(true);
        fabric.post(qp, &requests(1..2)).expect("one fits");
        // Request 2 does not fit; request 3 is judged behind it but must not count either.
        let refused = fabric
            .post(qp, &requests(2..4))
            .expect_err("the send queue is full");
        assert_eq!(refused.posted, 0);
        assert!(
            drain(&mut fabric).is_empty(),
            "nothing failed for the refusal"
        );
        script.hold(false);
        script.release();
        assert_eq!(drain(&mut fabric), vec![(1, WcStatus::Success)]);
        // Requests 2 and 3 are the second and third executed: the rule fails the third.
        fabric.post(qp, &requests(2..4)).expect("posted");
        let mut completions = drain(&mut fabric);
        completions.sort_unstable_by_key(|&(id, _)| id);
        assert_eq!(
            completions,
            vec![(2, WcStatus::Success), (3, WcStatus::RemAccessErr)]
        );
    }

    #[test]
    fn a_stall_holds_posts_back_until_it_lifts() {
        let (mut fabric, script, faults, qp) = faulted(FaultPlan::new(1));
        faults.add(Fault::Stall { on: QpMatch::Any });
        let refused = fabric.post(qp, &requests(1..3)).expect_err("stalled");
        assert!(matches!(refused.error, FabricError::SendQueueFull { .. }));
        assert!(script.posted().is_empty());
        faults.clear();
        fabric.post(qp, &requests(1..3)).expect("the stall lifted");
        assert_eq!(drain(&mut fabric).len(), 2);
    }

    #[test]
    fn delayed_completions_come_late_and_in_order() {
        let plan = FaultPlan::new(3).with(Fault::Delay {
            on: QpMatch::Any,
            min: Duration::from_millis(20),
            max: Duration::from_millis(40),
        });
        let (mut fabric, _, _, qp) = faulted(plan);
        let posted_at = Instant::now();
        fabric.post(qp, &requests(1..5)).expect("posted");
        let mut seen = Vec::new();
        let deadline = posted_at + Duration::from_secs(5);
        while seen.len() < 4 && Instant::now() < deadline {
            seen.extend(drain(&mut fabric));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(posted_at.elapsed() >= Duration::from_millis(20));
        let ids: Vec<u64> = seen.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![1, 2, 3, 4]);
    }
}
