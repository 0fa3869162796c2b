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

    def __init__(self, *args: str) -> None:
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), *args],
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
        self.session: str = ready["session"]
        self.name: str = ready["name"]
        self.bufs: list[tuple[int, int]] = [tuple(b) for b in ready["bufs"]]

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

    def spawn(*args: str) -> Peer:
        peer = Peer(*args)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.close()
