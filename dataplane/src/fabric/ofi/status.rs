//! libfabric's completion errors (`fi_cq_err_entry.err`) as verbs' statuses.

use railyard_ofi_sys as sys;

use crate::fabric::WcStatus;

/// The status of a completion that failed with `err` (a positive `FI_E*` code) and the
/// provider's own `prov_errno`.
pub(crate) fn map_error(err: u32, prov_errno: i32) -> WcStatus {
    match err {
        // railyard never cancels an RMA itself. The tcp provider answers a request its
        // target refuses (no such key, a range outside the region) by closing the
        // connection, and cancels what was on it with the errno its own thread last saw, not
        // a code from the target: on a quiet host that is one of these, but on a loaded one
        // the same refusal can come as ENOTCONN and reads as a flush (a transport failure).
        // A best guess, then; the refusal can only be told apart reliably by the target.
        sys::FI_ECANCELED
            if matches!(
                prov_errno.unsigned_abs(),
                sys::FI_ENOENT | sys::FI_EINVAL | sys::FI_EACCES | sys::FI_EPERM | sys::FI_EFAULT
            ) =>
        {
            WcStatus::RemAccessErr
        }
        // Cancelled, or flushed with its endpoint.
        sys::FI_ECANCELED => WcStatus::WrFlushErr,
        // A key, range or access the target's registration does not allow.
        sys::FI_EACCES | sys::FI_EKEYREJECTED | sys::FI_ENOKEY | sys::FI_EFAULT | sys::FI_EPERM => {
            WcStatus::RemAccessErr
        }
        // A local length the provider cannot carry.
        sys::FI_EMSGSIZE | sys::FI_ETOOSMALL | sys::FI_ETRUNC => WcStatus::LocLenErr,
        // The peer cannot be reached, or its connection broke.
        sys::FI_ETIMEDOUT
        | sys::FI_EHOSTUNREACH
        | sys::FI_ECONNREFUSED
        | sys::FI_ECONNRESET
        | sys::FI_ECONNABORTED
        | sys::FI_ENOTCONN
        | sys::FI_ESHUTDOWN
        | sys::FI_EHOSTDOWN
        | sys::FI_ENETUNREACH
        | sys::FI_ENETDOWN
        | sys::FI_EIO => WcStatus::RetryExcErr,
        _ => WcStatus::RemInvReqErr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_of_error_has_its_status() {
        assert_eq!(map_error(sys::FI_ECANCELED, 0), WcStatus::WrFlushErr);
        assert_eq!(map_error(sys::FI_ECANCELED, 2), WcStatus::RemAccessErr);
        assert_eq!(map_error(sys::FI_EACCES, 0), WcStatus::RemAccessErr);
        assert_eq!(map_error(sys::FI_EKEYREJECTED, 0), WcStatus::RemAccessErr);
        assert_eq!(map_error(sys::FI_ENOKEY, 0), WcStatus::RemAccessErr);
        assert_eq!(map_error(sys::FI_EMSGSIZE, 0), WcStatus::LocLenErr);
        assert_eq!(map_error(sys::FI_ECONNREFUSED, 0), WcStatus::RetryExcErr);
        assert_eq!(map_error(sys::FI_EIO, 0), WcStatus::RetryExcErr);
        assert_eq!(map_error(sys::FI_EOPNOTSUPP, 0), WcStatus::RemInvReqErr);
    }
}
