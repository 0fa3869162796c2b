//! Master failover through etcd (feature `etcd`): one leader elected with an etcd lease,
//! standbys waiting their turn, the leader's journal written to etcd under its term, and
//! clients finding the leader there.
//!
//! # Layout
//! Under the store's prefix (the etcd URL's `prefix=`, default `/railyard/`, with `store/`
//! after it): `leader` holds the leader's address under its lease, and its create revision
//! is the leader's **term**; `segments/ID`, `objects/KEY` and `writers/CLIENT` hold the
//! journal's records ([`JournalEntry`]).
//!
//! # Fencing
//! Every write of the journal is a transaction that succeeds only while `leader`'s create
//! revision is the writer's term: a leader that lost its lease (stopped, partitioned) and
//! did not notice can change nothing. It notices on its own too: it stops serving once its
//! last renewal is older than three quarters of the lease, before etcd can hand the lease to
//! anyone else, and a failed transaction stops it at once.
//!
//! # Owner
//! [`Leadership`] owns one thread running a single-threaded tokio runtime, the only code
//! that talks to etcd for a master; the server asks it to campaign, load and commit.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue,
    LeaseKeepAliveStream, LeaseKeeper, PutOptions, TlsOptions, Txn, TxnOp,
};
use railyard_engine::control::etcd::EtcdConfig;
use railyard_engine::dataplane::sabotage::{self, Protection};
use tokio::sync::{mpsc, oneshot};

use crate::master::{ClientId, JournalEntry, SegmentId, Snapshot};

/// Most operations in one transaction (etcd refuses more than `--max-txn-ops`, 128 by
/// default).
const TXN_OPS: usize = 100;
/// Keys read from etcd per request while loading the journal.
const LOAD_PAGE: i64 = 1000;
/// Pause between a standby's campaigns.
const CAMPAIGN_EVERY: Duration = Duration::from_millis(100);

/// Where a store's records live in etcd.
#[derive(Clone, Debug)]
pub struct StoreEtcd {
    config: EtcdConfig,
    prefix: String,
}

impl StoreEtcd {
    /// From an `etcd://` URL (see `EtcdConfig::from_url`; its `ttl=` is the leader's lease).
    ///
    /// # Errors
    /// What is wrong with the URL.
    pub fn from_url(url: &str) -> Result<Self, String> {
        let config = EtcdConfig::from_url(url).map_err(|error| error.to_string())?;
        let prefix = format!("{}store/", config.prefix);
        Ok(Self { config, prefix })
    }

    /// The leader's lease.
    pub fn lease_ttl(&self) -> Duration {
        self.config.lease_ttl
    }

    fn leader(&self) -> String {
        format!("{}leader", self.prefix)
    }

    fn segments(&self) -> String {
        format!("{}segments/", self.prefix)
    }

    fn objects(&self) -> String {
        format!("{}objects/", self.prefix)
    }

    fn writers(&self) -> String {
        format!("{}writers/", self.prefix)
    }

    async fn connect(&self) -> Result<Client, String> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.config.timeout)
            .with_timeout(self.config.timeout)
            .with_keep_alive(Duration::from_secs(1), self.config.timeout);
        if let Some(ca) = &self.config.tls_ca {
            options = options.with_tls(TlsOptions::new().ca_certificate(Certificate::from_pem(ca)));
        }
        if let Some(credentials) = &self.config.credentials {
            options = options.with_user(&credentials.user, &credentials.password);
        }
        let members = self.config.endpoints.join(",");
        tokio::time::timeout(
            self.config.timeout,
            Client::connect(&self.config.endpoints, Some(options)),
        )
        .await
        .map_err(|_| {
            format!(
                "etcd at {members}: no answer within {:?}",
                self.config.timeout
            )
        })?
        .map_err(|error| format!("etcd at {members}: {error}"))
    }

    /// The leader's address, if there is one (one short-lived connection).
    ///
    /// # Errors
    /// When etcd cannot be reached.
    pub fn find_leader(&self) -> Result<Option<String>, String> {
        // On a thread of its own: a caller inside an async runtime may not block on another.
        let etcd = self.clone();
        std::thread::spawn(move || etcd.read_leader())
            .join()
            .map_err(|_| "the thread reading the leader panicked".to_owned())?
    }

    fn read_leader(&self) -> Result<Option<String>, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| error.to_string())?;
        runtime.block_on(async {
            let mut client = self.connect().await?;
            let got = client
                .get(self.leader(), None)
                .await
                .map_err(|error| error.to_string())?;
            Ok(got
                .kvs()
                .first()
                .and_then(|kv| String::from_utf8(kv.value().to_vec()).ok()))
        })
    }
}

/// Where a master stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Waiting for the leader's lease to go.
    Standby,
    /// Leading under this term until it says otherwise.
    Leading(u64),
    /// It led and lost its lease (or etcd refused its term): it must serve nothing more.
    Lost,
}

enum Call {
    Load(oneshot::Sender<Result<Snapshot, String>>),
    Commit(Vec<JournalEntry>, oneshot::Sender<Result<(), String>>),
    Stop,
}

struct State {
    standing: Mutex<Standing>,
    /// Until when the lease surely holds (its last renewal plus three quarters of it).
    valid_until: Mutex<Option<Instant>>,
}

/// A master's place in the election. See the module docs.
pub struct Leadership {
    calls: mpsc::UnboundedSender<Call>,
    state: Arc<State>,
    stopped: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Leadership {
    /// Starts campaigning to lead with `advertise` (where clients connect) as the leader's
    /// address.
    ///
    /// # Errors
    /// When the thread cannot start.
    pub fn start(etcd: StoreEtcd, advertise: String) -> Result<Self, String> {
        let (calls, receiver) = mpsc::unbounded_channel();
        let state = Arc::new(State {
            standing: Mutex::new(Standing::Standby),
            valid_until: Mutex::new(None),
        });
        let stopped = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stopped) = (Arc::clone(&state), Arc::clone(&stopped));
            std::thread::Builder::new()
                .name("store-leadership".into())
                .spawn(move || run(etcd, advertise, receiver, state, &stopped))
                .map_err(|error| error.to_string())?
        };
        Ok(Self {
            calls,
            state,
            stopped,
            thread: Some(thread),
        })
    }

    /// Where it stands now: leading only while its lease surely holds.
    pub fn standing(&self) -> Standing {
        let standing = *self
            .state
            .standing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let valid = self
            .state
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until);
        match standing {
            Standing::Leading(_) if !valid && !sabotage::is_off(Protection::StoreLeaderFencing) => {
                Standing::Lost
            }
            other => other,
        }
    }

    /// Everything the journal holds (read once leading).
    ///
    /// # Errors
    /// When etcd does not answer.
    pub fn load(&self) -> Result<Snapshot, String> {
        let (reply, answer) = oneshot::channel();
        self.calls
            .send(Call::Load(reply))
            .map_err(|_| "the leadership thread has stopped".to_owned())?;
        answer
            .blocking_recv()
            .map_err(|_| "the leadership thread has stopped".to_owned())?
    }

    /// Writes `entries` down under this leader's term.
    ///
    /// # Errors
    /// When etcd refuses the term (another master leads) or does not answer: this master
    /// must stop serving.
    pub fn commit(&self, entries: Vec<JournalEntry>) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.calls
            .send(Call::Commit(entries, reply))
            .map_err(|_| "the leadership thread has stopped".to_owned())?;
        answer
            .blocking_recv()
            .map_err(|_| "the leadership thread has stopped".to_owned())?
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        let _ = self.calls.send(Call::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn set(state: &State, standing: Standing) {
    *state
        .standing
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = standing;
}

fn run(
    etcd: StoreEtcd,
    advertise: String,
    mut calls: mpsc::UnboundedReceiver<Call>,
    state: Arc<State>,
    stopped: &AtomicBool,
) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        set(&state, Standing::Lost);
        return;
    };
    runtime.block_on(async {
        match lead(&etcd, &advertise, &mut calls, &state, stopped).await {
            Ok(()) => {}
            Err(reason) => {
                tracing::error!(%reason, "store master: leadership lost; serving nothing more");
                set(&state, Standing::Lost);
            }
        }
        // Whatever is still asked is refused.
        calls.close();
        while let Some(call) = calls.recv().await {
            match call {
                Call::Load(reply) => drop(reply.send(Err("not leading".into()))),
                Call::Commit(_, reply) => drop(reply.send(Err("not leading".into()))),
                Call::Stop => {}
            }
        }
    });
}

/// Campaigns until elected, then serves calls until stopped (`Ok`) or the lease or the
/// term is lost (`Err`). The lease is kept by a task of its own, so that a long load or
/// commit never holds up its renewals.
async fn lead(
    etcd: &StoreEtcd,
    advertise: &str,
    calls: &mut mpsc::UnboundedReceiver<Call>,
    state: &Arc<State>,
    stopped: &AtomicBool,
) -> Result<(), String> {
    let ttl = etcd.config.lease_ttl;
    let leader = etcd.leader();
    let (mut client, lease, term, granted) = loop {
        if stopped.load(Ordering::Relaxed) {
            return Ok(());
        }
        match campaign(etcd, advertise, stopped).await {
            Ok(Some(won)) => break won,
            Ok(None) => return Ok(()),
            Err(reason) => {
                tracing::warn!(%reason, "store master: campaigning; trying again");
                tokio::time::sleep(CAMPAIGN_EVERY).await;
            }
        }
    };
    let (keeper, renewals) = client
        .lease_keep_alive(lease)
        .await
        .map_err(|error| format!("keeping the lease: {error}"))?;
    renewed(state, granted, ttl);
    set(state, Standing::Leading(term));
    tracing::info!(term, advertise, "store master: leading");
    let mut keeping = tokio::spawn(keep_lease(keeper, renewals, ttl, Arc::clone(state)));
    let mut kept = true;
    loop {
        tokio::select! {
            lapsed = &mut keeping, if kept => {
                kept = false;
                let reason = lapsed.unwrap_or_else(|error| format!("the lease task failed: {error}"));
                // Sabotaged, a leader that lost its lease carries on as if it had not.
                if !sabotage::is_off(Protection::StoreLeaderFencing) {
                    return Err(reason);
                }
            }
            call = calls.recv() => match call {
                Some(Call::Load(reply)) => {
                    let _ = reply.send(load(etcd, &mut client).await);
                }
                Some(Call::Commit(entries, reply)) => {
                    let result = commit(etcd, &mut client, &leader, term, entries).await;
                    if let Err(reason) = &result {
                        // Lost before anyone hears the commit failed.
                        set(state, Standing::Lost);
                        keeping.abort();
                        let _ = reply.send(Err(reason.clone()));
                        return Err(reason.clone());
                    }
                    let _ = reply.send(result);
                }
                Some(Call::Stop) | None => {
                    keeping.abort();
                    // Let a standby take over at once instead of after the lease.
                    let _ = client.lease_revoke(lease).await;
                    return Ok(());
                }
            },
        }
    }
}

/// Records that the lease surely holds for three quarters of `ttl` after `sent` (when the
/// renewal etcd answered left, or the grant was asked for).
fn renewed(state: &State, sent: Instant, ttl: Duration) {
    *state
        .valid_until
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(sent + ttl - ttl / 4);
}

/// Renews the lease every quarter of `ttl`, each answer crediting the renewal it answers
/// (the oldest unanswered), until a renewal fails or the lease is gone: returns why.
async fn keep_lease(
    mut keeper: LeaseKeeper,
    mut renewals: LeaseKeepAliveStream,
    ttl: Duration,
    state: Arc<State>,
) -> String {
    let mut tick = tokio::time::interval((ttl / 4).max(Duration::from_millis(100)));
    let mut unanswered: VecDeque<Instant> = VecDeque::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                unanswered.push_back(Instant::now());
                if let Err(error) = keeper.keep_alive().await {
                    return format!("renewing the lease: {error}");
                }
            }
            renewal = renewals.message() => match renewal {
                Ok(Some(answer)) if answer.ttl() > 0 => {
                    if let Some(sent) = unanswered.pop_front() {
                        renewed(&state, sent, ttl);
                    }
                }
                Ok(Some(_)) => return "the lease expired".into(),
                Ok(None) => return "the lease's keep-alive stream ended".into(),
                Err(error) => return format!("renewing the lease: {error}"),
            },
        }
    }
}

/// Waits until no master leads, then tries to: `Some((client, lease, term, when the lease
/// was asked for))` once elected, `None` when stopped first.
async fn campaign(
    etcd: &StoreEtcd,
    advertise: &str,
    stopped: &AtomicBool,
) -> Result<Option<(Client, i64, u64, Instant)>, String> {
    let mut client = etcd.connect().await?;
    let leader = etcd.leader();
    let ttl = i64::try_from(etcd.config.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    loop {
        if stopped.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let held = client
            .get(leader.clone(), None)
            .await
            .map_err(|error| error.to_string())?;
        if !held.kvs().is_empty() {
            tokio::time::sleep(CAMPAIGN_EVERY).await;
            continue;
        }
        let granted = Instant::now();
        let lease = client
            .lease_grant(ttl, None)
            .await
            .map_err(|error| error.to_string())?
            .id();
        let txn = Txn::new()
            .when([Compare::create_revision(
                leader.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                leader.clone(),
                advertise,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let answer = client.txn(txn).await.map_err(|error| error.to_string())?;
        if !answer.succeeded() {
            // Another standby was quicker.
            let _ = client.lease_revoke(lease).await;
            continue;
        }
        let term = answer
            .header()
            .map(|header| header.revision())
            .and_then(|revision| u64::try_from(revision).ok())
            .ok_or("etcd did not say the revision of the election")?;
        return Ok(Some((client, lease, term, granted)));
    }
}

async fn load(etcd: &StoreEtcd, client: &mut Client) -> Result<Snapshot, String> {
    let mut snapshot = Snapshot::default();
    let mut skipped = 0usize;
    let client = client.clone();
    // Every key under `prefix`, a page at a time (one reply holds a bounded number).
    let all = |prefix: String| {
        let mut client = client.clone();
        async move {
            let mut end = prefix.clone().into_bytes();
            if let Some(last) = end.last_mut() {
                *last += 1;
            }
            let mut from = prefix.into_bytes();
            let mut kvs = Vec::new();
            loop {
                let page = client
                    .get(
                        from.clone(),
                        Some(
                            GetOptions::new()
                                .with_range(end.clone())
                                .with_limit(LOAD_PAGE),
                        ),
                    )
                    .await
                    .map_err(|error| error.to_string())?;
                let more = page.more();
                let Some(last) = page.kvs().last() else {
                    break;
                };
                from = last.key().to_vec();
                from.push(0);
                kvs.extend(page.kvs().iter().cloned());
                if !more {
                    break;
                }
            }
            Ok::<Vec<KeyValue>, String>(kvs)
        }
    };
    let segments = all(etcd.segments()).await?;
    for kv in &segments {
        let id = kv
            .key_str()
            .ok()
            .and_then(|key| key.strip_prefix(&etcd.segments()))
            .and_then(|id| id.parse::<u64>().ok());
        match (id, postcard::from_bytes(kv.value())) {
            (Some(id), Ok(record)) => snapshot.segments.push((SegmentId(id), record)),
            _ => skipped += 1,
        }
    }
    let objects = all(etcd.objects()).await?;
    for kv in &objects {
        let key = kv
            .key_str()
            .ok()
            .and_then(|key| key.strip_prefix(&etcd.objects()));
        match (key, postcard::from_bytes(kv.value())) {
            (Some(key), Ok(record)) => snapshot.objects.push((key.to_owned(), record)),
            _ => skipped += 1,
        }
    }
    let writers = all(etcd.writers()).await?;
    for kv in &writers {
        let client = kv
            .key_str()
            .ok()
            .and_then(|key| key.strip_prefix(&etcd.writers()))
            .and_then(|id| id.parse::<u64>().ok());
        let term = kv
            .value_str()
            .ok()
            .and_then(|term| term.parse::<u64>().ok());
        match (client, term) {
            (Some(client), Some(term)) => snapshot.writers.push((ClientId(client), term)),
            _ => skipped += 1,
        }
    }
    if skipped > 0 {
        tracing::warn!(
            skipped,
            "store master: journal records that do not decode were skipped"
        );
    }
    Ok(snapshot)
}

/// Writes `entries` in transactions that each hold only while `leader` was created at
/// `term`; a writer's record is forgotten only if it still names the term that was fenced.
async fn commit(
    etcd: &StoreEtcd,
    client: &mut Client,
    leader: &str,
    term: u64,
    entries: Vec<JournalEntry>,
) -> Result<(), String> {
    let revision = i64::try_from(term).map_err(|_| format!("term {term} out of range"))?;
    let ours = || Compare::create_revision(leader, CompareOp::Equal, revision);
    let fenced = !sabotage::is_off(Protection::StoreLeaderFencing);
    // What each key becomes, in the order keys were last changed: etcd refuses a
    // transaction naming a key twice, and a batch may change one twice (a put and its
    // removal, a segment mounted and gone).
    let mut changes: Vec<Option<(String, Option<Vec<u8>>)>> = Vec::new();
    let mut latest: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut forgets = Vec::new();
    for entry in entries {
        let change = match entry {
            JournalEntry::Segment { id, record } => (
                format!("{}{:020}", etcd.segments(), id.0),
                record.as_ref().map(encode).transpose()?,
            ),
            JournalEntry::Object { key, record } => (
                format!("{}{key}", etcd.objects()),
                record.as_ref().map(encode).transpose()?,
            ),
            JournalEntry::Writer { client, term } => (
                format!("{}{:020}", etcd.writers(), client.0),
                Some(term.to_string().into_bytes()),
            ),
            JournalEntry::ForgetWriter { client, term } => {
                forgets.push((client, term));
                continue;
            }
        };
        if let Some(earlier) = latest.insert(change.0.clone(), changes.len()) {
            changes[earlier] = None;
        }
        changes.push(Some(change));
    }
    let ops: Vec<TxnOp> = changes
        .into_iter()
        .flatten()
        .map(|(key, value)| match value {
            Some(value) => TxnOp::put(key, value, None),
            None => TxnOp::delete(key, None),
        })
        .collect();
    for chunk in ops.chunks(TXN_OPS) {
        let guard: Vec<Compare> = if fenced { vec![ours()] } else { Vec::new() };
        let txn = Txn::new().when(guard).and_then(chunk.to_vec());
        let answer = client.txn(txn).await.map_err(|error| error.to_string())?;
        if !answer.succeeded() {
            return Err(format!(
                "etcd refused the journal: another master leads now (this one's term was {term})"
            ));
        }
    }
    for (writer, written_in) in forgets {
        let key = format!("{}{:020}", etcd.writers(), writer.0);
        let txn = Txn::new()
            .when([
                ours(),
                Compare::value(key.clone(), CompareOp::Equal, written_in.to_string()),
            ])
            .and_then([TxnOp::delete(key, None)]);
        client.txn(txn).await.map_err(|error| error.to_string())?;
    }
    Ok(())
}

fn encode<T: serde::Serialize>(record: &T) -> Result<Vec<u8>, String> {
    postcard::to_allocvec(record).map_err(|error| error.to_string())
}
