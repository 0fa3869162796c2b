//! What a store client has in flight towards its segments' owners, by connection to the
//! master, and whether it may tell a master it attaches to that nothing of it can land any
//! more (`Quiesced`, which lets that master reuse the space earlier masters gave it without
//! waiting for every owner to fence it). The client keeps one behind a lock; the
//! simulation (`crate::sim`) keeps one per simulated client, so both decide by this code.

/// Writes in flight and the connection to the master they are placed through.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    /// Writes whose transfers may be in flight.
    writes: usize,
    /// The connection to the master writes are placed through now, numbered.
    generation: u64,
    /// The connection a write whose transfers never resolved was placed through (the
    /// first such).
    unresolved_in: Option<u64>,
}

impl InFlight {
    /// The connection writes are placed through now.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Writes whose transfers may be in flight.
    pub(crate) fn writes(&self) -> usize {
        self.writes
    }

    /// Counts a write placed through connection `generation` as in flight; `false` (and
    /// nothing counted) when that connection was left: its master may be gone, so nothing
    /// it placed may be submitted any more.
    pub(crate) fn start_write(&mut self, generation: u64) -> bool {
        if generation != self.generation {
            return false;
        }
        self.writes += 1;
        true
    }

    /// A write's transfers resolved, or never will be known to: it is not in flight.
    pub(crate) fn end_write(&mut self) {
        self.writes = self.writes.saturating_sub(1);
    }

    /// A write placed through connection `generation` did not resolve: its transfers may
    /// land until its owner fences this process.
    pub(crate) fn unresolved(&mut self, generation: u64) {
        self.unresolved_in.get_or_insert(generation);
    }

    /// Leaves the connection writes were placed through for a new one; returns the new
    /// one's number.
    pub(crate) fn leave(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    /// Whether nothing this process ever placed can land any more: no write in flight,
    /// and none that never resolved. An unresolved write may land until its owner fences
    /// this process, which only the owner knows: a master that ran meanwhile may have
    /// fenced it, but one this process merely reconnected to did not, so such a process
    /// never says it is quiesced again, and its owners fence it after every failover.
    pub(crate) fn quiesced(&self) -> bool {
        self.writes == 0 && self.unresolved_in.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::InFlight;

    #[test]
    fn a_write_in_flight_holds_quiesced_back_until_it_resolves() {
        let mut state = InFlight::default();
        assert!(state.quiesced());
        assert!(state.start_write(0));
        let next = state.leave();
        assert!(!state.start_write(0), "its connection was left");
        assert!(!state.quiesced());
        state.end_write();
        assert!(state.quiesced());
        assert!(state.start_write(next));
    }

    /// A write left unresolved on one connection, then a reconnect to the same master
    /// (which fenced nothing), then a failover: the write may still land, so the new
    /// master must not be told this process is quiesced.
    #[test]
    fn an_unresolved_write_keeps_quiesced_back_across_every_later_connection() {
        let mut state = InFlight::default();
        assert!(state.start_write(0));
        state.unresolved(0);
        state.end_write();
        state.leave();
        assert!(!state.quiesced(), "the reconnect");
        state.leave();
        assert!(!state.quiesced(), "the failover after it");
    }
}
