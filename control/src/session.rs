//! Session keys and per-frame protection for a control connection after its handshake.
//!
//! With a cluster secret, each side proves it with [`crate::auth`]; from the frame after a
//! side's own [`Message::Auth`](crate::wire::Message::Auth) on, every frame it sends carries
//! a [`TAG_LEN`]-byte tag after its body, and the receiver refuses a frame whose tag does not
//! check out. The keys are per connection and per direction: HKDF-SHA256 over the cluster
//! secret, salted with both Hellos' nonces (fresh random bytes from each side), expanded
//! under a label naming the direction and the [`Protection`].
//!
//! Each direction counts its frames from 0, and the count is in every tag without being on
//! the wire: a frame dropped, replayed, reordered or injected fails its check, as does any
//! changed bit of header, body or tag. The first frame that fails closes the connection;
//! nothing in it is believed.
//!
//! - [`Protection::Authenticate`]: the tag is HMAC-SHA256 (truncated to 128 bits) over the
//!   count, the header and the body; the body travels in clear.
//! - [`Protection::Encrypt`] (`--encrypt-control`): AES-256-GCM with the count as nonce and
//!   the header as associated data; the body — region addresses, rkeys, data-port tokens,
//!   notifications — is ciphertext. (ChaCha20-Poly1305 took 1.7 µs to seal a 100-byte frame
//!   here, beyond the 1 µs budget for sealing and opening; AES-GCM with AES-NI takes 0.2 µs.
//!   `benches/control_frames.rs` measures it.) Either side asking for it is enough: the Hellos
//!   say so, and the proofs cover both Hellos, so nobody on the path can take it away.
//!
//! Data-path bytes (RDMA writes, the TCP data port) are not covered: see the README's
//! Security section.

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, KeyInit};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the tag after each protected frame's body.
pub const TAG_LEN: usize = 16;

/// What the keys' labels start with: the protocol and its version.
const LABEL: &[u8] = b"railyard control-plane frames v9";

/// Which side of a control connection: the one that dialed, or the one that accepted. A
/// proof ([`crate::auth`]) and a direction's key both depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that dialed.
    Dialer,
    /// The side that accepted.
    Listener,
}

/// How a connection's frames are protected after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// A MAC on every frame; bodies in clear.
    Authenticate,
    /// Bodies encrypted, with an AEAD tag on every frame.
    Encrypt,
}

impl Protection {
    /// The protection two sides use: encryption when either asks for it.
    pub fn agreed(dialer_encrypts: bool, listener_encrypts: bool) -> Self {
        if dialer_encrypts || listener_encrypts {
            Self::Encrypt
        } else {
            Self::Authenticate
        }
    }
}

/// One direction's key, ready for use.
#[derive(Clone)]
enum Cipher {
    Mac(Hmac<Sha256>),
    Aead(Box<Aes256Gcm>),
}

impl Cipher {
    fn new(protection: Protection, key: &[u8; 32]) -> Self {
        match protection {
            // HMAC takes keys of any length.
            Protection::Authenticate => Self::Mac(
                <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!()),
            ),
            Protection::Encrypt => Self::Aead(Box::new(Aes256Gcm::new(key.into()))),
        }
    }

    fn mac(keyed: &Hmac<Sha256>, seq: u64, header: &[u8], body: &[u8]) -> Hmac<Sha256> {
        let mut mac = keyed.clone();
        mac.update(&seq.to_le_bytes());
        mac.update(header);
        mac.update(body);
        mac
    }

    /// The AEAD nonce of frame `seq`: unique per key, since each key is one direction of one
    /// connection.
    fn nonce(seq: u64) -> aes_gcm::Nonce<aes_gcm::aead::consts::U12> {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_le_bytes());
        nonce.into()
    }
}

/// The keys of one side of one connection: [`Self::split`] gives what seals the frames it
/// sends and what opens the frames it receives.
pub struct SessionKeys {
    sealer: FrameSealer,
    opener: FrameOpener,
}

impl SessionKeys {
    /// The keys of `role`'s side of the connection whose Hellos carried these nonces, under
    /// the cluster secret's bytes ([`ClusterSecret::session_keys`] is how callers get them).
    ///
    /// [`ClusterSecret::session_keys`]: crate::auth::ClusterSecret::session_keys
    pub(crate) fn derive(
        secret: &[u8],
        role: Role,
        dialer_nonce: &[u8],
        listener_nonce: &[u8],
        protection: Protection,
    ) -> Self {
        let salt = [dialer_nonce, listener_nonce].concat();
        let hkdf = Hkdf::<Sha256>::new(Some(&salt), secret);
        let key = |direction: &[u8]| {
            let mode: &[u8] = match protection {
                Protection::Authenticate => b" hmac-sha256 ",
                Protection::Encrypt => b" aes-256-gcm ",
            };
            let mut key = [0u8; 32];
            // 32 bytes is far below HKDF-SHA256's limit of 255 × 32.
            hkdf.expand_multi_info(&[LABEL, mode, direction], &mut key)
                .unwrap_or_else(|_| unreachable!());
            Cipher::new(protection, &key)
        };
        let to_listener = key(b"dialer to listener");
        let to_dialer = key(b"listener to dialer");
        let (send, receive) = match role {
            Role::Dialer => (to_listener, to_dialer),
            Role::Listener => (to_dialer, to_listener),
        };
        Self {
            sealer: FrameSealer {
                cipher: send,
                seq: 0,
            },
            opener: FrameOpener {
                cipher: receive,
                seq: 0,
            },
        }
    }

    /// What seals outgoing frames, and what opens incoming ones.
    pub fn split(self) -> (FrameSealer, FrameOpener) {
        (self.sealer, self.opener)
    }
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(..)")
    }
}

/// Protects the frames one side sends, in the order they go on the wire.
pub struct FrameSealer {
    cipher: Cipher,
    seq: u64,
}

impl std::fmt::Debug for FrameSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameSealer {{ sealed: {} }}", self.seq)
    }
}

impl FrameSealer {
    /// Protects the next frame, given as its `header` (covered, never encrypted) and its
    /// `body` (encrypted in place if the session encrypts); returns the tag that follows
    /// it on the wire. For protocols with their own framing (the store's).
    pub fn seal_parts(&mut self, header: &[u8], body: &mut [u8]) -> [u8; TAG_LEN] {
        let seq = self.seq;
        self.seq += 1;
        match &self.cipher {
            Cipher::Mac(keyed) => {
                let full = Cipher::mac(keyed, seq, header, body)
                    .finalize()
                    .into_bytes();
                let mut tag = [0u8; TAG_LEN];
                tag.copy_from_slice(&full[..TAG_LEN]);
                tag
            }
            Cipher::Aead(aead) => aead
                .encrypt_in_place_detached(&Cipher::nonce(seq), header, body)
                // Only bodies beyond 64 GiB are refused; a frame is at most 64 MiB.
                .unwrap_or_else(|_| unreachable!())
                .into(),
        }
    }
}

/// Checks (and decrypts) the frames one side receives, in the order they arrive.
pub struct FrameOpener {
    cipher: Cipher,
    seq: u64,
}

/// A frame failed its check: altered, dropped, replayed, reordered or forged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "frame {seq} after the handshake failed its authentication check (altered, out of order, replayed or forged)"
)]
pub struct Unauthentic {
    /// The frame's place in its direction, counted from the sender's Auth.
    pub seq: u64,
}

impl std::fmt::Debug for FrameOpener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameOpener {{ opened: {} }}", self.seq)
    }
}

impl FrameOpener {
    /// Checks the frame of `header` (a control frame's 12 bytes, or another protocol's own)
    /// and `body` against `tag` and, if the session encrypts, decrypts `body` in place. A frame that fails leaves the opener unusable: the
    /// connection must close.
    ///
    /// # Errors
    /// [`Unauthentic`] for a frame that is not the sender's next frame, unchanged.
    pub fn open(
        &mut self,
        header: &[u8],
        body: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> Result<(), Unauthentic> {
        let seq = self.seq;
        let checked = match &self.cipher {
            Cipher::Mac(keyed) => Cipher::mac(keyed, seq, header, body)
                .verify_truncated_left(tag)
                .is_ok(),
            Cipher::Aead(aead) => aead
                .decrypt_in_place_detached(&Cipher::nonce(seq), header, body, tag.into())
                .is_ok(),
        };
        if !checked {
            return Err(self.refuse());
        }
        self.seq += 1;
        Ok(())
    }

    /// The next frame cannot be what the sender sealed (a header no sender writes, or a
    /// length beyond the bound): it fails like a frame whose tag does not check out.
    pub fn refuse(&mut self) -> Unauthentic {
        let seq = self.seq;
        // Never again: the count no longer says where the stream is.
        self.seq = u64::MAX;
        Unauthentic { seq }
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
