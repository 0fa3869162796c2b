"""A store member in a process of its own (run by the tests, not by pytest).

It sets up ``MooncakeDistributedStore`` (the Mooncake shim) with a segment, prints one
``READY`` line as JSON and answers one-line commands from stdin, one JSON line each:

    READY {"hostname": "host:port"}
    PUT <key> <hex> [replicas]   -> {"ret": int}
    GET <key>                    -> {"hex": "..."}   ("" on a miss)
    QUIT                         -> exits 0 (closing the store)

Usage: store_member.py <master> <local_hostname> <segment size>
"""

from __future__ import annotations

import json
import sys

from railyard.compat.mooncake_store import MooncakeDistributedStore, ReplicateConfig


def main() -> int:
    master, hostname, segment = sys.argv[1], sys.argv[2], sys.argv[3]
    store = MooncakeDistributedStore()
    ret = store.setup(
        {
            "local_hostname": hostname,
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": segment,
            "local_buffer_size": "16MB",
            "protocol": "tcp",
            "master_server_addr": master,
        }
    )
    if ret != 0:
        print(json.dumps({"error": ret}), flush=True)
        return 1
    print(json.dumps({"hostname": store.get_hostname()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "QUIT":
            break
        if words[0] == "PUT":
            config = ReplicateConfig()
            config.replica_num = int(words[3]) if len(words) > 3 else 1
            reply = {"ret": store.put(words[1], bytes.fromhex(words[2]), config)}
        elif words[0] == "GET":
            reply = {"hex": store.get(words[1]).hex()}
        else:
            reply = {"error": f"unknown command {words[0]}"}
        print(json.dumps(reply), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
