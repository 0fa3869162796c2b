//! Fault plans: failures a fabric produces on purpose, the same way for the same seed.
//!
//! A [`FaultPlan`] is a seed and a list of [`Fault`]s. The fabric counts the work requests it
//! executes on each queue pair; every rule is a function of that count, of which queue pair
//! it is ([`QpMatch`]) and of a random stream seeded from the plan's seed and the queue
//! pair's ordinal — never of wall-clock time or thread interleaving. So the same
//! submissions under the same plan fail at the same places.
//!
//! A [`FaultHandle`] changes the plan while the fabric runs (kill a link now, heal it later);
//! the fabric notices at its next post or poll through one atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::EndpointId;
use crate::fabric::WcStatus;
use crate::rng::SplitMix64;

/// Which queue pairs a fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpMatch {
    /// Every queue pair of the fabric.
    Any,
    /// Every queue pair adopted for this endpoint, now and later.
    Endpoint(EndpointId),
    /// The queue pair adopted `n`-th by the fabric, counting from 0.
    Ordinal(u32),
}

/// One rule of a [`FaultPlan`]. Counts of work requests are per queue pair, from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The `nth` work request on each matching queue pair completes with `status`; an error
    /// status moves the queue pair to ERR, as verbs does.
    FailNth {
        /// Which queue pairs.
        on: QpMatch,
        /// Which work request, from 1.
        nth: u64,
        /// Its completion status.
        status: WcStatus,
    },
    /// After `after` work requests a matching queue pair raises IBV_EVENT_QP_FATAL: it goes
    /// to ERR and everything outstanding on it is flushed.
    QpFatal {
        /// Which queue pairs.
        on: QpMatch,
        /// Work requests executed first.
        after: u64,
    },
    /// Completions of matching queue pairs become visible between `min` and `max` after
    /// execution (uniform, drawn from the seed). Order within a queue pair is kept.
    Delay {
        /// Which queue pairs.
        on: QpMatch,
        /// Shortest delay.
        min: Duration,
        /// Longest delay.
        max: Duration,
    },
    /// The link to the peers of matching queue pairs is dead: their work requests fail with
    /// RETRY_EXC_ERR, as when the remote port stops answering.
    KillLink {
        /// Which queue pairs.
        on: QpMatch,
    },
    /// A flapping peer: every matching queue pair fails with RETRY_EXC_ERR at work request
    /// `after + 1` — a fresh queue pair works briefly, then dies.
    Flap {
        /// Which queue pairs.
        on: QpMatch,
        /// Work requests that succeed on each new queue pair.
        after: u64,
    },
    /// The peer stops answering (a stopped process): matching queue pairs execute nothing
    /// while the rule holds, and nothing fails because of it; removing the rule lets them go
    /// on. Honoured by the soft fabric and by [`Faulted`](super::faulted::Faulted) (which
    /// keeps the requests posted meanwhile unexecuted); on TCP, stop the target process
    /// instead.
    Stall {
        /// Which queue pairs.
        on: QpMatch,
    },
    /// Each work request on matching queue pairs fails with `status` with probability
    /// `per_million` / 1 000 000, drawn from the seed.
    Random {
        /// Which queue pairs.
        on: QpMatch,
        /// Failure probability in millionths.
        per_million: u32,
        /// Status of the failures.
        status: WcStatus,
    },
}

impl Fault {
    fn on(&self) -> QpMatch {
        match *self {
            Self::FailNth { on, .. }
            | Self::QpFatal { on, .. }
            | Self::Delay { on, .. }
            | Self::KillLink { on }
            | Self::Flap { on, .. }
            | Self::Stall { on }
            | Self::Random { on, .. } => on,
        }
    }
}

/// A seed and the faults to produce.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Seeds every random draw.
    pub seed: u64,
    /// The rules, checked in order; the first that fails a work request wins.
    pub faults: Vec<Fault>,
}

impl FaultPlan {
    /// An empty plan with `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            faults: Vec::new(),
        }
    }

    /// Adds a rule.
    #[must_use]
    pub fn with(mut self, fault: Fault) -> Self {
        self.faults.push(fault);
        self
    }
}

#[derive(Debug, Default)]
struct Shared {
    version: AtomicU64,
    plan: Mutex<FaultPlan>,
}

/// Changes a running fabric's fault plan. Cheap to clone; any thread.
#[derive(Clone, Debug, Default)]
pub struct FaultHandle(Arc<Shared>);

impl FaultHandle {
    fn update(&self, change: impl FnOnce(&mut FaultPlan)) {
        let mut plan = self.0.plan.lock().unwrap_or_else(PoisonError::into_inner);
        change(&mut plan);
        // Release: the fabric that sees the new version (Acquire) reads the new plan.
        self.0.version.fetch_add(1, Ordering::Release);
    }

    /// Replaces the plan.
    pub fn set(&self, plan: FaultPlan) {
        self.update(|current| *current = plan);
    }

    /// Adds a rule to the plan.
    pub fn add(&self, fault: Fault) {
        self.update(|current| current.faults.push(fault));
    }

    /// Removes every rule (keeps the seed): links heal, delays stop.
    pub fn clear(&self) {
        self.update(|current| current.faults.clear());
    }

    /// The plan now.
    pub fn plan(&self) -> FaultPlan {
        self.0
            .plan
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// What the plan says about one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Execute it; its completion becomes visible after `delay`.
    Execute {
        /// Extra completion delay.
        delay: Duration,
    },
    /// Do not execute it: it completes with this status and the queue pair goes to ERR.
    Fail(WcStatus),
    /// The queue pair raises QP_FATAL before executing it.
    Fatal,
}

/// Per-queue-pair fault bookkeeping, owned by the fabric beside the queue pair.
#[derive(Clone, Debug)]
pub(crate) struct QpFaultState {
    ordinal: u32,
    endpoint: Option<EndpointId>,
    executed: u64,
    rng: SplitMix64,
}

impl QpFaultState {
    pub(crate) fn new(seed: u64, ordinal: u32, endpoint: Option<EndpointId>) -> Self {
        Self {
            ordinal,
            endpoint,
            executed: 0,
            rng: SplitMix64::new(seed ^ u64::from(ordinal).wrapping_mul(0xA24B_AED4_963E_E407)),
        }
    }

    fn matches(&self, on: QpMatch) -> bool {
        match on {
            QpMatch::Any => true,
            QpMatch::Endpoint(endpoint) => self.endpoint == Some(endpoint),
            QpMatch::Ordinal(ordinal) => self.ordinal == ordinal,
        }
    }

    /// Judges the next work request of this queue pair and counts it.
    pub(crate) fn judge(&mut self, plan: &FaultPlan) -> Verdict {
        self.executed += 1;
        let n = self.executed;
        let mut delay = Duration::ZERO;
        for fault in &plan.faults {
            if !self.matches(fault.on()) {
                continue;
            }
            match *fault {
                Fault::KillLink { .. } => return Verdict::Fail(WcStatus::RetryExcErr),
                Fault::FailNth { nth, status, .. } if nth == n => return Verdict::Fail(status),
                Fault::Flap { after, .. } if after + 1 == n => {
                    return Verdict::Fail(WcStatus::RetryExcErr);
                }
                Fault::QpFatal { after, .. } if after + 1 == n => return Verdict::Fatal,
                // One draw per matching rule and request, whatever it decides.
                Fault::Random {
                    per_million,
                    status,
                    ..
                } if self.rng.below(1_000_000) < u64::from(per_million) => {
                    return Verdict::Fail(status);
                }
                Fault::Delay { min, max, .. } => {
                    let spread = max.saturating_sub(min).as_nanos() as u64;
                    let extra = if spread == 0 {
                        0
                    } else {
                        self.rng.below(spread + 1)
                    };
                    delay = delay.max(min + Duration::from_nanos(extra));
                }
                _ => {}
            }
        }
        Verdict::Execute { delay }
    }

    /// Whether a matching Stall rule holds now: nothing executes.
    pub(crate) fn stalled(&self, plan: &FaultPlan) -> bool {
        plan.faults
            .iter()
            .any(|fault| matches!(fault, Fault::Stall { on } if self.matches(*on)))
    }

    /// Whether a matching KillLink rule holds now (for work that waits on the peer).
    pub(crate) fn link_killed(&self, plan: &FaultPlan) -> bool {
        plan.faults
            .iter()
            .any(|fault| matches!(fault, Fault::KillLink { on } if self.matches(*on)))
    }
}

/// The fabric's copy of the plan, refreshed when the handle changes it.
#[derive(Debug)]
pub(crate) struct FaultView {
    handle: FaultHandle,
    seen: u64,
    pub(crate) plan: FaultPlan,
}

impl FaultView {
    pub(crate) fn new(handle: FaultHandle) -> Self {
        let plan = handle.plan();
        let seen = handle.0.version.load(Ordering::Acquire);
        Self { handle, seen, plan }
    }

    /// Picks up a changed plan (one atomic load when nothing changed).
    pub(crate) fn refresh(&mut self) {
        // Acquire: pairs with the handle's Release increment.
        let version = self.handle.0.version.load(Ordering::Acquire);
        if version != self.seen {
            self.seen = version;
            self.plan = self.handle.plan();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn run(plan: &FaultPlan, ordinal: u32, requests: u64) -> Vec<Verdict> {
        let mut state = QpFaultState::new(plan.seed, ordinal, Some(EndpointId(3)));
        (0..requests).map(|_| state.judge(plan)).collect()
    }

    #[test]
    fn the_same_seed_fails_the_same_requests() {
        let plan = FaultPlan::new(42).with(Fault::Random {
            on: QpMatch::Any,
            per_million: 100_000,
            status: WcStatus::RemAccessErr,
        });
        let first = run(&plan, 0, 1000);
        assert_eq!(first, run(&plan, 0, 1000));
        let failures = first
            .iter()
            .filter(|v| matches!(v, Verdict::Fail(_)))
            .count();
        assert!(
            (50..=150).contains(&failures),
            "about 10 % of 1000: {failures}"
        );
        assert_ne!(first, run(&FaultPlan { seed: 43, ..plan }, 0, 1000));
    }

    #[test]
    fn nth_flap_and_fatal_hit_exactly_their_request() {
        let plan = FaultPlan::new(1)
            .with(Fault::FailNth {
                on: QpMatch::Ordinal(0),
                nth: 3,
                status: WcStatus::LocLenErr,
            })
            .with(Fault::Flap {
                on: QpMatch::Ordinal(1),
                after: 2,
            })
            .with(Fault::QpFatal {
                on: QpMatch::Endpoint(EndpointId(3)),
                after: 5,
            });
        let none = Verdict::Execute {
            delay: Duration::ZERO,
        };
        let on_first = run(&plan, 0, 6);
        assert_eq!(
            &on_first[..3],
            &[none, none, Verdict::Fail(WcStatus::LocLenErr)]
        );
        assert_eq!(run(&plan, 1, 3)[2], Verdict::Fail(WcStatus::RetryExcErr));
        assert_eq!(run(&plan, 2, 6)[5], Verdict::Fatal);
    }

    #[test]
    fn delays_stay_in_their_range_and_killed_links_fail() {
        let plan = FaultPlan::new(9).with(Fault::Delay {
            on: QpMatch::Any,
            min: Duration::from_millis(1),
            max: Duration::from_millis(3),
        });
        for verdict in run(&plan, 0, 100) {
            let Verdict::Execute { delay } = verdict else {
                panic!("a delay never fails: {verdict:?}");
            };
            assert!(delay >= Duration::from_millis(1) && delay <= Duration::from_millis(3));
        }
        let killed = FaultPlan::new(9).with(Fault::KillLink {
            on: QpMatch::Endpoint(EndpointId(3)),
        });
        assert_eq!(
            run(&killed, 0, 1),
            vec![Verdict::Fail(WcStatus::RetryExcErr)]
        );
        let other = QpFaultState::new(9, 0, Some(EndpointId(4)));
        assert!(!other.link_killed(&killed));
    }

    #[test]
    fn a_handle_change_reaches_the_view() {
        let handle = FaultHandle::default();
        let mut view = FaultView::new(handle.clone());
        assert!(view.plan.faults.is_empty());
        handle.add(Fault::KillLink { on: QpMatch::Any });
        view.refresh();
        assert_eq!(view.plan.faults.len(), 1);
        handle.clear();
        view.refresh();
        assert!(view.plan.faults.is_empty());
    }
}
