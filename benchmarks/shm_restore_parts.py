"""Where a restore from shared memory goes: the checked copy, and the restore's own work
around it.

    python benchmarks/shm_restore_parts.py                  # 1 GiB, 11 restores
    python benchmarks/shm_restore_parts.py --size-mb 256 --rounds 21

The benchmark state of `make bench` (`state.build_state`: 1 GiB in 408 tensors), saved
by a `Checkpointer` as the restore phase has it (``memory_every=Every(steps=1)``,
``keep=Keep(last=2)``, ``capture_rng=False``; two ``save()`` + ``wait()``, so the
newest snapshot is committed and its checksums recorded). Then, per round: the copy
floor and the fastest checked copy (`run.CopyProbe`), the live tensors zeroed, and
``restore(tier="memory")``. Inside the restore, `MemoryTier.copy_verified` (the copy
that checks every byte against its checksum) is timed by wrapping it, so that
*own work* = the restore's time - that copy's: reading the slot, capturing the live
state, choosing destinations, decoding the tree, loading the values, the room check.

Medians of the rounds. Writes ``benchmarks/results/partial/shm-restore-parts-<UTC>.json``
with the git commit of the ``resumable`` imported (run it with ``PYTHONPATH`` set to
another checkout's ``src`` to measure that code).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import state as state_mod  # noqa: E402
from run import CopyProbe  # noqa: E402


def _commit(module_file: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(module_file).parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(size_mb: float, rounds: int, root: Path) -> dict[str, Any]:
    import resumable
    from resumable.pipeline.memory import MemoryTier

    copies: list[float] = []
    plain = MemoryTier.copy_verified

    def timed(self: Any, *a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        try:
            plain(self, *a, **k)
        finally:
            copies.append(time.perf_counter() - t0)

    MemoryTier.copy_verified = timed  # type: ignore[method-assign]
    tree = state_mod.build_state(size_mb)
    live = [t for _, t in state_mod.iter_tensors(tree)]
    probe = CopyProbe(tree)
    ck = resumable.Checkpointer(
        root,
        tree,
        memory_every=resumable.Every(steps=1),
        keep=resumable.Keep(last=2),
        capture_rng=False,
    )
    try:
        for step in (1, 2):
            ck.save(step)
            ck.wait()
        floor, checked, restore = [], [], []
        for _ in range(rounds):
            floor.append(probe.once("x"))
            checked.append(probe.checked_once("x"))
            with torch.no_grad():
                for t in live:
                    t.zero_()
            t0 = time.perf_counter()
            got = ck.restore(tier="memory", quiet=True)
            restore.append(time.perf_counter() - t0)
            if got != 2:
                raise RuntimeError(f"restore(tier='memory') returned {got}, expected 2")
    finally:
        ck.close()
        MemoryTier.copy_verified = plain  # type: ignore[method-assign]
    if len(copies) != rounds:
        raise RuntimeError(f"{len(copies)} checked copies in {rounds} restores: not the fused path")
    own = [r - c for r, c in zip(restore, copies)]
    med = statistics.median
    return {
        "resumable": resumable.__file__,
        "git_commit": _commit(resumable.__file__),
        "size_mb": size_mb,
        "tensors": len(live),
        "rounds": rounds,
        "samples": {
            "copy_floor": floor,
            "checked_copy_floor": checked,
            "restore": restore,
            "checked_copy_in_restore": copies,
        },
        "median_s": {
            "copy_floor": med(floor),
            "checked_copy_floor": med(checked),
            "restore": med(restore),
            "checked_copy_in_restore": med(copies),
            "own_work": med(own),
        },
        "restore_over_copy_floor": med(restore) / med(floor),
        "restore_over_checked_copy_floor": med(restore) / med(checked),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1024)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--results-dir", type=Path, default=HERE / "results" / "partial")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="shm-restore-parts-"))
    try:
        out = measure(args.size_mb, max(1, args.rounds), root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"shm-restore-parts-{stamp}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    m = {k: round(v * 1e3, 1) for k, v in out["median_s"].items()}
    print(
        f"restore {m['restore']} ms = checked copy {m['checked_copy_in_restore']} ms "
        f"+ own work {m['own_work']} ms; copy floor {m['copy_floor']} ms "
        f"({out['restore_over_copy_floor']:.2f}x), checked copy floor "
        f"{m['checked_copy_floor']} ms ({out['restore_over_checked_copy_floor']:.2f}x); "
        f"wrote {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
