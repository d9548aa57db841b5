"""End to end: what checkpointing costs a training loop.

A deterministic MLP (fixed seed, synthetic data) trains in alternating segments of
``steps`` steps, in ABBA order: one without checkpoints, one with ``maybe_save(step)``
after every step under ``memory_every=Every(steps=1)`` and
``persist_every=Every(steps=50)`` (with the synchronous API, which has no memory tier,
only the persist every 50 steps happens). Step numbers are offset so that persists
start mid-segment (25 steps into a 50-step segment); each checkpointed segment ends
with ``wait()`` inside its timing, so no background persist leaks into the next
baseline segment. The worker start and the first allocation of the snapshot memory
happen in a warm-up save before any timing.

Throughput ratio = median baseline segment time / median checkpointed segment time;
the median of the per-pair ratios is recorded too.

The floor, timed in the same loop (without overlap): a third kind of segment copies,
after each step, the tensors a snapshot takes (`small_bench.loop_floor`: one
``_foreach_copy_`` into memory allocated once, nothing else), in the rotation of the
other two. Its fastest copy is what no snapshot of this state in this loop can beat;
``floor_throughput_ratio`` is what a snapshot made of that copy alone would keep.

Without overlap, a fourth kind of segment takes, after each step, the library's own
memory snapshot with its layers fused into one call (`small_bench.fused_snapshot`: the
same checks, random streams, metadata and slot as ``maybe_save``, no facade, schedule,
worker poll or fallback; a checkpointer of its own that never persists): its call's
median against ``maybe_save``'s is what fusing the layers would save in this loop.

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
    fused_seg_s: list[float] = []
    fused_call_s: list[float] = []
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
    guarded_seg_s: list[float] = []
    guarded_call_s: list[float] = []

    base_s: list[float] = []
    ckpt_s: list[float] = []
    snapshot_s: list[float] = []
    floor_seg_s: list[float] = []
    floor_copy_s: list[float] = []
    maybe_save_s: list[float] = []
    persists = 0
    # the tensors a snapshot takes (the random streams' too), as the loop floor copies them
    copy_floor, _, close_floor = loop_floor(
        list(capture_mod.capture({"model": model, "optim": opt}).tensors.values())
    )

    def baseline() -> None:
        t0 = time.perf_counter()
        for k in range(steps):
            step_once(k)
        base_s.append(time.perf_counter() - t0)

    def checkpointed() -> None:
        nonlocal gid, persists
        t0 = time.perf_counter()
        for k in range(steps):
            step_once(k)
            gid += 1
            t1 = time.perf_counter()
            if ck.maybe_save(gid):
                persists += 1
            maybe_save_s.append(time.perf_counter() - t1)
            snap = getattr(ck, "last_snapshot_s", None)
            if api["tiers"] and isinstance(snap, (int, float)):
                snapshot_s.append(snap)
        ck.wait()
        ckpt_s.append(time.perf_counter() - t0)

    def after_each_step(
        call: Callable[[], Any], calls: list[float], segments: list[float]
    ) -> Callable[[], None]:
        """A segment that runs ``call`` after each step, timing it and the segment."""

        def segment() -> None:
            t0 = time.perf_counter()
            for k in range(steps):
                step_once(k)
                t1 = time.perf_counter()
                call()
                calls.append(time.perf_counter() - t1)
            segments.append(time.perf_counter() - t0)

        return segment

    floor = after_each_step(copy_floor, floor_copy_s, floor_seg_s)
    bound_steps = itertools.count(4)  # the fused bound's checkpointer planned steps 1 to 3
    kinds = (baseline, checkpointed) if overlap else (baseline, checkpointed, floor)
    if fused is not None:
        kinds = (
            *kinds,
            after_each_step(lambda: fused(next(bound_steps)), fused_call_s, fused_seg_s),
        )
    if guarded is not None:
        kinds = (
            *kinds,
            after_each_step(lambda: guarded(next(bound_steps)), guarded_call_s, guarded_seg_s),
        )
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
        for r in range(rounds):  # ABBA order cancels a linear drift of the machine's speed
            for segment in kinds if r % 2 == 0 else kinds[::-1]:
                segment()
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
    b, c = statistics.median(base_s), statistics.median(ckpt_s)
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
        "persists": persists,
        "baseline_segment_s": {"samples": base_s, "median": b},
        "checkpointed_segment_s": {"samples": ckpt_s, "median": c},
        "step_ms_baseline": 1000 * b / steps,
        "step_ms_checkpointed": 1000 * c / steps,
        "snapshot_blocking_s": (
            {"samples": snapshot_s, "median": statistics.median(snapshot_s)} if snapshot_s else None
        ),
        "maybe_save_s": {"samples": maybe_save_s, "median": statistics.median(maybe_save_s)},
        "throughput_ratio": b / c,
        "pair_ratios": [x / y for x, y in zip(base_s, ckpt_s)],
        "median_pair_ratio": statistics.median(x / y for x, y in zip(base_s, ckpt_s)),
        **({"cold_warm": cold_warm} if cold_warm else {}),
        **(
            _timed_kind(b, "floor", "floor_copy_s", floor_seg_s, floor_copy_s)
            if floor_seg_s
            else {}
        ),
        **(
            _timed_kind(b, "fused", "fused_call_s", fused_seg_s, fused_call_s)
            if fused_seg_s
            else {}
        ),
        **(
            _timed_kind(b, "guarded", "guarded_call_s", guarded_seg_s, guarded_call_s)
            if guarded_seg_s
            else {}
        ),
    }


def _timed_kind(
    base: float, kind: str, call_key: str, segments: list[float], calls: list[float]
) -> dict[str, Any]:
    """One kind of segment that timed a call after each step (the loop floor's copy, the
    fused snapshot, the guarded one): its segments, its calls (the fastest call is the
    floor where it is one) and the segments' throughput ratio to the baseline's median."""
    median = statistics.median(segments)
    return {
        f"{kind}_segment_s": {"samples": segments, "median": median},
        call_key: {"samples": calls, "median": statistics.median(calls), "min": min(calls)},
        f"{kind}_throughput_ratio": base / median,
    }
