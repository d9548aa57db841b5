"""Read and verify a committed checkpoint, defensively.

This is the load path, and it trusts nothing it reads: the whole manifest is validated
by `resumable.format.decode_manifest` (structure, names, sizes, digest, byte ranges,
tiling of global tensors, state trees) before anything is allocated for it; every data
file must have the size the manifest declares and a valid safetensors header that
agrees with the tensor index; every tensor's bytes are checksummed before a tensor is
built from them. Only then does the manager touch the live training state. No byte of a
data file belongs to two tensors and no tree references a tensor twice, so what a
restore reads and builds is bounded by the checkpoint's real size. There is no pickle
here, and every path goes through the storage's root check.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from resumable.commit import step_dir
from resumable.errors import CorruptCheckpointError, NewerFormatError
from resumable.format import (
    CHECKSUM,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_SAFETENSORS_HEADER,
    byte_view,
    checksum,
    decode_manifest,
    dtype_from_name,
    parse_safetensors_header,
    tensor_ranges,
)
from resumable.storage.base import Storage


class CheckpointReader:
    """One committed checkpoint of ``storage``; reads lazily and caches the manifest."""

    def __init__(self, storage: Storage, step: int, *, files_only: bool = False) -> None:
        self.storage = storage
        self.step = step
        # An earlier checkpoint read only for the files a newer one refers to: its
        # manifest is checked up to its file entries (`decode_manifest`'s files_only).
        self._files_only = files_only
        self.dir = step_dir(step)
        self.where = f"checkpoint {self.dir} in {storage.url}"
        self._manifest: dict[str, Any] | None = None
        self.mapped = False  # whether tensors() returned views of mapped files
        self._holders: dict[int, CheckpointReader] = {}  # earlier checkpoints referred to
        self._range_cache: dict[str, list[tuple[int | None, str, int, int]]] = {}
        # Tensors `tensors` returned unassembled, and where their chunks lie: (the
        # tensor, [(byte position in it, source bytes)]), for `fill`.
        self._fills: list[tuple[torch.Tensor, list[tuple[int, np.ndarray]]]] = []

    @property
    def manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            path = f"{self.dir}/{MANIFEST}"
            try:
                size = self.storage.size(path)
                if size > MAX_MANIFEST_BYTES:  # refuse before allocating for it
                    raise CorruptCheckpointError(
                        f"{self.where}: manifest of {size} bytes exceeds {MAX_MANIFEST_BYTES}"
                    )
                raw = self.storage.read(path)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{self.where}: manifest is missing") from exc
            m = decode_manifest(raw, where=self.where, files_only=self._files_only)
            if m["step"] != self.step:
                raise CorruptCheckpointError(
                    f"{self.where}: manifest says step {m['step']}, directory says {self.step}"
                )
            self._manifest = m
        return self._manifest

    @property
    def tree(self) -> Any:
        """The state tree of rank 0."""
        return self.manifest["ranks"][0]["tree"]

    def check_files(self) -> None:
        """Every listed file exists with the declared size and a safetensors header that
        agrees with the tensor index."""
        m = self.manifest
        # What each own file's safetensors header must say: (name, dtype, shape, bytes).
        expect: dict[str, list[tuple[str, str, list[int], list[int]]]] = defaultdict(list)
        # Per file of another checkpoint, the chunk that begins first and the one that
        # ends last there: those two decide whether all lie inside its data.
        bounds: dict[tuple[int, str], tuple[tuple[int, int], tuple[int, int]]] = {}
        for name, info in m["tensors"].items():
            if "chunks" not in info and "extents" not in info:
                expect[info["file"]].append((name, info["dtype"], info["shape"], info["offsets"]))
                continue
            ranges = self._ranges(name)
            own = [(f, b, e) for step, f, b, e in ranges if step is None]
            for step, f, b, e in ranges:
                if step is not None:
                    first, last = bounds.get((step, f), ((b, e), (b, e)))
                    bounds[(step, f)] = (
                        (b, e) if b < first[0] else first,
                        (b, e) if e > last[1] else last,
                    )
            if own and len(own) == len(ranges) and _contiguous(own):
                # written whole: one entry, as in a full file
                expect[own[0][0]].append(
                    (name, info["dtype"], info["shape"], [own[0][1], own[-1][2]])
                )
            else:  # changed chunks: U8 entries, whatever their names
                for f, b, e in own:
                    expect[f].append(("", "U8", [e - b], [b, e]))
        for step, fname in sorted(bounds):
            holder = self._holder(step)
            key = self._holder_file(holder, fname)
            size = holder.manifest["files"][key]["size"]
            # Where its data starts is all this checkpoint uses of that file's header:
            # the bytes it reads there are checked against its own checksums, and that
            # checkpoint's header is checked in full whenever it is itself read.
            start = 8 + holder._header_length(key, size)
            for b, e in bounds[(step, fname)]:
                if b < start or e > size:
                    raise CorruptCheckpointError(
                        f"{self.where}: a chunk [{b}, {e}) lies outside the data of "
                        f"{fname} in {holder.dir}"
                    )
        for fname, finfo in m["files"].items():
            start, header = self._check_file(fname, finfo["size"])
            # parse_safetensors_header checked every entry but the metadata
            at = {tuple(h["data_offsets"]): h for k, h in header.items() if k != "__metadata__"}
            for name, dtype, shape, offsets in expect.get(fname, []):
                h = header.get(name) if name else at.get((offsets[0] - start, offsets[1] - start))
                if (
                    not isinstance(h, dict)
                    or h.get("dtype") != dtype
                    or h.get("shape") != shape
                    or [start + o for o in h["data_offsets"]] != offsets
                ):
                    raise CorruptCheckpointError(
                        f"{self.where}: {fname}'s safetensors header disagrees with the "
                        f"manifest about {f'tensor {name!r}' if name else f'a chunk at {offsets}'}"
                    )

    def _check_file(self, fname: str, size: int) -> tuple[int, dict[str, Any]]:
        """One data file: present, of the declared size, with a valid safetensors
        header; returns where its data starts and the header."""
        n = self._header_length(fname, size)
        path = f"{self.dir}/{fname}"
        head = n.to_bytes(8, "little") + self.storage.read_range(path, 8, n)
        try:
            return parse_safetensors_header(head, size)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{self.where}: {fname}: {exc}") from None

    def _header_length(self, fname: str, size: int) -> int:
        """A data file present, of the declared ``size``, whose first 8 bytes give a
        safetensors header length that fits in it: its data starts at 8 plus that."""
        path = f"{self.dir}/{fname}"
        try:
            actual = self.storage.size(path)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{self.where}: data file {fname} is missing") from exc
        if actual != size:
            raise CorruptCheckpointError(
                f"{self.where}: {fname} has {actual} bytes, manifest declares {size}"
                " (truncated or overwritten)"
            )
        head = self.storage.read_range(path, 0, min(actual, 8))
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > actual or n > MAX_SAFETENSORS_HEADER:
            raise CorruptCheckpointError(f"{self.where}: {fname} is not a safetensors file")
        return n

    def _holder(self, step: int) -> CheckpointReader:
        """The earlier checkpoint ``step`` that this one refers to, its manifest read."""
        holder = self._holders.get(step)
        if holder is None:
            holder = CheckpointReader(self.storage, step, files_only=True)
            try:
                holder.manifest  # noqa: B018 - read and validated now
            except (CorruptCheckpointError, NewerFormatError) as exc:
                # a newer format in an older checkpoint that this one refers to is
                # damage, not an upgrade to make
                raise CorruptCheckpointError(
                    f"{self.where} refers to step {step}, which cannot be read: {exc}"
                ) from None
            self._holders[step] = holder
        return holder

    def _holder_file(self, holder: CheckpointReader, basename: str) -> str:
        for key in holder.manifest["files"]:
            if key.rsplit("/", 1)[-1] == basename:
                return str(key)
        raise CorruptCheckpointError(
            f"{self.where} refers to a file {basename!r} of {holder.dir}, which has no such file"
        )

    def _ranges(self, name: str) -> list[tuple[int | None, str, int, int]]:
        """`tensor_ranges` of a tensor of this manifest, made once (several checks
        walk them; a tensor may have thousands)."""
        got = self._range_cache.get(name)
        if got is None:
            got = self._range_cache[name] = tensor_ranges(self.manifest["tensors"][name])
        return got

    def _locations(self, name: str) -> list[tuple[str, int, int]]:
        """Where a tensor's bytes lie, in order, as (path in storage, begin, end)."""
        out = []
        referred: dict[tuple[int, str], tuple[str, int]] = {}  # -> (path, file size)
        for step, fname, b, e in self._ranges(name):
            if step is None:
                out.append((f"{self.dir}/{fname}", b, e))
                continue
            found = referred.get((step, fname))
            if found is None:
                holder = self._holder(step)
                key = self._holder_file(holder, fname)
                found = referred[(step, fname)] = (
                    f"{holder.dir}/{key}",
                    holder.manifest["files"][key]["size"],
                )
            if e > found[1]:
                raise CorruptCheckpointError(
                    f"{self.where}: a chunk [{b}, {e}) lies past the end of {fname} in "
                    f"{step_dir(step)}"
                )
            out.append((found[0], b, e))
        merged: list[tuple[str, int, int]] = []
        for path, b, e in out:  # chunks back to back in one file read as one range
            if merged and merged[-1][0] == path and merged[-1][2] == b:
                merged[-1] = (path, merged[-1][1], e)
            else:
                merged.append((path, b, e))
        return merged

    def tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        verify: bool = True,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read (and by default checksum) tensors, as CPU tensors. All of a file's
        tensors are read with one sequential read of its data span.

        ``into``: where the caller will copy a tensor anyway (the live tensor of the
        same name, shape and dtype). A tensor whose bytes lie in several places (a
        version 2 or 3 entry with pieces in earlier checkpoints) is then not assembled in a
        buffer of its own: its checksum is computed over the chunks where they lie
        (files mapped), and the tensor returned is the ``into`` one, still unchanged;
        `fill` copies the chunks into it. The caller calls `fill` once it is about to
        copy every value into the live state, so that nothing live changes before the
        whole checkpoint was read and verified."""
        assert not self._files_only, "a files-only reader reads no tensors"
        m = self.manifest
        index = m["tensors"]
        wanted = list(index) if names is None else list(names)
        for name in wanted:
            if name not in index:
                raise CorruptCheckpointError(f"{self.where}: no tensor {name!r} in the index")
        locations = {n: self._locations(n) for n in wanted}
        by_path: dict[str, list[str]] = defaultdict(list)
        for name in wanted:
            if len(locations[name]) == 1:
                by_path[locations[name][0][0]].append(name)
        out: dict[str, torch.Tensor] = {}
        for path, names_in_file in by_path.items():
            ranges = [locations[n][0][1:] for n in names_in_file]
            lo = min(r[0] for r in ranges)
            hi = max(r[1] for r in ranges)
            span = sum(r[1] - r[0] for r in ranges)
            if hi - lo <= 2 * span:
                buf = self._read(path, lo, hi - lo)
                for n in names_in_file:
                    _, b, e = locations[n][0]
                    out[n] = self._tensor(n, buf, b - lo, e - lo, verify)
            else:
                for n in names_in_file:
                    _, b, e = locations[n][0]
                    out[n] = self._tensor(n, self._read(path, b, e - b), 0, e - b, verify)
        # Each file mapped once for all its chunks, as a NumPy array: a tensor may have
        # thousands of extents, and slicing, hashing and copying NumPy views costs a
        # fraction of the same on torch tensors, per extent.
        maps: dict[str, np.ndarray | None] = {}

        def mapped(path: str, end: int) -> np.ndarray | None:
            if path not in maps:
                mm = self.storage.map_file(path)
                maps[path] = None if mm is None else np.frombuffer(mm, dtype=np.uint8)
            whole = maps[path]
            return whole if whole is not None and end <= whole.size else None

        for name in wanted:
            if len(locations[name]) == 1:
                continue
            # chunks in several places
            dest = self._destination(name, (into or {}).get(name))
            if dest is not None and verify:
                sources = [mapped(path, e) for path, _, e in locations[name]]
                if all(src is not None for src in sources):
                    digest = xxhash.xxh3_64()
                    copies = []
                    pos = 0
                    for src, (_, b, e) in zip(sources, locations[name]):
                        assert src is not None
                        piece = src[b:e]
                        digest.update(piece.data)
                        copies.append((pos, piece))
                        pos += e - b
                    self._check_sum(name, digest.hexdigest())
                    self._fills.append((dest, copies))
                    out[name] = dest
                    continue
            total = sum(e - b for _, b, e in locations[name])
            buf = torch.empty(total, dtype=torch.uint8)
            flat = buf.numpy()
            pos = 0
            for path, b, e in locations[name]:
                if e > b:
                    src = mapped(path, e)
                    if src is not None:
                        flat[pos : pos + e - b] = src[b:e]
                    else:
                        self.storage.read_into(path, b, byte_view(buf[pos : pos + e - b]))
                pos += e - b
            out[name] = self._tensor(name, buf, 0, total, verify)
        return out

    def _destination(self, name: str, dest: torch.Tensor | None) -> torch.Tensor | None:
        """``dest`` as a flat byte view, if a verified tensor ``name`` can be copied
        straight into it: a contiguous CPU tensor of its dtype and shape."""
        info = self.manifest["tensors"][name]
        if (
            not isinstance(dest, torch.Tensor)
            or type(dest) not in (torch.Tensor, torch.nn.Parameter)
            or dest.device.type != "cpu"
            or not dest.is_contiguous()
            or dest.numel() == 0
            or dest.dtype != dtype_from_name(info["dtype"])
            or list(dest.shape) != info["shape"]
        ):
            return None
        return dest

    def fill(self) -> None:
        """Copy the chunks of the tensors `tensors` returned unassembled (``into``)
        into them; once."""
        fills, self._fills = self._fills, []
        for dest, copies in fills:
            flat = dest.detach().view(-1).view(torch.uint8).numpy()  # dest's own memory
            for pos, src in copies:
                flat[pos : pos + src.size] = src

    def _check_sum(self, name: str, got: str) -> None:
        want = self.manifest["tensors"][name][CHECKSUM]
        if got != want:
            raise CorruptCheckpointError(
                f"{self.where}: checksum mismatch in tensor {name!r} "
                f"(expected {want}, found {got}); the file is damaged"
            )

    def _read(self, path: str, offset: int, length: int) -> torch.Tensor:
        """Bytes ``[offset, offset + length)`` of a data file: a view of the file mapped
        copy-on-write where the backend can map (no allocation, no copy), else a read
        into a new buffer. Sizes were checked against the manifest before."""
        mm = self.storage.map_file(path) if length > 0 else None
        if mm is not None:
            if offset + length <= len(mm):
                self.mapped = True
                return torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=length)
            mm.close()
        buf = torch.empty(length, dtype=torch.uint8)
        if length:
            self.storage.read_into(path, offset, byte_view(buf))
        return buf

    def _tensor(self, name: str, buf: torch.Tensor, b: int, e: int, verify: bool) -> torch.Tensor:
        info = self.manifest["tensors"][name]
        raw = buf[b:e]
        if verify:
            self._check_sum(name, checksum(byte_view(raw)) if e > b else checksum(b""))
        dtype = dtype_from_name(info["dtype"])
        if raw.storage_offset() % _itemsize(dtype) != 0:
            raw = raw.clone()
        return raw.view(dtype).view(info["shape"])

    def verify(self) -> int:
        """Full check, the same a restore makes before it touches a live object:
        manifest (including how pieces tile global tensors), files, every checksum,
        every rank's tree decoded, and its random streams tried on throwaway
        generators. Returns bytes verified; raises `CorruptCheckpointError` on the
        first problem. Never initialises a GPU (tensors stay on the CPU)."""
        from resumable.capture import RNG_KEY, check_rng_state, decode

        self.check_files()
        tensors = self.tensors()

        def unassembled(fqn: str) -> torch.Tensor:  # the manifest check proved it tiles
            return torch.empty(0)

        for i, r in enumerate(self.manifest["ranks"]):
            values = decode(r["tree"], tensors, "cpu", resolve=unassembled)
            if RNG_KEY in values:
                try:
                    check_rng_state(values[RNG_KEY])
                except CorruptCheckpointError as exc:
                    raise CorruptCheckpointError(f"{self.where}: rank {i}: {exc}") from None
        return sum(f["size"] for f in self.manifest["files"].values())


def _contiguous(own: list[tuple[str, int, int]]) -> bool:
    """Whether pieces lie back to back in one file (a tensor written whole)."""
    return len({f for f, _, _ in own}) == 1 and all(
        a[2] == b[1] for a, b in itertools.pairwise(own)
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
