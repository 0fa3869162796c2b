//! The round trip `railyard bench --latency` measures and `railyard serve --echo` answers: a
//! write of N bytes into the target's pool with a ping notification, answered by the
//! target's write of those N bytes back into the pinger's landing area and a pong
//! notification. Both notifications are text, so a person reading `serve`'s output or a
//! capture sees what they are.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context as _, bail};
use railyard::control::Incarnation;
use railyard::dataplane::Batch;
use railyard::engine::{Engine, EngineSubmitter, Op, Peer, Region, Transfer};

const PING: &str = "railyard-ping";
const PONG: &str = "railyard-pong";

/// A ping: write `len` bytes into `landing` at the engine listening at `reply_to`, then say
/// pong `seq`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Ping {
    pub(crate) reply_to: String,
    pub(crate) landing: u64,
    pub(crate) len: u64,
    pub(crate) seq: u64,
}

impl Ping {
    pub(crate) fn encode(&self) -> Vec<u8> {
        format!(
            "{PING} {} {:#x} {} {}",
            self.reply_to, self.landing, self.len, self.seq
        )
        .into_bytes()
    }

    /// The ping `bytes` hold, if they hold one.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut words = text.split(' ');
        if words.next()? != PING {
            return None;
        }
        let reply_to = words.next()?.to_string();
        let landing = u64::from_str_radix(words.next()?.strip_prefix("0x")?, 16).ok()?;
        let len = words.next()?.parse().ok()?;
        let seq = words.next()?.parse().ok()?;
        if words.next().is_some() {
            return None;
        }
        Some(Self {
            reply_to,
            landing,
            len,
            seq,
        })
    }
}

pub(crate) fn encode_pong(seq: u64) -> Vec<u8> {
    format!("{PONG} {seq}").into_bytes()
}

/// The sequence number of the pong `bytes` hold, if they hold one.
pub(crate) fn decode_pong(bytes: &[u8]) -> Option<u64> {
    std::str::from_utf8(bytes)
        .ok()?
        .strip_prefix(PONG)?
        .strip_prefix(' ')?
        .parse()
        .ok()
}

/// The answering side (`serve --echo`): the pinging engines it has opened, and the pool
/// whose first bytes — where pings land — it writes back.
pub(crate) struct Echo {
    submitter: EngineSubmitter,
    pool: Region,
    /// By the address pings name: the peer opened there, and the last answer sent to it.
    peers: HashMap<String, (Peer, Option<Batch>)>,
}

/// Most pinging engines one echo keeps open.
const MAX_ECHO_PEERS: usize = 64;

impl Echo {
    pub(crate) fn new(engine: &Engine, pool: Region) -> anyhow::Result<Self> {
        Ok(Self {
            submitter: engine.submitter()?,
            pool,
            peers: HashMap::new(),
        })
    }

    /// Writes `ping.len` bytes of the pool back to the pinger — the process that sent the
    /// ping (`sender`), found at the address it names, and no other — and says pong after
    /// them.
    pub(crate) fn answer(
        &mut self,
        engine: &Engine,
        ping: &Ping,
        sender: Incarnation,
    ) -> anyhow::Result<()> {
        if ping.len == 0 || ping.len > self.pool.len {
            bail!(
                "a ping of {} bytes does not fit the pool of {} bytes",
                ping.len,
                self.pool.len
            );
        }
        // Opened afresh for a pinger that restarted at the same address, or whose last
        // answer failed.
        let stale = self.peers.get(&ping.reply_to).is_some_and(|(peer, last)| {
            peer.incarnation() != sender
                || last.as_ref().is_some_and(|batch| batch.poll().failed > 0)
        });
        if stale {
            self.peers.remove(&ping.reply_to);
        }
        if !self.peers.contains_key(&ping.reply_to) {
            if self.peers.len() >= MAX_ECHO_PEERS {
                self.peers.clear();
            }
            let peer = engine
                .open(&ping.reply_to)
                .with_context(|| format!("opening the pinger {}", ping.reply_to))?;
            if peer.incarnation() != sender {
                bail!(
                    "a ping from {sender} names {}, where {} answers: not answered (an echo \
                     writes back only to the process that pinged)",
                    ping.reply_to,
                    peer.incarnation()
                );
            }
            self.peers.insert(ping.reply_to.clone(), (peer, None));
        }
        let Some((peer, last)) = self.peers.get_mut(&ping.reply_to) else {
            bail!("the pinger {} is not open", ping.reply_to);
        };
        let back = Transfer {
            op: Op::Write,
            local: self.pool,
            local_offset: 0,
            remote_addr: ping.landing,
            len: ping.len,
        };
        match self
            .submitter
            .submit_and_notify(peer, &[back], encode_pong(ping.seq))
        {
            Ok(batch) => {
                *last = Some(batch);
                Ok(())
            }
            Err(error) => {
                self.peers.remove(&ping.reply_to);
                Err(error).with_context(|| format!("answering {}", ping.reply_to))
            }
        }
    }
}

/// Waits until `engine` receives pong `seq` (other notifications are dropped), at most
/// until `deadline`; whether it came.
pub(crate) fn wait_for_pong(engine: &Engine, seq: u64, deadline: Instant) -> bool {
    loop {
        for notification in engine.wait_notifications(deadline) {
            if let railyard::control::NotificationBody::Bytes(bytes) = &notification.body
                && decode_pong(bytes) == Some(seq)
            {
                return true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pings_and_pongs_read_back_what_was_written_and_nothing_else() {
        let ping = Ping {
            reply_to: "127.0.0.1:7400".into(),
            landing: 0x7f00_0000_1000,
            len: 4096,
            seq: 17,
        };
        assert_eq!(Ping::decode(&ping.encode()), Some(ping));
        assert_eq!(decode_pong(&encode_pong(9)), Some(9));
        assert_eq!(Ping::decode(b"railyard-ping 1.2.3.4:5 0x10 8"), None);
        assert_eq!(Ping::decode(b"railyard-ping 1.2.3.4:5 16 8 1"), None);
        assert_eq!(Ping::decode(b"hello"), None);
        assert_eq!(decode_pong(b"railyard-pongs 1"), None);
        assert_eq!(decode_pong(&[0xff, 0xfe]), None);
    }
}
