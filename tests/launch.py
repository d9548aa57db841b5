"""Launching jobs under ``torchrun`` from the tests: the command, and a run to its end.

Every launch runs in a session of its own (``start_new_session``), so that a timeout
kills torchrun, its ranks and their persist workers together, and with
``OMP_NUM_THREADS=1`` (two ranks on two cores) and this checkout's ``src`` first on the
path unless the caller's ``env`` says otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun_cmd(
    nproc: int, script: Path, *args: Any, restarts: int = 0, port: int | None = None
) -> list[str]:
    """``torchrun`` of ``script`` on ``nproc`` local ranks: ``--standalone`` (a free
    rendezvous port of its own), or ``port`` as the master port."""
    where = (
        ["--standalone"] if port is None else ["--master-addr=127.0.0.1", f"--master-port={port}"]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        str(script),
        *(str(a) for a in args),
    ]


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
        **(env or {}),
    }


def start(cmd: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``cmd`` started in a session of its own, stdout and stderr together, as text."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(env),
        start_new_session=True,
    )


def run(
    cmd: list[str], *, env: Mapping[str, str] | None = None, timeout: float = 240.0
) -> tuple[int, str]:
    """Run ``cmd`` to its end: its exit code and output. Over ``timeout`` seconds, the
    whole session is SIGKILLed and the test fails."""
    proc = start(cmd, env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran over {timeout} s:\n{output[-4000:]}")
    return proc.returncode, output


def kill_session(pid: int) -> None:
    """SIGKILL the session led by ``pid`` (torchrun, its ranks, their workers)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
