//! Queue-pair attributes for each verbs transition, built from plain configuration: no
//! device is needed, so every field and mask is tested on any machine.

use rdma_sys::{ibv_access_flags, ibv_qp_attr, ibv_qp_attr_mask as mask, ibv_qp_state};

use super::mtu::PathMtu;

/// Capacities of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth (verbs' `max_send_wr`).
    pub max_send_wr: u32,
    /// Receive queue depth (for WRITE_WITH_IMM arrivals).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Bytes a write may carry inline (copied into the request, no lkey needed).
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 4096,
            max_recv_wr: 256,
            max_send_sge: 1,
            max_inline_data: 64,
        }
    }
}

/// How a queue pair is set up. Defaults are perftest's and NCCL's common choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// The device port (from 1).
    pub port: u8,
    /// Source GID index; `None` for InfiniBand addressing by LID only.
    pub gid_index: Option<u8>,
    /// Capacities.
    pub caps: QpCaps,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before RETRY_EXC_ERR (at most 7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries, at most [`MAX_RNR_RETRY`] (verbs' 7 means forever: a
    /// peer that never posts a receive would hold the queue pair for good).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer (12 ≈ 0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs as initiator and as target.
    pub max_rd_atomic: u8,
    /// Hop limit of routed (RoCE v2, global) packets.
    pub hop_limit: u8,
    /// Traffic class of routed packets (RoCE v2: DSCP and ECN, e.g. 106 for DSCP 26 on a
    /// lossless class).
    pub traffic_class: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: None,
            caps: QpCaps::default(),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: MAX_RNR_RETRY,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            hop_limit: 64,
            traffic_class: 0,
        }
    }
}

/// The peer's side, as the handshake carried it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteQp {
    /// Its QP number.
    pub qp_num: u32,
    /// Its port LID (InfiniBand).
    pub lid: u16,
    /// Its GID.
    pub gid: [u8; 16],
    /// Its first PSN.
    pub psn: u32,
}

/// verbs' access flags for a registration with `access`.
pub fn access_flags(access: crate::fabric::Access) -> u32 {
    use crate::fabric::Access;
    let mut flags = 0;
    for (ours, theirs) in [
        (
            Access::LOCAL_WRITE,
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
        ),
        (
            Access::REMOTE_WRITE,
            ibv_access_flags::IBV_ACCESS_REMOTE_WRITE,
        ),
        (
            Access::REMOTE_READ,
            ibv_access_flags::IBV_ACCESS_REMOTE_READ,
        ),
    ] {
        if access.contains(ours) {
            flags |= theirs.0;
        }
    }
    flags
}

/// What remote peers may do through the queue pair.
pub fn remote_access() -> u32 {
    (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
        .0
}

fn zeroed() -> ibv_qp_attr {
    // SAFETY:
    // - `ibv_qp_attr` is a plain C struct of integers (and unions of integers): all-zero is
    //   a valid value, and what verbs expects for fields the mask does not name.
    unsafe { std::mem::zeroed() }
}

/// RESET → INIT.
pub fn init(config: &QpConfig) -> (ibv_qp_attr, i32) {
    let mut attr = zeroed();
    attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = config.port;
    attr.qp_access_flags = remote_access();
    let bits = mask::IBV_QP_STATE
        | mask::IBV_QP_PKEY_INDEX
        | mask::IBV_QP_PORT
        | mask::IBV_QP_ACCESS_FLAGS;
    (attr, bits.0 as i32)
}

/// The outstanding RDMA READ depth to ask for: what the configuration wants, but no more
/// than the device allows as target (`max_qp_rd_atom`) and as initiator
/// (`max_qp_init_rd_atom`) — more makes `ibv_modify_qp` fail — and at least 1.
pub fn clamp_read_depth(wanted: u8, device_as_target: u8, device_as_initiator: u8) -> u8 {
    wanted.min(device_as_target).min(device_as_initiator).max(1)
}

/// The most receiver-not-ready retries asked for: 7 would be infinite.
pub const MAX_RNR_RETRY: u8 = 6;

/// INIT → RTR, towards `remote`, at the negotiated `mtu`.
pub fn ready_to_receive(config: &QpConfig, remote: &RemoteQp, mtu: PathMtu) -> (ibv_qp_attr, i32) {
    let mut attr = zeroed();
    attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
    attr.path_mtu = mtu.to_ibv();
    attr.dest_qp_num = remote.qp_num;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = config.max_rd_atomic;
    attr.min_rnr_timer = config.min_rnr_timer;
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.sl = 0;
    attr.ah_attr.src_path_bits = 0;
    attr.ah_attr.port_num = config.port;
    if let Some(index) = config.gid_index {
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid.raw = remote.gid;
        attr.ah_attr.grh.sgid_index = index;
        attr.ah_attr.grh.hop_limit = config.hop_limit;
        attr.ah_attr.grh.traffic_class = config.traffic_class;
        attr.ah_attr.grh.flow_label = 0;
    }
    let bits = mask::IBV_QP_STATE
        | mask::IBV_QP_AV
        | mask::IBV_QP_PATH_MTU
        | mask::IBV_QP_DEST_QPN
        | mask::IBV_QP_RQ_PSN
        | mask::IBV_QP_MAX_DEST_RD_ATOMIC
        | mask::IBV_QP_MIN_RNR_TIMER;
    (attr, bits.0 as i32)
}

/// RTR → RTS, sending from `local_psn`.
pub fn ready_to_send(config: &QpConfig, local_psn: u32) -> (ibv_qp_attr, i32) {
    let mut attr = zeroed();
    attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
    attr.sq_psn = local_psn;
    attr.timeout = config.timeout;
    attr.retry_cnt = config.retry_cnt.min(7);
    attr.rnr_retry = config.rnr_retry.min(MAX_RNR_RETRY);
    attr.max_rd_atomic = config.max_rd_atomic;
    let bits = mask::IBV_QP_STATE
        | mask::IBV_QP_SQ_PSN
        | mask::IBV_QP_TIMEOUT
        | mask::IBV_QP_RETRY_CNT
        | mask::IBV_QP_RNR_RETRY
        | mask::IBV_QP_MAX_QP_RD_ATOMIC;
    (attr, bits.0 as i32)
}

/// Any state → ERR (flushes everything outstanding).
pub fn error() -> (ibv_qp_attr, i32) {
    let mut attr = zeroed();
    attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
    (attr, mask::IBV_QP_STATE.0 as i32)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn has(bits: i32, flag: mask) -> bool {
        bits as u32 & flag.0 == flag.0
    }

    const REMOTE: RemoteQp = RemoteQp {
        qp_num: 0x1234,
        lid: 7,
        gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2],
        psn: 0xabcde,
    };

    #[test]
    fn init_sets_port_pkey_and_remote_access() {
        let (attr, bits) = init(&QpConfig {
            port: 2,
            ..QpConfig::default()
        });
        assert_eq!(attr.qp_state, ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(attr.port_num, 2);
        assert_eq!(attr.qp_access_flags, 1 | 2 | 4);
        assert_eq!(
            bits as u32,
            (mask::IBV_QP_STATE
                | mask::IBV_QP_PKEY_INDEX
                | mask::IBV_QP_PORT
                | mask::IBV_QP_ACCESS_FLAGS)
                .0
        );
    }

    #[test]
    fn rtr_on_infiniband_addresses_by_lid_and_on_roce_by_gid() {
        let ib = QpConfig::default();
        let (attr, bits) = ready_to_receive(&ib, &REMOTE, PathMtu::Mtu2048);
        assert_eq!(attr.qp_state, ibv_qp_state::IBV_QPS_RTR);
        assert_eq!((attr.dest_qp_num, attr.rq_psn), (0x1234, 0xabcde));
        assert_eq!(attr.path_mtu, PathMtu::Mtu2048.to_ibv());
        assert_eq!((attr.ah_attr.dlid, attr.ah_attr.is_global), (7, 0));
        for flag in [
            mask::IBV_QP_AV,
            mask::IBV_QP_PATH_MTU,
            mask::IBV_QP_DEST_QPN,
            mask::IBV_QP_RQ_PSN,
            mask::IBV_QP_MAX_DEST_RD_ATOMIC,
            mask::IBV_QP_MIN_RNR_TIMER,
        ] {
            assert!(has(bits, flag));
        }
        assert!(!has(bits, mask::IBV_QP_SQ_PSN));

        let roce = QpConfig {
            gid_index: Some(3),
            ..QpConfig::default()
        };
        let (attr, _) = ready_to_receive(&roce, &REMOTE, PathMtu::Mtu1024);
        assert_eq!(attr.ah_attr.is_global, 1);
        assert_eq!(attr.ah_attr.grh.sgid_index, 3);
        assert_eq!(attr.ah_attr.grh.hop_limit, 64);
        // SAFETY: `raw` is the variant just written.
        assert_eq!(unsafe { attr.ah_attr.grh.dgid.raw }, REMOTE.gid);
    }

    #[test]
    fn the_read_depth_is_what_the_device_allows_and_the_traffic_class_is_configured() {
        assert_eq!(clamp_read_depth(16, 8, 16), 8);
        assert_eq!(clamp_read_depth(16, 16, 4), 4);
        assert_eq!(clamp_read_depth(2, 16, 16), 2);
        assert_eq!(clamp_read_depth(16, 0, 0), 1, "never zero");
        let roce = QpConfig {
            gid_index: Some(3),
            traffic_class: 106,
            ..QpConfig::default()
        };
        let (attr, _) = ready_to_receive(&roce, &REMOTE, PathMtu::Mtu1024);
        assert_eq!(attr.ah_attr.grh.traffic_class, 106);
    }

    #[test]
    fn rts_sets_psn_timeouts_and_clamps_retries() {
        let config = QpConfig {
            retry_cnt: 9,
            rnr_retry: 200,
            ..QpConfig::default()
        };
        let (attr, bits) = ready_to_send(&config, 0x42);
        assert_eq!(attr.qp_state, ibv_qp_state::IBV_QPS_RTS);
        assert_eq!((attr.sq_psn, attr.timeout), (0x42, 14));
        assert_eq!((attr.retry_cnt, attr.rnr_retry), (7, MAX_RNR_RETRY));
        for flag in [
            mask::IBV_QP_SQ_PSN,
            mask::IBV_QP_TIMEOUT,
            mask::IBV_QP_RETRY_CNT,
            mask::IBV_QP_RNR_RETRY,
            mask::IBV_QP_MAX_QP_RD_ATOMIC,
        ] {
            assert!(has(bits, flag));
        }
        let (attr, bits) = error();
        assert_eq!(attr.qp_state, ibv_qp_state::IBV_QPS_ERR);
        assert_eq!(bits as u32, mask::IBV_QP_STATE.0);
    }
}
