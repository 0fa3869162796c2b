//! Prometheus metrics as an operator sees them: scraped over HTTP from `railyard serve`
//! and `railyard bench` while a bench runs, parsed with a Prometheus text parser, and
//! checked against what the bench reports; failure counters checked against faults
//! injected in-process; and every metric the engine exports listed in docs/logs-and-metrics.md.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Read};
use std::num::NonZeroUsize;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{BOUND, Serve};
use prometheus_parse::{Scrape, Value};
use railyard::dataplane::fabric::WcStatus;
use railyard::dataplane::fabric::soft::{Fault, QpMatch};
use railyard::dataplane::{IdleStrategy, RequestOutcome};
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, Transfer};

/// A child killed if the test ends before it does.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn parse(text: &str) -> Scrape {
    Scrape::parse(text.lines().map(|line| Ok(line.to_string()))).expect("Prometheus text")
}

/// GET http://`addr`/metrics, parsed.
fn scrape(addr: &str) -> Scrape {
    let response = minreq::get(format!("http://{addr}/metrics"))
        .with_timeout(10)
        .send()
        .expect("the metrics endpoint answers");
    assert_eq!(response.status_code, 200);
    assert_eq!(
        response.headers.get("content-type").map(String::as_str),
        Some(railyard::metrics::CONTENT_TYPE)
    );
    parse(response.as_str().expect("UTF-8"))
}

/// The sum of the samples of `metric` whose labels include `labels`.
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|sample| sample.metric == metric)
        .filter(|sample| {
            labels
                .iter()
                .all(|(key, want)| sample.labels.get(key) == Some(*want))
        })
        .map(|sample| match sample.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => panic!("{metric} is not a number"),
        })
        .sum()
}

#[test]
fn a_scrape_of_serve_during_a_bench_counts_every_byte_the_bench_wrote() {
    let serve = Serve::start_with(
        "64MiB",
        &[
            "--rails",
            "1",
            "--fabric",
            "tcp",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let serve_metrics = serve
        .metrics
        .clone()
        .expect("serve prints its metrics address");
    let written =
        |scrape: &Scrape| value(scrape, "railyard_served_bytes_total", &[("op", "write")]);
    assert_eq!(written(&scrape(&serve_metrics)), 0.0);

    let mut bench = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["bench", "--target", &serve.addr, "--fabric", "tcp"])
            .args(["--rails", "1", "--duration", "2", "--json"])
            .args(["--metrics", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("bench starts"),
    );
    let stderr = bench.0.stderr.take().expect("piped");
    let (address, bench_metrics) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("railyard bench: metrics at http://") {
                let _ = address.send(rest.trim_end_matches("/metrics").to_string());
            }
        }
    });
    let bench_metrics = bench_metrics
        .recv_timeout(BOUND)
        .expect("bench prints its metrics address");

    // While it runs: both sides count, and the target's count only grows.
    let mut during = Vec::new();
    let mut submitted = 0.0;
    let end = Instant::now() + BOUND * 2;
    while bench.0.try_wait().expect("waitable").is_none() {
        assert!(Instant::now() < end, "bench did not finish");
        during.push(written(&scrape(&serve_metrics)));
        if let Ok(text) = minreq::get(format!("http://{bench_metrics}/metrics"))
            .with_timeout(10)
            .send()
        {
            let scrape = parse(text.as_str().expect("UTF-8"));
            submitted = value(
                &scrape,
                "railyard_submitted_bytes_total",
                &[("op", "write")],
            )
            .max(submitted);
            assert_eq!(
                value(&scrape, "railyard_submitted_bytes_total", &[("op", "read")]),
                0.0
            );
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let mut stdout = Vec::new();
    bench
        .0
        .stdout
        .take()
        .expect("piped")
        .read_to_end(&mut stdout)
        .expect("bench's report");
    assert!(bench.0.wait().expect("waitable").success(), "bench failed");
    let report: serde_json::Value = serde_json::from_slice(&stdout).expect("bench prints JSON");
    assert_eq!(report["failed_requests"], 0);
    let bench_bytes = report["bytes"].as_u64().expect("bytes");
    assert!(bench_bytes > 0);

    assert!(
        during
            .iter()
            .any(|&bytes| bytes > 0.0 && bytes < bench_bytes as f64),
        "no scrape saw the bench in progress: {during:?}"
    );
    assert!(
        during.windows(2).all(|pair| pair[0] <= pair[1]),
        "{during:?}"
    );
    assert!(submitted > 0.0, "the bench's own metrics counted nothing");
    let after = scrape(&serve_metrics);
    assert_eq!(written(&after), bench_bytes as f64);
    assert_eq!(
        value(&after, "railyard_served_bytes_total", &[("op", "read")]),
        0.0
    );
    assert!(
        value(
            &after,
            "railyard_queue_pairs_created_total",
            &[("side", "passive")]
        ) >= 1.0
    );

    let missing = minreq::get(format!("http://{serve_metrics}/other"))
        .with_timeout(10)
        .send()
        .expect("answers");
    assert_eq!(missing.status_code, 404);
}

#[test]
fn failure_counters_match_the_failures_injected_and_seen() {
    let serve = Serve::start("16MiB");
    let engine = Engine::builder("metrics-faults")
        .fabric(FabricChoice::Soft)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .slice_size(64 * 1024)
        .build()
        .expect("the engine starts");
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine.alloc(1 << 20, None).expect("memory");
    let mut submitter = engine.submitter().expect("a submitter");
    // One slice per transfer: each outcome is one slice's.
    let writes: Vec<Transfer> = (0..16)
        .map(|i| Transfer {
            op: Op::Write,
            local: source,
            local_offset: i << 16,
            remote_addr: serve.pool_base + (i << 16),
            len: 1 << 16,
        })
        .collect();
    engine.faults(0).expect("a soft rail").add(Fault::Random {
        on: QpMatch::Any,
        per_million: 200_000,
        status: WcStatus::RemAccessErr,
    });
    let mut seen: HashMap<&'static str, u64> = HashMap::new();
    let mut done = 0u64;
    for _ in 0..20 {
        let batch = submitter.submit(&peer, &writes).expect("submitted");
        batch.wait(Instant::now() + BOUND);
        for outcome in batch.outcomes() {
            match outcome.expect("resolved") {
                RequestOutcome::Done => done += 1,
                RequestOutcome::Failed(reason) => *seen.entry(reason.as_str()).or_default() += 1,
            }
        }
    }
    engine.faults(0).expect("a soft rail").clear();
    let metrics = parse(&engine.metrics_text());
    assert!(
        seen.get("remote_access").copied().unwrap_or(0) > 0,
        "the injected faults were seen: {seen:?}"
    );
    for reason in railyard::dataplane::FailReason::ALL {
        let reason = reason.as_str();
        assert_eq!(
            value(
                &metrics,
                "railyard_slices_failed_total",
                &[("reason", reason)]
            ),
            seen.get(reason).copied().unwrap_or(0) as f64,
            "{reason}: the application saw {seen:?}"
        );
    }
    assert_eq!(
        value(&metrics, "railyard_slices_completed_total", &[]),
        done as f64
    );
    let incarnation = peer.incarnation().to_string();
    let peer_labels = [("peer", peer.name()), ("incarnation", incarnation.as_str())];
    assert_eq!(
        value(
            &metrics,
            "railyard_submitted_requests_total",
            &[peer_labels[0], peer_labels[1], ("op", "write")]
        ),
        20.0 * 16.0
    );
    assert_eq!(
        value(
            &metrics,
            "railyard_submitted_bytes_total",
            &[peer_labels[0], peer_labels[1], ("op", "write")]
        ),
        20.0 * 16.0 * 65536.0
    );
    // Opening the peer took a queue-pair handshake; the reconnects after faults took more.
    let handshakes = value(&metrics, "railyard_handshake_duration_seconds_count", &[]);
    assert!(handshakes >= 1.0, "{handshakes}");
    assert!(handshakes <= 1.0 + value(&metrics, "railyard_reconnects_total", &[]));
    // Its endpoint is in exactly one state.
    assert_eq!(
        value(&metrics, "railyard_endpoint_state", &peer_labels),
        1.0
    );
}

#[test]
fn the_metrics_page_documents_every_metric_and_no_other() {
    let serve = Serve::start("4MiB");
    let engine = Engine::builder("metrics-docs")
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    engine.open(&serve.addr).expect("the target answers");
    let exported: BTreeSet<String> = parse(&engine.metrics_text()).docs.into_keys().collect();
    assert!(exported.len() > 30, "{exported:?}");
    let page = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/logs-and-metrics.md");
    let page = std::fs::read_to_string(page).expect("the metrics page");
    let documented: BTreeSet<String> = page
        .lines()
        .filter_map(|line| line.strip_prefix("| `railyard_"))
        .filter_map(|rest| rest.split('`').next())
        .map(|name| format!("railyard_{name}"))
        .collect();
    assert_eq!(exported, documented);
}

#[test]
fn the_metrics_server_does_not_keep_its_engine_running() {
    let engine = Engine::builder("metrics-weak")
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let server = railyard::metrics::MetricsServer::start(
        &engine,
        "127.0.0.1:0".parse().expect("an address"),
    )
    .expect("binds");
    let addr = server.addr().to_string();
    let live = scrape(&addr);
    assert_eq!(
        value(&live, "railyard_engine_info", &[("engine", "metrics-weak")]),
        1.0
    );
    let control = engine.addr();
    drop(engine);
    // Stopped: its handshake listener is closed, and the server says so.
    assert!(std::net::TcpStream::connect(control).is_err());
    let gone = minreq::get(format!("http://{addr}/metrics"))
        .with_timeout(10)
        .send()
        .expect("answers");
    assert_eq!(gone.status_code, 503);
}

#[test]
fn serve_keeps_at_most_max_half_open_silent_data_connections_and_counts_the_rest() {
    const CAP: usize = 2;
    const SILENT: usize = 20;
    let serve = Serve::start_with(
        "4MiB",
        &[
            "--rails",
            "1",
            "--fabric",
            "tcp",
            "--metrics",
            "127.0.0.1:0",
            "--max-half-open",
            &CAP.to_string(),
        ],
    );
    let metrics = serve
        .metrics
        .clone()
        .expect("serve says where its metrics are");
    let engine = Engine::builder("half-open-probe")
        .fabric(FabricChoice::Tcp)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let peer = engine.open(&serve.addr).expect("the target answers");
    let data_port = peer.descriptor().rails[0].tcp_port;
    let data_addr = std::net::SocketAddr::new(peer.addr().ip(), data_port);
    // Connections that never say hello, held open for the whole test: the target closes
    // all but CAP of them (the default cap, 64, would keep every one until its hello
    // deadline, and count none).
    let _silent: Vec<std::net::TcpStream> = (0..SILENT)
        .map(|_| std::net::TcpStream::connect(data_addr).expect("the data port accepts"))
        .collect();
    // Closed once 20 ms old (the grace for a hello on its way), normally all of those
    // beyond the cap long before their 2 s hello deadline, which closes without counting
    // (a poller stalled that long lets the deadline take some first).
    let beyond_cap = (SILENT - CAP) as f64;
    let deadline = Instant::now() + BOUND;
    let mut closed;
    loop {
        closed = value(
            &scrape(&metrics),
            "railyard_tcp_half_open_closed_total",
            &[],
        );
        if closed >= beyond_cap || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        (1.0..=beyond_cap).contains(&closed),
        "{closed} silent connections closed for a cap of {CAP}, of {SILENT}"
    );
}
