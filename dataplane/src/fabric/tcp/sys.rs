//! The TCP fabric's system calls: epoll, vectored non-blocking sends that never raise
//! SIGPIPE, receives straight into registered memory, and socket options.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn check(result: libc::ssize_t) -> io::Result<usize> {
    usize::try_from(result).map_err(|_| io::Error::last_os_error())
}

/// Receives up to `len` bytes into `addr` without blocking. `Ok(0)` is end of stream.
///
/// # Safety
/// `[addr, addr + len)` must be valid for writes for the duration of the call.
pub(crate) unsafe fn recv_into(fd: RawFd, addr: u64, len: usize) -> io::Result<usize> {
    // SAFETY: the caller guarantees the range; the kernel writes at most `len` bytes there.
    check(unsafe { libc::recv(fd, addr as *mut libc::c_void, len, libc::MSG_DONTWAIT) })
}

/// Sends the `iov` entries in order without blocking; returns the bytes the kernel took.
/// A closed peer is an error (EPIPE), never a signal.
///
/// # Safety
/// Every entry must name memory valid for reads for the duration of the call.
pub(crate) unsafe fn send_vectored(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    // SAFETY: `msghdr` is plain old data; all-zero is valid (no name, no control data).
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = iov.as_ptr().cast_mut();
    message.msg_iovlen = iov.len();
    // SAFETY: `message` names `iov`, whose entries the caller guarantees.
    check(unsafe { libc::sendmsg(fd, &message, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) })
}

/// An epoll instance, level-triggered, polled without waiting.
#[derive(Debug)]
pub(crate) struct Epoll {
    fd: OwnedFd,
    ready: Vec<libc::epoll_event>,
}

impl Epoll {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: plain system call; the result is checked.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: a fresh descriptor this instance alone owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            ready: vec![libc::epoll_event { events: 0, u64: 0 }; 256],
        })
    }

    /// Watches `fd` for input, reporting it as `token`.
    pub(crate) fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            u64: token,
        };
        // SAFETY: both descriptors are open; `event` is valid for the call.
        let code =
            unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        if code < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stops watching `fd` (closing it does too; this is for descriptors kept open).
    pub(crate) fn remove(&self, fd: RawFd) {
        // SAFETY: both descriptors are open; a null event is allowed for DEL.
        unsafe {
            libc::epoll_ctl(
                self.fd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            );
        }
    }

    /// The tokens of the descriptors with input (or a hang-up) now, without waiting.
    pub(crate) fn ready(&mut self, out: &mut Vec<u64>) {
        out.clear();
        let capacity = i32::try_from(self.ready.len()).unwrap_or(i32::MAX);
        // SAFETY: `ready` has `capacity` writable entries; timeout 0 never blocks.
        let count =
            unsafe { libc::epoll_wait(self.fd.as_raw_fd(), self.ready.as_mut_ptr(), capacity, 0) };
        for event in self.ready.iter().take(usize::try_from(count).unwrap_or(0)) {
            out.push(event.u64);
        }
    }
}

/// Sets an integer socket option.
fn set_option(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `value` is a valid `int` for the call.
    let code = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if code < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bulk-transfer settings: no Nagle delay, and `buffer` bytes of socket buffer each way
/// when given (otherwise the kernel's autotuning).
pub(crate) fn tune(stream: &std::net::TcpStream, buffer: Option<usize>) -> io::Result<()> {
    stream.set_nodelay(true)?;
    if let Some(bytes) = buffer {
        let bytes = i32::try_from(bytes).unwrap_or(i32::MAX);
        let fd = stream.as_raw_fd();
        set_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, bytes)?;
        set_option(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, bytes)?;
    }
    Ok(())
}
