"""The Mooncake Store shim as Mooncake's users call it: its own call shapes and codes, and
those of vLLM's MooncakeStoreConnector and LMCache's Mooncake connector, against a
master, segment servers and a member process."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import railyard
from conftest import StoreCluster

from railyard.compat import mooncake_store
from railyard.compat.mooncake_store import (
    BufferHandle,
    MooncakeDistributedStore,
    NotSupportedError,
    ReplicateConfig,
    SoftPinAction,
    parse_size,
)

MIB = 1 << 20
MEMBER = Path(__file__).resolve().parent / "store_member.py"


def connect(cluster, hostname: str = "localhost", segment: int = 0, buffer: int = 16 * MIB):
    store = MooncakeDistributedStore()
    ret = store.setup(hostname, "P2PHANDSHAKE", segment, buffer, "tcp", "", cluster.addr)
    assert ret == 0
    return store


@pytest.fixture
def store(store_cluster):
    store = connect(store_cluster)
    yield store
    store.remove_all(True)
    store.close()


class Member:
    """store_member.py in a process of its own."""

    def __init__(self, master: str, hostname: str, segment: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(MEMBER), master, hostname, segment],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hostname = self._reply()["hostname"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self) -> dict:
        line = self._lines.get(timeout=30)
        assert line is not None, "the member exited"
        return json.loads(line)

    def cmd(self, line: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def quit(self) -> None:
        """QUIT: the member closes its store and exits."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("QUIT\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=20)


def test_codes_and_conventions_as_mooncakes(store):
    assert store.put("k", b"value") == 0
    assert store.put("k", b"other") == 0  # an existing key: success, value kept
    assert store.get("k") == b"value"
    assert store.get("missing") == b""
    assert store.is_exist("k") == 1 and store.is_exist("missing") == 0
    assert store.batch_is_exist(["k", "missing"]) == [1, 0]
    assert store.get_size("k") == 5 and store.get_size("missing") == -704
    assert store.remove("missing") == -704
    assert store.remove("k") == -706  # the reads above hold a lease
    assert store.remove("k", True) == 0
    assert store.get_batch(["missing"]) == [b""]
    assert store.get_batch([]) == [b""]
    assert store.put_batch(["a", "b"], [b"1", b"2"]) == 0
    assert store.get_batch(["a", "b", "c"]) == [b"1", b"2", b""]
    assert store.upsert("a", b"11") == 0 and store.get("a") == b"11"
    assert store.put_parts("p", b"ab", b"cd") == 0 and store.get("p") == b"abcd"
    assert store.put_parts("empty") == 0 and store.is_exist("empty") == 0
    handle = store.get_buffer("p")
    assert isinstance(handle, BufferHandle)
    assert bytes(handle) == b"abcd" and handle.size() == 4 and len(handle) == 4
    assert handle.ptr() != 0 and bytes(memoryview(handle)) == b"abcd"
    assert store.get_buffer("missing") is None
    assert [h and bytes(h) for h in store.batch_get_buffer(["p", "x"])] == [b"abcd", None]
    assert store.batch_remove(["a", "missing"], True) == [0, -704]
    assert store.remove_by_regex("^p$", True) == 1
    assert store.remove_by_regex("(", True) == -600
    assert store.health_check() == 0
    assert store.get_hostname().startswith("localhost:")


def test_zero_copy_calls_return_bytes_or_codes(store):
    src = np.arange(64 * 1024, dtype=np.uint8)
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert store.put_from("z", src.ctypes.data, 4096) == 0
    assert store.get_into("z", dst.ctypes.data, dst.nbytes) == 4096
    assert np.array_equal(dst[:4096], src[:4096])
    assert store.get_into("z", dst.ctypes.data, 100) == -600  # smaller than the value
    assert store.get_into("missing", dst.ctypes.data, 4096) == -704
    assert store.batch_put_from(["z1", "z2"], [src.ctypes.data] * 2, [100, 200]) == [0, 0]
    assert store.batch_get_into(["z1", "z2", "no"], [dst.ctypes.data] * 3, [4096] * 3) == [
        100,
        200,
        -704,
    ]
    assert store.batch_get_into(["z1"], [dst.ctypes.data] * 2, [1]) == [-600]
    assert store.batch_put_from(["y"], [src.ctypes.data], [1, 2]) == [-600]
    meta = np.frombuffer(b"META", dtype=np.uint8).copy()
    assert store.register_buffer(meta.ctypes.data, 4) == 0
    assert store.put_from_with_metadata("m", src.ctypes.data, meta.ctypes.data, 8, 4) == 0
    assert store.get("m") == b"META" + src[:8].tobytes()
    assert store.upsert_from("z", src.ctypes.data + 1, 10) == 0
    assert store.get("z") == src[1:11].tobytes()
    assert store.put_from("nothing", src.ctypes.data, 0) == 0  # as Mooncake: a no-op
    assert store.unregister_buffer(meta.ctypes.data) == 0
    assert store.unregister_buffer(src.ctypes.data) == 0
    assert store.unregister_buffer(dst.ctypes.data) == 0
    assert store.unregister_buffer(dst.ctypes.data) == -600


def test_bad_input_answers_invalid_params_and_sends_nothing(store):
    buf = np.zeros(4096, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert store.put(None, b"x") == -600
    assert store.put("k", "a str") == -600
    assert store.put("k", 5) == -600  # not five zero bytes
    assert store.put("k", [104, 105]) == -600
    assert store.put("k", None) == -600
    assert store.put("k", b"") == -600
    assert store.put_from("k", -1, 16) == -600
    assert store.put_from("k", buf.ctypes.data, -16) == -600
    assert store.put_from("k", buf.ctypes.data, 8192) == -600  # larger than the buffer
    assert store.put_from("k", 4096, 16) == -600  # not registered
    assert store.get_into("k", buf.ctypes.data, 8192) == -600
    assert store.batch_put_from(["a", None], [buf.ctypes.data] * 2, [8, 8]) == [-600, -600]
    assert store.batch_put_from(["a", "b"], [buf.ctypes.data, 1 << 40], [8, 8]) == [-600, -600]
    assert store.batch_get_into(("a", None), [buf.ctypes.data] * 2, [8, 8]) == [-600, -600]
    assert store.batch_is_exist(("a", 7)) == [-600, -600]
    assert store.put("k", b"x", {"replica_num": 2}) == -600  # not a ReplicateConfig
    assert store.put("", b"x") == -600
    same_node = ReplicateConfig()
    same_node.prefer_alloc_in_same_node = True
    assert store.upsert("k", b"x", same_node) == -600
    assert store.register_buffer(0, 16) == -600
    assert store.register_buffer(buf.ctypes.data, 0) == -600
    config = ReplicateConfig()
    config.prefer_alloc_in_same_node = True
    assert store.put("k", b"x", config) == -600
    config = ReplicateConfig()
    config.soft_pin_ttl_ms = 1000  # without SoftPinAction.ENABLE
    assert store.put("k", b"x", config) == -600
    config = ReplicateConfig()
    config.nof_replica_num = 1
    assert store.put("k", b"x", config) == mooncake_store.NOT_SUPPORTED
    assert store.is_exist("a") == 0 and store.is_exist("k") == 0


def test_replicate_config_as_mooncakes():
    config = ReplicateConfig()
    assert config.replica_num == 1 and config.preferred_segment == ""
    assert config.soft_pin_action == SoftPinAction.PRESERVE and not config.with_soft_pin
    config.with_soft_pin = True
    assert config.soft_pin_action == SoftPinAction.ENABLE
    assert "replica_num: 1" in str(config)
    assert (mooncake_store.OBJECT_NOT_FOUND, mooncake_store.OBJECT_HAS_LEASE) == (-704, -706)
    assert (mooncake_store.NO_AVAILABLE_HANDLE, mooncake_store.TRANSFER_FAIL) == (-200, -800)


def test_sizes_as_mooncake_parses_them():
    assert parse_size("4GB") == 4 << 30
    assert parse_size("4 gb") == 4 << 30
    assert parse_size("1.5GB") == 3 << 29
    assert parse_size("512mb") == 512 << 20
    assert parse_size(1024) == 1024
    assert parse_size("100") == 100
    for bad in ("4GiB", "50%", "-1", "lots"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_setup_forms_metadata_servers_and_unsupported(store_cluster):
    store = MooncakeDistributedStore()
    assert store.health_check() == 1
    assert store.get("k") == b""  # before setup: a miss, not a crash
    assert store.put("k", b"v") == -600
    for metadata in ("http://127.0.0.1:8080/metadata", "etcd://127.0.0.1:2379", "host:2379"):
        assert (
            store.setup("localhost", metadata, 0, 0, "tcp", "", store_cluster.addr) == 0
        ), metadata
        assert store.close() == 0
    config = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "32MB",
        "local_buffer_size": 0,
        "protocol": "tcp",
        "master_server_addr": store_cluster.addr,
    }
    assert store.setup(config) == 0
    # local_buffer_size 0: a zero-copy client, as in Mooncake (copying calls refused).
    assert store.put("via-dict", b"v") == -600 and store.is_exist("via-dict") == 0
    src = np.full(64, 7, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.put_from("via-dict", src.ctypes.data, 64) == 0
    assert store.get("via-dict") == b""
    assert store.get_into("via-dict", src.ctypes.data, 64) == 64
    assert store.remove("via-dict", True) == 0
    assert store.close() == 0 and store.close() == 0
    assert store.setup({"local_hostname": "localhost"}) == -600
    assert store.setup({**config, "global_segment_size": "12 parsecs"}) == -600
    assert store.setup("", "P2PHANDSHAKE", 0, 0, "tcp", "", store_cluster.addr) == -600
    assert (
        store.setup(
            "localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", store_cluster.addr, None, True
        )
        == mooncake_store.NOT_SUPPORTED
    )
    assert store.setup_dummy(1 << 20, 1 << 20, "127.0.0.1:50052") == mooncake_store.NOT_SUPPORTED
    for protocol in ("cxl", "nvmeof", "nvlink"):
        assert (
            store.setup("localhost", "P2PHANDSHAKE", 0, 0, protocol, "", store_cluster.addr)
            == mooncake_store.NOT_SUPPORTED
        )
    assert store.setup(config=config) == 0  # Mooncake's keyword for the dict form
    assert store.upsert_from("k", 0, 0) == 0  # size 0: nothing, as Mooncake
    assert store.close() == 0
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:1") == -900
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = f"localhost:{taken.getsockname()[1]}"
        assert store.setup(busy, "P2PHANDSHAKE", 0, 0, "tcp", "", store_cluster.addr) == -600
    assert not hasattr(store, "get_tensor")
    with pytest.raises(NotSupportedError, match="put_from"):
        store.put_tensor("k", None)


def test_stores_side_by_side_close_and_setup_again(store_cluster):
    first = connect(store_cluster, "localhost:12345", segment=16 * MIB)
    second = connect(store_cluster, "localhost:12346", segment=16 * MIB)
    assert first.get_hostname() == "localhost:12345"
    on_first, on_second = ReplicateConfig(), ReplicateConfig()
    on_first.preferred_segment = "localhost:12345"
    on_second.preferred_segments = ["localhost:12346"]
    assert first.put("written-by-first", b"1", on_second) == 0
    assert second.put("written-by-second", b"2", on_first) == 0
    assert first.get("written-by-second") == b"2"
    # The first store closes: its segment goes, and the object on it; what it wrote on the
    # second store's segment stays readable.
    assert first.close() == 0
    assert second.get("written-by-first") == b"1"
    assert second.get("written-by-second") == b""
    assert first.setup("localhost:12345", "P2PHANDSHAKE", 0, MIB, "tcp", "", store_cluster.addr) == 0
    assert first.get("written-by-first") == b"1"
    second.remove_all(True)
    first.close()
    second.close()


def test_a_member_process_and_store_pressure(store_cluster):
    member = Member(store_cluster.addr, "localhost", "8MB")
    try:
        assert member.hostname.startswith("localhost:")
        with_member = connect(store_cluster)
        assert member.cmd("PUT from-member 0a0b0c 1") == {"ret": 0}
        assert with_member.get("from-member") == bytes([10, 11, 12])
        assert with_member.put("from-here", b"\x01\x02") == 0
        assert member.cmd("GET from-here") == {"hex": "0102"}
        # Hard-pinned 40 MiB values (never evicted) until the two 64 MiB segments hold no
        # more: no space, Mooncake's -200 (store pressure), and nothing half-written.
        big = np.zeros(40 * MIB, dtype=np.uint8)
        assert with_member.register_buffer(big.ctypes.data, big.nbytes) == 0
        pinned = ReplicateConfig()
        pinned.with_hard_pin = True
        codes = [with_member.put_from(f"big{i}", big.ctypes.data, big.nbytes, pinned) for i in range(3)]
        assert codes == [0, 0, -200]
        assert with_member.is_exist("big2") == 0
        # Larger than any segment: no space either (Mooncake's allocator finds none).
        assert with_member.put("too-big", bytes(100 << 20)) == -200
        # More replicas than segments: as many as they take, as Mooncake's allocator does.
        three = ReplicateConfig()
        three.replica_num = 5
        assert with_member.put("spread", b"s" * 4096, three) == 0
        strict = ReplicateConfig()
        strict.replica_num = 5
        strict.best_effort = False
        assert with_member.put("strict", b"s" * 4096, strict) == -200
        with_member.unregister_buffer(big.ctypes.data)
        with_member.remove_all(True)
        with_member.close()
    finally:
        member.quit()


def test_vllm_store_connector_call_shapes(store_cluster):
    """vLLM's MooncakeStoreConnector: dedup with batch_is_exist, multi-buffer puts with a
    ReplicateConfig, multi-buffer gets from a pool of receive threads, -200 as pressure."""
    store = connect(store_cluster)
    layers, block = 4, 4096
    kv = np.random.default_rng(7).integers(0, 255, (8, layers, block), dtype=np.uint8)
    recv = np.zeros_like(kv)
    assert store.register_buffer(kv.ctypes.data, kv.nbytes) == 0
    assert store.register_buffer(recv.ctypes.data, recv.nbytes) == 0
    keys = [f"vllm@model@tp0@{i:04x}" for i in range(8)]
    config = ReplicateConfig()
    config.replica_num = 1
    # The connector puts only what the store does not hold yet.
    assert store.batch_put_from_multi_buffers(
        keys[:3],
        [[kv[i, layer].ctypes.data for layer in range(layers)] for i in range(3)],
        [[block] * layers] * 3,
        config,
    ) == [0, 0, 0]
    exists = store.batch_is_exist(keys)
    missing = [i for i, found in enumerate(exists) if found != 1]
    assert missing == list(range(3, 8))
    results = store.batch_put_from_multi_buffers(
        [keys[i] for i in missing],
        [[kv[i, layer].ctypes.data for layer in range(layers)] for i in missing],
        [[block] * layers] * len(missing),
        config,
    )
    assert all(code == 0 or code == -200 for code in results)
    assert results == [0] * len(missing)

    def receive(i: int) -> int:
        (got,) = store.batch_get_into_multi_buffers(
            [keys[i]], [[recv[i, layer].ctypes.data for layer in range(layers)]], [[block] * layers]
        )
        return got

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(receive, range(8))) == [layers * block] * 8
    assert np.array_equal(recv, kv)
    store.remove_all(True)
    store.close()


def test_lmcache_connector_call_shapes(store_cluster):
    """LMCache's Mooncake connector: put_from, put_parts(key, metadata, data),
    batch_get_into, batch_get_buffer, and a put bounded by a 1 s timeout."""
    store = connect(store_cluster, buffer=16 * MIB)
    chunk = np.random.default_rng(3).integers(0, 255, 256 * 1024, dtype=np.uint8)
    into = np.zeros_like(chunk)
    assert store.register_buffer(chunk.ctypes.data, chunk.nbytes) == 0
    assert store.register_buffer(into.ctypes.data, into.nbytes) == 0
    assert store.put_from("lmcache/chunk0", chunk.ctypes.data, chunk.nbytes) == 0
    metadata = json.dumps({"shape": [256, 1024], "dtype": "uint8"}).encode()
    with ThreadPoolExecutor(max_workers=1) as pool:
        put = pool.submit(store.put_parts, "lmcache/chunk1", metadata, chunk[:1024].tobytes())
        assert put.result(timeout=1) == 0
    assert store.batch_get_into(["lmcache/chunk0"], [into.ctypes.data], [into.nbytes]) == [
        chunk.nbytes
    ]
    assert np.array_equal(into, chunk)
    handles = store.batch_get_buffer(["lmcache/chunk1", "lmcache/none"])
    assert bytes(handles[0])[: len(metadata)] == metadata and handles[1] is None
    store.remove_all(True)
    store.close()


def test_a_killed_member_loses_only_what_it_alone_held(store_cluster):
    member = Member(store_cluster.addr, "localhost", "8MB")
    store = connect(store_cluster)
    try:
        alone, twice = ReplicateConfig(), ReplicateConfig()
        alone.preferred_segment = member.hostname
        twice.preferred_segments = [member.hostname]
        twice.replica_num = 2
        assert store.put("only-on-member", b"a" * 4096, alone) == 0
        assert store.put("on-member-and-elsewhere", b"b" * 4096, twice) == 0
        member.proc.kill()
        member.proc.wait(timeout=10)
        started = time.monotonic()
        assert store.get("on-member-and-elsewhere") == b"b" * 4096
        assert store.get("only-on-member") == b""  # a miss, not a 60 s transfer timeout
        deadline = started + 5
        while store.is_exist("only-on-member") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.is_exist("only-on-member") == 0
        assert time.monotonic() - started < 5
        assert store.is_exist("on-member-and-elsewhere") == 1
    finally:
        store.remove_all(True)
        store.close()
        if member.proc.poll() is None:
            member.proc.kill()


def test_health_check_answers_at_once_when_the_master_dies():
    cluster = StoreCluster(servers=0)
    store = connect(cluster)
    member = railyard.Store(
        cluster.addr, segment_size=MIB, fabric="tcp", busy_poll=False, timeout_s=1
    )
    try:
        assert store.health_check() == 0
        cluster.master.kill()
        deadline = time.monotonic() + 5
        answer = 0
        while answer == 0 and time.monotonic() < deadline:
            started = time.monotonic()
            answer = store.health_check()
            assert time.monotonic() - started < 0.5  # from the keepalive: no round trip
            time.sleep(0.05)
        assert answer == 2
        # Closing with the master gone: closed anyway, said as a warning, never raised.
        with pytest.warns(RuntimeWarning, match="close"):
            member.close()
        assert not member.is_setup
    finally:
        member.close()
        store.close()
        cluster.stop()
