//! Time arithmetic that never panics on a duration a client or an operator chose: a moment
//! too far to represent is as good as never.

use std::time::{Duration, Instant};

/// About a century: later than anything the store waits for.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + by`, or a moment a century away when that cannot be represented.
pub(crate) fn after(now: Instant, by: Duration) -> Instant {
    now.checked_add(by.min(NEVER))
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_too_long_for_an_instant_mean_never_not_a_panic() {
        let now = Instant::now();
        assert_eq!(
            after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        assert!(after(now, Duration::MAX) > now + Duration::from_secs(3600 * 24 * 365));
    }
}
