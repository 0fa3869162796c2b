//! Raw byte streams to a TCP device's data port ([`open_sink`]): the ceiling a benchmark
//! compares the fabric with.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::wire::Hello;

/// Dials `addr` within `timeout` and sends `hello`.
fn dial(addr: SocketAddr, timeout: Duration, hello: Hello) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(&hello.encode())?;
    stream.set_write_timeout(None)?;
    Ok(stream)
}

/// Opens a raw byte stream to a TCP device's data port, which the serving poller reads and
/// discards: the ceiling a benchmark compares the fabric with (same two processes, same
/// receiving thread, no protocol).
///
/// # Errors
/// When the port cannot be reached.
pub fn open_sink(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let stream = dial(addr, timeout, Hello::Sink)?;
    stream.set_nodelay(true)?;
    Ok(stream)
}
