"""Worker of `test_data_distributed`: one phase, run on every rank by ``torchrun``.

``python -m torch.distributed.run --standalone --nproc-per-node=N tests/data_job.py PHASE OUT``

Each rank writes what it read to ``OUT/PHASE-rank{r}.json``; the assertions are on the pytest
side. Phases (the checkpoint roots under ``OUT`` are shared between launches):

- ``boundaries``: for each loader in `CONFIGS`, an uninterrupted run of `EPOCHS` epochs and
  one run interrupted after every batch (a fresh loader restored from the JSON state), all in
  the same processes; also whether the ranks' states were equal at every interruption.
- ``save``: for each loader in `RESIZE`, read `SAVE_AFTER` batches of epoch 0 and save the
  position with a real `Checkpointer` to ``OUT/<name>-from<world>``.
- ``resume FROM...``: restore each of those roots saved at the given world sizes and read the
  rest of epoch 0 and all of epoch 1.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

from resumable import Checkpointer
from resumable.data import ResumableDataLoader

EPOCHS = 2
SAVE_AFTER = 3
Batches = list[list[Any]]  # [epoch, [indices]] per batch


class IndexDataset(Dataset[int]):
    """Sample ``i`` is the int ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class RankStream(IterableDataset[int]):
    """``range(n)`` in an order drawn from (seed, epoch), each rank reading every
    world-th entry; tracks its position (``state_dict``) like Hugging Face's iterables."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.offset = n, seed, 0, 0
        self.resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100 + self.epoch)
        mine = torch.randperm(self.n, generator=g).tolist()[rank() :: dist.get_world_size()]
        self.offset, self.resume_at = self.resume_at, 0
        while self.offset < len(mine):
            self.offset += 1
            yield mine[self.offset - 1]

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["offset"]


class WorkerRankStream(RankStream):
    """`RankStream` that also shards its rank's entries over DataLoader workers; it takes
    its rank when built, as worker processes have no process group."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__(n, seed)
        self.rank, self.world = rank(), dist.get_world_size()

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100 + self.epoch)
        mine = torch.randperm(self.n, generator=g).tolist()[self.rank :: self.world]
        info = get_worker_info()
        if info is not None:
            mine = mine[info.id :: info.num_workers]
        self.offset, self.resume_at = self.resume_at, 0
        while self.offset < len(mine):
            self.offset += 1
            yield mine[self.offset - 1]


def own(n: int, batch_size: int, **kw: Any) -> Callable[[], ResumableDataLoader]:
    return lambda: ResumableDataLoader(IndexDataset(n), batch_size, **kw)


def user_sampler(n: int, batch_size: int) -> Callable[[], ResumableDataLoader]:
    def make() -> ResumableDataLoader:
        data = IndexDataset(n)
        return ResumableDataLoader(data, batch_size, sampler=DistributedSampler(data, seed=3))

    return make


def user_batch_sampler(n: int, batch_size: int) -> Callable[[], ResumableDataLoader]:
    def make() -> ResumableDataLoader:
        data = IndexDataset(n)
        batches = BatchSampler(DistributedSampler(data, seed=5), batch_size, drop_last=False)
        return ResumableDataLoader(data, batch_sampler=batches)

    return make


WORKERS: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "forkserver", "timeout": 60}
"""Worker processes started by a fork server, not forked from the rank: on CPython 3.11.7 and
older (gh-112275) a child forked while another thread of the rank holds the interpreter's
thread-list lock deadlocks before it runs a line, and these loaders start workers dozens of
times per rank (launches hung now and then, on CI too). A stuck worker would still fail within
``timeout`` seconds rather than hang the launch. See docs/data.md, "Limits"."""

CONFIGS: dict[str, Callable[[], ResumableDataLoader]] = {
    "shuffled-pad": own(21, 2, shuffle=True, seed=7),
    "sequential-drop": own(21, 3, shard_end="drop", drop_last=True),
    "shuffled-pad-droplast": own(23, 2, shuffle=True, seed=8, drop_last=True),
    "workers": own(13, 2, shuffle=True, seed=9, **WORKERS),
    "user-sampler": user_sampler(19, 2),
    "user-batch-sampler": user_batch_sampler(19, 2),
    "iterable": lambda: ResumableDataLoader(RankStream(20, 4), 2),
    "iterable-workers": lambda: ResumableDataLoader(WorkerRankStream(30, 6), 2, **WORKERS),
}
"""Loaders read at every batch boundary; those whose state is per-rank ('user...',
'iterable') carry their rank in it."""

RESIZE: dict[str, Callable[[], ResumableDataLoader]] = {
    "pad": own(50, 2, shuffle=True, seed=11),
    "drop": own(48, 2, shuffle=True, seed=12, shard_end="drop", drop_last=True),
    "user": user_sampler(48, 2),
}
"""Loaders saved at one world size and restored at another."""


def rank() -> int:
    return dist.get_rank()


def drive(
    loader: ResumableDataLoader, log: Batches, stop_after: int | None = None
) -> dict[str, Any] | None:
    """Read until `EPOCHS` epochs are done, logging each batch; returns the JSON-roundtripped
    state after ``stop_after`` batches, if it comes to that."""
    done = 0
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for batch in loader:
            log.append([epoch, batch.tolist()])
            done += 1
            if done == stop_after:
                state: dict[str, Any] = json.loads(json.dumps(loader.state_dict()))
                return state
    return None


def same_on_every_rank(value: Any) -> bool:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return all(g == gathered[0] for g in gathered)


def phase_boundaries(out: Path, report: dict[str, Any], args: list[str]) -> None:
    for name, make in CONFIGS.items():
        reference: Batches = []
        drive(make(), reference)
        mismatches = []
        states_equal = True
        for k in range(1, len(reference) + 1):
            log: Batches = []
            state = drive(make(), log, stop_after=k)
            assert state is not None
            states_equal &= same_on_every_rank(state)
            resumed = make()
            resumed.load_state_dict(state)
            drive(resumed, log)
            if log != reference:
                mismatches.append(k)
        report[name] = {
            "reference": reference,
            "mismatches": mismatches,
            "states_equal": states_equal,
            "epochs": sorted({e for e, _ in reference}),
        }


def open_ck(root: Path, loader: ResumableDataLoader, **kw: Any) -> Checkpointer:
    return Checkpointer(root, {"data": loader}, persist="sync", keep=None, **kw)


def phase_save(out: Path, report: dict[str, Any], args: list[str]) -> None:
    world = dist.get_world_size()
    for name, make in RESIZE.items():
        loader = make()
        log: Batches = []
        state = drive(loader, log, stop_after=SAVE_AFTER)
        with open_ck(out / f"{name}-from{world}", loader, capture_rng=False) as ck:
            ck.save(SAVE_AFTER)
        report[name] = {"read": log, "state": state}
        reference: Batches = []
        drive(make(), reference)
        report[name]["reference"] = reference
    loader = RESIZE["pad"]()
    drive(loader, [], stop_after=SAVE_AFTER)
    with open_ck(out / f"rng-from{world}", loader) as ck:  # random streams captured too
        ck.save(SAVE_AFTER)


def phase_resume(out: Path, report: dict[str, Any], args: list[str]) -> None:
    for source in args:
        for name, make in RESIZE.items():
            loader = make()
            result: dict[str, Any] = {}
            try:
                with open_ck(out / f"{name}-from{source}", loader, capture_rng=False) as ck:
                    result["step"] = ck.restore()
            except Exception as exc:
                result["error"] = type(exc).__name__
                result["message"] = str(exc)
                loader = make()
                with open_ck(out / f"{name}-from{source}", loader, capture_rng=False) as ck:
                    result["step_after_reset"] = ck.restore(reset_per_rank_state=True)
            log: Batches = []
            drive(loader, log)
            result["read"] = log
            report[f"{name}-from{source}"] = result
        loader = RESIZE["pad"]()
        rng: dict[str, Any] = {}
        try:
            with open_ck(out / f"rng-from{source}", loader) as ck:
                ck.restore()
        except Exception as exc:
            rng["error"] = type(exc).__name__
            rng["message"] = str(exc)
        loader = RESIZE["pad"]()
        with open_ck(out / f"rng-from{source}", loader) as ck:
            rng["step"] = ck.restore(reset_per_rank_state=True)
        rng["state"] = loader.state_dict()
        report[f"rng-from{source}"] = rng


PHASES = {"boundaries": phase_boundaries, "save": phase_save, "resume": phase_resume}


def main() -> None:
    phases, out, args = sys.argv[1].split("+"), Path(sys.argv[2]), sys.argv[3:]
    # The fork server (started at the first loader with workers) imports these once; each
    # worker it forks then only runs this file's definitions again.
    multiprocessing.set_forkserver_preload(["torch", "resumable.data"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    world = dist.get_world_size()
    for phase in phases:
        report: dict[str, Any] = {"rank": rank(), "world": world}
        path = out / f"{phase}-world{world}-rank{rank()}.json"
        try:
            PHASES[phase](out, report, args)
        except Exception:
            # Stop this rank: torchrun then stops the others, instead of them waiting in the
            # next phase's collectives for a rank that is not there.
            report["crash"] = traceback.format_exc()
            path.write_text(json.dumps(report))
            raise
        path.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
