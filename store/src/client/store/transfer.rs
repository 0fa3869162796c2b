//! Moving bytes for reads and writes: one batch per replica holder through the engine (a
//! plain copy for this process's own segment), each holder's peer opened by incarnation,
//! and what a failure means (the holder gone, or the transfer only).

use super::*;

impl Store {
    pub(super) fn call(&self, request: Request) -> Result<Reply, StoreError> {
        self.inner
            .call(request)
            .map_err(|kind| StoreError::new("", kind))
    }

    /// Moves `transfers` (each tagged with the item it belongs to, `items` in all) to their
    /// replicas; returns each item's outcome once every transfer of it has resolved.
    pub(super) fn move_bytes(
        &self,
        transfers: Vec<(usize, Transfer, &ReplicaDescriptor)>,
        items: usize,
        deadline: Instant,
    ) -> Vec<Result<(), MoveFailure>> {
        let mut outcomes: Vec<Result<(), MoveFailure>> = vec![Ok(()); items];
        let own = self.inner.engine.addr().to_string();
        let me = ClientId(self.inner.engine.incarnation().0);
        let mut by_holder: HashMap<(&str, ClientId), Vec<(usize, Transfer)>> = HashMap::new();
        for (item, transfer, replica) in transfers {
            if replica.handshake_addr == own && replica.holder == me {
                if let Err(detail) = self.copy_locally(&transfer) {
                    outcomes[item] = Err(MoveFailure::failed(detail));
                }
                continue;
            }
            by_holder
                .entry((replica.handshake_addr.as_str(), replica.holder))
                .or_default()
                .push((item, transfer));
        }
        let mut submitter = match self.submitter() {
            Ok(submitter) => submitter,
            Err(detail) => return vec![Err(MoveFailure::failed(detail)); items],
        };
        let mut batches: Vec<(Batch, Peer)> = Vec::new();
        let mut pending: Vec<Pending> = Vec::new();
        for (&(addr, holder), group) in &by_holder {
            let submitted = self.peer(addr, holder).and_then(|peer| {
                let transfers: Vec<Transfer> =
                    group.iter().map(|(_, transfer)| *transfer).collect();
                submitter
                    .submit(&peer, &transfers)
                    .map(|batch| (batch, peer))
                    .map_err(|error| MoveFailure::failed(error.to_string()))
            });
            match submitted {
                Ok(batch) => {
                    for (request, (item, _)) in group.iter().enumerate() {
                        pending.push(Pending {
                            item: *item,
                            batch: batches.len(),
                            request,
                        });
                    }
                    batches.push(batch);
                }
                Err(failure) => {
                    for (item, _) in group {
                        outcomes[*item] = Err(MoveFailure {
                            detail: format!("{addr}: {}", failure.detail),
                            ..failure.clone()
                        });
                    }
                }
            }
        }
        lock(&self.inner.submitters).push(submitter);
        let mut resolved = vec![true; batches.len()];
        for (index, (batch, _)) in batches.iter().enumerate() {
            // The engine resolves every request by its own deadline; past ours, wait for that
            // too, so that "failed" always means "nothing of it moves any more".
            let status = batch.wait(deadline);
            if !status.is_complete() && !batch.wait(after(deadline, RESOLVE_GRACE)).is_complete() {
                resolved[index] = false;
            }
        }
        for Pending {
            item,
            batch,
            request,
        } in pending
        {
            if !resolved[batch] {
                outcomes[item] = Err(MoveFailure {
                    detail: format!(
                        "transfers not resolved within {RESOLVE_GRACE:?} after the deadline"
                    ),
                    holder_gone: false,
                    unresolved: true,
                    expired: false,
                });
                continue;
            }
            let (batch, peer) = &batches[batch];
            if let Some(RequestOutcome::Failed(reason)) = batch.outcome(request)
                && outcomes[item].is_ok()
            {
                // Gone means the peer as a whole: one rail's circuit open or endpoint retired
                // (its errors) while another rail carries traffic leaves that one.
                let holder_gone = matches!(
                    reason,
                    FailReason::PeerUnavailable | FailReason::EndpointRetired
                ) && !peer.is_up_on_a_rail();
                outcomes[item] = Err(MoveFailure {
                    detail: format!("{reason:?}"),
                    holder_gone,
                    unresolved: false,
                    expired: false,
                });
            }
        }
        outcomes
    }

    /// A transfer to a replica in this process's own segment: a plain copy.
    pub(super) fn copy_locally(&self, transfer: &Transfer) -> Result<(), String> {
        let mounted = lock(&self.inner.mounted);
        let Some(segment) = mounted
            .values()
            .map(|(region, _)| *region)
            .find(|region| region.contains(transfer.remote_addr, transfer.len))
        else {
            return Err(format!(
                "{:#x}: not in a segment this process mounted",
                transfer.remote_addr
            ));
        };
        // Both ranges must still be the engine's: a region deregistered behind the store's
        // back is memory it may no longer touch.
        for region in [segment, transfer.local] {
            let live = self
                .inner
                .engine
                .region_at(region.addr, region.len)
                .is_some_and(|live| live.id == region.id);
            if !live {
                return Err(format!(
                    "region {} ({:#x}, {} bytes) is no longer registered",
                    region.id, region.addr, region.len
                ));
            }
        }
        let local = transfer.local.addr + transfer.local_offset;
        let (from, to) = match transfer.op {
            Op::Write => (local, transfer.remote_addr),
            Op::Read => (transfer.remote_addr, local),
        };
        // SAFETY:
        // - Both ranges lie in regions registered with this process's engine, checked just
        //   above: the local one was checked against its region's bounds, the remote one lies
        //   in a mounted segment. The lock on `mounted` keeps the store's own unmount from
        //   deregistering the segment during the copy; `mount_region`'s contract keeps the
        //   caller from doing so while it is mounted.
        // - They do not overlap: a caller's range is never in a mounted segment
        //   (`check_ranges` refuses that), and registered regions never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, transfer.len as usize);
        }
        Ok(())
    }

    pub(super) fn submitter(&self) -> Result<EngineSubmitter, String> {
        if let Some(submitter) = lock(&self.inner.submitters).pop() {
            return Ok(submitter);
        }
        self.inner
            .engine
            .submitter()
            .map_err(|error| error.to_string())
    }

    /// The engine's peer at `addr` if it is `holder` (opened once, and again after it
    /// retired). Another incarnation answering there took a dead holder's port: its memory
    /// is not the replica's, and the holder is gone.
    pub(super) fn peer(&self, addr: &str, holder: ClientId) -> Result<Peer, MoveFailure> {
        let gone = |incarnation: Incarnation| {
            MoveFailure::holder_gone(format!(
                "incarnation {} answers at {addr}, not the holder {}: the holder is gone",
                incarnation.0, holder.0
            ))
        };
        // A peer of another incarnation is opened again: the one cached may be the dead
        // holder (not yet retired) that the holder asked for replaced.
        if let Some(peer) = lock(&self.inner.peers)
            .get(addr)
            .filter(|peer| !peer.is_retired() && peer.incarnation().0 == holder.0)
        {
            return Ok(peer.clone());
        }
        // Not opening is no proof the holder is gone (it may be slow, or refuse for a while):
        // only a dead peer's transfers or another incarnation's answer are.
        let peer = self
            .inner
            .engine
            .open(addr)
            .map_err(|error| MoveFailure::failed(error.to_string()))?;
        lock(&self.inner.peers).insert(addr.to_owned(), peer.clone());
        if peer.incarnation().0 != holder.0 {
            return Err(gone(peer.incarnation()));
        }
        Ok(peer)
    }
}
