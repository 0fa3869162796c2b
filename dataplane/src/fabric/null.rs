//! A fabric that completes every work request successfully at once, moving no bytes: the
//! ceiling of the slice path, for benchmarks.

use std::collections::VecDeque;

use super::{Fabric, FabricError, PostError, QpNum, WcStatus, WorkCompletion, WorkRequest};
use crate::{EndpointId, Epoch};

/// Completes everything at once. Retiring a queue pair has nothing to flush.
#[derive(Debug, Default)]
pub struct NullFabric {
    next_qp: u32,
    completions: VecDeque<WorkCompletion>,
}

impl NullFabric {
    /// A null fabric.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Fabric for NullFabric {
    fn connect(&mut self, _endpoint: EndpointId, _epoch: Epoch) -> Result<QpNum, FabricError> {
        self.next_qp += 1;
        Ok(QpNum(self.next_qp))
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        self.completions.extend(
            requests
                .iter()
                .filter(|wr| wr.signaled)
                .map(|wr| WorkCompletion::of(wr, qp, WcStatus::Success)),
        );
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let count = max.min(self.completions.len());
        out.extend(self.completions.drain(..count));
        count
    }

    fn retire(&mut self, _qp: QpNum) {}

    /// It touches no memory.
    fn abandon(&mut self, _qp: QpNum) -> bool {
        true
    }
}
