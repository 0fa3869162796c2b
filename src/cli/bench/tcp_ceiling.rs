//! The TCP fabric's ceiling: how fast a plain TCP stream of the bench's requests moves,
//! with no protocol, to a reader on loopback or to a remote target's TCP port.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use railyard::dataplane::fabric::tcp::REQUESTS_PER_SEND;
use railyard::dataplane::rng::SplitMix64;

/// Where the TCP ceiling's reader runs.
pub(super) enum CeilingSite {
    /// A thread of this process on loopback: the target is on this host.
    Loopback,
    /// The TCP data port of a target elsewhere, which reads and discards (`open_sink`).
    Remote(SocketAddr),
}

/// Rounds of the TCP ceiling; the best counts.
pub(super) const TCP_CEILING_ROUNDS: usize = 5;
/// How long the TCP ceiling's connection runs before its rounds are timed.
const TCP_CEILING_WARM_UP: Duration = Duration::from_millis(300);
/// Longest the TCP ceiling's writer or reader waits for the other to move a byte.
const CEILING_STALL: Duration = Duration::from_secs(10);

/// A plain TCP stream of the bench's requests — the blocks of `source` cut at `slice`
/// bytes and sent [`REQUESTS_PER_SEND`] pieces per vectored write, as the fabric sends a
/// batch's slices — to a reader that lands each `block`-sized
/// block in a random slot of `pool`, at most a slice per read, as a target lands writes: no protocol, no headers, no
/// replies. Writer and reader busy-poll non-blocking sockets, as the fabric's pollers do (a
/// blocking reader loses half the rate here to sleeping and waking). With the target on
/// this host the reader is a thread of this process on loopback (the socket path's own
/// ceiling, independent of railyard); otherwise the target's TCP data port reads and
/// discards (`open_sink`), and `pool` is not used.
///
/// One connection, warmed up first (a fresh one spends its first hundred milliseconds
/// growing its windows, which the fabric's long-lived connections have long done), then
/// timed in rounds at the writer: the bytes the kernel took per round, which differs from
/// what the reader took by at most the two socket buffers (a few MiB against the GB of a
/// round). The best round counts (an upper bound: on a small shared machine the others lost
/// time to something else). Each round lasts `round`.
pub(super) fn tcp_ceiling(
    site: &CeilingSite,
    source: &[u8],
    pool: &mut [u8],
    block: u64,
    slice: usize,
    seed: u64,
    round: Duration,
) -> anyhow::Result<f64> {
    use std::io::{IoSlice, Read};
    let block = block as usize;
    let piece = slice.min(block).max(1);
    let remote = match site {
        CeilingSite::Remote(target) if !target.ip().is_loopback() => Some(*target),
        _ => None,
    };
    std::thread::scope(|scope| -> anyhow::Result<f64> {
        let (stream, reader) = match remote {
            Some(target) => {
                let sink = railyard::dataplane::fabric::tcp::open_sink(target, CEILING_STALL)
                    .with_context(|| {
                        format!(
                            "opening a raw stream to the target's TCP port {target} (a target with a \
                             cluster secret takes one only with `railyard serve \
                             --accept-sinks`)"
                        )
                    })?;
                (sink, None)
            }
            None => {
                let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
                let addr = listener.local_addr()?;
                let pool = &mut *pool;
                listener.set_nonblocking(true)?;
                let reader = scope.spawn(move || -> std::io::Result<()> {
                    let socket = accept_within(&listener, CEILING_STALL)?;
                    let mut rng = SplitMix64::new(seed);
                    let slots = (pool.len() / block) as u64;
                    loop {
                        let at = rng.below(slots) as usize * block;
                        let mut got = 0;
                        while got < block {
                            // At most a slice per read, as the fabric receives a slice into
                            // its place.
                            let end = at + block.min(got + piece);
                            match read_spinning(&mut &socket, &mut pool[at + got..end])? {
                                0 => return Ok(()),
                                read => got += read,
                            }
                        }
                    }
                });
                (std::net::TcpStream::connect(addr)?, Some(reader))
            }
        };
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        // Sends the request's blocks for `duration`: the bytes the kernel took.
        let pieces: Vec<&[u8]> = source.chunks(piece).collect();
        let send_for = |duration: Duration| -> anyhow::Result<u64> {
            let started = Instant::now();
            let mut moved = 0u64;
            while started.elapsed() < duration {
                for send in pieces.chunks(REQUESTS_PER_SEND) {
                    let mut iov: Vec<IoSlice<'_>> = send.iter().map(|p| IoSlice::new(p)).collect();
                    let mut left: &mut [IoSlice<'_>] = &mut iov;
                    while !left.is_empty() {
                        let written = write_spinning(&stream, left)?;
                        IoSlice::advance_slices(&mut left, written);
                        moved += written as u64;
                    }
                }
            }
            Ok(moved)
        };
        send_for(TCP_CEILING_WARM_UP).with_context(|| match remote {
            Some(target) => format!(
                "the target's TCP port {target} closed the raw stream (a target with a cluster \
                 secret takes one only with `railyard serve --accept-sinks`)"
            ),
            None => "the ceiling's stream failed".into(),
        })?;
        let mut best = 0.0f64;
        for _ in 0..TCP_CEILING_ROUNDS {
            let started = Instant::now();
            let moved = send_for(round)?;
            best = best.max(moved as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
        stream.set_nonblocking(false)?;
        stream.shutdown(std::net::Shutdown::Write)?;
        match reader {
            Some(reader) => reader
                .join()
                .map_err(|_| anyhow::anyhow!("the ceiling's reader panicked"))??,
            None => {
                // The target closes once it has read the end of the stream.
                stream.set_read_timeout(Some(CEILING_STALL))?;
                let mut end = [0u8; 1];
                let _ = (&stream).read(&mut end);
            }
        }
        Ok(best)
    })
}

/// The first connection to a non-blocking `listener`, waited for at most `bound`.
fn accept_within(
    listener: &std::net::TcpListener,
    bound: Duration,
) -> std::io::Result<std::net::TcpStream> {
    let began = Instant::now();
    loop {
        match listener.accept() {
            Ok((socket, _)) => {
                socket.set_nonblocking(true)?;
                return Ok(socket);
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if began.elapsed() > bound {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the ceiling's writer never connected",
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(error) => return Err(error),
        }
    }
}

/// One vectored write to a non-blocking `stream`, spinning while its send buffer is full:
/// the bytes taken (at least one).
pub(super) fn write_spinning(
    mut stream: &std::net::TcpStream,
    blocks: &[std::io::IoSlice<'_>],
) -> anyhow::Result<usize> {
    use std::io::Write;
    let waiting_since = Instant::now();
    loop {
        match stream.write_vectored(blocks) {
            Ok(0) => bail!("the ceiling's reader stopped taking bytes"),
            Ok(written) => return Ok(written),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if waiting_since.elapsed() > CEILING_STALL {
                    bail!("the ceiling's reader took no byte for {CEILING_STALL:?}");
                }
                std::hint::spin_loop();
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// One read from a non-blocking `socket` into `buffer`, spinning while nothing has
/// arrived: the bytes read (0 at the end of the stream).
pub(super) fn read_spinning(
    socket: &mut impl std::io::Read,
    buffer: &mut [u8],
) -> std::io::Result<usize> {
    let waiting_since = Instant::now();
    loop {
        match socket.read(buffer) {
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if waiting_since.elapsed() > CEILING_STALL {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the ceiling's writer sent nothing",
                    ));
                }
                std::hint::spin_loop();
            }
            result => return result,
        }
    }
}
