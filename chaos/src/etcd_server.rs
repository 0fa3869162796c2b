//! A real etcd on loopback for the soak and the tests (feature `etcd`): the `etcd` binary of
//! the distribution's `etcd-server` package, its own ports and data directory (in memory
//! where the host has `/dev/shm`), stopped and
//! started again on demand (an outage), killed and its data removed when dropped, and
//! killed with its parent even if that dies first.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use super::harness::BOUND;

/// A running (or stopped) etcd.
pub struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// Where it answers its health check (its client port, unless that speaks TLS).
    health_port: u16,
    /// The lease time to live its clients are told to use, in seconds.
    ttl: u64,
    tls: Option<EtcdTls>,
}

/// The certificate and key an etcd serves its clients with (PEM files).
#[derive(Clone, Debug)]
pub struct EtcdTls {
    /// The server's certificate.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// Where etcd keeps its data: memory (`/dev/shm`) where the host has it, else the temporary
/// directory. Every write etcd answers waits for an fsync of its log; on a busy disk one
/// takes up to a second and more, which the store's master (its journal, its leader lease)
/// would pay — the tests measure railyard, not the disk.
fn data_root() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Starts one whose clients use leases of `ttl_seconds`; returns once it is healthy.
    ///
    /// # Errors
    /// When `etcd` is not installed or not healthy within [`BOUND`].
    pub fn start(ttl_seconds: u64) -> Result<Self> {
        Self::start_with(ttl_seconds, None)
    }

    /// [`Self::start`], serving clients over TLS with `tls` when given (its health check
    /// then on a plain port of its own).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_with(ttl_seconds: u64, tls: Option<EtcdTls>) -> Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let client_port = free_port()?;
        let mut server = Self {
            child: None,
            dir: data_root().join(format!("railyard-etcd-{}-{n}", std::process::id())),
            client_port,
            peer_port: free_port()?,
            health_port: if tls.is_some() {
                free_port()?
            } else {
                client_port
            },
            ttl: ttl_seconds,
            tls,
        };
        server.run()?;
        Ok(server)
    }

    /// Starts it again after [`Self::stop`], on the same ports and data: its leases and
    /// keys come back.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn run(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{}", self.health_port));
        }
        command
            .args(["--name", "railyard", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("railyard={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        super::process::die_with_parent(&mut command);
        let child = command
            .spawn()
            .context("starting etcd (install etcd-server; `make deps` does)")?;
        self.child = Some(child);
        let end = Instant::now() + BOUND;
        while !self.healthy() {
            if Instant::now() > end {
                self.stop();
                bail!("etcd was not healthy within {BOUND:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Whether it answers its health check.
    pub fn healthy(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.health_port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        let mut answer = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.contains("\"health\":\"true\"")
    }

    /// Kills it (an outage); [`Self::run`] starts it again.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The directory URL its clients use (`--directory`; over TLS, `ca=` is the caller's to
    /// add).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "etcd+tls"
        } else {
            "etcd"
        };
        format!("{scheme}://127.0.0.1:{}?ttl={}", self.client_port, self.ttl)
    }

    /// Its client endpoint, as `etcd-client` takes it.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
