"""The persist worker outlives its trainer by moments, not by as long as the trainer's
other children: a SIGKILLed trainer whose DataLoader workers are stuck in a slow
``__getitem__`` (they never reach their own parent check) still loses its persist
worker promptly, and the persist worker never holds the trainer's stdout.

Each test runs a real trainer script with a real ``torch.utils.data.DataLoader``
(``num_workers=2``, forked) and ``persist="process"``; the processes it leaves are
found through ``/proc`` and killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import resumable

SRC = Path(resumable.__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="finds processes and their files in /proc"
)

TRAINER = """
import json, os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import resumable

ckpt, shm, pids = sys.argv[1:4]


class Slow(Dataset):
    # The first items come at once; the next ones block (a stuck read), so the loader's
    # workers never get back to checking whether their parent lives.
    def __len__(self):
        return 64

    def __getitem__(self, i):
        with open(os.path.join(pids, f"loader-{os.getpid()}"), "w"):
            pass
        if i >= 4:
            time.sleep(600)
        return torch.tensor([float(i)])


state = {"w": torch.arange(1024.0)}
ck = resumable.Checkpointer(ckpt, state, persist="process", shm_dir=shm)
ck.save(1)  # starts the persist worker: the loader's workers are forked after it
ck.wait()
loader = iter(DataLoader(Slow(), batch_size=2, num_workers=2))
next(loader)
ck.save(2)
ck.wait()
children = open(f"/proc/self/task/{os.getpid()}/children").read().split()
boot = b"resumable.pipeline._worker"
worker = [p for p in children if boot in open(f"/proc/{p}/cmdline", "rb").read()]
print(json.dumps({"worker": int(worker[0]), "stdout": os.readlink("/proc/self/fd/1")}), flush=True)
time.sleep(600)  # killed by the test
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, object], Path]]:
    """A running trainer with two stuck loader workers and a persist worker; yields the
    trainer, what it printed (the persist worker's pid, its stdout) and the folder where
    loader workers leave their pids. Kills whatever is left at the end."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER))
    shm, pids = tmp_path / "shm", tmp_path / "pids"
    shm.mkdir()
    pids.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ck"), str(shm), str(pids)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    leftovers: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the trainer ended early with status {proc.wait()}"
        info = json.loads(line)
        leftovers.append(int(info["worker"]))
        yield proc, info, pids
    finally:
        _kill(proc.pid)
        proc.wait()
        for path in pids.glob("loader-*"):
            leftovers.append(int(path.name.split("-")[1]))
        for pid in leftovers:
            _kill(pid)


def test_persist_worker_exits_when_the_trainer_is_killed_despite_stuck_loader_workers(
    trainer: tuple[subprocess.Popen[str], dict[str, object], Path],
) -> None:
    proc, info, pids = trainer
    worker = int(str(info["worker"]))
    loaders = [int(p.name.split("-")[1]) for p in pids.glob("loader-*")]
    loaders = [pid for pid in loaders if pid != proc.pid]
    assert loaders, "the DataLoader started no worker processes"
    assert _alive(worker)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(_alive(pid) for pid in loaders), "the loader workers should still be stuck"
    assert _wait_gone(worker, deadline_s=60.0), (
        "the persist worker outlived its SIGKILLed trainer (a loader worker held its socket?)"
    )
    # Its last snapshot stays in shared memory for the next launch; nothing was lost.
    assert any(_alive(pid) for pid in loaders)


def test_persist_worker_does_not_hold_the_trainers_stdout(
    trainer: tuple[subprocess.Popen[str], dict[str, object], Path],
) -> None:
    _, info, _ = trainer
    worker = int(str(info["worker"]))
    worker_stdout = os.readlink(f"/proc/{worker}/fd/1")
    assert worker_stdout != info["stdout"], "the persist worker holds the trainer's stdout"
    assert worker_stdout == os.devnull


WATCHED = """
import os, socket, sys, time
from resumable.pipeline import _worker as worker

use_pidfd, result = sys.argv[1] == "pidfd", sys.argv[2]
if not use_pidfd:
    del os.pidfd_open  # as on a kernel or platform without pidfds
here, there = socket.socketpair()  # a channel that never gets EOF: both ends stay open
trainer = os.getpid()
if os.fork() == 0:  # the worker: watches the process that forked it
    watch = worker.TrainerWatch(trainer)
    worker.TrainerWatch.POLL_S = 0.05
    readable = watch.wait(here)
    with open(result + ".tmp", "w") as f:
        f.write(f"{readable} {watch.uses_pidfd}")
    os.rename(result + ".tmp", result)
    os._exit(0)
time.sleep(0.5)  # the trainer dies with the channel still open
os._exit(0)
"""


@pytest.mark.parametrize("how", ["pidfd", "getppid"])
def test_trainer_watch_sees_its_trainer_die_without_an_eof(tmp_path: Path, how: str) -> None:
    if how == "pidfd" and not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open here")
    result = tmp_path / "result"
    done = subprocess.run(
        [sys.executable, "-c", WATCHED, how, str(result)],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0
    end = time.monotonic() + 60
    while not result.exists() and time.monotonic() < end:
        time.sleep(0.1)
    assert result.read_text() == f"False {how == 'pidfd'}"
