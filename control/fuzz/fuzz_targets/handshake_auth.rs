//! Any bytes, read as a connection's frames: every Hello pair and Auth in them is checked as
//! the handshake checks a proof. The check must never panic, and must accept a proof only
//! when it is exactly the one the secret gives for that transcript.
#![no_main]

use libfuzzer_sys::fuzz_target;
use railyard_control::auth::{self, ClusterSecret, Role, Transcript};
use railyard_control::wire::{FrameDecoder, Message};

fuzz_target!(|data: &[u8]| {
    let Ok(secret) = ClusterSecret::new(*b"railyard-fuzzing-secret") else {
        return;
    };
    let mut decoder = FrameDecoder::default();
    if decoder.push(data).is_err() {
        return;
    }
    let mut hellos = Vec::new();
    while let Ok(Some(message)) = decoder.next_message() {
        match message {
            Message::Hello { .. } => hellos.push(message),
            Message::Auth { mac } if hellos.len() >= 2 => {
                let transcript = Transcript {
                    dialer_hello: &hellos[hellos.len() - 2],
                    listener_hello: &hellos[hellos.len() - 1],
                    dialed: "127.0.0.1:7400".parse().expect("an address"),
                };
                for role in [Role::Dialer, Role::Listener] {
                    let expected = auth::prove(&secret, role, &transcript) == mac;
                    assert_eq!(auth::verify(&secret, role, &transcript, &mac), expected);
                }
            }
            _ => {}
        }
    }
});
