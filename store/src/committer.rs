//! Group commit of the master's journal: requests queue what they changed, in the order the
//! core changed it; one thread writes everything queued in one go and wakes the requests
//! waiting for it. A request answers only once everything queued before its answer is
//! written down — its own changes and the ones it may have seen (space an eviction freed, an
//! object another request completed). A failed write fails every request waiting and every
//! later one: the master must stop.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::master::JournalEntry;

/// Where the journal goes (etcd, under the leader's term).
pub(crate) trait JournalSink: Send + Sync {
    /// Writes `entries` down, in order.
    fn commit(&self, entries: Vec<JournalEntry>) -> Result<(), String>;
}

#[derive(Default)]
struct Queue {
    /// Sequence number of the last batch queued.
    queued: u64,
    /// Sequence number up to which batches are written down.
    committed: u64,
    pending: Vec<JournalEntry>,
    failed: Option<String>,
    stopping: bool,
}

/// See the module docs.
pub(crate) struct Committer {
    queue: Mutex<Queue>,
    changed: Condvar,
    sink: Arc<dyn JournalSink>,
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Committer {
    pub(crate) fn new(sink: Arc<dyn JournalSink>) -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
            sink,
        }
    }

    /// Queues `entries` (called in the order the core made them); returns the number to
    /// wait for.
    pub(crate) fn enqueue(&self, entries: Vec<JournalEntry>) -> u64 {
        let mut queue = lock(&self.queue);
        queue.queued += 1;
        queue.pending.extend(entries);
        self.changed.notify_all();
        queue.queued
    }

    /// The number of the last batch queued: a reply that may depend on anything the core
    /// did so far waits for it.
    pub(crate) fn latest(&self) -> u64 {
        lock(&self.queue).queued
    }

    /// Waits until batch `seq` is written down, at most until `deadline`.
    pub(crate) fn wait(&self, seq: u64, deadline: Instant) -> Result<(), String> {
        let mut queue = lock(&self.queue);
        loop {
            if let Some(reason) = &queue.failed {
                return Err(reason.clone());
            }
            if queue.committed >= seq {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("the journal was not written down in time".into());
            }
            queue = self
                .changed
                .wait_timeout(queue, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Why writing failed, if it did.
    pub(crate) fn failed(&self) -> Option<String> {
        lock(&self.queue).failed.clone()
    }

    /// Writes what is queued until [`Self::stop`] or a failure.
    pub(crate) fn run(&self) {
        loop {
            let (entries, up_to) = {
                let mut queue = lock(&self.queue);
                while queue.pending.is_empty() && !queue.stopping {
                    queue = self
                        .changed
                        .wait(queue)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                if queue.pending.is_empty() {
                    return;
                }
                (std::mem::take(&mut queue.pending), queue.queued)
            };
            let result = self.sink.commit(entries);
            let mut queue = lock(&self.queue);
            match result {
                Ok(()) => queue.committed = up_to,
                Err(reason) => queue.failed = Some(reason),
            }
            self.changed.notify_all();
            if queue.failed.is_some() {
                return;
            }
        }
    }

    /// Ends [`Self::run`] once what is queued is written.
    pub(crate) fn stop(&self) {
        lock(&self.queue).stopping = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::master::{ClientId, JournalEntry};

    /// Records what it is given; fails once told to.
    #[derive(Default)]
    struct Recorder {
        written: Mutex<Vec<Vec<JournalEntry>>>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl JournalSink for Recorder {
        fn commit(&self, entries: Vec<JournalEntry>) -> Result<(), String> {
            if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("refused".into());
            }
            self.written
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(entries);
            Ok(())
        }
    }

    fn writer(n: u64) -> JournalEntry {
        JournalEntry::Writer {
            client: ClientId(n),
            term: 1,
        }
    }

    #[test]
    fn batches_are_written_in_order_and_a_failure_fails_every_waiter() {
        let sink = Arc::new(Recorder::default());
        let committer = Arc::new(Committer::new(Arc::clone(&sink) as Arc<dyn JournalSink>));
        let first = committer.enqueue(vec![writer(1), writer(2)]);
        let second = committer.enqueue(vec![writer(3)]);
        let runner = {
            let committer = Arc::clone(&committer);
            std::thread::spawn(move || committer.run())
        };
        let bound = Instant::now() + Duration::from_secs(10);
        committer.wait(second, bound).expect("written");
        committer.wait(first, bound).expect("written before");
        let written: Vec<JournalEntry> = sink
            .written
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .concat();
        assert_eq!(written, [writer(1), writer(2), writer(3)]);

        sink.fail.store(true, std::sync::atomic::Ordering::Relaxed);
        let third = committer.enqueue(vec![writer(4)]);
        assert_eq!(committer.wait(third, bound), Err("refused".into()));
        runner.join().expect("the writer ends on a failure");
        let later = committer.enqueue(vec![writer(5)]);
        assert!(
            committer.wait(later, bound).is_err(),
            "and fails what comes after"
        );
        assert_eq!(committer.failed(), Some("refused".into()));
    }
}
