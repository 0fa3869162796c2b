//! Reads: `get` and its forms — a lease on the replicas, best first, and each failed read
//! moved to the next replica (and through them again while a failure was not a holder's
//! death), every lease checked to outlive its transfer.

use super::*;

impl Store {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let lease = self.lease(&[key]).remove(0)?;
        let size = lease.0.size;
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut value = Vec::with_capacity(size as usize);
        while (value.len() as u64) < size {
            let at = value.len() as u64;
            let mut chunk = self.inner.staging.chunk(size - at);
            let len = chunk.len.min(size - at);
            let target = LocalRange {
                region: self.inner.staging.region(),
                offset: chunk.offset,
                len,
            };
            self.read_replica(key, &lease, &[target], at, deadline)?;
            value.extend_from_slice(&chunk.bytes()[..len as usize]);
        }
        Ok(value)
    }

    /// Reads the value of `key` into registered memory `range`, zero-copy; returns its size.
    pub fn get_into(&self, key: &str, range: LocalRange) -> Result<u64, StoreError> {
        one(key, self.batch_get_into(&[key], &[range]))
    }

    /// [`Self::get_into`] for each key: one result per key.
    pub fn batch_get_into<K: AsRef<str>>(
        &self,
        keys: &[K],
        ranges: &[LocalRange],
    ) -> Vec<Result<u64, StoreError>> {
        let parts: Vec<Vec<LocalRange>> = ranges.iter().map(|range| vec![*range]).collect();
        self.batch_get_into_multi(keys, &parts)
    }

    /// Reads each key's value into its ranges, in order (scatter-gather): one result per
    /// key, its size.
    pub fn batch_get_into_multi<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
    ) -> Vec<Result<u64, StoreError>> {
        if keys.len() != parts.len() {
            return keys
                .iter()
                .map(|key| {
                    Err(StoreError::new(
                        key.as_ref(),
                        StoreErrorKind::InvalidArgument {
                            detail: format!("{} keys and {} buffers", keys.len(), parts.len()),
                        },
                    ))
                })
                .collect();
        }
        let mut results: Vec<Result<u64, StoreError>> = Vec::with_capacity(keys.len());
        let mut wanted = Vec::new();
        for (key, ranges) in keys.iter().zip(parts) {
            match self.check_ranges(key.as_ref(), ranges) {
                Ok(_) => {
                    wanted.push(key.as_ref());
                    results.push(Ok(0));
                }
                Err(error) => results.push(Err(error)),
            }
        }
        let leases = self.lease(&wanted);
        let mut leases = leases.iter();
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut reads: Vec<Read<'_>> = Vec::new();
        let mut read_of: Vec<(usize, u64)> = Vec::new();
        for (index, (key, ranges)) in keys.iter().zip(parts).enumerate() {
            if results[index].is_err() {
                continue;
            }
            let lease = match leases.next() {
                Some(Ok(lease)) => lease,
                Some(Err(error)) => {
                    results[index] = Err(error.clone());
                    continue;
                }
                None => continue,
            };
            let size = lease.0.size;
            let room: u64 = ranges.iter().map(|range| range.len).sum();
            if room < size {
                results[index] = Err(StoreError::new(
                    key.as_ref(),
                    StoreErrorKind::InvalidArgument {
                        detail: format!("a buffer of {room} bytes for a value of {size}"),
                    },
                ));
                continue;
            }
            reads.push(Read {
                key: key.as_ref(),
                lease,
                targets: ranges,
                at: 0,
            });
            read_of.push((index, size));
        }
        for ((index, size), read) in read_of.into_iter().zip(self.read_many(&reads, deadline)) {
            results[index] = read.map(|()| size);
        }
        results
    }

    /// Get for each key (one request): a lease on its replicas, best first.
    pub(super) fn lease(&self, keys: &[&str]) -> Vec<Result<(WireLease, Instant), StoreError>> {
        if keys.is_empty() {
            return Vec::new();
        }
        let request = Request::Get {
            keys: keys.iter().map(|key| (*key).to_owned()).collect(),
        };
        let answer = self
            .inner
            .call_timed(request)
            .map_err(|kind| StoreError::new("", kind));
        let (leases, asked) = match answer {
            Ok((Reply::Leases(leases), asked, _)) if leases.len() == keys.len() => (leases, asked),
            Ok((other, _, _)) => return each_failed(keys.iter().copied(), &unexpected(&other)),
            Err(error) => return each_failed(keys.iter().copied(), &error),
        };
        leases
            .into_iter()
            .map(|lease| {
                lease.map(|mut lease| {
                    self.rank(&mut lease.replicas);
                    // The lease counts from when the master answered, which is after the
                    // request left: measured from then, it ends no later than the master's.
                    let until = after(asked, lease.lease);
                    (lease, until)
                })
            })
            .collect()
    }

    /// Orders replicas best first: this process's own segment, then this host, then the rest,
    /// each group least loaded first.
    /// Holders this engine sees dead (its quarantine, kept by the engine's own liveness)
    /// go last, whatever the master still says.
    pub(super) fn rank(&self, replicas: &mut [ReplicaDescriptor]) {
        let own = self.inner.engine.addr().to_string();
        let quarantined = self.quarantined();
        replicas.sort_by_key(|replica| {
            let near = if replica.handshake_addr == own {
                0
            } else if replica.host == self.inner.host {
                1
            } else {
                2
            };
            (
                quarantined.contains(&replica.handshake_addr),
                near,
                replica.load,
            )
        });
    }

    /// Handshake addresses of holders this engine sees dead: their peer's circuit is open
    /// (it stopped answering or kept failing). A peer replaced by another incarnation is
    /// not one: its address now belongs to the newcomer, whose own segments are fine (the
    /// replicas of the one it replaced are refused by incarnation, see [`Self::peer`]).
    pub(super) fn quarantined(&self) -> Vec<String> {
        lock(&self.inner.peers)
            .iter()
            .filter(|(_, peer)| peer.is_unavailable() && !peer.is_retired())
            .map(|(addr, _)| addr.clone())
            .collect()
    }

    /// Reads `lease`'s value from `at` into `targets`, trying each replica in turn until one
    /// succeeds, and checks the lease outlived the transfer.
    pub(super) fn read_replica(
        &self,
        key: &str,
        lease: &(WireLease, Instant),
        targets: &[LocalRange],
        at: u64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let item = Read {
            key,
            lease,
            targets,
            at,
        };
        self.read_many(&[item], deadline).remove(0)
    }

    /// Reads every item at once — one batch per replica holder, not one round trip per key —
    /// moving each failed item to its next replica and trying again until every item has
    /// succeeded or run out of replicas; checks each lease outlived its transfer.
    pub(super) fn read_many(
        &self,
        items: &[Read<'_>],
        deadline: Instant,
    ) -> Vec<Result<(), StoreError>> {
        let mut results: Vec<Option<Result<(), StoreError>>> = vec![None; items.len()];
        let mut attempt = vec![0usize; items.len()];
        let mut last: Vec<String> = vec![String::from("no replica"); items.len()];
        // Whether every replica tried on this pass failed because its holder is gone.
        let mut all_gone = vec![true; items.len()];
        let mut passes = vec![1usize; items.len()];
        loop {
            let pending: Vec<usize> = (0..items.len()).filter(|&i| results[i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let mut reads: Vec<(usize, Transfer, &ReplicaDescriptor)> = Vec::new();
            for (slot, &i) in pending.iter().enumerate() {
                let Read {
                    lease, targets, at, ..
                } = &items[i];
                let (lease, _) = lease;
                let Some(replica) = lease.replicas.get(attempt[i]) else {
                    continue;
                };
                let mut from = *at;
                for target in targets.iter() {
                    let len = target.len.min(lease.size.saturating_sub(from));
                    if len > 0 {
                        reads.push((
                            slot,
                            Transfer {
                                op: Op::Read,
                                local: target.region,
                                local_offset: target.offset,
                                remote_addr: replica.addr + from,
                                len,
                            },
                            replica,
                        ));
                    }
                    from += len;
                }
            }
            let outcomes = self.move_bytes(reads, pending.len(), deadline);
            let mut pause = false;
            for (&i, outcome) in pending.iter().zip(outcomes) {
                let Read { key, lease, .. } = &items[i];
                let (lease, until) = lease;
                if attempt[i] >= lease.replicas.len() {
                    // Every replica failed, one at least for a reason of its own (errors on
                    // a rail, a circuit open on one rail of several): with time left, each
                    // is tried again — the engine routes around a rail that is down.
                    let time_left = Instant::now() + PASS_PAUSE < deadline.min(*until);
                    if !all_gone[i] && passes[i] < READ_PASSES && time_left {
                        passes[i] += 1;
                        attempt[i] = 0;
                        // Judged again on this pass alone: holders seen alive on the last one
                        // may have died since.
                        all_gone[i] = true;
                        pause = true;
                        continue;
                    }
                    // No replica left whose holder lives: the object is gone for readers (the
                    // master learns it within its silence bound), not a transfer failure.
                    let kind = if all_gone[i] {
                        StoreErrorKind::NotFound
                    } else {
                        StoreErrorKind::TransferFailed {
                            detail: last[i].clone(),
                        }
                    };
                    results[i] = Some(Err(StoreError::new(key, kind)));
                    continue;
                }
                results[i] = match outcome {
                    Ok(()) if Instant::now() <= *until => Some(Ok(())),
                    Ok(()) => Some(Err(StoreError::new(key, StoreErrorKind::LeaseExpired))),
                    Err(failure) => {
                        all_gone[i] &= failure.holder_gone;
                        last[i] = failure.detail;
                        attempt[i] += 1;
                        if sabotage::is_off(Protection::StoreReadFailover) {
                            attempt[i] = lease.replicas.len();
                            passes[i] = READ_PASSES;
                        }
                        None
                    }
                };
            }
            if pause {
                thread::sleep(PASS_PAUSE);
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Ok(())))
            .collect()
    }
}
