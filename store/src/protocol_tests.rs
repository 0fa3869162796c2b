//! Reading frames: what a frame's length costs before the frame has arrived.

use std::io::{self, Read};

use super::{FrameWriter, MAX_FRAME, read_frame};

/// A stream that hands out `bytes`, then ends, and remembers the largest buffer a read
/// asked it to fill: the memory the reader had set aside by then.
struct Recorded {
    bytes: io::Cursor<Vec<u8>>,
    largest_buffer: usize,
}

impl Read for Recorded {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        self.largest_buffer = self.largest_buffer.max(buffer.len());
        self.bytes.read(buffer)
    }
}

#[test]
fn a_frame_that_claims_the_largest_length_and_ends_early_costs_only_what_arrived() {
    let mut sent = (MAX_FRAME as u32).to_le_bytes().to_vec();
    sent.extend_from_slice(&[7; 100]);
    let mut stream = Recorded {
        bytes: io::Cursor::new(sent),
        largest_buffer: 0,
    };
    let error = read_frame::<u32>(&mut stream, None).expect_err("the frame is cut short");
    assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
    assert!(
        stream.largest_buffer <= super::READ_CHUNK,
        "{} bytes set aside for a frame that brought 100",
        stream.largest_buffer
    );
}

#[test]
fn a_frame_written_is_read_back_whole() {
    let value: Vec<u64> = (0..100_000).collect(); // several chunks
    let mut writer = FrameWriter::new(Vec::new(), None);
    writer.write(&value).expect("written");
    let mut stream = io::Cursor::new(std::mem::take(writer.get_mut()));
    let read: Vec<u64> = read_frame(&mut stream, None).expect("read back");
    assert_eq!(read, value);
}
