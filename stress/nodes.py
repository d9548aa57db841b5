"""Simulated nodes on one machine: a ``torchrun`` launcher per node, and its kill.

A node is one ``torchrun --nnodes=N --node-rank=K`` launcher on 127.0.0.1 with its own
shared-memory directory (`stress.nodekill`, ``tests/test_replicas_job.py``, the
replicas benchmark). torchrun starts each worker in a session of its own, so killing a
node means killing the launcher and every process under it, found through ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            found.append(k)
            todo.append(k)
    return found


def kill_node(proc: subprocess.Popen[str]) -> str:
    """SIGKILL a node, its launcher ``proc`` (started in a session of its own) and every
    process under it; returns the launcher's output."""
    pids = descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        out, _ = proc.communicate()
    except ValueError:  # its output was read already (it had ended): nothing left to read
        proc.wait()
        return ""
    return out or ""
