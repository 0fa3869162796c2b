//! Path MTU: verbs' enum, and the negotiation both sides of a queue pair agree on — the
//! smaller of their ports' active MTUs. (A mismatch is a known cause of LOC_LEN_ERR storms.)

use rdma_sys::ibv_mtu;

/// A verbs path MTU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathMtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl PathMtu {
    /// Bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Self::Mtu256 => 256,
            Self::Mtu512 => 512,
            Self::Mtu1024 => 1024,
            Self::Mtu2048 => 2048,
            Self::Mtu4096 => 4096,
        }
    }

    /// From bytes, as carried in `QpInfo`.
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        Some(match bytes {
            256 => Self::Mtu256,
            512 => Self::Mtu512,
            1024 => Self::Mtu1024,
            2048 => Self::Mtu2048,
            4096 => Self::Mtu4096,
            _ => return None,
        })
    }

    /// From verbs' `ibv_mtu` (a port's `active_mtu`).
    pub fn from_ibv(mtu: ibv_mtu::Type) -> Option<Self> {
        Some(match mtu {
            ibv_mtu::IBV_MTU_256 => Self::Mtu256,
            ibv_mtu::IBV_MTU_512 => Self::Mtu512,
            ibv_mtu::IBV_MTU_1024 => Self::Mtu1024,
            ibv_mtu::IBV_MTU_2048 => Self::Mtu2048,
            ibv_mtu::IBV_MTU_4096 => Self::Mtu4096,
            _ => return None,
        })
    }

    /// As verbs' `ibv_mtu`, for `ibv_qp_attr.path_mtu`.
    pub fn to_ibv(self) -> ibv_mtu::Type {
        match self {
            Self::Mtu256 => ibv_mtu::IBV_MTU_256,
            Self::Mtu512 => ibv_mtu::IBV_MTU_512,
            Self::Mtu1024 => ibv_mtu::IBV_MTU_1024,
            Self::Mtu2048 => ibv_mtu::IBV_MTU_2048,
            Self::Mtu4096 => ibv_mtu::IBV_MTU_4096,
        }
    }

    /// What both sides use: the smaller.
    pub fn negotiate(local: Self, remote: Self) -> Self {
        local.min(remote)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn mtus_round_trip_and_negotiate_down() {
        for mtu in [
            PathMtu::Mtu256,
            PathMtu::Mtu512,
            PathMtu::Mtu1024,
            PathMtu::Mtu2048,
            PathMtu::Mtu4096,
        ] {
            assert_eq!(PathMtu::from_bytes(mtu.bytes()), Some(mtu));
            assert_eq!(PathMtu::from_ibv(mtu.to_ibv()), Some(mtu));
        }
        assert_eq!(PathMtu::from_bytes(1500), None);
        assert_eq!(PathMtu::from_ibv(0), None);
        assert_eq!(
            PathMtu::negotiate(PathMtu::Mtu4096, PathMtu::Mtu1024),
            PathMtu::Mtu1024
        );
        assert_eq!(
            PathMtu::negotiate(PathMtu::Mtu2048, PathMtu::Mtu4096),
            PathMtu::Mtu2048
        );
    }
}
