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

use crate::auth::{ClusterSecret, Role};
use crate::wire::{HEADER_LEN, NONCE_LEN};

/// Bytes of the tag after each protected frame's body.
pub const TAG_LEN: usize = 16;

/// What the keys' labels start with: the protocol and its version.
const LABEL: &[u8] = b"railyard control-plane frames v9";

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
    /// The keys of `role`'s side of the connection whose Hellos carried these nonces.
    pub fn derive(
        secret: &ClusterSecret,
        role: Role,
        dialer_nonce: &[u8; NONCE_LEN],
        listener_nonce: &[u8; NONCE_LEN],
        protection: Protection,
    ) -> Self {
        let mut salt = [0u8; 2 * NONCE_LEN];
        salt[..NONCE_LEN].copy_from_slice(dialer_nonce);
        salt[NONCE_LEN..].copy_from_slice(listener_nonce);
        let hkdf = Hkdf::<Sha256>::new(Some(&salt), secret.expose());
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
    /// Protects `frame` (a whole frame as [`Message::encode`](crate::wire::Message::encode)
    /// made it): encrypts its body if the session encrypts, and appends the tag. Frames must
    /// be sealed in the order they are written.
    pub fn seal(&mut self, frame: &mut Vec<u8>) {
        debug_assert!(frame.len() >= HEADER_LEN, "a whole frame");
        let (header, body) = frame.split_at_mut(HEADER_LEN);
        let tag = self.seal_parts(header, body);
        frame.extend_from_slice(&tag);
    }

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
mod tests {
    use super::*;
    use crate::wire::Message;

    fn keys(protection: Protection) -> (SessionKeys, SessionKeys) {
        let secret = ClusterSecret::new([7u8; 32]).expect("long enough");
        let (d, l) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        (
            SessionKeys::derive(&secret, Role::Dialer, &d, &l, protection),
            SessionKeys::derive(&secret, Role::Listener, &d, &l, protection),
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
            let (_, mut outsider) = SessionKeys::derive(
                &other,
                Role::Listener,
                &[1; NONCE_LEN],
                &[2; NONCE_LEN],
                protection,
            )
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
}
