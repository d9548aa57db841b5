"""Campaign 2, power loss: record the file operations of real saves and retention, then
check every crash state they could leave.

A `Checkpointer` (persist ``sync``, ``Keep(last=2)``) saves ``saves`` steps into a fresh
local root while `stress.fsops.FileOps` records every operation inside it, with a mark
the moment each commit returns. For every prefix of that log (a power loss after each
operation), `stress.crashstate.FsModel` builds the states a power loss could leave
(unsynced directory changes lost per directory, unsynced file bytes dropped, torn at
4 KiB or read as zeros); each distinct state is written to a scratch directory and
judged by the library's own listing and reader:

- lost: a checkpoint whose commit had returned (and whose deletion by retention had not
  begun) is not listed, or does not verify;
- torn: a listed checkpoint does not verify (manifest, sizes, headers, checksums), or
  its tensors are not the bytes saved at that step;
- phantom: a listed step that was never saved.

Every ``restore_every``-th state is also restored by a fresh `Checkpointer`, which must
come back at the newest checkpoint committed before the crash, or newer.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from resumable.commit import list_committed, parse_step_dir
from resumable.errors import CheckpointError
from resumable.reader import CheckpointReader
from stress.crashstate import FsModel, fingerprint, materialise
from stress.fsops import FileOps, Op, no_directory_fsync, no_file_fsync
from stress.workload import (
    broken_commit,
    checkpointer,
    local,
    make_state,
    on_commit,
    set_step,
    tensor_sums,
)

SIZES = {
    "small": {"saves": 3, "variants": 4, "restore_every": 50},
    "full": {"saves": 100, "variants": 48, "restore_every": 100},
}
SEED = 20261125
WIDTH = 128  # 64 KiB of weights: 16 pages to tear


def record(
    root: str,
    saves: int,
    *,
    skip: Callable[[str, str, bool], bool] | None = None,
    commit: str | None = None,
    listdir_order: str = "os",
) -> tuple[list[Op], dict[int, dict[str, str]]]:
    """Save steps 1..``saves`` into the empty directory ``root`` while recording; return
    the op log and the tensor checksums of every step."""
    state = make_state(WIDTH)
    expected: dict[int, dict[str, str]] = {}
    ops = FileOps(root, skip=skip, listdir_order=listdir_order)
    with ops.active(), on_commit(lambda step: ops.mark("committed", step)), broken_commit(commit):
        ck = checkpointer(root, state)
        for step in range(1, saves + 1):
            set_step(state, step)
            ck.save(step)
            with_sums = local(root)
            expected[step] = tensor_sums(with_sums, step)
        ck.close()
    return ops.ops, expected


def judge(
    scratch: str, committed: set[int], deleting: set[int], expected: dict[int, dict[str, str]]
) -> list[str]:
    """What is wrong with the crash state in ``scratch`` (empty list: nothing)."""
    storage = local(scratch)
    problems = []
    try:
        listed = list_committed(storage)
    except CheckpointError as exc:
        return [f"listing failed: {exc}"]
    for step in listed:
        if step not in expected:
            problems.append(f"phantom: step {step} listed, never saved")
            continue
        try:
            CheckpointReader(storage, step).verify()
            if tensor_sums(storage, step) != expected[step]:
                raise CheckpointError("tensors differ from the ones saved at this step")
        except CheckpointError as exc:
            kind = "lost" if step in committed - deleting else "torn"
            problems.append(f"{kind}: step {step} listed but does not verify: {exc}")
    for step in sorted(committed - deleting - set(listed)):
        problems.append(f"lost: step {step} was committed but is not listed")
    return problems


def restores_newest(scratch: str, committed: set[int], deleting: set[int]) -> str | None:
    """Restore with a fresh Checkpointer; a problem in words, or None."""
    want = max(committed - deleting, default=0)
    try:
        ck = checkpointer(scratch, make_state(WIDTH), keep=None)
        try:
            got = ck.restore()
        finally:
            ck.close()
    except CheckpointError as exc:
        return f"restore failed: {exc}" if want else None
    if got < want:
        return f"restore came back at step {got}, step {want} was committed"
    return None


def replay(
    ops: list[Op],
    expected: dict[int, dict[str, str]],
    *,
    variants: int,
    restore_every: int,
    seed: int = SEED,
) -> dict[str, Any]:
    """Check every distinct crash state of every prefix of ``ops``."""
    rng = random.Random(seed)
    model = FsModel({})
    seen: set[str] = set()
    committed: set[int] = set()
    deleting: set[int] = set()
    states = restores = generated = 0
    failures: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    quiet = logging.getLogger("resumable")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="powerloss-") as tmp:
            scratch = os.path.join(tmp, "root")
            for i in range(len(ops) + 1):
                if i:
                    op = ops[i - 1]
                    model.apply(op)
                    if op[0] == "mark" and op[1] == "committed":
                        committed.add(op[2])
                    if op[0] == "rename" and parse_step_dir(op[1]) is not None:
                        deleting.add(parse_step_dir(op[1]) or 0)
                for choice in model.choices(rng, variants):
                    generated += 1
                    state = model.crash_state(choice)
                    key = fingerprint(state)
                    if key in seen:
                        continue
                    seen.add(key)
                    states += 1
                    materialise(state, scratch)
                    problems = judge(scratch, committed, deleting, expected)
                    if not problems and restore_every and states % restore_every == 0:
                        restores += 1
                        materialise(state, scratch)
                        bad = restores_newest(scratch, committed, deleting)
                        problems = [bad] if bad else []
                    for p in problems:
                        kind = p.split(":", 1)[0]
                        counts[kind] = counts.get(kind, 0) + 1
                    if problems and len(failures) < 20:
                        failures.append(
                            {
                                "after_op": i,
                                "op": _show(ops[i - 1]) if i else None,
                                "problems": problems[:3],
                            }
                        )
    finally:
        quiet.setLevel(level)
    return {
        "states": states,
        "generated": generated,
        "restores": restores,
        "problem_counts": counts,
        "examples": failures,
    }


def _show(op: Op) -> str:
    return " ".join(str(a) if not isinstance(a, bytes) else f"<{len(a)} bytes>" for a in op)


def run(
    size: str, *, skip: Callable[[str, str, bool], bool] | None = None, commit: str | None = None
) -> dict[str, Any]:
    """Record and replay, once with each directory listed in name order and once in
    reverse (deletions follow the listing); ``skip``/``commit`` break the save path
    (the able-to-fail runs)."""
    cfg = SIZES[size]
    t0 = time.perf_counter()
    totals: dict[str, Any] = {"states": 0, "generated": 0, "restores": 0, "ops": 0}
    counts: dict[str, int] = {}
    kinds: dict[str, int] = {}
    examples: list[Any] = []
    for n, order in enumerate(("sorted", "reversed")):
        with tempfile.TemporaryDirectory(prefix="powerloss-rec-") as tmp:
            root = os.path.join(tmp, "root")
            os.mkdir(root)
            ops, expected = record(
                root, cfg["saves"], skip=skip, commit=commit, listdir_order=order
            )
        for op in ops:
            kinds[op[0]] = kinds.get(op[0], 0) + 1
        result = replay(
            ops,
            expected,
            variants=cfg["variants"],
            restore_every=cfg["restore_every"],
            seed=SEED + n,
        )
        totals["states"] += result["states"]
        totals["generated"] += result["generated"]
        totals["restores"] += result["restores"]
        totals["ops"] += len(ops)
        for k, v in result["problem_counts"].items():
            counts[k] = counts.get(k, 0) + v
        examples += result["examples"][:3]
    return {
        "trials": totals["states"],
        "failures": sum(counts.values()),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "saves_per_recording": cfg["saves"],
            "recordings": "2 (directories listed in name order, then reversed)",
            "ops_recorded": totals["ops"],
            "op_kinds": kinds,
            "states_generated": totals["generated"],
            "distinct_states_checked": totals["states"],
            "random_mixes_per_prefix": cfg["variants"],
            "restores_checked": totals["restores"],
            "problem_counts": counts,
            "examples": examples[:5],
            "seed": SEED,
        },
    }


BROKEN: dict[str, dict[str, Any]] = {
    "no directory fsync": {"skip": no_directory_fsync},
    "no file fsync": {"skip": no_file_fsync},
    "manifest written first": {"commit": "manifest-first"},
}


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks run on each broken save path (small size)."""
    out = {}
    for name, kw in BROKEN.items():
        r = run("small", **kw)
        out[name] = {"trials": r["trials"], "failures": r["failures"]}
    return out
