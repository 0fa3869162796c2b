//! The round count a poller publishes, and how a thread that withdrew something (a memory
//! registration's keys) waits until no poller round that could have missed the withdrawal
//! is still running.
//!
//! Every round starts with a SeqCst fence ([`Rounds::begin`]) and ends by counting itself
//! ([`Rounds::end`], Release). The waiter withdraws, then takes a [`Rounds::snapshot`]: a
//! SeqCst fence, then the count `c`. Rounds up to `c` are over. A round whose fence comes
//! after the waiter's in the fences' total order sees the withdrawal. Only round `c + 1`
//! can have begun before the waiter's fence and still be running (had a later one begun
//! before it, its fence would follow round `c + 1`'s end, and the waiter would read at least
//! `c + 1`), and [`Rounds::passed`] waits for its end. So once `passed` is true, no round
//! that may have acted on what was withdrawn is still running. A loom model checks it.

use crate::sync::{AtomicU64, Ordering, fence};

/// The count of a poller that will never run another round.
const DONE: u64 = u64::MAX;

/// A poller's finished rounds. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Rounds(AtomicU64);

impl Rounds {
    /// Starts a round (the poller's thread, before anything else in the round).
    pub(crate) fn begin(&self) {
        // SeqCst fence: see the module docs.
        fence(Ordering::SeqCst);
    }

    /// Ends a round. The poller is the only writer.
    pub(crate) fn end(&self) {
        let next = self.0.load(Ordering::Relaxed).wrapping_add(1) % DONE;
        // Release: what the round did happens before a waiter that sees the count returns.
        self.0.store(next, Ordering::Release);
    }

    /// The poller will never run another round (it is going away with its fabric).
    pub(crate) fn finish(&self) {
        // Release: as in `end`.
        self.0.store(DONE, Ordering::Release);
    }

    /// Whether the poller has finished for good: its last round is over, and what it held
    /// was resolved.
    pub(crate) fn finished(&self) -> bool {
        // Acquire: pairs with `finish`'s Release.
        self.0.load(Ordering::Acquire) == DONE
    }

    /// Call after withdrawing: the count to wait past.
    pub(crate) fn snapshot(&self) -> u64 {
        // SeqCst fence: see the module docs.
        fence(Ordering::SeqCst);
        // Acquire: pairs with `end`'s Release.
        self.0.load(Ordering::Acquire)
    }

    /// Whether every round that may have missed a withdrawal made before `snapshot` is over.
    pub(crate) fn passed(&self, snapshot: u64) -> bool {
        // Acquire: pairs with `end`'s Release, so those rounds' work happens before ours.
        snapshot == DONE || self.0.load(Ordering::Acquire) != snapshot
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use loom::thread;

    use crate::quiesce::Rounds;
    use crate::sync::{Arc, AtomicUsize, Ordering};

    /// A key is withdrawn, then the waiter waits for the rounds and "unmaps". The poller
    /// runs two rounds, each acting on the memory only if it sees the key live. In every
    /// interleaving, no round acts on the memory after it was unmapped. (Taking the snapshot
    /// without its fence, or waiting on nothing, fails this model.)
    #[test]
    fn loom_no_round_acts_on_a_withdrawal_it_missed_after_quiesce_passes() {
        loom::model(|| {
            let rounds = Arc::new(Rounds::default());
            let live = Arc::new(AtomicUsize::new(1));
            let unmapped = Arc::new(AtomicUsize::new(0));
            let poller = {
                let (rounds, live, unmapped) = (rounds.clone(), live.clone(), unmapped.clone());
                thread::spawn(move || {
                    for _ in 0..2 {
                        rounds.begin();
                        if live.load(Ordering::Relaxed) == 1 {
                            assert_eq!(
                                unmapped.load(Ordering::Relaxed),
                                0,
                                "a round copied into memory already unmapped"
                            );
                        }
                        rounds.end();
                    }
                    rounds.finish();
                })
            };
            live.store(0, Ordering::Relaxed);
            let snapshot = rounds.snapshot();
            while !rounds.passed(snapshot) {
                thread::yield_now();
            }
            unmapped.store(1, Ordering::Relaxed);
            poller.join().unwrap();
        });
    }
}
