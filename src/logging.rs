//! Log output for people and machines: the subscriber the CLI installs, its lines written
//! through [`RateLimit`] (the engine crate's rate limit of repeated warnings, re-exported
//! here).

pub use railyard_engine::logging::{DEFAULT_BURST, DEFAULT_WINDOW, RateLimit};

/// How log lines look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// For people: one line per event, coloured on a terminal.
    Text,
    /// For machines: one JSON object per line.
    Json,
}

/// Installs the global subscriber: events that pass `filter` go to stderr in `format`,
/// warnings through [`RateLimit`] with its defaults.
///
/// # Errors
/// A subscriber is already installed.
pub fn install(
    filter: tracing_subscriber::EnvFilter,
    format: LogFormat,
) -> Result<(), tracing_subscriber::util::TryInitError> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let lines = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry
            .with(RateLimit::new(lines.with_ansi(
                std::io::IsTerminal::is_terminal(&std::io::stderr()),
            )))
            .try_init(),
        LogFormat::Json => registry.with(RateLimit::new(lines.json())).try_init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tracing_subscriber::layer::SubscriberExt;

    /// Collects written lines.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lines").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Lines {
        fn json(&self) -> Vec<serde_json::Value> {
            let bytes = self.0.lock().expect("lines").clone();
            String::from_utf8(bytes)
                .expect("utf-8")
                .lines()
                .map(|line| serde_json::from_str(line).expect("a JSON line"))
                .collect()
        }
    }

    fn with_limit(burst: u32, window: Duration, events: impl FnOnce()) -> Vec<serde_json::Value> {
        let lines = Lines::default();
        let writer = lines.clone();
        let layer = tracing_subscriber::fmt::layer()
            .json()
            .with_writer(move || writer.clone());
        let subscriber =
            tracing_subscriber::registry().with(RateLimit::with_limit(layer, burst, window));
        tracing::subscriber::with_default(subscriber, events);
        lines.json()
    }

    #[test]
    fn a_storm_of_one_kind_is_a_burst_then_a_count_on_the_next_line() {
        let window = Duration::from_secs(1);
        let events = with_limit(3, window, || {
            for epoch in 0..1000u64 {
                tracing::warn!(target: "railyard::control", kind = "reconnect", epoch, "reconnecting");
            }
            // Another kind has its own window, and so has the same kind of another engine.
            tracing::warn!(target: "railyard::control", kind = "retire", "endpoint retired");
            tracing::warn!(
                target: "railyard::control",
                engine = "other",
                kind = "reconnect",
                "reconnecting elsewhere"
            );
            // Not a warning: never limited.
            for _ in 0..10 {
                tracing::info!(target: "railyard::control", kind = "reconnect", "offered");
            }
            std::thread::sleep(window);
            tracing::warn!(target: "railyard::control", kind = "reconnect", epoch = 1000u64, "reconnecting");
        });
        let messages: Vec<&str> = events
            .iter()
            .map(|event| event["fields"]["message"].as_str().expect("a message"))
            .collect();
        let reconnects = messages.iter().filter(|m| **m == "reconnecting").count();
        assert_eq!(reconnects, 4, "{messages:?}");
        assert_eq!(messages.iter().filter(|m| **m == "offered").count(), 10);
        assert!(messages.contains(&"endpoint retired"));
        assert!(messages.contains(&"reconnecting elsewhere"));
        let summary = events
            .iter()
            .position(|event| event["target"] == "railyard::log")
            .expect("a suppressed line");
        assert_eq!(events[summary]["fields"]["suppressed"], 997);
        assert_eq!(events[summary]["fields"]["kind"], "reconnect");
        assert_eq!(events[summary]["level"], "WARN");
        // On the line before the next reconnect, which carries its own fields.
        assert_eq!(events[summary + 1]["fields"]["epoch"], 1000);
        assert_eq!(summary + 2, events.len());
    }

    #[test]
    fn warnings_without_a_kind_are_limited_per_call_site() {
        let events = with_limit(2, Duration::from_secs(60), || {
            for _ in 0..5 {
                tracing::warn!("first site");
                tracing::warn!("second site");
            }
        });
        let count = |text: &str| {
            events
                .iter()
                .filter(|event| event["fields"]["message"] == text)
                .count()
        };
        assert_eq!((count("first site"), count("second site")), (2, 2));
    }
}
