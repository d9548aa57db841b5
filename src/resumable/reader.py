"""Read and verify a committed checkpoint, defensively.

This is the load path, and it trusts nothing it reads: the whole manifest is validated
by `resumable.format.decode_manifest` (structure, names, sizes, digest, byte ranges,
tiling of global tensors, state trees) before anything is allocated for it; every data
file read must have the size the manifest declares and a valid safetensors header that
agrees with the tensor index, checked before its first read (only the files read: a
restoring rank reads a few of the N ranks' files); every tensor's bytes are checksummed
(on several threads where there are many, `_digests`) before any tensor is returned.
Only then does the manager touch the live training state. No byte of a data file
belongs to two tensors and no tree references a tensor twice, so what a restore reads
and builds is bounded by the checkpoint's real size. There is no pickle here, and every
path goes through the storage's root check.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from resumable._dtypes import dtype_from_name
from resumable._lazy import numpy_module, torch_module
from resumable._mapped_pieces import MappedPieces
from resumable.commit import step_dir
from resumable.errors import CorruptCheckpointError, NewerFormatError
from resumable.format import (
    CHECKSUM,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_SAFETENSORS_HEADER,
    byte_view,
    checksum,
    copy_checksum,
    decode_manifest,
    has_segments,
    is_split,
    parse_safetensors_header,
    tensor_ranges,
)
from resumable.nodes import SegmentView
from resumable.parts import check_parts, read_merged, top_sizes
from resumable.storage.base import Storage

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = numpy_module()
    torch = torch_module()


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
        self._top: dict[str, Any] | None = None
        # A split manifest (version 4): the rank whose parts alone to read, or None for all.
        self._rank: int | None = None
        self.mapped = False  # whether tensors() returned views of mapped files
        self._holders: dict[int, CheckpointReader] = {}  # earlier checkpoints referred to
        self._extents_cache: _Extents | None = None
        # The long extents lists the manifest's validation made into arrays, by tensor.
        self._arrays: dict[str, np.ndarray] = {}
        self._locations_cache: _Locations | None = None
        self._file_plan_cache: _FilePlan | None = None
        # The files `check_files` found sound: (step or None for this one, file).
        self._checked: set[tuple[int | None, str]] = set()
        # Tensors `tensors` returned unassembled, and where their bytes lie, for `fill`.
        self._fills: list[tuple[torch.Tensor, MappedPieces]] = []
        # Tensors `tensors` returned unchecked (``fuse``), for `fill` to copy and check:
        # (name, the bytes where they lie, the live tensor, its bytes)
        self._fused: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.fused_started = False  # whether `fill` began copying unchecked bytes
        self._owned: set[int] = set()  # ids of the live tensors `fill` writes

    @property
    def top(self) -> dict[str, Any]:
        """The manifest file, validated: the whole manifest of versions 1 to 3; of a
        split one (version 4), the header, data files, parts and refs, without reading
        a part. Enough for retention (metrics, refs, sizes)."""
        if self._top is None:
            path = f"{self.dir}/{MANIFEST}"
            raw = self._read_capped(path, MAX_MANIFEST_BYTES, "manifest")
            arrays: dict[str, np.ndarray] = {}
            m = decode_manifest(raw, where=self.where, files_only=self._files_only, arrays=arrays)
            if m["step"] != self.step:
                raise CorruptCheckpointError(
                    f"{self.where}: manifest says step {m['step']}, directory says {self.step}"
                )
            if is_split(m):
                check_parts(m, self.where)
                if has_segments(m):  # versions 6 and 7: files and parts in node objects
                    self.storage = SegmentView(self.storage, self.dir, m)
            else:
                self._manifest, self._arrays = m, arrays
            self._top = m
        return self._top

    @property
    def manifest(self) -> dict[str, Any]:
        """The whole manifest, validated, as versions 1 to 3 lay it out. Of a split one,
        the top with its parts merged (`resumable.parts.merge`): every part, or where
        `only_rank` was called, those that rank needs (``partial`` is then True)."""
        if self._manifest is None:
            top = self.top
            if self._manifest is None:
                if self._files_only:
                    self._manifest = top
                else:
                    self._manifest = self._merged(top)
        return self._manifest

    def only_rank(self, rank: int) -> None:
        """Read, of a split manifest, only what ``rank`` restores at the world size it was
        saved with: its own part and the parts holding the replicated tensors its tree
        names (all parts where its part does not say where each lies). Call before
        `manifest`; no effect on versions 1 to 3. `widen` reads the rest."""
        self._rank = rank

    def widen(self) -> None:
        """Drop a partial manifest (`only_rank`): the next `manifest` reads every part."""
        if self._rank is None:
            return
        self._rank = None
        if self._manifest is not None and self._manifest.get("partial"):
            self._manifest = None
            self._extents_cache = self._locations_cache = self._file_plan_cache = None
            self._arrays = {}

    @property
    def partial(self) -> bool:
        """Whether `manifest` holds some ranks' parts only."""
        return bool(self.manifest.get("partial"))

    def _merged(self, top: dict[str, Any]) -> dict[str, Any]:
        """A split manifest's parts read, checked and merged (`resumable.parts.read_merged`):
        each part's size is checked before it is read."""

        def read(entry: Mapping[str, Any]) -> bytes:
            path = f"{self.dir}/{entry['file']}"
            return self._read_capped(path, entry["size"], f"part {entry['rank']}")

        arrays: dict[str, np.ndarray] = {}
        m = read_merged(top, read, step=self.step, where=self.where, rank=self._rank, arrays=arrays)
        self._arrays = arrays
        return m

    def _read_capped(self, path: str, cap: int, what: str) -> bytes:
        try:
            size = self.storage.size(path)
            if size > cap:  # refuse before allocating for it
                raise CorruptCheckpointError(
                    f"{self.where}: {what} of {size} bytes exceeds the {cap} expected"
                )
            return self.storage.read(path)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{self.where}: {what} is missing") from exc

    @property
    def tree(self) -> Any:
        """The state tree of rank 0."""
        return self.manifest["ranks"][0]["tree"]

    def check_files(self, names: Iterable[str] | None = None) -> None:
        """Check the data files that hold the bytes of tensors ``names`` (every file of
        the checkpoint when None), each once per reader: present, of the declared size,
        with a safetensors header that agrees with the tensor index; and the chunks
        this checkpoint reads in an earlier one's file inside that file's data.
        `tensors` calls it for the files it reads, so a restoring rank checks its own
        files and those holding the pieces it loads, not every rank's. Raises
        `CorruptCheckpointError` (names not in the index are left to `tensors`)."""
        m = self.manifest
        plan = self._file_plan()
        keys = plan.keys if names is None else self._keys_of(names, plan)
        if keys <= self._checked:
            return
        for step, fname in sorted((s, f) for s, f in keys - self._checked if s is not None):
            holder = self._holder(step)
            hkey = self._holder_file(holder, fname)
            size = holder.manifest["files"][hkey]["size"]
            # Where its data starts is all this checkpoint uses of that file's header:
            # the bytes it reads there are checked against its own checksums, and that
            # checkpoint's header is checked in full whenever it is itself read.
            start = 8 + holder._header_length(hkey, size)
            lo, hi = plan.bounds[(step, fname)]
            if lo < start or hi > size:
                raise CorruptCheckpointError(
                    f"{self.where}: a chunk lies outside the data of {fname} in "
                    f"{holder.dir} (bytes [{start}, {size})): one begins at {lo}, one ends "
                    f"at {hi}"
                )
            self._checked.add((step, fname))
        for fname, finfo in m["files"].items():
            if (None, fname) not in keys or (None, fname) in self._checked:
                continue
            start, header = self._check_file(fname, finfo["size"])
            for name, dtype, shape, offsets in plan.expect.get(fname, []):
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
            if fname in plan.chunks:
                _check_chunk_entries(plan.chunks[fname], header, start, self.where, fname)
            self._checked.add((None, fname))

    def check_sizes(self) -> None:
        """Check that every data file this checkpoint reads is there with the size its
        manifest declares, from one listing of each checkpoint directory involved: this
        one, and each earlier one whose files its chunks lie in (those chunks must end
        inside the file). No file is opened, so on an object store the cost is a
        listing per 1,000 files, not requests per file as `check_files` makes.
        Retention checks the checkpoint just written so (`resumable.retention` says why
        that is enough); a restore still runs `check_files` and the checksums. Of a
        split manifest, from its top alone: the data files and parts, and each earlier
        checkpoint it refers to, every data file at its declared size (a restore checks
        that each chunk lies inside). Raises `CorruptCheckpointError`."""
        top = self.top
        if is_split(top):
            self._sizes_listed(self, top_sizes(top))
            for step in top["refs"]:
                holder = self._holder(step)
                files = holder.manifest["files"]
                self._sizes_listed(holder, {f: info["size"] for f, info in files.items()})
            return
        m = self.manifest
        self._sizes_listed(self, {f: info["size"] for f, info in m["files"].items()})
        wanted: dict[int, dict[str, int]] = defaultdict(dict)
        for (step, fname), (_, hi) in sorted(self._referred_bounds().items()):
            holder = self._holder(step)
            hkey = self._holder_file(holder, fname)
            size = holder.manifest["files"][hkey]["size"]
            if hi > size:
                raise CorruptCheckpointError(
                    f"{self.where}: a chunk ends at {hi}, past the {size} bytes of {fname} "
                    f"in {holder.dir}"
                )
            wanted[step][hkey] = size
        for step, sizes in wanted.items():
            self._sizes_listed(self._holder(step), sizes)

    def _referred_bounds(self) -> dict[tuple[int, str], tuple[int, int]]:
        """Per file of another checkpoint, the lowest begin and the highest end of the
        pieces this one reads there (`_FilePlan.bounds`). Found in Python where every
        extents list is short, without loading NumPy: a persist worker checks so each
        checkpoint it writes (`check_sizes`); else from `_file_plan`."""
        if self._file_plan_cache is not None:
            return self._file_plan_cache.bounds
        bounds: dict[tuple[int, str], tuple[int, int]] = {}

        def reads(step: int | None, fname: str, begin: int, end: int) -> None:
            if step is not None:
                lo, hi = bounds.get((step, fname), (begin, end))
                bounds[(step, fname)] = (min(lo, begin), max(hi, end))

        for info in self.manifest["tensors"].values():
            if "extents" in info:
                ext, sources = info["extents"], info["sources"]
                if len(ext) >= _SHORT:
                    return self._file_plan().bounds
                for j in range(0, len(ext), 3):
                    src = sources[ext[j]]
                    reads(src.get("step"), src["file"], ext[j + 1], ext[j + 2])
            elif "chunks" in info:
                for step, fname, begin, end in tensor_ranges(info):
                    reads(step, fname, begin, end)
        return bounds

    def _sizes_listed(self, reader: CheckpointReader, sizes: Mapping[str, int]) -> None:
        """Each file of ``sizes`` is listed in ``reader``'s directory with its size."""
        listed = self.storage.list_files(reader.dir)
        for fname, size in sizes.items():
            actual = listed.get(fname)
            if actual is None:
                raise CorruptCheckpointError(f"{reader.where}: data file {fname} is missing")
            if actual != size:
                raise CorruptCheckpointError(
                    f"{reader.where}: {fname} has {actual} bytes, manifest declares {size}"
                    " (truncated or overwritten)"
                )

    def _keys_of(self, names: Iterable[str], plan: _FilePlan) -> set[tuple[int | None, str]]:
        """The files (step or None for this checkpoint; file) holding bytes of ``names``."""
        index = self.manifest["tensors"]
        keys: set[tuple[int | None, str]] = set()
        pieced: list[int] = []
        for name in names:
            info = index.get(name)
            if info is None:
                continue
            if "chunks" in info or "extents" in info:
                pieced.append(plan.position[name])
            else:
                keys.add((None, info["file"]))
        if pieced:
            x = self._extents()
            sel = np.isin(x.rows[:, 0], pieced)
            keys.update(x.keys[k] for k in np.unique(x.rows[sel, 1]).tolist())
        return keys

    def _file_plan(self) -> _FilePlan:
        """What `check_files` checks each file against, worked out once from the
        manifest for all files (no request to storage)."""
        if self._file_plan_cache is not None:
            return self._file_plan_cache
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
        x = self._extents()
        t, key, begin, end = x.rows.T
        for k, (step, fname) in enumerate(x.keys):
            sel = key == k
            if step is not None and sel.any():
                bounds[(step, fname)] = (int(begin[sel].min()), int(end[sel].max()))
        own = np.array([step is None for step, _ in x.keys], dtype=bool)[key]
        # A tensor all of whose pieces lie back to back in one own file was written
        # whole: one entry, as in a full file. Others' own pieces are changed chunks:
        # U8 entries, whatever their names.
        inside = t[1:] == t[:-1]
        breaks = inside & ((key[1:] != key[:-1]) | (begin[1:] != end[:-1]))
        n = len(x.names)
        whole = (np.bincount(t[~own], minlength=n) == 0) & (
            np.bincount(t[1:][breaks], minlength=n) == 0
        )
        for i in np.flatnonzero(whole).tolist():
            name, first, last = x.names[i], int(x.starts[i]), int(x.starts[i + 1]) - 1
            info = m["tensors"][name]
            fname = x.keys[int(key[first])][1]
            expect[fname].append(
                (name, info["dtype"], info["shape"], [int(begin[first]), int(end[last])])
            )
        changed = own & ~whole[t]
        for k in np.unique(key[changed]).tolist():
            chunks[x.keys[k][1]].append(x.rows[changed & (key == k)][:, 2:])
        keys: set[tuple[int | None, str]] = {(None, f) for f in m["files"]}
        keys.update(bounds)
        self._file_plan_cache = _FilePlan(
            dict(expect),
            {f: np.concatenate(c) for f, c in chunks.items()},
            bounds,
            keys,
            {name: i for i, name in enumerate(x.names)},
        )
        return self._file_plan_cache

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

    def _extents(self) -> _Extents:
        """The pieces of every tensor with pieces (version 2 and 3 entries), in one
        table, made once: a manifest may have thousands of such tensors, or a tensor
        thousands of extents, and each check then runs once over all of them."""
        if self._extents_cache is None:
            names: list[str] = []
            keys: dict[tuple[int | None, str], int] = {}  # (step or None, file) -> id
            small: list[tuple[int, int, int, int]] = []  # (tensor, key, begin, end)
            parts: list[np.ndarray] = []  # the same, a long extents list at a time
            for name, info in self.manifest["tensors"].items():
                if "extents" in info:
                    i = len(names)
                    ids = [
                        keys.setdefault((src.get("step"), src["file"]), len(keys))
                        for src in info["sources"]
                    ]
                    ext = info["extents"]
                    a = self._arrays.get(name)
                    if a is None and len(ext) < _SHORT:
                        small.extend(
                            (i, ids[ext[j]], ext[j + 1], ext[j + 2]) for j in range(0, len(ext), 3)
                        )
                    else:
                        if a is None:
                            a = np.array(ext, dtype=np.int64).reshape(-1, 3)
                        lookup = np.array(ids, dtype=np.int64)
                        parts.append(
                            np.stack(
                                [np.full(len(a), i), lookup[a[:, 0]], a[:, 1], a[:, 2]], axis=1
                            )
                        )
                elif "chunks" in info:
                    i = len(names)
                    small.extend(
                        (i, keys.setdefault((st, f), len(keys)), b, e)
                        for st, f, b, e in tensor_ranges(info)
                    )
                else:
                    continue
                names.append(name)
            rows = np.concatenate([np.array(small, dtype=np.int64).reshape(-1, 4), *parts])
            rows = rows[np.argsort(rows[:, 0], kind="stable")]  # by tensor, in order
            starts = np.searchsorted(rows[:, 0], np.arange(len(names) + 1))
            self._extents_cache = _Extents(names, list(keys), rows, starts)
        return self._extents_cache

    def _locations(self) -> _Locations:
        """Where the pieces of every tensor with pieces lie: a path in storage per key
        of `_extents`, and the pieces with those back to back in one file merged."""
        if self._locations_cache is None:
            x = self._extents()
            t, key, begin, end = x.rows.T
            paths: list[str] = []
            for k, (step, fname) in enumerate(x.keys):
                if step is None:
                    paths.append(f"{self.dir}/{fname}")  # size checked against the manifest
                    continue
                holder = self._holder(step)
                hkey = self._holder_file(holder, fname)
                paths.append(f"{holder.dir}/{hkey}")
                size = holder.manifest["files"][hkey]["size"]
                sel = key == k
                if sel.any() and int(end[sel].max()) > size:
                    raise CorruptCheckpointError(
                        f"{self.where}: a chunk ends at {int(end[sel].max())}, past the end "
                        f"of {fname} in {step_dir(step)} ({size} bytes)"
                    )
            # a piece that begins where the one before it in the same tensor ended, in
            # the same file, joins it
            joins = (t[1:] == t[:-1]) & (key[1:] == key[:-1]) & (begin[1:] == end[:-1])
            first = np.flatnonzero(np.concatenate(([True], ~joins)))
            last = np.concatenate((first[1:] - 1, [len(t) - 1]))
            merged = np.stack([key[first], begin[first], end[last]], axis=1)
            starts = np.searchsorted(t[first], np.arange(len(x.names) + 1))
            where = {name: (int(starts[i]), int(starts[i + 1])) for i, name in enumerate(x.names)}
            self._locations_cache = _Locations(paths, merged, where)
        return self._locations_cache

    def tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        verify: bool = True,
        into: Mapping[str, torch.Tensor] | None = None,
        fuse: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Read (and by default checksum) tensors, as CPU tensors. All of a file's
        tensors are read with one sequential read of its data span. The files read
        are checked first (`check_files`, once per reader), only those.

        ``into``: where the caller will copy a tensor anyway (the live tensor of the
        same name, shape and dtype). A tensor whose bytes lie in several places (a
        version 2 or 3 entry with pieces in earlier checkpoints) is then not assembled in a
        buffer of its own: its checksum is computed over the chunks where they lie
        (files mapped), and the tensor returned is the ``into`` one, still unchanged;
        `fill` copies the chunks into it. The caller calls `fill` once it is about to
        copy every value into the live state, so that nothing live changes before the
        whole checkpoint was read and verified.

        ``fuse`` (with ``verify``): a tensor whose bytes lie in one place and that has a
        destination in ``into`` is not checked here either: the tensor returned is the
        ``into`` one, unchanged, and `fill` copies its bytes into it and checks them in
        the same pass (`copy_checksum`). A mismatch is then found once live tensors
        were written: the caller must be able to restore something else over them
        (`docs/decisions.md`)."""
        assert not self._files_only, "a files-only reader reads no tensors"
        m = self.manifest
        index = m["tensors"]
        wanted = list(index) if names is None else list(names)
        for name in wanted:
            if name not in index:
                raise CorruptCheckpointError(f"{self.where}: no tensor {name!r} in the index")
        self.check_files(None if names is None else wanted)
        single: dict[str, tuple[str, int, int]] = {}  # bytes in one place: (path, b, e)
        pieces: dict[str, np.ndarray] = {}  # in several: (path index, begin, end) rows
        at = None
        for name in wanted:
            info = index[name]
            if "chunks" not in info and "extents" not in info:
                single[name] = (f"{self.dir}/{info['file']}", *info["offsets"])
                continue
            at = at or self._locations()
            lo, hi = at.where[name]
            if hi - lo == 1:
                k, b, e = at.merged[lo].tolist()
                single[name] = (at.paths[k], b, e)
            else:
                pieces[name] = at.merged[lo:hi]
        by_path: dict[str, list[str]] = defaultdict(list)
        for name, (path, _, _) in single.items():
            by_path[path].append(name)
        out: dict[str, torch.Tensor] = {}
        # (name, bytes, what computes its checksum): run once every tensor is found,
        # on several threads where there are enough bytes (`_digests`)
        checks: list[tuple[str, int, Callable[[], str]]] | None = [] if verify else None
        fills: list[tuple[torch.Tensor, MappedPieces]] = []
        regions: list[tuple[int, int]] = []  # (address, bytes) of what the checks read
        targets = (into or {}) if fuse and verify else {}

        def place(n: str, buf: torch.Tensor, b: int, e: int) -> torch.Tensor:
            dest = self._destination(n, targets.get(n)) if n in targets else None
            if dest is None:
                return self._tensor(n, buf, b, e, checks)
            try:
                flat = dest.detach().view(-1).view(torch.uint8)
            except RuntimeError:  # a dtype without a byte view
                return self._tensor(n, buf, b, e, checks)
            self._fused.append((n, buf[b:e], dest, flat))
            self._owned.add(id(dest))
            return dest

        for path, names_in_file in by_path.items():
            ranges = [single[n][1:] for n in names_in_file]
            lo = min(r[0] for r in ranges)
            hi = max(r[1] for r in ranges)
            span = sum(r[1] - r[0] for r in ranges)
            if hi - lo <= 2 * span:
                buf = self._read(path, lo, hi - lo)
                regions.append((buf.data_ptr(), buf.numel()))
                for n in sorted(names_in_file, key=lambda n: single[n][1]):
                    _, b, e = single[n]
                    out[n] = place(n, buf, b - lo, e - lo)
            else:  # a few of the file's tensors: one mapping, only their bytes read ahead
                whole = self._mapped(path, sorted(ranges), hi)
                for n in names_in_file:
                    _, b, e = single[n]
                    if whole is not None:
                        regions.append((whole.data_ptr() + b, e - b))
                        out[n] = place(n, whole, b, e)
                        continue
                    buf = self._read(path, b, e - b)
                    regions.append((buf.data_ptr(), buf.numel()))
                    out[n] = place(n, buf, 0, e - b)
        # Each file mapped once for all its pieces: a tensor may have thousands.
        maps: dict[int, memoryview | None] = {}
        spans: dict[int, tuple[int, int]] = {}  # per file, from its first piece to its last
        if pieces:
            rows = np.concatenate(list(pieces.values()))
            rows = rows[np.argsort(rows[:, 0], kind="stable")]
            files, first = np.unique(rows[:, 0], return_index=True)
            lows = np.minimum.reduceat(rows[:, 1], first)
            highs = np.maximum.reduceat(rows[:, 2], first)
            spans = {int(k): (int(b), int(e)) for k, b, e in zip(files, lows, highs)}

        def mapped(k: int) -> memoryview | None:
            if k not in maps:
                assert at is not None
                mm = self.storage.map_file(at.paths[k], spans.get(k))
                view = None if mm is None else memoryview(mm)
                maps[k] = view
                if view is not None and k in spans:
                    b, e = spans[k]
                    address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
                    regions.append((address + b, min(e, view.nbytes) - b))
            return maps[k]

        for name, a in pieces.items():
            assert at is not None
            ends = {k: int(a[a[:, 0] == k, 2].max()) for k in np.unique(a[:, 0]).tolist()}
            views = {k: mapped(k) for k in ends}
            found = {k: v for k, v in views.items() if v is not None and ends[k] <= v.nbytes}
            gather = MappedPieces(found, a) if len(found) == len(views) else None
            dest = self._destination(name, (into or {}).get(name))
            if gather is not None and dest is not None and checks is not None:
                # the checksum over the pieces where they lie; copied by `fill`
                checks.append((name, int((a[:, 2] - a[:, 1]).sum()), gather.digest))
                fills.append((dest, gather))
                out[name] = dest
                continue
            total = int((a[:, 2] - a[:, 1]).sum())
            buf = torch.empty(total, dtype=torch.uint8)
            if gather is not None:
                gather.copy_into(buf)
            else:
                pos = 0
                for k, b, e in a.tolist():
                    if e > b:
                        self.storage.read_into(at.paths[k], b, byte_view(buf[pos : pos + e - b]))
                    pos += e - b
            out[name] = self._tensor(name, buf, 0, total, checks)
        if checks:
            from resumable.snapshot import copy_threads

            # Where every byte to check is in memory, the checks share the cores; where
            # some must come from the disk, one thread checks in the file's order, as
            # the read-ahead goes (threads faulting in pages at other places made a
            # cold restore slower: docs/decisions.md)
            warm = all(_resident(address, n) for address, n in regions)
            got = _digests([(n, fn) for _, n, fn in checks], copy_threads() if warm else 1)
            for (name, _, _), digest in zip(checks, got, strict=True):
                self._check_sum(name, digest)
        self._fills.extend(fills)  # only once every tensor passed
        self._owned.update(id(dest) for dest, _ in fills)
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

    @property
    def owned(self) -> frozenset[int]:
        """The ids of the live tensors `tensors` returned to be written by `fill`."""
        return frozenset(self._owned)

    def fill(self) -> None:
        """Copy the chunks of the tensors `tensors` returned unassembled (``into``)
        into them, and the bytes of those it returned unchecked (``fuse``), checking
        those as they are copied; once. A mismatch raises `CorruptCheckpointError`
        once every copy ended (`fused_started` then says live tensors were written).
        Where every byte is in memory the copies share the copy threads; where some
        must still come from the disk, one thread copies in the file's order, right
        behind the read-ahead (as `tensors` checks)."""
        fused, self._fused = self._fused, []
        if fused:
            from resumable.snapshot import copy_threads

            self.fused_started = True
            warm = all(_resident(src.data_ptr(), src.numel()) for _, src, _, _ in fused)
            jobs: list[tuple[int, Callable[[], str]]] = [
                (src.numel(), functools.partial(_copy_job, src, flat)) for _, src, _, flat in fused
            ]
            got = _digests(jobs, copy_threads() if warm else 1)
            for (name, *_), digest in zip(fused, got, strict=True):
                self._check_sum(name, digest)
        fills, self._fills = self._fills, []
        for dest, gather in fills:
            gather.copy_into(dest.detach().view(-1).view(torch.uint8))

    def _check_sum(self, name: str, got: str) -> None:
        want = self.manifest["tensors"][name][CHECKSUM]
        if got != want:
            raise CorruptCheckpointError(
                f"{self.where}: checksum mismatch in tensor {name!r} "
                f"(expected {want}, found {got}); the file is damaged"
            )

    def _mapped(self, path: str, spans: list[tuple[int, int]], end: int) -> torch.Tensor | None:
        """All of a data file's bytes, mapped copy-on-write, the ``spans`` read ahead;
        None where the backend does not map (or the file is shorter than ``end``)."""
        mm = self.storage.map_file(path, spans) if end > 0 else None
        if mm is None:
            return None
        if end > len(mm):
            mm.close()
            return None
        self.mapped = True
        return torch.frombuffer(mm, dtype=torch.uint8, count=len(mm))

    def _read(self, path: str, offset: int, length: int) -> torch.Tensor:
        """Bytes ``[offset, offset + length)`` of a data file: a view of the file mapped
        copy-on-write where the backend can map (no allocation, no copy), else a read
        into a new buffer. Sizes were checked against the manifest before."""
        mm = self.storage.map_file(path, (offset, offset + length)) if length > 0 else None
        if mm is not None:
            if offset + length <= len(mm):
                self.mapped = True
                return torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=length)
            mm.close()
        buf = torch.empty(length, dtype=torch.uint8)
        if length:
            self.storage.read_into(path, offset, byte_view(buf))
        return buf

    def _tensor(
        self,
        name: str,
        buf: torch.Tensor,
        b: int,
        e: int,
        checks: list[tuple[str, int, Callable[[], str]]] | None,
    ) -> torch.Tensor:
        """Tensor ``name`` from bytes ``[b, e)`` of ``buf``; its check added to
        ``checks`` (None: not checked)."""
        info = self.manifest["tensors"][name]
        raw = buf[b:e]
        if checks is not None:
            view = byte_view(raw) if e > b else b""
            checks.append((name, e - b, lambda: checksum(view)))
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

        self.widen()
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


class _Extents(NamedTuple):
    """`CheckpointReader._extents`: the tensors with pieces, the files their pieces lie
    in (step or None for this checkpoint; file), and one row per piece, grouped by
    tensor and in order: (tensor index, file key, begin, end); tensor i's rows are
    ``rows[starts[i]:starts[i + 1]]``."""

    names: list[str]
    keys: list[tuple[int | None, str]]
    rows: np.ndarray
    starts: np.ndarray


class _FilePlan(NamedTuple):
    """`CheckpointReader._file_plan`: per own file, the header entries it must hold
    (name, dtype, shape, file offsets) and its changed chunks' (begin, end) rows; per
    earlier checkpoint's file, the lowest begin and highest end read there; every file
    key; each pieced tensor's index in `_Extents.names`."""

    expect: dict[str, list[tuple[str, str, list[int], list[int]]]]
    chunks: dict[str, np.ndarray]
    bounds: dict[tuple[int, str], tuple[int, int]]
    keys: set[tuple[int | None, str]]
    position: dict[str, int]


class _Locations(NamedTuple):
    """`CheckpointReader._locations`: a path per file key, the merged pieces as (key,
    begin, end) rows, and each tensor's rows among them, as [lo, hi)."""

    paths: list[str]
    merged: np.ndarray
    where: dict[str, tuple[int, int]]


_libc: Any = None


def _resident(address: int, length: int) -> bool:
    """Whether every page of ``[address, address + length)`` is in memory (``mincore``);
    False where that cannot be told (not Linux, an error)."""
    global _libc
    if length <= 0:
        return True
    try:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.mincore.restype = ctypes.c_int
            _libc = libc
        page = mmap.PAGESIZE
        start = address - address % page
        pages = -(-(address + length - start) // page)
        vec = np.empty(pages, dtype=np.uint8)
        if _libc.mincore(start, pages * page, vec.ctypes.data) != 0:
            return False
        return bool((vec & 1).all())
    except (OSError, AttributeError):
        return False


def _copy_job(src: torch.Tensor, dst: torch.Tensor) -> str:
    """Copy flat bytes ``src`` into ``dst`` (as many), returning their XXH3-64."""
    if dst.numel() != src.numel():
        raise CorruptCheckpointError(
            f"a tensor of {src.numel()} bytes cannot fill a live one of {dst.numel()}"
        )
    data = byte_view(src) if src.numel() else memoryview(b"")
    return copy_checksum(src.data_ptr(), data, dst.data_ptr() if src.numel() else 0)


def _digests(jobs: list[tuple[int, Callable[[], str]]], threads: int) -> list[str]:
    """What each job computes (``(bytes, fn)``: a checksum), in the jobs' order. From
    `_DIGESTS_SPLIT_MIN` bytes in all, ``threads`` threads, the calling one included,
    take the jobs in order (a file's order: pages are met as they were read ahead),
    each the next one not taken (the hash releases the GIL on large inputs): a
    restore's check of many tensors no longer runs on one core while the others wait.
    A job's error is raised once every thread stopped."""
    threads = max(1, min(threads, len(jobs)))
    if threads < 2 or sum(n for n, _ in jobs) < _DIGESTS_SPLIT_MIN:
        return [fn() for _, fn in jobs]
    out = [""] * len(jobs)
    order = iter(range(len(jobs)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not errors:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                out[i] = jobs[i][1]()
        except BaseException as exc:  # handed to the calling thread
            errors.append(exc)

    others = [threading.Thread(target=run, daemon=True) for _ in range(threads - 1)]
    for t in others:
        t.start()
    run()
    for t in others:
        t.join()
    if errors:
        raise errors[0]
    return out


_DIGESTS_SPLIT_MIN = 8 << 20  # bytes to check from which `_digests` uses several threads
_SHORT = 96  # integers in an extents list below which `_extents` makes its rows in Python


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
