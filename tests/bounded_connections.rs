//! What one connection may cost a target is bounded: a peer that sends and never reads, a
//! peer that never finishes its frames, and ten thousand connections at once leave a
//! `railyard serve` process's memory within a few MiB of where it was; a peer with real
//! work keeps moving bytes throughout, and a new peer gets in during the flood.

mod common;

use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{BOUND, Serve, bytes_of, done, rss_kib};
use railyard::control::wire::{HEADER_LEN, MAGIC, MAX_BODY, Message, VERSION};
use railyard::control::{HostId, Incarnation};
use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, Op, RailChoice, Transfer};

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Lets this process (and the target it starts) hold `wanted` descriptors, or as many as
/// the hard limit allows; returns how many.
fn raise_descriptor_limit(wanted: u64) -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit the call writes.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 0;
    }
    limit.rlim_cur = limit.rlim_max.min(wanted);
    // SAFETY: `limit` is a valid rlimit the call reads.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    limit.rlim_cur
}

fn hello(name: &str, incarnation: u64) -> Vec<u8> {
    Message::Hello {
        name: name.into(),
        incarnation: Incarnation(incarnation),
        host: HostId::this_process(),
        listen: String::new(),
        nonce: [0; railyard_control::wire::NONCE_LEN],
        encrypt: false,
    }
    .encode()
}

/// A peer that asks for the descriptor over and over and never reads an answer: the
/// target closes it once its answers pass the output bound (4 MiB), instead of queueing
/// them forever. Returns once the target has closed it.
fn never_reads(addr: SocketAddr) {
    // A small receive buffer of its own: with the kernel's autotuning (up to tcp_rmem's
    // maximum, 32 MiB on some hosts) this side alone could hold most of the answers, and
    // the bound below would say nothing about the target.
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    socket
        .set_recv_buffer_size(256 << 10)
        .expect("a receive buffer size");
    socket.connect(&addr.into()).expect("connects");
    let mut stream: TcpStream = socket.into();
    stream.write_all(&hello("never-reads", 1)).expect("writes");
    // Requests in rounds of about 1 MiB, whose answers are about 10 MiB a round, and not
    // one answer read: more than the kernel's buffers on both sides and the target's bound
    // together after two rounds. Once the target closes this peer, a write fails (reset or
    // broken pipe). (Reading answers between rounds would let a fast target answer them all
    // within its bound, and prove nothing.)
    let request = Message::GetDescriptor.encode();
    let round: Vec<u8> = request
        .iter()
        .copied()
        .cycle()
        .take(request.len() * 100_000)
        .collect();
    stream.set_write_timeout(Some(BOUND)).expect("a timeout");
    const ROUNDS: usize = 12;
    for sent in 0..ROUNDS {
        match stream.write_all(&round) {
            Ok(()) => {}
            Err(error)
                if matches!(
                    error.kind(),
                    ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
                ) =>
            {
                return;
            }
            Err(error) => {
                panic!(
                    "the target neither read nor closed a peer that does not read ({sent} rounds in): {error}"
                )
            }
        }
    }
    panic!(
        "the target kept a peer that does not read through {ROUNDS} rounds of requests \
         (about {} MiB of answers)",
        ROUNDS * 10
    );
}

/// Connections that each start a frame of the largest size and never finish it, and one
/// that trickles a frame a byte at a time.
fn partial_frames(addr: SocketAddr, connections: usize) -> Vec<TcpStream> {
    let mut header = Vec::new();
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&6u16.to_le_bytes()); // Notify
    header.extend_from_slice(&(MAX_BODY as u32).to_le_bytes());
    assert_eq!(header.len(), HEADER_LEN);
    (0..connections)
        .map(|i| {
            let mut stream = TcpStream::connect(addr).expect("connects");
            let mut bytes = hello("partial", 100 + i as u64);
            bytes.extend_from_slice(&header);
            bytes.extend(std::iter::repeat_n(0u8, MAX_BODY / 2));
            stream.write_all(&bytes).expect("writes");
            stream
        })
        .collect()
}

/// `count` connections started at once (non-blocking), none saying anything.
fn flood(addr: SocketAddr, count: usize) -> Vec<socket2::Socket> {
    (0..count)
        .filter_map(|_| {
            let socket =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
            socket.set_nonblocking(true).ok()?;
            let _ = socket.connect(&addr.into());
            Some(socket)
        })
        .collect()
}

#[test]
fn abusive_connections_leave_the_target_bounded_and_other_peers_moving() {
    const FLOOD: usize = 10_000;
    let descriptors = raise_descriptor_limit(FLOOD as u64 + 1024);
    let target = Serve::start_named("decode", "4MiB", &["--rails", "1"]);
    let addr: SocketAddr = target.addr.parse().expect("an address");
    let engine = Engine::builder("prefill")
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let peer = engine.open(&target.addr).expect("the target answers");
    let pid = target.child.id();

    let stop = AtomicBool::new(false);
    let (moved, peak) = (AtomicU64::new(0), AtomicU64::new(0));
    let baseline = std::thread::scope(|scope| {
        // The good peer: write, read back, compare, all along.
        let worker = scope.spawn(|| {
            let source = engine.alloc(64 << 10, None).expect("memory");
            let back = engine.alloc(64 << 10, None).expect("memory");
            let mut submitter = engine.submitter().expect("a submitter");
            let mut round = 0u8;
            while !stop.load(Ordering::Relaxed) {
                round = round.wrapping_add(1);
                bytes_of(source).fill(round);
                let write = Transfer {
                    op: Op::Write,
                    local: source,
                    local_offset: 0,
                    remote_addr: target.pool_base,
                    len: 64 << 10,
                };
                let read = Transfer {
                    op: Op::Read,
                    local: back,
                    ..write
                };
                assert!(done(&submitter.submit(&peer, &[write]).expect("submitted")));
                assert!(done(&submitter.submit(&peer, &[read]).expect("submitted")));
                assert!(bytes_of(back).iter().all(|&byte| byte == round));
                moved.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Stops the worker however this closure ends: a failed assertion must not leave the
        // scope waiting for it forever.
        let stop_worker = StopOnDrop(&stop);
        let wait_moving = |since: u64| {
            let end = Instant::now() + BOUND;
            while moved.load(Ordering::Relaxed) < since + 20 {
                assert!(Instant::now() < end, "the good peer stopped moving");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        wait_moving(0);
        let baseline = rss_kib(pid);
        let sample = || {
            peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
        };

        never_reads(addr);
        sample();
        wait_moving(moved.load(Ordering::Relaxed));

        let partial = partial_frames(addr, 16);
        std::thread::sleep(Duration::from_millis(300));
        sample();
        wait_moving(moved.load(Ordering::Relaxed));

        let flooding = flood(addr, FLOOD.min(descriptors.saturating_sub(256) as usize));
        assert!(flooding.len() >= 1000, "only {} sockets", flooding.len());
        // A peer that arrives during the flood gets in: silent connections are evicted,
        // oldest first, to make room for one that speaks.
        let newcomer = Engine::builder("newcomer")
            .rails(RailChoice::Count(NonZeroUsize::MIN))
            .idle(IdleStrategy::gentle())
            .build()
            .expect("the engine starts");
        let end = Instant::now() + BOUND;
        let joined = loop {
            sample();
            match newcomer.open(&target.addr) {
                Ok(peer) => break peer,
                Err(error) => assert!(Instant::now() < end, "kept out by the flood: {error}"),
            }
        };
        assert!(!joined.is_retired());
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end {
            sample();
            std::thread::sleep(Duration::from_millis(50));
        }
        wait_moving(moved.load(Ordering::Relaxed));
        drop(flooding);
        drop(partial);
        drop(stop_worker);
        worker.join().expect("the good peer never failed");
        baseline
    });
    let grown = peak.load(Ordering::Relaxed).saturating_sub(baseline);
    eprintln!(
        "target RSS: {baseline} KiB before, at most {} KiB during the abuse",
        peak.load(Ordering::Relaxed)
    );
    // 4 MiB of unread output at most, 16 half frames of 512 KiB, 64 connections before
    // their Hello: everything else waits in the kernel.
    assert!(
        grown < 48 << 10,
        "the target grew by {grown} KiB under abuse (from {baseline} KiB)"
    );
}

/// CPU seconds (user + system) the process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the target runs");
    // Fields after the command name (which ends at the last ')'): utime is the 12th, stime
    // the 13th.
    let after = &stat[stat.rfind(')').expect("a command name") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / per_second
}

/// Out of file descriptors, `accept` fails with EMFILE while the kernel still reports the
/// listener readable: a control thread that simply retries spins a core. This one pauses
/// its listener, and takes connections again once descriptors are free.
#[test]
fn a_target_out_of_descriptors_pauses_its_listener_instead_of_spinning() {
    let target = Serve::start_with_descriptor_limit(48, "1MiB");
    let addr: SocketAddr = target.addr.parse().expect("an address");
    let pid = target.child.id();
    // Enough silent connections to exhaust its descriptors (fewer than the handshake cap).
    let flooding = flood(addr, 60);
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_seconds(pid) - before;
    assert!(
        used < 0.3,
        "the target used {used:.2} s of CPU in 1 s while out of descriptors"
    );
    drop(flooding);
    // The silent ones time out (2 s) and close; the listener takes new peers again.
    let engine = Engine::builder("prefill")
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let end = Instant::now() + BOUND;
    loop {
        match engine.open(&target.addr) {
            Ok(peer) => {
                assert_eq!(peer.name(), "limited");
                break;
            }
            Err(error) => assert!(Instant::now() < end, "never taken again: {error}"),
        }
    }
}
