//! A process of many engines without a secret is told once that its peers are not
//! authenticated, not once per engine (its own test binary: the warning is once per
//! process).

use std::io::Write;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, RailChoice};

/// Log lines, collected.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("unpoisoned").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn engine(listen: &str) -> Engine {
    Engine::builder("warned")
        .listen(listen.parse().expect("an address"))
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("an engine")
}

#[test]
fn many_engines_beyond_loopback_warn_once() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let warnings = || {
        String::from_utf8_lossy(&captured.0.lock().expect("unpoisoned"))
            .matches("not authenticated")
            .count()
    };

    let on_loopback: Vec<Engine> = (0..2).map(|_| engine("127.0.0.1:0")).collect();
    assert_eq!(warnings(), 0, "engines on loopback only");
    let reachable: Vec<Engine> = (0..3).map(|_| engine("0.0.0.0:0")).collect();
    assert_eq!(warnings(), 1, "three reachable engines, one warning");
    drop((on_loopback, reachable));
}
