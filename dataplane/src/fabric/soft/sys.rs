//! The soft fabric's system calls: the only module of it that calls libc. Everything above
//! it works with owned descriptors, [`Mapping`]s and `io::Result`s.

use std::io::{self, Read};
use std::mem;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;

/// Returns `Err(last OS error)` when a libc call returned -1.
fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// A new anonymous shared-memory file of `len` zero bytes, sealed so that it can never shrink
/// or grow: a peer that maps it can never take a SIGBUS from the owner truncating it.
pub(crate) fn sealed_memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    memfd(name, len, 0)
}

/// Like [`sealed_memfd`], backed by 2 MiB huge pages from the hugetlb pool (`len` must be a
/// multiple of 2 MiB). Fails when the pool has too few pages.
pub(crate) fn sealed_hugetlb_memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    memfd(name, len, libc::MFD_HUGETLB | libc::MFD_HUGE_2MB)
}

fn memfd(name: &str, len: usize, extra_flags: libc::c_uint) -> io::Result<OwnedFd> {
    let name = std::ffi::CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY:
    // - `name` is a NUL-terminated string that outlives the call.
    let raw = check(unsafe {
        libc::memfd_create(
            name.as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | extra_flags,
        )
    })?;
    // SAFETY:
    // - memfd_create returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY:
    // - `fd` is an open memfd; ftruncate and fcntl take plain integers.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), len) })?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: as above.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
    Ok(fd)
}

/// Whether `fd` is a memfd sealed against shrinking, and its length.
pub(crate) fn sealed_len(fd: BorrowedFd<'_>) -> io::Result<Option<u64>> {
    // SAFETY:
    // - `fd` is open for the duration of the borrow.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals == -1 || seals & libc::F_SEAL_SHRINK == 0 {
        return Ok(None);
    }
    // SAFETY:
    // - `stat` is plain old data; all-zero is a valid value.
    let mut stat: libc::stat = unsafe { mem::zeroed() };
    // SAFETY:
    // - `fd` is open and `stat` is a valid, writable `struct stat`.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) })?;
    Ok(u64::try_from(stat.st_size).ok())
}

/// A shared mapping of a file (`memmap2`'s raw map: only pointers, since the peer process
/// and this one's pollers write it too), unmapped on drop.
///
/// # Invariants
/// `map` is a live `MAP_SHARED` mapping of `len` bytes owned by this value. Every access to
/// its contents goes through atomics (`Mapping::atomic`) or through raw copies whose
/// callers state why no other thread writes the same bytes.
#[derive(Debug)]
pub(crate) struct Mapping {
    map: memmap2::MmapRaw,
    len: usize,
}

impl Mapping {
    /// Maps the first `len` bytes of `fd`, shared, read-only unless `writable`.
    pub(crate) fn new(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        let map = if writable {
            options.map_raw(fd.as_raw_fd())?
        } else {
            options.map_raw_read_only(fd.as_raw_fd())?
        };
        Ok(Self { map, len })
    }

    /// The address of the first byte in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.map.as_mut_ptr() as u64
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Asks the kernel for transparent huge pages on this mapping. `false` when it refuses.
    pub(crate) fn advise_huge_pages(&self) -> bool {
        self.map.advise(memmap2::Advice::HugePage).is_ok()
    }

    /// Touches every page so that none faults later (on the data path).
    ///
    /// # Safety
    /// Nothing else may be using the mapping: each page's first byte is written (with the
    /// value it has).
    pub(crate) unsafe fn prefault(&self) {
        const PAGE: usize = 4096;
        for offset in (0..self.len).step_by(PAGE) {
            // SAFETY:
            // - `offset < len`: inside the live, writable mapping (callers map writable
            //   buffers only); the caller guarantees no concurrent user.
            unsafe {
                let byte = self.map.as_mut_ptr().add(offset);
                byte.write_volatile(byte.read_volatile());
            }
        }
    }

    /// The 8-byte word at `offset`, as an atomic. `None` when it is not inside the mapping
    /// or not 8-byte aligned. On a read-only mapping only `Relaxed` loads are allowed (what
    /// std documents as sound on read-only memory); callers pair them with fences.
    pub(crate) fn atomic(&self, offset: usize) -> Option<&AtomicU64> {
        if offset % 8 != 0 || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY:
        // - `offset + 8 <= len`, so the word lies inside the live mapping (invariant).
        // - The mapping is page-aligned and `offset` a multiple of 8: the word is aligned.
        // - The word is only ever accessed atomically, here and in the peer process.
        // - The reference cannot outlive `self`, which keeps the mapping alive.
        Some(unsafe { &*self.map.as_mut_ptr().add(offset).cast::<AtomicU64>() })
    }
}

/// Which way `process_vm` moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// From this process into the peer.
    Write,
    /// From the peer into this process.
    Read,
}

/// Moves `len` bytes between `local` in this process and `remote` in process `pid` with
/// `process_vm_writev` / `process_vm_readv`, looping over partial transfers. Faults in either
/// range are reported as EFAULT by the kernel, never as a crash here.
pub(crate) fn process_vm(
    direction: Direction,
    pid: libc::pid_t,
    local: u64,
    remote: u64,
    len: usize,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let local_iov = libc::iovec {
            iov_base: (local as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY:
        // - The kernel checks both ranges against the address spaces and reports faults as
        //   EFAULT; it never writes outside the iovecs. The local range was validated
        //   against a registration whose owner promised it stays valid (`register` is
        //   unsafe for that reason).
        // - Both iovec arrays have one element and live across the call.
        let moved = unsafe {
            match direction {
                Direction::Write => libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0),
                Direction::Read => libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0),
            }
        };
        match moved {
            -1 => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
            0 => return Err(io::Error::from_raw_os_error(libc::EFAULT)),
            n => done += n as usize,
        }
    }
    Ok(())
}

/// A descriptor that becomes readable when process `pid` exits.
pub(crate) fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY:
    // - pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY:
    // - The syscall returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as RawFd) })
}

/// A duplicate, in this process, of descriptor `fd` of the process behind `pidfd`. Needs the
/// same permission as `process_vm_writev` (ptrace attach).
pub(crate) fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY:
    // - pidfd_getfd takes two descriptors and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY:
    // - The syscall returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as RawFd) })
}

/// Whether the process behind `pidfd` has exited (does not wait).
pub(crate) fn has_exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut poll = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY:
    // - One valid pollfd, zero timeout.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready > 0 && poll.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

/// The pid of the process at the other end of a Unix socket, as the kernel knows it.
pub(crate) fn peer_pid(socket: &UnixStream) -> io::Result<libc::pid_t> {
    // SAFETY:
    // - `ucred` is plain old data; all-zero is a valid value.
    let mut cred: libc::ucred = unsafe { mem::zeroed() };
    let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY:
    // - `cred` and `len` are valid and writable; the kernel writes at most `len` bytes.
    check(unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred.pid)
}

/// Most descriptors one handshake frame carries.
pub(crate) const MAX_FDS: usize = 2;

/// The control-message buffer for [`MAX_FDS`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct FdBuffer([u8; 64]);

/// Sends `bytes` with `fds` attached (SCM_RIGHTS).
pub(crate) fn send_with_fds(
    socket: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    debug_assert!(fds.len() <= MAX_FDS && !fds.is_empty());
    let mut control = FdBuffer([0; 64]);
    let fds_len = mem::size_of_val(fds);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY:
    // - `msghdr` is plain old data; all-zero is a valid value.
    let mut message: libc::msghdr = unsafe { mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY:
    // - CMSG_SPACE is a pure size computation.
    message.msg_controllen = unsafe { libc::CMSG_SPACE(fds_len as u32) } as usize;
    debug_assert!(message.msg_controllen <= control.0.len());
    // SAFETY:
    // - `message` points at `control`, which is large enough for one header with
    //   `fds_len` bytes of data (asserted above), so CMSG_FIRSTHDR is non-null and the
    //   header and its data lie inside `control`.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(fds_len as u32) as usize;
        let data = libc::CMSG_DATA(header).cast::<RawFd>();
        for (index, fd) in fds.iter().enumerate() {
            data.add(index).write_unaligned(fd.as_raw_fd());
        }
    }
    // SAFETY:
    // - `message` and everything it points to live across the call.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &message, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let sent = sent as usize;
    if sent < bytes.len() {
        // The descriptors went with the first byte; the rest is plain data.
        io::Write::write_all(&mut &*socket, &bytes[sent..])?;
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and the descriptors attached to them (at most
/// [`MAX_FDS`]). Honours the socket's read timeout.
pub(crate) fn recv_with_fds(socket: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    let mut control = FdBuffer([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY:
    // - `msghdr` is plain old data; all-zero is a valid value.
    let mut message: libc::msghdr = unsafe { mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.0.as_mut_ptr().cast();
    message.msg_controllen = control.0.len();
    let received = loop {
        // SAFETY:
        // - `message` points at `buf` and `control`, both writable and alive across the
        //   call; the kernel writes at most their lengths.
        let received =
            unsafe { libc::recvmsg(socket.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC) };
        if received >= 0 {
            break received as usize;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    };
    let mut fds = Vec::new();
    // SAFETY:
    // - The kernel filled `message.msg_control` with well-formed headers up to
    //   `msg_controllen`; CMSG_FIRSTHDR/NXTHDR stay inside it. Each SCM_RIGHTS payload is an
    //   array of descriptors the kernel just installed in this process, owned by no one
    //   else, so wrapping each in an OwnedFd (which closes it) is right, including the ones
    //   past MAX_FDS that are closed at once.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                let payload = (*header).cmsg_len - libc::CMSG_LEN(0) as usize;
                for index in 0..payload / mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(index).read_unaligned()));
                }
            }
            header = libc::CMSG_NXTHDR(&message, header);
        }
    }
    if message.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "peer attached more descriptors than a handshake carries",
        ));
    }
    if received == 0 && !buf.is_empty() {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    (&*socket).read_exact(&mut buf[received..])?;
    Ok(fds)
}
