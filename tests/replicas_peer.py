"""A replica peer in its own process, for tests that SIGKILL one side mid-transfer.

    python replicas_peer.py serve <store dir> <run id> <rank>
        prints "port <n>" once listening, serves until killed
    python replicas_peer.py push <port> <run id> <rank> <step> <data bytes> <rate B/s>
        pushes a replica of deterministic bytes (seed = step), prints "pushed" or "error"

The job's secret comes from the environment (REPLICA_SECRET, hex).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types

# The replica modules need neither torch nor the package facade; importing the facade
# (torch) takes seconds to tens of seconds on a loaded machine, so this peer registers
# the package without running its __init__ and imports only what it uses.
_spec = importlib.util.find_spec("resumable")
assert _spec is not None and _spec.submodule_search_locations is not None
_pkg = types.ModuleType("resumable")
_pkg.__path__ = list(_spec.submodule_search_locations)
sys.modules.setdefault("resumable", _pkg)

from resumable.errors import ReplicaError  # noqa: E402
from resumable.replicas.store import ReplicaStore  # noqa: E402
from resumable.replicas.transport import ReplicaClient, ReplicaServer  # noqa: E402


def payload(step: int, size: int) -> tuple[bytes, bytes]:
    meta = b'{"tree": {"step": %d}, "layout": []}' % step
    block = bytes((step * 31 + i) % 251 for i in range(4096))
    data = (block * (size // len(block) + 1))[:size]
    return meta, data


def main(argv: list[str]) -> int:
    secret = bytes.fromhex(os.environ["REPLICA_SECRET"])
    if argv[0] == "serve":
        store = ReplicaStore(argv[1], argv[2])
        server = ReplicaServer(store, secret=secret, rank=int(argv[3]))
        print(f"port {server.start()[1]}", flush=True)
        while True:
            time.sleep(1)
    if argv[0] == "push":
        port, run_id, rank, step, size, rate = argv[1:7]
        meta, data = payload(int(step), int(size))
        client = ReplicaClient(
            ("127.0.0.1", int(port)),
            secret=secret,
            run_id=run_id,
            rank=int(rank),
            rate=float(rate),
        )
        print("pushing", flush=True)
        try:
            with client:
                client.push(int(step), meta, data)
        except ReplicaError as exc:
            print(f"error {exc.reason}: {exc}", flush=True)
            return 1
        print("pushed", flush=True)
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
