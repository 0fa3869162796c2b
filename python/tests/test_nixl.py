"""NIXL's agent API on railyard (``railyard.compat.nixl``), called as vLLM's NixlConnector
calls it: this process is the decode side, ``nixl_peer.py`` the prefill side, and both
import nothing but ``nixl._api`` / ``nixl._bindings`` once ``install()`` ran. Metadata goes
through a side channel (the peer's stdout and stdin), lists are prepared on both sides,
blocks are READ by ndarray indices, states are polled, notifications ``"req:n"`` arrive
after the last byte, and every byte is checked. Then peers that stall or die, bad input,
two threads on one agent, metadata over the listener, and the throughput of prepared
transfers beside ``railyard bench`` (printed)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from railyard.compat import nixl as shim
from railyard.compat.nixl.agent import _strided

shim.install()

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402
from nixl._bindings import (  # noqa: E402
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRepostActiveError,
    nixlXferTelemetry,
)

from conftest import HERE  # noqa: E402

NIXL_PEER = HERE / "nixl_peer.py"
LAYERS, BLOCKS, BLOCK = 4, 64, 16384
BOUND_S = 10.0


def prefill(spawn_peer, name: str, *, fabric: str = "auto", layers: int = LAYERS,
            blocks: int = BLOCKS, block: int = BLOCK, listen_port: int | None = None):
    args = ["--name", name, "--layers", str(layers), "--blocks", str(blocks),
            "--block-bytes", str(block)]
    if listen_port is not None:
        args += ["--listen-port", str(listen_port)]
    return spawn_peer(*args, script=NIXL_PEER, env={"RAILYARD_FABRIC": fabric})


def prefill_bytes(layers: int = LAYERS, blocks: int = BLOCKS, block: int = BLOCK,
                  seed: int = 7) -> list[np.ndarray]:
    """What nixl_peer.py fills its layers with."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=blocks * block, dtype=np.uint8) for _ in range(layers)]


def stop(peer) -> None:
    """SIGSTOP, and wait (bounded) until the kernel says it is stopped: it answers nothing,
    and nothing fails on its own."""
    peer.pause()
    deadline = time.monotonic() + BOUND_S
    stat = Path(f"/proc/{peer.proc.pid}/stat")
    while stat.read_text().rsplit(") ", 1)[1][0] != "T":
        assert time.monotonic() < deadline, "the peer never stopped"
        time.sleep(0.001)


class Decode:
    """The decode side as vLLM's worker builds it: one KV tensor per layer, registered, and
    its block list prepared."""

    def __init__(self, config: nixl_agent_config | None = None, *, layers: int = LAYERS,
                 blocks: int = BLOCKS, block: int = BLOCK) -> None:
        self.blocks, self.block = blocks, block
        self.agent = nixl_agent(str(uuid.uuid4()), config or nixl_agent_config(
            num_threads=4, capture_telemetry=True))
        self.layers = [np.zeros(blocks * block, dtype=np.uint8) for _ in range(layers)]
        caches = [(kv.ctypes.data, kv.nbytes, 0, "") for kv in self.layers]
        self.reg = self.agent.register_memory(self.agent.get_reg_descs(caches, "DRAM"),
                                              backends=["UCX"])
        blocks_data = [(kv.ctypes.data + b * block, block, 0)
                       for kv in self.layers for b in range(blocks)]
        descs = self.agent.get_xfer_descs(blocks_data, "DRAM")
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs)

    def add(self, peer) -> tuple[bytes, object]:
        """add_remote_agent from the side channel, then the remote list as an N×3 array."""
        name = self.agent.add_remote_agent(bytes.fromhex(peer.ready["metadata"]))
        rows = np.array([(base + b * self.block, self.block, 0)
                         for base, _ in peer.ready["layers"] for b in range(self.blocks)],
                        dtype=np.uint64)
        remote = self.agent.prep_xfer_dlist(name, self.agent.get_xfer_descs(rows, "DRAM"))
        return name, remote

    def desc_ids(self, block_ids: np.ndarray) -> np.ndarray:
        """vLLM's `_get_block_descs_ids`: every layer's descriptor of each block."""
        regions = np.arange(len(self.layers), dtype=np.int64)
        return (regions[:, None] * self.blocks + block_ids[None, :]).flatten()

    def wait(self, handle, bound_s: float = BOUND_S) -> str:
        deadline = time.monotonic() + bound_s
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            assert time.monotonic() < deadline, "the transfer neither finished nor failed"
            time.sleep(0.001)
        return state

    def close(self) -> None:
        self.agent.close()


def test_the_vllm_pull_sequence_reads_every_byte_and_notifies_after_the_last(spawn_peer):
    peer = prefill(spawn_peer, "prefill-vllm")
    decode = Decode()
    try:
        name, remote = decode.add(peer)
        assert name == b"prefill-vllm", "add_remote_agent answers the name as bytes"
        source = prefill_bytes()
        rng = np.random.default_rng(3)
        requests = {
            # Scattered blocks on both sides: nothing merges.
            "req-a": (rng.choice(BLOCKS, 24, replace=False), rng.choice(BLOCKS, 24, replace=False)),
            # A run of blocks contiguous on both sides: each layer's run merges.
            "req-b": (np.arange(40, 56), np.arange(8, 24)),
        }
        for request, (local_blocks, remote_blocks) in requests.items():
            local_ids = decode.desc_ids(local_blocks.astype(np.int64))
            remote_ids = decode.desc_ids(remote_blocks.astype(np.int64))
            notif_id = f"{request}:1".encode()
            handle = decode.agent.make_prepped_xfer(
                "READ", decode.local, local_ids, remote, remote_ids, notif_msg=notif_id)
            assert decode.agent.transfer(handle) in ("PROC", "DONE")
            assert decode.wait(handle) == "DONE"
            telemetry = decode.agent.get_xfer_telemetry(handle)
            assert isinstance(telemetry, nixlXferTelemetry)
            assert telemetry.totalBytes == len(local_ids) * BLOCK
            assert telemetry.xferDuration >= telemetry.postDuration > 0
            assert telemetry.startTime > 0
            if request == "req-b":
                assert telemetry.descCount == LAYERS, "each layer's 16 blocks went as one"
            else:
                assert telemetry.descCount == len(local_ids)
            decode.agent.release_xfer_handle(handle)
            for layer in range(LAYERS):
                for here, there in zip(local_blocks, remote_blocks):
                    got = decode.layers[layer][here * BLOCK:(here + 1) * BLOCK]
                    want = source[layer][there * BLOCK:(there + 1) * BLOCK]
                    assert np.array_equal(got, want), f"{request}: layer {layer} block {here}"
        # The producer sees each request's notification once, from the decode agent.
        seen: list[str] = []
        deadline = time.monotonic() + BOUND_S
        while len(seen) < 2 and time.monotonic() < deadline:
            notifs = peer.cmd("NOTIFS 2")["notifs"]
            assert set(notifs) <= {decode.agent.name}, notifs
            seen += notifs.get(decode.agent.name, [])
        assert sorted(seen) == ["req-a:1", "req-b:1"]
        assert peer.cmd("NOTIFS 0.3")["notifs"] == {}, "a notification came twice"
        # vLLM's shutdown.
        decode.agent.release_dlist_handle(decode.local)
        decode.agent.release_dlist_handle(remote)
        decode.agent.remove_remote_agent(name)
        decode.agent.deregister_memory(decode.reg)
        assert not decode.agent.check_remote_metadata(name)
    finally:
        decode.close()


def test_a_write_notification_comes_only_after_all_its_blocks(spawn_peer):
    """Push mode: the decode side writes into the prefill side; when the prefill side sees
    the notification, every block of the transfer is already in place."""
    peer = prefill(spawn_peer, "prefill-push")
    decode = Decode()
    try:
        name, remote = decode.add(peer)
        for kv in decode.layers:
            kv[:] = 0xAB
        ids = decode.desc_ids(np.arange(BLOCKS, dtype=np.int64))
        handle = decode.agent.make_prepped_xfer("WRITE", decode.local, ids, remote, ids,
                                                notif_msg=b"push-1:1", skip_desc_merge=True)
        decode.agent.transfer(handle)
        notifs = peer.cmd(f"NOTIFS {BOUND_S}")["notifs"]
        assert notifs == {decode.agent.name: ["push-1:1"]}
        digests = peer.cmd("DIGEST")["digests"]
        want = hashlib.sha256(bytes([0xAB]) * (BLOCKS * BLOCK)).hexdigest()
        assert digests == [want] * LAYERS
        assert decode.wait(handle) == "DONE"
        assert decode.agent.get_xfer_telemetry(handle).descCount == LAYERS * BLOCKS
        # A handle is posted again once done, with a new notification.
        assert decode.agent.transfer(handle, b"push-2:1") in ("PROC", "DONE")
        assert peer.cmd(f"NOTIFS {BOUND_S}")["notifs"] == {decode.agent.name: ["push-2:1"]}
        decode.wait(handle)
    finally:
        decode.close()


def test_a_stalled_peer_turns_proc_into_err_by_the_deadline(spawn_peer, monkeypatch):
    monkeypatch.setenv("RAILYARD_FABRIC", "tcp")
    peer = prefill(spawn_peer, "prefill-stalled", fabric="tcp")
    decode = Decode(nixl_agent_config(capture_telemetry=True, xfer_timeout_s=3.0))
    try:
        name, remote = decode.add(peer)
        ids = decode.desc_ids(np.arange(BLOCKS, dtype=np.int64))
        handle = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids,
                                                notif_msg=b"never")
        decode.agent.transfer(handle)
        assert decode.wait(handle) == "DONE"
        stop(peer)
        posted = time.monotonic()
        assert decode.agent.transfer(handle) == "PROC"
        with pytest.raises(nixlRepostActiveError):
            decode.agent.transfer(handle)
        with pytest.raises(nixlRepostActiveError):
            decode.agent.release_xfer_handle(handle)
        assert decode.wait(handle, bound_s=3.0 + 3.0) == "ERR"
        assert time.monotonic() - posted < 3.0 + 2.0
        # NIXL drops a peer it lost: vLLM and SGLang look for that and add it again.
        assert not decode.agent.check_remote_metadata(name)
        with pytest.raises(nixlNotFoundError):
            decode.agent.transfer(handle)
        decode.agent.release_xfer_handle(handle)
    finally:
        peer.resume()
        decode.close()


def test_a_killed_peer_turns_proc_into_err_and_its_successor_is_added_again(spawn_peer,
                                                                             monkeypatch):
    monkeypatch.setenv("RAILYARD_FABRIC", "tcp")
    peer = prefill(spawn_peer, "prefill-killed", fabric="tcp", listen_port=0)
    decode = Decode(nixl_agent_config(capture_telemetry=True, xfer_timeout_s=20.0))
    try:
        name, remote = decode.add(peer)
        ids = decode.desc_ids(np.arange(BLOCKS, dtype=np.int64))
        handle = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids)
        stop(peer)  # so that the post below is surely still in flight when it dies
        assert decode.agent.transfer(handle) == "PROC"
        killed = time.monotonic()
        peer.kill()
        assert decode.wait(handle) == "ERR"
        assert time.monotonic() - killed < 20.0, "failed by the peer's death, not the deadline"
        assert not decode.agent.check_remote_metadata(name)
        decode.agent.release_xfer_handle(handle)

        # Its successor takes the same address (a fixed listen port), as a restarted
        # process does: it is added again at once, not after a cooldown.
        port = int(peer.ready["session"].rsplit(":", 1)[1])
        successor = prefill(spawn_peer, "prefill-killed", fabric="tcp", listen_port=port)
        assert successor.ready["session"].endswith(f":{port}")
        added = time.monotonic()
        name, remote = decode.add(successor)
        assert time.monotonic() - added < 5.0
        assert decode.agent.check_remote_metadata(name)
        handle = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids)
        decode.agent.transfer(handle)
        assert decode.wait(handle) == "DONE"
        assert np.array_equal(decode.layers[2], prefill_bytes()[2])
    finally:
        decode.close()


@pytest.mark.parametrize("how", ["config", "environment"])
def test_a_transfer_slower_than_its_deadline_answers_err(spawn_peer, monkeypatch, how):
    """The peer is alive and answering; the transfer just takes longer than its deadline."""
    monkeypatch.setenv("RAILYARD_FABRIC", "tcp")
    peer = prefill(spawn_peer, "prefill-slow", fabric="tcp", layers=2, blocks=256,
                   block=256 << 10)
    if how == "config":
        config = nixl_agent_config(capture_telemetry=True, xfer_timeout_s=0.002)
    else:
        monkeypatch.setenv("RAILYARD_NIXL_XFER_TIMEOUT_S", "0.002")
        config = nixl_agent_config(capture_telemetry=True)
    decode = Decode(config, layers=2, blocks=256, block=256 << 10)
    try:
        name, remote = decode.add(peer)
        ids = decode.desc_ids(np.arange(256, dtype=np.int64))  # 128 MiB
        handle = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids,
                                                notif_msg=b"too-late:1", skip_desc_merge=True)
        posted = time.monotonic()
        decode.agent.transfer(handle)
        assert decode.wait(handle) == "ERR"
        assert time.monotonic() - posted < 3.0, "failed by its deadline, not later"
        # Its deadline, not the peer: the peer is still known and answers.
        assert decode.agent.check_remote_metadata(name)
        assert peer.cmd("NOTIFS 0.5")["notifs"] == {}, "a failed transfer notified"
        decode.agent.send_notif(name, b"still-here")
        assert peer.cmd(f"NOTIFS {BOUND_S}")["notifs"] == {decode.agent.name: ["still-here"]}
    finally:
        decode.close()


def test_a_peer_that_registers_its_memory_anew_is_prepared_anew(spawn_peer):
    """vLLM's sleep mode: the prefill side lets its KV caches go and registers them again;
    the decode side adds the new metadata and prepares its list again, which works at once."""
    peer = prefill(spawn_peer, "prefill-sleep")
    decode = Decode()
    try:
        name, remote = decode.add(peer)
        ids = decode.desc_ids(np.arange(8, dtype=np.int64))
        handle = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids)
        decode.agent.transfer(handle)
        assert decode.wait(handle) == "DONE"
        peer.ready["metadata"] = peer.cmd("REREG")["metadata"]
        decode.layers[1][:] = 0
        name, remote = decode.add(peer)
        fresh = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids)
        decode.agent.transfer(fresh)
        assert decode.wait(fresh) == "DONE"
        assert np.array_equal(decode.layers[1][: 8 * BLOCK], prefill_bytes()[1][: 8 * BLOCK])
        assert decode.agent.check_remote_metadata(name)
    finally:
        decode.close()


@pytest.mark.parametrize("listen", [False, True])
def test_notifications_keep_their_order_while_several_threads_look(listen):
    """vLLM's main thread asks check_remote_metadata while another thread takes
    notifications (and a listening agent has its own thread): each sender's messages still
    come in the order they were sent."""
    config = nixl_agent_config(True, listen, 0) if listen else nixl_agent_config()
    receiver = nixl_agent("receiver-order", config)
    sender = nixl_agent("sender-order")
    count = 3000
    try:
        name = sender.add_remote_agent(receiver.get_agent_metadata())
        receiver.add_remote_agent(sender.get_agent_metadata())
        done = threading.Event()

        def look() -> None:
            while not done.is_set():
                receiver.check_remote_metadata("sender-order")

        lookers = [threading.Thread(target=look) for _ in range(2)]
        for thread in lookers:
            thread.start()
        for i in range(count):
            sender.send_notif(name, str(i).encode())
        seen: list[int] = []
        deadline = time.monotonic() + BOUND_S * 3
        while len(seen) < count and time.monotonic() < deadline:
            for message in receiver.get_new_notifs().get("sender-order", []):
                seen.append(int(message))
        done.set()
        for thread in lookers:
            thread.join(timeout=BOUND_S)
        assert seen == list(range(count))
    finally:
        receiver.close()
        sender.close()


def test_registrations_inside_registrations_are_counted():
    agent = nixl_agent("nested-registrations")
    try:
        kv = np.zeros(1 << 16, dtype=np.uint8)
        base = kv.ctypes.data
        whole = agent.register_memory([(base, kv.nbytes, 0, "")], "DRAM")
        part = agent.register_memory([(base + 4096, 4096, 0, ""), (base + 4096, 4096, 0, "")],
                                     "DRAM")
        local = agent.prep_xfer_dlist("", [(base + 4096, 4096, 0)], "DRAM")
        agent.deregister_memory(whole)
        # The registrations inside keep the memory registered.
        agent.prep_xfer_dlist("", [(base + 4096, 4096, 0)], "DRAM")
        agent.deregister_memory(part)
        with pytest.raises(nixlNotFoundError, match="not registered"):
            agent.prep_xfer_dlist("", [(base + 4096, 4096, 0)], "DRAM")
        with pytest.raises(nixlNotFoundError, match="not registered"):
            agent.deregister_memory(part)
        assert local
        other = np.zeros(1 << 14, dtype=np.uint8)
        agent.register_memory([(other.ctypes.data + 4096, 4096, 0, "")], "DRAM")
        with pytest.raises(nixlBackendError, match="overlaps"):
            agent.register_memory([(other.ctypes.data, other.nbytes, 0, "")], "DRAM")
    finally:
        agent.close()


def test_bad_input_raises_nixl_errors_that_say_what_is_wrong():
    a = Decode(nixl_agent_config(capture_telemetry=False))
    b = Decode()
    try:
        agent = a.agent
        with pytest.raises(nixlInvalidParamError, match="VRAM.*GPUDirect") as raised:
            agent.get_reg_descs([(a.layers[0].ctypes.data, 4096, 0, "")], "VRAM")
        assert isinstance(raised.value, nixlNotSupportedError)
        with pytest.raises(nixlInvalidParamError, match="host memory"):
            agent.register_memory([(a.layers[0].ctypes.data, 4096, 0, "")], "cuda")
        with pytest.raises(KeyError):
            agent.get_xfer_descs([(1, 2, 0)], "V-RAM")
        assert agent.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None
        with pytest.raises(ValueError, match="Nx3"):
            agent.get_xfer_descs(np.zeros((4, 3), dtype=np.float32), "DRAM")
        with pytest.raises(TypeError, match="N×3"):
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.zeros((4, 2), dtype=np.uint64), "DRAM")
        with pytest.raises(ValueError, match="mem type"):
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.zeros((1, 5), dtype=np.uint64))

        with pytest.raises(nixlNotFoundError, match="nobody"):
            agent.prep_xfer_dlist("nobody", [(1, 4096, 0)], "DRAM")
        with pytest.raises(nixlNotFoundError, match="nobody"):
            agent.send_notif("nobody", b"hello")
        with pytest.raises(nixlNotFoundError, match="nobody"):
            agent.initialize_xfer("WRITE",
                                  agent.get_xfer_descs([(a.layers[0].ctypes.data, 64, 0)], "DRAM"),
                                  agent.get_xfer_descs([(1, 64, 0)], "DRAM"), "nobody")
        with pytest.raises(KeyError):
            agent.make_prepped_xfer("RD", a.local, [0], a.local, [0])
        with pytest.raises(nixlMismatchError):
            agent.add_remote_agent(b"not metadata")
        with pytest.raises(nixlInvalidParamError, match="own"):
            agent.add_remote_agent(agent.get_agent_metadata())
        unregistered = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(nixlNotFoundError, match="not registered"):
            agent.prep_xfer_dlist("", [(unregistered.ctypes.data, 4096, 0)], "DRAM")

        name = agent.add_remote_agent(b.agent.get_agent_metadata())
        rows = [(b.layers[0].ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
        remote = agent.prep_xfer_dlist(name, rows, "DRAM")
        with pytest.raises(nixlNotFoundError, match="not registered"):
            agent.prep_xfer_dlist(name, [(b.layers[0].ctypes.data - 4096, 4096, 0)], "DRAM")
        with pytest.raises(nixlInvalidParamError, match="outside its list of 64"):
            agent.make_prepped_xfer("WRITE", a.local, [0, 1], remote, [0, 64])
        with pytest.raises(nixlInvalidParamError, match="2 local indices but 1"):
            agent.make_prepped_xfer("WRITE", a.local, [0, 1], remote, [0])
        with pytest.raises(nixlInvalidParamError, match="negative"):
            agent.make_prepped_xfer("WRITE", a.local, np.array([-1]), remote, [0])
        with pytest.raises(nixlInvalidParamError, match="no descriptors"):
            agent.make_prepped_xfer("WRITE", a.local, [], remote, [])
        with pytest.raises(ValueError, match="1D"):
            agent.make_prepped_xfer("WRITE", a.local, np.zeros((2, 2), np.int64), remote, [0])
        half = agent.prep_xfer_dlist("", [(a.layers[0].ctypes.data, BLOCK // 2, 0)], "DRAM")
        with pytest.raises(nixlInvalidParamError, match="8192 bytes, the remote one 16384"):
            agent.make_prepped_xfer("WRITE", half, [0], remote, [0])
        with pytest.raises(nixlInvalidParamError, match="local side"):
            agent.make_prepped_xfer("WRITE", remote, [0], remote, [0])

        handle = agent.make_prepped_xfer("WRITE", a.local, [0], remote, [0])
        with pytest.raises(nixlNotPostedError):
            agent.check_xfer_state(handle)
        agent.transfer(handle)
        assert a.wait(handle) == "DONE"
        with pytest.raises(nixlNoTelemetryError):
            agent.get_xfer_telemetry(handle)
        agent.release_xfer_handle(handle)
        agent.release_xfer_handle(handle)  # twice is harmless
        with pytest.raises(nixlInvalidParamError, match="released"):
            agent.transfer(handle)
        with pytest.raises(nixlInvalidParamError, match="released"):
            agent.check_xfer_state(handle)
        agent.release_dlist_handle(remote)
        with pytest.raises(nixlInvalidParamError, match="released"):
            agent.make_prepped_xfer("WRITE", a.local, [0], remote, [0])
        # Removing the agent makes its lists stale; unknown names are ignored.
        fresh = agent.prep_xfer_dlist(name, rows, "DRAM")
        agent.remove_remote_agent(name)
        agent.remove_remote_agent("nobody")
        with pytest.raises(nixlNotFoundError, match="removed"):
            agent.make_prepped_xfer("WRITE", a.local, [0], fresh, [0])
        with pytest.raises(nixlInvalidParamError):
            agent.send_local_metadata()
        assert agent.check_remote_metadata(b"nobody") is False
    finally:
        a.close()
        b.close()


def test_the_worker_and_handshake_threads_share_one_agent(spawn_peer):
    """vLLM's handshake thread adds agents and prepares their lists while its worker thread
    posts and polls transfers and takes notifications, on one agent at once."""
    first = prefill(spawn_peer, "prefill-threads-1")
    second = prefill(spawn_peer, "prefill-threads-2", blocks=16)
    decode = Decode()
    errors: list[BaseException] = []
    stop = threading.Event()
    name, remote = decode.add(first)
    source = prefill_bytes()

    rounds = [0]

    def handshakes() -> None:
        try:
            rows = [(base + b * BLOCK, BLOCK, 0)
                    for base, _ in second.ready["layers"] for b in range(16)]
            metadata = bytes.fromhex(second.ready["metadata"])
            while not stop.is_set():
                other = decode.agent.add_remote_agent(metadata)
                handle = decode.agent.prep_xfer_dlist(other, rows, "DRAM")
                decode.agent.get_agent_metadata()
                assert decode.agent.check_remote_metadata(other)
                decode.agent.release_dlist_handle(handle)
                # vLLM drops an engine it gave up on while the worker goes on with others.
                decode.agent.remove_remote_agent(other)
                rounds[0] += 1
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=handshakes)
    thread.start()
    try:
        rng = np.random.default_rng(11)
        for round in range(40):
            blocks = rng.choice(BLOCKS, 8, replace=False).astype(np.int64)
            ids = decode.desc_ids(blocks)
            handle = decode.agent.make_prepped_xfer("READ", decode.local, ids, remote, ids,
                                                    notif_msg=f"r{round}:1".encode())
            decode.agent.transfer(handle)
            assert decode.wait(handle) == "DONE", f"round {round}"
            decode.agent.get_xfer_telemetry(handle)
            decode.agent.release_xfer_handle(handle)
            decode.agent.get_new_notifs()
            for layer in (0, LAYERS - 1):
                for block in blocks:
                    span = slice(block * BLOCK, (block + 1) * BLOCK)
                    assert np.array_equal(decode.layers[layer][span], source[layer][span])
    finally:
        stop.set()
        thread.join(timeout=BOUND_S)
        decode.close()
    assert not thread.is_alive()
    assert not errors, errors
    assert rounds[0] > 1, "the handshake thread hardly ran beside the worker"
    seen = []
    deadline = time.monotonic() + BOUND_S
    while len(seen) < 40 and time.monotonic() < deadline:
        seen += first.cmd("NOTIFS 1")["notifs"].get(decode.agent.name, [])
    assert sorted(seen) == sorted(f"r{i}:1" for i in range(40))


def test_metadata_goes_over_the_listener():
    """NIXL's socket exchange (basic_two_peers.py): fetch, send, check, invalidate."""
    target = nixl_agent("target", nixl_agent_config(True, True, 0))
    initiator = nixl_agent("initiator", nixl_agent_config(True, True, 0))
    try:
        kv = np.zeros(1 << 16, dtype=np.uint8)
        target.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
        host, port = target.session_id.rsplit(":", 1)
        initiator.fetch_remote_metadata("target", host, int(port))
        assert initiator.check_remote_metadata("target")
        descs = initiator.get_xfer_descs([(kv.ctypes.data, 4096, 0)], "DRAM")
        assert initiator.check_remote_metadata("target", descs)
        outside = initiator.get_xfer_descs([(kv.ctypes.data + kv.nbytes, 4096, 0)], "DRAM")
        assert not initiator.check_remote_metadata("target", outside)

        initiator.send_local_metadata(host, int(port))
        deadline = time.monotonic() + BOUND_S
        while not target.check_remote_metadata("initiator"):
            assert time.monotonic() < deadline, "the listener never loaded the metadata"
            time.sleep(0.01)
        target.send_notif("initiator", b"descs")
        deadline = time.monotonic() + BOUND_S
        while not (notifs := initiator.get_new_notifs()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert notifs == {"target": [b"descs"]}, "metadata messages never reach the caller"

        initiator.invalidate_local_metadata(host, int(port))
        deadline = time.monotonic() + BOUND_S
        while target.check_remote_metadata("initiator"):
            assert time.monotonic() < deadline, "the listener never dropped the agent"
            time.sleep(0.01)
    finally:
        target.close()
        initiator.close()


EXITING = """
import time
from railyard.compat.nixl import nixl_agent, nixl_agent_config


class SlowToGo:
    # Destroyed while the interpreter finalizes, after the atexit hooks: a window in which a
    # thread still inside the engine would come back into Python and be cut off there.
    def __del__(self):
        time.sleep(0.5)


agent = nixl_agent("exiting", nixl_agent_config(True, True, 0))
slow = SlowToGo()
"""


def test_a_process_with_a_listening_agent_exits_cleanly(tmp_path):
    """The listen thread is stopped at exit: a daemon thread that returns from the engine
    while the interpreter finalizes is ended mid-call, and the process aborts."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", EXITING], cwd=tmp_path, timeout=60,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert not list(tmp_path.iterdir()), "a crash report was written"


def test_install_makes_nixl_imports_resolve_to_railyard():
    import nixl._api
    import nixl._bindings

    assert nixl._api.nixl_agent is shim.nixl_agent
    assert nixl._bindings.nixlXferTelemetry is shim.nixlXferTelemetry
    assert importlib.util.find_spec("nixl") is not None
    assert sys.modules["nixl"].nixl_agent is shim.nixl_agent
    assert nixl._bindings.NIXL_INIT_AGENT == ""
    for error in ("nixlBackendError", "nixlRemoteDisconnectError", "nixlCancelledError"):
        assert issubclass(getattr(nixl._bindings, error), Exception)
    assert shim.install() is not None  # idempotent
    # vLLM's import guard and its telemetry type.
    from nixl._api import nixl_agent as NixlWrapper  # noqa: N813
    assert NixlWrapper is shim.nixl_agent
    telemetry = nixlXferTelemetry()
    assert telemetry.totalBytes == 0
    with pytest.raises(AttributeError):
        telemetry.totalBytes = 5  # type: ignore[misc]
    config = nixl_agent_config(backends=["UCX"], capture_telemetry=True)
    assert (config.backends, config.capture_telemetry, config.enable_listen) == (["UCX"], True, False)
    with pytest.raises(TypeError, match="sync_mode"):
        nixl_agent_config(sync_mode=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        nixl_agent("")


def test_strided_lists_expand_as_nixl_does():
    decode = Decode()
    try:
        base = decode.layers[0].ctypes.data
        table = np.array([[base, 1024, 0, 4096, 4], [base + 1024, 512, 0, 8192, 2]],
                         dtype=np.uint64)
        expanded = _strided(table)
        assert [expanded[i] for i in range(expanded.descCount())] == [
            (base, 1024, 0), (base + 4096, 1024, 0), (base + 8192, 1024, 0),
            (base + 12288, 1024, 0), (base + 1024, 512, 0), (base + 9216, 512, 0)]
        handle = decode.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem_type="DRAM")
        assert handle._count == 6
    finally:
        decode.close()


def test_vllm_strided_lists_move_the_right_blocks(spawn_peer):
    """vLLM >= 0.33 prepares both sides as N×5 strided arrays (one row per layer:
    address, block length, device, stride, count) and indexes the expanded blocks."""
    peer = prefill(spawn_peer, "prefill-strided")
    decode = Decode()
    try:
        name = decode.agent.add_remote_agent(bytes.fromhex(peer.ready["metadata"]))
        local_rows = np.array([[kv.ctypes.data, BLOCK, 0, BLOCK, BLOCKS] for kv in decode.layers],
                              dtype=np.uint64)
        remote_rows = np.array([[base, BLOCK, 0, BLOCK, BLOCKS] for base, _ in peer.ready["layers"]],
                               dtype=np.uint64)
        local = decode.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, mem_type="DRAM")
        remote = decode.agent.prep_xfer_dlist(name, remote_rows, "DRAM")
        local_blocks = np.array([5, 17, 40], dtype=np.int32)
        remote_blocks = np.array([60, 2, 33], dtype=np.int32)
        handle = decode.agent.make_prepped_xfer("READ", local, decode.desc_ids(local_blocks),
                                                remote, decode.desc_ids(remote_blocks))
        decode.agent.transfer(handle)
        assert decode.wait(handle) == "DONE"
        source = prefill_bytes()
        for layer in range(LAYERS):
            for here, there in zip(local_blocks, remote_blocks):
                got = decode.layers[layer][here * BLOCK:(here + 1) * BLOCK]
                assert np.array_equal(got, source[layer][there * BLOCK:(there + 1) * BLOCK])
    finally:
        decode.close()


def test_docs_nixl_example_runs():
    page = (HERE.parents[1] / "docs" / "python.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```python\n")[1:]]
    (example,) = [b for b in blocks if "nixl.install()" in b]
    out = subprocess.run([sys.executable, "-c", example], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "2"


# -- throughput of prepared transfers beside `railyard bench` (printed, not asserted) -----

BENCH_BLOCKS, BENCH_BLOCK = 1024, 64 << 10
SECONDS = float(os.environ.get("RAILYARD_TEST_THROUGHPUT_S", "2"))


def test_prepped_transfers_beside_railyard_bench(spawn_peer, capsys):
    from test_throughput import _bench_gbps_of  # noqa: PLC0415

    peer = prefill(spawn_peer, "prefill-bench", layers=1, blocks=BENCH_BLOCKS, block=BENCH_BLOCK)
    decode = Decode(layers=1, blocks=BENCH_BLOCKS, block=BENCH_BLOCK)
    try:
        name, remote = decode.add(peer)
        rng = np.random.default_rng(5)
        local_ids = np.arange(BENCH_BLOCKS, dtype=np.int64)
        handles = [
            decode.agent.make_prepped_xfer("WRITE", decode.local, local_ids, remote,
                                           rng.permutation(BENCH_BLOCKS))
            for _ in range(8)
        ]
        decode.agent.transfer(handles[0])
        decode.wait(handles[0])
        moved = 0
        started = time.perf_counter()
        while time.perf_counter() - started < SECONDS:
            handle = handles[moved % len(handles)]
            decode.agent.transfer(handle)
            assert decode.wait(handle) == "DONE"
            moved += 1
        elapsed = time.perf_counter() - started
    finally:
        decode.close()
    python_gbps = moved * BENCH_BLOCKS * BENCH_BLOCK / elapsed / 1e9
    bench_gbps = _bench_gbps_of(BENCH_BLOCKS)
    with capsys.disabled():
        line = (f"\nNIXL make_prepped_xfer + transfer, {BENCH_BLOCKS} x 64 KiB: "
                f"{python_gbps:.2f} GB/s")
        if bench_gbps:
            line += f", railyard bench {bench_gbps:.2f} GB/s ({python_gbps / bench_gbps:.0%})"
        print(line)
    assert python_gbps > 0
