"""A persist worker whose trainer died ends at once, whatever it was doing, so it never
holds the trainer's stderr (``python train.py 2>&1 | tee log`` ends with the trainer).

The trainer is a real script run with ``persist="process"`` and its stdout and stderr on
one pipe; it SIGKILLs itself while its worker is still booting, or while the worker
writes a checkpoint. It runs under a small harness that makes itself a child subreaper,
so the orphaned worker becomes the harness's child and the harness learns how it ended:
by the kernel's death signal (SIGKILL) or on its lifeline's EOF (`ORPHAN_EXIT`). Before
this, an orphaned worker finished booting or its persist, found its trainer gone and
returned 0, holding the pipe for seconds meanwhile; how it ended is the deterministic
sign of which way it went, and the time to the pipe's EOF is printed only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import resumable
from resumable.commit import RenameCommit, list_committed
from resumable.pipeline._worker import ORPHAN_EXIT
from resumable.storage import open_storage

SRC = Path(resumable.__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a child subreaper (prctl) and /proc"
)

TRAINER = """
import json, os, signal, sys, time
import torch
import resumable

root, shm, phase = sys.argv[1:4]
numel = 1 << 25 if phase == "persisting" else 1024  # 128 MiB: a persist that takes a while
ck = resumable.Checkpointer(root, {"w": torch.ones(numel)}, persist="process", shm_dir=shm)
ck.restore()  # starts the persist worker, which now boots (imports torch, resumable)
worker = ck._persister.worker_pid
if phase == "persisting":
    ck.save(1)
    while True:  # until the worker writes the step's staging directory, or committed it
        names = os.listdir(root)
        if any(name.startswith(".tmp-step-") for name in names):
            break
        if "step-000000000001" in names:
            phase = "committed"
            break
        time.sleep(0.001)
print(json.dumps({"worker": worker, "phase": phase}), flush=True)
print("the trainer's last words", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

HARNESS = """
import ctypes, json, os, select, subprocess, sys, time

assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # CHILD_SUBREAPER
trainer = subprocess.Popen(
    [sys.executable, *sys.argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    bufsize=0,
)
fd = trainer.stdout.fileno()
output, line = b"", b""
while not line.endswith(b"\\n"):
    chunk = os.read(fd, 1)
    if not chunk:
        break
    line += chunk
code = trainer.wait()
killed = time.monotonic()
eof_s = None
while time.monotonic() - killed < 120:  # a guard against a hang, not a measure
    ready, _, _ = select.select([fd], [], [], 1.0)
    if ready:
        chunk = os.read(fd, 65536)
        if not chunk:  # every writer closed: the trainer's and its worker's ends
            eof_s = time.monotonic() - killed
            break
        output += chunk
info = json.loads(line) if line else {}
status = None
if info.get("worker"):
    try:
        _, status = os.waitpid(info["worker"], 0)  # orphaned, it became our child
    except ChildProcessError:
        status = None
print(json.dumps({
    "trainer": code, "info": info, "eof_s": eof_s, "output": output.decode(errors="replace"),
    "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
    "exit": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
}))
"""


def _orphan(tmp_path: Path, phase: str) -> dict[str, object]:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAINER))
    (tmp_path / "harness.py").write_text(textwrap.dedent(HARNESS))
    shm = tmp_path / "shm"
    shm.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "harness.py"),
            str(tmp_path / "train.py"),
            str(tmp_path / "ck"),
            str(shm),
            phase,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    print(f"{phase}: the pipe reached EOF {result['eof_s']} s after the trainer died")
    return result


def _ended_for_its_trainer(result: dict[str, object]) -> None:
    assert result["trainer"] == -signal.SIGKILL, result
    assert result["eof_s"] is not None, f"the trainer's pipe never reached EOF: {result}"
    assert "the trainer's last words" in str(result["output"])
    assert "Traceback" not in str(result["output"]), result["output"]
    how = (result["signal"], result["exit"])
    assert how in ((signal.SIGKILL, None), (None, ORPHAN_EXIT)), (
        f"the orphaned persist worker ended with {how} (signal, exit status), not by its "
        "trainer's death: it lived on after the trainer was killed"
    )


def test_a_booting_worker_ends_with_its_killed_trainer(tmp_path: Path) -> None:
    result = _orphan(tmp_path, "booting")
    _ended_for_its_trainer(result)
    assert not list_committed(open_storage(str(tmp_path / "ck")))


def test_a_persisting_worker_ends_with_its_killed_trainer_and_leaves_nothing_torn(
    tmp_path: Path,
) -> None:
    result = _orphan(tmp_path, "persisting")
    info = result["info"]
    assert isinstance(info, dict) and info["phase"] == "persisting", result
    _ended_for_its_trainer(result)
    storage = open_storage(str(tmp_path / "ck"))
    assert list_committed(storage) == []  # abandoned, not committed, nothing half-visible
    names = storage.list_dir("")
    assert "step-000000000001" not in names
    staging = [name for name in names if name.startswith(".tmp-step-")]
    assert staging and RenameCommit(storage).stale() == staging  # a later launch removes it
    # The next launch adopts the snapshot the trainer left in shared memory and goes on.
    ck = resumable.Checkpointer(
        str(tmp_path / "ck"),
        {"w": torch.zeros(1 << 25)},
        persist="process",
        shm_dir=str(tmp_path / "shm"),
    )
    try:
        assert ck.restore() == 1
        ck.save(2)
        ck.wait()
    finally:
        ck.close()
    assert 2 in list_committed(storage)


def _thread_gone(native_id: int) -> bool:
    return not Path(f"/proc/self/task/{native_id}").exists()


def test_a_worker_started_from_a_thread_that_ends_lives_on(tmp_path: Path) -> None:
    """The kernel's death signal follows the thread that started the worker: a worker
    started from a training thread that ended must not be killed with it."""
    (tmp_path / "shm").mkdir()
    ck = resumable.Checkpointer(
        str(tmp_path / "ck"),
        {"w": torch.arange(1024.0)},
        persist="process",
        shm_dir=str(tmp_path / "shm"),
    )
    try:
        started: list[int | None] = []
        ids: list[int] = []

        def start() -> None:
            ids.append(threading.get_native_id())
            ck.restore()  # starts the worker from this thread
            ck.save(1)
            ck.wait()  # the worker answered: it booted, its death signal (if any) is set
            started.append(ck._persister.worker_pid)  # type: ignore[attr-defined]

        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
        while not _thread_gone(ids[0]):  # its task gone: a death signal was sent by now
            time.sleep(0.01)
        assert started[0] is not None
        ck.save(2)
        ck.wait()  # a round trip: a killed worker cannot have answered
        assert ck._persister.worker_pid == started[0]  # type: ignore[attr-defined]
    finally:
        ck.close()
    assert list_committed(open_storage(str(tmp_path / "ck"))) == [1, 2]
