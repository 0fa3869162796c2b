"""The other process of the two-process tests (run by conftest.Peer, not by pytest).

It opens an engine (native ``railyard.Engine`` or the Mooncake shim), registers NumPy
buffers, prints one ``READY`` line as JSON and then answers one-line commands from stdin,
one JSON reply line each, until ``QUIT`` or EOF:

    READY {"session": "host:port", "name": ..., "bufs": [[addr, nbytes], ...]}
    FILL <seed>                  -> {"ok": true}       random bytes into every buffer
    ZERO                         -> {"ok": true}
    DIGEST                       -> {"digests": [sha256 hex per buffer]}
    WAIT_NOTIFS <timeout_s>      -> {"notifs": {sender: [hex, ...]}}   (native)
    NOTIFIES <timeout_s>         -> {"notifies": [[name, msg], ...]}   (shim, polls)
    NOTIFY <session> <hex>       -> {"ok": true} or {"error": "..."}   (native)
    HAMMER <session> <addr> <len> -> {"ok": true}   (native) reads the peer's range into the
                                    first buffer over and over, several batches in flight,
                                    until CALM (failures are counted, never stop it)
    CALM                         -> {"reads": n, "failures": m}
    QUIT                         -> exits 0

Usage: peer_process.py --mode native|mooncake --bufs N --size BYTES
       [--fabric auto] [--protocol tcp] [--name NAME] [--managed]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import threading
import time

import numpy as np


class Hammer:
    """Threads reading one remote range into ``local`` over and over (HAMMER/CALM): a peer
    that is nearly always inside a copy of that range, for tests that stop it there."""

    THREADS = 2
    IN_FLIGHT = 4

    def __init__(self, engine, session: str, local: int, remote: int, length: int) -> None:
        self.stop = threading.Event()
        self.reads = 0
        self.failures = 0
        self._lock = threading.Lock()
        args = (engine, session, local, remote, length)
        self.threads = [
            threading.Thread(target=self._run, args=args, daemon=True) for _ in range(self.THREADS)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, engine, session: str, local: int, remote: int, length: int) -> None:
        while not self.stop.is_set():
            reads = failures = 0
            try:
                batches = [
                    engine.submit(session, "read", [local], [remote], [length], timeout_s=10)
                    for _ in range(self.IN_FLIGHT)
                ]
                for batch in batches:
                    if batch.wait(15) == "DONE":
                        reads += 1
                    else:
                        failures += 1
            except Exception:  # refused: the range was withdrawn, say
                failures += 1
                time.sleep(0.01)
            with self._lock:
                self.reads += reads
                self.failures += failures

    def calm(self) -> dict:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        return {"reads": self.reads, "failures": self.failures}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["native", "mooncake"], default="native")
    parser.add_argument("--bufs", type=int, default=1)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--fabric", default="auto")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--name", default=None)
    parser.add_argument(
        "--managed",
        action="store_true",
        help="mooncake mode: the buffers come from allocate_managed_buffer, nothing else",
    )
    args = parser.parse_args()

    bufs = [np.zeros(args.size, dtype=np.uint8) for _ in range(args.bufs)]
    addrs = [int(b.ctypes.data) for b in bufs]
    lens = [int(b.nbytes) for b in bufs]

    if args.mode == "native":
        import railyard

        engine = railyard.Engine(args.name, listen="127.0.0.1:0", fabric=args.fabric)
        engine.register(addrs, lens)
        session, name = engine.session_id, engine.name
    else:
        from railyard.compat.mooncake import TransferEngine

        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "") != 0:
            print(json.dumps({"error": "initialize failed"}), flush=True)
            return 1
        if args.managed:
            # Mooncake's basic usage: the target only allocates managed buffers.
            addrs = [engine.allocate_managed_buffer(args.size) for _ in bufs]
            bufs = [
                np.ctypeslib.as_array((ctypes.c_uint8 * args.size).from_address(addr))
                for addr in addrs
            ]
        elif engine.batch_register_memory(addrs, lens) != 0:
            print(json.dumps({"error": "batch_register_memory failed"}), flush=True)
            return 1
        session, name = f"127.0.0.1:{engine.get_rpc_port()}", engine.engine.name

    print(
        json.dumps({"session": session, "name": name, "bufs": list(zip(addrs, lens))}), flush=True
    )

    hammer: Hammer | None = None
    for line in sys.stdin:
        cmd, *rest = line.split()
        try:
            if cmd == "QUIT":
                break
            if cmd == "FILL":
                rng = np.random.default_rng(int(rest[0]))
                for b in bufs:
                    b[:] = rng.integers(0, 256, size=b.size, dtype=np.uint8)
                reply: dict = {"ok": True}
            elif cmd == "ZERO":
                for b in bufs:
                    b[:] = 0
                reply = {"ok": True}
            elif cmd == "DIGEST":
                reply = {"digests": [hashlib.sha256(b.tobytes()).hexdigest() for b in bufs]}
            elif cmd == "WAIT_NOTIFS":
                got = engine.wait_notifs(float(rest[0]))
                reply = {"notifs": {k: [bytes(m).hex() for m in v] for k, v in got.items()}}
            elif cmd == "NOTIFIES":
                deadline = time.monotonic() + float(rest[0])
                notifies = engine.get_notifies()
                while not notifies and time.monotonic() < deadline:
                    time.sleep(0.01)
                    notifies = engine.get_notifies()
                reply = {"notifies": [[n.name, n.msg] for n in notifies]}
            elif cmd == "NOTIFY":
                engine.notify(rest[0], bytes.fromhex(rest[1]))
                reply = {"ok": True}
            elif cmd == "HAMMER":
                if hammer is not None:
                    hammer.calm()
                remote, length = int(rest[1]), int(rest[2])
                if length > lens[0]:
                    raise ValueError(f"{length} bytes do not fit the first buffer")
                hammer = Hammer(engine, rest[0], addrs[0], remote, length)
                reply = {"ok": True}
            elif cmd == "CALM":
                reply = hammer.calm() if hammer is not None else {"reads": 0, "failures": 0}
                hammer = None
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as err:  # reported to the test, which decides
            reply = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(reply), flush=True)

    if hammer is not None:
        hammer.calm()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
