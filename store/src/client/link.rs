//! A client's connection to the master: requests sent with ids, one reader thread handing
//! each reply to the caller that waits for it and each event (fences, finished unmounts)
//! to the store, and a keepalive thread that pings the master every [`KEEPALIVE`] — how
//! the master tells a live member from a stopped one.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use railyard_engine::control::ClusterSecret;
use railyard_engine::control::session::SessionKeys;

use crate::error::StoreErrorKind;
use crate::handshake::{self, Identity};
use crate::master::ClientId;
use crate::protocol::{
    FrameWriter, KEEPALIVE, MASTER_SILENCE, PROTOCOL_VERSION, Reply, Request, ToClient, ToMaster,
    is_unauthentic, read_frame,
};

type Waiting = Arc<Mutex<HashMap<u64, Sender<Reply>>>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unreachable(detail: impl Into<String>) -> StoreErrorKind {
    StoreErrorKind::MasterUnreachable {
        detail: detail.into(),
    }
}

/// An open, admitted connection to the master.
pub(crate) struct MasterLink {
    writer: Arc<Mutex<FrameWriter>>,
    waiting: Waiting,
    next_id: Arc<AtomicU64>,
    reader: Option<JoinHandle<()>>,
    keepalive: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    /// Set when the connection is gone (its reader ended): the store attaches again.
    closed: Arc<AtomicBool>,
    /// When a frame last arrived, in milliseconds after `opened`.
    heard: Arc<AtomicU64>,
    opened: Instant,
    /// What the master knows this client as.
    pub(crate) client: ClientId,
    /// The master's address.
    pub(crate) addr: SocketAddr,
}

impl MasterLink {
    /// Connects to the master at `master` as `me`, within `timeout`; events go to `events`.
    pub(crate) fn connect(
        master: &str,
        me: &Identity,
        secret: Option<&ClusterSecret>,
        timeout: Duration,
        events: Sender<ToClient>,
    ) -> Result<Self, StoreErrorKind> {
        let addr = master
            .to_socket_addrs()
            .map_err(|error| unreachable(format!("{master}: {error}")))?
            .next()
            .ok_or_else(|| unreachable(format!("{master}: no address")))?;
        // A live master answers the handshake and Open at once; one that does not within
        // its silence bound is stopped (its kernel still accepts), and the caller looks for
        // the leader again instead of waiting out its whole timeout.
        let opening = timeout.min(MASTER_SILENCE);
        let mut stream = TcpStream::connect_timeout(&addr, opening)
            .map_err(|error| unreachable(format!("{addr}: {error}")))?;
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(opening))
            .map_err(|error| unreachable(error.to_string()))?;
        let (_, keys) = handshake::dial(&mut stream, addr, me, secret)
            .map_err(|reason| unreachable(format!("{addr}: {reason}")))?;
        let (sealer, mut opener) = keys.map(SessionKeys::split).unzip();
        stream
            .set_read_timeout(None)
            .map_err(|error| unreachable(error.to_string()))?;
        // A master that stopped reading fails the write instead of holding every caller.
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|error| unreachable(error.to_string()))?;
        let mut reader_stream = stream
            .try_clone()
            .map_err(|error| unreachable(error.to_string()))?;
        let waiting: Waiting = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let heard = Arc::new(AtomicU64::new(0));
        let opened = Instant::now();
        let reader = {
            let waiting = Arc::clone(&waiting);
            let closed = Arc::clone(&closed);
            let heard = Arc::clone(&heard);
            thread::Builder::new()
                .name("store-link".into())
                .spawn(move || {
                    loop {
                        let frame =
                            match read_frame::<ToClient>(&mut reader_stream, opener.as_mut()) {
                                Ok(frame) => frame,
                                Err(error) => {
                                    if is_unauthentic(&error) {
                                        tracing::warn!(
                                            kind = "auth",
                                            %addr,
                                            %error,
                                            "store client: a frame from the master failed its \
                                             authentication check; closing"
                                        );
                                    }
                                    break;
                                }
                            };
                        let since = u64::try_from(opened.elapsed().as_millis()).unwrap_or(u64::MAX);
                        heard.store(since, Ordering::Relaxed);
                        match frame {
                            ToClient::Reply { id, reply } => {
                                if let Some(caller) = lock(&waiting).remove(&id) {
                                    let _ = caller.send(reply);
                                }
                            }
                            event => {
                                let _ = events.send(event);
                            }
                        }
                    }
                    // The master is gone, or what came cannot be read further: the writers'
                    // side closes too (the keepalive stops, events go to the next link), and
                    // every caller still waiting hears so.
                    let _ = reader_stream.shutdown(std::net::Shutdown::Both);
                    closed.store(true, Ordering::Relaxed);
                    lock(&waiting).clear();
                })
                .map_err(|error| unreachable(error.to_string()))?
        };
        let writer = Arc::new(Mutex::new(FrameWriter::new(stream, sealer)));
        let mut link = Self {
            writer,
            waiting,
            next_id: Arc::new(AtomicU64::new(0)),
            reader: Some(reader),
            keepalive: None,
            closed,
            heard,
            opened,
            client: ClientId(me.incarnation.0),
            addr,
        };
        match link.call(
            Request::Open {
                version: PROTOCOL_VERSION,
            },
            opening,
        )? {
            Reply::Opened { client, .. } => link.client = client,
            Reply::Refused(reason) => return Err(unreachable(format!("{addr}: {reason}"))),
            other => return Err(unreachable(format!("{addr}: answered Open with {other:?}"))),
        }
        link.start_keepalive()?;
        Ok(link)
    }

    /// Pings the master every [`KEEPALIVE`] (after Open: a master of another version hears
    /// nothing it cannot read). A ping that cannot be written closes the connection, so that
    /// every caller sees the link is down instead of the master seeing a silent member.
    fn start_keepalive(&mut self) -> Result<(), StoreErrorKind> {
        let stop = Arc::new(AtomicBool::new(false));
        let (writer, next_id, stopping) = (
            Arc::clone(&self.writer),
            Arc::clone(&self.next_id),
            Arc::clone(&stop),
        );
        let keepalive = thread::Builder::new()
            .name("store-keepalive".into())
            .spawn(move || {
                // Its answer has no caller waiting: the reader drops it.
                while !stopping.load(Ordering::Relaxed) {
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let ping = ToMaster {
                        id,
                        request: Request::Ping,
                    };
                    let mut writer = lock(&writer);
                    if writer.write(&ping).is_err() {
                        writer.shutdown();
                        return;
                    }
                    drop(writer);
                    thread::park_timeout(KEEPALIVE);
                }
            })
            .map_err(|error| unreachable(error.to_string()))?;
        self.keepalive = Some((stop, keepalive));
        Ok(())
    }

    /// Whether the connection is gone.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// How long nothing arrived from the master (it answers every ping at once, even while
    /// a request of this connection waits for its journal).
    pub(crate) fn silent_for(&self) -> Duration {
        let heard = Duration::from_millis(self.heard.load(Ordering::Relaxed));
        self.opened.elapsed().saturating_sub(heard)
    }

    /// Gives the connection up: every caller waiting hears it is lost.
    pub(crate) fn close(&self) {
        lock(&self.writer).shutdown();
    }

    /// Sends `request` and waits at most `timeout` for its reply.
    pub(crate) fn call(
        &self,
        request: Request,
        timeout: Duration,
    ) -> Result<Reply, StoreErrorKind> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = mpsc::channel();
        lock(&self.waiting).insert(id, sender);
        // The reader marks the link closed before it lets go of the callers waiting: one
        // that came in after that would wait for nothing.
        if self.is_closed() {
            lock(&self.waiting).remove(&id);
            return Err(unreachable(format!("{}: connection lost", self.addr)));
        }
        let written = {
            let mut writer = lock(&self.writer);
            let written = writer.write(&ToMaster { id, request });
            if written.is_err() {
                // Perhaps half a frame went out: nothing after it could be read right. Closed
                // now, not when the reader notices: the caller attaches again at once.
                writer.shutdown();
                self.closed.store(true, Ordering::Relaxed);
            }
            written
        };
        if let Err(error) = written {
            lock(&self.waiting).remove(&id);
            return Err(unreachable(format!("{}: {error}", self.addr)));
        }
        match receiver.recv_timeout(timeout) {
            Ok(Reply::Refused(reason)) => {
                Err(unreachable(format!("{}: refused: {reason}", self.addr)))
            }
            Ok(reply) => Ok(reply),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                lock(&self.waiting).remove(&id);
                Err(unreachable(format!(
                    "{}: no answer within {timeout:?}",
                    self.addr
                )))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(unreachable(format!("{}: connection lost", self.addr)))
            }
        }
    }
}

impl Drop for MasterLink {
    fn drop(&mut self) {
        if let Some((stop, keepalive)) = self.keepalive.take() {
            stop.store(true, Ordering::Relaxed);
            keepalive.thread().unpark();
            let _ = keepalive.join();
        }
        lock(&self.writer).shutdown();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}
