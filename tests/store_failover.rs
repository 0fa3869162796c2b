//! The store's master failing over through a real etcd: three `railyard master --etcd`
//! processes (one leads, two wait), two segment servers and a client, values replicated
//! twice and checked byte for byte. SIGKILL the leader: a standby takes over within the
//! lease bound, rebuilds every committed object from the journal, and the client and the
//! segment servers attach to it by themselves. SIGSTOP the next leader: the last standby
//! takes over, and the stopped one, let go again, finds its lease gone and exits instead
//! of acting on a term that is no longer its own.

#![cfg(feature = "etcd")]

mod common;

use std::time::{Duration, Instant};

use common::store::{BOUND, Process, client, value_of};
use railyard::chaos::etcd_server::EtcdServer;
use railyard::store::failover::StoreEtcd;
use railyard::store::{ReplicaConfig, Store};

const VALUE: usize = 64 << 10;
/// The leader's lease (seconds).
const TTL: u64 = 2;

fn master(etcd: &str) -> Process {
    Process::start(&["master", "--listen", "127.0.0.1:0", "--etcd", etcd])
}

/// A segment server of 16 MiB that finds the master through etcd at `url`.
fn segment_server(url: &str) -> Process {
    Process::start(&[
        "store",
        "serve",
        "--master",
        url,
        "--segment",
        "16MiB",
        "--fabric",
        "soft",
    ])
}

/// The address etcd names as the leader's, once there is one (within `BOUND`).
fn leader(etcd: &StoreEtcd) -> String {
    let start = Instant::now();
    loop {
        if let Ok(Some(addr)) = etcd.find_leader() {
            return addr;
        }
        assert!(start.elapsed() < BOUND, "no master leads");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads every key until all are back, byte for byte (within `BOUND`); returns how long
/// that took.
fn all_readable(store: &Store, keys: &[String]) -> Duration {
    let start = Instant::now();
    loop {
        let wrong = keys.iter().find(|key| {
            !store
                .get(key)
                .is_ok_and(|value| value == value_of(key, VALUE))
        });
        match wrong {
            None => return start.elapsed(),
            Some(key) => assert!(start.elapsed() < BOUND, "{key} not readable again"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The tests take turns: each times failovers of its own processes.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_killed_leader_is_replaced_with_every_committed_object_and_a_stopped_one_cannot_act() {
    let _turn = one_at_a_time();
    let etcd = EtcdServer::start(TTL).expect("etcd runs (install etcd-server; `make test` does)");
    let url = etcd.url();
    let election = StoreEtcd::from_url(&url).expect("a good URL");
    let mut masters = vec![master(&url)];
    let first = leader(&election);
    masters.push(master(&url));
    masters.push(master(&url));
    assert_eq!(first, masters[0].addr(), "the first master leads");
    let _servers = [segment_server(&url), segment_server(&url)];
    let (_engine, store) = client(&url);
    let two = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    let keys: Vec<String> = (0..16).map(|i| format!("before-{i}")).collect();
    for key in &keys {
        store.put(key, &value_of(key, VALUE), &two).expect("put");
    }
    let first_term = store.master_stats().expect("stats").term;
    assert!(first_term > 0);

    // SIGKILL the leader: a standby leads within the lease, with every committed object.
    drop(masters.remove(0));
    let killed = Instant::now();
    let back = all_readable(&store, &keys);
    let second = leader(&election);
    assert_ne!(second, first);
    let stats = store.master_stats().expect("stats");
    assert!(stats.term > first_term, "{stats:?}");
    assert_eq!(stats.objects, keys.len() as u64);
    eprintln!("after SIGKILL of the leader every object was readable again in {back:?}");
    assert!(back < Duration::from_secs(TTL + 4), "{back:?}");
    // Writes go on once the segments' owners fenced the old term's writers.
    let start = Instant::now();
    let more: Vec<String> = (0..8).map(|i| format!("after-kill-{i}")).collect();
    for key in &more {
        loop {
            match store.put(key, &value_of(key, VALUE), &two) {
                Ok(()) => break,
                Err(error) => {
                    assert!(start.elapsed() < BOUND, "{key}: {error}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
    eprintln!("puts placed again {:?} after the kill", killed.elapsed());

    // SIGSTOP the new leader: the last standby takes over; the stopped one, running again,
    // finds its term gone and exits rather than act on it.
    let stopped_index = masters
        .iter()
        .position(|m| m.addr() == second)
        .expect("the leader is one of ours");
    common::signal_stop(&masters[stopped_index].child);
    let all: Vec<String> = keys.iter().chain(&more).cloned().collect();
    let back = all_readable(&store, &all);
    let third = leader(&election);
    assert!(third != second && third != first);
    eprintln!("after SIGSTOP of the leader every object was readable again in {back:?}");
    let stopped = &mut masters[stopped_index];
    common::signal_continue(&stopped.child);
    let start = Instant::now();
    let status = loop {
        if let Some(status) = stopped.child.try_wait().expect("waitable") {
            break status;
        }
        assert!(start.elapsed() < BOUND, "the stopped leader still runs");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "it exits saying it no longer leads");
    assert!(all_readable(&store, &all) < BOUND);

    // A client that starts now finds the leader by itself.
    let (_engine, late) = client(&url);
    assert!(late.get(&all[0]).expect("get") == value_of(&all[0], VALUE));
}

/// A leader whose key went (its lease lapsed behind its back) while another was elected
/// can write nothing more: etcd refuses its term, and it knows it lost.
#[test]
fn etcd_refuses_the_journal_of_a_leader_whose_term_is_gone() {
    use railyard::store::failover::{Leadership, Standing};
    use railyard::store::master::{ClientId, JournalEntry};
    let _turn = one_at_a_time();
    let etcd = EtcdServer::start(TTL).expect("etcd runs (install etcd-server; `make test` does)");
    let election = StoreEtcd::from_url(&etcd.url()).expect("a good URL");
    let leading = |leadership: &Leadership| {
        let start = Instant::now();
        loop {
            if let Standing::Leading(term) = leadership.standing() {
                return term;
            }
            assert!(start.elapsed() < BOUND, "never elected");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let writer = |client: u64, term: u64| JournalEntry::Writer {
        client: ClientId(client),
        term,
    };
    let old = Leadership::start(election.clone(), "old:1".into()).expect("campaigns");
    let old_term = leading(&old);
    old.commit(vec![writer(1, old_term)])
        .expect("its term holds");
    // Its key goes as if its lease had lapsed; a standby is elected.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
            .await
            .expect("etcd");
        client
            .delete("/railyard/store/leader", None)
            .await
            .expect("deleted");
    });
    let new = Leadership::start(election, "new:1".into()).expect("campaigns");
    let new_term = leading(&new);
    assert!(new_term > old_term);
    assert!(
        old.commit(vec![writer(2, old_term)]).is_err(),
        "etcd refuses the old term"
    );
    assert_eq!(old.standing(), Standing::Lost);
    let written = new.load().expect("loads");
    assert_eq!(
        written.writers,
        [(ClientId(1), old_term)],
        "nothing of the old term after"
    );
}

/// With leader fencing switched off, a leader that was stopped past its lease goes on
/// serving once it runs again — a client that reaches it writes under a term that is no
/// longer its own — where the real one exits (above).
#[cfg(feature = "sabotage")]
#[test]
fn without_leader_fencing_a_stopped_leader_goes_on_acting() {
    use railyard::dataplane::sabotage::{ENV, Protection};
    let _turn = one_at_a_time();
    let etcd = EtcdServer::start(TTL).expect("etcd runs (install etcd-server; `make test` does)");
    let url = etcd.url();
    let election = StoreEtcd::from_url(&url).expect("a good URL");
    let sabotaged = |url: &str| {
        Process::start_with_env(
            &["master", "--listen", "127.0.0.1:0", "--etcd", url],
            &[(ENV, Protection::StoreLeaderFencing.name())],
        )
    };
    let mut stale = sabotaged(&url);
    let first = leader(&election);
    assert_eq!(first, stale.addr());
    let _standby = sabotaged(&url);
    let _server = segment_server(&url);
    common::signal_stop(&stale.child);
    let start = Instant::now();
    while leader(&election) == first {
        assert!(start.elapsed() < BOUND, "the standby never took over");
        std::thread::sleep(Duration::from_millis(50));
    }
    common::signal_continue(&stale.child);
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        stale.child.try_wait().expect("waitable").is_none(),
        "sabotaged, the stale leader does not step down"
    );
    // It still takes a client's change and writes it down, under a term not its own.
    let (_engine, store) = client(&first);
    let stale_term = store.master_stats().expect("it answers").term;
    store.mount(1 << 20).expect("the stale leader acts");
    let (_engine, real) = client(&url);
    assert!(real.master_stats().expect("stats").term > stale_term);
}

/// One batch of the journal may change a key twice (an object written and removed, a
/// writer recorded in two terms): etcd refuses a transaction naming a key twice, so the
/// batch writes each key's last change once — and the leader keeps leading.
#[test]
fn a_batch_changing_one_key_twice_is_written_as_its_last_change() {
    use railyard::store::failover::{Leadership, Standing};
    use railyard::store::master::{ClientId, JournalEntry};
    let _turn = one_at_a_time();
    let etcd = EtcdServer::start(TTL).expect("etcd runs (install etcd-server; `make test` does)");
    let election = StoreEtcd::from_url(&etcd.url()).expect("a good URL");
    let leadership = Leadership::start(election, "only:1".into()).expect("campaigns");
    let start = Instant::now();
    let term = loop {
        if let Standing::Leading(term) = leadership.standing() {
            break term;
        }
        assert!(start.elapsed() < BOUND, "never elected");
        std::thread::sleep(Duration::from_millis(20));
    };
    let writer = |client: u64, term: u64| JournalEntry::Writer {
        client: ClientId(client),
        term,
    };
    leadership
        .commit(vec![writer(1, term), writer(2, term), writer(1, term + 1)])
        .expect("one key changed twice in a batch is written");
    assert_eq!(leadership.standing(), Standing::Leading(term));
    let mut written = leadership.load().expect("loads").writers;
    written.sort();
    assert_eq!(written, [(ClientId(1), term + 1), (ClientId(2), term)]);
}
