//! Writes: `put` and its forms (plain bytes through the bounce buffer, registered ranges,
//! batches, scatter-gather, upserts) — placed by the master, moved to every replica, then
//! ended or revoked, and placed again on live segments when a holder died.

use super::*;

impl Store {
    /// Stores `value` under `key` (a new key: an existing one answers
    /// [`StoreErrorKind::AlreadyExists`]).
    pub fn put(&self, key: &str, value: &[u8], config: &ReplicaConfig) -> Result<(), StoreError> {
        self.put_parts(key, &[value], config)
    }

    /// Stores the concatenation of `parts` under `key`.
    pub fn put_parts(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        self.put_bytes(key, parts, config, false)
    }

    /// Stores `value` under `key`, replacing a complete object of that key (readers see the
    /// old value until the new one is complete).
    pub fn upsert(
        &self,
        key: &str,
        value: &[u8],
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        self.put_bytes(key, &[value], config, true)
    }

    /// Stores the bytes of registered memory `range` under `key`, zero-copy.
    pub fn put_from(
        &self,
        key: &str,
        range: LocalRange,
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        one(key, self.batch_put_from(&[key], &[range], config))
    }

    /// [`Self::put_from`] for each key: one result per key.
    pub fn batch_put_from<K: AsRef<str>>(
        &self,
        keys: &[K],
        ranges: &[LocalRange],
        config: &ReplicaConfig,
    ) -> Vec<Result<(), StoreError>> {
        written(self.batch_put_from_counted(keys, ranges, config))
    }

    /// [`Self::batch_put_from`], each result the number of replicas written:
    /// `config.replica_num`, or fewer (at least one) with
    /// [`ReplicaConfig::best_effort`] when fewer segments could take one.
    pub fn batch_put_from_counted<K: AsRef<str>>(
        &self,
        keys: &[K],
        ranges: &[LocalRange],
        config: &ReplicaConfig,
    ) -> Vec<Result<usize, StoreError>> {
        let parts: Vec<Vec<LocalRange>> = ranges.iter().map(|range| vec![*range]).collect();
        self.put_ranges(keys, &parts, config, false)
    }

    /// Stores, for each key, the concatenation of its ranges (scatter-gather): one result
    /// per key.
    pub fn batch_put_from_multi<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
        config: &ReplicaConfig,
    ) -> Vec<Result<(), StoreError>> {
        written(self.put_ranges(keys, parts, config, false))
    }

    /// [`Self::put_from`], replacing a complete object of that key.
    pub fn upsert_from(
        &self,
        key: &str,
        range: LocalRange,
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        one(
            key,
            written(self.put_ranges(&[key], &[vec![range]], config, true)),
        )
    }

    /// Writes plain bytes through the bounce buffer, a chunk at a time.
    pub(super) fn put_bytes(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicaConfig,
        upsert: bool,
    ) -> Result<(), StoreError> {
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut attempt = 1;
        loop {
            match self.put_bytes_once(key, parts, config, upsert, deadline) {
                Err((error, true)) if attempt < PUT_ATTEMPTS && Instant::now() < deadline => {
                    tracing::debug!(key, %error, attempt, "store: writing again on live segments");
                    attempt += 1;
                }
                result => return result.map_err(|(error, _)| error),
            }
        }
    }

    /// One try of [`Self::put_bytes`]; a failure says whether writing again may work.
    pub(super) fn put_bytes_once(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicaConfig,
        upsert: bool,
        deadline: Instant,
    ) -> Result<(), (StoreError, bool)> {
        let size: u64 = parts.iter().map(|part| part.len() as u64).sum();
        let sent = Instant::now();
        let (mut tickets, generation) = self.start(
            &[PutItem {
                key: key.to_owned(),
                size,
            }],
            config,
            upsert,
            deadline,
        );
        let ticket = tickets.remove(0).map_err(|error| (error, false))?;
        let expires = submit_by(sent, &ticket);
        let Some(writing) = self.inner.writing(generation) else {
            return Err((StoreError::new(key, StoreErrorKind::MasterChanged), true));
        };
        let mut written = 0u64;
        let mut outcome: Result<(), MoveFailure> = Ok(());
        let mut sources = parts.iter().flat_map(|part| part.iter().copied());
        while written < size && outcome.is_ok() {
            let mut chunk = self.inner.staging.chunk(size - written);
            let len = chunk.len.min(size - written);
            for (slot, byte) in chunk.bytes()[..len as usize]
                .iter_mut()
                .zip(sources.by_ref())
            {
                *slot = byte;
            }
            let source = LocalRange {
                region: self.inner.staging.region(),
                offset: chunk.offset,
                len,
            };
            let writes: Vec<(usize, Transfer, &ReplicaDescriptor)> = ticket
                .replicas
                .iter()
                .map(|replica| {
                    (
                        0,
                        Transfer {
                            op: Op::Write,
                            local: source.region,
                            local_offset: source.offset,
                            remote_addr: replica.addr + written,
                            len,
                        },
                        replica,
                    )
                })
                .collect();
            outcome = if Instant::now() < expires {
                self.move_bytes(writes, 1, deadline).remove(0)
            } else {
                Err(MoveFailure::expired())
            };
            written += len;
        }
        if matches!(&outcome, Err(failure) if failure.unresolved) {
            self.inner.unresolved(generation);
        }
        // Its transfers are done with: ending it may attach again, which waits for none of
        // them.
        drop(writing);
        self.finish(vec![(key.to_owned(), ticket.put, outcome)])
            .remove(0)
    }

    pub(super) fn put_ranges<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
        config: &ReplicaConfig,
        upsert: bool,
    ) -> Vec<Result<usize, StoreError>> {
        if keys.len() != parts.len() {
            return keys
                .iter()
                .map(|key| {
                    Err(StoreError::new(
                        key.as_ref(),
                        StoreErrorKind::InvalidArgument {
                            detail: format!("{} keys and {} values", keys.len(), parts.len()),
                        },
                    ))
                })
                .collect();
        }
        let mut results: Vec<Option<Result<usize, StoreError>>> = vec![None; keys.len()];
        let mut items = Vec::new();
        let mut asked = Vec::new();
        for (index, (key, ranges)) in keys.iter().zip(parts).enumerate() {
            match self.check_ranges(key.as_ref(), ranges) {
                Ok(size) => {
                    items.push(PutItem {
                        key: key.as_ref().to_owned(),
                        size,
                    });
                    asked.push(index);
                }
                Err(error) => results[index] = Some(Err(error)),
            }
        }
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut attempt = 1;
        while !asked.is_empty() {
            let round = self.put_round(keys, parts, &asked, &items, config, upsert, deadline);
            let mut again = Vec::new();
            for ((index, item), result) in asked.into_iter().zip(items).zip(round) {
                match result {
                    Err((error, true)) if attempt < PUT_ATTEMPTS && Instant::now() < deadline => {
                        tracing::debug!(key = item.key, %error, attempt, "store: writing again on live segments");
                        again.push((index, item));
                    }
                    result => results[index] = Some(result.map_err(|(error, _)| error)),
                }
            }
            (asked, items) = again.into_iter().unzip();
            attempt += 1;
        }
        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| Err(StoreError::new("", StoreErrorKind::NotFound)))
            })
            .collect()
    }

    /// One try of writing `items` (the values of `keys[asked[i]]` in `parts`): placed,
    /// moved, ended or revoked. A failure says whether writing again may work.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn put_round<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
        asked: &[usize],
        items: &[PutItem],
        config: &ReplicaConfig,
        upsert: bool,
        deadline: Instant,
    ) -> Vec<Result<usize, (StoreError, bool)>> {
        let mut results: Vec<Option<Result<usize, (StoreError, bool)>>> = vec![None; asked.len()];
        let sent = Instant::now();
        let (tickets, generation) = self.start(items, config, upsert, deadline);
        let mut writes = Vec::new();
        let mut started = Vec::new();
        for (slot, ticket) in tickets.into_iter().enumerate() {
            let index = asked[slot];
            match ticket {
                Ok(ticket) => {
                    let item = started.len();
                    let mut at = 0;
                    // An empty part moves nothing (and a transfer of 0 bytes is refused).
                    for range in parts[index].iter().filter(|range| range.len > 0) {
                        for replica in &ticket.replicas {
                            writes.push((
                                item,
                                Transfer {
                                    op: Op::Write,
                                    local: range.region,
                                    local_offset: range.offset,
                                    remote_addr: replica.addr + at,
                                    len: range.len,
                                },
                                replica.clone(),
                            ));
                        }
                        at += range.len;
                    }
                    started.push((slot, ticket));
                }
                Err(error) => results[slot] = Some(Err((error, false))),
            }
        }
        let borrowed: Vec<(usize, Transfer, &ReplicaDescriptor)> = writes
            .iter()
            .map(|(item, transfer, replica)| (*item, *transfer, replica))
            .collect();
        // Every write goes out before the earliest of their expiries, or none does.
        let expires = started
            .iter()
            .map(|(_, ticket)| submit_by(sent, ticket))
            .min();
        let writing = self.inner.writing(generation);
        let outcomes = if writing.is_none() {
            // Placed by a master this store left: nothing of it is submitted.
            vec![Err(MoveFailure::master_changed()); started.len()]
        } else if expires.is_none_or(|expires| Instant::now() < expires) {
            self.move_bytes(borrowed, started.len(), deadline)
        } else {
            vec![Err(MoveFailure::expired()); started.len()]
        };
        if outcomes
            .iter()
            .any(|outcome| matches!(outcome, Err(failure) if failure.unresolved))
        {
            self.inner.unresolved(generation);
        }
        drop(writing);
        let finished = self.finish(
            started
                .iter()
                .zip(outcomes)
                .map(|((slot, ticket), outcome)| {
                    (keys[asked[*slot]].as_ref().to_owned(), ticket.put, outcome)
                })
                .collect(),
        );
        for ((slot, ticket), result) in started.iter().zip(finished) {
            results[*slot] = Some(result.map(|()| ticket.replicas.len()));
        }
        results
            .into_iter()
            .map(|result| {
                result
                    .unwrap_or_else(|| Err((StoreError::new("", StoreErrorKind::NotFound), false)))
            })
            .collect()
    }

    /// Checks that every range lies in its region; returns the value's size.
    pub(super) fn check_ranges(&self, key: &str, ranges: &[LocalRange]) -> Result<u64, StoreError> {
        let mut size = 0u64;
        for range in ranges {
            let inside = range
                .offset
                .checked_add(range.len)
                .is_some_and(|end| end <= range.region.len);
            let registered = self
                .inner
                .engine
                .region_at(range.region.addr, range.region.len)
                .is_some_and(|region| region.id == range.region.id);
            let mounted = lock(&self.inner.mounted)
                .values()
                .any(|(segment, _)| segment.id == range.region.id);
            if mounted {
                return Err(StoreError::new(
                    key,
                    StoreErrorKind::InvalidArgument {
                        detail:
                            "a range in a segment this process mounted: that memory is the store's"
                                .into(),
                    },
                ));
            }
            if !inside || !registered {
                return Err(StoreError::new(
                    key,
                    StoreErrorKind::InvalidArgument {
                        detail: format!(
                            "{} bytes at offset {} of a region of {} bytes{}",
                            range.len,
                            range.offset,
                            range.region.len,
                            if registered {
                                ""
                            } else {
                                " not registered with the engine"
                            }
                        ),
                    },
                ));
            }
            size += range.len;
        }
        Ok(size)
    }

    /// Put-start for each item (one request), with the generation of the connection that
    /// placed them. Right after a failover, while no segment takes writes yet (every item
    /// answered [`StoreErrorKind::SegmentsNotReady`]), asks again until `deadline`.
    pub(super) fn start(
        &self,
        items: &[PutItem],
        config: &ReplicaConfig,
        upsert: bool,
        deadline: Instant,
    ) -> (Vec<Result<PutTicket, StoreError>>, u64) {
        loop {
            let (tickets, generation) = self.start_once(items, config, upsert);
            let not_ready = !tickets.is_empty()
                && tickets.iter().all(|ticket| {
                    matches!(ticket, Err(error) if matches!(error.kind, StoreErrorKind::SegmentsNotReady { .. }))
                });
            if !not_ready || Instant::now() + READY_POLL >= deadline {
                return (tickets, generation);
            }
            thread::sleep(READY_POLL);
        }
    }

    /// One put-start request for `items`.
    pub(super) fn start_once(
        &self,
        items: &[PutItem],
        config: &ReplicaConfig,
        upsert: bool,
    ) -> (Vec<Result<PutTicket, StoreError>>, u64) {
        if items.is_empty() {
            return (Vec::new(), 0);
        }
        let request = Request::PutStart {
            items: items.to_vec(),
            config: config.clone(),
            upsert,
            avoid: self.quarantined(),
        };
        let keys = || items.iter().map(|item| item.key.as_str());
        match self.inner.call_timed(request) {
            Ok((Reply::Tickets(tickets), _, generation)) if tickets.len() == items.len() => {
                (tickets, generation)
            }
            Ok((other, _, _)) => (each_failed(keys(), &unexpected(&other)), 0),
            Err(kind) => (each_failed(keys(), &StoreError::new("", kind)), 0),
        }
    }

    /// Put-end for the writes that moved, put-revoke for those that failed (their transfers
    /// all resolved). A write whose transfers did not resolve is left to the put timeout
    /// and its fence. A failure says whether writing again (placed anew) may work: a
    /// revoked write's transfers failed, or put-end found a replica's segment gone.
    pub(super) fn finish(
        &self,
        writes: Vec<(String, PutId, Result<(), MoveFailure>)>,
    ) -> Vec<Result<(), (StoreError, bool)>> {
        let mut ends = Vec::new();
        let mut revokes = Vec::new();
        let mut results: Vec<Option<Result<(), (StoreError, bool)>>> = Vec::new();
        for (index, (key, put, outcome)) in writes.iter().enumerate() {
            match outcome {
                Ok(()) => {
                    ends.push((index, (key.clone(), *put)));
                    results.push(None);
                }
                Err(failure) => {
                    let retryable = !failure.unresolved && !failure.expired;
                    if !failure.unresolved {
                        revokes.push((key.clone(), *put));
                    }
                    results.push(Some(Err((
                        StoreError::new(
                            key,
                            StoreErrorKind::TransferFailed {
                                detail: failure.detail.clone(),
                            },
                        ),
                        retryable,
                    ))));
                }
            }
        }
        if !revokes.is_empty() {
            // Best effort: a revoke that does not reach the master leaves the space to the
            // put timeout.
            let _ = self.call(Request::PutRevoke { items: revokes });
        }
        if !ends.is_empty() {
            let request = Request::PutEnd {
                items: ends.iter().map(|(_, item)| item.clone()).collect(),
            };
            let answers = match self.call(request) {
                Ok(Reply::Each(answers)) if answers.len() == ends.len() => answers,
                Ok(other) => ends
                    .iter()
                    .map(|(_, (key, _))| Err(rekey(key, unexpected(&other))))
                    .collect(),
                Err(error) => ends
                    .iter()
                    .map(|(_, (key, _))| Err(rekey(key, error.clone())))
                    .collect(),
            };
            for ((index, _), answer) in ends.iter().zip(answers) {
                results[*index] = Some(answer.map_err(|error| {
                    let retryable = matches!(
                        error.kind,
                        StoreErrorKind::ReplicaLost { .. } | StoreErrorKind::MasterChanged
                    );
                    (error, retryable)
                }));
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Ok(())))
            .collect()
    }
}
