//! Whether a verbs rail can carry work: a small state machine fed with what the device
//! reports outside the completion queue, and with completion-queue poll errors.
//!
//! - `IBV_EVENT_PORT_ERR`: the port's link went down. The rail is down until
//!   `IBV_EVENT_PORT_ACTIVE` says it is back; the device flushes the queue pairs itself.
//! - `IBV_EVENT_CQ_ERR`, an `ibv_poll_cq` error, `IBV_EVENT_DEVICE_FATAL`: the completion
//!   queue (or the device) is gone for good. Nothing more will complete on it, so what is
//!   outstanding must be handed back by the fabric itself; the rail stays down until the
//!   process opens it again.
//!
//! Down, the rail's fabric refuses new queue pairs (the endpoints on it back off and open
//! their circuits; the engine sends their peers' work to other rails) and reports each
//! change to its poller, which counts it.

/// What the device (or a poll) said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthInput {
    /// `IBV_EVENT_PORT_ERR`.
    PortError,
    /// `IBV_EVENT_PORT_ACTIVE`.
    PortActive,
    /// `IBV_EVENT_CQ_ERR`.
    CompletionQueueError,
    /// `ibv_poll_cq` failed with this errno.
    PollError(i32),
    /// `IBV_EVENT_DEVICE_FATAL`.
    DeviceFatal,
}

/// Where the rail stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RailState {
    /// Carrying work.
    Up,
    /// The port is down; it may come back.
    PortDown,
    /// The completion queue or the device failed: down until the rail is opened again.
    Failed(HealthInput),
}

/// A change the fabric acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// The rail went down; `lost_completions`: the completion queue will not hand back what
    /// is outstanding, so the fabric must.
    WentDown {
        /// Why, in words.
        reason: &'static str,
        /// The completion queue is gone with it.
        lost_completions: bool,
    },
    /// The port is back: new queue pairs may be made.
    CameBack,
}

/// The rail's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailHealth {
    state: RailState,
}

impl Default for RailHealth {
    fn default() -> Self {
        Self {
            state: RailState::Up,
        }
    }
}

impl RailHealth {
    /// Where it stands.
    pub fn state(&self) -> RailState {
        self.state
    }

    /// Whether it carries work.
    pub fn is_up(&self) -> bool {
        self.state == RailState::Up
    }

    /// Applies `input`; returns the change, if there is one.
    pub fn on(&mut self, input: HealthInput) -> Option<Transition> {
        let failed = |reason| Transition::WentDown {
            reason,
            lost_completions: true,
        };
        let (next, transition) = match (self.state, input) {
            (RailState::Failed(_), _) => return None,
            (RailState::Up, HealthInput::PortError) => (
                RailState::PortDown,
                Some(Transition::WentDown {
                    reason: "the port's link went down",
                    lost_completions: false,
                }),
            ),
            (RailState::PortDown, HealthInput::PortActive) => {
                (RailState::Up, Some(Transition::CameBack))
            }
            (_, HealthInput::PortError | HealthInput::PortActive) => return None,
            (_, HealthInput::CompletionQueueError) => (
                RailState::Failed(input),
                Some(failed("the completion queue overran or failed")),
            ),
            (_, HealthInput::PollError(_)) => (
                RailState::Failed(input),
                Some(failed("polling the completion queue failed")),
            ),
            (_, HealthInput::DeviceFatal) => {
                (RailState::Failed(input), Some(failed("the device failed")))
            }
        };
        self.state = next;
        transition
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_that_goes_down_comes_back() {
        let mut health = RailHealth::default();
        assert!(health.is_up());
        assert_eq!(health.on(HealthInput::PortActive), None, "up already");
        assert_eq!(
            health.on(HealthInput::PortError),
            Some(Transition::WentDown {
                reason: "the port's link went down",
                lost_completions: false
            })
        );
        assert!(!health.is_up());
        assert_eq!(health.on(HealthInput::PortError), None, "down already");
        assert_eq!(
            health.on(HealthInput::PortActive),
            Some(Transition::CameBack)
        );
        assert!(health.is_up());
    }

    #[test]
    fn a_failed_completion_queue_or_device_is_down_for_good() {
        for input in [
            HealthInput::CompletionQueueError,
            HealthInput::PollError(libc::EINVAL),
            HealthInput::DeviceFatal,
        ] {
            let mut health = RailHealth::default();
            assert!(matches!(
                health.on(input),
                Some(Transition::WentDown {
                    lost_completions: true,
                    ..
                })
            ));
            assert_eq!(health.state(), RailState::Failed(input));
            assert_eq!(health.on(HealthInput::PortActive), None, "no way back");
            assert_eq!(health.on(HealthInput::CompletionQueueError), None);
            assert!(!health.is_up());
        }
    }

    #[test]
    fn a_completion_queue_failure_while_the_port_is_down_still_loses_the_completions() {
        let mut health = RailHealth::default();
        health.on(HealthInput::PortError);
        assert!(matches!(
            health.on(HealthInput::CompletionQueueError),
            Some(Transition::WentDown {
                lost_completions: true,
                ..
            })
        ));
        assert_eq!(health.on(HealthInput::PortActive), None);
    }
}
