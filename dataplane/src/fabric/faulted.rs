//! A fault plan at the boundary of any fabric: [`Faulted`] wraps a fabric that has no fault
//! plan of its own (libfabric's) and produces a [`FaultPlan`](super::faults::FaultPlan)'s
//! failures in front of it, as the soft and TCP fabrics produce them inside: the same rules,
//! counted per queue pair in the order requests are executed, so the same seed fails the
//! same requests (a post the inner fabric refuses is judged again, with the same draws, when
//! it comes back).
//!
//! A request a rule fails never reaches the inner fabric: it completes with the rule's
//! status, and its queue pair is then in error as verbs' would be — every later request
//! posted on it completes flushed without reaching the inner fabric either. `QpFatal` does
//! the same and raises [`AsyncEvent::QpFatal`]. Completions made here come after the inner
//! fabric's completions of the requests posted before them on the same queue pair, as a
//! NIC's would. `Delay` holds the inner fabric's completions back, in order per queue pair.
//! `Stall` keeps the requests posted meanwhile here, unexecuted, and hands them to the inner
//! fabric when the rule goes; retiring the queue pair flushes them.
//!
//! The wrapper lives on the poller thread with the fabric it wraps. With an empty plan a post
//! costs an atomic load, a map lookup and a judgement per request, and a completion a map
//! lookup (the count of the queue pair's requests in the inner fabric, which orders the
//! completions made here); a poll looks only at queue pairs with something waiting here.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::delayed::DelayedCompletions;
use super::faults::{FaultHandle, FaultView, QpFaultState, Verdict};
use super::{
    AsyncEvent, Fabric, FabricError, FabricLimits, PostError, QpNum, WcStatus, WorkCompletion,
    WorkRequest, WrId,
};
use crate::{EndpointId, Epoch};

/// One queue pair's fault state, kept until it is retired and nothing of it is pending.
#[derive(Debug)]
struct FaultedQp {
    faults: QpFaultState,
    /// A rule failed one of its requests: it is in error, as a verbs queue pair would be.
    broken: bool,
    retired: bool,
    /// Signaled requests handed to the inner fabric whose completions have not come back
    /// (the poller signals every request).
    in_inner: usize,
    /// Completions made here, waiting for the inner fabric's earlier ones.
    behind: VecDeque<WorkCompletion>,
    /// Requests accepted while a Stall rule held, not executed yet.
    stalled: VecDeque<WorkRequest>,
    /// Completions on their way out, delayed ones among them, in order.
    held: DelayedCompletions,
}

impl FaultedQp {
    /// Nothing of it is left here.
    fn settled(&self) -> bool {
        self.behind.is_empty() && self.stalled.is_empty() && self.held.is_empty()
    }
}

/// A fabric with a fault plan in front of it: see the module docs.
#[derive(Debug)]
pub struct Faulted<F> {
    inner: F,
    view: FaultView,
    qps: HashMap<QpNum, FaultedQp>,
    /// Queue pairs connected so far (the next one's ordinal).
    adopted: u32,
    /// Completions due now, in the order they go out.
    ready: VecDeque<WorkCompletion>,
    /// QP-fatal events raised here.
    events: VecDeque<AsyncEvent>,
    /// How long each delayed request's completion is held once the inner fabric reports it.
    delays: HashMap<WrId, (QpNum, Duration)>,
    /// Queue pairs with requests held by a stall.
    stalls: usize,
    /// Queue pairs with completions made or held here, or retired and not yet forgotten:
    /// the only ones a poll looks at besides the inner fabric's completions.
    waiting: HashSet<QpNum>,
    /// Scratch for the inner fabric's completions.
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
            stalls: 0,
            waiting: HashSet::new(),
            polled: Vec::new(),
        }
    }

    /// Judges `requests` of `qp` in order and executes them: those before the first a rule
    /// fails go to the inner fabric in one post; that one and the rest complete here. A
    /// refusal of the inner fabric is returned as it came, with only the requests it took
    /// counted as executed.
    fn execute(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        let Some(state) = self.qps.get_mut(&qp) else {
            return self.inner.post(qp, requests);
        };
        let before = state.faults.clone();
        let mut failure = None;
        let mut executed = 0;
        for request in requests {
            match state.faults.judge(&self.view.plan) {
                Verdict::Execute { delay } => {
                    if !delay.is_zero() {
                        self.delays.insert(request.wr_id, (qp, delay));
                    }
                    executed += 1;
                }
                Verdict::Fail(status) => {
                    failure = Some((status, false));
                    break;
                }
                Verdict::Fatal => {
                    failure = Some((WcStatus::WrFlushErr, true));
                    break;
                }
            }
        }
        if executed > 0 {
            let posted = self.inner.post(qp, &requests[..executed]);
            let taken = posted
                .as_ref()
                .map_or_else(|refused| refused.posted, |()| executed);
            state.in_inner += requests[..taken].iter().filter(|r| r.signaled).count();
            if let Err(refused) = posted {
                // Not executed after all: judged again, with the same draws, when they come
                // back.
                state.faults = before;
                for _ in 0..taken {
                    state.faults.judge(&self.view.plan);
                }
                for request in &requests[taken..executed] {
                    self.delays.remove(&request.wr_id);
                }
                return Err(refused);
            }
        }
        if let Some((status, fatal)) = failure {
            if fatal {
                self.events.push_back(AsyncEvent::QpFatal { qp });
            }
            state.broken = true;
            self.waiting.insert(qp);
            let (failed, behind) = requests[executed..].split_at(1);
            state.behind.extend(
                failed
                    .iter()
                    .map(|request| WorkCompletion::of(request, qp, status)),
            );
            state.behind.extend(
                behind
                    .iter()
                    .map(|request| WorkCompletion::of(request, qp, WcStatus::WrFlushErr)),
            );
        }
        Ok(())
    }

    /// Hands the requests held by stalls that are over to the inner fabric (what it refuses
    /// stays held).
    fn release_stalls(&mut self) {
        if self.stalls == 0 {
            return;
        }
        self.view.refresh();
        let waiting: Vec<QpNum> = self
            .qps
            .iter()
            .filter(|(_, state)| {
                !state.stalled.is_empty() && !state.faults.stalled(&self.view.plan)
            })
            .map(|(&qp, _)| qp)
            .collect();
        for qp in waiting {
            let Some(requests) = self
                .qps
                .get_mut(&qp)
                .map(|state| std::mem::take(&mut state.stalled))
            else {
                continue;
            };
            let requests = Vec::from(requests);
            let (taken, backpressure) = match self.execute(qp, &requests) {
                Ok(()) => (requests.len(), false),
                Err(PostError {
                    posted,
                    error: FabricError::SendQueueFull { .. },
                }) => (posted, true),
                Err(refused) => (refused.posted, false),
            };
            let Some(state) = self.qps.get_mut(&qp) else {
                continue;
            };
            if backpressure {
                // Tried again at the next poll.
                state.stalled.extend(&requests[taken..]);
            } else if taken < requests.len() {
                // The inner fabric will not take them: the queue pair is in error.
                state.broken = true;
                self.waiting.insert(qp);
                state.behind.extend(
                    requests[taken..]
                        .iter()
                        .map(|request| WorkCompletion::of(request, qp, WcStatus::WrFlushErr)),
                );
            }
            if state.stalled.is_empty() {
                self.stalls -= 1;
            }
        }
    }

    /// Moves what may go out to `ready`: completions made here once the inner fabric has
    /// none left ahead of them (or, once the queue pair is retired, at once: the inner
    /// fabric may never report some), and held ones that are due. Forgets retired queue
    /// pairs with nothing left here; the inner fabric's late completions for them go out as
    /// they come.
    fn release(&mut self, now: Instant) {
        let (qps, ready) = (&mut self.qps, &mut self.ready);
        self.waiting.retain(|qp| {
            let Some(state) = qps.get_mut(qp) else {
                return false;
            };
            if state.in_inner == 0 || state.retired {
                while let Some(completion) = state.behind.pop_front() {
                    state.held.emit(completion, now, ready);
                }
            }
            state.held.release(now, ready);
            if state.retired && state.settled() {
                qps.remove(qp);
                return false;
            }
            !state.behind.is_empty() || !state.held.is_empty() || state.retired
        });
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
                retired: false,
                in_inner: 0,
                behind: VecDeque::new(),
                stalled: VecDeque::new(),
                held: DelayedCompletions::default(),
            },
        );
        Ok(qp)
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        if requests.is_empty() {
            return Ok(());
        }
        self.view.refresh();
        let Some(state) = self.qps.get_mut(&qp).filter(|state| !state.retired) else {
            // Not ours (never connected, or retired): the inner fabric says so.
            return self.inner.post(qp, requests);
        };
        if state.broken {
            self.waiting.insert(qp);
            state.behind.extend(
                requests
                    .iter()
                    .map(|request| WorkCompletion::of(request, qp, WcStatus::WrFlushErr)),
            );
            return Ok(());
        }
        if !state.stalled.is_empty() || state.faults.stalled(&self.view.plan) {
            // Kept unexecuted, behind what a stall already holds, until the rule goes.
            if state.stalled.is_empty() {
                self.stalls += 1;
            }
            state.stalled.extend(requests);
            return Ok(());
        }
        self.execute(qp, requests)
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        self.release_stalls();
        let mut polled = std::mem::take(&mut self.polled);
        polled.clear();
        self.inner
            .poll(&mut polled, max.saturating_sub(self.ready.len()));
        let now = Instant::now();
        for completion in polled.drain(..) {
            let Some(state) = self.qps.get_mut(&completion.qp) else {
                self.ready.push_back(completion);
                continue;
            };
            state.in_inner = state.in_inner.saturating_sub(1);
            let delay = if self.delays.is_empty() {
                Duration::ZERO
            } else {
                self.delays
                    .remove(&completion.wr_id)
                    .map_or(Duration::ZERO, |(_, delay)| delay)
            };
            let qp = completion.qp;
            state.held.emit(completion, now + delay, &mut self.ready);
            if !state.held.is_empty() {
                self.waiting.insert(qp);
            }
        }
        self.polled = polled;
        self.release(now);
        let taken = max.min(self.ready.len());
        out.extend(self.ready.drain(..taken));
        taken
    }

    fn retire(&mut self, qp: QpNum) {
        if let Some(state) = self.qps.get_mut(&qp) {
            state.retired = true;
            self.waiting.insert(qp);
            if !state.stalled.is_empty() {
                self.stalls -= 1;
            }
            // Never executed: flushed, after whatever the inner fabric still reports.
            let flushed = state
                .stalled
                .drain(..)
                .map(|request| WorkCompletion::of(&request, qp, WcStatus::WrFlushErr));
            state.behind.extend(flushed);
            if !self.delays.is_empty() {
                self.delays.retain(|_, (delayed_qp, _)| *delayed_qp != qp);
            }
        }
        self.inner.retire(qp);
    }

    fn abandon(&mut self, qp: QpNum) -> bool {
        // A fabric that keeps its operations keeps reporting them: so does this one.
        if !self.inner.abandon(qp) {
            return false;
        }
        if let Some(state) = self.qps.remove(&qp) {
            if !state.stalled.is_empty() {
                self.stalls -= 1;
            }
        }
        self.waiting.remove(&qp);
        self.delays.retain(|_, (delayed_qp, _)| *delayed_qp != qp);
        self.ready.retain(|completion| completion.qp != qp);
        true
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
        script.hold(true);
        fabric.post(qp, &requests(1..6)).expect("posted");
        fabric.post(qp, &requests(6..8)).expect("posted");
        let reached: Vec<u64> = script.posted().iter().map(|p| p.request.wr_id.0).collect();
        assert_eq!(
            reached,
            vec![1, 2],
            "only the requests before the failed one"
        );
        assert!(
            drain(&mut fabric).is_empty(),
            "the failure waits for the requests posted before it"
        );
        script.release();
        use WcStatus::{LocLenErr, Success, WrFlushErr};
        assert_eq!(
            drain(&mut fabric),
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
    fn a_retire_releases_what_was_made_here_though_the_fabric_never_answers() {
        let plan = FaultPlan::new(1).with(Fault::FailNth {
            on: QpMatch::Any,
            nth: 2,
            status: WcStatus::RemAccessErr,
        });
        let (mut fabric, script, _, qp) = faulted(plan);
        script.hold(true);
        fabric.post(qp, &requests(1..4)).expect("posted");
        assert!(
            drain(&mut fabric).is_empty(),
            "behind request 1, which never completes"
        );
        fabric.retire(qp);
        assert_eq!(
            drain(&mut fabric)
                .into_iter()
                .filter(|&(id, _)| id != 1)
                .collect::<Vec<_>>(),
            vec![(2, WcStatus::RemAccessErr), (3, WcStatus::WrFlushErr)]
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
        assert_eq!(
            drain(&mut fabric),
            vec![(2, WcStatus::Success), (3, WcStatus::RemAccessErr)]
        );
    }

    #[test]
    fn a_stall_keeps_requests_until_it_lifts_and_a_retire_flushes_them() {
        let (mut fabric, script, faults, qp) = faulted(FaultPlan::new(1));
        faults.add(Fault::Stall { on: QpMatch::Any });
        fabric
            .post(qp, &requests(1..3))
            .expect("accepted, not executed");
        fabric
            .post(qp, &requests(3..4))
            .expect("accepted, not executed");
        assert!(drain(&mut fabric).is_empty());
        assert!(
            script.posted().is_empty(),
            "nothing executes while it holds"
        );
        faults.clear();
        let done = drain(&mut fabric);
        assert_eq!(
            done,
            vec![
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::Success)
            ]
        );
        faults.add(Fault::Stall { on: QpMatch::Any });
        fabric
            .post(qp, &requests(4..6))
            .expect("accepted, not executed");
        fabric.retire(qp);
        assert_eq!(
            drain(&mut fabric),
            vec![(4, WcStatus::WrFlushErr), (5, WcStatus::WrFlushErr)]
        );
        assert_eq!(script.posted().len(), 3, "the flushed ones never executed");
    }

    #[test]
    fn a_refusal_keeps_the_random_draws_of_the_requests_it_refused() {
        let plan = FaultPlan::new(11).with(Fault::Random {
            on: QpMatch::Any,
            per_million: 60_000,
            status: WcStatus::RemAccessErr,
        });
        // The same 100 requests, once in posts that always fit and once through a send queue
        // of 3 that refuses most of every post: the same ones fail.
        let failed = |send_queue: usize| {
            let (mut fabric, script, _, qp) = faulted(plan.clone());
            script.set_limits(FabricLimits {
                send_queue,
                ..FabricLimits::UNLIMITED
            });
            script.hold(true);
            let all = requests(1..101);
            let mut next = 0;
            let mut failed = Vec::new();
            while next < all.len() {
                let taken = match fabric.post(qp, &all[next..]) {
                    Ok(()) => all.len() - next,
                    Err(refused) => refused.posted,
                };
                next += taken;
                script.release();
                let done = drain(&mut fabric);
                failed.extend(
                    done.iter()
                        .filter(|(_, s)| *s == WcStatus::RemAccessErr)
                        .map(|&(id, _)| id),
                );
                if done.iter().any(|(_, s)| *s != WcStatus::Success) {
                    break;
                }
            }
            failed
        };
        let roomy = failed(usize::MAX);
        assert_eq!(roomy.len(), 1, "the first failure breaks the queue pair");
        assert!(roomy[0] > 6, "past a few refusals: {roomy:?}");
        assert_eq!(failed(3), roomy);
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
