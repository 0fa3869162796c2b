//! One queue pair's completions on their way to the completion queue: a fault plan may
//! delay them, but they always come out in the order they were made, as a NIC's do.

use std::collections::VecDeque;
use std::time::Instant;

use super::WorkCompletion;

/// Completions not visible yet, in order, each with when it may be.
#[derive(Debug, Default)]
pub(crate) struct DelayedCompletions(VecDeque<(Instant, WorkCompletion)>);

impl DelayedCompletions {
    /// Queues `completion` to become visible at `at`, never before an earlier one; one due
    /// now, with nothing ahead of it, goes straight to `cq`.
    pub(crate) fn emit(
        &mut self,
        completion: WorkCompletion,
        at: Instant,
        cq: &mut VecDeque<WorkCompletion>,
    ) {
        match self.0.back() {
            None if at <= Instant::now() => cq.push_back(completion),
            Some(&(last, _)) => self.0.push_back((at.max(last), completion)),
            None => self.0.push_back((at, completion)),
        }
    }

    /// Moves the completions due by `now` to `cq`, in order.
    pub(crate) fn release(&mut self, now: Instant, cq: &mut VecDeque<WorkCompletion>) {
        while let Some(&(at, completion)) = self.0.front() {
            if at > now {
                break;
            }
            cq.push_back(completion);
            self.0.pop_front();
        }
    }

    /// Whether none is waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
