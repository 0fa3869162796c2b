//! The Engine on the TCP fabric across two processes (this test's engine and a
//! `railyard serve` child), `--fabric auto` choosing soft on one host, `railyard bench
//! --fabric tcp` against its raw-stream ceiling, and two "hosts": network namespaces joined
//! by a veth pair, each side in its own PID namespace too (run as root; skipped otherwise).

mod common;

use std::num::NonZeroUsize;
use std::process::{Command, Stdio};

use common::{Serve, bytes_of, done, read_back};
use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, Transfer};

fn engine(fabric: FabricChoice) -> Engine {
    Engine::builder("prefill-tcp")
        .fabric(fabric)
        .rails(RailChoice::Count(NonZeroUsize::new(2).expect("two")))
        .idle(IdleStrategy::gentle())
        .slice_size(256 * 1024)
        .build()
        .expect("the engine starts")
}

#[test]
fn two_processes_over_tcp_move_mixed_sizes_intact_with_an_immediate_after_them() {
    let serve = Serve::start_with("16MiB", &["--rails", "1", "--fabric", "tcp"]);
    let engine = engine(FabricChoice::Tcp);
    assert_eq!(engine.fabric(), "tcp");
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine.alloc(8 << 20, None).unwrap();
    let back = engine.alloc(8 << 20, None).unwrap();
    for (i, byte) in bytes_of(source).iter_mut().enumerate() {
        *byte = (i as u64).wrapping_mul(0x9E37_79B9) as u8;
    }
    // 1 B to 1 MiB, packed, split into 256 KiB slices over 2 rails.
    let sizes = [1u64, 3, 4096, 65_536, 1 << 20, 100, 300_000, 7];
    let mut writes = Vec::new();
    let mut offset = 0;
    for &len in sizes.iter().cycle() {
        if offset + len > 8 << 20 {
            break;
        }
        writes.push(Transfer {
            op: Op::Write,
            local: source,
            local_offset: offset,
            remote_addr: serve.pool_base + offset,
            len,
        });
        offset += len;
    }
    let mut submitter = engine.submitter().unwrap();
    let batch = submitter
        .submit_and_signal(&peer, &writes, 0x7C90_0001)
        .unwrap();
    assert!(done(&batch));
    let line = serve.expect_line("immediate from prefill-tcp");
    assert!(line.ends_with(": 0x7c900001"), "{line}");
    let reads = read_back(&writes, back);
    assert!(done(&submitter.submit(&peer, &reads).unwrap()));
    let len = offset as usize;
    assert!(bytes_of(back)[..len] == bytes_of(source)[..len]);
    let stats = engine.stats();
    assert_eq!(stats.control.tcp_qps, 2, "both rails' queue pairs are TCP");
    assert!(stats.rails.iter().all(|r| r.poller.completed > 0));
}

#[test]
fn auto_uses_the_soft_fabric_for_a_peer_on_this_host() {
    let serve = Serve::start_with("8MiB", &["--rails", "1"]);
    let engine = engine(FabricChoice::Auto);
    let peer = engine.open(&serve.addr).unwrap();
    let source = engine.alloc(1 << 20, None).unwrap();
    let write = Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: serve.pool_base,
        len: 1 << 20,
    };
    assert!(done(
        &engine.submitter().unwrap().submit(&peer, &[write]).unwrap()
    ));
    let stats = engine.stats();
    assert_eq!(stats.control.tcp_qps, 0);
    assert_eq!(stats.control.active_qps, 2);
}

#[test]
fn bench_over_tcp_compares_with_a_raw_stream_between_the_same_processes() {
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "bench",
            "--fabric",
            "tcp",
            "--duration",
            "0.5",
            "--json",
            "--check",
        ])
        .args(["--pool", "32MiB", "--batch", "8", "--rails", "1"])
        .output()
        .expect("runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one object");
    assert_eq!(report["fabric"], "tcp");
    assert!(
        report["ceiling"]
            .as_str()
            .is_some_and(|what| what.contains("plain TCP stream")),
        "{report}"
    );
    assert!(report["ceiling_gbps"].as_f64() > Some(0.0));
    assert!(report["ratio"].as_f64() > Some(0.0));
    assert!(report["tcp_queue_pairs"].as_u64() >= Some(1));
    assert_eq!(report["check"]["mismatches"], 0);
    assert_eq!(report["failed_requests"], 0);
}

/// Two network namespaces joined by a veth pair; removed when dropped.
struct TwoHosts {
    names: [String; 2],
    addrs: [String; 2],
}

impl TwoHosts {
    fn create() -> Result<Self, String> {
        let id = std::process::id() % 10_000;
        let names = [format!("ry{id}a"), format!("ry{id}b")];
        let subnet = format!("10.{}.{}", 200 + id % 50, id % 250);
        let addrs = [format!("{subnet}.1"), format!("{subnet}.2")];
        let hosts = Self { names, addrs };
        let [a, b] = &hosts.names;
        let (va, vb) = (format!("{a}v"), format!("{b}v"));
        for step in [
            vec!["netns", "add", a],
            vec!["netns", "add", b],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb],
            vec!["link", "set", &va, "netns", a],
            vec!["link", "set", &vb, "netns", b],
        ] {
            ip(&step)?;
        }
        for (ns, (dev, addr)) in hosts
            .names
            .iter()
            .zip([(&va, &hosts.addrs[0]), (&vb, &hosts.addrs[1])])
        {
            let cidr = format!("{addr}/24");
            for step in [
                vec!["-n", ns, "addr", "add", &cidr, "dev", dev],
                vec!["-n", ns, "link", "set", dev, "up"],
                vec!["-n", ns, "link", "set", "lo", "up"],
            ] {
                ip(&step)?;
            }
        }
        Ok(hosts)
    }

    /// `railyard args…` in namespace `index`, in a PID namespace of its own.
    fn railyard(&self, index: usize, args: &[&str]) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.names[index]])
            .args(["unshare", "--pid", "--fork", "--kill-child"])
            .arg(env!("CARGO_BIN_EXE_railyard"))
            .args(args);
        command
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

#[test]
fn two_hosts_joined_by_veth_use_tcp_under_auto_and_move_every_byte_intact() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: creating network namespaces needs root (run the tests as root)");
        return;
    }
    let hosts = match TwoHosts::create() {
        Ok(hosts) => hosts,
        Err(reason) => {
            eprintln!("skipped: cannot create network namespaces here: {reason}");
            return;
        }
    };
    let listen = format!("{}:7400", hosts.addrs[0]);
    let mut serve = hosts
        .railyard(
            0,
            &[
                "serve", "--listen", &listen, "--pool", "64MiB", "--rails", "1",
            ],
        )
        // bench's ceiling across hosts is a raw stream into the target's TCP port.
        .args(["--until-stdin-closes", "--accept-sinks"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("serve starts in namespace A");
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(serve.stdout.take().expect("piped")));
    let first = lines
        .next()
        .and_then(Result::ok)
        .expect("serve prints where it listens");
    assert!(first.starts_with("listening"), "{first}");
    // Keep reading what it prints, so that it never writes into a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let output = hosts
        .railyard(
            1,
            &["bench", "--target", &listen, "--duration", "1", "--json"],
        )
        .args(["--check", "--batch", "16", "--rails", "1"])
        .output()
        .expect("bench runs in namespace B");
    drop(serve.stdin.take());
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one object");
    assert_eq!(report["fabric"], "soft+tcp", "{report}");
    assert!(
        report["tcp_queue_pairs"].as_u64() >= Some(1),
        "auto chose TCP for a peer in another PID namespace: {report}"
    );
    assert_eq!(report["check"]["mismatches"], 0);
    assert_eq!(report["failed_requests"], 0);
    assert!(report["requests"].as_u64() > Some(0));
}
