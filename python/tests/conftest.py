"""Shared helpers: a second Python process (peer_process.py) driven over stdin/stdout lines,
every wait bounded."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peer_process.py"

# The fabric between the two processes: "auto" picks the soft fabric on one host.
FABRIC = os.environ.get("RAILYARD_TEST_FABRIC", "auto")
# How long a peer may take to start or to answer one command.
REPLY_TIMEOUT_S = 20.0


class Peer:
    """A peer process; ``cmd()`` sends one line and returns its JSON reply."""

    def __init__(self, *args: str, script: Path = PEER_SCRIPT, env: dict | None = None) -> None:
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self._reply(REPLY_TIMEOUT_S)
        if "error" in ready:
            raise RuntimeError(f"peer failed to start: {ready['error']}\n{self.stderr()}")
        self.ready = ready
        self.session: str = ready.get("session", "")
        self.name: str = ready.get("name", "")
        self.bufs: list[tuple[int, int]] = [tuple(b) for b in ready.get("bufs", [])]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def _reply(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"peer did not answer in {timeout_s} s\n{self.stderr()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(
                    f"peer exited (status {self.proc.poll()}) without answering\n{self.stderr()}"
                )
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
            # anything else on stdout (a stray print) is not a reply

    def cmd(self, line: str, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the process stops where it is (inside a copy, say) and answers nothing."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.resume()  # a paused peer would answer nothing
        if self.proc.poll() is None:
            try:
                self.cmd("QUIT", timeout_s=5)
            except Exception:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._stderr.close()


@pytest.fixture
def spawn_peer():
    """``spawn_peer(*args)`` starts a peer; every peer is stopped after the test."""
    peers: list[Peer] = []

    def spawn(*args: str, **kwargs) -> Peer:
        peer = Peer(*args, **kwargs)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.close()


# -- a store cluster: `railyard master` and `railyard store serve` processes ---------------

RAILYARD = Path(
    os.environ.get("CARGO_TARGET_DIR", HERE.parents[1] / "target")
) / "release" / "railyard"
# How long a store process may take to print its first line.
START_TIMEOUT_S = 30.0


class _Process:
    """A `railyard` child whose first stdout line says where it listens; stdin open until
    stopped (it exits when stdin closes)."""

    def __init__(self, *args: str) -> None:
        if not RAILYARD.exists():
            raise RuntimeError(f"{RAILYARD} missing: `cargo build --release --bin railyard`")
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [str(RAILYARD), *args, "--until-stdin-closes"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            first = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            first = None
        if not first or not first.startswith("listening "):
            self.kill()
            raise RuntimeError(f"railyard {args[0]} did not start: {first!r}\n{self.stderr()}")
        self.addr = first.split()[1]

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL: gone at once, as a crashed process."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Closes stdin: it exits cleanly (a segment server unmounts first)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except Exception:
                self.kill()
        self._stderr.close()


class StoreCluster:
    """A master and segment servers (TCP fabric), each its own process."""

    def __init__(self, servers: int, segment: str = "64MiB") -> None:
        self.master = _Process("master", "--listen", "127.0.0.1:0", "--lease-ttl", "1s")
        self.addr = self.master.addr
        self.servers: list[_Process] = []
        for _ in range(servers):
            self.add_server(segment)

    def add_server(self, segment: str = "64MiB") -> _Process:
        server = _Process(
            "store", "serve", "--master", self.addr, "--fabric", "tcp", "--segment", segment
        )
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.master.stop()


@pytest.fixture(scope="module")
def store_cluster():
    """A master and two 64 MiB segment servers for the tests of one module."""
    cluster = StoreCluster(servers=2)
    yield cluster
    cluster.stop()
