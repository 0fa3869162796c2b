//! railyard's log events for Python: a `tracing` layer hands each event (warnings and
//! errors; `RUST_LOG` widens or narrows that) to one forwarder thread, which gives it to
//! Python's `logging` under the logger `railyard` — `railyard.engine`, `railyard.control`,
//! `railyard.store…`, after the event's target — so an application's handlers, levels and
//! formats apply to them like to its own. Warnings pass the engine's rate limit first
//! ([`RateLimit`]: a burst per kind per window, then one line counting the rest), as they do
//! on the CLI's stderr, so a reconnect storm or a scan of the handshake port is a few
//! records, not thousands.
//!
//! The thread that logs (a poller, the control thread, a caller holding the GIL) never
//! waits for the GIL: events wait in a bounded queue, and when it is full they are
//! dropped and counted, and the count is logged with the next event that gets through.
//! At exit (`atexit`, before the interpreter finalizes) the forwarder is stopped and
//! joined, so it never tries to attach to an interpreter that is going away; what is
//! logged after that is dropped.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use pyo3::prelude::*;
use railyard_engine::logging::RateLimit;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// Events waiting for the GIL, at most.
const QUEUE: usize = 1024;

/// Python's `logging` levels.
const TRACE: u8 = 5;

/// How often the forwarder looks whether it is asked to stop while no event comes.
const STOP_POLL: Duration = Duration::from_millis(100);

/// Set at exit: the forwarder stops.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// The forwarder, joined at exit.
static FORWARDER: Mutex<Option<JoinHandle<()>>> = Mutex::new(None);

/// One event, ready for Python.
struct Record {
    logger: String,
    level: u8,
    message: String,
}

/// The `tracing` layer that queues events for the forwarder.
struct ToPython {
    queue: SyncSender<Record>,
    dropped: AtomicU64,
}

/// Installs the layer as this process's `tracing` subscriber (unless another one was
/// installed first), starts the forwarder, and has `atexit` stop it.
///
/// # Errors
/// When `atexit` cannot be reached.
pub(crate) fn install(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let (queue, records) = mpsc::sync_channel(QUEUE);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let layer = ToPython {
        queue,
        dropped: AtomicU64::new(0),
    };
    let subscriber = Registry::default().with(filter).with(RateLimit::new(layer));
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        return Ok(());
    }
    // Without a forwarder the queue fills and events are dropped: nothing waits.
    if let Ok(forwarder) = thread::Builder::new()
        .name("railyard-log".into())
        .spawn(move || forward(&records))
    {
        *FORWARDER.lock().unwrap_or_else(PoisonError::into_inner) = Some(forwarder);
    }
    let stop = wrap_pyfunction!(stop_forwarding, module)?;
    module
        .py()
        .import("atexit")?
        .call_method1("register", (stop,))?;
    Ok(())
}

/// Stops the forwarder and waits for it (without the GIL, which it may be waiting for to
/// hand over its last event).
#[pyfunction]
fn stop_forwarding(py: Python<'_>) {
    STOPPING.store(true, Ordering::Relaxed);
    let forwarder = FORWARDER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(forwarder) = forwarder {
        py.detach(|| {
            let _ = forwarder.join();
        });
    }
}

/// Hands queued records to Python's `logging` until it is stopped.
fn forward(records: &Receiver<Record>) {
    while !STOPPING.load(Ordering::Relaxed) {
        let record = match records.recv_timeout(STOP_POLL) {
            Ok(record) => record,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let delivered = Python::try_attach(|py| {
            // A failing handler is the application's to see in its own logging; it must
            // not take railyard's forwarder down.
            let _ = log(py, &record);
        });
        if delivered.is_none() {
            return;
        }
    }
}

fn log(py: Python<'_>, record: &Record) -> PyResult<()> {
    py.import("logging")?
        .call_method1("getLogger", (record.logger.as_str(),))?
        .call_method1("log", (record.level, record.message.as_str()))?;
    Ok(())
}

/// `railyard.engine` for `railyard::engine`, `railyard.store.client` for
/// `railyard_store::client`: every railyard logger sits under `railyard`.
fn logger_of(target: &str) -> String {
    let rest = target
        .strip_prefix("railyard")
        .map(|rest| rest.trim_start_matches(['_', ':']))
        .unwrap_or(target);
    let mut logger = String::from("railyard");
    for part in rest.split("::").filter(|part| !part.is_empty()) {
        logger.push('.');
        logger.push_str(part);
    }
    logger
}

fn level_of(level: Level) -> u8 {
    match level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => TRACE,
    }
}

/// The event's message, then its fields as `name=value`.
#[derive(Default)]
struct Message {
    text: String,
    fields: String,
}

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.text.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.text, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for ToPython {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let metadata = event.metadata();
        let mut message = Message::default();
        event.record(&mut message);
        let dropped = self.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let _ = write!(
                message.fields,
                " (and {dropped} earlier railyard log event(s) dropped: Python's logging \
                 did not keep up)"
            );
        }
        let record = Record {
            logger: logger_of(metadata.target()),
            level: level_of(*metadata.level()),
            message: message.text + &message.fields,
        };
        match self.queue.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(dropped + 1, Ordering::Relaxed);
            }
        }
    }
}
