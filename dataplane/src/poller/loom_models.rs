//! Loom model of the hand-off between the control plane and a poller: that the order of a
//! round's steps never lets a slice reach a queue pair of another epoch.

use std::collections::VecDeque;

use loom::thread;

use super::rule::{LinkState, Route, epoch_rule};
use crate::Epoch;
use crate::ring::{self, Producer};
use crate::sync::{Arc, AtomicUsize, Ordering};

fn push(ring: &mut Producer<u64>, mut value: u64) {
    while let Err(full) = ring.push(value) {
        value = full.into_inner();
        thread::yield_now();
    }
}

/// The control/poller hand-off of a connect and a reconnect, in the order the control
/// plane uses: send the command (AddEndpoint at epoch 1, then BumpEpoch to 2) first,
/// then publish the epoch to submitters (the endpoint view). A submitter reads the view
/// twice and prepares a slice from each epoch it finds (none before the first); the
/// poller runs its real loop order (drain submissions, then apply commands, then route)
/// with the real epoch rule and a re-prepare hook that stamps the current epoch. In every
/// interleaving no slice meets an endpoint the poller does not know yet, each is posted
/// exactly once, on a queue pair of exactly the epoch it carries, and nothing is left
/// waiting. (Publishing the epoch before sending the command fails this model.)
#[test]
fn loom_epoch_hand_off_never_posts_a_stale_slice() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(|| {
        let view = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicUsize::new(0));
        let (mut commands_tx, mut commands) = ring::channel::<u64>(2);
        let (mut slices_tx, mut slices) = ring::channel::<u64>(2);
        let (control_view, control_finished) = (view.clone(), finished.clone());
        let control = thread::spawn(move || {
            for epoch in [1, 2] {
                push(&mut commands_tx, epoch);
                control_view.store(epoch as usize, Ordering::Release);
            }
            control_finished.fetch_add(1, Ordering::Release);
        });
        let submitter_finished = finished.clone();
        let submitter = thread::spawn(move || {
            let mut sent = 0;
            for _ in 0..2 {
                let epoch = view.load(Ordering::Acquire);
                if epoch != 0 {
                    push(&mut slices_tx, epoch as u64);
                    sent += 1;
                }
            }
            submitter_finished.fetch_add(1, Ordering::Release);
            sent
        });
        let mut endpoint: Option<Epoch> = None;
        let mut backlog: Vec<u64> = Vec::new();
        let mut ready: VecDeque<u64> = VecDeque::new();
        let mut posted: Vec<(Epoch, Epoch)> = Vec::new();
        loop {
            let both_done = finished.load(Ordering::Acquire) == 2;
            while let Some(epoch) = slices.pop() {
                ready.push_back(epoch);
            }
            while let Some(epoch) = commands.pop() {
                endpoint = Some(Epoch::new(epoch));
                ready.extend(backlog.drain(..));
            }
            while let Some(epoch) = ready.pop_front() {
                let Some(current) = endpoint else {
                    panic!("a slice reached the poller before its endpoint");
                };
                let mut slice = Epoch::new(epoch);
                loop {
                    match epoch_rule(slice, current, LinkState::Up) {
                        Route::Post => {
                            posted.push((slice, current));
                            break;
                        }
                        Route::Wait => {
                            backlog.push(slice.get());
                            break;
                        }
                        Route::Reprepare => slice = current,
                        Route::Fail(reason) => {
                            panic!("an up endpoint failed a slice: {reason}")
                        }
                    }
                }
            }
            if both_done {
                break;
            }
            thread::yield_now();
        }
        control.join().unwrap();
        let sent = submitter.join().unwrap();
        assert!(backlog.is_empty(), "a slice was left waiting");
        assert_eq!(posted.len(), sent);
        for (slice, queue_pair) in posted {
            assert_eq!(slice, queue_pair, "posted on a queue pair of another epoch");
        }
    });
}
