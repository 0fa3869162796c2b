//! The session's frames: what opens, in which order, and what fails.

use super::*;
use crate::auth::ClusterSecret;
use crate::wire::{HEADER_LEN, Message, NONCE_LEN};

fn keys(protection: Protection) -> (SessionKeys, SessionKeys) {
    let secret = ClusterSecret::new([7u8; 32]).expect("long enough");
    let (d, l) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
    (
        secret.session_keys(Role::Dialer, &d, &l, protection),
        secret.session_keys(Role::Listener, &d, &l, protection),
    )
}

fn frame(bytes: &[u8]) -> Vec<u8> {
    Message::Notify {
        target: crate::Incarnation(3),
        bytes: bytes.to_vec(),
    }
    .encode()
}

/// Opens a sealed frame as a receiver would: header, body, tag.
fn open(opener: &mut FrameOpener, sealed: &[u8]) -> Result<Vec<u8>, Unauthentic> {
    let (header, rest) = sealed.split_at(HEADER_LEN);
    let (body, tag) = rest.split_at(rest.len() - TAG_LEN);
    let mut body = body.to_vec();
    opener.open(header, &mut body, tag.try_into().expect("a tag"))?;
    Ok(body)
}

#[test]
fn frames_open_in_order_only_and_unchanged_only() {
    for protection in [Protection::Authenticate, Protection::Encrypt] {
        let (dialer, listener) = keys(protection);
        let (mut seal, _) = dialer.split();
        let (_, mut open_here) = listener.split();
        let plain = [frame(b"first"), frame(b"second"), frame(b"third")];
        let sealed: Vec<Vec<u8>> = plain
            .iter()
            .map(|f| {
                let mut f = f.clone();
                seal.seal(&mut f);
                f
            })
            .collect();
        assert_eq!(
            open(&mut open_here, &sealed[0]),
            Ok(plain[0][HEADER_LEN..].to_vec())
        );
        let in_clear = sealed[1].windows(6).any(|window| window == b"second");
        assert_eq!(in_clear, protection == Protection::Authenticate);
        // Replayed, skipped ahead: refused, and nothing after is accepted.
        for (case, bytes) in [("replayed", &sealed[0]), ("skipped ahead", &sealed[2])] {
            let (_, mut fresh) = keys(protection).1.split();
            open(&mut fresh, &sealed[0]).expect("the first frame");
            if case == "replayed" {
                assert_eq!(
                    open(&mut fresh, bytes),
                    Err(Unauthentic { seq: 1 }),
                    "{case}"
                );
            } else {
                assert!(open(&mut fresh, bytes).is_err(), "{case}");
            }
            assert!(
                open(&mut fresh, &sealed[1]).is_err(),
                "{case}: closed for good"
            );
        }
        // Every single bit flipped, in header, body or tag, is caught.
        for bit in 0..sealed[1].len() * 8 {
            let (_, mut fresh) = keys(protection).1.split();
            open(&mut fresh, &sealed[0]).expect("the first frame");
            let mut flipped = sealed[1].clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(open(&mut fresh, &flipped).is_err(), "bit {bit}");
        }
        // A frame sealed toward the dialer does not open at the dialer's receiver as
        // one of its own, and the other secret's keys open nothing.
        let (_, mut wrong_direction) = keys(protection).0.split();
        assert!(open(&mut wrong_direction, &sealed[0]).is_err());
        let other = ClusterSecret::new([8u8; 32]).expect("long enough");
        let (_, mut outsider) = other
            .session_keys(Role::Listener, &[1; NONCE_LEN], &[2; NONCE_LEN], protection)
            .split();
        assert!(open(&mut outsider, &sealed[0]).is_err());
    }
}

#[test]
fn either_side_asking_for_encryption_is_enough() {
    assert_eq!(Protection::agreed(false, false), Protection::Authenticate);
    assert_eq!(Protection::agreed(true, false), Protection::Encrypt);
    assert_eq!(Protection::agreed(false, true), Protection::Encrypt);
}
