//! The poller's posted work requests, by slot. A work-request id carries its slot and the
//! slot's generation, so a completion for a slot that moved on (a request resolved without
//! its completion, then the slot reused) is recognised and ignored, never matched to the
//! newer request. The poller (`state.rs`) owns the table; slots hold its slices.

use crate::EndpointId;
use crate::fabric::{QpNum, WrId};

/// One posted work request's slot.
#[derive(Debug)]
pub(super) struct InflightSlot<T> {
    generation: u32,
    busy: bool,
    /// `None` only once resolved without its completion (the fabric missed its flush
    /// grace): the slot still waits for the completion.
    pub(super) slice: Option<T>,
    /// The endpoint it was posted for.
    pub(super) endpoint: EndpointId,
    /// The queue pair it was posted on.
    pub(super) qp: QpNum,
    /// The local key of the memory it reads or writes: kept after the slice is resolved
    /// without its completion, since the fabric may still touch that memory.
    lkey: u32,
}

/// Posted work requests by slot.
#[derive(Debug)]
pub(super) struct Inflight<T> {
    slots: Vec<InflightSlot<T>>,
    free: Vec<u32>,
    busy: usize,
}

impl<T> Default for Inflight<T> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            busy: 0,
        }
    }
}

impl<T> Inflight<T> {
    /// Work requests posted and not yet completed.
    pub(super) fn busy(&self) -> usize {
        self.busy
    }

    /// Holds `slice`, posted for `endpoint` on `qp` through local key `lkey`; returns the id
    /// its work request carries.
    pub(super) fn insert(&mut self, slice: T, endpoint: EndpointId, qp: QpNum, lkey: u32) -> WrId {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(InflightSlot {
                    generation: 0,
                    busy: false,
                    slice: None,
                    endpoint,
                    qp,
                    lkey,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.generation = slot.generation.wrapping_add(1);
        slot.busy = true;
        slot.slice = Some(slice);
        slot.endpoint = endpoint;
        slot.qp = qp;
        slot.lkey = lkey;
        self.busy += 1;
        WrId::new(index, slot.generation)
    }

    /// Frees the slot of `wr_id`: its endpoint, the queue pair it was posted on and its
    /// slice. `None` when the id names a slot that moved on.
    pub(super) fn take(&mut self, wr_id: WrId) -> Option<(EndpointId, QpNum, Option<T>)> {
        let slot = self.slots.get_mut(wr_id.slot() as usize)?;
        if !slot.busy || slot.generation != wr_id.generation() {
            return None;
        }
        slot.busy = false;
        self.free.push(wr_id.slot());
        self.busy -= 1;
        Some((slot.endpoint, slot.qp, slot.slice.take()))
    }

    /// Whether a request posted and not yet completed goes through any of `lkeys`.
    pub(super) fn uses_any(&self, lkeys: &[u32]) -> bool {
        self.slots
            .iter()
            .any(|slot| slot.busy && lkeys.contains(&slot.lkey))
    }

    /// The ids of the requests posted on `qp` and not yet completed, with their slices
    /// (`None` once resolved without the completion).
    pub(super) fn posted_on(&self, qp: QpNum) -> impl Iterator<Item = (WrId, Option<&T>)> {
        self.slots
            .iter()
            .enumerate()
            .filter(move |(_, slot)| slot.busy && slot.qp == qp)
            .map(|(index, slot)| {
                (
                    WrId::new(index as u32, slot.generation),
                    slot.slice.as_ref(),
                )
            })
    }

    /// The slots of requests posted and not yet completed.
    pub(super) fn posted_mut(&mut self) -> impl Iterator<Item = &mut InflightSlot<T>> {
        self.slots.iter_mut().filter(|slot| slot.busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QP: QpNum = QpNum(7);

    #[test]
    fn a_request_is_taken_once_by_its_own_id() {
        let mut inflight = Inflight::default();
        let first = inflight.insert("a", EndpointId(1), QP, 0);
        let second = inflight.insert("b", EndpointId(2), QpNum(8), 0);
        assert_eq!(inflight.busy(), 2);
        assert_eq!(
            inflight.take(second),
            Some((EndpointId(2), QpNum(8), Some("b")))
        );
        assert_eq!(inflight.busy(), 1);
        assert_eq!(inflight.take(second), None, "taken already");
        assert_eq!(inflight.busy(), 1);
        assert_eq!(inflight.take(first), Some((EndpointId(1), QP, Some("a"))));
        assert_eq!(inflight.busy(), 0);
        assert_eq!(inflight.take(WrId::new(9, 1)), None, "no such slot");
    }

    #[test]
    fn a_reused_slot_does_not_answer_to_its_previous_id() {
        let mut inflight = Inflight::default();
        let old = inflight.insert(1, EndpointId(1), QP, 0);
        assert!(inflight.take(old).is_some());
        let new = inflight.insert(2, EndpointId(3), QP, 0);
        assert_eq!(new.slot(), old.slot(), "the slot is reused");
        assert_ne!(new.generation(), old.generation());
        assert_eq!(inflight.take(old), None);
        assert_eq!(inflight.busy(), 1);
        assert_eq!(inflight.take(new), Some((EndpointId(3), QP, Some(2))));
    }

    #[test]
    fn a_slice_resolved_without_its_completion_leaves_the_slot_waiting() {
        let mut inflight = Inflight::default();
        let id = inflight.insert(5, EndpointId(1), QP, 0);
        let other = inflight.insert(6, EndpointId(2), QP, 0);
        assert!(inflight.take(other).is_some());
        let posted: Vec<_> = inflight
            .posted_mut()
            .map(|slot| slot.slice.take())
            .collect();
        assert_eq!(posted, [Some(5)], "only the busy slot");
        assert_eq!(inflight.busy(), 1);
        assert_eq!(inflight.take(id), Some((EndpointId(1), QP, None)));
        assert_eq!(inflight.posted_mut().count(), 0);
    }

    #[test]
    fn the_requests_posted_on_a_queue_pair_are_its_busy_slots_with_their_ids() {
        let mut inflight = Inflight::default();
        let first = inflight.insert(1, EndpointId(1), QP, 0);
        let elsewhere = inflight.insert(2, EndpointId(1), QpNum(8), 0);
        let second = inflight.insert(3, EndpointId(2), QP, 0);
        let done = inflight.insert(4, EndpointId(2), QP, 0);
        assert!(inflight.take(done).is_some());
        let posted: Vec<_> = inflight
            .posted_on(QP)
            .map(|(id, slice)| (id, slice.copied()))
            .collect();
        assert_eq!(posted, [(first, Some(1)), (second, Some(3))]);
        let posted: Vec<_> = inflight.posted_on(QpNum(8)).map(|(id, _)| id).collect();
        assert_eq!(posted, [elsewhere]);
        // The ids given are the ones that take the slots.
        assert_eq!(inflight.take(second), Some((EndpointId(2), QP, Some(3))));
        assert_eq!(inflight.posted_on(QP).count(), 1);
    }

    #[test]
    fn a_key_is_in_use_until_every_request_through_it_completed() {
        let mut inflight = Inflight::default();
        let first = inflight.insert(1, EndpointId(1), QP, 4);
        let second = inflight.insert(2, EndpointId(1), QP, 4);
        let other = inflight.insert(3, EndpointId(1), QP, 5);
        assert!(inflight.uses_any(&[4]));
        assert!(inflight.uses_any(&[9, 5]));
        assert!(!inflight.uses_any(&[9]));
        assert!(inflight.take(first).is_some());
        // Resolved without its completion: the fabric may still touch its memory.
        for slot in inflight.posted_mut() {
            slot.slice.take();
        }
        assert!(inflight.uses_any(&[4]), "the second is still posted");
        assert!(inflight.take(second).is_some());
        assert!(!inflight.uses_any(&[4]));
        assert!(inflight.take(other).is_some());
        assert!(!inflight.uses_any(&[5]));
    }
}
