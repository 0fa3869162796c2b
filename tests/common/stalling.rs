//! Memory whose first read stops the reading thread until the test lets it go: a peer
//! stalled in the middle of a copy, at a known moment, with no race (Linux userfaultfd).
//!
//! A soft-fabric peer in this process copies with a plain memory copy, on its poller's
//! thread, inside the access section the target's fences wait for. When the bytes it copies
//! come from a [`StallingBuffer`] armed with [`StallingBuffer::arm`], its first read of them
//! faults and the kernel holds the thread there — after the key check, before any byte has
//! moved — until [`Stall::release`] fills the memory (or the [`Stall`] drops).
//!
//! Only faults taken in user mode are held (`UFFD_USER_MODE_ONLY`, Linux 5.11 or later), which
//! needs no privilege; a copy the kernel makes for us (`process_vm_writev`) is not stalled.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::time::Instant;

use railyard::engine::{Engine, Region};

// <linux/userfaultfd.h>: the ioctls (generic `_IOWR` encoding, as on x86-64 and arm64), the
// flag that limits the descriptor to user-mode faults, and the page-fault event.
const UFFD_API: u64 = 0xaa;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFDIO_REGISTER: u64 = iowr(0x00, size_of::<UffdioRegister>());
const UFFDIO_COPY: u64 = iowr(0x03, size_of::<UffdioCopy>());
const UFFDIO_API: u64 = iowr(0x3f, size_of::<UffdioApi>());
/// `struct uffd_msg`: the event in its first byte, a page fault's address at offset 16.
const MSG_LEN: usize = 32;

const fn iowr(nr: u64, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | (0xaa << 8) | nr
}

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// A private anonymous mapping the test never touches before it releases it: its pages are
/// not there yet, so an armed buffer's first read of any of them stalls.
pub struct StallingBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain anonymous mapping; the engines read it through raw pointers, and the test
// reads it only after the stall is released.
unsafe impl Send for StallingBuffer {}
// SAFETY: as for Send.
unsafe impl Sync for StallingBuffer {}

impl StallingBuffer {
    /// `len` bytes, a multiple of the page size.
    pub fn new(len: usize) -> Self {
        assert_eq!(len % page_size(), 0, "whole pages");
        // SAFETY: a fresh private anonymous mapping overlaps nothing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        Self {
            ptr: NonNull::new(ptr.cast()).expect("mapped"),
            len,
        }
    }

    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub fn register(&self, engine: &Engine) -> Region {
        // SAFETY: the mapping lives until the end of the test, after every engine is gone;
        // registering does not touch the pages.
        unsafe { engine.register(self.ptr.as_ptr(), self.len) }.expect("registers")
    }

    /// From now on, the first thread to read (or write) any of its pages stops there until
    /// the returned [`Stall`] is released or dropped. Arm it before anything touches it.
    ///
    /// Keep the `Stall` in a variable declared after the engines that read the buffer: it
    /// must drop first (letting a stopped poller go), or dropping an engine would wait for
    /// its stopped poller forever.
    pub fn arm(&self) -> Stall<'_> {
        // SAFETY: userfaultfd(2) with valid flags; the result is checked.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
            )
        };
        assert!(
            fd >= 0,
            "userfaultfd (user-mode faults, Linux 5.11 or later) is not available here: {}; \
             this test stops a peer inside a copy with it",
            std::io::Error::last_os_error()
        );
        // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        ioctl(&uffd, UFFDIO_API, &mut api, "UFFDIO_API");
        let mut register = UffdioRegister {
            start: self.addr(),
            len: self.len as u64,
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        ioctl(&uffd, UFFDIO_REGISTER, &mut register, "UFFDIO_REGISTER");
        Stall { uffd, buffer: self }
    }

    /// Offset of the first byte that is not `byte`. Only once its stall is released.
    pub fn first_not(&self, byte: u8) -> Option<usize> {
        // SAFETY: inside the live mapping; its pages are present (released), and nothing
        // writes them.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) };
        bytes.iter().position(|&b| b != byte)
    }
}

impl Drop for StallingBuffer {
    fn drop(&mut self) {
        // SAFETY: our mapping; the engines that used it are dropped first.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// An armed [`StallingBuffer`]: its readers stop until [`Self::release`]. Dropping it lets
/// them go too (they then read zeros).
pub struct Stall<'a> {
    uffd: OwnedFd,
    buffer: &'a StallingBuffer,
}

impl Stall<'_> {
    /// Waits until a thread reads the buffer and is stopped there; the address it read.
    pub fn wait_for_reader(&self, deadline: Instant) -> u64 {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "nothing read the stalling buffer in time");
            let mut poll = libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let timeout = left.as_millis().clamp(1, 1000) as libc::c_int;
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut poll, 1, timeout) } <= 0 {
                continue;
            }
            let mut msg = [0u8; MSG_LEN];
            // SAFETY: reads at most `MSG_LEN` bytes into `msg`.
            let read =
                unsafe { libc::read(self.uffd.as_raw_fd(), msg.as_mut_ptr().cast(), MSG_LEN) };
            if read != MSG_LEN as isize {
                continue;
            }
            assert_eq!(msg[0], UFFD_EVENT_PAGEFAULT, "a userfaultfd event");
            let addr = u64::from_ne_bytes(msg[16..24].try_into().expect("eight bytes"));
            let range = self.buffer.addr()..self.buffer.addr() + self.buffer.len as u64;
            assert!(
                range.contains(&addr),
                "a fault at {addr:#x}, outside {range:x?}"
            );
            return addr;
        }
    }

    /// Fills the whole buffer with `byte` and lets every stopped reader go on.
    pub fn release(&self, byte: u8) {
        let fill = vec![byte; self.buffer.len];
        let mut copied = 0;
        while copied < self.buffer.len {
            let mut copy = UffdioCopy {
                dst: self.buffer.addr() + copied as u64,
                src: fill.as_ptr() as u64 + copied as u64,
                len: (self.buffer.len - copied) as u64,
                mode: 0,
                copy: 0,
            };
            // SAFETY: UFFDIO_COPY with a valid argument: `dst` is inside the registered
            // range, `src` inside `fill`, and `len` within both.
            let result =
                unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_COPY as _, &raw mut copy) };
            let error = std::io::Error::last_os_error();
            // `copy`: bytes copied, also when the kernel stopped early (EAGAIN).
            if copy.copy > 0 {
                copied += copy.copy as usize;
            } else {
                assert!(
                    result != 0 && error.raw_os_error() == Some(libc::EAGAIN),
                    "UFFDIO_COPY: {error}"
                );
            }
        }
    }
}

fn ioctl<T>(uffd: &OwnedFd, request: u64, argument: &mut T, name: &str) {
    // SAFETY: a userfaultfd ioctl with the argument structure it takes.
    let result =
        unsafe { libc::ioctl(uffd.as_raw_fd(), request as _, std::ptr::from_mut(argument)) };
    assert_eq!(result, 0, "{name}: {}", std::io::Error::last_os_error());
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).expect("a page size")
}
