//! An initiator's TCP queue pair on its way to the poller — prepared ([`TcpPreparedQp`]),
//! then dialing ([`TcpQp`]) — and which queue-pair numbers are TCP's ([`is_tcp_qp`]).

use std::net::TcpStream;

use super::wire::HELLO_LEN;
use crate::fabric::QpNum;

/// Whether `qp` is a TCP queue pair's number.
pub fn is_tcp_qp(qp: QpNum) -> bool {
    qp.is_high()
}

/// An initiator's queue pair before it is connected.
#[derive(Debug)]
pub struct TcpPreparedQp {
    pub(super) num: QpNum,
}

/// An initiator's queue pair, until its poller adopts it: a connection started without
/// waiting (the control thread never blocks on a peer), and the hello the poller sends
/// first once it is established.
#[derive(Debug)]
pub struct TcpQp {
    pub(super) num: QpNum,
    pub(super) stream: TcpStream,
    pub(super) hello: [u8; HELLO_LEN],
}

impl TcpQp {
    /// Its number.
    pub fn num(&self) -> QpNum {
        self.num
    }
}
