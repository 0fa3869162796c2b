//! The TCP fabric's system calls: epoll, vectored non-blocking sends that never raise
//! SIGPIPE, receives straight into registered memory, socket options, the send queue's
//! depth, and abortive closes.

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

/// Receives up to `first.1` bytes into `first.0` and, once those are full, up to `second.1`
/// more into `second.0`, in one call without blocking. `Ok(0)` is end of stream.
///
/// # Safety
/// Both ranges must be valid for writes for the duration of the call.
pub(crate) unsafe fn recv_into_both(
    fd: RawFd,
    first: (u64, usize),
    second: (u64, usize),
) -> io::Result<usize> {
    let mut iov = [
        libc::iovec {
            iov_base: first.0 as *mut libc::c_void,
            iov_len: first.1,
        },
        libc::iovec {
            iov_base: second.0 as *mut libc::c_void,
            iov_len: second.1,
        },
    ];
    // SAFETY: `msghdr` is plain old data; all-zero is valid (no name, no control data).
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = iov.as_mut_ptr();
    message.msg_iovlen = iov.len();
    // SAFETY: `message` names `iov`, whose ranges the caller guarantees writable; the kernel
    // writes at most their lengths.
    check(unsafe { libc::recvmsg(fd, &mut message, libc::MSG_DONTWAIT) })
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

    /// The descriptors with input (or a hang-up) now, without waiting: each token, and
    /// whether the peer hung up (reset, error, or closed its side).
    pub(crate) fn ready(&mut self, out: &mut Vec<(u64, bool)>) {
        out.clear();
        let capacity = i32::try_from(self.ready.len()).unwrap_or(i32::MAX);
        // SAFETY: `ready` has `capacity` writable entries; timeout 0 never blocks.
        let count =
            unsafe { libc::epoll_wait(self.fd.as_raw_fd(), self.ready.as_mut_ptr(), capacity, 0) };
        let hang_up = (libc::EPOLLERR | libc::EPOLLHUP | libc::EPOLLRDHUP) as u32;
        for event in self.ready.iter().take(usize::try_from(count).unwrap_or(0)) {
            out.push((event.u64, event.events & hang_up != 0));
        }
    }
}

/// A non-blocking TCP socket whose connection to `addr` has started (or, on loopback,
/// finished): the caller learns how it went from its first send or receive.
pub(crate) fn connect_nonblocking(addr: std::net::SocketAddr) -> io::Result<std::net::TcpStream> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain system call; the result is checked.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function alone owns; the stream closes it.
    let stream = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let (storage, len) = socket_address(addr);
    // SAFETY: `storage` holds a valid address of `len` bytes for the socket's family.
    let code = unsafe { libc::connect(fd, (&raw const storage).cast(), len) };
    if code < 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(error);
        }
    }
    Ok(stream)
}

/// `addr` as the C socket address the kernel takes.
fn socket_address(addr: std::net::SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: `sockaddr_storage` is plain old data; all-zero is valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        std::net::SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for `sockaddr_in`.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for `sockaddr_in6`.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
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

/// Closes `stream` abortively: with SO_LINGER {on, 0} the close sends a reset and discards
/// whatever the kernel still held to send, so none of it reaches the peer afterwards.
pub(crate) fn close_abortively(stream: std::net::TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: the descriptor is open (the stream owns it until the end of this function);
    // `linger` is a valid `struct linger` for the call.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    // Should the option have been refused, this is an ordinary close: still nothing more
    // is sent by this process.
    drop(stream);
}

/// Bytes the kernel holds for `fd` that the peer has not acknowledged yet, sent or not
/// (SIOCOUTQ).
pub(crate) fn unacknowledged(fd: RawFd) -> io::Result<usize> {
    let mut bytes: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ on sockets) writes one `int` through the pointer, which is
    // valid for the call; a closed or foreign descriptor is refused with an error.
    let code = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &raw mut bytes) };
    if code < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(bytes).unwrap_or(0))
}
