"""The native API (railyard.Engine) between two Python processes on loopback."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time

import numpy as np
import pytest

import railyard
from railyard import TransferError

from conftest import FABRIC

BLOCK = 64 << 10  # 64 KiB
NUM_BLOCKS = 256  # 16 MiB on each side
BLOCKS_PER_BATCH = 8
BATCHES = 1000
THREADS = 10


@pytest.fixture
def engine():
    with railyard.Engine("pytest-local", listen="127.0.0.1:0", fabric=FABRIC) as e:
        yield e


@pytest.fixture
def peer(spawn_peer):
    return spawn_peer(
        "--mode",
        "native",
        "--size",
        str(NUM_BLOCKS * BLOCK),
        "--fabric",
        FABRIC,
        "--name",
        "pytest-peer",
    )


def _batches(rng: np.random.Generator) -> list[np.ndarray]:
    """1000 batches of distinct remote block indices; the first ones cover every block."""
    order = rng.permutation(NUM_BLOCKS)
    batches = [order[i : i + BLOCKS_PER_BATCH] for i in range(0, NUM_BLOCKS, BLOCKS_PER_BATCH)]
    while len(batches) < BATCHES:
        batches.append(rng.choice(NUM_BLOCKS, size=BLOCKS_PER_BATCH, replace=False))
    return batches


def test_session_id_and_name(engine):
    host, _, port = engine.session_id.rpartition(":")
    assert host and port.isdigit() and int(port) > 0
    assert engine.name == "pytest-local"
    assert isinstance(engine.stats(), dict)


def test_scattered_writes_and_reads_from_ten_threads(engine, peer):
    """1000 batches of 8 scattered 64 KiB blocks written, then 1000 read, from 10 threads;
    every byte compared. Remote block r always receives local block perm[r], so batches
    that overlap write the same bytes and the final contents are known."""
    rng = np.random.default_rng(18)
    src = rng.integers(0, 256, size=NUM_BLOCKS * BLOCK, dtype=np.uint8)
    back = np.zeros_like(src)
    engine.register([src.ctypes.data, back.ctypes.data], [src.nbytes, back.nbytes])
    remote_base, remote_len = peer.bufs[0]
    assert remote_len == NUM_BLOCKS * BLOCK

    perm = rng.permutation(NUM_BLOCKS)  # remote block r <- local block perm[r]
    src_base, back_base = src.ctypes.data, back.ctypes.data
    batches = _batches(rng)

    def write(i: int) -> None:
        remote = batches[i]
        local_addrs = src_base + perm[remote].astype(np.uint64) * BLOCK
        remote_addrs = remote_base + remote.astype(np.uint64) * BLOCK
        lengths = np.full(len(remote), BLOCK, dtype=np.uint64)
        if i % 2:  # lists of ints and NumPy uint64 arrays are both accepted
            local_addrs, remote_addrs, lengths = (
                local_addrs.tolist(),
                remote_addrs.tolist(),
                lengths.tolist(),
            )
        engine.write(peer.session, local_addrs, remote_addrs, lengths, timeout_s=30)

    def read(i: int) -> None:  # remote block r -> back block r
        remote = batches[i]
        engine.read(
            peer.session,
            (back_base + remote.astype(np.uint64) * BLOCK).tolist(),
            (remote_base + remote.astype(np.uint64) * BLOCK).tolist(),
            [BLOCK] * len(remote),
            timeout_s=30,
        )

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        for fut in [pool.submit(write, i) for i in range(BATCHES)]:
            fut.result(timeout=60)
    expected = src.reshape(NUM_BLOCKS, BLOCK)[perm].reshape(-1)
    digest = peer.cmd("DIGEST")["digests"][0]
    assert digest == hashlib.sha256(expected.tobytes()).hexdigest(), "peer's bytes differ"

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        for fut in [pool.submit(read, i) for i in range(BATCHES)]:
            fut.result(timeout=60)
    mismatched = np.flatnonzero(
        (back.reshape(NUM_BLOCKS, BLOCK) != expected.reshape(NUM_BLOCKS, BLOCK)).any(axis=1)
    )
    assert mismatched.size == 0, f"blocks read back wrong: {mismatched[:10].tolist()}"
    elapsed = time.monotonic() - started
    moved = 2 * BATCHES * BLOCKS_PER_BATCH * BLOCK
    print(f"\n{moved / 2**20:.0f} MiB written and read back in {elapsed:.2f} s")

    # What an inference server would serve at /metrics counts exactly this traffic.
    assert railyard.METRICS_CONTENT_TYPE.startswith("text/plain")
    submitted = {}
    for line in engine.metrics_text().splitlines():
        if line.startswith("railyard_submitted_bytes_total{"):
            labels, value = line.rsplit(" ", 1)
            op = labels.split('op="')[1].split('"')[0]
            submitted[op] = submitted.get(op, 0) + int(value)
    assert submitted == {"write": moved // 2, "read": moved // 2}
    (peer_stats,) = engine.stats()["peers"]
    assert peer_stats["write_bytes"] == peer_stats["read_bytes"] == moved // 2


def test_submit_poll_wait(engine, peer):
    src = np.arange(4 * BLOCK, dtype=np.uint64).view(np.uint8)[: 4 * BLOCK].copy()
    engine.register(src.ctypes.data, src.nbytes)
    remote_base, _ = peer.bufs[0]
    batch = engine.submit(
        peer.session,
        "write",
        [src.ctypes.data + i * BLOCK for i in range(4)],
        [remote_base + i * BLOCK for i in range(4)],
        [BLOCK] * 4,
    )
    assert batch.poll() in ("DONE", "PROC")
    assert batch.wait(10) == "DONE"
    assert batch.poll() == "DONE"
    assert batch.failures() == []
    expected = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    expected[: 4 * BLOCK] = src
    assert peer.cmd("DIGEST")["digests"][0] == hashlib.sha256(expected.tobytes()).hexdigest()

    back = np.zeros(4 * BLOCK, dtype=np.uint8)
    engine.register(back.ctypes.data, back.nbytes)
    batch = engine.submit(peer.session, "read", [back.ctypes.data], [remote_base], [back.nbytes])
    assert batch.wait(10) == "DONE"
    assert np.array_equal(back, src)


def test_notifications_both_ways(engine, peer):
    # here -> peer, alone and after a write (the data is there when the message is)
    engine.notify(peer.session, b"hello peer")
    got = peer.cmd("WAIT_NOTIFS 10")["notifs"]
    assert got == {engine.name: [b"hello peer".hex()]}

    src = np.full(BLOCK, 0x5A, dtype=np.uint8)
    engine.register(src.ctypes.data, src.nbytes)
    remote_base, _ = peer.bufs[0]
    engine.write(peer.session, [src.ctypes.data], [remote_base], [BLOCK], notify=b"kv ready")
    got = peer.cmd("WAIT_NOTIFS 10")["notifs"]
    assert got == {engine.name: [b"kv ready".hex()]}
    expected = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    expected[:BLOCK] = 0x5A
    assert peer.cmd("DIGEST")["digests"][0] == hashlib.sha256(expected.tobytes()).hexdigest()

    # peer -> here, keyed by the peer's name
    assert engine.get_notifs() == {}
    for msg in (b"one", b"two"):
        assert peer.cmd(f"NOTIFY {engine.session_id} {msg.hex()}") == {"ok": True}
    received: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + 10
    while sum(map(len, received.values())) < 2 and time.monotonic() < deadline:
        for sender, msgs in engine.wait_notifs(1.0).items():
            received.setdefault(sender, []).extend(bytes(m) for m in msgs)
    assert received == {peer.name: [b"one", b"two"]}

    started = time.monotonic()
    assert engine.wait_notifs(0.2) == {}
    assert time.monotonic() - started < 5


def test_failed_peer_raises_within_deadline(engine, spawn_peer):
    peer = spawn_peer("--mode", "native", "--size", str(BLOCK), "--fabric", FABRIC)
    src = np.ones(BLOCK, dtype=np.uint8)
    engine.register(src.ctypes.data, src.nbytes)
    remote_base, _ = peer.bufs[0]
    engine.write(peer.session, [src.ctypes.data], [remote_base], [BLOCK], timeout_s=10)
    assert engine.probe(peer.session) is True

    peer.kill()

    started = time.monotonic()
    with pytest.raises(TransferError) as info:
        engine.write(peer.session, [src.ctypes.data], [remote_base], [BLOCK], timeout_s=5)
    elapsed = time.monotonic() - started
    # The 5 s deadline and the 2 s grace a synchronous call gives a batch to resolve.
    assert elapsed < 8, f"took {elapsed:.1f} s to notice a dead peer"
    assert peer.session in str(info.value) or info.value.peer == peer.session

    started = time.monotonic()
    assert engine.probe(peer.session) is False  # never raises for a dead peer
    assert time.monotonic() - started < 15

    started = time.monotonic()
    try:
        batch = engine.submit(
            peer.session, "write", [src.ctypes.data], [remote_base], [BLOCK], timeout_s=3
        )
    except TransferError:
        pass  # refused up front: the peer is known dead
    else:
        assert batch.wait(15) == "ERR"
        assert batch.failures() and batch.failures()[0][0] == 0
    assert time.monotonic() - started < 20

    # the engine is still usable
    assert isinstance(engine.stats(), dict)


def test_bad_arguments_raise_and_never_crash(engine, peer):
    src = np.zeros(4 * BLOCK, dtype=np.uint8)
    engine.register(src.ctypes.data, src.nbytes)
    unregistered = np.zeros(BLOCK, dtype=np.uint8)
    remote_base, remote_len = peer.bufs[0]
    a = src.ctypes.data

    with pytest.raises(ValueError):  # mismatched list lengths
        engine.write(peer.session, [a, a + BLOCK], [remote_base], [BLOCK, BLOCK])
    with pytest.raises(ValueError):
        engine.read(peer.session, [a], [remote_base], [BLOCK, BLOCK])
    with pytest.raises(ValueError):  # negative size
        engine.write(peer.session, [a], [remote_base], [-BLOCK])
    with pytest.raises(ValueError):
        engine.register(unregistered.ctypes.data, -1)
    with pytest.raises(TransferError):  # unregistered local range
        engine.write(peer.session, [unregistered.ctypes.data], [remote_base], [BLOCK])
    with pytest.raises(TransferError):  # local range running past its registration
        engine.write(peer.session, [a + 3 * BLOCK], [remote_base], [2 * BLOCK])
    with pytest.raises(TransferError):  # unregistered remote range
        engine.write(peer.session, [a], [remote_base + remote_len + (1 << 20)], [BLOCK])
    with pytest.raises(ValueError):  # unknown op
        engine.submit(peer.session, "copy", [a], [remote_base], [BLOCK])
    for bad_session in ("not-a-session", "127.0.0.1", "127.0.0.1:notaport", ""):
        with pytest.raises((ValueError, TransferError)):
            engine.write(bad_session, [a], [remote_base], [BLOCK], timeout_s=5)
    with pytest.raises(TypeError):
        engine.write(peer.session, ["0x10"], [remote_base], [BLOCK])
    with pytest.raises(TypeError):
        engine.notify(peer.session, "not bytes")

    # registration rules: the same range again is a no-op, an overlapping one is refused
    engine.register(a, src.nbytes)
    with pytest.raises(ValueError):
        engine.register(a + BLOCK, src.nbytes)
    with pytest.raises(ValueError):
        engine.deregister(unregistered.ctypes.data)

    # after all that, transfers still work
    src[:] = 7
    engine.write(peer.session, [a], [remote_base], [BLOCK])
    back = np.zeros(BLOCK, dtype=np.uint8)
    engine.register(back.ctypes.data, back.nbytes)
    engine.read(peer.session, [back.ctypes.data], [remote_base], [BLOCK])
    assert (back == 7).all()
    engine.deregister([back.ctypes.data])


def test_alloc_free_and_close():
    e = railyard.Engine(listen="127.0.0.1:0", fabric=FABRIC)
    addr = e.alloc(1 << 20)
    assert isinstance(addr, int) and addr != 0
    e.free(addr)
    e.close()
    e.close()  # idempotent
    with pytest.raises(RuntimeError):
        e.alloc(4096)
    with pytest.raises(RuntimeError):
        _ = e.stats()


def test_unknown_fabric_is_refused():
    with pytest.raises((ValueError, RuntimeError)):
        railyard.Engine(listen="127.0.0.1:0", fabric="warp-drive")


def test_refusals_queue_nothing_and_name_the_range(engine, peer):
    src = np.full(2 * BLOCK, 3, dtype=np.uint8)
    engine.register(src.ctypes.data, src.nbytes)
    remote_base, remote_len = peer.bufs[0]
    before = peer.cmd("DIGEST")["digests"][0]

    # A notification too large for one message: refused before the batch is queued.
    with pytest.raises(ValueError):
        engine.write(peer.session, [src.ctypes.data], [remote_base], [BLOCK],
                     notify=b"x" * (2 << 20))
    with pytest.raises(ValueError):
        engine.submit(peer.session, "write", [src.ctypes.data], [remote_base], [BLOCK],
                      notify=b"x" * (2 << 20))
    # The second range is outside every region: the error names it, nothing moved.
    bad_remote = remote_base + remote_len + (1 << 20)
    with pytest.raises(TransferError) as info:
        engine.write(peer.session, [src.ctypes.data, src.ctypes.data + BLOCK],
                     [remote_base, bad_remote], [BLOCK, BLOCK], timeout_s=5)
    assert info.value.index == 1
    assert info.value.remote_addr == bad_remote and info.value.length == BLOCK
    assert peer.cmd("DIGEST")["digests"][0] == before, "a refused batch moved bytes"

    # A registration call refused halfway leaves nothing of it registered.
    other = np.zeros(BLOCK, dtype=np.uint8)
    with pytest.raises(ValueError):
        engine.register([other.ctypes.data, src.ctypes.data + 8], [other.nbytes, 16])
    with pytest.raises(ValueError):
        engine.deregister(other.ctypes.data)

    # Waits of zero only look; an absurd rail count is refused.
    batch = engine.submit(peer.session, "write", [src.ctypes.data], [remote_base], [BLOCK])
    assert batch.wait(0) in ("DONE", "PROC")
    assert batch.wait(10) == "DONE" and not batch.timed_out()
    assert engine.wait_notifs(0) == {}
    with pytest.raises(ValueError):
        railyard.Engine(listen="127.0.0.1:0", rails=100_000)


def test_close_releases_a_thread_waiting_for_notifications():
    e = railyard.Engine(listen="127.0.0.1:0", fabric=FABRIC, busy_poll=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(e.wait_notifs, 60)
        time.sleep(0.2)
        started = time.monotonic()
        e.close()
        assert waiting.result(timeout=10) == {}
        assert time.monotonic() - started < 2


def test_libfabric_engines_write_to_each_other():
    """fabric="ofi" on libfabric's tcp provider, two engines in one process."""
    provider = {"ofi_provider": "tcp;ofi_rxm", "fabric": "ofi", "busy_poll": False, "rails": 1}
    with railyard.Engine("py-ofi-a", listen="127.0.0.1:0", **provider) as a, railyard.Engine(
        "py-ofi-b", listen="127.0.0.1:0", **provider
    ) as b:
        assert a.fabric == "ofi"
        src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
        dst = np.zeros(1 << 20, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes)
        b.register(dst.ctypes.data, dst.nbytes)
        a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [src.nbytes], timeout_s=10)
        assert (dst == src).all()
    with pytest.raises(RuntimeError, match="no-such"):
        railyard.Engine("py-ofi-c", fabric="ofi", ofi_provider="no-such")


def test_encrypted_control_frames_from_the_environment(tmp_path, monkeypatch):
    """RAILYARD_ENCRYPT_CONTROL=1 (the CLI's --encrypt-control): members with the secret
    still write to each other; without a secret, or with a value that is not a yes or a no,
    the engine is refused and says why."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-32-bytes-ok!\n")
    secret.chmod(0o600)
    common = {"listen": "127.0.0.1:0", "fabric": FABRIC, "busy_poll": False, "rails": 1}
    monkeypatch.delenv("RAILYARD_SECRET_FILE", raising=False)
    monkeypatch.setenv("RAILYARD_ENCRYPT_CONTROL", "1")
    with railyard.Engine("py-sealed-a", secret_file=secret, **common) as a, railyard.Engine(
        "py-sealed-b", secret_file=secret, **common
    ) as b:
        src = np.full(1 << 16, 5, dtype=np.uint8)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes, peer_access="none")
        b.register(dst.ctypes.data, dst.nbytes)
        a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [src.nbytes], timeout_s=10)
        assert (dst == 5).all()
    with pytest.raises(RuntimeError, match="needs a cluster secret"):
        railyard.Engine("py-sealed-alone", **common)
    monkeypatch.setenv("RAILYARD_ENCRYPT_CONTROL", "maybe")
    with pytest.raises(ValueError, match="RAILYARD_ENCRYPT_CONTROL"):
        railyard.Engine("py-sealed-unclear", secret_file=secret, **common)


def test_an_empty_secret_file_variable_is_refused_by_name(monkeypatch):
    """RAILYARD_SECRET_FILE= (set, empty) is refused, as the CLI refuses it: neither read
    as the path "" nor taken for no secret."""
    monkeypatch.delenv("RAILYARD_ENCRYPT_CONTROL", raising=False)
    monkeypatch.setenv("RAILYARD_SECRET_FILE", "")
    with pytest.raises(ValueError, match="RAILYARD_SECRET_FILE is set but empty"):
        railyard.Engine("py-empty-secret", listen="127.0.0.1:0", fabric=FABRIC, busy_poll=False)


def test_a_cluster_secret_lets_members_in_and_keeps_others_out(tmp_path):
    """secret_file=: members write to each other; an engine without it gets no peer, and
    memory registered with peer_access="read" refuses a write."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-32-bytes-ok!\n")
    secret.chmod(0o600)
    common = {"listen": "127.0.0.1:0", "fabric": FABRIC, "busy_poll": False, "rails": 1}
    with railyard.Engine("py-member-a", secret_file=secret, **common) as a, railyard.Engine(
        "py-member-b", secret_file=str(secret), **common
    ) as b, railyard.Engine("py-outsider", **common) as outsider:
        src = np.full(1 << 16, 7, dtype=np.uint8)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        shelf = np.zeros(1 << 16, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes, peer_access="none")
        b.register(dst.ctypes.data, dst.nbytes)
        b.register(shelf.ctypes.data, shelf.nbytes, peer_access="read")
        a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [src.nbytes], timeout_s=10)
        assert (dst == 7).all()
        with pytest.raises(TransferError):
            a.write(b.session_id, [src.ctypes.data], [shelf.ctypes.data], [4096], timeout_s=10)
        assert (shelf == 0).all()
        outsider_src = np.full(4096, 9, dtype=np.uint8)
        outsider.register(outsider_src.ctypes.data, outsider_src.nbytes)
        with pytest.raises(TransferError):
            outsider.write(
                b.session_id, [outsider_src.ctypes.data], [dst.ctypes.data], [4096], timeout_s=5
            )
        assert (dst == 7).all()
    with pytest.raises(ValueError, match="too short"):
        short = tmp_path / "short"
        short.write_text("short\n")
        railyard.Engine("py-short", secret_file=short, **common)
    with pytest.raises(ValueError, match="peer_access"):
        with railyard.Engine("py-bad-access", **common) as e:
            e.alloc(4096, peer_access="everything")
