//! The CLI's log events go through `tracing` to stderr: `--log-format json` gives one JSON
//! object per line with the event's fields, `--log` filters (a level or `RUST_LOG`
//! directives), the default shows warnings only, and a filter that does not parse is a
//! one-line error. Control-plane warnings carry fields and are rate-limited; a peer's
//! handshake and an endpoint's life are spans naming the incarnation.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::num::NonZeroUsize;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, RailChoice};

mod common;

const BOUND: Duration = Duration::from_secs(30);

/// Runs `railyard serve` with `log_args` until it has printed its first line, then closes
/// its stdin: that first line and every stderr line.
fn serve_with(log_args: &[&str]) -> (String, Vec<String>) {
    serve_while(log_args, |_| {})
}

/// As [`serve_with`], running `meanwhile` with serve's address before closing its stdin.
fn serve_while(log_args: &[&str], meanwhile: impl FnOnce(&str)) -> (String, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--pool",
            "4MiB",
            "--rails",
            "1",
        ])
        .arg("--until-stdin-closes")
        .args(log_args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    // Read to the end, so that serve never writes into a closed pipe.
    let stdout = child.stdout.take().expect("piped");
    let (first_line, first) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = first_line.send(line);
        }
        lines.for_each(drop);
    });
    let first = first.recv_timeout(BOUND).expect("a first line");
    meanwhile(first.split_whitespace().nth(1).expect("listening ADDR ..."));
    drop(child.stdin.take());
    let end = Instant::now() + BOUND;
    while child.try_wait().expect("waitable").is_none() {
        assert!(
            Instant::now() < end,
            "serve did not stop when its stdin closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = errors
        .join()
        .expect("the reader")
        .lines()
        .map(str::to_string)
        .collect();
    (first, lines)
}

#[test]
fn json_log_lines_carry_the_events_fields() {
    let (first, lines) = serve_with(&["--log", "info", "--log-format", "json"]);
    let addr = first.split_whitespace().nth(1).expect("listening ADDR ...");
    let events: Vec<serde_json::Value> = lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect();
    let serving = events
        .iter()
        .find(|event| event["fields"]["message"] == "serving")
        .unwrap_or_else(|| panic!("no serving event in {lines:?}"));
    assert_eq!(serving["level"], "INFO");
    assert_eq!(serving["target"], "railyard::serve");
    assert_eq!(serving["fields"]["addr"], addr);
    assert_eq!(serving["fields"]["pool_bytes"], 4 << 20);
    assert!(serving["fields"]["incarnation"].is_string());
    assert!(serving["fields"]["engine"].is_string());
    assert!(serving["timestamp"].is_string());
}

#[test]
fn the_default_shows_warnings_only_and_a_bad_filter_is_one_line() {
    let (_, lines) = serve_with(&[]);
    assert!(
        lines.iter().all(|line| !line.contains("INFO")),
        "info events at the default level: {lines:?}"
    );
    let (_, lines) = serve_with(&["--log", "railyard::serve=info"]);
    assert!(
        lines
            .iter()
            .any(|line| line.contains("INFO") && line.contains("serving")),
        "{lines:?}"
    );

    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "serve",
            "--log",
            "nonsense[[",
            "--pool",
            "4MiB",
            "--until-stdin-closes",
        ])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("railyard: error: --log"), "{stderr}");
}

fn json_lines(lines: &[String]) -> Vec<serde_json::Value> {
    lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect()
}

#[test]
fn control_warnings_have_fields_and_a_storm_of_them_is_cut_short() {
    const CLIENTS: usize = 12;
    let (_, lines) = serve_while(&["--log-format", "json"], |addr| {
        for _ in 0..CLIENTS {
            let mut client = TcpStream::connect(addr).expect("connects");
            client.write_all(&[0xff; 64]).expect("sends");
            // Serve closes a connection that is not railyard's: wait for it.
            client
                .set_read_timeout(Some(BOUND))
                .expect("a read timeout");
            let mut rest = Vec::new();
            let _ = client.read_to_end(&mut rest);
        }
    });
    let events = json_lines(&lines);
    let closed: Vec<&serde_json::Value> = events
        .iter()
        .filter(|event| event["fields"]["kind"] == "connection")
        .collect();
    assert_eq!(closed.len(), 5, "a burst of 5 per kind: {lines:?}");
    for event in closed {
        assert_eq!(event["level"], "WARN");
        assert_eq!(event["target"], "railyard::control");
        let fields = &event["fields"];
        assert!(fields["engine"].is_string());
        let addr: std::net::SocketAddr = fields["addr"]
            .as_str()
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("no addr: {event}"));
        assert!(addr.ip().is_loopback());
        assert!(
            fields["reason"]
                .as_str()
                .is_some_and(|reason| reason.contains("malformed frame")),
            "{event}"
        );
        assert!(
            !fields["message"]
                .as_str()
                .unwrap_or_default()
                .contains(&addr.to_string())
        );
    }
}

/// Collects what a subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("captured").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn one_search_for_an_incarnation_tells_its_story_on_both_sides() {
    // This process's own events (the initiator's endpoint), as JSON with their spans.
    let captured = Captured::default();
    let writer = captured.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .json()
            .with_env_filter("railyard=info")
            .with_writer(move || writer.clone())
            .finish(),
    )
    .expect("the only subscriber of this test binary");
    let engine = Engine::builder("prefill-logging")
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let own_incarnation = engine.incarnation().to_string();
    let mut serve_incarnation = String::new();
    let (first, lines) = serve_while(
        &["--log", "railyard::control=info", "--log-format", "json"],
        |addr| {
            let peer = engine.open(addr).expect("serve answers");
            serve_incarnation = peer.incarnation().to_string();
            drop(peer);
        },
    );
    drop(engine);
    assert!(first.contains(&serve_incarnation));

    // Serve's side: the handshake span of our connection names our incarnation.
    assert_eq!(
        incarnation_in_span_of(&json_lines(&lines), "peer said Hello"),
        own_incarnation
    );
    // Our side: the endpoint to serve lived inside a span naming serve's incarnation.
    let text = String::from_utf8(captured.0.lock().expect("captured").clone()).expect("UTF-8");
    let own: Vec<String> = text.lines().map(str::to_string).collect();
    let story: Vec<String> = json_lines(&own)
        .iter()
        .filter(|event| event["span"]["name"] == "endpoint")
        .filter(|event| event["span"]["incarnation"] == serve_incarnation.as_str())
        .inspect(|event| {
            // Its own span only: not nested in a connection's (nor in an older endpoint's).
            assert_eq!(event["spans"].as_array().map(Vec::len), Some(1), "{event}");
        })
        .map(|event| {
            event["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    for step in [
        "endpoint opened",
        "queue pair offered",
        "queue pair connected",
    ] {
        assert!(story.iter().any(|m| m == step), "no {step:?} in {story:?}");
    }
}

/// The incarnation in the `handshake` span of the event with `message`.
fn incarnation_in_span_of(events: &[serde_json::Value], message: &str) -> String {
    let event = events
        .iter()
        .find(|event| event["fields"]["message"] == message)
        .unwrap_or_else(|| panic!("no {message:?} in {events:?}"));
    assert_eq!(event["span"]["name"], "handshake", "{event}");
    assert_eq!(event["span"]["peer"], "prefill-logging", "{event}");
    event["span"]["incarnation"]
        .as_str()
        .expect("an incarnation")
        .to_string()
}

/// Runs `railyard serve --listen LISTEN` until its first line and returns its stderr
/// lines that warn about authentication.
fn authentication_warnings(listen: &str) -> Vec<String> {
    let output = common::output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args([
                "serve", "--listen", listen, "--pool", "4MiB", "--rails", "2",
            ])
            .arg("--until-stdin-closes")
            .env_remove("RUST_LOG")
            .env_remove("RAILYARD_SECRET_FILE")
            .stdin(Stdio::null()),
        BOUND,
    );
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| line.contains("not authenticated"))
        .map(str::to_string)
        .collect()
}

#[test]
fn only_an_engine_others_can_reach_warns_that_peers_are_not_authenticated() {
    assert_eq!(
        authentication_warnings("127.0.0.1:0"),
        Vec::<String>::new(),
        "an engine on loopback only is reached by this host alone"
    );
    let warnings = authentication_warnings("0.0.0.0:0");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("--secret-file FILE or RAILYARD_SECRET_FILE=FILE"),
        "it says how to set a secret: {warnings:?}"
    );
}
