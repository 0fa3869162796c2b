//! The master service with real engines: a zombie writer's space comes back only after its
//! segment's owner fenced it (and the zombie's late bytes are refused by the owner's
//! engine), and a master with a cluster secret admits only clients that prove it and
//! refuses any frame after the handshake that is not the client's next one, unchanged.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use railyard_engine::control::{ClusterSecret, HostId};
use railyard_engine::dataplane::{FailReason, IdleStrategy, RequestOutcome};
use railyard_engine::{Engine, Op, RailChoice, Transfer};

use super::{MasterConfig, MasterServer};
use crate::client::link::MasterLink;
use crate::config::{MasterPolicy, ReplicaConfig};
use crate::error::StoreErrorKind;
use crate::handshake::{self, Identity};
use crate::protocol::{
    FrameWriter, PROTOCOL_VERSION, PutItem, Reply, Request, ToClient, ToMaster, read_frame,
};
use crate::{Store, StoreOptions};

const BOUND: Duration = Duration::from_secs(10);

fn engine(name: &str, secret: Option<&ClusterSecret>) -> Engine {
    let mut builder = Engine::builder(name)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle());
    if let Some(secret) = secret {
        builder = builder.secret(secret.clone());
    }
    builder.build().expect("the engine starts")
}

fn master(policy: MasterPolicy, secret: Option<ClusterSecret>) -> MasterServer {
    MasterServer::start(MasterConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        policy,
        secret,
        name: "master".into(),
        election: None,
        advertise: None,
    })
    .expect("the master starts")
}

#[test]
fn a_zombie_writers_space_returns_only_after_its_owner_fenced_it() {
    let policy = MasterPolicy {
        put_timeout: Duration::from_millis(300),
        ..MasterPolicy::default()
    };
    let master = master(policy, None);
    let owner_engine = engine("owner", None);
    let owner = Store::connect(&owner_engine, StoreOptions::new(master.addr().to_string()))
        .expect("connects");
    owner.mount(4 << 20).expect("mounts");

    // The zombie starts a write of the whole segment and never ends it.
    let zombie = engine("zombie", None);
    let (events, _) = mpsc::channel();
    let link = MasterLink::connect(
        &master.addr().to_string(),
        &Identity {
            name: "zombie".into(),
            incarnation: zombie.incarnation(),
            host: HostId::this_process(),
        },
        None,
        BOUND,
        events,
    )
    .expect("connects");
    let request = Request::PutStart {
        items: vec![PutItem {
            key: "zombie".into(),
            size: 4 << 20,
        }],
        config: ReplicaConfig::default(),
        upsert: false,
        avoid: Vec::new(),
    };
    let Ok(Reply::Tickets(mut tickets)) = link.call(request, BOUND) else {
        panic!("put-start answered");
    };
    let ticket = tickets.remove(0).expect("placed");
    let replica = ticket.replicas[0].clone();

    // The zombie writes part of it, over a connection it keeps.
    let source = zombie.alloc(4 << 20, None).expect("alloc");
    let peer = zombie
        .open(&replica.handshake_addr)
        .expect("reaches the owner");
    let mut submitter = zombie.submitter().expect("a submitter");
    let write = |submitter: &mut railyard_engine::EngineSubmitter| {
        let batch = submitter
            .submit(
                &peer,
                &[Transfer {
                    op: Op::Write,
                    local: source,
                    local_offset: 0,
                    remote_addr: replica.addr,
                    len: 4096,
                }],
            )
            .expect("submitted");
        assert!(batch.wait(Instant::now() + BOUND).is_complete());
        batch.outcome(0)
    };
    assert_eq!(write(&mut submitter), Some(RequestOutcome::Done));

    // Past the put timeout the master abandons the write and asks the owner for a fence;
    // the owner revokes the zombie on its engine and says so; only then is the space free.
    let deadline = Instant::now() + BOUND;
    while master.stats().counters.puts_abandoned == 0 || master.stats().fences_pending > 0 {
        assert!(
            Instant::now() < deadline,
            "fenced within the bound: {:?}",
            master.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(master.stats().segments[0].reserved, 0);

    // The zombie's late bytes over its old connection: refused by the owner's engine, never
    // landing in the next object; its late put-end: refused by the master.
    assert_eq!(
        write(&mut submitter),
        Some(RequestOutcome::Failed(FailReason::Revoked))
    );
    let late = link.call(
        Request::PutEnd {
            items: vec![("zombie".into(), ticket.put)],
        },
        BOUND,
    );
    let Ok(Reply::Each(answers)) = late else {
        panic!("put-end answered");
    };
    assert_eq!(
        answers[0].as_ref().expect_err("too late").kind,
        StoreErrorKind::PutTimedOut
    );
    owner
        .put("next", &[7u8; 4096], &ReplicaConfig::default())
        .expect("the space is handed out again");
}

#[test]
fn a_master_with_a_secret_admits_only_clients_that_prove_it() {
    let secret = ClusterSecret::new(vec![0x5a; 32]).expect("a secret");
    let wrong = ClusterSecret::new(vec![0xa5; 32]).expect("a secret");
    let master = master(MasterPolicy::default(), Some(secret.clone()));
    let options = |secret: Option<ClusterSecret>| StoreOptions {
        secret,
        timeout: Duration::from_secs(3),
        ..StoreOptions::new(master.addr().to_string())
    };
    for (name, given) in [("none", None), ("wrong", Some(wrong))] {
        let engine = engine(name, None);
        let refused = Store::connect(&engine, options(given))
            .err()
            .expect("refused");
        assert!(
            matches!(refused.kind, StoreErrorKind::MasterUnreachable { .. }),
            "{name}: {refused}"
        );
    }
    let engine = engine("member", Some(&secret));
    let store = Store::connect(&engine, options(Some(secret))).expect("admitted");
    store.mount(1 << 20).expect("mounts");
    store
        .put("k", b"v", &ReplicaConfig::default())
        .expect("puts");
    assert_eq!(store.get("k").expect("gets"), b"v");
}

#[test]
fn frames_after_the_handshake_that_fail_their_check_close_the_connection_unanswered() {
    let secret = ClusterSecret::new(vec![0x5a; 32]).expect("a secret");
    let master = master(MasterPolicy::default(), Some(secret.clone()));
    let open = ToMaster {
        id: 1,
        request: Request::Open {
            version: PROTOCOL_VERSION,
        },
    };
    // (what is done to the first frame's bytes after the genuine one, whether it is
    // answered)
    type Tamper = fn(&[u8]) -> Vec<u8>;
    let cases: [(&str, Tamper); 4] = [
        ("the genuine frame once more (a replay)", <[u8]>::to_vec),
        ("a bit flipped", |frame| {
            let mut flipped = frame.to_vec();
            flipped[6] ^= 0x10;
            flipped
        }),
        ("a tag made up", |frame| {
            let mut forged = frame.to_vec();
            let len = forged.len();
            forged[len - 16..].fill(0);
            forged
        }),
        ("nothing at all, then a later frame", |_| Vec::new()),
    ];
    for (round, (case, tamper)) in cases.into_iter().enumerate() {
        let mut stream = std::net::TcpStream::connect(master.addr()).expect("connects");
        stream.set_read_timeout(Some(BOUND)).expect("a timeout");
        let me = Identity {
            name: "by-hand".into(),
            incarnation: railyard_engine::control::Incarnation(0x77 + round as u64),
            host: HostId::this_process(),
        };
        let (_, keys) =
            handshake::dial(&mut stream, master.addr(), &me, Some(&secret)).expect("admitted");
        let (sealer, mut opener) = keys.expect("session keys").split();
        // Frames sealed in order, kept as bytes: the first, and one after it.
        let mut sealed = FrameWriter::new(Vec::new(), Some(sealer));
        sealed.write(&open).expect("sealed");
        let first = std::mem::take(sealed.get_mut());
        sealed.write(&open).expect("sealed");
        let second = std::mem::take(sealed.get_mut());
        let said = if case.starts_with("nothing") {
            second
        } else {
            use std::io::Write;
            stream.write_all(&first).expect("writes");
            let answer: ToClient =
                read_frame(&mut &stream, Some(&mut opener)).expect("an answer that opens");
            assert!(
                matches!(
                    answer,
                    ToClient::Reply {
                        id: 1,
                        reply: Reply::Opened { .. }
                    }
                ),
                "{case}: {answer:?}"
            );
            tamper(&first)
        };
        {
            use std::io::Write;
            stream.write_all(&said).expect("writes");
        }
        let after = read_frame::<ToClient>(&mut &stream, Some(&mut opener));
        assert!(after.is_err(), "{case}: answered {after:?}");
        let started = Instant::now();
        while master.stats().counters.auth_failures < round as u64 + 1 {
            assert!(started.elapsed() < BOUND, "{case}: not counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(master.stats().counters.auth_failures, 4);
}

#[test]
fn a_writer_submits_nothing_once_its_put_has_timed_out() {
    let policy = MasterPolicy {
        put_timeout: Duration::from_nanos(1),
        ..MasterPolicy::default()
    };
    let master = master(policy, None);
    let owner_engine = engine("owner", None);
    let owner = Store::connect(&owner_engine, StoreOptions::new(master.addr().to_string()))
        .expect("connects");
    owner.mount(1 << 20).expect("mounts");
    let engine = engine("late-writer", None);
    let store =
        Store::connect(&engine, StoreOptions::new(master.addr().to_string())).expect("connects");
    let refused = store
        .put("late", &[1u8; 4096], &ReplicaConfig::default())
        .expect_err("expired before it was submitted");
    match refused.kind {
        StoreErrorKind::TransferFailed { detail } => {
            assert!(detail.contains("timed out before"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    let submitted: u64 = engine
        .stats()
        .peers
        .iter()
        .map(|peer| peer.requests())
        .sum();
    assert_eq!(submitted, 0, "nothing was submitted");
    assert!(!store.exists("late").expect("valid"));
}
