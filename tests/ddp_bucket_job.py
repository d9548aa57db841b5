"""Worker of `test_ddp_identical`: a DDP run stopped at step ``STOP`` and resumed, on every
rank, launched by ``torchrun``.

``python -m torch.distributed.run --standalone --nproc-per-node=4 tests/ddp_bucket_job.py
PHASE OUT``

Each phase runs three variants of the same training side by side, checkpointed together
under ``OUT/ckpt``: ``plain`` (DDP as it comes), ``per_parameter`` (after
`resumable.ddp.reduce_per_parameter`) and ``find_unused`` (``find_unused_parameters=True``,
with which DDP never rebuilds its buckets).

- ``first``: a fresh run, ``STOP`` steps, a checkpoint of step ``STOP``, then stops.
- ``resume``: a new launch restores and trains to ``TOTAL``; then, in the same process,
  two uninterrupted runs of ``TOTAL`` steps from scratch (fresh models, fresh DDP
  wrappers, as a new launch builds them) are the references.

Each rank writes ``OUT/PHASE-rank{r}.json``: the step restored and, per variant, whether the
resumed parameters equal the reference bit for bit, whether the two references equal
each other, the largest difference, and whether all ranks hold the same parameters.
"""

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resumable import Checkpointer
from resumable.ddp import reduce_per_parameter

SEED = 0
STOP = 7
TOTAL = 20
VARIANTS = ("plain", "per_parameter", "find_unused")


def build(variant: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP (same initial values on every rank) wrapped in DDP, and its AdamW."""
    torch.manual_seed(SEED)
    inner = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh())
    inner.append(nn.Linear(48, 4))
    model: nn.Module = nn.parallel.DistributedDataParallel(
        inner, find_unused_parameters=variant == "find_unused"
    )
    if variant == "per_parameter":
        model = reduce_per_parameter(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One step on a batch derived from (step, rank) only."""
    g = torch.Generator().manual_seed(step * 1009 + dist.get_rank())
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    loss = (model(x) - y).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


Runs = dict[str, tuple[nn.Module, torch.optim.Optimizer]]


def open_ck(out: Path, runs: Runs) -> Checkpointer:
    """One checkpointer for both variants' models and optimizers."""
    state: dict[str, Any] = {}
    for variant, (model, optim) in runs.items():
        state |= {f"{variant}_model": model, f"{variant}_optim": optim}
    return Checkpointer(out / "ckpt", state, persist="sync", keep=None, shm_dir=out / "shm")


def train(runs: Runs, steps: range) -> None:
    for step in steps:
        for model, optim in runs.values():
            train_step(model, optim, step)


def phase_first(out: Path, report: dict[str, Any]) -> None:
    runs = {v: build(v) for v in VARIANTS}
    ck = open_ck(out, runs)
    report["started_at"] = ck.restore()
    train(runs, range(report["started_at"], STOP))
    ck.save(STOP)
    ck.close()


def same_on_all_ranks(values: torch.Tensor) -> bool:
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    return all(torch.equal(gathered[0], other) for other in gathered)


def uninterrupted(variant: str) -> torch.Tensor:
    runs = {variant: build(variant)}
    train(runs, range(TOTAL))
    return flat(runs[variant][0])


def phase_resume(out: Path, report: dict[str, Any]) -> None:
    runs = {v: build(v) for v in VARIANTS}
    ck = open_ck(out, runs)
    report["restored"] = ck.restore()
    train(runs, range(report["restored"], TOTAL))
    ck.close()
    for variant, (model, _) in runs.items():
        resumed = flat(model)
        ref, ref_again = uninterrupted(variant), uninterrupted(variant)
        report[variant] = {
            "resumed_equal": torch.equal(resumed, ref),
            "references_equal": torch.equal(ref, ref_again),
            "max_diff": (resumed - ref).abs().max().item(),
            "ranks_agree": same_on_all_ranks(resumed),
        }


PHASES = {"first": phase_first, "resume": phase_resume}


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    report: dict[str, Any] = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    try:
        PHASES[phase](out, report)
    except Exception:
        report["crash"] = traceback.format_exc()
    (out / f"{phase}-rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's threads can abort a finished rank
    # at exit ("terminate called without an active exception"; see dist_job.leave).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
