//! The TCP device's own checks: attachments survive their wire form (and malformed ones are
//! named), and its queue-pair numbers are marked as TCP's.

use std::net::{IpAddr, Ipv4Addr};

use super::{TcpAttachment, TcpConfig, TcpDevice, is_tcp_qp};
use crate::fabric::soft::SoftDevice;

#[test]
fn attachments_round_trip_and_malformed_ones_are_named() {
    let v4 = TcpAttachment::Target {
        addr: "10.1.2.3:4567".parse().unwrap(),
        token: 0xABCD,
    };
    let v6 = TcpAttachment::Target {
        addr: "[fe80::1]:80".parse().unwrap(),
        token: 7,
    };
    for attachment in [TcpAttachment::Initiator, v4, v6] {
        let bytes = attachment.encode();
        assert!(TcpAttachment::is_tcp(&bytes));
        assert_eq!(TcpAttachment::decode(&bytes).unwrap(), attachment);
    }
    let error = |bytes: &[u8]| TcpAttachment::decode(bytes).unwrap_err().to_string();
    assert!(error(b"SOFT....").contains("magic"));
    assert!(error(b"RYTC").contains("no kind"));
    assert!(error(b"RYTC\x09").contains("unknown kind 9"));
    assert!(error(b"RYTC\x01\x00").contains("wrong length"));
    let mut bad_family = v4.encode();
    bad_family[5] = 5;
    assert!(error(&bad_family).contains("family 5"));
}

#[test]
fn queue_pair_numbers_are_marked_as_tcp() {
    let soft = SoftDevice::open("t0", Default::default()).unwrap();
    let device =
        TcpDevice::open(&soft, IpAddr::V4(Ipv4Addr::LOCALHOST), TcpConfig::default()).unwrap();
    let (a, info) = device.create_qp();
    let (b, _, _) = device.create_target(IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert!(is_tcp_qp(a.num) && is_tcp_qp(b.num()) && a.num != b.num());
    assert_eq!(info.qp_num, a.num.0);
    assert!(!is_tcp_qp(
        soft.create_qp(crate::fabric::Access::ALL).unwrap().num()
    ));
}
