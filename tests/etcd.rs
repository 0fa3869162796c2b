//! The etcd directory against a real etcd (`etcd` from the distribution's `etcd-server`,
//! which `make test` installs), started per test on free loopback ports with a temporary
//! data directory and stopped afterwards: discovery by name, two claims of one name, a
//! killed and a frozen peer failing fast within the lease bound while another goes on (the frozen one
//! back by itself once it runs again), a restart
//! seen as a new incarnation, an etcd outage that connected peers ride out, and etcd over
//! TLS with its authentication on (records of engines with a cluster secret hold no
//! regions).

#![cfg(feature = "etcd")]

mod common;

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{BOUND, Serve, bytes_of, done, read_back};
use railyard::chaos::etcd_server::{EtcdServer, EtcdTls};
use railyard::control::WarningKind;
use railyard::dataplane::IdleStrategy;
use railyard::engine::{BuildError, DirectoryChoice, Engine, Op, Peer, PeerError, Transfer};

/// Lease time to live in these tests (seconds).
const TTL: u64 = 2;

/// A real etcd whose clients use leases of [`TTL`].
type Etcd = EtcdServer;

/// The tests that time failures (and the soak, which loads both cores) take turns.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

fn etcd() -> Etcd {
    EtcdServer::start(TTL).expect("etcd runs (install etcd-server; `make test` does)")
}

fn engine(name: &str, etcd: &Etcd) -> Engine {
    Engine::builder(name)
        .directory(DirectoryChoice::Etcd(etcd.url()))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts and publishes itself")
}

fn serve(name: &str, etcd: &Etcd) -> Serve {
    Serve::start_named(name, "8MiB", &["--rails", "1", "--directory", &etcd.url()])
}

/// Writes 1 MiB to the peer's first region and reads it back; true when every byte came
/// back.
fn round_trip(engine: &Engine, peer: &Peer, fill: u8) -> bool {
    let source = engine.alloc(1 << 20, None).expect("alloc");
    let back = engine.alloc(1 << 20, None).expect("alloc");
    bytes_of(source).fill(fill);
    let write = [Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: peer.descriptor().regions[0].base,
        len: 1 << 20,
    }];
    let mut submitter = engine.submitter().expect("submitter");
    let ok = submitter
        .submit(peer, &write)
        .is_ok_and(|batch| done(&batch))
        && submitter
            .submit(peer, &read_back(&write, back))
            .is_ok_and(|batch| done(&batch))
        && bytes_of(back).iter().all(|&b| b == fill);
    let _ = engine.deregister(source);
    let _ = engine.deregister(back);
    ok
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(child.id() as i32, signal) };
    if signal == libc::SIGSTOP {
        common::wait_until_stopped(child.id());
    }
}

#[test]
fn peers_are_found_by_name_and_a_name_is_held_by_one_live_process() {
    let etcd = etcd();
    let a = serve("decode-a", &etcd);
    let prefill = engine("prefill-0", &etcd);
    let peer = prefill.open("decode-a").expect("found by name");
    // Registration and deregistration publish the descriptor again: another engine sees
    // prefill-0's regions come and go.
    let observer = engine("observer-0", &etcd);
    let regions_of = |name: &str| observer.lookup(name).map(|d| d.regions.len());
    let wait_for = |name: &str, regions: usize| {
        let end = Instant::now() + BOUND;
        while regions_of(name).ok() != Some(regions) {
            assert!(
                Instant::now() < end,
                "{name}: {:?} regions",
                regions_of(name)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for("prefill-0", 0);
    let first = prefill.alloc(1 << 20, None).unwrap();
    let second = prefill.alloc(1 << 20, None).unwrap();
    wait_for("prefill-0", 2);
    prefill.deregister(first).unwrap();
    wait_for("prefill-0", 1);
    prefill.deregister(second).unwrap();
    wait_for("prefill-0", 0);
    assert_eq!(
        observer.lookup("decode-a").unwrap().incarnation,
        peer.incarnation()
    );
    assert_eq!(peer.name(), "decode-a");
    assert_eq!(peer.incarnation().to_string(), a.incarnation);
    assert!(round_trip(&prefill, &peer, 0x5A));

    // A second process claiming the name waits out one lease, then is refused.
    let started = Instant::now();
    let second = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--name", "decode-a"])
        .args(["--pool", "1MiB", "--directory", &etcd.url()])
        .output()
        .expect("runs");
    assert_eq!(second.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("\"decode-a\" is held by another live process"),
        "{stderr}"
    );
    assert!(started.elapsed() < BOUND);
    // The holder was not disturbed.
    assert!(round_trip(&prefill, &peer, 0x3C));

    // bench finds its target by name too.
    let bench = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "--directory", &etcd.url(), "--target", "decode-a"])
        .args([
            "--duration",
            "0.3",
            "--json",
            "--check",
            "--batch",
            "8",
            "--rails",
            "1",
        ])
        .output()
        .expect("runs");
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&bench.stdout).expect("json");
    assert_eq!(report["check"]["mismatches"], 0);

    // Names nobody holds, names without a directory, and an unreachable etcd.
    match prefill.open("decode-nobody") {
        Err(PeerError::UnknownName { reason, .. }) => {
            assert!(reason.contains("no live segment"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let p2p = Engine::builder("p2p").build().expect("starts");
    assert!(matches!(
        p2p.open("decode-a"),
        Err(PeerError::UnknownName { reason, .. }) if reason.contains("directory")
    ));
    let closed = free_port();
    match Engine::builder("lost")
        .directory(DirectoryChoice::Etcd(format!("etcd://127.0.0.1:{closed}")))
        .build()
    {
        Err(BuildError::Directory(reason)) => {
            assert!(
                reason.contains(&format!("cannot reach etcd at 127.0.0.1:{closed}")),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn killed_and_frozen_peers_fail_fast_while_the_others_go_on_and_the_frozen_one_comes_back() {
    let _turn = one_at_a_time();
    let etcd = etcd();
    let killed = serve("decode-killed", &etcd);
    let frozen = serve("decode-frozen", &etcd);
    let _healthy = serve("decode-healthy", &etcd);
    let prefill = engine("prefill-1", &etcd);
    let to_killed = prefill.open("decode-killed").unwrap();
    let to_frozen = prefill.open("decode-frozen").unwrap();
    let to_healthy = prefill.open("decode-healthy").unwrap();
    assert!(round_trip(&prefill, &to_frozen, 1));

    signal(&killed.child, libc::SIGKILL);
    signal(&frozen.child, libc::SIGSTOP);
    let signalled = Instant::now();
    // A stopped process keeps its sockets open and its memory writable: only its silence
    // on the control connection, then its lease, say it is gone.
    let mut transfers_to_healthy = 0;
    while !(to_killed.is_unavailable() && to_frozen.is_unavailable()) {
        assert!(
            signalled.elapsed() < Duration::from_secs(TTL) + BOUND,
            "not failing fast"
        );
        assert!(round_trip(
            &prefill,
            &to_healthy,
            transfers_to_healthy as u8
        ));
        transfers_to_healthy += 1;
    }
    let unavailable_after = signalled.elapsed();
    assert!(
        unavailable_after < Duration::from_secs(TTL + 2),
        "failing fast only {unavailable_after:?} after the signals (lease {TTL} s)"
    );
    assert!(transfers_to_healthy > 0);
    // A transfer to it fails at once, not at its deadline.
    let started = Instant::now();
    assert!(!round_trip(&prefill, &to_frozen, 9));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(round_trip(&prefill, &to_healthy, 0xEE));
    // Let its lease run out, then let it run: it claims its name again, and the same Peer
    // carries traffic without being opened again. Nothing was retired.
    std::thread::sleep(Duration::from_secs(TTL + 1));
    signal(&frozen.child, libc::SIGCONT);
    let resumed = Instant::now();
    while !round_trip(&prefill, &to_frozen, 0x42) {
        assert!(resumed.elapsed() < BOUND, "the frozen peer never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!to_frozen.is_retired());
    assert!(!to_killed.is_retired(), "a lost lease is not a restart");
    assert!(to_killed.is_unavailable());
}

#[test]
fn a_peer_restarted_under_the_same_name_is_a_new_incarnation() {
    let etcd = etcd();
    let first = serve("decode-r", &etcd);
    let prefill = engine("prefill-2", &etcd);
    let old = prefill.open("decode-r").unwrap();
    assert!(round_trip(&prefill, &old, 7));
    signal(&first.child, libc::SIGKILL);
    // The new process's claim waits for the dead one's lease to expire.
    let second = serve("decode-r", &etcd);
    assert_ne!(second.incarnation, first.incarnation);
    let end = Instant::now() + BOUND;
    while !old.is_retired() {
        assert!(
            Instant::now() < end,
            "the old incarnation's endpoints never retired"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let new = loop {
        let peer = prefill.open("decode-r");
        if let Ok(peer) = peer.as_ref() {
            if peer.incarnation().to_string() == second.incarnation {
                break peer.clone();
            }
        }
        assert!(
            Instant::now() < end,
            "the new incarnation never resolved: {peer:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(round_trip(&prefill, &new, 8));
    assert!(
        !round_trip(&prefill, &old, 9),
        "the old incarnation is gone"
    );
}

#[test]
fn an_etcd_outage_leaves_connected_peers_working_and_recovers_by_itself() {
    let _turn = one_at_a_time();
    let mut etcd = etcd();
    let mut a = serve("decode-o", &etcd);
    let prefill = engine("prefill-3", &etcd);
    let peer = prefill.open("decode-o").unwrap();
    assert!(round_trip(&prefill, &peer, 0x70));
    // (the initiator's reconnects and teardowns, the target's)
    let churn = |engine: &Engine, serve: &mut Serve| {
        let stats = engine.stats().control;
        let target = serve.command("stats");
        let count = |name: &str| -> u64 {
            target
                .split_whitespace()
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                .and_then(|value| value.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {target:?}"))
        };
        (
            stats.reconnects,
            stats.teardowns,
            count("reconnects"),
            count("teardowns"),
        )
    };
    let before_outage = churn(&prefill, &mut a);
    let warnings =
        |engine: &Engine| engine.stats().control.warnings[WarningKind::Directory.index()];
    let before = warnings(&prefill);
    etcd.stop();
    // Two leases' worth of outage: transfers between connected peers go on.
    let outage = Instant::now();
    let mut rounds = 0u8;
    while outage.elapsed() < Duration::from_secs(2 * TTL) {
        assert!(
            round_trip(&prefill, &peer, rounds),
            "round {rounds} in the outage"
        );
        rounds = rounds.wrapping_add(1);
    }
    assert!(!peer.is_retired());
    assert!(warnings(&prefill) > before, "the outage is reported");
    etcd.run().expect("etcd starts again");
    // A process that registers after the restart is found, and the one from before is
    // published again.
    let _b = serve("decode-p", &etcd);
    let end = Instant::now() + BOUND;
    let late = loop {
        match prefill.open("decode-p") {
            Ok(peer) => break peer,
            Err(error) => assert!(Instant::now() < end, "never found decode-p: {error}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(round_trip(&prefill, &late, 0x77));
    let newcomer = engine("prefill-4", &etcd);
    let again = loop {
        match newcomer.open("decode-o") {
            Ok(peer) => break peer,
            Err(error) => assert!(Instant::now() < end, "decode-o not republished: {error}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(round_trip(&newcomer, &again, 0x78));
    assert!(round_trip(&prefill, &peer, 0x79));
    // Both sides lost their leases and claimed their names again; the data connection
    // between them stayed: no reconnect, no teardown on either side.
    assert_eq!(churn(&prefill, &mut a), before_outage);
}

/// The soak with etcd: every process published there, targets opened by name, and etcd
/// stopped and started again among the kills, stops, queue-pair errors and key rotations:
/// nothing lost or misdirected, and live targets neither fail fast nor stall while etcd is
/// down.
#[test]
fn half_a_minute_of_soak_with_etcd_restarts_loses_nothing() {
    let _turn = one_at_a_time();
    let output = common::output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["chaos", "soak", "--etcd", "--json"])
            .args(["--duration", "30", "--seed", "8"]),
        Duration::from_secs(120),
    );
    let counts: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert!(output.status.success(), "{counts}");
    assert_eq!(counts["passed"], true, "{counts}");
    assert!(counts["etcd_restarts"].as_u64() >= Some(1), "{counts}");
    assert_eq!(counts["unavailable_during_etcd_outage"], 0, "{counts}");
    assert_eq!(counts["stalled_during_etcd_outage"], 0, "{counts}");
    assert_eq!(counts["lost"], 0, "{counts}");
    assert_eq!(counts["misdirected_blocks"], 0, "{counts}");
    assert!(counts["bytes_verified"].as_u64() > Some(0), "{counts}");
}

/// A CA and a certificate for 127.0.0.1 signed by it, made with `openssl` in `dir`:
/// (CA certificate, server certificate and key).
fn certificates(dir: &std::path::Path) -> (std::path::PathBuf, EtcdTls) {
    std::fs::create_dir_all(dir).expect("a directory");
    let run = |args: &[&str]| {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl runs (install openssl; `make deps` does)");
        assert!(output.status.success(), "openssl {args:?}: {output:?}");
    };
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").expect("writes");
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=railyard-test-ca",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    ]);
    (
        dir.join("ca.pem"),
        EtcdTls {
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
        },
    )
}

/// Turns etcd's authentication on with user `root` and `password`, as an operator would.
fn enable_authentication(etcd: &Etcd, ca: &std::path::Path, password: &str) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let pem = std::fs::read(ca).expect("the CA");
        let options = etcd_client::ConnectOptions::new().with_tls(
            etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(pem)),
        );
        let mut client = etcd_client::Client::connect([etcd.endpoint()], Some(options))
            .await
            .expect("connects over TLS");
        client
            .user_add("root", password, None)
            .await
            .expect("adds root");
        client
            .user_grant_role("root", "root")
            .await
            .expect("grants root");
        client.auth_enable().await.expect("enables authentication");
    });
}

#[test]
fn a_directory_over_tls_with_credentials_serves_members_and_refuses_the_rest() {
    let _turn = one_at_a_time();
    let dir = std::env::temp_dir().join(format!("railyard-etcd-tls-{}", std::process::id()));
    let (ca, tls) = certificates(&dir);
    let etcd = EtcdServer::start_with(TTL, Some(tls)).expect("etcd runs over TLS");
    enable_authentication(&etcd, &ca, "s3cret-root");
    let credentials = dir.join("credentials");
    std::fs::write(&credentials, "root:s3cret-root\n").expect("writes");
    let secured = format!(
        "{}&ca={}&credentials={}",
        etcd.url(),
        ca.display(),
        credentials.display()
    );
    let cluster = railyard::engine::ClusterSecret::new(vec![5u8; 32]).expect("long enough");
    let build = |name: &str, url: String| {
        Engine::builder(name)
            .directory(DirectoryChoice::Etcd(url))
            .secret(cluster.clone())
            .idle(IdleStrategy::gentle())
            .build()
    };
    let target = build("decode-tls", secured.clone()).expect("publishes over TLS");
    let pool = target.alloc(1 << 20, None).expect("a pool");
    // An engine without a cluster secret, whose record does list its regions: once its
    // pool shows there, the secret-holding target's later record has landed too.
    let open_target = Engine::builder("decode-open")
        .directory(DirectoryChoice::Etcd(secured.clone()))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("publishes over TLS");
    open_target.alloc(1 << 16, None).expect("a pool");
    let initiator = build("prefill-tls", secured).expect("joins over TLS");
    let published = Instant::now() + BOUND;
    while initiator
        .lookup("decode-open")
        .map_or(true, |record| record.regions.is_empty())
    {
        assert!(
            Instant::now() < published,
            "the open target's pool was never published"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The directory holds where to find the target, not its regions and keys: the
    // authenticated handshake hands those out.
    let record = initiator.lookup("decode-tls").expect("published");
    assert!(record.regions.is_empty(), "{record:?}");
    let peer = initiator.open("decode-tls").expect("found by name");
    assert_eq!(peer.descriptor().regions[0].base, pool.addr);
    assert!(round_trip(&initiator, &peer, 0x3c));

    // No credentials; no CA; plain text to a TLS port: each refused, saying why.
    let no_credentials = format!("{}&ca={}", etcd.url(), ca.display());
    let plain = etcd.url().replacen("etcd+tls://", "etcd://", 1);
    for (what, url) in [("no credentials", no_credentials), ("plain text", plain)] {
        let error = build("intruder", url)
            .err()
            .unwrap_or_else(|| panic!("{what}: joined"));
        assert!(matches!(error, BuildError::Directory(_)), "{what}: {error}");
    }
    let Err(error) = build("intruder", etcd.url()) else {
        panic!("no CA: joined");
    };
    assert!(error.to_string().contains("ca=FILE"), "{error}");
    drop((peer, initiator, target, open_target));
    let _ = std::fs::remove_dir_all(dir);
}
