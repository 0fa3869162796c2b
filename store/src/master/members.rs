//! Members' liveness: which processes that contribute segments are alive, suspected (silent,
//! or their connection dropped) or gone — and what becomes of their segments, replicas and
//! the writes into them.
//!
//! A member is one engine incarnation. Suspected, its segments take no replica and no reader
//! is pointed at them, but their objects are kept: the same incarnation heard again within
//! [`MasterPolicy::suspect_grace`](crate::config::MasterPolicy::suspect_grace) keeps its
//! data. Past that, or as soon as another incarnation shows up at its address or under a
//! segment name of its, it is gone: its segments and their replicas are forgotten, and a
//! write into them ends with [`StoreErrorKind::ReplicaLost`].

use std::time::Instant;

use crate::error::StoreErrorKind;
use crate::master::core::{MasterAction, MasterCore};
use crate::master::objects::Replica;
use crate::master::segments::{ClientId, Member, SegmentId};

impl MasterCore {
    /// A frame from `client` arrived: a suspected member is alive again, with its data.
    pub fn heard(&mut self, client: ClientId, now: Instant) {
        let Some(member) = self.members.get_mut(&client) else {
            return;
        };
        member.last_heard = now;
        if member.suspected_since.take().is_some() {
            for segment in self.segments.owned_by(client) {
                if let Some(segment) = self.segments.get_mut(segment) {
                    segment.suspected_since = None;
                    segment.unconfirmed = false;
                }
            }
        }
    }

    /// `client`'s connection dropped (its process may have died: a reset arrives at once):
    /// suspected now, not after the silence bound.
    pub fn disconnected(&mut self, client: ClientId, now: Instant) {
        self.suspect(client, now);
    }

    /// Declares gone whoever `owner` replaces: the owner of a segment at the same handshake
    /// address `addr` (a process that took over a dead one's port), or a suspected owner of
    /// a segment named `name`. Returns whether one was.
    pub(super) fn replace_members(&mut self, owner: ClientId, addr: &str, name: &str) -> bool {
        let mut replaced: Vec<ClientId> = self
            .segments
            .iter()
            .filter(|(_, segment)| segment.owner != owner)
            .filter(|(_, segment)| {
                segment.spec.handshake_addr == addr
                    || (segment.spec.name == name && segment.suspected_since.is_some())
            })
            .map(|(_, segment)| segment.owner)
            .collect();
        replaced.sort_unstable();
        replaced.dedup();
        for &gone in &replaced {
            self.lose_member(gone);
        }
        !replaced.is_empty()
    }

    /// Starts tracking `owner`'s liveness (it mounted a segment).
    pub(super) fn track_member(&mut self, owner: ClientId, now: Instant) {
        self.members.entry(owner).or_insert(Member {
            last_heard: now,
            suspected_since: None,
        });
    }

    /// Timers: a member silent for the silence bound is suspected; one suspected for the
    /// grace period is gone.
    pub(super) fn check_members(&mut self, now: Instant) {
        let mut silent = Vec::new();
        let mut gone = Vec::new();
        for (&client, member) in &self.members {
            match member.suspected_since {
                Some(since)
                    if now.saturating_duration_since(since) >= self.policy.suspect_grace =>
                {
                    gone.push(client);
                }
                Some(_) => {}
                None if now.saturating_duration_since(member.last_heard)
                    >= self.policy.member_silence =>
                {
                    silent.push(client);
                }
                None => {}
            }
        }
        for client in silent {
            self.suspect(client, now);
        }
        for client in gone {
            self.lose_member(client);
        }
    }

    fn suspect(&mut self, client: ClientId, now: Instant) {
        let Some(member) = self.members.get_mut(&client) else {
            return;
        };
        if member.suspected_since.is_some() {
            return;
        }
        member.suspected_since = Some(now);
        self.counters.members_suspected += 1;
        for segment in self.segments.owned_by(client) {
            if let Some(segment) = self.segments.get_mut(segment) {
                segment.suspected_since = Some(now);
            }
        }
    }

    /// `client` is gone: every segment of it is lost. Each is reported unmounted to it, in
    /// case it is alive after all (stopped past the grace, its connection still open): it
    /// learns its memory is no longer the store's.
    fn lose_member(&mut self, client: ClientId) {
        self.members.remove(&client);
        self.counters.members_lost += 1;
        for segment in self.segments.owned_by(client) {
            self.lose_segment(segment);
            self.push_action(MasterAction::Unmounted {
                segment,
                owner: client,
            });
        }
        self.push_action(MasterAction::MemberGone { client });
    }

    /// Forgets `segment` and every replica in it (its memory is gone with its process): an
    /// object left with no replica is gone, a write with a replica in it ends with
    /// [`StoreErrorKind::ReplicaLost`] (its other replicas fenced as for any abandoned write).
    fn lose_segment(&mut self, segment: SegmentId) {
        let Some(lost) = self.segments.remove(segment) else {
            return;
        };
        self.touched_segment(segment);
        self.drop_fences_of(segment);
        self.retired
            .retain(|(_, replica)| replica.segment != segment);
        let on = |replicas: &[Replica]| replicas.iter().any(|r| r.segment == segment);
        let affected: Vec<String> = self
            .objects
            .iter()
            .filter(|(_, object)| {
                object.complete.as_ref().is_some_and(|v| on(&v.replicas))
                    || object
                        .write
                        .as_ref()
                        .is_some_and(|w| on(&w.version.replicas))
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in affected {
            self.touched(&key);
            let Some(object) = self.objects.get_mut(&key) else {
                continue;
            };
            if let Some(write) = object.write.take_if(|w| on(&w.version.replicas)) {
                self.end_write(
                    write,
                    StoreErrorKind::ReplicaLost {
                        segment: lost.spec.name.clone(),
                    },
                );
            }
            let Some(object) = self.objects.get_mut(&key) else {
                continue;
            };
            if let Some(version) = object.complete.as_mut() {
                version.replicas.retain(|r| r.segment != segment);
                if version.replicas.is_empty() {
                    object.complete = None;
                }
            }
            if object.complete.is_none() && object.write.is_none() {
                self.objects.remove(&key);
            }
        }
    }
}
