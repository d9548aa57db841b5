"""Worker of `test_memory_previous`: a job killed in the middle of a memory snapshot.

``python tests/memory_previous_job.py MODE ROOT SHM_DIR OUT`` (one process), or under
``torchrun`` (each rank). The state is per-rank values: after step k every element of
``w`` is ``k + 1000 * rank``, so the step a relaunch restored can be read off them.

Modes:

- ``solo``: a snapshot every step; step 4 committed; the persist of step 6 holds its
  slot (its worker process is stopped before it starts, its pid in ``OUT/worker.pid``);
  the process SIGKILLs itself during the copy of step 8, after the data, before the
  snapshot is published: the slots hold steps 6 and 7 complete (before: step 6 only,
  step 7's slot being the one step 8 overwrote).
- ``ranks``: two ranks, a snapshot every step, a persist every 4 steps (step 4
  committed); rank 1 SIGKILLs itself during its copy of step 7, once rank 0 finished
  its own (``OUT/r0-7``).
- ``resume``: restore (any world size) and write ``OUT/resume-rank{r}.json``: the step
  restored and the values of ``w``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resumable import Checkpointer, Every
from resumable._shm import ShmSlot

N = 1 << 20  # 4 MiB of float32 per rank


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def train(w: torch.Tensor, step: int) -> None:
    if dist.is_initialized():
        dist.barrier()  # as a training step's collective: the ranks keep in step
    w.fill_(step + 1000 * rank())


def die_during_copy_of(kill_step: int, wait_for: Path | None = None) -> None:
    """SIGKILL this process when it publishes its snapshot of ``kill_step``: the data is
    copied, the slot still marked WRITING (what a kill during the copy leaves)."""
    real = ShmSlot.finish_write

    def finish_write(self: ShmSlot, *, step: int, **kw: Any) -> int:
        if step == kill_step:
            while wait_for is not None and not wait_for.exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, step=step, **kw)

    ShmSlot.finish_write = finish_write  # type: ignore[method-assign]


def checkpointer(root: Path, shm_dir: Path, w: torch.Tensor) -> Checkpointer:
    return Checkpointer(
        root,
        {"values": {"w": w}},
        memory_every=Every(steps=1),
        persist_every=Every(steps=4),
        keep=None,
        shm_dir=shm_dir,
        persist="process",
    )


def solo(root: Path, shm_dir: Path, out: Path) -> None:
    w = torch.zeros(N)
    ck = checkpointer(root, shm_dir, w)
    ck.restore()
    die_during_copy_of(8)
    for step in range(1, 9):
        train(w, step)
        if step == 6:
            pid = ck.worker_pid
            assert pid is not None
            (out / "worker.pid").write_text(str(pid))
            os.kill(pid, signal.SIGSTOP)  # the persist of step 6 holds its slot from now on
        if step in (4, 6):
            assert ck.save(step)
        else:
            ck.snapshot(step)
        if step == 4:
            ck.wait()  # step 4 committed
    raise SystemExit("not killed during the copy of step 8")


def ranks(root: Path, shm_dir: Path, out: Path) -> None:
    w = torch.zeros(N)
    ck = checkpointer(root, shm_dir, w)
    ck.restore()
    if rank() == 1:
        die_during_copy_of(7, wait_for=out / "r0-7")
    for step in range(1, 8):
        train(w, step)
        ck.maybe_save(step)
        if step == 4:
            ck.wait()  # step 4 committed on every rank
    (out / "r0-7").write_text("")  # rank 0 holds step 7 complete
    time.sleep(600)  # until torchrun ends this rank: rank 1 is gone


def resume(root: Path, shm_dir: Path, out: Path) -> None:
    w = torch.zeros(N)
    with checkpointer(root, shm_dir, w) as ck:
        step = ck.restore()
        values = sorted({float(v) for v in w.unique()})
        report = {"step": step, "values": values}
        (out / f"resume-rank{rank()}.json").write_text(json.dumps(report))


def main() -> None:
    mode, root, shm_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    {"solo": solo, "ranks": ranks, "resume": resume}[mode](root, shm_dir, out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
