"""`ResumableDataLoader` on several ranks: real gloo groups launched by torchrun (CPU).

The rank side is `data_job`; four launches share one output folder (`runs`):

1. world 2: every batch boundary of each loader in ``data_job.CONFIGS``; save the loaders of
   ``data_job.RESIZE`` after 3 batches with a `Checkpointer`;
2. world 4: the same, and restore what world 2 saved (2->4);
3. world 2: restore what world 4 saved (4->2) and what world 2 saved (2->2);
4. world 3: restore what world 2 saved (2->3).

And `examples/distributed/train_ddp_data.py` (DDP, dropout, the loader in the checkpoint)
SIGKILLed at random moments at 2 ranks ends bit-identical to an uninterrupted run.

Expected shards are computed here from the epoch's permutation with the dealing rule of
``DistributedSampler`` written out again, not with the library's own sharding code.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import data_job
from resumable.data import ResumableSampler
from test_distributed import torchrun, torchrun_cmd

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

JOB = Path(__file__).with_name("data_job.py")
B = 2  # batch size of every RESIZE loader
SEEDS = {"pad": 11, "drop": 12}
SIZES = {"pad": 50, "drop": 48, "user": 48}


class Reports:
    def __init__(self, out: Path) -> None:
        self.out = out

    def ranks(self, phase: str, world: int) -> list[dict[str, Any]]:
        reports = []
        for r in range(world):
            path = self.out / f"{phase}-world{world}-rank{r}.json"
            data: dict[str, Any] = json.loads(path.read_text())
            assert "crash" not in data, f"{phase} at world {world}, rank {r}:\n{data['crash']}"
            reports.append(data)
        return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Reports:
    out = tmp_path_factory.mktemp("data-dist")
    torchrun(2, JOB, "boundaries+save", out)
    torchrun(4, JOB, "boundaries+save+resume", out, 2)
    torchrun(2, JOB, "resume", out, 4, 2)
    torchrun(3, JOB, "resume", out, 2)
    return Reports(out)


def epoch_reads(log: list[list[Any]], epoch: int) -> list[list[int]]:
    return [batch for e, batch in log if e == epoch]


def deal(order: list[int], start: int, world: int, rank: int, pad: bool) -> list[int]:
    """``DistributedSampler``'s dealing of ``order[start:]``: pad with the epoch's head (or
    drop the tail) to a multiple of ``world``, rank ``r`` takes every ``world``-th entry."""
    rest = order[start:]
    if pad:
        short = -len(rest) % world
        rest = rest + (order * (short // max(len(order), 1) + 1))[:short]
    else:
        rest = rest[: len(rest) // world * world]
    return rest[rank::world]


def batched(items: list[int], size: int, drop_last: bool) -> list[list[int]]:
    out = [items[i : i + size] for i in range(0, len(items), size)]
    return [b for b in out if len(b) == size] if drop_last else out


def permutation(name: str, epoch: int) -> list[int]:
    perm = ResumableSampler(SIZES[name], seed=SEEDS[name]).permutation(epoch)
    return [int(i) for i in perm.tolist()]


# --------------------------------------------------------------------------- same world size


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", list(data_job.CONFIGS))
def test_every_batch_boundary_resumes_every_rank_exactly(
    runs: Reports, world: int, config: str
) -> None:
    for report in runs.ranks("boundaries", world):
        result = report[config]
        assert result["epochs"] == list(range(data_job.EPOCHS))
        assert result["mismatches"] == [], f"rank {report['rank']}"


@pytest.mark.parametrize("world", [2, 4])
def test_states_are_global_with_the_loaders_order_and_per_rank_with_a_users(
    runs: Reports, world: int
) -> None:
    result = runs.ranks("boundaries", world)[0]
    for config in data_job.CONFIGS:
        per_rank = config.startswith(("user", "iterable"))
        assert result[config]["states_equal"] is not per_rank, config


@pytest.mark.parametrize("world", [2, 4])
def test_shards_are_dealt_like_distributed_sampler(runs: Reports, world: int) -> None:
    reports = runs.ranks("boundaries", world)
    for r, report in enumerate(reports):
        got = report["sequential-drop"]["reference"]
        for epoch in range(data_job.EPOCHS):
            mine = list(DistributedSampler(range(21), world, r, shuffle=False, drop_last=True))
            assert epoch_reads(got, epoch) == batched(mine, 3, drop_last=True)
    for epoch in range(data_job.EPOCHS):
        reads = [
            i
            for rep in reports
            for b in epoch_reads(rep["shuffled-pad"]["reference"], epoch)
            for i in b
        ]
        counts = Counter(reads)
        assert set(counts) == set(range(21))  # every sample, padded by repeats
        assert len(reads) == -(-21 // world) * world
    orders = [epoch_reads(reports[0]["shuffled-pad"]["reference"], e) for e in (0, 1)]
    assert orders[0] != orders[1]


@pytest.mark.parametrize("world", [2, 4])
def test_a_users_sampler_gets_set_epoch(runs: Reports, world: int) -> None:
    """The loader reads exactly what a plain DataLoader over the user's DistributedSampler
    (in a BatchSampler, or not) reads when the caller calls ``set_epoch`` each epoch."""
    for r, report in enumerate(runs.ranks("boundaries", world)):
        for config, seed in (("user-sampler", 3), ("user-batch-sampler", 5)):
            data = data_job.IndexDataset(19)
            sampler = DistributedSampler(data, world, r, seed=seed)
            want = []
            for epoch in range(data_job.EPOCHS):
                sampler.set_epoch(epoch)
                want += [[epoch, b.tolist()] for b in DataLoader(data, 2, sampler=sampler)]
            assert report[config]["reference"] == want, config


# --------------------------------------------------------------------------- world-size change

RESIZES = [(4, 2), (2, 4), (2, 3), (2, 2)]


def resumed(runs: Reports, name: str, source: int, target: int) -> list[dict[str, Any]]:
    return [rep[f"{name}-from{source}"] for rep in runs.ranks("resume", target)]


@pytest.mark.parametrize(("source", "target"), RESIZES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", ["pad", "drop"])
def test_world_size_change_reads_the_rest_of_the_epoch_exactly_once(
    runs: Reports, name: str, source: int, target: int
) -> None:
    pad = name == "pad"
    n = SIZES[name]
    perm = permutation(name, 0)
    consumed = source * data_job.SAVE_AFTER * B
    saved = [
        i
        for rep in runs.ranks("save", source)
        for b in epoch_reads(rep[name]["read"], 0)
        for i in b
    ]
    assert sorted(saved) == sorted(perm[:consumed])  # the saved position is a prefix
    results = resumed(runs, name, source, target)
    after: list[int] = []
    for r, result in enumerate(results):
        assert "error" not in result, result
        assert result["step"] == data_job.SAVE_AFTER
        mine = deal(perm, consumed, target, r, pad)
        got = epoch_reads(result["read"], 0)
        assert got == batched(mine, B, drop_last=not pad)
        after += [i for b in got for i in b]
    counts = Counter(after)
    remaining = set(perm[consumed:])
    assert all(counts[i] == 1 for i in remaining & set(counts)), "a remaining sample read twice"
    extra = [i for i in counts if i not in remaining]
    assert set(extra) <= set(saved)  # padding repeats the epoch's head, already consumed
    if pad:
        assert remaining <= set(counts)
        assert sum(counts[i] for i in extra) == -(n - consumed) % target
    else:
        assert not extra
        assert len(remaining - set(counts)) < target * B  # the tail drop, as DistributedSampler
    nxt = permutation(name, 1)
    for r, result in enumerate(results):  # later epochs: what a target-rank run reads
        assert epoch_reads(result["read"], 1) == batched(deal(nxt, 0, target, r, pad), B, not pad)


@pytest.mark.parametrize("name", ["pad", "drop", "user"])
def test_same_world_restore_continues_the_uninterrupted_run(runs: Reports, name: str) -> None:
    saves = runs.ranks("save", 2)
    for r, result in enumerate(resumed(runs, name, 2, 2)):
        assert "error" not in result, result
        assert saves[r][name]["read"] + result["read"] == saves[r][name]["reference"]


@pytest.mark.parametrize(("source", "target"), [(4, 2), (2, 4), (2, 3)], ids=lambda v: str(v))
def test_a_users_sampler_position_is_per_rank_state(
    runs: Reports, source: int, target: int
) -> None:
    """A position in a user's sampler cannot be dealt over new ranks: without
    ``reset_per_rank_state`` restore refuses, naming it; with it, the epoch starts over."""
    for r, result in enumerate(resumed(runs, "user", source, target)):
        assert result["error"] == "StateMismatchError"
        assert "'data'" in result["message"] and "reset_per_rank_state=True" in result["message"]
        assert result["step_after_reset"] == data_job.SAVE_AFTER
        data = data_job.IndexDataset(SIZES["user"])
        fresh = [
            b.tolist()
            for b in DataLoader(data, B, sampler=DistributedSampler(data, target, r, seed=3))
        ]
        assert epoch_reads(result["read"], 0) == fresh


@pytest.mark.parametrize(("source", "target"), [(4, 2), (2, 4), (2, 3)], ids=lambda v: str(v))
def test_random_streams_need_the_reset_but_the_data_position_does_not(
    runs: Reports, source: int, target: int
) -> None:
    for result in resumed(runs, "rng", source, target):
        assert result["error"] == "StateMismatchError"
        assert "'__rng__'" in result["message"] and "'data'" not in result["message"]
        assert result["step"] == data_job.SAVE_AFTER
        assert result["state"]["position"] == source * data_job.SAVE_AFTER * B


# --------------------------------------------------------------------------- killed training

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed" / "train_ddp_data.py"
EXAMPLE_ARGS = ["--epochs", "2", "--samples", "320", "--batch-size", "8", "--save-every", "2"]
STEPS_PER_EPOCH = 320 // (2 * 8)


def killed_after(out: Path, new_steps: int) -> int:
    """Launch the example at 2 ranks, SIGKILL torchrun and its workers (one process group)
    once rank 0 has printed ``new_steps`` steps; returns the step it resumed from."""
    proc = subprocess.Popen(
        torchrun_cmd(2, EXAMPLE, "--dir", out, *EXAMPLE_ARGS),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    watchdog = threading.Timer(240, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    resumed, seen, lines = None, 0, []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"rank 0: resumed from step (\d+)", line)
            if found:
                resumed = int(found.group(1))
            if line.startswith("step "):
                seen += 1
                if seen == new_steps:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
    finally:
        watchdog.cancel()
        proc.wait()
    assert seen == new_steps and resumed is not None, "".join(lines)[-6000:]
    return resumed


@pytest.mark.parametrize("kills", [2, pytest.param(6, marks=pytest.mark.slow)])
def test_ddp_training_killed_at_random_moments_ends_bit_identical(
    tmp_path: Path, kills: int
) -> None:
    plain = torchrun(2, EXAMPLE, "--dir", tmp_path / "plain", *EXAMPLE_ARGS)
    want = re.findall(r"final step=\d+ params_sha256=\w+", plain)
    assert want, plain[-3000:]
    rng = random.Random(kills)
    resumed = [killed_after(tmp_path / "killed", rng.randint(3, 12)) for _ in range(kills)]
    finished = torchrun(2, EXAMPLE, "--dir", tmp_path / "killed", *EXAMPLE_ARGS)
    assert re.findall(r"final step=\d+ params_sha256=\w+", finished) == want
    assert any(s % STEPS_PER_EPOCH for s in resumed[1:]), resumed  # resumed mid-epoch
    assert resumed == sorted(resumed) and resumed[-1] > 0
