//! Prometheus metrics of an engine, read from [`Engine::stats`] when scraped: nothing is
//! added to the data path for them. [`EngineMetrics`] is a `prometheus-client` collector
//! (register it in an application's own registry), [`Engine::metrics_text`] renders one
//! engine alone in the Prometheus text format (0.0.4, what every scraper reads), and
//! [`MetricsServer`] serves that text at
//! `/metrics` over HTTP (`railyard serve --metrics ADDR`, `railyard bench --metrics ADDR`).
//!
//! Every metric is named `railyard_…`, with its unit in the name and `_total` on counters;
//! docs/logs-and-metrics.md lists them all. Labels: `engine` on the info metric only; `peer`
//! (name) and `incarnation` for peers; `rail` (its device name) for rails; `op`, `reason`,
//! `kind` and `state` where a count is split.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};
use railyard_control::{Phase, TIME_BUCKET_BOUNDS_US, TimeHistogram, WarningKind};
use railyard_dataplane::FailReason;
use railyard_dataplane::fabric::tcp::ServedStats;

use crate::op::Op;
use crate::state::{Engine, WeakEngine};
use crate::stats::{OpTotals, PeerStats, RailStats};

/// The content type of [`Engine::metrics_text`]: the Prometheus text format, 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// One engine's metrics as a `prometheus-client` collector, evaluated at each scrape. It
/// does not keep the engine running: once the engine stops, it collects nothing.
#[derive(Clone, Debug)]
pub struct EngineMetrics {
    engine: WeakEngine,
}

impl EngineMetrics {
    /// The metrics of `engine`.
    pub fn new(engine: &Engine) -> Self {
        Self {
            engine: engine.downgrade(),
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// Writes one metric family.
struct Family<'e, 'a> {
    encoder: &'e mut DescriptorEncoder<'a>,
}

impl Family<'_, '_> {
    fn counter(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        series: impl IntoIterator<Item = (Labels, u64)>,
    ) -> fmt::Result {
        let mut metric = self
            .encoder
            .encode_descriptor(name, help, unit, MetricType::Counter)?;
        for (labels, value) in series {
            ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn gauge<V: prometheus_client::encoding::EncodeGaugeValue>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        series: impl IntoIterator<Item = (Labels, V)>,
    ) -> fmt::Result {
        let mut metric = self
            .encoder
            .encode_descriptor(name, help, unit, MetricType::Gauge)?;
        for (labels, value) in series {
            ConstGauge::new(value).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn seconds_histogram(&mut self, name: &str, help: &str, times: &TimeHistogram) -> fmt::Result {
        let mut metric = self.encoder.encode_descriptor(
            name,
            help,
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        let mut buckets: Vec<(f64, u64)> = TIME_BUCKET_BOUNDS_US
            .iter()
            .zip(times.buckets)
            .map(|(&bound, count)| (bound as f64 / 1e6, count))
            .collect();
        let bucketed: u64 = times.buckets.iter().sum();
        buckets.push((f64::INFINITY, times.count.saturating_sub(bucketed)));
        metric.encode_histogram::<Labels>(times.sum_us as f64 / 1e6, times.count, &buckets, None)
    }
}

fn labels<const N: usize>(pairs: [(&'static str, String); N]) -> Labels {
    pairs.into()
}

impl Collector for EngineMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let Some(engine) = self.engine.upgrade() else {
            return Ok(());
        };
        let stats = engine.stats();
        let mut family = Family {
            encoder: &mut encoder,
        };
        family.gauge(
            "railyard_engine_info",
            "This engine: its segment name, incarnation and fabric (always 1).",
            None,
            [(
                labels([
                    ("engine", engine.name().to_string()),
                    ("incarnation", engine.incarnation().to_string()),
                    ("fabric", engine.fabric().to_string()),
                ]),
                1u64,
            )],
        )?;

        // Per peer: what the application submitted to it.
        let peer = |p: &PeerStats| {
            [
                ("peer", p.name.clone()),
                ("incarnation", p.incarnation.to_string()),
            ]
        };
        let by_op = |value: fn(&OpTotals) -> u64| {
            stats.peers.iter().flat_map(move |p| {
                Op::ALL.map(|op| {
                    let mut labels: Labels = peer(p).into();
                    labels.push(("op", op.as_str().to_string()));
                    (labels, value(&p.op(op)))
                })
            })
        };
        family.counter(
            "railyard_submitted_requests",
            "Transfers submitted to a peer, by op.",
            None,
            by_op(|op| op.requests),
        )?;
        family.counter(
            "railyard_submitted",
            "Bytes of the transfers submitted to a peer, by op.",
            Some(&Unit::Bytes),
            by_op(|op| op.bytes),
        )?;
        family.counter(
            "railyard_submitted_slices",
            "Slices the transfers to a peer were split into.",
            None,
            stats.peers.iter().map(|p| (peer(p).into(), p.slices)),
        )?;

        // Per rail: its poller.
        let rail = |name: &str| labels([("rail", name.to_string())]);
        let per_rail = |value: fn(&RailStats) -> u64| {
            stats.rails.iter().map(move |r| (rail(&r.name), value(r)))
        };
        family.counter(
            "railyard_work_requests_posted",
            "Work requests a rail's poller posted to its fabric.",
            None,
            per_rail(|r| r.poller.posted),
        )?;
        family.counter(
            "railyard_slices_completed",
            "Slices completed successfully on a rail.",
            None,
            per_rail(|r| r.poller.completed),
        )?;
        family.counter(
            "railyard_slices_failed",
            "Slices failed on a rail, by reason.",
            None,
            stats.rails.iter().flat_map(|r| {
                FailReason::ALL.map(|reason| {
                    (
                        labels([
                            ("rail", r.name.clone()),
                            ("reason", reason.as_str().to_string()),
                        ]),
                        r.poller.failed(reason),
                    )
                })
            }),
        )?;
        family.counter(
            "railyard_slices_reprepared",
            "Slices prepared for an older epoch, re-prepared for the current one.",
            None,
            per_rail(|r| r.poller.reprepared),
        )?;
        family.counter(
            "railyard_slices_stale_dropped",
            "Slices prepared for an older epoch that could not be re-prepared: failed, never \
             posted.",
            None,
            per_rail(|r| r.poller.stale_dropped),
        )?;
        family.gauge(
            "railyard_work_requests_in_flight",
            "Work requests posted to a rail's fabric and not yet completed.",
            None,
            per_rail(|r| r.poller.in_flight),
        )?;
        family.gauge(
            "railyard_rail_load",
            "Bytes of slices a rail's poller holds (queued, waiting for credits or in flight).",
            Some(&Unit::Bytes),
            per_rail(|r| r.poller.load_bytes),
        )?;
        family.counter(
            "railyard_poller_rounds",
            "Rounds of a rail's poller, by state: idle (found no work) or busy.",
            None,
            stats.rails.iter().flat_map(|r| {
                [
                    ("idle", r.poller.idle_rounds),
                    ("busy", r.poller.busy_rounds),
                ]
                .map(|(state, value)| {
                    (
                        labels([("rail", r.name.clone()), ("state", state.to_string())]),
                        value,
                    )
                })
            }),
        )?;
        family.gauge(
            "railyard_poller_idle_ratio",
            "Share of a rail's poller rounds that found no work, since it started (for a \
             recent share, divide the rates of railyard_poller_rounds_total).",
            None,
            stats.rails.iter().map(|r| {
                let rounds = r.poller.idle_rounds + r.poller.busy_rounds;
                let idle = if rounds == 0 {
                    1.0
                } else {
                    r.poller.idle_rounds as f64 / rounds as f64
                };
                (rail(&r.name), idle)
            }),
        )?;
        family.counter(
            "railyard_doorbells",
            "Post calls a rail's poller made (one per queue pair per round with work for it).",
            None,
            per_rail(|r| r.poller.doorbells),
        )?;
        family.counter(
            "railyard_credit_waits",
            "Slices that waited for credits (a full send or completion queue) before posting.",
            None,
            per_rail(|r| r.poller.credit_waits),
        )?;
        family.counter(
            "railyard_send_queue_full",
            "Post calls the fabric cut short with a full send queue (the rest waited, then went).",
            None,
            per_rail(|r| r.poller.send_queue_full),
        )?;
        family.counter(
            "railyard_rail_downs",
            "Times a rail's fabric reported the rail down (port, completion queue, device).",
            None,
            per_rail(|r| r.poller.rail_downs),
        )?;
        family.counter(
            "railyard_rail_ups",
            "Times a rail's port came back.",
            None,
            per_rail(|r| r.poller.rail_ups),
        )?;
        let served = |value: fn(&ServedStats) -> [u64; 2]| {
            stats.rails.iter().flat_map(move |r| {
                let values = r.served.as_ref().map(value).unwrap_or_default();
                [("write", values[0]), ("read", values[1])].map(|(op, value)| {
                    (
                        labels([("rail", r.name.clone()), ("op", op.to_string())]),
                        value,
                    )
                })
            })
        };
        family.counter(
            "railyard_served_requests",
            "Requests of initiators this engine carried out as a TCP target, by op (soft and \
             RDMA transfers are one-sided: the target never sees them).",
            None,
            served(|s| [s.writes, s.reads]),
        )?;
        family.counter(
            "railyard_served",
            "Bytes initiators wrote into (write) or read from (read) this engine's memory \
             through its TCP target side.",
            Some(&Unit::Bytes),
            served(|s| [s.write_bytes, s.read_bytes]),
        )?;
        let data_port = |value: fn(&ServedStats) -> u64| {
            stats.rails.iter().map(move |r| {
                (
                    labels([("rail", r.name.clone())]),
                    r.served.as_ref().map(value).unwrap_or_default(),
                )
            })
        };
        family.counter(
            "railyard_tcp_half_open_closed",
            "Connections to a rail's TCP data port closed before their hello, to keep at most \
             the cap of them (a flood of silent connections).",
            None,
            data_port(|s| s.half_open_closed),
        )?;
        family.counter(
            "railyard_tcp_accept_failures",
            "Times a rail's TCP data port could not accept for lack of file descriptors or \
             memory; accepting pauses 100 ms after each.",
            None,
            data_port(|s| s.accept_failures),
        )?;

        // The control plane.
        family.gauge(
            "railyard_endpoint_state",
            "Each endpoint's state (1 for the state it is in, 0 for the others); state \
             circuit_open means work for the peer fails fast.",
            None,
            stats.endpoints.iter().flat_map(|endpoint| {
                Phase::ALL.map(|state| {
                    (
                        labels([
                            ("peer", endpoint.peer.clone()),
                            ("incarnation", endpoint.incarnation.to_string()),
                            ("rail", endpoint.rail.clone()),
                            ("endpoint", endpoint.endpoint.to_string()),
                            ("state", state.as_str().to_string()),
                        ]),
                        u64::from(endpoint.phase == state),
                    )
                })
            }),
        )?;
        let c = &stats.control;
        let one = |value: u64| [(Labels::new(), value)];
        family.counter(
            "railyard_reconnects",
            "Queue pairs created for an endpoint after its first.",
            None,
            one(c.reconnects),
        )?;
        family.counter(
            "railyard_teardowns",
            "Endpoints retired and target queue pairs replaced or dropped.",
            None,
            one(c.teardowns),
        )?;
        family.counter(
            "railyard_peer_restarts",
            "Peers seen coming back as a new incarnation.",
            None,
            one(c.peer_restarts),
        )?;
        family.counter(
            "railyard_circuit_openings",
            "Circuits opened (an endpoint failing fast until its cooldown ends).",
            None,
            one(c.circuit_openings),
        )?;
        family.counter(
            "railyard_unreachable_peers",
            "Peers declared unreachable: silent on their control connection past the liveness \
             timeout.",
            None,
            one(c.unreachable_peers),
        )?;
        family.counter(
            "railyard_queue_pairs_created",
            "Queue pairs created, by side: active (this engine initiates) or passive (a peer \
             initiates to it).",
            None,
            [("active", c.active_qps), ("passive", c.passive_qps)]
                .map(|(side, value)| (labels([("side", side.to_string())]), value)),
        )?;
        family.counter(
            "railyard_handshakes_idempotent",
            "Repeated ConnectQp requests answered with the queue pair already given.",
            None,
            one(c.idempotent_replies),
        )?;
        family.counter(
            "railyard_handshakes_refused",
            "ConnectQp requests refused.",
            None,
            one(c.refused),
        )?;
        family.counter(
            "railyard_stray_replies",
            "ConnectQp replies that matched no handshake waiting on their connection.",
            None,
            one(c.stray_replies),
        )?;
        family.counter(
            "railyard_connections_closed",
            "Control connections closed for breaking a bound or the protocol.",
            None,
            one(c.connections_closed),
        )?;
        family.counter(
            "railyard_auth_failures",
            "Control connections closed because the peer did not prove the cluster secret, or a frame after the handshake failed its authentication check.",
            None,
            one(c.auth_failures),
        )?;
        family.counter(
            "railyard_evictions",
            "Idle endpoints parked (their queue pairs freed) to keep a rail within its \
             queue-pair cap; refused: parks a poller refused because the endpoint was busy.",
            None,
            [("parked", c.evictions), ("refused", c.eviction_refusals)]
                .map(|(outcome, value)| (labels([("outcome", outcome.to_string())]), value)),
        )?;
        family.counter(
            "railyard_endpoint_waits",
            "Endpoints that waited for room on their rail (every other endpoint busy).",
            None,
            one(c.endpoint_waits),
        )?;
        family.counter(
            "railyard_endpoint_wakes",
            "Parked endpoints connected again because traffic wanted them.",
            None,
            one(c.wakes),
        )?;
        family.counter(
            "railyard_handshake_failures",
            "Handshakes that failed: refused, timed out, or their queue pair not adopted.",
            None,
            one(c.handshake_failures),
        )?;
        family.counter(
            "railyard_handshakes_queued",
            "Handshakes that waited their turn here: behind this process's cap on handshakes out, or as the target that told their initiator to wait.",
            None,
            one(c.handshakes_queued),
        )?;
        family.gauge(
            "railyard_handshakes_in_flight",
            "Handshakes waiting for their reply.",
            None,
            one(c.handshakes_in_flight),
        )?;
        family.gauge(
            "railyard_known_peers",
            "Peer incarnations the control plane knows.",
            None,
            one(c.known_peers),
        )?;
        family.gauge(
            "railyard_control_state",
            "Memory the control plane's peer table holds, about.",
            Some(&Unit::Bytes),
            one(c.control_state_bytes),
        )?;
        family.gauge(
            "railyard_rail_endpoints",
            "Endpoints of a rail, by state: live (holding or connecting a queue pair), parked \
             (idle, queue pair freed), retiring.",
            None,
            stats.rails.iter().flat_map(|rail| {
                [
                    ("live", rail.endpoints.live),
                    ("parked", rail.endpoints.parked),
                    ("retiring", rail.endpoints.retiring),
                ]
                .map(|(state, value)| {
                    (
                        labels([("rail", rail.name.clone()), ("state", state.to_string())]),
                        value as u64,
                    )
                })
            }),
        )?;
        family.counter(
            "railyard_accept_pauses",
            "Times the handshake listener stopped accepting (at a cap, or out of descriptors).",
            None,
            one(c.accept_pauses),
        )?;
        family.counter(
            "railyard_notifications",
            "Notifications, by event: sent, dropped (not sent), received, refused (meant for \
             another incarnation), discarded (not drained in time).",
            None,
            [
                ("sent", c.notifications_sent),
                ("dropped", c.notifications_dropped),
                ("received", c.notifications_received),
                ("refused", c.notifications_refused),
                ("discarded", c.notifications_discarded),
            ]
            .map(|(event, value)| (labels([("event", event.to_string())]), value)),
        )?;
        family.counter(
            "railyard_warnings",
            "Control-plane warnings emitted, by kind (before the log's rate limit).",
            None,
            WarningKind::ALL.map(|kind| {
                (
                    labels([("kind", kind.as_str().to_string())]),
                    c.warnings[kind.index()],
                )
            }),
        )?;
        family.seconds_histogram(
            "railyard_handshake_duration",
            "Queue-pair handshakes that succeeded: from the ConnectQp sent to its reply applied.",
            &c.handshake_times,
        )?;
        family.seconds_histogram(
            "railyard_failure_detection",
            "How long a peer had been silent when it was declared unreachable.",
            &c.detection_times,
        )
    }
}

impl Engine {
    /// Its metrics in the Prometheus text format, read from [`Self::stats`] now: what a
    /// Prometheus scrape of `/metrics` wants (content type [`CONTENT_TYPE`]), for an
    /// application that serves them on its own endpoint. docs/logs-and-metrics.md lists them;
    /// [`EngineMetrics`] adds them to an application's registry. (Defined here, beside the
    /// metrics, so that the engine never reads its own metrics module: metrics read the
    /// engine, not the other way round.)
    pub fn metrics_text(&self) -> String {
        render(self)
    }
}

/// Renders `engine`'s metrics alone, in the Prometheus text format.
fn render(engine: &Engine) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(EngineMetrics::new(engine)));
    let mut text = String::new();
    // Writing into a String cannot fail; a collector that fails leaves what it wrote.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry);
    text
}

/// An HTTP server answering `GET /metrics` with an engine's metrics (any other path: 404),
/// each response written from a thread of its own, so that a scraper that does not read
/// holds up no one. It does not keep the engine running (once the engine stops it answers
/// 503). Stops when dropped.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Serves `engine`'s metrics on `addr` (port 0: any) from a thread of its own.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(engine: &Engine, addr: SocketAddr) -> std::io::Result<Self> {
        let server = tiny_http::Server::http(addr).map_err(std::io::Error::other)?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| std::io::Error::other("the metrics server is not on an IP address"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let (serving, stop) = (server.clone(), stopping.clone());
        let engine = engine.downgrade();
        let thread = std::thread::Builder::new()
            .name("railyard-metrics".into())
            .spawn(move || serve(&serving, &engine, &stop, addr))?;
        Ok(Self {
            server,
            addr,
            stopping,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Takes requests until stopped; each is answered from a thread of its own.
fn serve(server: &tiny_http::Server, engine: &WeakEngine, stopping: &AtomicBool, addr: SocketAddr) {
    loop {
        match server.recv() {
            Ok(request) => {
                let engine = engine.clone();
                let answering = std::thread::Builder::new()
                    .name("railyard-metrics-reply".into())
                    .spawn(move || answer(&engine, request));
                if let Err(error) = answering {
                    tracing::warn!(
                        target: "railyard::metrics",
                        %addr,
                        reason = %error,
                        "cannot start a thread to answer a scrape; it goes unanswered"
                    );
                }
            }
            // Unblocked by the drop.
            Err(_) if stopping.load(Ordering::Acquire) => return,
            Err(error) => {
                // tiny_http stops accepting after an accept error (out of descriptors).
                tracing::warn!(
                    target: "railyard::metrics",
                    %addr,
                    reason = %error,
                    "the metrics server stopped accepting connections"
                );
                return;
            }
        }
    }
}

fn answer(engine: &WeakEngine, request: tiny_http::Request) {
    let path = request.url().split('?').next().unwrap_or_default();
    let response = if *request.method() != tiny_http::Method::Get || path != "/metrics" {
        tiny_http::Response::from_string("railyard serves /metrics only\n").with_status_code(404)
    } else if let Some(engine) = engine.upgrade() {
        let text = engine.metrics_text();
        // Not the last handle kept beyond the scrape.
        drop(engine);
        let response = tiny_http::Response::from_string(text);
        match tiny_http::Header::from_bytes("Content-Type", CONTENT_TYPE) {
            Ok(header) => response.with_header(header),
            Err(()) => response,
        }
    } else {
        tiny_http::Response::from_string("the engine has stopped\n").with_status_code(503)
    };
    // A client that went away is its own business.
    let _ = request.respond(response);
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
