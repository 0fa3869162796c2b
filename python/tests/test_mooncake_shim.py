"""railyard.compat.mooncake.TransferEngine driven the way vLLM's Mooncake connector drives
Mooncake (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py),
against a second process running the shim as the decode side."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import socket
import time
import warnings

import numpy as np
import pytest

from railyard.compat import mooncake
from railyard.compat.mooncake import TransferEngine, TransferNotify, TransferOpcode

NUM_LAYERS = 4
NUM_BLOCKS = 128
BLOCK_LEN = 16 << 10  # bytes of one block in one layer's KV tensor
REQUESTS = 48
BLOCKS_PER_REQUEST = 8


def group_concurrent_contiguous(src: list[int], dst: list[int]):
    """vLLM's grouping: split where either side's block ids stop being consecutive."""
    if not src:
        return [], []
    brk = np.where((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    return (
        [g.tolist() for g in np.split(src, brk)],
        [g.tolist() for g in np.split(dst, brk)],
    )


@pytest.fixture(params=["tcp", "rdma"])
def protocol(request):
    return request.param


@pytest.fixture
def prefill(protocol):
    engine = TransferEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "rdma" without a NIC falls back
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    yield engine
    engine.close()


@pytest.fixture
def decode(spawn_peer, protocol):
    return spawn_peer(
        "--mode",
        "mooncake",
        "--protocol",
        protocol,
        "--bufs",
        str(NUM_LAYERS),
        "--size",
        str(NUM_BLOCKS * BLOCK_LEN),
    )


def test_vllm_connector_path(prefill, decode):
    rpc_port = prefill.get_rpc_port()
    assert isinstance(rpc_port, int) and 0 < rpc_port < 65536

    # register_kv_caches(): each KV storage once, deduplicated by base address (here two
    # layer names share one tensor, as split K/V views or MLA can).
    rng = np.random.default_rng(7)
    tensors = [
        rng.integers(0, 256, size=NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(NUM_LAYERS)
    ]
    kv_caches = {f"layer.{i}": t for i, t in enumerate(tensors)}
    kv_caches["layer.0.alias"] = tensors[0]
    kv_data_ptrs: list[int] = []
    kv_data_lens: list[int] = []
    seen_base_addresses: list[int] = []
    for cache in kv_caches.values():
        base_addr = cache.ctypes.data
        if base_addr in seen_base_addresses:
            continue
        seen_base_addresses.append(base_addr)
        kv_data_ptrs.append(base_addr)
        kv_data_lens.append(cache.nbytes)
    assert len(kv_data_ptrs) == NUM_LAYERS
    assert prefill.batch_register_memory(kv_data_ptrs, kv_data_lens) == 0
    local_base_addr = seen_base_addresses
    remote_base_addr = [addr for addr, _ in decode.bufs]
    remote_session = decode.session

    # Each request: remote (decode) blocks are a disjoint contiguous run; local (prefill)
    # blocks are two contiguous halves at random places, so merging gives >= 2 groups.
    slots = rng.permutation(NUM_BLOCKS // BLOCKS_PER_REQUEST)
    requests = []
    for r in range(REQUESTS):
        slot = int(slots[r % len(slots)])
        remote_ids = list(range(slot * BLOCKS_PER_REQUEST, (slot + 1) * BLOCKS_PER_REQUEST))
        half = BLOCKS_PER_REQUEST // 2
        a, b = rng.choice(NUM_BLOCKS // half, size=2, replace=False) * half
        local_ids = list(range(a, a + half)) + list(range(b, b + half))
        requests.append((local_ids, remote_ids))
    # Several requests may target one decode slot: the last writer wins, so keep one
    # mapping per slot (later requests reuse the first request's local blocks).
    first_for_slot: dict[int, list[int]] = {}
    for local_ids, remote_ids in requests:
        first_for_slot.setdefault(remote_ids[0], local_ids)
    requests = [(first_for_slot[rem[0]], rem) for _, rem in requests]

    def build_transfer_params(local_ids, remote_ids):
        src_ptrs, dst_ptrs, lengths = [], [], []
        groups_local, groups_remote = group_concurrent_contiguous(local_ids, remote_ids)
        for local_layer_addr, remote_layer_addr in zip(local_base_addr, remote_base_addr):
            for gl, gr in zip(groups_local, groups_remote):
                src_ptrs.append(local_layer_addr + gl[0] * BLOCK_LEN)
                dst_ptrs.append(remote_layer_addr + gr[0] * BLOCK_LEN)
                lengths.append(BLOCK_LEN * len(gl))
        return src_ptrs, dst_ptrs, lengths

    def send_blocks(local_ids, remote_ids) -> int:
        src_ptrs, dst_ptrs, lengths = build_transfer_params(local_ids, remote_ids)
        assert len(src_ptrs) < NUM_LAYERS * len(local_ids)  # contiguous blocks merged
        return prefill.batch_transfer_sync_write(remote_session, src_ptrs, dst_ptrs, lengths)

    with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
        futures = [pool.submit(send_blocks, loc, rem) for loc, rem in requests]
        rets = [f.result(timeout=60) for f in futures]
    assert rets == [0] * len(requests)

    # Every byte on the decode side: written slots hold the prefill blocks, others zero.
    expected = [np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(NUM_LAYERS)]
    for local_ids, remote_ids in requests:
        for layer in range(NUM_LAYERS):
            src = tensors[layer].reshape(NUM_BLOCKS, BLOCK_LEN)
            expected[layer].reshape(NUM_BLOCKS, BLOCK_LEN)[remote_ids] = src[local_ids]
    digests = decode.cmd("DIGEST")["digests"]
    assert digests == [hashlib.sha256(e.tobytes()).hexdigest() for e in expected]

    # Read one request's blocks back (batch_transfer_sync_read) and compare.
    back = np.zeros(BLOCKS_PER_REQUEST * BLOCK_LEN, dtype=np.uint8)
    assert prefill.register_memory(back.ctypes.data, back.nbytes) == 0
    _, remote_ids = requests[0]
    ret = prefill.batch_transfer_sync_read(
        remote_session,
        [back.ctypes.data],
        [remote_base_addr[1] + remote_ids[0] * BLOCK_LEN],
        [back.nbytes],
    )
    assert ret == 0
    assert np.array_equal(back, expected[1].reshape(NUM_BLOCKS, BLOCK_LEN)[remote_ids].reshape(-1))
    assert prefill.unregister_memory(back.ctypes.data) == 0
    assert prefill.batch_unregister_memory(kv_data_ptrs) == 0


def test_sglang_calls_and_return_codes(prefill, decode):
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8).copy()  # 256 KiB
    assert prefill.register_memory(src.ctypes.data, src.nbytes) == 0
    assert prefill.register_memory(src.ctypes.data, src.nbytes) == 0  # idempotent
    remote, _ = decode.bufs[0]
    session = decode.session
    n = src.nbytes

    assert prefill.send_probe(session) == 0
    assert prefill.transfer_sync_write(session, src.ctypes.data, remote, 4096) == 0
    assert (
        prefill.batch_transfer_sync(
            session, [src.ctypes.data + 4096], [remote + 4096], [n - 4096], TransferOpcode.Write
        )
        == 0
    )

    # transfer_submit_write + transfer_check_status (SGLang's aux data path)
    batch_id = prefill.transfer_submit_write(session, src.ctypes.data, remote, n)
    assert batch_id > 0
    deadline = time.monotonic() + 30
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = prefill.transfer_check_status(batch_id)
        time.sleep(0.001)
    assert status == 1
    assert prefill.transfer_check_status(batch_id) == -1  # forgotten once reported done

    ids = [
        prefill.batch_transfer_async_write(session, [src.ctypes.data], [remote], [n]),
        prefill.batch_transfer_async_read(session, [src.ctypes.data], [remote], [n]),
    ]
    assert all(i > 0 for i in ids)
    assert prefill.get_batch_transfer_status(ids) == 0

    expected = np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8)
    expected[:n] = src
    assert decode.cmd("DIGEST")["digests"][0] == hashlib.sha256(expected.tobytes()).hexdigest()

    back = np.zeros(4096, dtype=np.uint8)
    assert prefill.register_memory(back.ctypes.data, back.nbytes) == 0
    assert prefill.transfer_sync_read(session, back.ctypes.data, remote + 8192, 4096) == 0
    assert np.array_equal(back, src[8192 : 8192 + 4096])
    assert (
        prefill.transfer_sync(
            session,
            back.ctypes.data,
            remote,
            4096,
            TransferOpcode.Read,
            TransferNotify("prefill-0", "req-42 done"),
        )
        == 0
    )
    assert np.array_equal(back, src[:4096])
    assert decode.cmd("NOTIFIES 10")["notifies"] == [["prefill-0", "req-42 done"]]

    # failures are return codes, never exceptions
    unregistered = np.zeros(4096, dtype=np.uint8)
    assert prefill.transfer_sync_write(session, unregistered.ctypes.data, remote, 4096) == -1
    assert prefill.batch_transfer_sync_write(session, [src.ctypes.data], [remote], []) == -1
    assert prefill.batch_transfer_sync_write(session, [src.ctypes.data], [1 << 40], [4096]) == -1
    assert prefill.transfer_sync_write("no-such-host", src.ctypes.data, remote, 4096) == -1
    assert prefill.transfer_sync(session, src.ctypes.data, remote, 16, opcode=7) == -1
    bad_id = prefill.transfer_submit_write(session, unregistered.ctypes.data, remote, 16)
    assert bad_id == -1 and prefill.transfer_check_status(bad_id) == -1
    assert prefill.transfer_check_status(0) == -1
    assert prefill.transfer_check_status(123456789) == -1
    assert prefill.unregister_memory(unregistered.ctypes.data) == -1
    assert prefill.register_memory(src.ctypes.data, 4096, "cuda:0") == -1
    assert prefill.batch_register_memory([src.ctypes.data], []) == -1

    addr = prefill.allocate_managed_buffer(1 << 20)
    assert addr != 0
    assert prefill.free_managed_buffer(addr, 1 << 20) == 0


def test_failed_peer_returns_minus_one_within_timeout(spawn_peer, monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    engine = TransferEngine()
    try:
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        peer = spawn_peer("--mode", "mooncake", "--protocol", "tcp", "--size", "65536")
        src = np.ones(65536, dtype=np.uint8)
        assert engine.register_memory(src.ctypes.data, src.nbytes) == 0
        remote, _ = peer.bufs[0]
        assert engine.transfer_sync_write(peer.session, src.ctypes.data, remote, 65536) == 0
        peer.kill()
        started = time.monotonic()
        assert engine.transfer_sync_write(peer.session, src.ctypes.data, remote, 65536) == -1
        assert time.monotonic() - started < 15
        assert engine.send_probe(peer.session) == -1
    finally:
        engine.close()


def test_initialize_mappings():
    engine = TransferEngine()
    assert engine.get_rpc_port() == -1  # before initialize: a code, not a crash
    assert engine.initialize("127.0.0.1", "http://127.0.0.1:8080/metadata", "tcp", "") == -1
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "mlx5_0") == 0
    assert engine.get_rpc_port() > 0
    engine.close()


def test_a_finished_batch_checked_after_its_deadline_is_done(prefill, decode, monkeypatch):
    src = np.full(4096, 9, dtype=np.uint8)
    assert prefill.register_memory(src.ctypes.data, src.nbytes) == 0
    remote, _ = decode.bufs[0]
    batch_id = prefill.batch_transfer_async_write(
        decode.session, [src.ctypes.data], [remote], [4096]
    )
    assert batch_id > 0
    pending = prefill._pending[batch_id]
    assert pending.batch.wait(10) == "DONE"
    # Looked at only long after its deadline (a slow caller): still a success, as in
    # Mooncake; the shim reads no clock of its own.
    later = time.monotonic() + 3600
    with monkeypatch.context() as patched:
        patched.setattr(time, "monotonic", lambda: later)
        assert prefill.get_batch_transfer_status([batch_id]) == 0


def test_mooncakes_basic_usage_finds_a_managed_buffer_by_segment_name(spawn_peer):
    """Mooncake's own example: the target only allocates a managed buffer; the initiator
    finds it with get_first_buffer_address(target's segment name) and writes into it."""
    target = spawn_peer("--mode", "mooncake", "--managed", "--size", "65536", "--bufs", "2")
    initiator = TransferEngine()
    try:
        assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        remote = initiator.get_first_buffer_address(target.session)
        assert remote == target.bufs[0][0] != 0
        local = initiator.allocate_managed_buffer(65536)
        assert initiator.get_first_buffer_address(initiator.get_session_id()) == local
        assert initiator.write_bytes_to_buffer(local, b"railyard" * 8192, 65536) == 0
        assert initiator.transfer_sync_write(target.session, local, remote, 65536) == 0
        expected = hashlib.sha256(b"railyard" * 8192).hexdigest()
        assert target.cmd("DIGEST")["digests"][0] == expected
        assert initiator.read_bytes_from_buffer(local, 8) == b"railyard"
        # Unknown and malformed segments: 0, as Mooncake.
        assert initiator.get_first_buffer_address("127.0.0.1:1") == 0
        assert initiator.get_first_buffer_address("no-such-segment") == 0
    finally:
        initiator.close()


def test_shim_gaps_mooncake_users_meet_first():
    engine = TransferEngine()
    assert engine.get_first_buffer_address("127.0.0.1:1") == 0  # before initialize
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        # Listening where the caller said: 127.0.0.1 is loopback only (127.0.0.2 is another
        # loopback address, so a listener on every interface would answer there too).
        port = engine.get_rpc_port()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
        # Registrations are counted: the second unregister is the one that deregisters.
        buf = np.zeros(4096, dtype=np.uint8)
        assert engine.register_memory(buf.ctypes.data, 4096) == 0
        assert engine.register_memory(buf.ctypes.data, 4096) == 0
        assert engine.unregister_memory(buf.ctypes.data) == 0
        assert engine.get_first_buffer_address(engine.get_session_id()) == buf.ctypes.data
        assert engine.unregister_memory(buf.ctypes.data) == 0
        assert engine.unregister_memory(buf.ctypes.data) == -1
        assert engine.get_first_buffer_address(engine.get_session_id()) == 0
        # Failures are codes.
        assert engine.transfer_submit_write("127.0.0.1:1", buf.ctypes.data, 0, 16) == -1
        assert engine.write_bytes_to_buffer(buf.ctypes.data, b"abc", 10) == -1
        assert engine.write_bytes_to_buffer(0, b"abc", 3) == -1
        assert engine.write_bytes_to_buffer(buf.ctypes.data, "héllo", 3) == 0
        assert buf[:3].tobytes() == "héllo".encode()[:3]
        assert engine.send_probe("127.0.0.1:1") != 0
        assert engine.send_probe("no-such-peer") != 0
        topology = json.loads(engine.get_local_topology())
        assert "cpu:0" in topology and all(len(lists) == 2 for lists in topology.values())
        assert json.loads(engine.get_local_topology("no-such-device"))["cpu:0"] == [[], []]
        assert engine.get_engine() is engine.engine
        assert engine.warmup_efa_segment("127.0.0.1:1") == 0
        # Every method Mooncake binds is here, or says what to use instead.
        for name in MOONCAKE_BOUND:
            if hasattr(engine, name):
                continue
            with pytest.raises(NotImplementedError, match="railyard"):
                getattr(engine, name)
        assert not hasattr(engine, "transfer_write_on_cuda")
        assert not mooncake.SUPPORT_CUDA
        # close() then initialize(): registrations start afresh with the new engine.
        assert engine.register_memory(buf.ctypes.data, 4096) == 0
        engine.close()
        assert engine.initialize("127.0.0.2", "P2PHANDSHAKE", "tcp", "") == 0
        assert engine.get_first_buffer_address(engine.get_session_id()) == 0
        assert engine.register_memory(buf.ctypes.data, 4096) == 0
        assert engine.engine.peer_buffers(engine.engine.session_id) == [(buf.ctypes.data, 4096)]
        with socket.create_connection(("127.0.0.2", engine.get_rpc_port()), timeout=5):
            pass
    finally:
        engine.close()


# What mooncake-integration/transfer_engine/transfer_engine_py.cpp binds on TransferEngine.
MOONCAKE_BOUND = [
    "initialize", "initialize_ext", "get_rpc_port", "allocate_managed_buffer",
    "free_managed_buffer", "transfer_sync_write", "transfer_sync_read",
    "batch_transfer_sync_write", "batch_transfer_sync_read", "batch_transfer_async_write",
    "batch_transfer_async_read", "transfer_sync", "batch_transfer_sync", "batch_transfer_async",
    "transfer_write_on_cuda", "transfer_read_on_cuda", "batch_transfer_write_on_cuda",
    "batch_transfer_read_on_cuda", "get_batch_transfer_status", "transfer_submit_write",
    "transfer_check_status", "write_bytes_to_buffer", "read_bytes_from_buffer",
    "register_memory", "unregister_memory", "batch_register_memory", "batch_unregister_memory",
    "get_local_topology", "get_first_buffer_address", "warmup_efa_segment", "get_notifies",
    "send_probe", "get_engine", "get_engine_ptr",
]  # fmt: skip
