"""The README's Python example as a script: the lines between README:start and README:end are
the README's ```python block, byte for byte (scripts/check_docs.py checks it in `make lint`),
and test_readme_example.py runs this file."""

# README:start
import numpy as np
import railyard

# Two engines in one process stand in for a decode and a prefill process.
with railyard.Engine("decode-0", busy_poll=False) as decode, \
     railyard.Engine("prefill-0", busy_poll=False) as prefill:
    kv_decode = np.zeros(1 << 20, dtype=np.uint8)             # or tensor.data_ptr()
    decode.register(kv_decode.ctypes.data, kv_decode.nbytes)
    kv_prefill = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
    prefill.register(kv_prefill.ctypes.data, kv_prefill.nbytes)  # again: no-op; overlap: ValueError
    src, dst = kv_prefill.ctypes.data, kv_decode.ctypes.data      # dst and session: out of band
    prefill.write(decode.session_id, [src, src + 65536], [dst + 131072, dst],
                  [65536, 65536], notify=b"req-17 ready", timeout_s=5)  # GIL released
    assert (kv_decode[131072:196608] == kv_prefill[:65536]).all()
    print(decode.wait_notifs(1.0))                            # {'prefill-0': [b'req-17 ready']}
    batch = prefill.submit(decode.session_id, "read", [src], [dst], [65536])
    assert batch.wait(5) == "DONE"                            # or poll(): DONE / PROC / ERR
# README:end
