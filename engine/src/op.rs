//! The direction of a transfer, and its place in the per-op counters and metric labels.

/// The direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Local range → remote range.
    Write,
    /// Remote range → local range.
    Read,
}

impl Op {
    /// Both ops, in the order of [`Self::index`].
    pub const ALL: [Op; 2] = [Op::Write, Op::Read];

    /// Its position in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// `write` or `read` (the `op` label of the metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}
