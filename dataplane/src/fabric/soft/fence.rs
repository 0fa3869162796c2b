//! Access fences: how a soft device knows that no peer is still copying into or out of
//! memory it withdrew.
//!
//! A soft peer moves the bytes itself — a plain copy into our memfd it mapped, or
//! `process_vm_writev/readv` — after checking the key in our live region table. A withdrawal
//! in the table stops every check made after it, but not a copy whose check came before.
//! So every connected queue pair's inbox carries an access word the peer makes odd around
//! each check-and-copy (then a SeqCst fence, then its checks; [`super::nic::execute`]), and
//! a revoked word we set to take the queue pair out of service.
//!
//! The device keeps one [`Guests`] entry per queue pair a peer connected to it. After
//! withdrawing a key (or revoking), [`Guests::quiesce`] fences and waits until each peer is
//! outside any check-and-copy it was inside: from then on, no copy that passed the old
//! check is running, and every later one sees the withdrawal. A peer that has exited is not
//! waited for; one that stays inside past the deadline (stopped, or hostile) makes the wait
//! fail instead of blocking.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::inbox::InboxWatch;
use super::sys;

/// One queue pair a peer may copy through.
#[derive(Clone, Debug)]
struct Guest {
    watch: InboxWatch,
    /// Readable once the peer exits; `None` for this process.
    pidfd: Option<Arc<OwnedFd>>,
}

impl Guest {
    fn has_exited(&self) -> bool {
        self.pidfd
            .as_ref()
            .is_some_and(|fd| sys::has_exited(fd.as_fd()))
    }
}

/// The queue pairs through which peers may touch a device's memory.
#[derive(Debug, Default)]
pub(crate) struct Guests(Mutex<Vec<Guest>>);

/// How long the fence sleeps between looks at a peer still inside.
const RECHECK: Duration = Duration::from_micros(20);

impl Guests {
    /// Adds a connected queue pair; `pidfd` is the peer's (none for this process). Forgets
    /// those that can never copy again, so that a long-lived device holds one entry (and one
    /// pidfd) per live queue pair, not one per queue pair it ever had.
    pub(crate) fn admit(&self, watch: InboxWatch, pidfd: Option<OwnedFd>) {
        let guest = Guest {
            watch,
            pidfd: pidfd.map(Arc::new),
        };
        let mut guests = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        forget_finished(&mut guests);
        guests.push(guest);
    }

    /// Call after withdrawing a key or revoking a queue pair: returns true once no peer is
    /// inside a check-and-copy that began before the call, false if `deadline` passes
    /// first. Forgets queue pairs that can never copy again (revoked and outside, or whose
    /// peer exited).
    pub(crate) fn quiesce(&self, deadline: Instant) -> bool {
        // SeqCst fence: pairs with the fence a peer makes after entering (see
        // `InboxWriter::enter`): either we see it inside, or it sees what we withdrew.
        fence(Ordering::SeqCst);
        let inside: Vec<(Guest, u64)> = {
            let mut guests = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            forget_finished(&mut guests);
            guests
                .iter()
                .map(|guest| (guest.clone(), guest.watch.access()))
                .filter(|(_, access)| access & 1 == 1)
                .collect()
        };
        for (guest, section) in inside {
            while guest.watch.access() == section && !guest.has_exited() {
                if Instant::now() >= deadline {
                    return false;
                }
                thread::sleep(RECHECK);
            }
        }
        true
    }
}

/// Drops the queue pairs that can never copy again: whose peer exited, or revoked and seen
/// outside after the revocation. The revocation is read (SeqCst) before a SeqCst fence and
/// the access word after it, whichever thread revoked: a peer that entered without seeing
/// the revocation fenced before it was stored, so after our fence its entry shows.
fn forget_finished(guests: &mut Vec<Guest>) {
    guests.retain(|guest| {
        if guest.has_exited() {
            return false;
        }
        if !guest.watch.is_revoked() {
            return true;
        }
        fence(Ordering::SeqCst);
        guest.watch.access() & 1 == 1
    });
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::fabric::soft::inbox::{InboxWriter, RecvQueue};

    fn peer_of(queue: &RecvQueue) -> InboxWriter {
        let fd = queue.fd().try_clone_to_owned().expect("dup");
        InboxWriter::map(fd).expect("valid inbox")
    }

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    /// Caught: a device kept one guest (and the peer's pidfd) per queue pair it ever had
    /// until something was deregistered, so a long-lived initiator that reconnected again
    /// and again gained descriptors without bound (the soak saw +80 in 90 s).
    #[test]
    fn admitting_forgets_the_queue_pairs_that_can_never_copy_again() {
        let guests = Guests::default();
        let mut retired = Vec::new();
        for _ in 0..10 {
            let queue = RecvQueue::new().expect("memfd");
            guests.admit(queue.watch(), None);
            queue.watch().revoke();
            retired.push(queue);
        }
        let live = RecvQueue::new().expect("memfd");
        guests.admit(live.watch(), None);
        let kept = guests.0.lock().expect("not poisoned").len();
        assert_eq!(kept, 1, "only the live queue pair is kept");
    }

    /// Caught: without the wait, `quiesce` returned while the peer was still inside the
    /// copy it checked before the withdrawal.
    #[test]
    fn quiesce_waits_for_a_peer_inside_a_copy_and_only_for_it() {
        let queue = RecvQueue::new().expect("memfd");
        let peer = peer_of(&queue);
        let guests = Guests::default();
        guests.admit(queue.watch(), None);
        assert!(guests.quiesce(soon(10)), "nobody inside: no wait");

        let section = peer.enter();
        let started = Instant::now();
        assert!(!guests.quiesce(soon(30)), "a peer inside holds the fence");
        assert!(started.elapsed() >= Duration::from_millis(30));

        let leaving = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(section);
            peer
        });
        assert!(
            guests.quiesce(soon(10_000)),
            "the peer left: the fence passes"
        );
        let peer = leaving.join().expect("no panic");

        // Revoked: the peer's next section sees it; once the peer is outside, the device
        // forgets the queue pair.
        queue.watch().revoke();
        let section = peer.enter();
        assert!(peer.is_revoked());
        drop(section);
        assert!(guests.quiesce(soon(10)));
        assert_eq!(guests.0.lock().expect("lock").len(), 0);
    }
}
