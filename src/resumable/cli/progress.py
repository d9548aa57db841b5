"""Progress bars on stderr, shown only while stderr is a terminal (pipes, logs and
tests see nothing).

`progress_bar` counts items (checkpoints deleted, manifests read). `ByteProgress` counts
bytes read and checked; `ProgressReader` reads a checkpoint's tensors in batches of
`PROGRESS_BATCH` bytes so that the bar moves.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from rich.console import Console

from resumable._dtypes import itemsize
from resumable.cli.common import printable
from resumable.errors import CheckpointError
from resumable.reader import CheckpointReader
from resumable.storage import Storage


def stderr_is_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress_bar(items: Iterable[Any], total: int, what: str) -> Iterator[Any]:
    """``items``, with a progress bar on stderr while it is a terminal and ``total`` is
    more than one; silent otherwise (pipes, logs, tests)."""
    if total <= 1 or not stderr_is_terminal():
        yield from items
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(what, total=total)
        for item in items:
            yield item
            bar.advance(task)


# Tensors read and checked per step of the bar: large enough that the checks still
# share the cores (`CheckpointReader.tensors` does from 8 MiB), small enough that the
# bar moves every fraction of a second.
PROGRESS_BATCH = 64 << 20


class ByteProgress:
    """A bar of bytes read and checked, on stderr while it is a terminal; silent (and
    `active` false) otherwise: pipes, logs, tests. Used as a context manager by the
    command that reads; `set_total` once the total is known, `advance` per batch."""

    def __init__(self, what: str, enabled: bool = True) -> None:
        self.what = what
        self.active = enabled and stderr_is_terminal()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> ByteProgress:
        if self.active:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def count(self, storage: Storage, steps: Iterable[int]) -> None:
        """Set the total to the tensor bytes of checkpoints ``steps`` (`checkpoint_bytes`);
        their manifests are read only while the bar shows."""
        if self.active:
            self.set_total(checkpoint_bytes(storage, steps))

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=printable(text))

    def start_over(self, text: str, total: int) -> None:
        """The bar empty again, for ``total`` bytes of another piece of work."""
        if self._bar is not None:
            self._bar.update(self._task, description=printable(text), total=total, completed=0)

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, nbytes)


def _tensor_nbytes(info: Any) -> int:
    try:
        return math.prod(info["shape"]) * itemsize(info["dtype"])
    except (KeyError, TypeError, ValueError, CheckpointError):
        return 0


def checkpoint_bytes(storage: Storage, steps: Iterable[int]) -> int:
    """The tensor bytes of ``steps`` a full check reads (unreadable manifests: 0)."""
    total = 0
    for step in steps:
        try:
            index = CheckpointReader(storage, step).manifest["tensors"]
        except (CheckpointError, OSError):
            continue
        total += sum(_tensor_nbytes(info) for info in index.values())
    return total


class ProgressReader(CheckpointReader):
    """A `CheckpointReader` whose read of every tensor (``tensors()``, as `verify`
    makes it) goes in batches of `PROGRESS_BATCH` bytes in the files' order, each
    batch read and checked as one, the bar advanced after each. Without an active bar
    it reads as its parent does, in one call."""

    def __init__(self, storage: Storage, step: int, bar: ByteProgress) -> None:
        super().__init__(storage, step)
        self._bar = bar

    def tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        verify: bool = True,
        into: Any = None,
        fuse: bool = False,
    ) -> dict[str, torch.Tensor]:
        if names is not None or into is not None or not self._bar.active:
            return super().tensors(names, verify=verify, into=into, fuse=fuse)
        index = self.manifest["tensors"]
        out: dict[str, torch.Tensor] = {}
        for batch in _batches(index):
            out.update(super().tensors(batch, verify=verify))
            self._bar.advance(sum(_tensor_nbytes(index[n]) for n in batch))
        return out


def _batches(index: dict[str, Any]) -> Iterator[list[str]]:
    """The tensor names of ``index`` in the files' order (tensors in pieces last), cut
    into runs of about `PROGRESS_BATCH` bytes."""

    def where(name: str) -> tuple[int, str, int]:
        info = index[name]
        if "chunks" in info or "extents" in info or "offsets" not in info:
            return (1, "", 0)
        return (0, str(info.get("file")), int(info["offsets"][0]))

    batch: list[str] = []
    size = 0
    for name in sorted(index, key=where):
        batch.append(name)
        size += _tensor_nbytes(index[name])
        if size >= PROGRESS_BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
