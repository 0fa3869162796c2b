//! The etcd cluster directory (feature `etcd`): discovery by name, liveness by lease, and
//! change watches for fleets beyond one host.
//!
//! # Layout
//! One key per segment name under a prefix (default `/railyard/`): `PREFIX + name` holds a
//! [record](encode_record) — a generation counter and the segment descriptor (incarnation,
//! handshake address, rails, regions) — attached to a lease this process keeps alive. When
//! the process dies its lease expires after [`EtcdConfig::lease_ttl`] and the key goes with
//! it; when it stops cleanly it revokes the lease and the key goes at once.
//!
//! # Owner
//! [`EtcdDirectory`] owns one thread running a single-threaded tokio runtime: the only code
//! that talks to etcd. It claims the name (refusing one a live, different incarnation holds;
//! a dead holder's key is waited out for one lease period), publishes the descriptor again
//! whenever the engine asks ([`EtcdDirectory::publish`], generation + 1), keeps the lease
//! alive, and watches the prefix. What it learns goes two ways: the peer table that
//! [`EtcdDirectory::resolve`] reads, and [`PeerEvents`] to the control thread — a new
//! incarnation under a known name is [`PeerChange::Restarted`] (the old incarnation's
//! endpoints retire at once instead of waiting for a transport timeout), a deleted key
//! [`PeerChange::Gone`] (its endpoints fail fast unless its control connection still
//! answers), and the same incarnation claiming the name again [`PeerChange::Returned`]
//! (its endpoints try a queue pair at once).
//!
//! # Outages
//! Start-up fails with an error naming the endpoints when etcd cannot be reached. Later, a
//! failed call, a watch that ends, or a keep-alive that goes unanswered for a lease period
//! ends the session: the thread reports it (a control-plane warning of kind `directory`),
//! retries every half second, and on reconnecting claims the name again (a new
//! lease), publishes, re-reads the prefix (peers that went or changed meanwhile are
//! reported) and watches again. Transfers between connected peers never depend on etcd.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue,
    LeaseKeeper, PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use tokio::sync::mpsc;

use crate::descriptor::SegmentDescriptor;
use crate::endpoint::Incarnation;
use crate::plane::{DirectoryWarning, PeerChange, PeerEvents};
use crate::wire::{FrameDecoder, Message, WireError};

/// How to reach etcd and how the directory behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each etcd member.
    pub endpoints: Vec<String>,
    /// Key prefix of this fleet's segments.
    pub prefix: String,
    /// Lease time to live: how long a dead process's key outlives it.
    pub lease_ttl: Duration,
    /// Longest one etcd call (or the first connection) may take.
    pub timeout: Duration,
    /// TLS to the members (`etcd+tls://`): the PEM of the CA that signed their certificates.
    pub tls_ca: Option<Vec<u8>>,
    /// The user and password etcd's authentication asks for (`credentials=FILE`).
    pub credentials: Option<EtcdCredentials>,
}

/// An etcd user and its password. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// The user.
    pub user: String,
    /// Its password.
    pub password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EtcdCredentials({}, <password>)", self.user)
    }
}

impl EtcdConfig {
    /// Default prefix.
    pub const DEFAULT_PREFIX: &'static str = "/railyard/";
    /// Default lease time to live.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(3);

    /// From `etcd[+tls]://HOST:PORT[,HOST:PORT...][?ttl=SECONDS&prefix=PREFIX&ca=FILE&
    /// credentials=FILE]`; the prefix defaults to [`Self::DEFAULT_PREFIX`], the lease to
    /// [`Self::DEFAULT_TTL`]. `etcd+tls://` talks TLS to the members, checking their
    /// certificates against the CA in `ca` (PEM; required). `credentials` names a file that
    /// holds `USER:PASSWORD` (a trailing newline is not part of it), for an etcd with
    /// authentication enabled. Both files are read here.
    ///
    /// # Errors
    /// [`EtcdError::BadUrl`] naming what is wrong, including a file that cannot be read.
    pub fn from_url(url: &str) -> Result<Self, EtcdError> {
        let bad = |why: &str| EtcdError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let (tls, rest) = match (url.strip_prefix("etcd://"), url.strip_prefix("etcd+tls://")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) => (true, rest),
            _ => return Err(bad("it does not start with etcd:// or etcd+tls://")),
        };
        let (members, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut prefix = Self::DEFAULT_PREFIX.to_string();
        let mut lease_ttl = Self::DEFAULT_TTL;
        let mut tls_ca = None;
        let mut credentials = None;
        let read = |what: &str, path: &str| {
            std::fs::read(path)
                .map_err(|error| bad(&format!("cannot read the {what} {path}: {error}")))
        };
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            match pair.split_once('=') {
                Some(("ca", _)) if !tls => {
                    return Err(bad("ca= is for etcd+tls://"));
                }
                Some(("ca", path)) => tls_ca = Some(read("CA file", path)?),
                Some(("credentials", path)) => {
                    let text = String::from_utf8(read("credentials file", path)?)
                        .map_err(|_| bad(&format!("the credentials file {path} is not text")))?;
                    let (user, password) = text
                        .trim_end()
                        .split_once(':')
                        .filter(|(user, _)| !user.is_empty())
                        .ok_or_else(|| {
                            bad(&format!(
                                "the credentials file {path} does not hold USER:PASSWORD"
                            ))
                        })?;
                    credentials = Some(EtcdCredentials {
                        user: user.to_string(),
                        password: password.to_string(),
                    });
                }
                Some(("ttl", seconds)) => {
                    lease_ttl = seconds
                        .parse::<u64>()
                        .ok()
                        .filter(|s| (1..=3600).contains(s))
                        .map(Duration::from_secs)
                        .ok_or_else(|| bad(&format!("ttl={seconds} is not 1..3600 seconds")))?;
                }
                Some(("prefix", value)) if value.starts_with('/') => prefix = value.to_string(),
                Some(("prefix", value)) => {
                    return Err(bad(&format!("prefix={value} does not start with /")));
                }
                _ => {
                    return Err(bad(&format!(
                        "unknown parameter {pair:?} (ttl, prefix, ca, credentials)"
                    )));
                }
            }
        }
        let endpoints: Vec<String> = members.split(',').map(str::to_string).collect();
        for endpoint in &endpoints {
            let (host, port) = endpoint
                .rsplit_once(':')
                .ok_or_else(|| bad(&format!("{endpoint:?} has no :PORT")))?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad(&format!("{endpoint:?} is not HOST:PORT")));
            }
        }
        if tls && tls_ca.is_none() {
            return Err(bad(
                "etcd+tls:// needs ca=FILE, the CA that signed the members' certificates",
            ));
        }
        Ok(Self {
            endpoints,
            prefix,
            lease_ttl,
            timeout: Duration::from_secs(3),
            tls_ca,
            credentials,
        })
    }

    fn members(&self) -> String {
        self.endpoints.join(",")
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

/// Why the directory could not start or do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// A malformed `--directory` value.
    #[error("{url:?} is not an etcd directory (etcd://HOST:PORT[,HOST:PORT...]): {why}")]
    BadUrl {
        /// What was given.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// etcd did not answer.
    #[error("cannot reach etcd at {endpoints}: {reason}")]
    Unreachable {
        /// The members tried.
        endpoints: String,
        /// Why.
        reason: String,
    },
    /// Another live process holds the name.
    #[error(
        "the name {name:?} is held by another live process (incarnation {holder}) in etcd at \
         {endpoints}; stop it or choose another name"
    )]
    NameTaken {
        /// The name.
        name: String,
        /// Its holder.
        holder: Incarnation,
        /// The members.
        endpoints: String,
    },
    /// The directory's thread could not start.
    #[error("cannot start the etcd directory thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// First bytes of a record.
const RECORD_MAGIC: &[u8; 8] = b"RYDIR001";

/// A key's value: magic, generation (u64 LE), then the descriptor as a RYCP `Descriptor`
/// frame (the handshake's own encoding, with its total decoder).
pub fn encode_record(generation: u64, descriptor: &SegmentDescriptor) -> Vec<u8> {
    let mut bytes = RECORD_MAGIC.to_vec();
    bytes.extend_from_slice(&generation.to_le_bytes());
    bytes.extend_from_slice(&Message::Descriptor(descriptor.clone()).encode());
    bytes
}

/// Decodes [`encode_record`]'s bytes.
///
/// # Errors
/// What is malformed.
pub fn decode_record(bytes: &[u8]) -> Result<(u64, SegmentDescriptor), String> {
    let rest = bytes
        .strip_prefix(RECORD_MAGIC.as_slice())
        .ok_or("not a railyard directory record (bad magic)")?;
    if rest.len() < 8 {
        return Err("a record shorter than its generation".into());
    }
    let (generation, frame) = rest.split_at(8);
    let mut word = [0; 8];
    word.copy_from_slice(generation);
    match FrameDecoder::decode_frame(frame) {
        Ok(Message::Descriptor(descriptor)) => Ok((u64::from_le_bytes(word), descriptor)),
        Ok(_) => Err("a record holding a message other than a descriptor".into()),
        Err(WireError::Truncated { field: "frame" }) => Err("a truncated record".into()),
        Err(error) => Err(format!("a malformed record: {error}")),
    }
}

/// A peer as the directory last saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerRecord {
    /// Bumped by each publication of one incarnation.
    pub generation: u64,
    /// Its descriptor.
    pub descriptor: SegmentDescriptor,
}

/// What the directory has done, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EtcdStats {
    /// Sessions that ended with etcd unreachable (or a lease lost).
    pub outages: u64,
    /// Sessions started (the first included).
    pub sessions: u64,
    /// Publications of this process's descriptor.
    pub publications: u64,
}

#[derive(Debug, Default)]
struct Shared {
    peers: RwLock<HashMap<String, PeerRecord>>,
    outages: AtomicU64,
    sessions: AtomicU64,
    publications: AtomicU64,
}

enum Update {
    Publish(SegmentDescriptor),
    Stop,
}

/// This process's entry in etcd and its view of everyone else's. See the module docs.
#[derive(Debug)]
pub struct EtcdDirectory {
    config: EtcdConfig,
    shared: Arc<Shared>,
    updates: mpsc::UnboundedSender<Update>,
    thread: Option<JoinHandle<()>>,
}

impl EtcdDirectory {
    /// Connects, claims `own.name`, publishes `own`, reads the peers, and keeps all of it
    /// current from then on, reporting peer changes to `events`.
    ///
    /// # Errors
    /// [`EtcdError::Unreachable`] (naming the endpoints), [`EtcdError::NameTaken`],
    /// [`EtcdError::Thread`].
    pub fn start(
        config: EtcdConfig,
        own: SegmentDescriptor,
        events: PeerEvents,
    ) -> Result<Self, EtcdError> {
        let shared = Arc::new(Shared::default());
        let (updates, updates_rx) = mpsc::unbounded_channel();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let session = Session {
            config: config.clone(),
            own,
            generation: 1,
            last_seen: HashMap::new(),
            shared: shared.clone(),
            events,
            updates: updates_rx,
        };
        let thread = std::thread::Builder::new()
            .name("railyard-etcd".into())
            .spawn(move || session.run(started_tx))
            .map_err(EtcdError::Thread)?;
        // The first session: connect, claim (up to one lease period for a dead holder),
        // publish, list.
        let bound = config.timeout * 4 + config.lease_ttl + Duration::from_secs(1);
        let started = started_rx.recv_timeout(bound).unwrap_or_else(|_| {
            Err(EtcdError::Unreachable {
                endpoints: config.members(),
                reason: format!("no answer within {bound:?}"),
            })
        });
        let directory = Self {
            config,
            shared,
            updates,
            thread: Some(thread),
        };
        started.map(|()| directory)
    }

    /// The peer named `name`, as last seen.
    pub fn resolve(&self, name: &str) -> Option<PeerRecord> {
        self.shared
            .peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Publishes this process's descriptor again (its regions changed).
    pub fn publish(&self, descriptor: SegmentDescriptor) {
        let _ = self.updates.send(Update::Publish(descriptor));
    }

    /// The etcd members, as configured.
    pub fn endpoints(&self) -> String {
        self.config.members()
    }

    /// What it has done so far.
    pub fn stats(&self) -> EtcdStats {
        EtcdStats {
            outages: self.shared.outages.load(Ordering::Relaxed),
            sessions: self.shared.sessions.load(Ordering::Relaxed),
            publications: self.shared.publications.load(Ordering::Relaxed),
        }
    }
}

impl Drop for EtcdDirectory {
    /// Revokes the lease (the key goes at once, so peers learn now, not after the lease)
    /// and stops the thread.
    fn drop(&mut self) {
        let _ = self.updates.send(Update::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How a session ended.
enum Ended {
    /// Asked to stop.
    Stopped,
    /// etcd failed or the lease was lost: try again.
    Failed(String),
    /// The name belongs to someone else.
    Taken(Incarnation),
}

impl From<etcd_client::Error> for Ended {
    fn from(error: etcd_client::Error) -> Self {
        Self::Failed(describe(&error))
    }
}

/// One line for an etcd client error: gRPC's message and the innermost cause (the client's
/// own rendering nests transport errors several levels deep).
fn describe(error: &etcd_client::Error) -> String {
    let mut innermost: &dyn std::error::Error = error;
    while let Some(source) = innermost.source() {
        innermost = source;
    }
    let outer = match error {
        etcd_client::Error::GRpcStatus(status) => status.message().to_string(),
        other => other.to_string(),
    };
    let cause = innermost.to_string();
    if std::ptr::addr_eq(innermost, error) || outer.contains(&cause) {
        outer
    } else {
        format!("{outer}: {cause}")
    }
}

/// The directory thread's state across sessions.
struct Session {
    config: EtcdConfig,
    own: SegmentDescriptor,
    generation: u64,
    /// The newest incarnation seen under each name, kept after it leaves: a later one
    /// under the same name is that peer restarted.
    last_seen: HashMap<String, Incarnation>,
    shared: Arc<Shared>,
    events: PeerEvents,
    updates: mpsc::UnboundedReceiver<Update>,
}

/// Pause between sessions while etcd is unreachable.
const RETRY: Duration = Duration::from_millis(500);
/// Failed retries between two "still unreachable" reports (about 10 s).
const STILL_DOWN_EVERY: u32 = 20;

impl Session {
    fn run(mut self, started: std::sync::mpsc::Sender<Result<(), EtcdError>>) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(error) => {
                let _ = started.send(Err(EtcdError::Thread(error)));
                return;
            }
        };
        runtime.block_on(async move {
            let mut started = Some(started);
            let mut down_since: Option<Instant> = None;
            let mut retries = 0u32;
            loop {
                self.shared.sessions.fetch_add(1, Ordering::Relaxed);
                let ended = self.session(&mut started, &mut down_since).await;
                let members = self.config.members();
                match ended {
                    Ended::Stopped => return,
                    Ended::Taken(holder) => {
                        if let Some(started) = started.take() {
                            let _ = started.send(Err(EtcdError::NameTaken {
                                name: self.own.name.clone(),
                                holder,
                                endpoints: members,
                            }));
                            return;
                        }
                        self.events.warn(DirectoryWarning {
                            message: "etcd: another incarnation took this process's name \
                                      while it could not renew it; retrying",
                            directory: members,
                            peer: Some(self.own.name.clone()),
                            incarnation: Some(holder),
                            reason: None,
                        });
                    }
                    Ended::Failed(reason) => {
                        if let Some(started) = started.take() {
                            let _ = started.send(Err(EtcdError::Unreachable {
                                endpoints: members,
                                reason,
                            }));
                            return;
                        }
                        match down_since {
                            None => {
                                self.shared.outages.fetch_add(1, Ordering::Relaxed);
                                down_since = Some(Instant::now());
                                retries = 0;
                                self.events.warn(DirectoryWarning {
                                    message: "etcd is unreachable; transfers between \
                                              connected peers go on; retrying",
                                    directory: members,
                                    peer: None,
                                    incarnation: None,
                                    reason: Some(reason),
                                });
                            }
                            Some(since) => {
                                retries += 1;
                                if retries % STILL_DOWN_EVERY == 0 {
                                    self.events.warn(DirectoryWarning {
                                        message: "etcd is still unreachable",
                                        directory: members,
                                        peer: None,
                                        incarnation: None,
                                        reason: Some(format!(
                                            "{reason} (for {:.0} s)",
                                            since.elapsed().as_secs_f64()
                                        )),
                                    });
                                }
                            }
                        }
                    }
                }
                // Wait before retrying, but still take updates (and a stop) meanwhile.
                let pause = tokio::time::sleep(RETRY);
                tokio::pin!(pause);
                loop {
                    tokio::select! {
                        () = &mut pause => break,
                        update = self.updates.recv() => match update {
                            // Published with the next session's claim.
                            Some(Update::Publish(descriptor)) => self.own = descriptor,
                            Some(Update::Stop) | None => return,
                        },
                    }
                }
            }
        });
    }

    /// Runs `call` with the configured bound.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, Ended> {
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(result) => result.map_err(Ended::from),
            Err(_) => Err(Ended::Failed(format!(
                "no answer within {:?}",
                self.config.timeout
            ))),
        }
    }

    /// One connection's life: claim, publish, list, then keep alive and watch until
    /// something fails or the directory stops.
    async fn session(
        &mut self,
        started: &mut Option<std::sync::mpsc::Sender<Result<(), EtcdError>>>,
        down_since: &mut Option<Instant>,
    ) -> Ended {
        match self.session_inner(started, down_since).await {
            Ok(ended) | Err(ended) => ended,
        }
    }

    async fn session_inner(
        &mut self,
        started: &mut Option<std::sync::mpsc::Sender<Result<(), EtcdError>>>,
        down_since: &mut Option<Instant>,
    ) -> Result<Ended, Ended> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.config.timeout)
            .with_keep_alive(Duration::from_secs(1), self.config.timeout);
        if let Some(ca) = &self.config.tls_ca {
            options = options.with_tls(TlsOptions::new().ca_certificate(Certificate::from_pem(ca)));
        }
        if let Some(credentials) = &self.config.credentials {
            options = options.with_user(&credentials.user, &credentials.password);
        }
        let mut client = self
            .bounded(Client::connect(&self.config.endpoints, Some(options)))
            .await?;
        let ttl = i64::try_from(self.config.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = self.bounded(client.lease_grant(ttl, None)).await?.id();
        let (mut keeper, mut renewals) = self.bounded(client.lease_keep_alive(lease)).await?;
        self.claim(&mut client, lease, &mut keeper).await?;
        let prefix = self.config.prefix.clone();
        let listed = self
            .bounded(client.get(prefix.clone(), Some(GetOptions::new().with_prefix())))
            .await?;
        let revision = listed.header().map_or(0, |header| header.revision());
        self.reconcile(listed.kvs());
        let mut watch = self
            .bounded(
                client.watch(
                    prefix,
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision + 1),
                    ),
                ),
            )
            .await?;
        if let Some(started) = started.take() {
            let _ = started.send(Ok(()));
        } else if let Some(since) = down_since.take() {
            self.events.warn(DirectoryWarning {
                message: "etcd is reachable again; this process's record is re-published",
                directory: self.config.members(),
                peer: Some(self.own.name.clone()),
                incarnation: None,
                reason: Some(format!(
                    "it was unreachable for {:.1} s",
                    since.elapsed().as_secs_f64()
                )),
            });
        }
        // A third of the lease (tokio refuses a zero period; a zero TTL is granted as 1 s).
        let period = (self.config.lease_ttl / 3).max(Duration::from_millis(100));
        let mut renew = tokio::time::interval(period);
        let mut last_renewed = Instant::now();
        loop {
            tokio::select! {
                _ = renew.tick() => {
                    if last_renewed.elapsed() >= self.config.lease_ttl {
                        return Err(Ended::Failed("the lease went unrenewed for its whole \
                            time to live".into()));
                    }
                    self.bounded(keeper.keep_alive()).await?;
                }
                renewal = renewals.message() => match renewal? {
                    Some(answer) if answer.ttl() > 0 => last_renewed = Instant::now(),
                    Some(_) => return Err(Ended::Failed("the lease expired".into())),
                    None => return Err(Ended::Failed("the keep-alive stream ended".into())),
                },
                changes = watch.message() => {
                    let Some(changes) = changes? else {
                        return Err(Ended::Failed("the watch ended".into()));
                    };
                    if changes.canceled() {
                        return Err(Ended::Failed(format!(
                            "the watch was canceled ({})",
                            changes.cancel_reason()
                        )));
                    }
                    for event in changes.events() {
                        let Some(kv) = event.kv() else { continue };
                        match event.event_type() {
                            EventType::Put => self.seen(kv),
                            EventType::Delete => self.deleted(kv.key()),
                        }
                    }
                }
                update = self.updates.recv() => match update {
                    Some(Update::Publish(descriptor)) => {
                        self.own = descriptor;
                        self.generation += 1;
                        self.put_own(&mut client, lease).await?;
                    }
                    Some(Update::Stop) | None => {
                        let _ = self.bounded(client.lease_revoke(lease)).await;
                        return Ok(Ended::Stopped);
                    }
                },
            }
        }
    }

    /// Puts this process's record under `lease` unless another process holds the name.
    /// A holder that is this incarnation (an earlier session) is replaced; another
    /// holder's key is waited out for what its lease had left when first seen, plus a lease
    /// period and a second (it may be a process that just died), then the name is refused:
    /// a live holder renews its lease, a dead one's key is gone by then.
    async fn claim(
        &mut self,
        client: &mut Client,
        lease: i64,
        keeper: &mut LeaseKeeper,
    ) -> Result<(), Ended> {
        let key = self.config.key(&self.own.name);
        // A new generation per session: the descriptor may have changed while etcd was
        // unreachable, and watchers ignore a record no newer than the one they have.
        self.generation += 1;
        let mut deadline: Option<Instant> = None;
        loop {
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([self.put_record(&key, lease)])
                .or_else([TxnOp::get(key.clone(), None)]);
            let answer = self.bounded(client.txn(txn)).await?;
            if answer.succeeded() {
                self.shared.publications.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            let held = answer.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(got) => got.kvs().first().and_then(|kv| {
                    let (_, descriptor) = decode_record(kv.value()).ok()?;
                    Some((descriptor.incarnation, kv.lease()))
                }),
                _ => None,
            });
            if let (Some((holder, holder_lease)), None) = (held, deadline) {
                if holder != self.own.incarnation {
                    deadline = Some(self.holder_deadline(client, holder_lease).await);
                }
            }
            let holder = held.map(|(holder, _)| holder);
            match holder {
                // Ours from an earlier session (etcd restarted, or our lease lapsed while
                // it was unreachable): move it under this session's lease.
                Some(holder) if holder == self.own.incarnation => {
                    let put = Txn::new().and_then([self.put_record(&key, lease)]);
                    self.bounded(client.txn(put)).await?;
                    self.shared.publications.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Some(holder) if deadline.is_some_and(|end| Instant::now() >= end) => {
                    return Err(Ended::Taken(holder));
                }
                // Another holder (maybe dead, its lease not yet expired), or the key went
                // between the two reads: try again shortly, keeping our own lease alive.
                _ => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    self.bounded(keeper.keep_alive()).await?;
                }
            }
        }
    }

    /// When a holder whose key is under `holder_lease` must have lost it if it is dead: the
    /// time its lease has left (two of our own lease periods when etcd will not say), plus
    /// one lease period and a second.
    async fn holder_deadline(&self, client: &mut Client, holder_lease: i64) -> Instant {
        let fallback = self.config.lease_ttl * 2 + Duration::from_secs(1);
        let left = match self
            .bounded(client.lease_time_to_live(holder_lease, None))
            .await
        {
            Ok(answer) => u64::try_from(answer.ttl()).map_or(Duration::ZERO, Duration::from_secs),
            Err(_) => fallback,
        };
        // etcd revokes expired leases in rounds (every 500 ms) through consensus: allow one
        // more of our own lease periods beyond what it reports.
        Instant::now() + left.min(fallback) + self.config.lease_ttl + Duration::from_secs(1)
    }

    /// Puts this process's current record at `key` under `lease`.
    fn put_record(&self, key: &str, lease: i64) -> TxnOp {
        let value = encode_record(self.generation, &self.own);
        TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)))
    }

    /// Publishes the current descriptor under `lease` (only while this lease holds the
    /// key: a lost name ends the session, which claims it again).
    async fn put_own(&mut self, client: &mut Client, lease: i64) -> Result<(), Ended> {
        let key = self.config.key(&self.own.name);
        let txn = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, lease)])
            .and_then([self.put_record(&key, lease)]);
        if !self.bounded(client.txn(txn)).await?.succeeded() {
            return Err(Ended::Failed(
                "this process's key is no longer under its lease".into(),
            ));
        }
        self.shared.publications.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn name_of<'a>(&self, key: &'a [u8]) -> Option<&'a str> {
        std::str::from_utf8(key)
            .ok()?
            .strip_prefix(self.config.prefix.as_str())
            .filter(|name| *name != self.own.name)
    }

    /// A key was put: record the peer; a new incarnation under a known name is a restart.
    fn seen(&mut self, kv: &KeyValue) {
        let Some(name) = self.name_of(kv.key()) else {
            return;
        };
        let Ok((generation, descriptor)) = decode_record(kv.value()) else {
            self.events.warn(DirectoryWarning {
                message: "etcd: ignoring a malformed record",
                directory: self.config.members(),
                peer: Some(name.to_string()),
                incarnation: None,
                reason: Some(format!("the record under {}{name}", self.config.prefix)),
            });
            return;
        };
        let name = name.to_string();
        let new = descriptor.incarnation;
        let mut peers = self
            .shared
            .peers
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if peers.get(&name).is_some_and(|known| {
            known.descriptor.incarnation == new && known.generation >= generation
        }) {
            return;
        }
        let listed = peers.contains_key(&name);
        match self.last_seen.insert(name.clone(), new) {
            // Reported gone, and the same process holds the name again.
            Some(old) if old == new && !listed => self
                .events
                .changed(name.clone(), PeerChange::Returned { incarnation: new }),
            Some(old) if old != new => match descriptor.handshake_addr.parse::<SocketAddr>() {
                Ok(addr) => self
                    .events
                    .changed(name.clone(), PeerChange::Restarted { old, new, addr }),
                Err(_) => self
                    .events
                    .changed(name.clone(), PeerChange::Gone { incarnation: old }),
            },
            _ => {}
        }
        peers.insert(
            name,
            PeerRecord {
                generation,
                descriptor,
            },
        );
    }

    /// A key was deleted (its lease expired or was revoked): the peer is gone.
    fn deleted(&mut self, key: &[u8]) {
        let Some(name) = self.name_of(key) else {
            return;
        };
        let removed = self
            .shared
            .peers
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
        if let Some(record) = removed {
            self.events.changed(
                name.to_string(),
                PeerChange::Gone {
                    incarnation: record.descriptor.incarnation,
                },
            );
        }
    }

    /// A full listing: what is listed is seen; what is known and not listed is gone.
    fn reconcile(&mut self, listed: &[KeyValue]) {
        let mut missing: Vec<String> = self
            .shared
            .peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        for kv in listed {
            if let Some(name) = self.name_of(kv.key()) {
                missing.retain(|known| known != name);
            }
            self.seen(kv);
        }
        for name in missing {
            self.deleted(self.config.key(&name).as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{RailDescriptor, RegionDescriptor, fabric};

    #[test]
    fn urls_parse_and_malformed_ones_say_what_is_wrong() {
        let config = EtcdConfig::from_url("etcd://10.0.0.1:2379,etcd-b:2380").unwrap();
        assert_eq!(config.endpoints, ["10.0.0.1:2379", "etcd-b:2380"]);
        assert_eq!(config.prefix, "/railyard/");
        assert_eq!(config.lease_ttl, EtcdConfig::DEFAULT_TTL);
        assert_eq!(config.key("decode-0"), "/railyard/decode-0");
        let creds =
            std::env::temp_dir().join(format!("railyard-etcd-creds-{}", std::process::id()));
        std::fs::write(&creds, "fleet:s3cret\n").unwrap();
        let url = format!("etcd+tls://h:1?ca={0}&credentials={0}", creds.display());
        let secured = EtcdConfig::from_url(&url).unwrap();
        assert_eq!(secured.tls_ca.as_deref(), Some(&b"fleet:s3cret\n"[..]));
        let credentials = secured.credentials.clone().unwrap();
        assert_eq!(
            (credentials.user.as_str(), credentials.password.as_str()),
            ("fleet", "s3cret")
        );
        assert!(
            !format!("{secured:?}").contains("s3cret"),
            "the password stays out of logs"
        );
        std::fs::write(&creds, "no-colon\n").unwrap();
        let error = EtcdConfig::from_url(&url).unwrap_err().to_string();
        assert!(error.contains("USER:PASSWORD"), "{error}");
        std::fs::remove_file(&creds).unwrap();
        let tuned = EtcdConfig::from_url("etcd://h:1?ttl=2&prefix=/fleet-a/").unwrap();
        assert_eq!(
            (tuned.lease_ttl, tuned.prefix.as_str()),
            (Duration::from_secs(2), "/fleet-a/")
        );
        for (url, why) in [
            ("http://h:1", "etcd://"),
            ("etcd://h", "no :PORT"),
            ("etcd://h:port", "not HOST:PORT"),
            ("etcd://:1", "not HOST:PORT"),
            ("etcd://h:1?ttl=0", "ttl=0"),
            ("etcd://h:1?prefix=x", "does not start with /"),
            ("etcd://h:1?color=red", "unknown parameter"),
            ("etcd://h:1?ca=/etc/hostname", "ca= is for etcd+tls://"),
            ("etcd+tls://h:1", "needs ca=FILE"),
            (
                "etcd+tls://h:1?ca=/nonexistent/ca.pem",
                "cannot read the CA file",
            ),
            (
                "etcd://h:1?credentials=/nonexistent/creds",
                "cannot read the credentials",
            ),
        ] {
            let error = EtcdConfig::from_url(url).unwrap_err().to_string();
            assert!(error.contains(why), "{url}: {error}");
        }
    }

    #[test]
    fn records_round_trip_and_malformed_ones_are_refused() {
        let descriptor = SegmentDescriptor {
            name: "decode-0".into(),
            incarnation: Incarnation(42),
            handshake_addr: "10.0.0.2:7400".into(),
            rails: vec![RailDescriptor {
                name: "soft0".into(),
                fabric: fabric::SOFT,
                tcp_port: 41000,
                address: Vec::new(),
            }],
            regions: vec![RegionDescriptor {
                base: 0x1000,
                len: 0x2000,
                rkeys: vec![7],
                generation: 1,
                access: railyard_dataplane::fabric::Access::ALL,
            }],
        };
        let bytes = encode_record(9, &descriptor);
        assert_eq!(decode_record(&bytes), Ok((9, descriptor)));
        assert!(decode_record(b"nonsense").unwrap_err().contains("magic"));
        assert!(decode_record(&bytes[..12]).unwrap_err().contains("shorter"));
        assert!(
            decode_record(&bytes[..bytes.len() - 1])
                .unwrap_err()
                .contains("truncated")
        );
    }
}
