//! Connected queue pairs on their way from the control plane to a rail's poller: the
//! control thread stages one for an endpoint at an epoch, and the poller's
//! [`Fabric::connect`](super::Fabric::connect) for exactly that endpoint and epoch takes
//! it. One slot per endpoint; staging again replaces what was there.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::FabricError;
use crate::{EndpointId, Epoch};

/// Staged queue pairs of one rail.
#[derive(Debug)]
pub(crate) struct Staging<Q>(Mutex<HashMap<EndpointId, (Epoch, Q)>>);

impl<Q> Default for Staging<Q> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<Q> Staging<Q> {
    fn slots(&self) -> MutexGuard<'_, HashMap<EndpointId, (Epoch, Q)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stages `qp` for `endpoint` at `epoch`, dropping one staged earlier for the endpoint.
    pub(crate) fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: Q) {
        self.slots().insert(endpoint, (epoch, qp));
    }

    /// Whether a queue pair is staged for `endpoint` at exactly `epoch`.
    pub(crate) fn is_staged(&self, endpoint: EndpointId, epoch: Epoch) -> bool {
        self.slots()
            .get(&endpoint)
            .is_some_and(|(staged, _)| *staged == epoch)
    }

    /// Takes the queue pair staged for `endpoint` at `epoch`; otherwise says which epoch is
    /// staged for the endpoint, if any (and leaves it staged).
    pub(crate) fn take(&self, endpoint: EndpointId, epoch: Epoch) -> Result<Q, Option<Epoch>> {
        let mut slots = self.slots();
        match slots.remove(&endpoint) {
            Some((staged, qp)) if staged == epoch => Ok(qp),
            Some((staged, qp)) => {
                slots.insert(endpoint, (staged, qp));
                Err(Some(staged))
            }
            None => Err(None),
        }
    }

    /// [`Self::take`] for a poller's `connect` on rail `rail`: a miss is the
    /// [`FabricError::Connect`] that says what is staged instead.
    pub(crate) fn take_for_connect(
        &self,
        endpoint: EndpointId,
        epoch: Epoch,
        rail: &str,
    ) -> Result<Q, FabricError> {
        self.take(endpoint, epoch)
            .map_err(|staged| FabricError::Connect {
                endpoint,
                epoch,
                reason: format!(
                    "no connected queue pair is staged on {rail} at {epoch}{}",
                    staged.map_or(String::new(), |other| format!(
                        " (one is staged at {other})"
                    ))
                ),
            })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn only_the_staged_epoch_is_taken_and_a_miss_says_what_is_staged() {
        let staging = Staging::default();
        staging.stage(EndpointId(1), Epoch::FIRST.next(), "qp-a");
        assert!(staging.is_staged(EndpointId(1), Epoch::FIRST.next()));
        assert!(!staging.is_staged(EndpointId(1), Epoch::FIRST));
        assert_eq!(
            staging.take(EndpointId(1), Epoch::FIRST),
            Err(Some(Epoch::FIRST.next()))
        );
        let error = staging
            .take_for_connect(EndpointId(2), Epoch::FIRST, "rail0")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("no connected queue pair is staged on rail0"),
            "{error}"
        );
        staging.stage(EndpointId(1), Epoch::FIRST.next().next(), "qp-b");
        assert_eq!(
            staging.take(EndpointId(1), Epoch::FIRST.next().next()),
            Ok("qp-b")
        );
        assert_eq!(
            staging.take(EndpointId(1), Epoch::FIRST.next().next()),
            Err(None)
        );
    }
}
