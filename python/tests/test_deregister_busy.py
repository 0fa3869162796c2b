"""Deregistration refused with the engine's ``Busy`` keeps the region, and can be retried.

``Busy``: a peer process was still inside a copy of the region when the engine's wait ended.
The peer (soft fabric, one host) reads the region over and over and is stopped with SIGSTOP,
most likely in the middle of a copy; when the stop happened between two copies the release
succeeds and the test tries again with a fresh region."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest

import railyard
from railyard.compat.mooncake import TransferEngine

LEN = 4 << 20
ATTEMPTS = 8


@pytest.fixture
def reader(spawn_peer):
    """A peer that can read LEN bytes of this process's memory over and over (HAMMER)."""
    return spawn_peer("--mode", "native", "--fabric", "auto", "--size", str(LEN))


def stop_reader_inside(
    reader, session: str, make: Callable[[], int], release: Callable[[int], bool]
) -> int:
    """Makes a region (``make``), has ``reader`` read it over and over, stops the reader and
    releases the region (``release``: whether the release was refused as busy). Returns the
    region whose release was refused; the reader is left stopped."""
    for _ in range(ATTEMPTS):
        addr = make()
        assert reader.cmd(f"HAMMER {session} {addr} {LEN}") == {"ok": True}
        time.sleep(0.3)
        reader.pause()
        if release(addr):
            return addr
        reader.resume()  # stopped between two copies: the region was released
        assert reader.cmd("CALM")["reads"] > 0
    pytest.fail(f"the reader was never stopped inside a copy in {ATTEMPTS} attempts")


def busy(call: Callable[[], object]) -> bool:
    try:
        call()
    except RuntimeError as err:
        assert "still in use" in str(err), err
        return True
    return False


@pytest.fixture
def engine():
    with railyard.Engine("busy-local", listen="127.0.0.1:0", fabric="auto") as e:
        yield e


def test_free_after_busy_keeps_the_memory_and_can_be_retried(engine, reader):
    addr = stop_reader_inside(
        reader, engine.session_id, lambda: engine.alloc(LEN), lambda a: busy(lambda: engine.free(a))
    )
    reader.resume()
    engine.free(addr)  # kept after Busy: freed now that the reader let go
    with pytest.raises(ValueError):
        engine.free(addr)
    reader.cmd("CALM")


def test_deregister_after_busy_can_be_retried(engine, reader):
    buffers: list[np.ndarray] = []  # kept mapped: a busy region must not be unmapped

    def make() -> int:
        buffers.append(np.zeros(LEN, dtype=np.uint8))
        engine.register(buffers[-1].ctypes.data, LEN)
        return buffers[-1].ctypes.data

    addr = stop_reader_inside(
        reader, engine.session_id, make, lambda a: busy(lambda: engine.deregister(a))
    )
    reader.resume()
    engine.deregister(addr)  # still withdrawn after Busy: deregistered now
    with pytest.raises(ValueError):
        engine.deregister(addr)
    reader.cmd("CALM")


@pytest.fixture
def shim():
    """A Mooncake shim on railyard's auto fabric (soft between processes of one host)."""
    engine = TransferEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "auto", "") == 0
    yield engine
    engine.close()


def test_shim_unregister_after_busy_can_be_retried(shim, reader):
    session = f"127.0.0.1:{shim.get_rpc_port()}"
    buffers: list[np.ndarray] = []

    def make() -> int:
        buffers.append(np.zeros(LEN, dtype=np.uint8))
        assert shim.register_memory(buffers[-1].ctypes.data, LEN) == 0
        return buffers[-1].ctypes.data

    addr = stop_reader_inside(reader, session, make, lambda a: shim.unregister_memory(a) == -1)
    reader.resume()
    assert shim.unregister_memory(addr) == 0
    assert shim.unregister_memory(addr) == -1  # gone now
    reader.cmd("CALM")


def test_shim_free_managed_buffer_after_busy_can_be_retried(shim, reader):
    session = f"127.0.0.1:{shim.get_rpc_port()}"
    addr = stop_reader_inside(
        reader,
        session,
        lambda: shim.allocate_managed_buffer(LEN),
        lambda a: shim.free_managed_buffer(a, LEN) == -1,
    )
    reader.resume()
    assert shim.free_managed_buffer(addr, LEN) == 0
    assert shim.free_managed_buffer(addr, LEN) == -1  # gone now
    reader.cmd("CALM")
