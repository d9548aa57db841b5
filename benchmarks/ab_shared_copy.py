"""A/B of a snapshot's copy on one thread and shared among the copy threads, by state size.

    python benchmarks/ab_shared_copy.py [--widths 256 384 512 768] [--rounds 150] [--out F.json]

The end-to-end benchmark's MLP (`training.build_mlp`, depth 4, batch 512, AdamW, torch
on one intra-op thread) at several widths, so its state (parameters and both moments)
spans the sizes around `resumable.snapshot.SHARED_COPY_MIN_BYTES`. For each width, a
memory-tier `Checkpointer` (`small_bench.snapshotter`: a snapshot at every
``maybe_save``, no persist) takes a snapshot after a training step, the threshold set
in turn so the copy runs on the training thread alone (``one``: one
``_foreach_copy_``) or shared among `copy_threads` threads (``shared``), the two
alternating step by step in ABBA order, with plain steps between them. ``maybe_save``
is timed around the call; its medians and fastest samples are compared. Writes a JSON
file (``--out``, default ``benchmarks/results/ab-shared-copy-<UTC stamp>.json``) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import torch  # noqa: E402
from small_bench import machine, snapshotter  # noqa: E402
from training import build_mlp  # noqa: E402

import resumable.snapshot as snapshot_mod  # noqa: E402

WAYS = {"one": 1 << 62, "shared": 0}  # SHARED_COPY_MIN_BYTES for each way


def measure(width: int, rounds: int, work: Path, shm: Path) -> dict[str, Any]:
    """``maybe_save``'s seconds each way, and the plain steps', for the MLP of ``width``."""
    torch.manual_seed(0)
    model = build_mlp(width, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 256, generator=gen), torch.randint(0, 10, (512,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()  # creates the moments
    state = {"model": model, "optim": opt}
    saves: dict[str, list[float]] = {w: [] for w in WAYS}
    plain: list[float] = []
    kept = snapshot_mod.SHARED_COPY_MIN_BYTES
    with snapshotter(work / f"w{width}", state, shm) as ck:
        n = 0
        for way in (*WAYS, *WAYS):  # warm-up: slots made, share-outs planned
            snapshot_mod.SHARED_COPY_MIN_BYTES = WAYS[way]
            step()
            n += 1
            ck.maybe_save(n)
        try:
            for r in range(rounds):
                order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
                for way in (*order, None):
                    t0 = time.perf_counter()
                    step()
                    t1 = time.perf_counter()
                    if way is None:
                        plain.append(t1 - t0)
                        continue
                    snapshot_mod.SHARED_COPY_MIN_BYTES = WAYS[way]
                    n += 1
                    ck.maybe_save(n)
                    saves[way].append(time.perf_counter() - t1)
        finally:
            snapshot_mod.SHARED_COPY_MIN_BYTES = kept
        nbytes = ck._parts.saver._memory.arena._plan.nbytes  # type: ignore[union-attr]
    ms = {w: {"median": statistics.median(v) * 1e3, "min": min(v) * 1e3} for w, v in saves.items()}
    return {
        "width": width,
        "state_mib": round(nbytes / 2**20, 2),
        "step_ms": round(statistics.median(plain) * 1e3, 2),
        "maybe_save_ms": {w: {k: round(v, 3) for k, v in m.items()} for w, m in ms.items()},
        "shared_over_one": round(ms["shared"]["median"] / ms["one"]["median"], 3),
        "samples_ms": {w: [round(s * 1e3, 4) for s in v] for w, v in saves.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 384, 512, 768])
    ap.add_argument("--rounds", type=int, default=150, help="snapshots each way per width")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if snapshot_mod.copy_threads() < 2:
        sys.exit("one copy thread here: nothing to compare")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = args.out or HERE / "results" / f"ab-shared-copy-{stamp}.json"
    work = Path(tempfile.mkdtemp(prefix="ab-shared-copy-"))
    shm = Path(tempfile.mkdtemp(prefix="ab-shared-copy-", dir="/dev/shm"))
    try:
        rows = [measure(w, args.rounds, work, shm) for w in args.widths]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result = {
        "date": stamp,
        "machine": machine(),
        "copy_threads": snapshot_mod.copy_threads(),
        "rounds": args.rounds,
        "threshold_mib": snapshot_mod.SHARED_COPY_MIN_BYTES / 2**20,
        "widths": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("| width | state MiB | step ms | maybe_save one thread ms | shared ms | shared ÷ one |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        one, sh = r["maybe_save_ms"]["one"], r["maybe_save_ms"]["shared"]
        print(
            f"| {r['width']} | {r['state_mib']} | {r['step_ms']} | {one['median']:.3f} "
            f"(fastest {one['min']:.3f}) | {sh['median']:.3f} (fastest {sh['min']:.3f}) "
            f"| {r['shared_over_one']:.2f} |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
