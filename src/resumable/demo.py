"""The demo job: a small classifier on scikit-learn's bundled digits, checkpointed by
`resumable`, that resumes by itself and ends bit-identical however often it is killed.

It exercises everything a real loop has: a shuffling DataLoader with worker processes
(`resumable.data.ResumableDataLoader`), dropout (global torch RNG), AdamW, a learning
rate schedule and a metric carried across restarts. Its last line,
``final step=<N> loss=<float> params_sha256=<hex>``, hashes every model parameter and
optimizer tensor, so two runs print the same line only if they end bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

import resumable
from resumable._shm import SHM_DIR, list_segments, run_key_for, slot_paths, user_dirs
from resumable.data import ResumableDataLoader
from resumable.errors import CheckpointError
from resumable.storage import LocalStorage


@dataclass(frozen=True)
class DemoConfig:
    dir: str
    steps: int = 600
    seed: int = 0
    every: int = 50
    memory_every: int = 1
    workers: int = 2
    batch_size: int = 32
    keep_last: int = 3
    log_every: int = 100
    grace_seconds: float = 30.0
    mirror: str | None = None


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (1797 images of 8x8), split 80/20 deterministically; shipped with sklearn.

    Read from sklearn's data file without importing sklearn (1 to 4 s of a launch here),
    the same arrays `sklearn.datasets.load_digits` returns; through it if the file moved.
    """
    spec = importlib.util.find_spec("sklearn")
    path = None
    if spec is not None and spec.origin is not None:
        path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if path is not None and os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",")
        pixels, target = table[:, :-1], table[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits

        data = load_digits()
        pixels, target = data.data, data.target
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    order = np.random.RandomState(1234).permutation(len(x))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, 10),
    )


def params_sha256(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every model parameter/buffer and every optimizer state tensor, in a
    fixed order (names and values both count)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().cpu().numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print) -> str:
    """Train (resuming from ``cfg.dir`` if it holds checkpoints) and return the final line."""
    # One intra-op thread: CPU kernels are then deterministic run to run.
    # (torch.use_deterministic_algorithms would import the compiler stack: +2 s per start.)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    xtr, ytr, xte, yte = load_digits_tensors()
    train = torch.utils.data.TensorDataset(xtr, ytr)
    loader = ResumableDataLoader(
        train,
        batch_size=cfg.batch_size,
        shuffle=True,
        seed=cfg.seed,
        drop_last=True,
        num_workers=cfg.workers,
    )
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200, gamma=0.5)
    extra = {"loss": float("nan")}
    ckpt = resumable.Checkpointer(
        cfg.dir,
        state={
            "model": model,
            "optim": optimizer,
            "sched": scheduler,
            "data": loader,
            "extra": extra,
        },
        memory_every=resumable.Every(steps=cfg.memory_every) if cfg.memory_every else None,
        persist_every=resumable.Every(steps=cfg.every),
        keep=resumable.Keep(last=cfg.keep_last),
        preemption=resumable.Preemption(grace_seconds=cfg.grace_seconds),
        mirror=cfg.mirror,
    )
    with ckpt:
        step = ckpt.restore()
        echo(f"resumed from step {step}" if step else f"starting fresh in {cfg.dir}")
        t0 = time.perf_counter()
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        while step < cfg.steps:
            for xb, yb in loader:
                loss = loss_fn(model(xb), yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                extra["loss"] = loss.item()
                ckpt.maybe_save(step, metrics={"loss": extra["loss"]})
                if step % cfg.log_every == 0:
                    echo(f"step {step} loss={extra['loss']:.4f} epoch={loader.epoch}")
                if step >= cfg.steps:
                    break
            if step == cfg.steps and step % cfg.every:
                ckpt.save(step, metrics={"loss": extra["loss"]})
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        echo(f"test accuracy={acc:.4f} ({time.perf_counter() - t0:.1f}s in this process)")
    digest = params_sha256(model, optimizer)
    line = f"final step={step} loss={extra['loss']:.6f} params_sha256={digest}"
    echo(line)
    return line


def remove_run(
    directory: str | os.PathLike[str],
    echo: Callable[[str], None] = print,
    shm_dir: Path = SHM_DIR,
) -> bool:
    """Delete an earlier local run so that the next launch in ``directory`` starts fresh:
    the directory and this host's shared-memory snapshots of it (a launch resumes from
    those too, even into an empty directory). Says what it is about to delete through
    ``echo`` first; returns whether there was anything. Raises `CheckpointError`, before
    deleting anything, if ``directory`` holds files but no ``audit.jsonl`` (so it is not a
    checkpoint root) or if a live process still takes snapshots of that run.
    """
    root = LocalStorage(directory).root
    if root.exists() and not (root / "audit.jsonl").is_file():
        if not root.is_dir() or any(root.iterdir()):
            raise CheckpointError(
                f"refusing to delete {directory}: expected an earlier run's checkpoint "
                "directory (one with an audit.jsonl), found other files; pick another directory"
            )
    key = run_key_for(LocalStorage(directory).location)
    slots = {p for d in user_dirs(shm_dir) for p in slot_paths(key, 0, d)}
    segments = [seg for seg in list_segments(shm_dir) if seg.path in slots]
    snapshots = [seg.path for seg in segments]
    live = sorted({seg.owner_pid for seg in segments if seg.in_use})
    if live:
        raise CheckpointError(
            f"cannot start {directory} afresh: process {', '.join(map(str, live))} still "
            "takes snapshots of that run; stop it first, then run this again"
        )
    if not root.exists() and not snapshots:
        return False
    what = [os.fspath(directory)] if root.exists() else []
    what += [f"its shared-memory snapshot {p}" for p in snapshots]
    echo(f"removing an earlier run to start afresh: {', '.join(what)}")
    if root.exists():
        shutil.rmtree(root)
    for path in snapshots:
        path.unlink(missing_ok=True)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``resumable demo`` arguments."""
    p.add_argument(
        "--dir", required=True, help="checkpoint directory or s3:// URL (resumes if it has any)"
    )
    p.add_argument("--mirror", default=None, help="also upload every checkpoint there (s3://)")
    p.add_argument("--steps", type=int, default=DemoConfig.steps, help="training steps")
    p.add_argument("--seed", type=int, default=DemoConfig.seed, help="seed of model and data")
    p.add_argument("--every", type=int, default=DemoConfig.every, help="persist every K steps")
    p.add_argument(
        "--memory-every",
        type=int,
        default=DemoConfig.memory_every,
        help="shared-memory snapshot every K steps (0: none)",
    )
    p.add_argument("--workers", type=int, default=DemoConfig.workers, help="DataLoader workers")
    p.add_argument("--log-every", type=int, default=DemoConfig.log_every, help="progress lines")


def run(args: argparse.Namespace) -> int:
    """``resumable demo``: train (or resume) and print the final line."""
    for name in ("steps", "every", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    cfg = DemoConfig(
        dir=args.dir,
        steps=args.steps,
        seed=args.seed,
        every=args.every,
        memory_every=args.memory_every,
        workers=args.workers,
        log_every=args.log_every,
        mirror=args.mirror,
    )
    run_demo(cfg, echo=lambda line: print(line, flush=True))
    return 0
