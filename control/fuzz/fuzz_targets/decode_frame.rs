//! Any bytes must decode to messages or an error: never a panic, a hang or a huge
//! allocation. A decoded message must re-encode to the bytes it came from.
#![no_main]

use libfuzzer_sys::fuzz_target;
use railyard_control::wire::FrameDecoder;

fuzz_target!(|data: &[u8]| {
    let mut decoder = FrameDecoder::default();
    decoder.push(data);
    let mut consumed = 0;
    while let Ok(Some(message)) = decoder.next_message() {
        let frame = message.encode();
        assert_eq!(&data[consumed..consumed + frame.len()], frame.as_slice());
        consumed += frame.len();
    }
});
