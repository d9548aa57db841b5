"""The first saves of a launch: how long each one blocks the training loop while the
persist worker process still starts.

    python benchmarks/first_saves.py --out             # ~1.5 min on 2 cores
    python benchmarks/first_saves.py --quick           # ~30 s

A launch: a fresh root, an MLP with AdamW (``--mib`` of parameters, 4 by default; three
times that of state), ``Checkpointer(root, state, persist="process", on_busy=...,
persist_every=Every(steps=K))`` (K = 2 by default: saves closer together than the worker
process takes to start) and `restore()`, then ``3 K`` training steps with `maybe_save`
after each. Timed on the training thread: each
`maybe_save` that started a persist (its *block*) and the snapshot copy inside it
(`Checkpointer.last_snapshot_s`). Four variants, the first rotating launch by launch:
``on_busy="wait"``, ``"skip"``, *wait-all*: ``"wait"`` with `Checkpointer.wait`
before each due save (how ``"wait"`` behaved before a persist could queue), and
*wait-torch*: ``"wait"`` with a worker process that imports torch as it starts (as every
worker did before it stopped needing torch).
Reported per save index (first, second, third of the launch, and *all*: a launch's
three summed): the median block, the median snapshot, and block ÷ snapshot. A block
near its snapshot means the save did not wait for the worker. Writes
``benchmarks/results/first-saves-<date>.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import resumable
from resumable.pipeline import _worker_process

HERE = Path(__file__).resolve().parent


def _model(mib: float) -> nn.Module:
    width = 1024
    layers = max(1, round(mib * 2**20 / (4 * width * width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


VARIANTS = ("wait", "wait-torch", "wait-all", "skip")

_TORCH_BOOT = _worker_process._WORKER_BOOT.replace(
    "from resumable.pipeline._worker import worker_main\n",
    "import torch\nfrom resumable.pipeline._worker import worker_main\n",
)
assert _TORCH_BOOT != _worker_process._WORKER_BOOT


@contextlib.contextmanager
def _worker_boot(variant: str) -> Iterator[None]:
    """For ``"wait-torch"``, a worker process that imports torch as it starts, as every
    worker did before it stopped needing torch (docs/decisions.md)."""
    plain = _worker_process._WORKER_BOOT
    if variant == "wait-torch":
        _worker_process._WORKER_BOOT = _TORCH_BOOT
    try:
        yield
    finally:
        _worker_process._WORKER_BOOT = plain


def one_launch(root: Path, *, variant: str, mib: float, every: int) -> dict[str, Any]:
    """One launch's three saves: block and snapshot seconds of each. ``variant``: an
    ``on_busy`` value, ``"wait-all"``: ``"wait"`` with `Checkpointer.wait` called
    before each due save, which is what ``"wait"`` did before a persist could queue
    behind the running one, or ``"wait-torch"``: ``"wait"`` with a worker that imports
    torch as it starts, as it did before it stopped needing torch."""
    emulate_wait_all = variant == "wait-all"
    on_busy = "wait" if variant in ("wait-all", "wait-torch") else variant
    torch.manual_seed(0)
    model = _model(mib)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 1024)
    with _worker_boot(variant):  # the worker may start with the Checkpointer
        ck = resumable.Checkpointer(
            root,
            {"model": model, "optim": optim},
            persist="process",
            on_busy=on_busy,
            persist_every=resumable.Every(steps=every),
            keep=resumable.Keep(last=2),
        )
        blocks: list[float] = []
        snaps: list[float] = []
        with ck:
            ck.restore()
            for step in range(1, 3 * every + 1):
                model(x).square().mean().backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                if emulate_wait_all and step % every == 0:
                    ck.wait()  # what on_busy="wait" did before persists could queue
                started = ck.maybe_save(step)
                took = time.perf_counter() - t0
                if started:
                    blocks.append(took)
                    snaps.append(float(ck.last_snapshot_s or 0.0))
            t0 = time.perf_counter()
    return {"block_s": blocks, "snapshot_s": snaps, "close_s": time.perf_counter() - t0}


def run(launches: int, mib: float, every: int, log: Any = print) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="first-saves-"))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        for i in range(launches):
            k = i % len(VARIANTS)
            for variant in VARIANTS[k:] + VARIANTS[:k]:  # the first rotates
                root = work / f"{variant}-{i}"
                got = one_launch(root, variant=variant, mib=mib, every=every)
                runs[variant].append(got)
                shutil.rmtree(root, ignore_errors=True)
                log(
                    f"  launch {i} {variant}: blocks "
                    + ", ".join(f"{b * 1e3:.0f} ms" for b in got["block_s"])
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {}
    for on_busy, got in runs.items():
        rows = []
        for k in range(3):
            blocks = [g["block_s"][k] for g in got if len(g["block_s"]) > k]
            snaps = [g["snapshot_s"][k] for g in got if len(g["snapshot_s"]) > k]
            if not blocks:
                continue
            b, s = statistics.median(blocks), statistics.median(snaps)
            rows.append(
                {
                    "save": k + 1,
                    "n": len(blocks),
                    "block_s": b,
                    "snapshot_s": s,
                    "ratio": b / s if s else None,
                }
            )
        totals = [sum(g["block_s"]) for g in got]
        snaps_all = [sum(g["snapshot_s"]) for g in got]
        if totals:
            b, s = statistics.median(totals), statistics.median(snaps_all)
            rows.append(
                {
                    "save": "all",
                    "n": len(totals),
                    "block_s": b,
                    "snapshot_s": s,
                    "ratio": b / s if s else None,
                }
            )
        summary[on_busy] = rows
    return {
        "machine": {
            "cpus": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "resumable": resumable.__version__,
        "settings": {"launches": launches, "mib": mib, "every": every},
        "summary": summary,
        "runs": runs,
    }


def table(out: dict[str, Any]) -> str:
    lines = [
        "| variant | save of the launch | block (median) | snapshot (median) | block ÷ snapshot |",
        "|---|---|---|---|---|",
    ]
    for on_busy, rows in out["summary"].items():
        for r in rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            block, snap = r["block_s"] * 1e3, r["snapshot_s"] * 1e3
            lines.append(f"| {on_busy} | {r['save']} | {block:.1f} ms | {snap:.1f} ms | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--launches", type=int, default=None)
    ap.add_argument("--mib", type=float, default=4.0, help="parameter MiB (state: 3x)")
    ap.add_argument("--every", type=int, default=2, help="persist every K steps")
    ap.add_argument("--label", default="", help="added to the results file's name")
    ap.add_argument(
        "--out", action="store_true", help="write benchmarks/results/first-saves-<date>.json"
    )
    args = ap.parse_args(argv)
    launches = args.launches or (3 if args.quick else 6)
    out = run(launches, args.mib, args.every)
    out["label"] = args.label
    print(table(out))
    if args.out:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        label = f"-{args.label}" if args.label else ""
        path = HERE / "results" / f"first-saves{label}-{stamp}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
