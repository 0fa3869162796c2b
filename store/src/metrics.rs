//! The master's Prometheus metrics: what it holds (objects, bytes, writes in progress,
//! fences awaited, each segment's capacity and reservations), what it did (puts, gets,
//! evictions, lease refusals…) and how long requests took, served at `/metrics`.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::master::MasterStats;

/// Request latencies by kind of request (`put_start`, `put_end`, `get`, …), in seconds.
pub(crate) struct Latencies {
    family: Family<Vec<(&'static str, &'static str)>, Histogram>,
}

impl Latencies {
    pub(crate) fn new() -> Self {
        Self {
            family: Family::new_with_constructor(|| {
                Histogram::new([
                    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0,
                ])
            }),
        }
    }

    /// Records that a `kind` request took `took`.
    pub(crate) fn observe(&self, kind: &'static str, took: Duration) {
        self.family
            .get_or_create(&vec![("request", kind)])
            .observe(took.as_secs_f64());
    }
}

/// The master's stats as of one scrape.
#[derive(Debug)]
struct StatsCollector(MasterStats);

fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(metric)
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: i64,
) -> fmt::Result {
    let metric = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
    ConstGauge::new(value).encode(metric)
}

impl Collector for StatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let stats = &self.0;
        let e = &mut encoder;
        gauge(
            e,
            "railyard_store_objects",
            "Complete objects.",
            None,
            stats.objects as i64,
        )?;
        gauge(
            e,
            "railyard_store_writes_in_progress",
            "Writes between put-start and put-end.",
            None,
            stats.writes as i64,
        )?;
        gauge(
            e,
            "railyard_store_value",
            "Bytes of complete values (one replica each).",
            Some(&Unit::Bytes),
            stats.bytes as i64,
        )?;
        gauge(
            e,
            "railyard_store_fences_pending",
            "Abandoned writes whose space waits for its segment owner's fence.",
            None,
            stats.fences_pending as i64,
        )?;
        let counters = &stats.counters;
        counter(
            e,
            "railyard_store_puts_started",
            "Writes placed (put-start, upsert-start).",
            counters.puts_started,
        )?;
        counter(
            e,
            "railyard_store_puts_completed",
            "Writes completed (put-end).",
            counters.puts_completed,
        )?;
        counter(
            e,
            "railyard_store_puts_revoked",
            "Writes revoked by their writer.",
            counters.puts_revoked,
        )?;
        counter(
            e,
            "railyard_store_puts_abandoned",
            "Writes abandoned past the put timeout or removed by force.",
            counters.puts_abandoned,
        )?;
        counter(
            e,
            "railyard_store_gets",
            "Reads granted a lease.",
            counters.gets,
        )?;
        counter(
            e,
            "railyard_store_evictions",
            "Objects evicted.",
            counters.evictions,
        )?;
        counter(
            e,
            "railyard_store_evicted_bytes",
            "Bytes of values evicted.",
            counters.evicted_bytes,
        )?;
        counter(
            e,
            "railyard_store_lease_refusals",
            "Removes refused because a reader held a lease.",
            counters.lease_refusals,
        )?;
        counter(
            e,
            "railyard_store_no_space",
            "Writes refused for lack of space after eviction.",
            counters.no_space,
        )?;
        counter(
            e,
            "railyard_store_members_suspected",
            "Members suspected (silent, or their connection dropped).",
            counters.members_suspected,
        )?;
        counter(
            e,
            "railyard_store_members_lost",
            "Members gone: suspected past the grace, or replaced by another incarnation.",
            counters.members_lost,
        )?;
        counter(
            e,
            "railyard_store_auth_failures",
            "Connections closed because a frame after the handshake failed its authentication check.",
            counters.auth_failures,
        )?;
        gauge(
            e,
            "railyard_store_segments_suspected",
            "Segments whose owner is suspected: no replica placed, no read pointed there.",
            None,
            stats.segments.iter().filter(|s| s.suspected).count() as i64,
        )?;
        for (name, help, value) in [
            (
                "railyard_store_segment_capacity",
                "Each segment's bytes.",
                (|s: &crate::master::SegmentUsage| s.capacity)
                    as fn(&crate::master::SegmentUsage) -> u64,
            ),
            (
                "railyard_store_segment_reserved",
                "Each segment's bytes reserved by replicas.",
                |s| s.reserved,
            ),
        ] {
            let mut metric =
                e.encode_descriptor(name, help, Some(&Unit::Bytes), MetricType::Gauge)?;
            for segment in &stats.segments {
                let labels = [
                    ("segment", segment.name.clone()),
                    ("host", segment.host.clone()),
                ];
                ConstGauge::new(value(segment) as i64).encode(metric.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// An HTTP server answering `GET /metrics` (any other path: 404). Stops when dropped.
pub(crate) struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves on `addr` (port 0: any): `stats` at each scrape, and `latencies`.
    pub(crate) fn start<S: Send + Sync + 'static>(
        addr: SocketAddr,
        source: Weak<S>,
        stats: fn(&S) -> MasterStats,
        latencies: fn(&S) -> &Latencies,
    ) -> std::io::Result<Self> {
        let server = tiny_http::Server::http(addr).map_err(std::io::Error::other)?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| std::io::Error::other("the metrics server is not on an IP address"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let (serving, stop) = (Arc::clone(&server), Arc::clone(&stopping));
        let thread = std::thread::Builder::new()
            .name("store-metrics".into())
            .spawn(move || {
                loop {
                    let request = match serving.recv() {
                        Ok(request) => request,
                        Err(_) if stop.load(Ordering::Acquire) => return,
                        Err(error) => {
                            tracing::warn!(%addr, %error, "store metrics: stopped accepting");
                            return;
                        }
                    };
                    let path = request
                        .url()
                        .split('?')
                        .next()
                        .unwrap_or_default()
                        .to_owned();
                    let response = match source.upgrade() {
                        Some(source)
                            if *request.method() == tiny_http::Method::Get
                                && path == "/metrics" =>
                        {
                            let mut registry = Registry::default();
                            registry.register_collector(Box::new(StatsCollector(stats(&source))));
                            registry.register(
                                "railyard_store_request",
                                "Time the master took to answer a request, by kind.",
                                latencies(&source).family.clone(),
                            );
                            let mut text = String::new();
                            let _ = prometheus_client::encoding::prometheus_text::encode(
                                &mut text, &registry,
                            );
                            let response = tiny_http::Response::from_string(text);
                            match tiny_http::Header::from_bytes(
                                "Content-Type",
                                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                            ) {
                                Ok(header) => response.with_header(header),
                                Err(()) => response,
                            }
                        }
                        Some(_) => {
                            tiny_http::Response::from_string("the master serves /metrics only\n")
                                .with_status_code(404)
                        }
                        None => tiny_http::Response::from_string("the master has stopped\n")
                            .with_status_code(503),
                    };
                    let _ = request.respond(response);
                }
            })?;
        Ok(Self {
            server,
            addr,
            stopping,
            thread: Some(thread),
        })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
