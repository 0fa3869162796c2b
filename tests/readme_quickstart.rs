//! The README's Rust example, run as written: the lines between `README:start` and
//! `README:end` are the README's ```rust block, byte for byte (`scripts/check_docs.py`
//! checks it in `make lint`), and the test calls its `main`.

// README:start
use std::time::{Duration, Instant};

use railyard::engine::control::NotificationBody;
use railyard::engine::{Engine, Op, Transfer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Two engines in one process stand in for a decode and a prefill process.
    let decode = Engine::builder("decode-0").build()?; // rails from the topology plan
    let kv_cache = decode.alloc(64 << 20, None)?; // huge pages if it can, NUMA-bound, prefaulted
    let prefill = Engine::builder("prefill-0").build()?;
    let blocks = prefill.alloc(4 << 20, None)?;

    let peer = prefill.open(&decode.addr().to_string())?; // a `railyard serve` or another engine
    let mut submitter = prefill.submitter()?; // one per thread
    let write = Transfer {
        op: Op::Write,
        local: blocks,
        local_offset: 0,
        remote_addr: kv_cache.addr + (8 << 20), // out of band, or from peer.descriptor()
        len: 4 << 20,
    };
    let ready = b"request 17 ready".to_vec(); // delivered after the data, never if it failed
    let batch = submitter.submit_and_notify(&peer, &[write], ready.clone())?;
    let status = batch.wait(Instant::now() + Duration::from_secs(5));
    assert_eq!(status.done, 1, "{:?}", batch.failure(0)); // the reason, range, endpoint, epoch

    let notes = decode.wait_notifications(Instant::now() + Duration::from_secs(5));
    let note = notes.first().ok_or("no notification within 5 s")?;
    assert_eq!(note.body, NotificationBody::Bytes(ready));
    println!("{} wrote 4 MiB and said so", note.from);
    Ok(())
}
// README:end

#[test]
fn the_readme_example_runs() {
    main().expect("the README's example runs");
}
