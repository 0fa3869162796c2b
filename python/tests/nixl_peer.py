"""The prefill side of the NIXL tests (run by test_nixl.py, not by pytest), written only
against NIXL's Python API as vLLM's NixlConnector calls it: ``railyard.compat.nixl.install()``
first, then nothing but ``nixl._api`` and ``nixl._bindings``.

It registers one KV tensor per layer (filled from ``--seed``), prepares its local block
list, prints one JSON line (its name, its agent metadata in hex — the test's side channel
— and its layers)
and answers one-line commands on stdin with one JSON line each:

    NOTIFS <timeout_s>   -> {"notifs": {agent: [text, ...]}}  (waits until at least one)
    ADD <metadata hex>   -> {"name": agent name}                (add_remote_agent)
    REREG                -> {"metadata": hex}   deregister and register the layers again
    HAS <agent>          -> {"known": bool}                     (check_remote_metadata)
    DIGEST               -> {"digests": [sha256 hex per layer]}
    QUIT                 -> exits 0

Usage: nixl_peer.py --name NAME --layers L --blocks B --block-bytes N [--seed S]
       [--listen-port P]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from railyard.compat import nixl as shim

shim.install()

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--listen-port", type=int, default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    layers = [
        rng.integers(0, 256, size=args.blocks * args.block_bytes, dtype=np.uint8)
        for _ in range(args.layers)
    ]
    if args.listen_port is None:
        config = nixl_agent_config(num_threads=4, capture_telemetry=True)
    else:
        config = nixl_agent_config(True, True, args.listen_port, capture_telemetry=True)
    agent = nixl_agent(args.name, config)
    caches_data = [(kv.ctypes.data, kv.nbytes, 0, "") for kv in layers]
    descs = agent.get_reg_descs(caches_data, "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    blocks_data = [
        (kv.ctypes.data + block * args.block_bytes, args.block_bytes, 0)
        for kv in layers
        for block in range(args.blocks)
    ]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks_data, "DRAM"))
    assert local
    print(
        json.dumps(
            {
                "name": agent.name,
                "metadata": agent.get_agent_metadata().hex(),
                "layers": [[kv.ctypes.data, kv.nbytes] for kv in layers],
                "session": getattr(agent, "session_id", ""),
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        command = words[0]
        if command == "NOTIFS":
            deadline = time.monotonic() + float(words[1])
            seen: dict[str, list[str]] = {}
            while time.monotonic() < deadline:
                for sender, messages in agent.get_new_notifs().items():
                    seen.setdefault(sender, []).extend(m.decode() for m in messages)
                if seen:
                    break
                time.sleep(0.005)
            reply: dict = {"notifs": seen}
        elif command == "ADD":
            reply = {"name": agent.add_remote_agent(bytes.fromhex(words[1])).decode()}
        elif command == "REREG":
            # vLLM's sleep mode: the KV caches let go and registered again, same ranges.
            agent.deregister_memory(descs)
            agent.register_memory(descs, backends=["UCX"])
            reply = {"metadata": agent.get_agent_metadata().hex()}
        elif command == "HAS":
            reply = {"known": agent.check_remote_metadata(words[1])}
        elif command == "DIGEST":
            reply = {"digests": [hashlib.sha256(kv.tobytes()).hexdigest() for kv in layers]}
        elif command == "QUIT":
            print(json.dumps({"ok": True}), flush=True)
            return
        else:
            reply = {"error": f"unknown command {command}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
