"""Copying and hashing a tensor's bytes where its pieces lie in mapped files.

An incremental checkpoint's tensor may lie in thousands of pieces across several
files (`resumable.reader.CheckpointReader.tensors` maps each file once). Of what a
small piece costs in Python, slicing a memoryview is the cheapest. Measured against
it (4 KiB and 64 KiB chunks): NumPy views cost more per piece; gathering rows of a
common piece size with NumPy fancy indexing was slower still (scattered rows copy
element-wise), and torch's scatter ops too. `ctypes.memmove` costs more per call, so
it pays only where the copy of a piece costs more than the call: for the pieces of
`SPLIT` bytes or more, which several threads copy at once (it releases the GIL; one
thread alone copies at about half the memory's speed). ``docs/decisions.md`` has the
measurements.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import xxhash

from resumable._lazy import numpy_module, torch_module
from resumable.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = numpy_module()
    torch = torch_module()

SPLIT = 64 << 10  # bytes of a piece from which `MappedPieces` copies it on several threads
IN_PLACE_MIN = 64  # pieces in place in one file from which `MappedPieces` copies their span


class MappedPieces:
    """The bytes of one tensor whose pieces lie in mapped files, in the tensor's order:
    ``sources``, the mapped files by index; ``a``, (source index, begin, end) rows.
    A reader hashes them (`digest`, on any thread) and, once every tensor passed its
    check, copies them into the live tensor (`copy_into`). Neither writes a source."""

    def __init__(self, sources: Mapping[int, memoryview], a: np.ndarray) -> None:
        self.sources = sources  # the mapped files, by path index
        self.table = a  # (path index, begin, end) rows, in order
        self.rows: list[list[int]] = a.tolist()

    def digest(self) -> str:
        h = xxhash.xxh3_64()
        update, sources = h.update, self.sources
        for i, b, e in self.rows:
            update(sources[i][b:e])
        return h.hexdigest()

    def copy_into(self, dest: torch.Tensor) -> None:
        """Write the tensor's bytes into ``dest``, contiguous bytes of their total
        length. First, where many pieces lie in one file as they lie in the tensor (a
        file that held the tensor whole, of which later checkpoints replaced chunks),
        the whole range they span, in one copy (`in_place`); then the other pieces:
        those of `SPLIT` bytes or more shared by byte count among torch's intra-op
        thread count of threads, the rest one memoryview slice each. Every piece is
        copied after the range, so what the range copied of another piece's place is
        overwritten."""
        a, sources = self.table, self.sources
        lengths = a[:, 2] - a[:, 1]
        # Raw copies: every bound checked here again, whatever the caller checked.
        if (
            dest.dtype != torch.uint8
            or dest.dim() != 1
            or not dest.is_contiguous()
            or int(lengths.sum()) != dest.numel()
            or len(a) == 0
            or int(a[:, 1].min()) < 0
            or int(lengths.min()) < 0
            or any(int(a[a[:, 0] == k, 2].max()) > sources[k].nbytes for k in np.unique(a[:, 0]))
        ):
            raise CorruptCheckpointError("pieces that do not fit their files or destination")
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        threads = max(1, torch.get_num_threads())
        base = dest.data_ptr()
        addresses: dict[int, int] = {}

        def address(k: int) -> int:
            if k not in addresses:
                addresses[k] = int(np.frombuffer(sources[k], dtype=np.uint8).ctypes.data)
            return addresses[k]

        rest = np.ones(len(a), dtype=bool)  # the pieces still to copy one by one
        found = in_place(a, starts, lengths)
        if found is not None:
            done, k, lo, hi, shift = found
            _memmove_on_threads([(base + lo, address(k) + lo - shift, hi - lo)], threads)
            rest &= ~done
        big = rest & (lengths >= SPLIT)
        if big.any():
            moves = []
            for j in np.flatnonzero(big).tolist():
                i, b, e = self.rows[j]
                moves.append((base + int(starts[j]), address(i) + b, e - b))
            _memmove_on_threads(moves, threads)
        flat, positions = dest.numpy().data, starts.tolist()
        for j in np.flatnonzero(rest & ~big).tolist():
            i, b, e = self.rows[j]
            pos = positions[j]
            flat[pos : pos + e - b] = sources[i][b:e]


def in_place(
    a: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, int, int, int, int] | None:
    """The largest set of pieces (rows of ``a``, placed at ``starts`` in the tensor)
    that lie in one file at one offset from their place in the tensor, if they are at
    least `IN_PLACE_MIN` and the tensor range they span holds at most twice their
    bytes: (which rows, file, begin and end in the tensor, tensor place minus file
    offset). Its source range lies between the lowest begin and the highest end of
    those pieces, so inside their file."""
    if len(a) < IN_PLACE_MIN:
        return None
    shift = starts - a[:, 1]
    best: tuple[int, int, int] | None = None  # (count, file, shift)
    for k in np.unique(a[:, 0]).tolist():
        values, counts = np.unique(shift[a[:, 0] == k], return_counts=True)
        g = int(np.argmax(counts))
        if best is None or int(counts[g]) > best[0]:
            best = (int(counts[g]), k, int(values[g]))
    assert best is not None
    count, k, d = best
    if count < IN_PLACE_MIN:
        return None
    rows = (a[:, 0] == k) & (shift == d)
    lo, hi = int(starts[rows].min()), int((starts + lengths)[rows].max())
    if hi - lo > 2 * int(lengths[rows].sum()):
        return None
    return rows, k, lo, hi, d


def _memmove_on_threads(moves: list[tuple[int, int, int]], threads: int) -> None:
    """``memmove(dest, src, n)`` for each of ``moves`` (addresses whose bounds the
    caller checked), the bytes shared evenly among ``threads`` threads, the calling one
    included (a move larger than a share is cut)."""
    total = sum(n for _, _, n in moves)
    threads = max(1, min(threads, total // SPLIT))
    share = -(-total // threads)
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    k, room = 0, share
    for d, s, n in moves:
        while n:
            take = min(n, room)
            parts[k].append((d, s, take))
            d, s, n, room = d + take, s + take, n - take, room - take
            if room == 0 and k + 1 < threads:
                k, room = k + 1, share
    errors: list[BaseException] = []

    def run(part: list[tuple[int, int, int]]) -> None:
        try:
            for d, s, n in part:
                ctypes.memmove(d, s, n)
        except BaseException as exc:  # handed to the calling thread
            errors.append(exc)

    others = [threading.Thread(target=run, args=(p,), daemon=True) for p in parts[1:]]
    for t in others:
        t.start()
    run(parts[0])
    for t in others:
        t.join()
    if errors:
        raise errors[0]
