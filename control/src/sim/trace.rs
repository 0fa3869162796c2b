//! The run's trace: every event folded into one hash (FNV-1a over its fields), and, when
//! asked for, kept as a line.

use std::time::Duration;

/// The trace of one run.
pub(super) struct Trace {
    hash: u64,
    lines: Option<Vec<String>>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl Trace {
    pub(super) fn new(record: bool) -> Self {
        Self {
            hash: FNV_OFFSET,
            lines: record.then(Vec::new),
        }
    }

    fn fold(&mut self, value: u64) {
        for byte in value.to_le_bytes() {
            self.hash ^= u64::from(byte);
            self.hash = self.hash.wrapping_mul(FNV_PRIME);
        }
    }

    /// Records event `what` at `at` (µs) on process `node` with `fields`; `line` renders it
    /// only when lines are kept.
    pub(super) fn event(
        &mut self,
        at: u64,
        node: usize,
        what: &'static str,
        fields: &[u64],
        line: impl FnOnce() -> String,
    ) {
        self.fold(at);
        self.fold(node as u64);
        for byte in what.bytes() {
            self.fold(u64::from(byte));
        }
        for &field in fields {
            self.fold(field);
        }
        if let Some(lines) = &mut self.lines {
            let at = Duration::from_micros(at);
            lines.push(format!("{at:>12.6?} p{node:<5} {what:<14} {}", line()));
        }
    }

    pub(super) fn hash(&self) -> u64 {
        self.hash
    }

    pub(super) fn take_lines(&mut self) -> Vec<String> {
        self.lines.take().unwrap_or_default()
    }
}
