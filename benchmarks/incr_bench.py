"""Incremental checkpoints (issue 15, "Write only what changed"): bytes written and time
per persist of ``Checkpointer(..., incremental=Incremental())`` against the same
``Checkpointer`` with ``incremental=False``, side by side on the same training state.

    python benchmarks/incr_bench.py              # full size (~5 min on 2 cores)
    python benchmarks/incr_bench.py --quick      # smaller state (~1 min)
    python benchmarks/incr_bench.py --docs       # ... and rewrite its block in docs/performance.md

(`run.py` calls `run_phase` as a phase of ``make bench`` (``--no-incr`` leaves it out) and
`report.py` renders the block from the run's JSON; alone, this prints the results JSON
and, with ``--docs``, writes ``benchmarks/results/incr-<date>.json`` and rewrites only the
block between the markers of docs/performance.md, which `report.py` shows for a run
without this phase.)

Every checkpointer persists with ``persist="sync"`` and ``keep=Keep(last=2)``;
``save(step)`` returns after the durable commit, then ``wait()`` (which also waits for
the mirror's upload). At every persist point each checkpointer of the shape saves the
same state once, the first one alternating between persist points. Per persist the
figures come from the root's audit log: the ``commit`` event's ``bytes`` (the
checkpoint's own data files and manifest) and ``duration_s`` (writing, fsync, commit),
and, with a mirror, the ``mirror_commit`` event's ``bytes`` and ``duration_s`` (the
upload); ``save()``'s wall time (which also holds the copy of the state) is recorded
beside them, and each committed manifest's ``format_version`` and ``refs``. The first
persist of an incremental checkpointer is always whole (its writer remembers nothing
yet): medians are over the persists after the first, for every mode alike, and the first
is shown apart. Ratios are the full mode's median ÷ the incremental mode's.

**Fine-tuning.** A residual stack of ``depth`` frozen ``Linear(width, width)`` layers
(``requires_grad=False``), each with a trainable low-rank adapter (``width -> rank ->
width``, LoRA-like), and a trainable classification head; AdamW on the trainable
parameters only; batches of random inputs and labels (8 rows), ``every`` steps (3)
between persists. State: ``{"model": model, "optim": optimizer}``. Full size: 16 layers
of 2048, rank 8, 256 classes: 98 % of the parameters frozen, 276 MiB of state of which
about 12 MiB (trainable parameters and their two moments) changes between persists.
After the last persist, a fresh state restored from each root is compared with the
live one (the embedding runs do the same).

**Mirror.** The same shape, fewer persists, each checkpointer with
``mirror="s3://bench/incr-<mode>"`` (``mirror_keep=Keep(last=2)``) on a SeaweedFS server
started on free loopback ports (as ``s3_bench.py`` does; credentials and endpoint in
``storage_options``): bytes uploaded per checkpoint and the upload's time.

**Embedding table.** ``nn.Embedding(rows, dim, sparse=True)`` (full size: 524,288 rows of
128 float32, 256 MiB) and a dense MLP (``dim -> hidden -> 1``); each sample sums
``ids`` rows; ``torch.optim.SGD`` (no momentum, no weight decay: it adds the sparse
gradient to the touched rows only, so every other row keeps its bytes) on the table and
AdamW on the MLP. Two touch patterns, each its own training run: *Zipf*: ids drawn with
probability proportional to ``1 / (id + 1) ** s`` (s = 1.2) over a table sorted by
frequency (hot ids first, as production tables usually are); *uniform*: ids drawn
uniformly, where rows changed are spread over the whole table (large chunks cannot help).
Each run compares whole checkpoints with incremental ones at ``chunk_bytes`` 4 MiB
(the default: 8,192 rows per chunk), 64 KiB (128 rows) and 4 KiB (8 rows, the
smallest chunk ``Incremental`` takes: rows changed at random leave most such chunks
unchanged, at the price of many extents to restore). Between persists ``every``
steps of ``batch x ids`` draws (full size: 4 x 256 x 4 = 4,096); the rows that actually
changed are counted by comparing the table with a copy taken at the previous persist
(and the share of chunks holding one), so that the bytes written can be read against
what changed. 24 persist points per pattern (full size), so that the ``min_live``
cleaner's rewrites and the checkpoints retention keeps because kept ones refer to them
show in the figures: each root's committed checkpoints and their bytes are recorded
after every persist.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from incr_report import (  # noqa: E402
    BEGIN,
    DOCS,
    END,
    GOAL_EMBEDDING_PCT,
    GOAL_FINETUNE_X,
    GOAL_RESTORE_X,
    MCORE_END,
    KiB,
    MiB,
    chunk_label,
    measured,
    newest,
    render,
    write_docs,
)

__all__ = [
    "BEGIN",
    "END",
    "MCORE_END",
    "Settings",
    "main",
    "measured",
    "newest",
    "render",
    "run_phase",
    "write_docs",
]
BUCKET = "bench"

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(f"[incr {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    """What to measure. ``ft_*``: the fine-tuning shape (``ft_persists`` persist points,
    ``ft_every`` steps apart); ``s3_persists``: persist points of the mirror run (0: no
    mirror run); ``emb_*``: the embedding shape; ``chunk_bytes``: the incremental
    checkpointers' chunk sizes in the embedding runs; ``threads``: torch threads;
    ``restore_reps``: timed rounds of restores per root."""

    ft_width: int = 2048
    ft_depth: int = 16
    ft_rank: int = 8
    ft_classes: int = 256
    ft_batch: int = 8
    ft_every: int = 3
    ft_persists: int = 8
    s3_persists: int = 5
    emb_rows: int = 524_288
    emb_dim: int = 128
    emb_hidden: int = 256
    emb_batch: int = 256
    emb_ids: int = 4
    emb_every: int = 4
    emb_persists: int = 24
    zipf_s: float = 1.2
    patterns: tuple[str, ...] = ("zipf", "uniform")
    chunk_bytes: tuple[int, ...] = (4 * MiB, 64 * KiB, 4 * KiB)
    threads: int = 2
    seed: int = 0
    min_bytes: int | None = None  # None: the library's default (toy states pass 0)
    restore_reps: int = 9

    @classmethod
    def quick(cls) -> Settings:
        """About a quarter of the state; fewer persists."""
        return cls(
            ft_width=1024,
            ft_depth=16,
            ft_persists=6,
            s3_persists=4,
            emb_rows=131_072,
            emb_every=1,
            emb_persists=6,
        )

    @classmethod
    def toy(cls) -> Settings:
        """The smoke test's: seconds, no figure means anything."""
        return cls(
            ft_width=64,
            ft_depth=4,
            ft_rank=2,
            ft_classes=8,
            ft_batch=4,
            ft_every=1,
            ft_persists=3,
            s3_persists=2,
            emb_rows=4096,
            emb_dim=16,
            emb_hidden=16,
            emb_batch=8,
            emb_ids=2,
            emb_every=1,
            emb_persists=3,
            chunk_bytes=(4 * MiB, 4 * KiB),
            threads=1,
            min_bytes=0,
            restore_reps=2,
        )

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


# ---------------------------------------------------------------------------- helpers


def machine() -> dict[str, Any]:
    import torch

    import resumable

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "host": socket.gethostname().split(".")[0],
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "resumable": resumable.__version__,
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _mode_key(chunk: int) -> str:
    return f"incr_{chunk_label(chunk).replace(' ', '')}"


def _audit(root: Path) -> list[dict[str, Any]]:
    path = root / "audit.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _manifest(root: Path, step: int) -> dict[str, Any]:
    path = root / f"step-{step:012d}" / "manifest.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _tree_bytes(root: Path) -> int:
    """Bytes of the committed checkpoints in ``root`` (what retention keeps; not the
    audit log, nor directories a deleting thread has not removed yet)."""
    total = 0
    for step in _steps_on_disk(root):
        for dirpath, _, files in os.walk(root / f"step-{step:012d}"):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(dirpath, f))
    return total


def _steps_on_disk(root: Path) -> list[int]:
    """Committed checkpoints in ``root`` (a ``step-N`` directory with a manifest)."""
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def _stat(values: list[float], digits: int = 6) -> dict[str, Any]:
    """Value 0 apart as ``first``; median, mean, min and max over the rest."""
    rest = values[1:] or values
    return {
        "first": round(values[0], digits) if values else None,
        "median": round(statistics.median(rest), digits) if rest else None,
        "mean": round(statistics.fmean(rest), digits) if rest else None,
        "min": round(min(rest), digits) if rest else None,
        "max": round(max(rest), digits) if rest else None,
        "n": len(rest),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _checkpointer(root: Path | str, state: Mapping[str, Any], incremental: Any, **kw: Any) -> Any:
    import resumable
    from resumable import Checkpointer

    return Checkpointer(
        root,
        state,
        persist="sync",
        keep=resumable.Keep(last=2),
        capture_rng=False,
        incremental=incremental,
        **kw,
    )


def _incremental(chunk: int | None, min_bytes: int | None = None) -> Any:
    """The library's defaults, but for the chunk size (the embedding runs) and
    ``min_bytes`` (0 at toy sizes, whose states are under its 1 MiB default)."""
    from resumable import Incremental

    kw: dict[str, int] = {}
    if chunk is not None:
        kw["chunk_bytes"] = chunk
    if min_bytes is not None:
        kw["min_bytes"] = min_bytes
    return Incremental(**kw)


class SideBySide:
    """Several checkpointers on one state, each in its own root; `persist` saves the
    state through each (the first alternating) and `results` reads back their audit
    logs."""

    def __init__(
        self,
        work: Path,
        state: Mapping[str, Any],
        modes: Mapping[str, Any],
        *,
        mirror: Callable[[str], str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        import resumable

        self.roots = {name: work / name for name in modes}
        for root in self.roots.values():
            shutil.rmtree(root, ignore_errors=True)
        self.cks: dict[str, Any] = {}
        self.modes = dict(modes)
        self.work = work
        self.mirrored = mirror is not None
        self.mirror_kw: dict[str, dict[str, Any]] = {n: {} for n in modes}
        for name, inc in modes.items():
            if mirror is not None:
                self.mirror_kw[name] = {
                    "mirror": mirror(name),
                    "mirror_keep": resumable.Keep(last=2),
                    "storage_options": dict(storage_options or {}),
                }
            self.cks[name] = _checkpointer(self.roots[name], state, inc, **self.mirror_kw[name])
        self.wall: dict[str, dict[int, dict[str, float]]] = {n: {} for n in modes}
        self.manifests: dict[str, dict[int, dict[str, Any]]] = {n: {} for n in modes}
        self.count = 0

    def persist(self, step: int) -> None:
        names = list(self.cks)
        k = self.count % len(names)
        self.count += 1
        for name in names[k:] + names[:k]:
            ck = self.cks[name]
            t0 = time.perf_counter()
            ck.save(step)
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            self.wall[name][step] = {"save_s": t1 - t0, "total_s": t2 - t0}
            man = _manifest(self.roots[name], step)
            own = sum(int(f.get("size", 0)) for f in man.get("files", {}).values())
            self.manifests[name][step] = {
                "format_version": man.get("format_version"),
                "refs": man.get("refs", []),
                "own_data_bytes": own,
                "root_bytes": _tree_bytes(self.roots[name]),
                "checkpoints_on_disk": len(_steps_on_disk(self.roots[name])),
            }

    def check_restores(self, live: Mapping[str, Any], build: Callable[[], Any]) -> dict[str, Any]:
        """Per mode: a fresh state from ``build()`` restored by a new checkpointer on the
        root (the newest checkpoint, checksums verified) equals ``live`` tensor for tensor
        (True), or differs (the names), or the restore's error. With a mirror, the new
        checkpointer has an empty local root: the checkpoint comes from the mirror."""
        import torch

        from resumable import capture as capture_mod

        want = capture_mod.capture(live, include_rng=False).tensors
        out: dict[str, Any] = {}
        for name, root in self.roots.items():
            ck = None
            try:
                fresh = build()
                kw = self.mirror_kw[name]
                where = self.work / f"restore-{name}" if kw else root
                ck = _checkpointer(where, fresh, self.modes[name], **kw)
                ck.restore()
                got = capture_mod.capture(fresh, include_rng=False).tensors
                bad = sorted(set(want) ^ set(got))
                bad += [k for k in want if k in got and not torch.equal(want[k], got[k])]
                out[name] = True if not bad else bad[:10]
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                if ck is not None:
                    ck.save_on_close = False
                    with contextlib.suppress(Exception):
                        ck.close()
        return out

    def time_restores(self, build: Callable[[], Any], reps: int = 9) -> dict[str, Any]:
        """Per local root (not a mirror run's): seconds of ``restore()`` (the newest
        checkpoint, checksums verified, into a freshly built state) over ``reps`` rounds,
        the roots interleaved and the first rotating, a garbage collection before each;
        a first round, not timed, reads every root once, so that the page cache is warm
        for all alike (large files are written around it, with O_DIRECT). An
        incremental root reads its references from the earlier checkpoints' files."""
        names = [n for n in self.roots if not self.mirror_kw[n]]
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(-1, reps):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                fresh = build()
                ck = _checkpointer(self.roots[name], fresh, self.modes[name])
                # the last sample's state and mappings freed here, not inside this one
                gc.collect()
                try:
                    t0 = time.perf_counter()
                    ck.restore()
                    if i >= 0:
                        times[name].append(time.perf_counter() - t0)
                finally:
                    ck.save_on_close = False
                    with contextlib.suppress(Exception):
                        ck.close()
        return {
            n: {"median": round(statistics.median(v), 6), "samples": [round(x, 6) for x in v]}
            for n, v in times.items()
            if v
        }

    def close(self) -> None:
        for ck in self.cks.values():
            ck.save_on_close = False
            with contextlib.suppress(Exception):
                ck.close()

    def results(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, root in self.roots.items():
            events = _audit(root)
            commits = {e["step"]: e for e in events if e.get("event") == "commit"}
            mirrors = {e["step"]: e for e in events if e.get("event") == "mirror_commit"}
            persists = []
            for step in sorted(self.wall[name]):
                c, m = commits.get(step, {}), mirrors.get(step, {})
                row: dict[str, Any] = {
                    "step": step,
                    "bytes": c.get("bytes"),
                    "commit_s": c.get("duration_s"),
                    "save_s": round(self.wall[name][step]["save_s"], 6),
                    "total_s": round(self.wall[name][step]["total_s"], 6),
                    **self.manifests[name][step],
                }
                if self.mirrored:
                    row["mirror_bytes"] = m.get("bytes")
                    row["mirror_s"] = m.get("duration_s")
                persists.append(row)
            entry: dict[str, Any] = {"persists": persists}
            for key in ("bytes", "commit_s", "save_s", "total_s", "mirror_bytes", "mirror_s"):
                vals = [p[key] for p in persists if isinstance(p.get(key), (int, float))]
                if vals and len(vals) == len(persists):
                    entry[key] = _stat([float(v) for v in vals])
            # persists that refer to earlier checkpoints (format version 2 or 3; the
            # key keeps its name for the results already stored)
            entry["v2_persists"] = sum(1 for p in persists if _refers(p.get("format_version")))
            entry["root_bytes_end"] = _tree_bytes(root)
            entry["steps_kept"] = _steps_on_disk(root)
            out[name] = entry
        return out


def _refers(version: Any) -> bool:
    """Whether a manifest's ``format_version`` is that of a checkpoint that refers to
    earlier ones: 2 (chunks, read only now) or 3 (extents)."""
    return type(version) is int and version >= 2


def _compare(
    modes: dict[str, Any], full: str, incr: str, key: str, what: str = "median"
) -> float | None:
    a = (modes.get(full) or {}).get(key) or {}
    b = (modes.get(incr) or {}).get(key) or {}
    return _ratio(a.get(what), b.get(what))


def _state_bytes(state: Mapping[str, Any]) -> tuple[int, int]:
    from resumable import capture as capture_mod

    tensors = capture_mod.capture(state, include_rng=False).tensors
    return sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)


# ---------------------------------------------------------------------------- fine-tuning


def _finetune_model(s: Settings) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(s.ft_width, s.ft_width)
            self.down = nn.Linear(s.ft_width, s.ft_rank, bias=False)
            self.up = nn.Linear(s.ft_rank, s.ft_width, bias=False)
            nn.init.zeros_(self.up.weight)
            self.base.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.base(x) + self.up(self.down(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(s.ft_depth)))
            self.head = nn.Linear(s.ft_width, s.ft_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    return Model()


def finetune(work: Path, s: Settings, log: Log, *, endpoint: str | None = None) -> dict[str, Any]:
    """The fine-tuning shape; with ``endpoint``, each checkpointer mirrors to the S3
    server there (and ``s3_persists`` persist points instead of ``ft_persists``)."""
    import torch

    def build() -> dict[str, Any]:
        model = _finetune_model(s)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return {"model": model, "optim": torch.optim.AdamW(trainable, lr=1e-3)}

    torch.manual_seed(s.seed)
    state = build()
    model, opt = state["model"], state["optim"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(s.seed + 1)

    def step() -> float:
        x = torch.randn(s.ft_batch, s.ft_width, generator=gen)
        y = torch.randint(0, s.ft_classes, (s.ft_batch,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()  # AdamW's moments exist before the first persist
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in trainable)
    nbytes, ntensors = _state_bytes(state)
    persists = s.s3_persists if endpoint else s.ft_persists
    modes = {"incremental": _incremental(None, s.min_bytes), "full": False}
    opts: dict[str, Any] | None = None
    mirror = None
    if endpoint is not None:
        import s3_bench

        opts = s3_bench.ClientSettings().storage_options(endpoint)
        mirror = lambda name: f"s3://{BUCKET}/incr-{name}"  # noqa: E731
    log(
        f"fine-tuning{' + mirror' if endpoint else ''}: {nbytes / MiB:.0f} MiB of state, "
        f"{100 * (1 - n_train / n_params):.1f} % of parameters frozen, {persists} persists"
    )
    sbs = SideBySide(work, state, modes, mirror=mirror, storage_options=opts)
    steps, losses, step_s = 1, [], []
    try:
        for i in range(persists):
            if i:
                t0 = time.perf_counter()
                for _ in range(s.ft_every):
                    losses.append(step())
                    steps += 1
                step_s.append((time.perf_counter() - t0) / s.ft_every)
            sbs.persist(steps)
    finally:
        sbs.close()
    got = sbs.results()
    restored = sbs.check_restores(state, build)
    restore_s = sbs.time_restores(build, s.restore_reps) if endpoint is None else {}
    out: dict[str, Any] = {
        "model": {
            "width": s.ft_width,
            "depth": s.ft_depth,
            "adapter_rank": s.ft_rank,
            "classes": s.ft_classes,
            "batch": s.ft_batch,
            "params": n_params,
            "trainable_params": n_train,
            "frozen_pct": round(100 * (1 - n_train / n_params), 2),
        },
        "state_bytes": nbytes,
        "tensors": ntensors,
        "steps_between_persists": s.ft_every,
        "persist_points": persists,
        "median_step_s": round(statistics.median(step_s), 6) if step_s else None,
        "last_loss": round(losses[-1], 4) if losses else None,
        "modes": got,
        "restored_equal": restored,
        "restore_s": restore_s,
        "ratios": {
            "bytes": _compare(got, "full", "incremental", "bytes"),
            "commit_s": _compare(got, "full", "incremental", "commit_s"),
            "save_s": _compare(got, "full", "incremental", "save_s"),
        },
    }
    if endpoint is not None:
        out["ratios"]["mirror_bytes"] = _compare(got, "full", "incremental", "mirror_bytes")
        out["ratios"]["mirror_s"] = _compare(got, "full", "incremental", "mirror_s")
    keys = ("commit_s", "save_s", "mirror_s") if endpoint else ("commit_s", "save_s")
    out["ratios_of_min"] = {k: _compare(got, "full", "incremental", k, "min") for k in keys}
    r = out["ratios"]
    log(
        f"fine-tuning{' + mirror' if endpoint else ''}: full ÷ incremental: bytes "
        f"{r['bytes']}x, commit time {r['commit_s']}x"
        + (f", upload bytes {r['mirror_bytes']}x, time {r['mirror_s']}x" if endpoint else "")
    )
    return out


@contextlib.contextmanager
def seaweedfs(work: Path, log: Log) -> Iterator[str]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    import s3_bench

    with s3_bench.seaweedfs(work, BUCKET, log) as endpoint:
        yield endpoint


# ---------------------------------------------------------------------------- embedding


def _embedding_model(s: Settings) -> Any:
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(s.emb_rows, s.emb_dim, sparse=True)
            self.mlp = nn.Sequential(
                nn.Linear(s.emb_dim, s.emb_hidden), nn.ReLU(), nn.Linear(s.emb_hidden, 1)
            )

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.table(ids).sum(1)).squeeze(-1)

    return Model()


class Draws:
    """Row ids of a touch pattern: ``zipf`` (rank ``i`` with probability proportional to
    ``1 / (i + 1) ** s``, hot ids first) or ``uniform``."""

    def __init__(self, pattern: str, rows: int, s: float, seed: int) -> None:
        import numpy as np

        self.pattern, self.rows = pattern, rows
        self.rng = np.random.default_rng(seed)
        self.cdf = None
        if pattern == "zipf":
            p = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s
            self.cdf = np.cumsum(p / p.sum())
        elif pattern != "uniform":
            raise ValueError(f"unknown pattern {pattern!r}")

    def __call__(self, shape: tuple[int, ...]) -> Any:
        import numpy as np

        if self.cdf is None:
            ids = self.rng.integers(0, self.rows, size=shape)
        else:
            ids = np.searchsorted(self.cdf, self.rng.random(size=shape), side="right")
            ids = np.minimum(ids, self.rows - 1)
        return ids.astype(np.int64)


def embedding(work: Path, s: Settings, pattern: str, log: Log) -> dict[str, Any]:
    """One training run of the embedding shape under ``pattern``, whole checkpoints
    beside incremental ones at every ``chunk_bytes``."""
    import torch

    def build() -> dict[str, Any]:
        model = _embedding_model(s)
        return {
            "model": model,
            "sparse_optim": torch.optim.SGD([model.table.weight], lr=0.05),
            "dense_optim": torch.optim.AdamW(model.mlp.parameters(), lr=1e-3),
        }

    torch.manual_seed(s.seed)
    state = build()
    model, sparse_opt, dense_opt = state["model"], state["sparse_optim"], state["dense_optim"]
    draws = Draws(pattern, s.emb_rows, s.zipf_s, s.seed + 7)
    gen = torch.Generator().manual_seed(s.seed + 3)
    touched: list[Any] = []

    def step() -> None:
        ids = draws((s.emb_batch, s.emb_ids))
        touched.append(ids)
        y = torch.randint(0, 2, (s.emb_batch,), generator=gen).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.from_numpy(ids)), y)
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()

    step()  # AdamW's moments exist before the first persist
    touched.clear()
    nbytes, ntensors = _state_bytes(state)
    table = model.table.weight
    table_bytes = table.numel() * table.element_size()
    row_bytes = s.emb_dim * table.element_size()
    modes: dict[str, Any] = {"full": False}
    for chunk in s.chunk_bytes:
        modes[_mode_key(chunk)] = _incremental(chunk, s.min_bytes)
    log(
        f"embedding, {pattern}: {nbytes / MiB:.0f} MiB of state ({table_bytes / MiB:.0f} MiB "
        f"table), {s.emb_persists} persists, modes {', '.join(modes)}"
    )
    sbs = SideBySide(work, state, modes)
    prev = table.detach().clone()
    intervals: list[dict[str, Any]] = []
    steps = 1
    try:
        for i in range(s.emb_persists):
            if i:
                for _ in range(s.emb_every):
                    step()
                    steps += 1
                with torch.no_grad():
                    changed = (table != prev).any(dim=1).nonzero().flatten()
                    prev.copy_(table)
                import numpy as np

                drawn = np.unique(np.concatenate([t.reshape(-1) for t in touched]))
                touched.clear()
                rows = changed.numpy()
                row_info: dict[str, Any] = {
                    "step": steps,
                    "ids_drawn": s.emb_every * s.emb_batch * s.emb_ids,
                    "distinct_ids": int(drawn.size),
                    "rows_changed": int(rows.size),
                    "rows_changed_pct": round(100 * rows.size / s.emb_rows, 4),
                    "changed_outside_drawn": int(np.setdiff1d(rows, drawn).size),
                    "chunks_touched_pct": {},
                }
                for chunk in s.chunk_bytes:
                    per = max(1, chunk // row_bytes)
                    n_chunks = -(-table_bytes // chunk)
                    hit = np.unique((rows * row_bytes) // chunk).size if rows.size else 0
                    row_info["chunks_touched_pct"][chunk_label(chunk)] = round(
                        100 * hit / n_chunks, 3
                    )
                    row_info.setdefault("rows_per_chunk", {})[chunk_label(chunk)] = per
                intervals.append(row_info)
            sbs.persist(steps)
    finally:
        sbs.close()
    got = sbs.results()
    del prev
    restored = sbs.check_restores(state, build)
    restore_s = sbs.time_restores(build, s.restore_reps)
    full_med = (got.get("full", {}).get("bytes") or {}).get("median")
    summary: dict[str, Any] = {}
    for chunk in s.chunk_bytes:
        key = _mode_key(chunk)
        b = got.get(key, {}).get("bytes") or {}
        summary[key] = {
            "chunk_bytes": chunk,
            "bytes_pct_of_full_median": round(100 * b["median"] / full_med, 3)
            if full_med and b.get("median") is not None
            else None,
            "bytes_pct_of_full_mean": round(100 * b["mean"] / full_med, 3)
            if full_med and b.get("mean") is not None
            else None,
            "bytes_ratio": _compare(got, "full", key, "bytes"),
            "commit_s_ratio": _compare(got, "full", key, "commit_s"),
        }
        log(
            f"embedding, {pattern}, chunks of {chunk_label(chunk)}: "
            f"{summary[key]['bytes_pct_of_full_median']} % of a whole checkpoint's bytes "
            f"(median), {summary[key]['bytes_pct_of_full_mean']} % (mean)"
        )
    rows_pct = [r["rows_changed_pct"] for r in intervals]
    return {
        "pattern": pattern,
        "zipf_s": s.zipf_s if pattern == "zipf" else None,
        "model": {
            "rows": s.emb_rows,
            "dim": s.emb_dim,
            "hidden": s.emb_hidden,
            "batch": s.emb_batch,
            "ids_per_sample": s.emb_ids,
            "table_bytes": table_bytes,
        },
        "state_bytes": nbytes,
        "tensors": ntensors,
        "steps_between_persists": s.emb_every,
        "persist_points": s.emb_persists,
        "intervals": intervals,
        "rows_changed_pct_median": round(statistics.median(rows_pct), 4) if rows_pct else None,
        "rows_changed_pct_max": max(rows_pct) if rows_pct else None,
        "modes": got,
        "restored_equal": restored,
        "restore_s": restore_s,
        "summary": summary,
    }


def touch_model(s: Settings, exponents: tuple[float, ...] = (1.0, 1.1, 1.2, 1.5)) -> dict[str, Any]:
    """Not measured by training: for the embedding table's size and one interval's draws,
    the share of rows drawn and of chunks holding a drawn row, per Zipf exponent and for
    uniform draws (median of 3 draws each). It shows how far the measured figures depend
    on the exponent chosen."""
    import numpy as np

    draws = s.emb_every * s.emb_batch * s.emb_ids
    row_bytes = s.emb_dim * 4
    table_bytes = s.emb_rows * row_bytes
    out: dict[str, Any] = {"draws_per_interval": draws, "rows": s.emb_rows, "patterns": {}}
    for name in [*(f"zipf s={e:g}" for e in exponents), "uniform"]:
        exp = float(name.split("=")[1]) if "=" in name else 0.0
        draw = Draws("zipf" if exp else "uniform", s.emb_rows, exp, s.seed + 11)
        rows: list[float] = []
        chunks: dict[str, list[float]] = {chunk_label(c): [] for c in s.chunk_bytes}
        for _ in range(3):
            ids = np.unique(draw((draws,)))
            rows.append(100 * ids.size / s.emb_rows)
            for c in s.chunk_bytes:
                n = -(-table_bytes // c)
                chunks[chunk_label(c)].append(100 * np.unique(ids * row_bytes // c).size / n)
        out["patterns"][name] = {
            "rows_pct": round(statistics.median(rows), 3),
            "chunks_pct": {k: round(statistics.median(v), 2) for k, v in chunks.items()},
        }
    return out


# ---------------------------------------------------------------------------- the phase


def _get(e: Any, key: str) -> Any:
    return e.get(key) if isinstance(e, dict) else None


def goals(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals: fine-tuning bytes and time per persist >= 5x less than whole
    checkpoints (and the mirror's upload, the same); a restore of an incremental root
    <= 1.1x a whole one's; an embedding table's incremental persist <= 10 % of a whole
    one's bytes, per pattern and chunk size."""
    rows: list[dict[str, Any]] = []

    def x_goal(name: str, e: Any, key: str, of: list[str]) -> None:
        got = _get(_get(e, "ratios"), key)
        row = {
            "goal": name,
            "measured": got,
            "limit": GOAL_FINETUNE_X,
            "unit": "x",
            "met": None if got is None else got >= GOAL_FINETUNE_X,
            "of": of,
        }
        cross = _get(_get(e, "ratios_of_min"), key)
        if cross is not None:
            row.update(cross_check=cross, cross_check_is="ratio of the fastest samples")
        rows.append(row)

    ft, s3 = out.get("finetune"), out.get("finetune_s3")
    x_goal("fine-tuning: bytes per persist, whole ÷ incremental ≥ 5x", ft, "bytes", ["finetune"])
    x_goal("fine-tuning: time per persist (commit), whole ÷ incremental ≥ 5x",
           ft, "commit_s", ["finetune"])  # fmt: skip
    x_goal("fine-tuning, mirror: bytes uploaded, whole ÷ incremental ≥ 5x",
           s3, "mirror_bytes", ["finetune_s3"])  # fmt: skip
    x_goal("fine-tuning, mirror: upload time, whole ÷ incremental ≥ 5x",
           s3, "mirror_s", ["finetune_s3"])  # fmt: skip

    def restore_goal(name: str, e: Any, of: list[str]) -> None:
        """Each incremental root's restore (median) ÷ the whole root's, <= 1.1x."""
        t = _get(e, "restore_s") or {}
        full = _get(t.get("full"), "median")
        for mode, v in t.items():
            med = _get(v, "median")
            if mode == "full" or not full or med is None:
                continue
            got = round(med / full, 3)
            whole_only = _get(_get(_get(e, "modes"), mode), "v2_persists") == 0
            row = {
                "goal": f"{name}{'' if mode == 'incremental' else f' ({mode})'}: restore, "
                "incremental ÷ whole ≤ 1.1x"
                + (" (every checkpoint of this root was written whole)" if whole_only else ""),
                "measured": got,
                "limit": GOAL_RESTORE_X,
                "unit": "x at most",
                "met": got <= GOAL_RESTORE_X,
                "of": [*of, "restore_s", mode],
            }
            fastest = [min(_get(x, "samples") or [0.0]) for x in (v, t["full"])]
            if all(fastest):
                row.update(
                    cross_check=round(fastest[0] / fastest[1], 3),
                    cross_check_is="ratio of the fastest samples",
                )
            rows.append(row)

    restore_goal("fine-tuning", ft, ["finetune"])
    for pattern, e in (out.get("embedding") or {}).items():
        restore_goal(f"embedding, {pattern}", e, ["embedding", pattern])
    for pattern, e in (out.get("embedding") or {}).items():
        for key, srow in (e.get("summary") or {}).items() if isinstance(e, dict) else []:
            got = srow.get("bytes_pct_of_full_median")
            rows.append(
                {
                    "goal": f"embedding, {pattern}, chunks of {chunk_label(srow['chunk_bytes'])}: "
                    "bytes per persist ≤ 10 % of a whole checkpoint (median)",
                    "measured": got,
                    "limit": GOAL_EMBEDDING_PCT,
                    "unit": "%",
                    "met": None if got is None else got <= GOAL_EMBEDDING_PCT,
                    "cross_check": srow.get("bytes_pct_of_full_mean"),
                    "cross_check_is": "mean over the persists after the first",
                    "of": ["embedding", pattern, key],
                }
            )
    return rows


def run_phase(
    work: Path, settings: Settings = Settings(), log: Log = _print, *, s3: bool = True
) -> dict[str, Any]:
    """Measure every shape; one that fails is recorded with its error and the others
    still run. ``work`` is removed at the end. Raises if `resumable.Incremental` is
    missing (`run.py` records it)."""
    import torch

    import resumable

    if not hasattr(resumable, "Incremental"):
        raise RuntimeError("resumable.Incremental not found: this resumable has no incremental")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    started = time.perf_counter()
    out: dict[str, Any] = {
        "schema": 1,
        "machine": machine(),
        "settings": settings.to_json(),
        "how": 'persist="sync", keep=Keep(last=2), save() + wait() at each persist point',
    }

    def guarded(key: str, fn: Callable[[], Any], into: dict[str, Any] | None = None) -> None:
        target = out if into is None else into
        try:
            target[key] = fn()
        except Exception as exc:
            log(f"{key} failed: {exc!r}"[:500])
            target[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    try:
        guarded("finetune", lambda: finetune(work / "ft", settings, log))
        if not s3 or settings.s3_persists < 1:
            out["finetune_s3"] = {"error": "skipped (--no-s3)"}
        else:

            def mirrored() -> dict[str, Any]:
                with seaweedfs(work / "seaweedfs", log) as endpoint:
                    got = finetune(work / "ft-s3", settings, log, endpoint=endpoint)
                got["server"] = "SeaweedFS on loopback, same machine"
                return got

            guarded("finetune_s3", mirrored)
        guarded("touch_model", lambda: touch_model(settings))
        out["embedding"] = {}
        for pattern in settings.patterns:
            guarded(
                pattern,
                lambda p=pattern: embedding(work / f"emb-{p}", settings, p, log),  # type: ignore[misc]
                out["embedding"],
            )
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(work, ignore_errors=True)
    out["machine"]["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["goals"] = goals(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller state, fewer persists")
    ap.add_argument("--no-s3", action="store_true", help="leave out the mirror run")
    ap.add_argument("--patterns", nargs="+", choices=["zipf", "uniform"], default=None)
    ap.add_argument("--docs", action="store_true", help="save the results, rewrite the block")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results")
    ap.add_argument("--work-dir", type=Path, default=HERE.parent / "runs" / "incr-bench")
    args = ap.parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    if args.patterns:
        settings = replace(settings, patterns=tuple(args.patterns))
    out = run_phase(args.work_dir, settings, s3=not args.no_s3)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out["date"] = stamp
    if args.docs:
        path = args.results_dir / f"incr-{stamp}.json"
        out["file"] = path.name
        path.write_text(json.dumps(out, indent=1) + "\n")
        write_docs(out, f"benchmarks/results/{path.name}")
        _print(f"wrote {path} and its block in {DOCS}")
        print(json.dumps(out["goals"], indent=1))
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
