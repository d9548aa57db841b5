"""Fixtures shared by the whole test suite.

- `small_training_state`: a factory for a tiny model + AdamW + StepLR trained a few
  deterministic steps (`TrainingState`), to save from and restore into.
- `make_saved_root` / `saved_root`: a checkpoint root with committed checkpoints at steps
  1, 2, 3 and the exact tensors each one holds (`SavedRoot`).
- `audit_events`: a recorder on a process-wide ``sys.addaudithook`` hook, installed once
  per session (audit hooks cannot be removed); it records only inside ``recording()``.
- `frozen_heap`: a context in which `gc.collect` skips the test process's heap.

Add new fixtures below the existing ones, each with a docstring saying what it builds.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import torch
from torch import nn

import resumable

pytest_plugins = ("s3server", "cloudservers")  # SeaweedFS (S3), fake-gcs-server, Azurite

# Property tests draw new examples at every local run; CI (`.ci/run` sets
# HYPOTHESIS_PROFILE=ci) draws the same ones at every run, so that a red CI is one that
# any later run reproduces, not a draw of that day.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# ``progress`` audit notes come at a launch's first step, then every few seconds of wall
# time, then at close: in tests only the first and the last (subprocesses inherit it), so
# that a check of the audit log's events does not depend on how loaded the machine is.
# Tests of the notes themselves set their own interval.
os.environ.setdefault("RESUMABLE_PROGRESS_EVERY_S", "3600")

DATA_FILE = "rank-00000.safetensors"
MANIFEST_FILE = "manifest.json"


# --------------------------------------------------------------------------- test order

# The files that start DeepSpeed wait at first for its op, compiled beside the checks
# `make test` runs before pytest (`deepspeed_shm_op_built`): a fresh machine's compile
# takes a minute or two. They take no worker before this many longer files have.
_DEEPSPEED_AFTER = 6


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files longest first (`file_seconds.json`, written by `file_seconds.py`
    from a whole run's report), each file's tests in their own order. pytest-xdist hands a
    worker a whole file at a time (``--dist loadfile``) in this order
    (``--no-loadscope-reorder``; by default it orders by count of tests): a long file
    started last would keep one worker busy after the others are done. A file the table
    does not know goes after those it does."""
    import json

    table = Path(__file__).with_name("file_seconds.json")
    seconds: dict[str, float] = json.loads(table.read_text()) if table.exists() else {}
    first: dict[str, int] = {}
    deepspeed: set[str] = set()
    for i, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        first.setdefault(path, i)
        if "deepspeed_shm_op_built" in getattr(item, "fixturenames", ()):
            deepspeed.add(path)
    order = sorted(first, key=lambda p: (-seconds.get(p, 0.0), first[p]))
    for path in [p for p in order[:_DEEPSPEED_AFTER] if p in deepspeed]:
        order.remove(path)
        order.insert(_DEEPSPEED_AFTER, path)
    rank = {p: r for r, p in enumerate(order)}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


# --------------------------------------------------------------------------- training state


def tensor_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bit for bit: -0.0 != 0.0, NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


@dataclass
class TrainingState:
    """A tiny training job: ``state`` is what a script hands to `resumable.Checkpointer`."""

    model: nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    batches: torch.Generator
    state: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.state = {"model": self.model, "optim": self.optim, "sched": self.sched}

    def train(self, steps: int = 1) -> None:
        """Deterministic optimizer steps (batches come from this state's own generator)."""
        for _ in range(steps):
            x = torch.randn(5, 4, generator=self.batches)
            loss = self.model(x).square().mean()
            self.optim.zero_grad()
            loss.backward()
            self.optim.step()
            self.sched.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Clones of every tensor that a restore must reproduce: parameters, buffers,
        optimizer moments and step counts, and the learning rate / scheduler position."""
        out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, st in self.optim.state_dict()["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{i}/{k}"] = v.detach().clone()
        out["optim/lr"] = torch.tensor(
            [g["lr"] for g in self.optim.param_groups], dtype=torch.float64
        )
        out["sched/last_epoch"] = torch.tensor(self.sched.last_epoch)
        return out

    def mismatches(self, expected: dict[str, torch.Tensor]) -> list[str]:
        """Names whose live value differs (bit for bit) from ``expected``; ``[]`` if equal."""
        actual = self.tensors()
        names = sorted(set(actual) | set(expected))
        return [
            n
            for n in names
            if n not in actual
            or n not in expected
            or not tensor_bytes_equal(actual[n], expected[n])
        ]


def build_training_state(seed: int = 0, steps: int = 2) -> TrainingState:
    """Linear(4, 8) -> ReLU -> Linear(8, 2), AdamW, StepLR; ``steps`` optimizer steps.
    Different seeds give different weights; the global RNG streams are left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    batches = torch.Generator().manual_seed(1000 + seed)
    ts = TrainingState(model, optim, sched, batches)
    ts.train(steps)
    return ts


@pytest.fixture(scope="session")
def small_training_state() -> Callable[..., TrainingState]:
    """Factory ``small_training_state(seed=0, steps=2) -> TrainingState``."""
    return build_training_state


# --------------------------------------------------------------------------- saved checkpoints


@dataclass
class SavedRoot:
    """A checkpoint root written by `resumable.Checkpointer` (``keep=None``)."""

    path: Path
    steps: list[int]
    expected: dict[int, dict[str, torch.Tensor]]  # TrainingState.tensors() at each step

    def step_dir(self, step: int) -> Path:
        return self.path / f"step-{step:012d}"

    def data_file(self, step: int) -> Path:
        return self.step_dir(step) / DATA_FILE

    def manifest_file(self, step: int) -> Path:
        return self.step_dir(step) / MANIFEST_FILE

    def copy_to(self, dst: Path) -> SavedRoot:
        """An independent copy of the root (same expected tensors)."""
        shutil.copytree(self.path, dst, symlinks=True)
        return SavedRoot(dst, list(self.steps), self.expected)


def build_saved_root(
    path: Path, steps: Iterable[int] = (1, 2, 3), seed: int = 0, incremental: bool = False
) -> SavedRoot:
    """Train one step before each save, so every checkpoint holds different values.
    Saves synchronously (no worker process, no shared memory): fast and deterministic.
    Checkpoints are written whole (format version 1, which the damage and hostile-file
    tests edit field by field) unless ``incremental``: this small state's random
    streams, unchanged between saves, are most of its bytes, so by default its later
    checkpoints would refer to the first."""
    ts = build_training_state(seed=seed, steps=1)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    steps = list(steps)
    with resumable.Checkpointer(
        path, ts.state, keep=None, persist="sync", incremental=incremental
    ) as ckpt:
        for step in steps:
            ts.train(1)
            ckpt.save(step, metrics={"loss": 1.0 / (step + 1)})
            ckpt.wait()
            expected[step] = ts.tensors()
    return SavedRoot(Path(path), steps, expected)


@pytest.fixture(scope="session")
def make_saved_root() -> Callable[..., SavedRoot]:
    """Factory ``make_saved_root(path, steps=(1, 2, 3), seed=0) -> SavedRoot``."""
    return build_saved_root


@pytest.fixture
def saved_root(tmp_path: Path) -> SavedRoot:
    """``tmp_path / "ckpt"`` with committed checkpoints at steps 1, 2 and 3."""
    return build_saved_root(tmp_path / "ckpt")


# --------------------------------------------------------------------------- audit hooks


class AuditRecorder:
    """Records `sys.audit` events, but only inside ``with recorder.recording():``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[Any, ...]]] = []
        self._active = False

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self._active:
            self.events.append((event, args))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
        self.events = []
        self._active = True
        try:
            yield self.events
        finally:
            self._active = False

    def named(self, *names: str) -> list[tuple[str, tuple[Any, ...]]]:
        """Recorded events whose name is one of ``names`` or starts with ``name + "."``."""
        return [
            (e, a) for e, a in self.events if any(e == n or e.startswith(n + ".") for n in names)
        ]

    def opened_paths(self) -> list[str]:
        """Absolute paths of every ``open`` event recorded (file descriptors skipped)."""
        out = []
        for event, args in self.events:
            if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
                out.append(os.path.abspath(os.fsdecode(args[0])))
        return out


_RECORDER: AuditRecorder | None = None


@pytest.fixture(scope="session")
def audit_events() -> AuditRecorder:
    """The session's `AuditRecorder` (its hook is installed on first use)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = AuditRecorder()
        sys.addaudithook(_RECORDER.hook)
    return _RECORDER


@pytest.fixture
def sync_persist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Persist on the training thread (``RESUMABLE_PERSIST=sync``): for suites about the
    format and the load path, which need no worker process per Checkpointer."""
    monkeypatch.setenv("RESUMABLE_PERSIST", "sync")


@pytest.fixture(scope="session")
def dead_pid() -> int:
    """The pid of a process that has exited: staging directories naming it are stale."""
    import subprocess

    for _ in range(5):
        proc = subprocess.Popen(["true"])
        proc.wait()
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return proc.pid
    pytest.skip("could not find a dead pid")


# --------------------------------------------------------------------------- DeepSpeed's op


@pytest.fixture(scope="session")
def deepspeed_shm_op_built(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSpeed compiles its CPU shared-memory op (``deepspeed_shm_comm``) at a
    process's first ``deepspeed.initialize``, holding a lock file torch's JIT loader only
    waits on. A test that SIGKILLs a rank during that compile (minutes on a busy machine)
    would leave the lock behind, and every later DeepSpeed launch would wait on it until
    its timeout. So it is built here, before the first test that starts DeepSpeed: every
    module that does lists this fixture in its ``pytestmark``. One test process builds it
    while the others (pytest-xdist workers) wait on an ``flock``; a worker that then finds
    it built in this run starts no interpreter of its own (importing DeepSpeed to load
    the op takes seconds)."""
    import fcntl
    import importlib.util
    import subprocess

    if importlib.util.find_spec("deepspeed") is None:
        return
    run_dir = tmp_path_factory.getbasetemp().parent  # under xdist: this run's, shared
    lock = run_dir / "deepspeed-shm-op.lock"
    built = run_dir / "deepspeed-shm-op.built" if os.environ.get("PYTEST_XDIST_WORKER") else None
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if built is not None and built.exists():
            return
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=1800,
            check=False,
        )
        if built is not None:
            built.touch()


# --------------------------------------------------------------------------- garbage collection


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(scope="session")
def frozen_heap() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """Factory of a context in which `gc.collect` skips every object alive at its start
    (`gc.freeze`; unfrozen at its exit). For the smoke test of a benchmark harness that
    collects before each timed sample: in a test process, holding torch and every test
    module imported before, each collection scans that whole heap (about 0.5 s here).
    Objects made inside the context are collected as usual."""
    return _frozen_heap
