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
        self._table_cache: dict[str, tuple[list[tuple[int | None, str]], np.ndarray]] = {}
        # Tensors `tensors` returned unassembled, and where their bytes lie, for `fill`.
        self._fills: list[tuple[torch.Tensor, _Pieces]] = []

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
        # Per own file, the changed chunks written there, each a U8 entry: (k, 2) arrays
        # of (begin, end).
        chunks: dict[str, list[np.ndarray]] = defaultdict(list)
        # Per file of another checkpoint, the lowest begin and the highest end of the
        # chunks this one reads there: those two decide whether all lie inside its data.
        bounds: dict[tuple[int, str], tuple[int, int]] = {}
        for name, info in m["tensors"].items():
            if "chunks" not in info and "extents" not in info:
                expect[info["file"]].append((name, info["dtype"], info["shape"], info["offsets"]))
                continue
            keys, a = self._table(name)
            own_files: list[str] = []  # the own files among the sources
            fid = np.full(len(keys), -1, dtype=np.int64)  # source -> own file, or -1
            for i, (step, fname) in enumerate(keys):
                if step is None:
                    if fname not in own_files:
                        own_files.append(fname)
                    fid[i] = own_files.index(fname)
                    continue
                sel = a[a[:, 0] == i]
                if len(sel):
                    lo, hi = int(sel[:, 1].min()), int(sel[:, 2].max())
                    was = bounds.get((step, fname), (lo, hi))
                    bounds[(step, fname)] = (min(was[0], lo), max(was[1], hi))
            where = fid[a[:, 0]]
            own = a[where >= 0]
            if (
                len(own) == len(a)
                and len(own_files) == 1
                and bool((own[1:, 1] == own[:-1, 2]).all())
            ):  # written whole: one entry, as in a full file
                expect[own_files[0]].append(
                    (name, info["dtype"], info["shape"], [int(own[0, 1]), int(own[-1, 2])])
                )
            else:  # changed chunks: U8 entries, whatever their names
                for k, fname in enumerate(own_files):
                    chunks[fname].append(a[where == k][:, 1:])
        for step, fname in sorted(bounds):
            holder = self._holder(step)
            key = self._holder_file(holder, fname)
            size = holder.manifest["files"][key]["size"]
            # Where its data starts is all this checkpoint uses of that file's header:
            # the bytes it reads there are checked against its own checksums, and that
            # checkpoint's header is checked in full whenever it is itself read.
            start = 8 + holder._header_length(key, size)
            lo, hi = bounds[(step, fname)]
            if lo < start or hi > size:
                raise CorruptCheckpointError(
                    f"{self.where}: a chunk lies outside the data of {fname} in "
                    f"{holder.dir} (bytes [{start}, {size})): one begins at {lo}, one ends "
                    f"at {hi}"
                )
        for fname, finfo in m["files"].items():
            start, header = self._check_file(fname, finfo["size"])
            for name, dtype, shape, offsets in expect.get(fname, []):
                h = header.get(name)
                if (
                    not isinstance(h, dict)
                    or h.get("dtype") != dtype
                    or h.get("shape") != shape
                    or [start + o for o in h["data_offsets"]] != offsets
                ):
                    raise CorruptCheckpointError(
                        f"{self.where}: {fname}'s safetensors header disagrees with the "
                        f"manifest about tensor {name!r}"
                    )
            if fname in chunks:
                _check_chunk_entries(
                    np.concatenate(chunks[fname]), header, start, self.where, fname
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

    def _table(self, name: str) -> tuple[list[tuple[int | None, str]], np.ndarray]:
        """Where the bytes of a tensor with pieces lie, in order: its sources (step, or
        None for this checkpoint; file) and an (n, 3) array of (source index, begin,
        end). Made once per tensor: several checks walk it, and a version 3 entry may
        have thousands of extents."""
        got = self._table_cache.get(name)
        if got is None:
            info = self.manifest["tensors"][name]
            if "extents" in info:
                keys = [(s.get("step"), s["file"]) for s in info["sources"]]
                a = np.array(info["extents"], dtype=np.int64).reshape(-1, 3)
            else:
                ids: dict[tuple[int | None, str], int] = {}
                rows = [
                    (ids.setdefault((st, f), len(ids)), b, e) for st, f, b, e in tensor_ranges(info)
                ]
                keys, a = list(ids), np.array(rows, dtype=np.int64).reshape(-1, 3)
            got = self._table_cache[name] = (keys, a)
        return got

    def _locations(self, name: str) -> tuple[list[str], np.ndarray]:
        """Where the bytes of a tensor with pieces lie, in order: paths in storage and
        an (n, 3) array of (path index, begin, end), pieces back to back in one file
        merged into one."""
        keys, a = self._table(name)
        paths: list[str] = []
        pid = np.empty(len(keys), dtype=np.int64)  # source -> path index
        for i, (step, fname) in enumerate(keys):
            if step is None:
                path = f"{self.dir}/{fname}"  # its size checked against the manifest's
            else:
                holder = self._holder(step)
                key = self._holder_file(holder, fname)
                path = f"{holder.dir}/{key}"
                size = holder.manifest["files"][key]["size"]
                sel = a[a[:, 0] == i]
                if len(sel) and int(sel[:, 2].max()) > size:
                    raise CorruptCheckpointError(
                        f"{self.where}: a chunk ends at {int(sel[:, 2].max())}, past the end "
                        f"of {fname} in {step_dir(step)} ({size} bytes)"
                    )
            if path not in paths:
                paths.append(path)
            pid[i] = paths.index(path)
        p = pid[a[:, 0]]
        # a piece that begins where the one before it ended, in the same file, joins it
        joins = (p[1:] == p[:-1]) & (a[1:, 1] == a[:-1, 2])
        first = np.flatnonzero(np.concatenate(([True], ~joins)))
        last = np.concatenate((first[1:] - 1, [len(a) - 1]))
        return paths, np.stack([p[first], a[first, 1], a[last, 2]], axis=1)

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
        single: dict[str, tuple[str, int, int]] = {}  # bytes in one place: (path, b, e)
        pieces: dict[str, tuple[list[str], np.ndarray]] = {}  # in several: `_locations`
        for name in wanted:
            info = index[name]
            if "chunks" not in info and "extents" not in info:
                single[name] = (f"{self.dir}/{info['file']}", *info["offsets"])
                continue
            paths, a = self._locations(name)
            if len(a) == 1:
                single[name] = (paths[int(a[0, 0])], int(a[0, 1]), int(a[0, 2]))
            else:
                pieces[name] = (paths, a)
        by_path: dict[str, list[str]] = defaultdict(list)
        for name, (path, _, _) in single.items():
            by_path[path].append(name)
        out: dict[str, torch.Tensor] = {}
        for path, names_in_file in by_path.items():
            ranges = [single[n][1:] for n in names_in_file]
            lo = min(r[0] for r in ranges)
            hi = max(r[1] for r in ranges)
            span = sum(r[1] - r[0] for r in ranges)
            if hi - lo <= 2 * span:
                buf = self._read(path, lo, hi - lo)
                for n in names_in_file:
                    _, b, e = single[n]
                    out[n] = self._tensor(n, buf, b - lo, e - lo, verify)
            else:
                for n in names_in_file:
                    _, b, e = single[n]
                    out[n] = self._tensor(n, self._read(path, b, e - b), 0, e - b, verify)
        # Each file mapped once for all its pieces: a tensor may have thousands.
        maps: dict[str, memoryview | None] = {}

        def mapped(path: str, end: int) -> memoryview | None:
            if path not in maps:
                mm = self.storage.map_file(path)
                maps[path] = None if mm is None else memoryview(mm)
            whole = maps[path]
            return whole if whole is not None and end <= whole.nbytes else None

        for name, (paths, a) in pieces.items():
            ends = [int(a[a[:, 0] == i, 2].max(initial=0)) for i in range(len(paths))]
            sources = [mapped(path, end) for path, end in zip(paths, ends)]
            found = [src for src in sources if src is not None]
            gather = _Pieces(found, a) if len(found) == len(sources) else None
            dest = self._destination(name, (into or {}).get(name))
            if gather is not None and dest is not None and verify:
                # the checksum over the pieces where they lie; copied by `fill`
                self._check_sum(name, gather.digest())
                self._fills.append((dest, gather))
                out[name] = dest
                continue
            total = int((a[:, 2] - a[:, 1]).sum())
            buf = torch.empty(total, dtype=torch.uint8)
            if gather is not None:
                gather.copy_into(buf.numpy().data)
            else:
                pos = 0
                for i, b, e in a.tolist():
                    if e > b:
                        self.storage.read_into(paths[i], b, byte_view(buf[pos : pos + e - b]))
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
        for dest, gather in fills:
            gather.copy_into(dest.detach().view(-1).view(torch.uint8).numpy().data)

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


def _check_chunk_entries(
    want: np.ndarray, header: Mapping[str, Any], start: int, where: str, fname: str
) -> None:
    """Each (begin, end) row of ``want``, file positions of changed chunks, is a
    one-dimensional U8 entry of ``fname``'s safetensors ``header`` (its data at
    ``start``), whatever the entry's name."""
    got = [
        h["data_offsets"]
        for k, h in header.items()
        if k != "__metadata__" and h["dtype"] == "U8" and len(h["shape"]) == 1
    ]  # parse_safetensors_header checked each entry's shape against its offsets
    have = np.array(got, dtype=np.int64).reshape(-1, 2) + start
    have = have[np.argsort(have[:, 0], kind="stable")]
    at = np.minimum(np.searchsorted(have[:, 0], want[:, 0]), max(len(have) - 1, 0))
    ok = (
        (have[at, 0] == want[:, 0]) & (have[at, 1] == want[:, 1])
        if len(have)
        else np.zeros(len(want), dtype=bool)
    )
    if not ok.all():
        b, e = want[int(np.argmin(ok))].tolist()
        raise CorruptCheckpointError(
            f"{where}: {fname}'s safetensors header disagrees with the manifest about a "
            f"chunk at {[b, e]} (no U8 entry holds exactly those bytes)"
        )


class _Pieces:
    """The bytes of a tensor whose pieces lie in mapped files, in the tensor's order,
    hashed or copied a piece at a time through memoryviews: of what a piece costs in
    Python, slicing a memoryview is the cheapest (NumPy views cost more per piece, and
    gathering rows with NumPy fancy indexing or torch's index ops more than that)."""

    def __init__(self, sources: list[memoryview], a: np.ndarray) -> None:
        self.sources = sources  # the mapped files, by path index
        self.rows: list[list[int]] = a.tolist()  # (path index, begin, end), in order

    def digest(self) -> str:
        h = xxhash.xxh3_64()
        update, sources = h.update, self.sources
        for i, b, e in self.rows:
            update(sources[i][b:e])
        return h.hexdigest()

    def copy_into(self, flat: memoryview) -> None:
        """Write the tensor's bytes into ``flat`` (their total length, format ``B``)."""
        sources, pos = self.sources, 0
        for i, b, e in self.rows:
            flat[pos : pos + e - b] = sources[i][b:e]
            pos += e - b


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
