//! Selective signaling: only every k-th work request of a post list, and its last, asks for
//! a completion. Completions of one queue pair arrive in posting order, so a completion for
//! request x says every earlier unsignaled request of that queue pair succeeded; the fabric
//! reports them then. (Errors and flushes always produce completions of their own.)

use std::collections::VecDeque;

use crate::fabric::{Opcode, WrId};

/// Whether request `position` of a list of `len` is signaled with one completion every
/// `every` requests (and always the last, so that a list's end is seen).
pub fn is_signaled(position: usize, len: usize, every: usize) -> bool {
    position + 1 == len || (position + 1) % every.max(1) == 0
}

/// A posted request as the tracker remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedRequest {
    /// Its id.
    pub wr_id: WrId,
    /// Its operation.
    pub opcode: Opcode,
    /// Its length.
    pub len: u32,
    /// Whether it asked for a completion.
    pub signaled: bool,
}

/// One queue pair's requests that have no completion yet, in posting order.
#[derive(Debug, Default)]
pub struct Outstanding {
    queue: VecDeque<PostedRequest>,
}

impl Outstanding {
    /// Remembers a posted request.
    pub fn push(&mut self, request: PostedRequest) {
        self.queue.push_back(request);
    }

    /// Requests without a completion.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none is outstanding.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Takes every outstanding request, oldest first (their completions will not come).
    pub fn take_all(&mut self) -> VecDeque<PostedRequest> {
        std::mem::take(&mut self.queue)
    }

    /// A completion for `wr_id` arrived: appends to `implied` the unsignaled requests posted
    /// before it (they succeeded), forgets them and it, and returns it. A completion for an
    /// id this queue pair does not hold changes nothing.
    pub fn complete(
        &mut self,
        wr_id: WrId,
        implied: &mut Vec<PostedRequest>,
    ) -> Option<PostedRequest> {
        let position = self.queue.iter().position(|r| r.wr_id == wr_id)?;
        let mut completed = None;
        for earlier in self.queue.drain(..=position) {
            if earlier.wr_id == wr_id {
                completed = Some(earlier);
            } else if !earlier.signaled {
                implied.push(earlier);
            }
        }
        completed
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn request(n: u32, signaled: bool) -> PostedRequest {
        PostedRequest {
            wr_id: WrId::new(n, 1),
            opcode: Opcode::Write,
            len: 64,
            signaled,
        }
    }

    #[test]
    fn every_kth_and_the_last_are_signaled() {
        let pattern: Vec<bool> = (0..10).map(|i| is_signaled(i, 10, 4)).collect();
        assert_eq!(
            pattern,
            [
                false, false, false, true, false, false, false, true, false, true
            ]
        );
        assert!(is_signaled(0, 1, 16), "a single request is the last");
        assert!(
            (0..5).all(|i| is_signaled(i, 5, 1)),
            "every = 1 signals all"
        );
        assert!(
            (0..5).all(|i| is_signaled(i, 5, 0)),
            "every = 0 is read as 1"
        );
    }

    #[test]
    fn a_completion_implies_the_unsignaled_requests_before_it() {
        let mut outstanding = Outstanding::default();
        for n in 0..8 {
            outstanding.push(request(n, n % 4 == 3));
        }
        let mut implied = Vec::new();
        let completed = outstanding.complete(WrId::new(3, 1), &mut implied);
        assert_eq!(completed.map(|r| r.signaled), Some(true));
        let ids: Vec<u32> = implied.iter().map(|r| r.wr_id.slot()).collect();
        assert_eq!(ids, [0, 1, 2]);
        assert_eq!(outstanding.len(), 4);
        // A flush of request 5 (unsignaled, the queue pair failed): 4 succeeded before it.
        implied.clear();
        outstanding.complete(WrId::new(5, 1), &mut implied);
        assert_eq!(
            implied.iter().map(|r| r.wr_id.slot()).collect::<Vec<_>>(),
            [4]
        );
        implied.clear();
        assert_eq!(outstanding.complete(WrId::new(99, 1), &mut implied), None);
        assert!(implied.is_empty() && outstanding.len() == 2);
    }
}
