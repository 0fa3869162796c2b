//! How a store connection opens: the control plane's Hello both ways and, with a cluster
//! secret, its Auth proofs both ways (dialer first), on a blocking socket — so the master
//! admits exactly the processes a railyard peer would, and knows each by its incarnation.
//! With a secret, each side comes out with the connection's session keys, which
//! authenticate every frame after the handshake ([`crate::protocol`]).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use railyard_engine::control::auth::{self, Role, Transcript};
use railyard_engine::control::session::SessionKeys;
use railyard_engine::control::wire::{self, HEADER_LEN, MAX_HELLO_BODY};
use railyard_engine::control::{ClusterSecret, HostId, Incarnation, Message};

/// What a Hello says about its sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// Its name (a label).
    pub(crate) name: String,
    /// Its engine's incarnation.
    pub(crate) incarnation: Incarnation,
    /// Its host.
    pub(crate) host: HostId,
}

/// What `listen` says in a store Hello: which side of a store connection the sender is.
const MASTER: &str = "railyard-store-master";
const CLIENT: &str = "railyard-store-client";

fn hello(me: &Identity, role: &str) -> Message {
    Message::Hello {
        name: me.name.clone(),
        incarnation: me.incarnation,
        host: me.host,
        listen: role.to_owned(),
        nonce: auth::nonce(),
        encrypt: false,
    }
}

/// A handshake frame's name, for errors.
fn kind(message: &Message) -> &'static str {
    match message {
        Message::Hello { .. } => "Hello",
        Message::Auth { .. } => "Auth",
        Message::Bye => "Bye",
        _ => "another control frame",
    }
}

fn send(stream: &mut TcpStream, message: &Message) -> Result<(), String> {
    stream
        .write_all(&message.encode())
        .map_err(|error| format!("sending {}: {error}", kind(message)))
}

fn receive(stream: &mut TcpStream) -> Result<Message, String> {
    let mut header = [0u8; HEADER_LEN];
    stream
        .read_exact(&mut header)
        .map_err(|error| format!("reading the handshake: {error}"))?;
    let (kind, len) = wire::decode_header(&header).map_err(|error| error.to_string())?;
    if len > MAX_HELLO_BODY {
        return Err(format!("a handshake frame of {len} bytes"));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|error| format!("reading the handshake: {error}"))?;
    Message::decode_body(kind, &body).map_err(|error| error.to_string())
}

/// Who sent `message`, if it is a Hello from the `role` side.
fn identity(message: &Message, role: &str) -> Result<Identity, String> {
    match message {
        Message::Hello {
            name,
            incarnation,
            host,
            listen,
            ..
        } if listen == role => Ok(Identity {
            name: name.clone(),
            incarnation: *incarnation,
            host: *host,
        }),
        Message::Hello { listen, .. } => Err(format!(
            "not a railyard store {}: its Hello says {listen:?}",
            if role == MASTER { "master" } else { "client" }
        )),
        other => Err(format!("expected Hello, got {}", kind(other))),
    }
}

fn proof(message: &Message) -> Result<[u8; wire::MAC_LEN], String> {
    match message {
        Message::Auth { mac } => Ok(*mac),
        other => Err(format!(
            "expected the proof of the cluster secret (Auth), got {}",
            kind(other)
        )),
    }
}

/// Opens a connection to the master at `dialed` as `me`; returns the master's identity and,
/// with a secret, the connection's session keys.
pub(crate) fn dial(
    stream: &mut TcpStream,
    dialed: SocketAddr,
    me: &Identity,
    secret: Option<&ClusterSecret>,
) -> Result<(Identity, Option<SessionKeys>), String> {
    let mine = hello(me, CLIENT);
    send(stream, &mine)?;
    let theirs = receive(stream)?;
    let master = identity(&theirs, MASTER)?;
    if let Some(secret) = secret {
        let transcript = Transcript {
            dialer_hello: &mine,
            listener_hello: &theirs,
            dialed,
        };
        send(
            stream,
            &Message::Auth {
                mac: auth::prove(secret, Role::Dialer, &transcript),
            },
        )?;
        let mac = proof(&receive(stream)?)?;
        if !auth::verify(secret, Role::Listener, &transcript, &mac) {
            return Err("the master's proof of the cluster secret is wrong".into());
        }
        return Ok((
            master,
            secret.session_keys_for(Role::Dialer, &mine, &theirs),
        ));
    }
    Ok((master, None))
}

/// Admits a client that dialed `local` (this master's address as it dialed it); returns
/// the client's identity and, with a secret, the connection's session keys.
pub(crate) fn accept(
    stream: &mut TcpStream,
    local: SocketAddr,
    me: &Identity,
    secret: Option<&ClusterSecret>,
) -> Result<(Identity, Option<SessionKeys>), String> {
    let theirs = receive(stream)?;
    let client = identity(&theirs, CLIENT)?;
    let mine = hello(me, MASTER);
    send(stream, &mine)?;
    if let Some(secret) = secret {
        let transcript = Transcript {
            dialer_hello: &theirs,
            listener_hello: &mine,
            dialed: local,
        };
        let mac = proof(&receive(stream)?)?;
        if !auth::verify(secret, Role::Dialer, &transcript, &mac) {
            return Err("wrong proof of the cluster secret".into());
        }
        send(
            stream,
            &Message::Auth {
                mac: auth::prove(secret, Role::Listener, &transcript),
            },
        )?;
        return Ok((
            client,
            secret.session_keys_for(Role::Listener, &theirs, &mine),
        ));
    }
    Ok((client, None))
}
