"""The Mooncake shim's status codes, and that it reports only what the railyard engine
resolved: a batch whose deadline passes while its work is posted stays pending (``0``, not
``-2``/``-1``, not forgotten) until the engine has failed it with its own ``Timeout``.

A stalled target is a peer process stopped with SIGSTOP on the TCP fabric: what is posted to
it neither completes nor fails until the engine's deadline (which must come before the
engine's liveness timeout of 1.5 s declares the stopped peer unavailable). To show that the
shim keeps no clock of its own, the shim's timeout is short and the engine is given a later
deadline: the shim's own deadline has passed long before the engine resolves anything."""

from __future__ import annotations

import time

import numpy as np
import pytest

import railyard
from railyard.compat.mooncake import TransferEngine

BUF = 64 << 10
# The shim's MC_TRANSFER_TIMEOUT is at least 5 s; tests set its attribute to stay fast.
SHIM_TIMEOUT_S = 0.1
# How much later than the shim's timeout the engine's deadline is in the stalled tests: the
# engine's deadline (0.9 s) comes well before its liveness timeout fails the stopped peer.
ENGINE_EXTRA_S = 0.8
# Bound of every poll loop.
WAIT_S = 20.0


class LaterDeadlines:
    """The shim's :class:`railyard.Engine` with every deadline the shim passes it extended by
    ``extra_s``: the engine resolves a stalled request that long after the shim's own
    timeout has passed."""

    def __init__(self, engine: railyard.Engine, extra_s: float) -> None:
        self._engine = engine
        self._extra_s = extra_s

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def _later(self, timeout_s: float | None) -> float:
        return (timeout_s if timeout_s is not None else 30.0) + self._extra_s

    def submit(self, *args, timeout_s=None, **kwargs):
        return self._engine.submit(*args, timeout_s=self._later(timeout_s), **kwargs)

    def write(self, *args, timeout_s=None, **kwargs):
        return self._engine.write(*args, timeout_s=self._later(timeout_s), **kwargs)

    def read(self, *args, timeout_s=None, **kwargs):
        return self._engine.read(*args, timeout_s=self._later(timeout_s), **kwargs)


@pytest.fixture
def shim():
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield engine
    engine.close()


@pytest.fixture
def target():
    """A railyard engine in this process: one read-write and one read-only buffer."""
    with railyard.Engine("status-target", listen="127.0.0.1:0", fabric="tcp", busy_poll=False) as t:
        rw = np.zeros(BUF, dtype=np.uint8)
        ro = np.zeros(BUF, dtype=np.uint8)
        t.register(rw.ctypes.data, rw.nbytes)
        t.register(ro.ctypes.data, ro.nbytes, peer_access="read")
        yield t, rw, ro


@pytest.fixture
def stalled(shim, spawn_peer):
    """``(shim, peer, src)``: the shim talks to a TCP peer, then the peer is stopped. The shim's
    timeout is SHIM_TIMEOUT_S; the engine's deadlines are ENGINE_EXTRA_S later."""
    peer = spawn_peer("--mode", "native", "--fabric", "tcp", "--size", str(BUF))
    src = np.full(BUF, 0x6B, dtype=np.uint8)
    assert shim.register_memory(src.ctypes.data, src.nbytes) == 0
    remote, _ = peer.bufs[0]
    # The peer is opened (and a transfer to it done) while it still answers.
    assert shim.transfer_sync_write(peer.session, src.ctypes.data, remote, BUF) == 0
    shim._timeout_s = SHIM_TIMEOUT_S
    shim._engine = LaterDeadlines(shim._engine, ENGINE_EXTRA_S)
    peer.pause()
    try:
        yield shim, peer, src
    finally:
        peer.resume()


def poll_until_reported(shim: TransferEngine, batch_id: int) -> tuple[int, float]:
    """``transfer_check_status`` until it is not 0: (that code, ``time.monotonic()`` then)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status = shim.transfer_check_status(batch_id)
        if status != 0:
            return status, time.monotonic()
        time.sleep(0.005)
    pytest.fail(f"batch {batch_id} still pending after {WAIT_S} s")


def test_done_failed_and_unknown_codes(shim, target):
    engine, rw, ro = target
    session = engine.session_id
    src = np.arange(BUF, dtype=np.uint32).view(np.uint8)[:BUF].copy()
    assert shim.register_memory(src.ctypes.data, src.nbytes) == 0

    # done: 1 once, then the id is forgotten (-1)
    done = shim.batch_transfer_async_write(session, [src.ctypes.data], [rw.ctypes.data], [BUF])
    assert done > 0
    status, _ = poll_until_reported(shim, done)
    assert status == 1
    assert np.array_equal(rw, src)
    assert shim.transfer_check_status(done) == -1

    # failed, not by the deadline: the target refuses a write into read-only memory (-1)
    failed = shim.batch_transfer_async_write(session, [src.ctypes.data], [ro.ctypes.data], [BUF])
    assert failed > 0
    batch = shim._pending[failed].batch
    status, _ = poll_until_reported(shim, failed)
    assert status == -1
    assert batch.poll() == "ERR" and not batch.timed_out()
    assert shim.transfer_check_status(failed) == -1
    assert not ro.any()

    # get_batch_transfer_status: 0 when all are done, -1 when one failed; ids forgotten
    ids = [
        shim.batch_transfer_async_write(session, [src.ctypes.data], [rw.ctypes.data], [BUF]),
        shim.batch_transfer_async_read(session, [src.ctypes.data], [rw.ctypes.data], [BUF]),
    ]
    assert all(i > 0 for i in ids)
    assert shim.get_batch_transfer_status(ids) == 0
    assert [shim.transfer_check_status(i) for i in ids] == [-1, -1]
    ids = [
        shim.batch_transfer_async_write(session, [src.ctypes.data], [rw.ctypes.data], [BUF]),
        shim.batch_transfer_async_write(session, [src.ctypes.data], [ro.ctypes.data], [BUF]),
    ]
    assert shim.get_batch_transfer_status(ids) == -1
    assert [shim.transfer_check_status(i) for i in ids] == [-1, -1]

    # unknown ids: Mooncake's submit sentinel 0, never issued, negative; an empty list
    for bad in (0, 123456789, -1):
        assert shim.transfer_check_status(bad) == -1
        assert shim.get_batch_transfer_status([bad]) == -1
    assert shim.get_batch_transfer_status([]) == 0
    # a batch that could not be submitted (unregistered local memory) is the sentinel 0
    unregistered = np.zeros(BUF, dtype=np.uint8)
    local = unregistered.ctypes.data
    assert shim.batch_transfer_async_write(session, [local], [rw.ctypes.data], [BUF]) == 0


def test_check_status_is_pending_past_the_shim_timeout_until_the_engine_resolves(stalled):
    shim, peer, src = stalled
    remote, _ = peer.bufs[0]
    submitted = time.monotonic()
    batch_id = shim.batch_transfer_async_write(peer.session, [src.ctypes.data], [remote], [BUF])
    assert batch_id > 0
    batch = shim._pending[batch_id].batch

    # Well past the shim's timeout, the engine has not resolved the write: still pending.
    time.sleep(SHIM_TIMEOUT_S + 0.2)
    assert batch.poll() == "PROC"
    assert shim.transfer_check_status(batch_id) == 0
    assert batch_id in shim._pending

    # Reported once, as the engine's timeout, only when the engine failed it (not before
    # the engine's deadline).
    status, reported = poll_until_reported(shim, batch_id)
    assert status == -2
    assert reported - submitted >= SHIM_TIMEOUT_S + ENGINE_EXTRA_S
    assert batch.poll() == "ERR" and batch.timed_out()
    assert shim.transfer_check_status(batch_id) == -1  # forgotten once reported


def test_get_batch_transfer_status_waits_until_the_engine_resolved_every_batch(stalled):
    shim, peer, src = stalled
    remote, _ = peer.bufs[0]
    submitted = time.monotonic()
    first = shim.batch_transfer_async_write(peer.session, [src.ctypes.data], [remote], [BUF])
    second = shim.batch_transfer_async_write(peer.session, [src.ctypes.data], [remote], [BUF])
    assert first > 0 and second > 0
    batches = [shim._pending[first].batch, shim._pending[second].batch]
    time.sleep(SHIM_TIMEOUT_S + 0.2)  # the shim's timeout has passed

    # An unknown id first: still every named batch is waited for before anything is
    # reported or forgotten.
    assert shim.get_batch_transfer_status([987654321, first, second]) == -1
    assert [b.poll() for b in batches] == ["ERR", "ERR"]
    assert all(b.timed_out() for b in batches)
    assert time.monotonic() - submitted >= SHIM_TIMEOUT_S + ENGINE_EXTRA_S
    assert shim.transfer_check_status(first) == -1
    assert shim.transfer_check_status(second) == -1


def test_sync_transfer_to_a_stalled_peer_returns_after_the_engine_resolved(stalled):
    shim, peer, src = stalled
    remote, _ = peer.bufs[0]
    started = time.monotonic()
    assert shim.transfer_sync_write(peer.session, src.ctypes.data, remote, BUF) == -1
    assert time.monotonic() - started >= SHIM_TIMEOUT_S + ENGINE_EXTRA_S
