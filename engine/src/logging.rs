//! The rate limit of repeated warnings, as a `tracing` layer: what every subscriber railyard
//! installs (the CLI's, the Python module's) wraps the layer that writes its lines in.
//!
//! A reconnect storm is tens of thousands of warnings of one kind in a minute (DESIGN.md,
//! seed 002). [`RateLimit`] wraps the layer that writes log lines and lets through at most
//! a burst of warnings (and errors) of one kind per window; the rest are counted, and when
//! the next one of that kind gets through, a line with target `railyard::log` and fields
//! `kind` and `suppressed` says how many were dropped just before it. A kind is the event's
//! target with its `engine` and `kind` fields (every engine in a process has its own
//! windows), or its call site when it has no `kind`. Events below `warn` are never limited.
//!
//! The engine itself only emits events; an embedding application that installs its own
//! subscriber wraps its writer layer in [`RateLimit`] to get the same behaviour. Filter
//! outside it (a global filter such as `EnvFilter` added to the registry), not with a
//! per-layer filter on the wrapped layer: the limit decides per event what reaches that
//! layer, and its summary lines would bypass such a filter.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::callsite::{Callsite, Identifier};
use tracing::field::{Field, FieldSet, Value, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber, span};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// Warnings of one kind let through per window by default.
pub const DEFAULT_BURST: u32 = 5;
/// The default window.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10);

/// Which warnings share a window: those with a `kind` field share it per target and kind
/// (every control-plane reconnect warning is one kind), the rest per call site.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum WindowKey {
    Kind {
        target: &'static str,
        engine: Option<String>,
        kind: String,
    },
    Callsite(Identifier),
}

#[derive(Debug)]
struct Window {
    start: Instant,
    admitted: u32,
    suppressed: u64,
}

/// What to do with one warning.
enum Verdict {
    Pass,
    Suppress,
    /// Pass it after a line saying how many of its kind were suppressed.
    PassAfterSuppressed {
        kind: String,
        suppressed: u64,
    },
}

/// Wraps the layer `inner` (the one that writes lines): warnings beyond a burst per kind
/// per window do not reach it. See the module docs.
pub struct RateLimit<L> {
    inner: L,
    burst: u32,
    window: Duration,
    windows: Mutex<HashMap<WindowKey, Window>>,
}

impl<L> RateLimit<L> {
    /// At most [`DEFAULT_BURST`] warnings of a kind per [`DEFAULT_WINDOW`] reach `inner`.
    pub fn new(inner: L) -> Self {
        Self::with_limit(inner, DEFAULT_BURST, DEFAULT_WINDOW)
    }

    /// At most `burst` warnings of a kind per `window` reach `inner`.
    pub fn with_limit(inner: L, burst: u32, window: Duration) -> Self {
        Self {
            inner,
            burst,
            window,
            windows: Mutex::new(HashMap::new()),
        }
    }

    fn judge(&self, event: &Event<'_>, now: Instant) -> Verdict {
        let metadata = event.metadata();
        if *metadata.level() > Level::WARN {
            return Verdict::Pass;
        }
        let mut fields = KeyFields::default();
        event.record(&mut fields);
        let key = match fields.kind {
            Some(kind) => WindowKey::Kind {
                target: metadata.target(),
                engine: fields.engine,
                kind,
            },
            None => WindowKey::Callsite(metadata.callsite()),
        };
        let mut windows = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        let window = windows.entry(key.clone()).or_insert(Window {
            start: now,
            admitted: 0,
            suppressed: 0,
        });
        if now.duration_since(window.start) >= self.window {
            window.start = now;
            window.admitted = 0;
        }
        if window.admitted >= self.burst {
            window.suppressed += 1;
            return Verdict::Suppress;
        }
        window.admitted += 1;
        match std::mem::take(&mut window.suppressed) {
            0 => Verdict::Pass,
            suppressed => Verdict::PassAfterSuppressed {
                kind: match key {
                    WindowKey::Kind { kind, .. } => kind,
                    WindowKey::Callsite(_) => metadata.name().to_string(),
                },
                suppressed,
            },
        }
    }
}

/// Reads an event's `kind` and `engine` fields.
#[derive(Default)]
struct KeyFields {
    kind: Option<String>,
    engine: Option<String>,
}

impl KeyFields {
    fn slot(&mut self, field: &Field) -> Option<&mut Option<String>> {
        match field.name() {
            "kind" => Some(&mut self.kind),
            "engine" => Some(&mut self.engine),
            _ => None,
        }
    }
}

impl Visit for KeyFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if let Some(slot) = self.slot(field) {
            *slot = Some(value.to_string());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if let Some(slot) = self.slot(field) {
            *slot = Some(format!("{value:?}"));
        }
    }
}

/// The call site of the "suppressed" lines [`RateLimit`] writes.
struct SuppressedCallsite;

static SUPPRESSED_CALLSITE: SuppressedCallsite = SuppressedCallsite;

static SUPPRESSED: Metadata<'static> = Metadata::new(
    "similar warnings suppressed",
    "railyard::log",
    Level::WARN,
    Some(file!()),
    Some(line!()),
    Some(module_path!()),
    FieldSet::new(
        &["message", "kind", "suppressed"],
        Identifier(&SUPPRESSED_CALLSITE),
    ),
    tracing::metadata::Kind::EVENT,
);

impl Callsite for SuppressedCallsite {
    fn set_interest(&self, _: Interest) {}

    fn metadata(&self) -> &Metadata<'_> {
        &SUPPRESSED
    }
}

impl<S, L> Layer<S> for RateLimit<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.inner.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.inner.on_layer(subscriber);
    }

    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        self.inner.register_callsite(metadata)
    }

    fn enabled(&self, metadata: &Metadata<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.enabled(metadata, ctx)
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_new_span(attrs, id, ctx);
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        self.inner.max_level_hint()
    }

    fn on_record(&self, span: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        self.inner.on_record(span, values, ctx);
    }

    fn on_follows_from(&self, span: &span::Id, follows: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_follows_from(span, follows, ctx);
    }

    fn event_enabled(&self, event: &Event<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.event_enabled(event, ctx)
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        match self.judge(event, Instant::now()) {
            Verdict::Pass => self.inner.on_event(event, ctx),
            Verdict::Suppress => {}
            Verdict::PassAfterSuppressed { kind, suppressed } => {
                let fields = SUPPRESSED.fields();
                let mut names = fields.iter();
                // The summary passes the subscriber's filters like any event.
                if let (true, Some(message), Some(kind_field), Some(count)) = (
                    ctx.enabled(&SUPPRESSED),
                    names.next(),
                    names.next(),
                    names.next(),
                ) {
                    let text = format_args!("{suppressed} similar warnings suppressed");
                    let values: [(&Field, Option<&dyn Value>); 3] = [
                        (&message, Some(&text)),
                        (&kind_field, Some(&kind.as_str())),
                        (&count, Some(&suppressed)),
                    ];
                    let values = fields.value_set(&values);
                    self.inner
                        .on_event(&Event::new(&SUPPRESSED, &values), ctx.clone());
                }
                self.inner.on_event(event, ctx);
            }
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_exit(id, ctx);
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        self.inner.on_close(id, ctx);
    }

    fn on_id_change(&self, old: &span::Id, new: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_id_change(old, new, ctx);
    }

    // SAFETY (of the contract): a pointer is returned only for `TypeId::of::<Self>()`,
    // pointing at `self`; anything else is the inner layer's answer, under its contract.
    unsafe fn downcast_raw(&self, id: TypeId) -> Option<*const ()> {
        if id == TypeId::of::<Self>() {
            return Some(std::ptr::from_ref(self).cast());
        }
        // SAFETY: forwards the caller's obligations unchanged to the inner layer, which
        // answers for its own type ids (the fmt layer finds its formatter this way).
        unsafe { self.inner.downcast_raw(id) }
    }
}
