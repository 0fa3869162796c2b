//! Cluster authentication: a secret every member holds, proven on each control connection.
//!
//! With a [`ClusterSecret`], each side of a control connection puts fresh random bytes in its
//! Hello, and then proves the secret with [`Message::Auth`]: HMAC-SHA256 under the secret over
//! a domain label, the sender's role (dialer or listener), the address the dialer dialed, and
//! both Hellos of this connection as encoded — names, incarnations, hosts, announced
//! listeners and nonces. The dialer proves first; the listener checks the proof against the
//! addresses it is reached at (its handshake address and the connection's local address) and
//! answers with its own only once the dialer's checked out.
//!
//! A proof is bound to one connection's nonces, so a recorded handshake replayed on another
//! connection fails; to the address dialed, so a member that dials an impostor signs nothing
//! the impostor can present to another member (or back to it); and to the role, so a proof
//! cannot be reflected. Proofs are compared in constant time. Until both are in, the core
//! answers nothing but Hello, Auth and Bye, and sends nothing else.
//!
//! Every frame after a side's Auth is protected with keys derived from the secret and both
//! nonces ([`crate::session`]): a MAC always, encryption on request.

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::session::{Protection, SessionKeys};
use crate::wire::{MAC_LEN, Message, NONCE_LEN};

/// What a proof is computed over first: the protocol and its version.
const DOMAIN: &[u8] = b"railyard control-plane auth v1";

/// The secret shared by a cluster's members. Its `Debug` shows its length, never its bytes.
#[derive(Clone)]
pub struct ClusterSecret(Arc<[u8]>);

/// Why a secret cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The secret file cannot be read.
    #[error("cannot read the cluster secret from {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Too few bytes to be a secret.
    #[error(
        "a cluster secret of {len} bytes is too short: at least {} are needed (`railyard secret new FILE` writes one)",
        ClusterSecret::MIN_LEN
    )]
    TooShort {
        /// Its length.
        len: usize,
    },
}

impl ClusterSecret {
    /// The fewest bytes a secret may have.
    pub const MIN_LEN: usize = 16;

    /// A secret of these bytes.
    ///
    /// # Errors
    /// [`SecretError::TooShort`] under [`Self::MIN_LEN`] bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        let bytes: Vec<u8> = bytes.into();
        if bytes.len() < Self::MIN_LEN {
            return Err(SecretError::TooShort { len: bytes.len() });
        }
        Ok(Self(bytes.into()))
    }

    /// The secret in the file at `path`: its bytes, without trailing whitespace (the newline
    /// an editor or `echo` adds). It should be random (a proof on the wire allows guessing a
    /// weak one offline) and readable by its owner only: a warning says so when others may
    /// read it.
    ///
    /// # Errors
    /// [`SecretError::Read`] when it cannot be read; [`SecretError::TooShort`].
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        let read_error = |source| SecretError::Read {
            path: path.display().to_string(),
            source,
        };
        let mut bytes = std::fs::read(path).map_err(read_error)?;
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(path).map_err(read_error)?.permissions(),
        );
        if mode & 0o077 != 0 {
            tracing::warn!(
                target: "railyard::control",
                path = %path.display(),
                mode = format_args!("{:o}", mode & 0o777),
                "the cluster secret's file may be read by others than its owner (chmod 600 it)"
            );
        }
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        Self::new(bytes)
    }

    /// The keys of `role`'s side of the connection whose Hellos carried these nonces
    /// ([`crate::session`]): HKDF-SHA256 over the secret, salted with both nonces.
    pub fn session_keys(
        &self,
        role: Role,
        dialer_nonce: &[u8; NONCE_LEN],
        listener_nonce: &[u8; NONCE_LEN],
        protection: Protection,
    ) -> SessionKeys {
        SessionKeys::derive(&self.0, role, dialer_nonce, listener_nonce, protection)
    }

    /// The keys of `role`'s side of the connection whose Hellos, as sent, were `dialer` and
    /// `listener`: salted with their nonces, encrypting if either asked. `None` unless both
    /// are Hellos.
    pub fn session_keys_for(
        &self,
        role: Role,
        dialer: &Message,
        listener: &Message,
    ) -> Option<SessionKeys> {
        let (
            Message::Hello {
                nonce: dialer_nonce,
                encrypt: dialer_encrypts,
                ..
            },
            Message::Hello {
                nonce: listener_nonce,
                encrypt: listener_encrypts,
                ..
            },
        ) = (dialer, listener)
        else {
            return None;
        };
        let protection = Protection::agreed(*dialer_encrypts, *listener_encrypts);
        Some(self.session_keys(role, dialer_nonce, listener_nonce, protection))
    }

    fn keyed(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length.
        Hmac::<Sha256>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterSecret({} bytes)", self.0.len())
    }
}

pub use crate::session::Role;

/// What a proof covers: the connection's two Hellos, as sent, and the address the dialer
/// dialed.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    /// The dialer's Hello.
    pub dialer_hello: &'a Message,
    /// The listener's Hello.
    pub listener_hello: &'a Message,
    /// The listener's address, as the dialer dialed it.
    pub dialed: SocketAddr,
}

/// The MAC over `role` and `transcript` under `secret`.
fn keyed_transcript(
    secret: &ClusterSecret,
    role: Role,
    transcript: &Transcript<'_>,
) -> Hmac<Sha256> {
    let mut mac = secret.keyed();
    mac.update(DOMAIN);
    mac.update(&[match role {
        Role::Dialer => 0,
        Role::Listener => 1,
    }]);
    // The same address however it is spelled: an IPv4 address seen through an IPv6 socket
    // (`::ffff:a.b.c.d`), or with a scope only one host knows, is the plain one.
    let dialed = SocketAddr::new(
        transcript.dialed.ip().to_canonical(),
        transcript.dialed.port(),
    )
    .to_string();
    mac.update(&(dialed.len() as u64).to_le_bytes());
    mac.update(dialed.as_bytes());
    for hello in [transcript.dialer_hello, transcript.listener_hello] {
        let frame = hello.encode();
        mac.update(&(frame.len() as u64).to_le_bytes());
        mac.update(&frame);
    }
    mac
}

/// The proof `role` sends on a connection whose handshake was `transcript` (what a member's
/// [`Message::Auth`] carries).
pub fn prove(secret: &ClusterSecret, role: Role, transcript: &Transcript<'_>) -> [u8; MAC_LEN] {
    keyed_transcript(secret, role, transcript)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is `role`'s proof over `transcript` (compared in constant time).
pub fn verify(
    secret: &ClusterSecret,
    role: Role,
    transcript: &Transcript<'_>,
    proof: &[u8; MAC_LEN],
) -> bool {
    keyed_transcript(secret, role, transcript)
        .verify_slice(proof)
        .is_ok()
}

/// Fresh random bytes for a Hello, from the kernel.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut bytes = [0u8; NONCE_LEN];
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&railyard_dataplane::entropy::random_u64().to_le_bytes());
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Incarnation;
    use crate::host::HostId;

    fn hello(incarnation: u64, nonce: u8) -> Message {
        Message::Hello {
            name: "peer".into(),
            incarnation: Incarnation(incarnation),
            host: HostId::default(),
            listen: "127.0.0.1:1".into(),
            nonce: [nonce; NONCE_LEN],
            encrypt: false,
        }
    }

    fn dialed(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    #[test]
    fn a_proof_holds_for_its_role_secret_hellos_and_address_only() {
        let secret = ClusterSecret::new(*b"0123456789abcdef").expect("long enough");
        let (dialer, listener, again) = (hello(1, 1), hello(2, 2), hello(2, 3));
        let transcript = Transcript {
            dialer_hello: &dialer,
            listener_hello: &listener,
            dialed: dialed(7000),
        };
        let proof = prove(&secret, Role::Dialer, &transcript);
        assert!(verify(&secret, Role::Dialer, &transcript, &proof));
        assert!(!verify(&secret, Role::Listener, &transcript, &proof));
        let other = ClusterSecret::new(*b"0123456789abcdeX").expect("long enough");
        assert!(!verify(&other, Role::Dialer, &transcript, &proof));
        // Another connection: another nonce; another address dialed.
        let replayed = Transcript {
            listener_hello: &again,
            ..transcript
        };
        assert!(!verify(&secret, Role::Dialer, &replayed, &proof));
        let elsewhere = Transcript {
            dialed: dialed(7001),
            ..transcript
        };
        assert!(!verify(&secret, Role::Dialer, &elsewhere, &proof));
        // The listener sees the address through an IPv6 socket: the same one.
        let mapped = Transcript {
            dialed: "[::ffff:10.0.0.1]:7000".parse().expect("an address"),
            ..transcript
        };
        assert!(verify(&secret, Role::Dialer, &mapped, &proof));
    }

    #[test]
    fn short_secrets_are_refused_and_files_lose_their_newline() {
        assert!(matches!(
            ClusterSecret::new(*b"short"),
            Err(SecretError::TooShort { len: 5 })
        ));
        let path = std::env::temp_dir().join(format!("railyard-secret-{}", std::process::id()));
        std::fs::write(&path, b"0123456789abcdef\n").expect("writes");
        let read = ClusterSecret::from_file(&path).expect("reads");
        std::fs::remove_file(&path).expect("removes");
        let direct = ClusterSecret::new(*b"0123456789abcdef").expect("long enough");
        let (d, l) = (hello(1, 1), hello(2, 2));
        let transcript = Transcript {
            dialer_hello: &d,
            listener_hello: &l,
            dialed: dialed(1),
        };
        assert_eq!(
            prove(&read, Role::Dialer, &transcript),
            prove(&direct, Role::Dialer, &transcript)
        );
        assert_eq!(format!("{read:?}"), "ClusterSecret(16 bytes)");
        assert!(ClusterSecret::from_file(Path::new("/nonexistent/secret")).is_err());
    }
}
