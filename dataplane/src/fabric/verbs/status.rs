//! Verbs completion statuses mapped onto the fabric model's seven.
//!
//! The model keeps verbs' names for the statuses the policy acts on. The rest map by whom
//! they charge: a malformed or forbidden local request is the slice's (LOC_LEN / LOC_PROT),
//! a request the responder rejects is the slice's (REM_INV_REQ), and everything that says
//! the transport or the responder failed is the peer's (RETRY_EXC).

use rdma_sys::ibv_wc_status as wc;

use crate::fabric::WcStatus;

/// The model's status for a verbs `ibv_wc_status` value.
pub fn map_status(status: wc::Type) -> WcStatus {
    match status {
        wc::IBV_WC_SUCCESS => WcStatus::Success,
        wc::IBV_WC_LOC_LEN_ERR | wc::IBV_WC_LOC_QP_OP_ERR | wc::IBV_WC_LOC_EEC_OP_ERR => {
            WcStatus::LocLenErr
        }
        wc::IBV_WC_LOC_PROT_ERR
        | wc::IBV_WC_LOC_ACCESS_ERR
        | wc::IBV_WC_MW_BIND_ERR
        | wc::IBV_WC_LOC_RDD_VIOL_ERR => WcStatus::LocProtErr,
        wc::IBV_WC_REM_ACCESS_ERR => WcStatus::RemAccessErr,
        wc::IBV_WC_REM_INV_REQ_ERR
        | wc::IBV_WC_REM_OP_ERR
        | wc::IBV_WC_REM_INV_RD_REQ_ERR
        | wc::IBV_WC_REM_ABORT_ERR => WcStatus::RemInvReqErr,
        wc::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushErr,
        // RETRY_EXC, RNR_RETRY_EXC, BAD_RESP, RESP_TIMEOUT, FATAL, GENERAL and anything
        // newer: the transport or the responder failed us.
        _ => WcStatus::RetryExcErr,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_status_maps_to_whom_it_charges() {
        assert_eq!(map_status(wc::IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(map_status(wc::IBV_WC_LOC_LEN_ERR), WcStatus::LocLenErr);
        assert_eq!(map_status(wc::IBV_WC_LOC_QP_OP_ERR), WcStatus::LocLenErr);
        assert_eq!(map_status(wc::IBV_WC_LOC_PROT_ERR), WcStatus::LocProtErr);
        assert_eq!(map_status(wc::IBV_WC_LOC_ACCESS_ERR), WcStatus::LocProtErr);
        assert_eq!(
            map_status(wc::IBV_WC_REM_ACCESS_ERR),
            WcStatus::RemAccessErr
        );
        assert_eq!(
            map_status(wc::IBV_WC_REM_INV_REQ_ERR),
            WcStatus::RemInvReqErr
        );
        assert_eq!(map_status(wc::IBV_WC_REM_OP_ERR), WcStatus::RemInvReqErr);
        assert_eq!(map_status(wc::IBV_WC_WR_FLUSH_ERR), WcStatus::WrFlushErr);
        for transport in [
            wc::IBV_WC_RETRY_EXC_ERR,
            wc::IBV_WC_RNR_RETRY_EXC_ERR,
            wc::IBV_WC_BAD_RESP_ERR,
            wc::IBV_WC_RESP_TIMEOUT_ERR,
            wc::IBV_WC_FATAL_ERR,
            wc::IBV_WC_GENERAL_ERR,
            999,
        ] {
            assert_eq!(map_status(transport), WcStatus::RetryExcErr, "{transport}");
        }
        // Every work-request error the policy charges to a slice stays one.
        for slice_error in [1, 2, 3, 4, 6, 8, 9, 10, 11, 14, 15, 16] {
            assert!(
                map_status(slice_error).is_work_request_error(),
                "{slice_error}"
            );
        }
    }
}
