//! Finding RDMA devices at run time. `ibv_get_device_list` failing (ENOSYS on a kernel
//! without RDMA support) or listing nothing is a specific reason, worked out once per process
//! and reported by whoever asks: `--fabric auto` falls back to the soft fabric and says why,
//! `--fabric verbs` fails with it.

use std::ffi::CStr;
use std::io;
use std::sync::OnceLock;

/// Why the verbs fabric cannot run here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct VerbsUnavailable {
    /// In words, with the errno when there is one.
    pub reason: String,
}

/// The reason for an `ibv_get_device_list` failure with `error`.
pub fn reason_for(error: &io::Error) -> String {
    match error.raw_os_error() {
        Some(libc::ENOSYS) => {
            "ibv_get_device_list: ENOSYS (the kernel has no RDMA support)".to_string()
        }
        Some(libc::EPERM | libc::EACCES) => {
            format!("ibv_get_device_list: {error} (no permission to open /dev/infiniband/uverbs*)")
        }
        _ => format!("ibv_get_device_list: {error}"),
    }
}

fn list() -> Result<Vec<String>, VerbsUnavailable> {
    let mut count = 0;
    // SAFETY:
    // - `count` is a valid out-pointer; the returned list (or null) is ours to free.
    let devices = unsafe { rdma_sys::ibv_get_device_list(&mut count) };
    if devices.is_null() {
        return Err(VerbsUnavailable {
            reason: reason_for(&io::Error::last_os_error()),
        });
    }
    let mut names = Vec::new();
    for index in 0..usize::try_from(count).unwrap_or(0) {
        // SAFETY:
        // - The list holds `count` valid device pointers; each name is a NUL-terminated
        //   string owned by the device, copied out before the list is freed.
        let name = unsafe {
            let device = *devices.add(index);
            CStr::from_ptr(rdma_sys::ibv_get_device_name(device))
                .to_string_lossy()
                .into_owned()
        };
        names.push(name);
    }
    // SAFETY:
    // - `devices` came from ibv_get_device_list and is freed once; no pointer into it is
    //   kept (names were copied).
    unsafe { rdma_sys::ibv_free_device_list(devices) };
    if names.is_empty() {
        return Err(VerbsUnavailable {
            reason: "ibv_get_device_list found no RDMA device".to_string(),
        });
    }
    Ok(names)
}

/// The RDMA devices of this host, or why there are none. Asked once per process.
///
/// # Errors
/// [`VerbsUnavailable`] with the reason.
pub fn devices() -> Result<Vec<String>, VerbsUnavailable> {
    static PROBED: OnceLock<Result<Vec<String>, VerbsUnavailable>> = OnceLock::new();
    PROBED.get_or_init(list).clone()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn failures_have_specific_reasons() {
        let enosys = reason_for(&io::Error::from_raw_os_error(libc::ENOSYS));
        assert!(
            enosys.contains("ENOSYS") && enosys.contains("no RDMA support"),
            "{enosys}"
        );
        let eperm = reason_for(&io::Error::from_raw_os_error(libc::EPERM));
        assert!(eperm.contains("/dev/infiniband"), "{eperm}");
    }

    #[test]
    fn probing_this_host_gives_devices_or_a_reason_and_the_same_answer_twice() {
        let first = devices();
        assert_eq!(first, devices());
        match first {
            Ok(names) => assert!(!names.is_empty()),
            Err(unavailable) => assert!(unavailable.reason.starts_with("ibv_get_device_list")),
        }
    }
}
