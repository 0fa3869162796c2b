"""Python-side throughput of Engine.write beside `railyard bench` (printed, not asserted):
64 KiB blocks, 64 per batch, to random slots of a peer in another process.

Run with `pytest -s python/tests/test_throughput.py` to see the numbers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

import railyard

from conftest import FABRIC

BLOCK = 64 << 10
BATCH = 64
POOL_BLOCKS = 1024  # 64 MiB at the peer
SECONDS = float(os.environ.get("RAILYARD_TEST_THROUGHPUT_S", "2"))
# Where `make python-test` built it: cargo's target directory (CARGO_TARGET_DIR if set).
BENCH = (
    Path(os.environ.get("CARGO_TARGET_DIR") or Path(__file__).resolve().parents[2] / "target")
    / "release"
    / "railyard"
)


def _python_gbps(spawn_peer) -> float:
    peer = spawn_peer("--mode", "native", "--size", str(POOL_BLOCKS * BLOCK), "--fabric", FABRIC)
    remote_base, _ = peer.bufs[0]
    src = np.random.default_rng(1).integers(0, 256, size=BATCH * BLOCK, dtype=np.uint8)
    rng = np.random.default_rng(2)
    with railyard.Engine(listen="127.0.0.1:0", fabric=FABRIC) as engine:
        engine.register(src.ctypes.data, src.nbytes)
        local = src.ctypes.data + np.arange(BATCH, dtype=np.uint64) * BLOCK
        lengths = np.full(BATCH, BLOCK, dtype=np.uint64)
        slots = [
            remote_base
            + rng.choice(POOL_BLOCKS, size=BATCH, replace=False).astype(np.uint64) * BLOCK
            for _ in range(64)
        ]
        engine.write(peer.session, local, slots[0], lengths)  # connect and warm up
        requests = 0
        started = time.perf_counter()
        deadline = started + SECONDS
        while time.perf_counter() < deadline:
            engine.write(peer.session, local, slots[requests % len(slots)], lengths)
            requests += 1
        elapsed = time.perf_counter() - started
    return requests * BATCH * BLOCK / elapsed / 1e9


def _bench_gbps() -> float | None:
    return _bench_gbps_of(BATCH)


def _bench_gbps_of(batch: int) -> float | None:
    """`railyard bench` of `batch` blocks of 64 KiB per request, GB/s (None if it cannot
    run)."""
    binary = os.environ.get("RAILYARD_BENCH", str(BENCH))
    if not (Path(binary).is_file() or shutil.which(binary)):
        print(f"railyard bench: {binary} missing (build it with `cargo build --release`)")
        return None
    try:
        out = subprocess.run(
            [
                binary,
                "bench",
                "--block-size",
                "64KiB",
                "--batch",
                str(batch),
                "--fabric",
                FABRIC,
                "--duration",
                str(SECONDS),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=SECONDS + 60,
            check=True,
        ).stdout
        return float(json.loads(out.strip().splitlines()[-1])["gbps"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as err:
        print(f"railyard bench failed, no comparison: {err}")
        return None


def test_write_throughput_beside_railyard_bench(spawn_peer, capsys):
    python_gbps = _python_gbps(spawn_peer)
    bench_gbps = _bench_gbps()
    with capsys.disabled():
        line = (
            f"\nthroughput ({FABRIC}, 64 KiB x {BATCH}, 1 thread): "
            f"Engine.write from Python {python_gbps:.2f} GB/s"
        )
        if bench_gbps:
            line += f", railyard bench {bench_gbps:.2f} GB/s ({python_gbps / bench_gbps:.0%})"
        print(line)
    assert python_gbps > 0
