"""The training job every local campaign checkpoints: a small model whose weights
change deterministically with the step, so each checkpoint's bytes are known."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import resumable.pipeline._worker_jobs
from resumable import Checkpointer, Keep
from resumable.audit import read_audit
from resumable.commit import Attempt, RenameCommit, list_committed
from resumable.errors import CheckpointError
from resumable.format import CHECKSUM, MANIFEST
from resumable.reader import CheckpointReader
from resumable.storage import Storage
from resumable.storage.local import LocalStorage


def make_state(width: int = 64) -> dict[str, Any]:
    """A state whose tensors span several 4 KiB pages (``width=64``: 16 KiB of weights)."""
    torch.manual_seed(0)
    return {"model": nn.Linear(width, width)}


def set_step(state: dict[str, Any], step: int) -> None:
    """Give the weights values that depend only on ``step``."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in state["model"].parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def checkpointer(root: str | os.PathLike[str], state: dict[str, Any], **kw: Any) -> Checkpointer:
    """A synchronous Checkpointer keeping the 2 newest (campaigns override by keyword)."""
    opts: dict[str, Any] = {
        "persist": "sync",
        "keep": Keep(last=2),
        "capture_rng": False,
        "save_on_close": False,
    }
    opts.update(kw)
    return Checkpointer(os.fspath(root), state, **opts)


def tensor_sums(storage: Storage, step: int) -> dict[str, str]:
    """The checksum of every tensor of committed checkpoint ``step``."""
    return {k: v[CHECKSUM] for k, v in CheckpointReader(storage, step).manifest["tensors"].items()}


@contextlib.contextmanager
def on_commit(callback: Callable[[int], None]) -> Iterator[None]:
    """Call ``callback(step)`` the moment each rename commit returns."""
    original = RenameCommit.commit

    def commit(self: RenameCommit, attempt: Attempt, manifest: bytes) -> bool:
        replaced = original(self, attempt, manifest)
        callback(attempt.step)
        return replaced

    RenameCommit.commit = commit  # type: ignore[method-assign]
    try:
        yield
    finally:
        RenameCommit.commit = original  # type: ignore[method-assign]


class ManifestFirstCommit(RenameCommit):
    """A deliberately broken commit: the manifest goes into the final directory first,
    then the data is copied next to it. A crash between the two lists a checkpoint
    whose data is missing or short."""

    def commit(self, attempt: Attempt, manifest: bytes) -> bool:
        s = self.storage
        s.write(f"{attempt.final}/{MANIFEST}", [manifest])
        s.sync_dir(attempt.final)
        s.sync_dir("")
        time.sleep(0.2)  # a slow copy: a window a kill lands in even on a loaded machine
        for name in s.list_dir(attempt.staging):
            if name != MANIFEST:
                s.write(f"{attempt.final}/{name}", [s.read(f"{attempt.staging}/{name}")])
        s.sync_dir(attempt.final)
        s.delete(attempt.staging)
        return False


@contextlib.contextmanager
def broken_commit(kind: str | None) -> Iterator[None]:
    """Within the block, Checkpointers commit with a broken strategy (``"manifest-first"``)
    or, for None, the library's own."""
    if kind is None:
        yield
        return
    if kind != "manifest-first":
        raise ValueError(f"unknown broken commit {kind!r}")
    original = resumable.pipeline._worker_jobs.committer_for

    def committer_for(storage: Storage, **kw: Any) -> Any:
        return ManifestFirstCommit(storage, **kw)

    resumable.pipeline._worker_jobs.committer_for = committer_for
    try:
        yield
    finally:
        resumable.pipeline._worker_jobs.committer_for = original


def newest_commit(root: str | os.PathLike[str]) -> int:
    """The newest step whose commit the audit log of ``root`` recorded (0 if none)."""
    steps = [e["step"] for e in read_audit(local(root)) if e.get("event") == "commit"]
    return max(steps, default=0)


def torn(root: str | os.PathLike[str]) -> list[str]:
    """Problems: each checkpoint ``root`` lists that does not verify."""
    storage = local(root)
    bad = []
    for step in list_committed(storage):
        try:
            CheckpointReader(storage, step).verify()
        except CheckpointError as exc:
            bad.append(f"step {step} of {root} listed but does not verify: {exc}")
    return bad


def local(root: str | os.PathLike[str]) -> LocalStorage:
    return LocalStorage(root)
