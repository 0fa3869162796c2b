//! Rate-limited warnings: a reconnect storm must not become a log storm. Each kind of
//! warning prints at most [`RateLimiter::burst`] lines per window; the rest are counted and
//! the count is printed with the next line that gets through.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Kinds of repeatable warnings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WarningKind {
    /// An endpoint reconnects.
    Reconnect,
    /// An endpoint or passive queue pair is retired.
    Retire,
    /// A handshake failed or was refused.
    Handshake,
    /// A circuit opened.
    Circuit,
    /// The cluster directory is unreachable or refused something.
    Directory,
    /// A connection was closed for breaking a bound or the protocol, or the listener paused.
    Connection,
}

#[derive(Debug)]
struct Window {
    start: Instant,
    printed: u32,
    suppressed: u64,
}

/// Counts and limits warning lines by kind.
#[derive(Debug)]
pub struct RateLimiter {
    window: Duration,
    burst: u32,
    windows: HashMap<WarningKind, Window>,
    printed: u64,
    suppressed: u64,
}

impl RateLimiter {
    /// At most `burst` lines per kind per `window`.
    pub fn new(window: Duration, burst: u32) -> Self {
        Self {
            window,
            burst,
            windows: HashMap::new(),
            printed: 0,
            suppressed: 0,
        }
    }

    /// Lines of one kind allowed per window.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// The line to print for a warning of `kind` at `now`, or `None` when it is suppressed.
    /// A printed line says how many of its kind were suppressed since the last one.
    pub fn admit(&mut self, kind: WarningKind, message: &str, now: Instant) -> Option<String> {
        let window = self.windows.entry(kind).or_insert(Window {
            start: now,
            printed: 0,
            suppressed: 0,
        });
        if now.duration_since(window.start) >= self.window {
            window.start = now;
            window.printed = 0;
        }
        if window.printed >= self.burst {
            window.suppressed += 1;
            self.suppressed += 1;
            return None;
        }
        window.printed += 1;
        self.printed += 1;
        let line = if window.suppressed > 0 {
            format!("{message} ({} similar suppressed)", window.suppressed)
        } else {
            message.to_string()
        };
        window.suppressed = 0;
        Some(line)
    }

    /// Lines let through so far.
    pub fn printed(&self) -> u64 {
        self.printed
    }

    /// Lines suppressed so far.
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storm_prints_a_burst_per_window_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut limiter = RateLimiter::new(Duration::from_secs(10), 3);
        let printed: Vec<_> = (0..1000)
            .filter_map(|_| limiter.admit(WarningKind::Reconnect, "reconnecting", t0))
            .collect();
        assert_eq!(printed.len(), 3);
        assert_eq!(limiter.suppressed(), 997);
        assert!(
            limiter.admit(WarningKind::Retire, "retired", t0).is_some(),
            "per kind"
        );
        let next = limiter
            .admit(
                WarningKind::Reconnect,
                "reconnecting",
                t0 + Duration::from_secs(10),
            )
            .expect("a new window");
        assert_eq!(next, "reconnecting (997 similar suppressed)");
        assert_eq!(limiter.printed(), 5);
    }
}
