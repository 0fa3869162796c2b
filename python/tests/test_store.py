"""railyard.Store against a master and segment servers, each its own process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import railyard
from railyard import ObjectNotFound, ReplicateConfig, Store, StoreError

MIB = 1 << 20


def client(cluster, **options) -> Store:
    return Store(cluster.addr, fabric="tcp", busy_poll=False, **options)


@pytest.fixture
def store(store_cluster):
    with client(store_cluster) as store:
        yield store
        store.remove_all(force=True)


def test_values_put_and_got_as_bytes(store):
    store.put("greeting", b"hello")
    assert store.get("greeting") == b"hello"
    assert store.is_exist("greeting")
    assert store.get_size("greeting") == 5
    store.put_parts("parts", b"ab", bytearray(b"cd"), memoryview(b"ef"))
    assert store.get("parts") == b"abcdef"
    store.upsert("greeting", b"bye")
    assert store.get("greeting") == b"bye"
    with pytest.raises(StoreError) as exists:
        store.put("greeting", b"again")
    assert exists.value.code == -705 and exists.value.kind == "AlreadyExists"
    assert store.get("greeting") == b"bye"


def test_a_missing_key_raises_object_not_found_with_mooncakes_code(store):
    with pytest.raises(ObjectNotFound) as missing:
        store.get("no-such-key")
    assert missing.value.code == -704
    assert missing.value.key == "no-such-key"
    assert isinstance(missing.value, StoreError)
    assert not store.is_exist("no-such-key")
    with pytest.raises(ObjectNotFound):
        store.remove("no-such-key")


def test_zero_copy_from_and_into_registered_buffers(store):
    source = np.random.default_rng(1).integers(0, 255, 4 * MIB, dtype=np.uint8)
    target = np.zeros_like(source)
    store.register_buffer(source)
    store.register_buffer(target.ctypes.data, target.nbytes)
    store.put_from("whole", source)
    store.put_from("half", source.ctypes.data + 2 * MIB, 2 * MIB)
    assert store.get_into("whole", target) == 4 * MIB
    assert np.array_equal(target, source)
    assert store.get_into("half", target.ctypes.data, MIB * 2) == 2 * MIB
    assert np.array_equal(target[: 2 * MIB], source[2 * MIB :])
    store.unregister_buffer(source)
    store.unregister_buffer(target.ctypes.data)


def test_batches_answer_per_key_and_scatter_gather(store):
    pages = np.arange(8 * 4096, dtype=np.uint8).reshape(8, 4096) * 3
    out = np.zeros_like(pages)
    store.register_buffer(pages)
    store.register_buffer(out)
    keys = [f"page-{i}" for i in range(4)]
    written = store.batch_put_from(keys, [pages[i].ctypes.data for i in range(4)], [4096] * 4)
    assert written == [1, 1, 1, 1]  # replicas written, per key
    got = store.batch_get_into(
        keys + ["missing"], [out[i].ctypes.data for i in range(5)], [4096] * 5
    )
    assert got[:4] == [4096] * 4
    assert isinstance(got[4], ObjectNotFound) and got[4].code == -704
    assert np.array_equal(out[:4], pages[:4])
    # A key's value from two buffers, read back into two others (k and v of a page).
    store.batch_put_from_multi_buffers(
        ["kv"], [[pages[4].ctypes.data, pages[5].ctypes.data]], [[4096, 4096]]
    )
    assert store.batch_get_into_multi_buffers(
        ["kv"], [[out[6].ctypes.data, out[7].ctypes.data]], [[4096, 4096]]
    ) == [8192]
    assert np.array_equal(out[6:8], pages[4:6])
    assert store.batch_is_exist(["page-0", "nope"]) == [True, False]
    assert store.batch_get(["page-1", "nope"])[0] == pages[1].tobytes()
    assert store.batch_put(["b1", "b2"], [b"x", b"y"])[0] is None
    assert store.batch_remove(["b1", "nope"])[0] is None
    store.unregister_buffer(pages)
    store.unregister_buffer(out)


def test_bad_input_is_refused_before_anything_is_sent(store):
    buf = np.zeros(4096, dtype=np.uint8)
    store.register_buffer(buf)
    before = store.keys()
    cases = [
        (TypeError, lambda: store.put(None, b"x")),
        (TypeError, lambda: store.put("k", "a str")),
        (TypeError, lambda: store.put("k", 5)),  # not five zero bytes
        (TypeError, lambda: store.put("k", [104, 105])),
        (TypeError, lambda: store.put_from("k", "0x10", 4)),
        (ValueError, lambda: store.put_from("k", -1, 4)),
        (ValueError, lambda: store.put_from("k", buf.ctypes.data, -4)),
        (ValueError, lambda: store.put_from("k", buf.ctypes.data, 8192)),  # beyond the buffer
        (ValueError, lambda: store.put_from("k", 4096, 16)),  # not registered
        (ValueError, lambda: store.get_into("k", buf.ctypes.data + 1, 4096)),
        (TypeError, lambda: store.batch_put_from(["a", None], [buf.ctypes.data] * 2, [1, 1])),
        (ValueError, lambda: store.batch_put_from(["a", "b"], [buf.ctypes.data], [1, 1])),
        # One bad range refuses the whole batch: the good key is not written either.
        (
            ValueError,
            lambda: store.batch_put_from(["good", "bad"], [buf.ctypes.data, 1 << 40], [8, 8]),
        ),
        (TypeError, lambda: store.batch_is_exist("a str, not a list")),
        (ValueError, lambda: store.unregister_buffer(12345)),
        (ValueError, lambda: store.register_buffer(b"read-only bytes")),
        (ValueError, lambda: store.put("k", b"x", ReplicateConfig(replica_num=0))),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
    assert store.keys() == before
    assert not store.is_exist("good")
    store.unregister_buffer(buf)


def test_registrations_are_counted(store):
    buf = np.ones(8192, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    store.unregister_buffer(buf.ctypes.data)
    store.put_from("still-registered", buf.ctypes.data, 8192)
    store.unregister_buffer(buf.ctypes.data)
    with pytest.raises(ValueError):
        store.put_from("gone", buf.ctypes.data, 8192)
    store.register_buffer(buf.ctypes.data, 4096)
    with pytest.raises(ValueError):
        store.register_buffer(buf.ctypes.data, 8192)  # registered already, another size
    store.unregister_buffer(buf.ctypes.data)
    with pytest.raises(ValueError):
        store.unregister_buffer(buf.ctypes.data)


def test_remove_waits_for_a_readers_lease_unless_forced(store):
    store.put("leased", b"v")
    assert store.get("leased") == b"v"  # takes a lease (1 s at this master)
    with pytest.raises(StoreError) as leased:
        store.remove("leased")
    assert leased.value.code == -706
    store.remove("leased", force=True)
    assert not store.is_exist("leased")
    store.put("a", b"1")
    store.put("b", b"2")
    assert store.remove_all(force=True) >= 2
    assert store.keys() == []


def test_replicas_survive_a_killed_segment_server(store_cluster):
    cluster = store_cluster
    extra = [cluster.add_server(), cluster.add_server()]
    with client(cluster) as store:
        config = ReplicateConfig(replica_num=2)
        value = bytes(range(256)) * 1024
        store.put("twice", value, config)
        assert store.health_check()
        segments = {s["name"] for s in store.master_stats()["segments"]}
        assert len(segments) >= 4
        extra[0].kill()
        # Whichever replica was on the killed server, the other one answers.
        assert store.get("twice") == value
        extra[1].kill()
        deadline = time.monotonic() + 10
        got = None
        while time.monotonic() < deadline:
            try:
                got = store.get("twice")
                break
            except ObjectNotFound:
                # Both replicas were on the killed servers: the master says so, typed.
                got = "not found"
                break
            except StoreError:
                time.sleep(0.1)
        assert got in (value, "not found")
        store.remove_all(force=True)
    cluster.servers = [s for s in cluster.servers if s not in extra]


def test_best_effort_writes_what_segments_can_take(store):
    buf = np.ones(4096, dtype=np.uint8)
    store.register_buffer(buf)
    config = ReplicateConfig(replica_num=9, best_effort=True)
    (count,) = store.batch_put_from(["best"], [buf.ctypes.data], [4096], config)
    live = [s for s in store.master_stats()["segments"] if not s["suspected"]]
    assert count == len(live)
    (refused,) = store.batch_put_from(["strict"], [buf.ctypes.data], [4096], ReplicateConfig(9))
    assert isinstance(refused, StoreError) and refused.code == -200 and refused.kind == "TooManyReplicas"
    store.unregister_buffer(buf)


def test_setup_close_and_setup_again(store_cluster):
    store = Store()
    assert not store.is_setup
    with pytest.raises(RuntimeError):
        store.get("anything")
    store.setup(store_cluster.addr, fabric="tcp", busy_poll=False, segment_size=16 * MIB)
    name = store.segment_name
    assert name and store.get_hostname().count(":") == 1
    store.put("on-someone", b"kept", ReplicateConfig(preferred_segments=[name]))
    with pytest.raises(RuntimeError):
        store.setup(store_cluster.addr)
    store.close()
    store.close()  # idempotent
    store.setup(store_cluster.addr, fabric="tcp", busy_poll=False)
    # The first incarnation's segment went with it: its object is gone, typed.
    with pytest.raises(ObjectNotFound):
        store.get("on-someone")
    store.close()
    with pytest.raises(ValueError):
        Store("not an address")
    with pytest.raises(StoreError) as unreachable:
        Store("127.0.0.1:1", fabric="tcp", busy_poll=False, timeout_s=2)
    assert unreachable.value.code == -900


def test_data_calls_release_the_gil(store):
    store.put("big", bytes(48 * MIB))
    inside = threading.Event()
    done = threading.Event()

    def reader() -> None:
        inside.set()
        store.get("big")  # one call, tens of milliseconds
        done.set()

    thread = threading.Thread(target=reader)
    thread.start()
    assert inside.wait(10)
    ticks = 0
    while not done.is_set():
        ticks += 1
        time.sleep(0.0005)
    thread.join(timeout=30)
    # With the GIL held through the call, this thread could not run until it returned.
    assert ticks >= 3, f"the main thread ran {ticks} times while the reader was inside get()"


def test_buffers_as_objects_are_pinned_and_batches_take_them(store_cluster):
    with client(store_cluster) as store:
        grows = bytearray(8192)
        store.register_buffer(grows)
        with pytest.raises(BufferError):
            grows.extend(b"moves the memory a registration points at")
        pages = [np.full(4096, i, dtype=np.uint8) for i in range(3)]
        for page in pages:
            store.register_buffer(page)
        assert store.batch_put_from(["o0", "o1"], pages[:2]) == [1, 1]
        assert store.batch_get_into(["o1"], [pages[2]]) == [4096]
        assert (pages[2] == 1).all()
        store.batch_put_from_multi_buffers(["o01"], [pages[:2]])
        assert store.get("o01") == pages[0].tobytes() + pages[1].tobytes()

        class Strided:
            def data_ptr(self) -> int:
                return pages[0].ctypes.data

            def numel(self) -> int:
                return 16

            def element_size(self) -> int:
                return 1

            def is_contiguous(self) -> bool:
                return False

        with pytest.raises(ValueError, match="contiguous"):
            store.put_from("strided", Strided())
        with pytest.raises(ValueError):
            store.put("", b"empty key")
        with pytest.raises(ValueError):
            store.put("k", b"")
        with pytest.raises(TypeError):
            store.put("k", b"x", config=42)
        with pytest.raises(TypeError):
            store.put("k", b"x", ReplicateConfig(preferred_segments="one-str"))
        store.remove_all(force=True)
    # Leaving the with block closed it and let go of the buffers it held.
    assert not store.is_setup and not store._held
    grows.extend(b"free to move again")


def test_the_module_exports_the_store():
    assert railyard.Store is Store
    assert issubclass(railyard.ObjectNotFound, railyard.StoreError)


def test_docs_store_example_runs(store_cluster):
    page = (Path(__file__).resolve().parents[2] / "docs" / "store.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```python\n")[1:]]
    (example,) = [b for b in blocks if "railyard.Store(master" in b]
    assert len(example.strip().splitlines()) <= 15
    assert '"127.0.0.1:7500"' in example
    example = example.replace('"127.0.0.1:7500"', repr(store_cluster.addr))
    subprocess.run([sys.executable, "-c", example], check=True, timeout=120)
