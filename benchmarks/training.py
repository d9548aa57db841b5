"""End to end: what checkpointing costs a training loop.

A deterministic MLP (fixed seed, synthetic data) trains in ``rounds`` rounds of
``steps`` steps of each kind: without checkpoints (the baseline), and with
``maybe_save(step)`` after every step under ``memory_every=Every(steps=1)`` and
``persist_every=Every(steps=50)`` (with the synchronous API, which has no memory tier,
only the persist every 50 steps happens). Without overlap the kinds take turns step by
step, in ABBA order, so that the other jobs of this shared machine, which come and go
over seconds, slow every kind alike (runs before `vm-20261207T212801Z`: each kind ran its 50 steps
in a row, a "segment", and the kinds' ratios differed by more than the snapshot costs).
With ``overlap=True`` each kind still runs its steps in a row: the overlapped copy runs
during the next step, which must be the checkpointed kind's own. A kind's steps of one
round are its "segment" below. Step numbers are offset so that persists start in the
middle of a round; each round ends with ``wait()``, timed in the checkpointed kind's,
so no background persist leaks into the next round. The worker start and the first
allocation of the snapshot memory happen in a warm-up save before any timing.

Throughput kept, three ways: the ratio of the baseline's and the checkpointed kind's
total times (``total_ratio``: the same steps, so the ratio of their throughputs), of
their rounds' medians (``throughput_ratio``), and the median of the rounds' ratios
(``median_pair_ratio``). Every step's and call's time is recorded too (the steps'
medians and means, the calls' medians and means). Without overlap a persist runs in
another process during the steps after the one that started it, mostly other kinds':
what those steps took beyond their kinds' mean step is charged to the checkpointed
kind, moved from the other kinds' rounds to its own (``persist_spill``).

The floor, timed in the same loop (without overlap): a third kind copies, after each
step, the tensors a snapshot takes (`small_bench.loop_floor`: one ``_foreach_copy_``
into memory allocated once, nothing else). Its fastest copy is what no snapshot of this
state in this loop can beat; its ratios are what a snapshot made of that copy alone
would keep.

Without overlap, a fourth kind takes, after each step, the library's own memory
snapshot with its layers fused into one call (`small_bench.fused_snapshot`: the same
checks, random streams, metadata and slot as ``maybe_save``, no facade, schedule,
worker poll or fallback; a checkpointer of its own that never persists): its call
against ``maybe_save``'s is what fusing the layers would save in this loop.

Without overlap, a fifth kind takes, after each step, the least snapshot that keeps the
library's guarantees (`small_bench.guarded_snapshot`: the structure and tensor checks,
two shared-memory slots taken in turn with an odd/even sequence, every optimizer
group's values and the random streams in a record with its digest, the copy as the
floor makes it): the floor a snapshot with those guarantees is bound by in this loop.

Without overlap, after the rounds: ``maybe_save`` and the floor's copy, each timed right
after a step and once more straight after the first call (``cold_warm``): whether the
snapshot's own work (all but the copy) costs more after a training step than after
another snapshot, whose copy also went through the caches.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from resumable_bench import api_info
from small_bench import fused_snapshot, guarded_snapshot, loop_floor
from torch import nn

import resumable
from resumable import capture as capture_mod


def build_mlp(width: int, depth: int, d_in: int = 256, d_out: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.GELU()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


def run_e2e(
    root: Path,
    *,
    steps: int,
    rounds: int,
    width: int,
    depth: int,
    batch: int,
    persist_every: int = 50,
    persist: str | None = None,
    threads: int | None = 1,
    overlap: bool = False,
) -> dict[str, Any]:
    """Run the comparison; ``threads`` sets torch's intra-op threads for the loop (and
    is restored after): one thread keeps step times stable on a small shared machine
    and leaves a core to the background persist, as a GPU trainer would."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        result = _run(root, steps, rounds, width, depth, batch, persist_every, persist, overlap)
    finally:
        torch.set_num_threads(before)
    result["torch_threads"] = threads or before
    return result


def _run(
    root: Path,
    steps: int,
    rounds: int,
    width: int,
    depth: int,
    batch: int,
    persist_every: int,
    persist: str | None,
    overlap: bool = False,
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_mlp(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    pool = [
        (torch.randn(batch, 256, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        for _ in range(8)
    ]
    loss_fn = nn.CrossEntropyLoss()

    def step_once(k: int) -> None:
        x, y = pool[k % len(pool)]
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for k in range(20):  # warm-up; also creates the Adam moments
        step_once(k)

    api = api_info()
    kwargs: dict[str, Any] = {
        "persist_every": resumable.Every(steps=persist_every),
        "keep": resumable.Keep(last=2),
    }
    if api["tiers"]:
        kwargs["memory_every"] = resumable.Every(steps=1)
    if persist is not None and "persist" in api["init_params"]:
        kwargs["persist"] = persist
    if overlap:
        kwargs["overlap"] = True
    ck = resumable.Checkpointer(
        str(root / ("e2e-overlap" if overlap else "e2e")),
        state={"model": model, "optim": opt},
        **kwargs,
    )
    offset = persist_every // 2
    ck.save(offset)  # warm-up: starts the worker, allocates the snapshot memory
    ck.wait()
    gid = offset
    # the fused bound's own checkpointer: memory snapshots only, never a persist
    ck_fused = None
    if api["tiers"] and not overlap:
        ck_fused = resumable.Checkpointer(
            str(root / "e2e-fused"),
            state={"model": model, "optim": opt},
            memory_every=resumable.Every(steps=1),
            persist_every=resumable.Every(steps=10**9),
            keep=None,
        )
        for k in range(1, 4):
            ck_fused.maybe_save(k)  # plans the structure the fused call checks
    fused = fused_snapshot(ck_fused, {"model": model, "optim": opt}) if ck_fused else None
    # the guarded floor's slots: a private directory in shared memory, removed at the end
    guarded = close_guarded = None
    guarded_dir: Path | None = None
    if api["tiers"] and not overlap:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        guarded_dir = Path(tempfile.mkdtemp(prefix="resumable-e2e-", dir=shm))
        guarded, _, close_guarded = guarded_snapshot(
            model,
            opt,
            list(capture_mod.capture({"model": model, "optim": opt}).tensors.values()),
            guarded_dir,
        )

    persists = 0
    snapshot_s: list[float] = []
    # the tensors a snapshot takes (the random streams' too), as the loop floor copies them
    copy_floor, _, close_floor = loop_floor(
        list(capture_mod.capture({"model": model, "optim": opt}).tensors.values())
    )

    def checkpoint() -> bool:
        nonlocal gid
        gid += 1
        return ck.maybe_save(gid)

    def after_checkpoint(persisted: Any) -> None:
        nonlocal persists
        persists += bool(persisted)
        snap = getattr(ck, "last_snapshot_s", None)
        if api["tiers"] and isinstance(snap, (int, float)):
            snapshot_s.append(snap)

    base, ckpt = _Kind("baseline", None), _Kind("checkpointed", checkpoint, after_checkpoint)
    kinds = [base, ckpt]
    if not overlap:
        kinds.append(_Kind("floor", copy_floor))
    bound_steps = itertools.count(4)  # the fused bound's checkpointer planned steps 1 to 3
    if fused is not None:
        kinds.append(_Kind("fused", lambda: fused(next(bound_steps))))
    if guarded is not None:
        kinds.append(_Kind("guarded", lambda: guarded(next(bound_steps))))
    cold_warm: dict[str, Any] = {}

    def cold_and_warm(n: int) -> None:
        """`maybe_save`, and the copy floor, right after a step and once more straight
        after the first call, on alternate steps, ``n`` steps in all; a pair in which a
        persist started is left out. Each call's time less the copy's, in each
        position, is what the snapshot does beside its copy there."""
        nonlocal gid
        keys = ("maybe_save_cold_s", "maybe_save_warm_s", "floor_cold_s", "floor_warm_s")
        got: dict[str, list[float]] = {k: [] for k in keys}
        for k in range(n):
            step_once(k)
            pair: list[float] = []
            persisted = False
            for _ in range(2):
                t1 = time.perf_counter()
                if k % 2:
                    copy_floor()
                else:
                    gid += 1
                    persisted = ck.maybe_save(gid) or persisted
                pair.append(time.perf_counter() - t1)
            if not persisted:
                for key, dt in zip(keys[2:] if k % 2 else keys[:2], pair):
                    got[key].append(dt)
        ck.wait()
        cold_warm.update(
            (k, {"samples": v, "median": statistics.median(v)}) for k, v in got.items() if v
        )

    try:
        spill = _interleave(kinds, rounds, steps, step_once, ck, overlap)
        if api["tiers"] and not overlap:
            cold_and_warm(2 * steps)
    finally:
        ck.close()
        close_floor()
        if close_guarded is not None:
            close_guarded()
        if guarded_dir is not None:
            shutil.rmtree(guarded_dir, ignore_errors=True)
        if ck_fused is not None:
            ck_fused.save_on_close = False
            ck_fused.close()
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    b, c = statistics.median(base.rounds), statistics.median(ckpt.rounds)
    base_step = statistics.median(base.steps)
    return {
        "mode": (
            f"two-tier: maybe_save every step, memory_every=1, persist_every={persist_every}, "
            f"persist mode {getattr(ck, 'persist_mode', '?')}"
            + (", overlap=True" if overlap else "")
            if api["tiers"]
            else f"sync fallback: maybe_save every step, persist_every={persist_every} "
            "(no memory tier in this API)"
        ),
        "model": {
            "width": width,
            "depth": depth,
            "batch": batch,
            "params": sum(p.numel() for p in model.parameters()),
        },
        "state_bytes": state_bytes,
        "steps_per_segment": steps,
        "rounds": rounds,
        # "step": the kinds take turns step by step (ABBA), a round's steps of a kind are
        # its "segment"; "segment": each kind runs its steps in a row (overlap mode, whose
        # copy runs during the next step, which must be its own kind's)
        "interleaved": "segment" if overlap else "step",
        "persists": persists,
        "baseline_segment_s": {"samples": base.rounds, "median": b},
        "checkpointed_segment_s": {"samples": ckpt.rounds, "median": c},
        "step_ms_baseline": 1000 * b / steps,
        "step_ms_checkpointed": 1000 * c / steps,
        "baseline_step_s": {"median": base_step, "mean": statistics.mean(base.steps)},
        "checkpointed_step_s": {
            "median": statistics.median(ckpt.steps),
            "mean": statistics.mean(ckpt.steps),
        },
        "snapshot_blocking_s": (
            {"samples": snapshot_s, "median": statistics.median(snapshot_s)} if snapshot_s else None
        ),
        "maybe_save_s": {
            "samples": ckpt.calls,
            "median": statistics.median(ckpt.calls),
            "mean": statistics.mean(ckpt.calls),
        },
        "wait_s": ckpt.waits,
        "throughput_ratio": b / c,
        "total_ratio": sum(base.rounds) / sum(ckpt.rounds),
        "pair_ratios": [x / y for x, y in zip(base.rounds, ckpt.rounds)],
        "median_pair_ratio": statistics.median(x / y for x, y in zip(base.rounds, ckpt.rounds)),
        **({"persist_spill": spill} if spill is not None else {}),
        **({"cold_warm": cold_warm} if cold_warm else {}),
        **{
            k: v
            for kind in kinds[2:]
            for k, v in _timed_kind(base, kind, _CALL_KEYS[kind.name]).items()
        },
    }


_CALL_KEYS = {"floor": "floor_copy_s", "fused": "fused_call_s", "guarded": "guarded_call_s"}


class _Kind:
    """One kind of step in the loop: what runs after each step (nothing for the
    baseline), each step's and call's time, each round's total."""

    def __init__(
        self,
        name: str,
        call: Callable[[], Any] | None,
        after: Callable[[Any], None] | None = None,
    ) -> None:
        self.name, self.call, self.after = name, call, after
        self.steps: list[float] = []
        self.calls: list[float] = []
        self.rounds: list[float] = []
        self.waits: list[float] = []


def _interleave(
    kinds: list[_Kind],
    rounds: int,
    steps: int,
    step_once: Callable[[int], None],
    ck: resumable.Checkpointer,
    overlap: bool,
) -> dict[str, Any] | None:
    """``rounds`` rounds of ``steps`` steps of each kind (``kinds[0]`` the baseline,
    ``kinds[1]`` the checkpointed kind). Without overlap the kinds take turns step by
    step, in ABBA order (the other jobs on this shared machine come and go over
    seconds: each kind meets them alike); a round ends with ``ck.wait()``, timed in the
    checkpointed kind's round, so no persist leaks into the next round. With overlap
    each kind runs its steps in a row (ABBA by round), the checkpointed run ending with
    ``ck.wait()``: its copy runs during the next step, which must be its own kind's.

    Without overlap a persist runs (in another process, on the other core) during the
    steps after the one that started it, which are mostly other kinds'. The steps of
    the ``len(kinds)`` units after a persist's start are charged to the checkpointed
    kind: each one's excess over its own kind's mean step elsewhere moves from its
    kind's round to the checkpointed kind's. Returns what moved (None with overlap)."""
    block = steps if overlap else 1
    ckpt = kinds[1]
    beside: list[tuple[int, int, float]] = []  # (kind, round, step) after a persist start
    pending = 0
    for r in range(rounds):
        totals = [0.0] * len(kinds)
        for n, k0 in enumerate(range(0, steps, block)):
            order = range(len(kinds)) if (r + n) % 2 == 0 else range(len(kinds) - 1, -1, -1)
            for i in order:
                kind = kinds[i]
                for k in range(k0, min(k0 + block, steps)):
                    t0 = time.perf_counter()
                    step_once(k)
                    t1 = time.perf_counter()
                    got = kind.call() if kind.call is not None else None
                    t2 = time.perf_counter()
                    kind.steps.append(t1 - t0)
                    totals[i] += t2 - t0
                    if kind.call is not None:
                        kind.calls.append(t2 - t1)
                    if pending:
                        beside.append((i, r, t1 - t0))
                        pending -= 1
                    if kind.after is not None:
                        kind.after(got)
                        if got and not overlap:
                            pending = len(kinds)
                if overlap and kind is ckpt:
                    totals[i] += _timed_wait(ck, ckpt)
        if not overlap:
            totals[1] += _timed_wait(ck, ckpt)
        for kind, total in zip(kinds, totals):
            kind.rounds.append(total)
    if overlap:
        return None
    return _charge_persists(kinds, beside)


def _charge_persists(kinds: list[_Kind], beside: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Move the excess of the steps beside a persist (over their kind's mean step
    elsewhere) from their kinds' rounds to the checkpointed kind's (``kinds[1]``)."""
    moved = [0.0] * len(kinds)
    control = []
    for i, kind in enumerate(kinds):
        mine = [t for j, _, t in beside if j == i]
        rest = len(kind.steps) - len(mine)
        control.append((sum(kind.steps) - sum(mine)) / rest if rest else 0.0)
    for i, r, t in beside:
        excess = t - control[i]
        kinds[i].rounds[r] -= excess
        kinds[1].rounds[r] += excess
        moved[i] += excess
    total = sum(moved)
    return {
        "steps_beside": len(beside),
        "excess_s": total,
        "moved_s": {kind.name: m for kind, m in zip(kinds, moved)},
        "per_checkpointed_step_s": total / max(1, len(kinds[1].steps)),
    }


def _timed_wait(ck: resumable.Checkpointer, kind: _Kind) -> float:
    t0 = time.perf_counter()
    ck.wait()
    dt = time.perf_counter() - t0
    kind.waits.append(dt)
    return dt


def _timed_kind(base: _Kind, kind: _Kind, call_key: str) -> dict[str, Any]:
    """One kind that timed a call after each step (the loop floor's copy, the fused
    snapshot, the guarded one): its rounds, its calls (the fastest call is the floor
    where it is one) and its throughput against the baseline's, three ways: the ratio
    of the rounds' medians, of their totals, and the median of the rounds' ratios."""
    median = statistics.median(kind.rounds)
    name = kind.name
    return {
        f"{name}_segment_s": {"samples": kind.rounds, "median": median},
        call_key: {
            "samples": kind.calls,
            "median": statistics.median(kind.calls),
            "mean": statistics.mean(kind.calls),
            "min": min(kind.calls),
        },
        f"{name}_step_s": {
            "median": statistics.median(kind.steps),
            "mean": statistics.mean(kind.steps),
        },
        f"{name}_throughput_ratio": statistics.median(base.rounds) / median,
        f"{name}_total_ratio": sum(base.rounds) / sum(kind.rounds),
        f"{name}_pair_ratio": statistics.median(x / y for x, y in zip(base.rounds, kind.rounds)),
    }
