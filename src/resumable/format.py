"""The on-storage format: safetensors data files and one JSON manifest per checkpoint.

A checkpoint is a directory (or key prefix) holding one or more valid safetensors files
and ``manifest.json``. The manifest carries the state tree, a tensor index (file, dtype,
shape, byte range and xxh3-64 checksum of each tensor's bytes), the files with their
sizes, step, wall time, metrics, versions and world size, and a digest over its own
canonical JSON. The full specification is ``docs/format.md``.

Trade-off: we write the safetensors container ourselves (8-byte header length, JSON
header padded to 8 bytes, packed little-endian data) instead of calling
``safetensors.torch.save_file``, because that function serialises the whole state into
one more in-memory copy; writing header and tensor bytes straight from the snapshot
arena keeps a persist at one pass over memory. Tensors whose bytes are a multiple of
`LINE_BYTES` come first, then the others, each kind by element size, largest first:
every tensor starts at an offset aligned to its element size and can be viewed in
place, and those of the first kind (nearly every large one) start on a cache line.
Files stay readable by ``safetensors.safe_open`` (tested).

Reading is defensive: every name, size, offset and checksum in a manifest is validated
against the files before a byte is used, and nothing in a checkpoint can name code.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import itertools
import json
import math
import re
import socket
import sys
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from resumable._dtypes import ARRAY_LIMIT, ITEMSIZE, MAX_NDIM, dtype_name, numel, shape_ok
from resumable._lazy import numpy_module
from resumable._version import __version__
from resumable.errors import CorruptCheckpointError, NewerFormatError, UnsupportedStateError
from resumable.pieces import check_pieces, global_tensors
from resumable.tree import check_tree, has_repeats

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = numpy_module()  # loaded at its first use: a persist worker may need none

FORMAT_NAME = "resumable-checkpoint"
FORMAT_VERSION = 7  # the highest this reads; one process writes 1, or 3 if it refers,
# or 5 where a tree references one stored tensor from several places (a tied weight);
# several ranks write 7 (the split manifest, `resumable.parts`, its parts compressed),
# which reads 4 (parts as JSON), 5 (4 with ties) and 6 (5 in one object per node,
# `resumable.nodes`) as before
SPLIT_VERSION = 4
ALIAS_VERSION = 5  # trees may reference a stored tensor more than once; split or not
SEGMENT_VERSION = 6  # a split manifest whose files and parts lie in shared objects
GZIP_PARTS_VERSION = 7  # a split manifest whose parts are gzip'd JSON; objects optional
CHUNK_HASH = "xxh3_128"  # version 2's per-chunk hash (read, no longer written)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
MAX_SAFETENSORS_HEADER = 100 << 20
MAX_JSON_DEPTH = 256  # arrays and objects; a tree of MAX_TREE_DEPTH needs at most 197
CHECKSUM = "xxh3_64"

_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9._-]{0,199}$")


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor as a flat memoryview, without a copy."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"1.5 KiB"`` ... ``"3.2 TiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(n)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def checksum(data: Any) -> str:
    """xxh3-64 of a buffer, as 16 hex digits (releases the GIL on large buffers)."""
    return xxhash.xxh3_64_hexdigest(data)


CHECKED_BLOCK = 512 << 10  # `copy_checksum` copies, then hashes, this many bytes at a time


def copy_checksum(src: int, data: memoryview, dst: int) -> str:
    """The XXH3-64 of ``data`` (the bytes at address ``src``), as `checksum` gives it,
    those bytes copied on the way to address ``dst`` (0: hashed only). A block of
    `CHECKED_BLOCK` bytes at a time is copied, then hashed while it is still in the
    cache, so the source is read from memory once, not once to hash it and again to
    copy it (`docs/decisions.md`). Both calls let go of the GIL."""
    n = data.nbytes
    if n <= CHECKED_BLOCK:
        if dst and n:
            ctypes.memmove(dst, src, n)
        return checksum(data)
    h = xxhash.xxh3_64()
    for o in range(0, n, CHECKED_BLOCK):
        m = min(CHECKED_BLOCK, n - o)
        if dst:
            ctypes.memmove(dst + o, src + o, m)
        h.update(data[o : o + m])
    return h.hexdigest()


def check_relpath(path: Any) -> str:
    """Validate a relative path found in a manifest or given to storage.

    Only ``/``-separated components of letters, digits, ``_``, ``-`` and ``.`` are
    allowed; no empty, ``.`` or ``..`` component, no absolute path, no backslash.
    Raises `CorruptCheckpointError` for anything else: such a name never reaches a
    filesystem call.
    """
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise CorruptCheckpointError(f"invalid path {str(path)[:100]!r} in checkpoint")
    for part in path.split("/"):
        if part in (".", "..") or not _SAFE_COMPONENT.fullmatch(part):
            raise CorruptCheckpointError(
                f"refusing path {path[:200]!r}: only relative names of letters, digits, "
                "'_', '-' and '.' are allowed inside a checkpoint"
            )
    return path


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes live in a data file's data region; ``dtype`` is its
    safetensors name (``"F32"``; `resumable._dtypes.dtype_from_name` gives torch's)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


LINE_BYTES = 64
"""A cache line: the alignment `plan_layout` gives every tensor whose bytes are a
multiple of it."""


def plan_layout(
    tensors: Mapping[str, torch.Tensor], last: Collection[str] = ()
) -> list[TensorSlot]:
    """Pack tensors back to back: first those whose bytes are a multiple of
    `LINE_BYTES`, then the others; each kind by element size, largest first, in the
    state's order within that. Every slot is then aligned to its element size, and every
    one of the first kind to a cache line (the buffer and the file's data start on a
    page). The same layout serves the snapshot arena and the file.

    The tensors named in ``last`` (a rank's replicated tensors that another rank writes:
    `resumable.pieces.owned_tensors`) go after all the others, laid out alike from the
    next cache line on: what the rank writes is then the first bytes of its snapshot,
    which its persist worker writes from shared memory without copying them out.

    The first kind is nearly every large tensor; the second, scalars and odd sizes.
    Packed in the state's order instead, an optimizer's 4-byte ``step`` before each
    parameter's moments put every later moment off the line by a multiple of 4 bytes,
    and a copy into a destination misaligned with its source took 1.19x as long
    (``docs/decisions.md``, "Tensors laid out on cache lines")."""
    order = sorted(
        tensors.items(),
        key=lambda kv: (
            kv[0] in last,
            kv[1].numel() * kv[1].element_size() % LINE_BYTES != 0,
            -kv[1].element_size(),
        ),
    )
    slots, offset = [], 0
    tail = False
    for name, t in order:
        if not tail and name in last:
            tail = True
            offset += -offset % LINE_BYTES
        n = t.numel() * t.element_size()
        slots.append(TensorSlot(name, dtype_name(t.dtype), tuple(t.shape), offset, offset + n))
        offset += n
    return slots


def safetensors_header(
    slots: Iterable[TensorSlot], metadata: Mapping[str, str], *, align: int = 8
) -> bytes:
    """The 8-byte length prefix plus the JSON header, padded with spaces (as the
    safetensors format allows) to a multiple of ``align`` bytes, 8 at least: the data
    then starts at that alignment in the file (a page, for a file written with
    ``O_DIRECT`` straight from page-aligned memory: `resumable.storage.direct`)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for s in slots:
        header[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.end],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    assert align % 8 == 0, align
    body += b" " * (-(8 + len(body)) % align)
    return len(body).to_bytes(8, "little") + body


def parse_safetensors_header(prefix: bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    """Parse and validate a safetensors header from the first bytes of a file; returns
    (data_start, header). ``prefix`` must hold at least ``8 + header length`` bytes.

    The header must make a valid safetensors file, as the ``safetensors`` library
    checks it: every entry has a known dtype, a shape and ``data_offsets`` whose length
    is the shape's byte size, and the entries, sorted, cover the data region exactly:
    no gap, no overlap, nothing after the last one. O(n log n) in the entries.
    """
    if len(prefix) < 8:
        raise CorruptCheckpointError("data file shorter than a safetensors header")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_SAFETENSORS_HEADER or 8 + n > file_size or len(prefix) < 8 + n:
        raise CorruptCheckpointError(f"safetensors header length {n} is out of bounds")
    try:
        # Decoded as UTF-8 here: json.loads would take bytes in UTF-16 or -32 as well.
        # The collector paused, as for a manifest (`decode_manifest`): a header with
        # thousands of entries set off full collections that took 0.1 s.
        with no_gc():
            header = json.loads(bytes(prefix[8 : 8 + n]).decode("utf-8"))
    except RecursionError:
        raise CorruptCheckpointError("safetensors header is nested too deeply") from None
    except ValueError as exc:
        raise CorruptCheckpointError(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError("safetensors header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError("safetensors __metadata__ is not an object of strings")
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        # A one-dimensional entry, as every chunk entry of a version 3 file is (a file
        # may have thousands): the checks below in one expression.
        if type(entry) is dict:
            dtype, shape, offsets = (
                entry.get("dtype"),
                entry.get("shape"),
                entry.get("data_offsets"),
            )
            if (
                type(shape) is list
                and len(shape) == 1
                and type(offsets) is list
                and len(offsets) == 2
                and type(dtype) is str
                and dtype in ITEMSIZE
            ):
                (n0,), (begin, end) = shape, offsets
                if (
                    type(n0) is int
                    and type(begin) is int
                    and type(end) is int
                    and 0 <= n0 < ARRAY_LIMIT // ITEMSIZE[dtype]
                    and 0 <= begin <= end
                    and end - begin == n0 * ITEMSIZE[dtype]
                ):
                    ranges.append((begin, end))
                    continue
        dtype = entry.get("dtype") if type(entry) is dict else None
        if type(dtype) is not str or dtype not in ITEMSIZE:
            raise CorruptCheckpointError(f"{_entry(name)} is not an object with a known dtype")
        offsets = entry.get("data_offsets")
        shape = entry.get("shape")
        if not shape_ok(shape, ITEMSIZE[dtype]) or not int_pair(offsets):
            raise CorruptCheckpointError(f"{_entry(name)} has a malformed shape or data_offsets")
        begin, end = offsets
        if end - begin != numel(shape) * ITEMSIZE[dtype]:
            raise CorruptCheckpointError(
                f"{_entry(name)}: data_offsets {offsets} do not hold shape {shape} of {dtype}"
            )
        ranges.append((begin, end))
    ranges.sort()
    at = 0
    for begin, end in ranges:
        if begin != at:
            raise CorruptCheckpointError(
                f"safetensors data_offsets {'overlap' if begin < at else 'leave a gap'} at "
                f"data byte {min(begin, at)}; a valid file holds every byte exactly once"
            )
        at = end
    if at != file_size - 8 - n:
        raise CorruptCheckpointError(
            f"safetensors header describes {at} data bytes, the file holds {file_size - 8 - n}"
        )
    return 8 + n, header


def _entry(name: str) -> str:
    return f"safetensors header entry {name[:100]!r}"


# --------------------------------------------------------------------------- manifest


_TOLD_VERSIONS: dict[str, str] = {}
"""Versions of torch and NumPy a persist worker was told by its trainer (`tell_versions`)."""


def versions() -> dict[str, str]:
    """The versions a manifest records: each library's loaded module's; in a persist
    worker, which loads neither torch nor NumPy to write, those its trainer had loaded
    (`tell_versions`), else the installed distribution's."""
    return {
        "resumable": __version__,
        "torch": _library_version("torch"),
        "numpy": _library_version("numpy"),
        "python": sys.version.split()[0],  # what platform.python_version() reads
    }


def loaded_versions() -> dict[str, str]:
    """The versions of torch and NumPy loaded in this process (a trainer's), for its
    persist worker (`tell_versions`)."""
    out = {}
    for name in ("torch", "numpy"):
        version = getattr(sys.modules.get(name), "__version__", None)
        if version is not None:
            out[name] = str(version)
    return out


def tell_versions(told: Mapping[str, str]) -> None:
    """Record the versions of torch and NumPy the trainer loaded (`loaded_versions`), in
    its persist worker, for the manifests it writes."""
    _TOLD_VERSIONS.update({k: str(v) for k, v in told.items() if k in ("torch", "numpy")})


def _library_version(name: str) -> str:
    # getattr: a module another thread is still importing has no __version__ yet
    version = getattr(sys.modules.get(name), "__version__", None)
    if version is not None:
        return str(version)
    return _TOLD_VERSIONS.get(name) or _installed_version(name)


@functools.cache
def _installed_version(name: str) -> str:
    import importlib.metadata  # slow to import: only where no trainer told the version

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def build_manifest(
    *,
    step: int,
    metrics: Mapping[str, Any] | None,
    trees: list[Any],
    files: Mapping[str, Mapping[str, Any]],
    tensors: Mapping[str, Mapping[str, Any]],
    world_size: int = 1,
) -> dict[str, Any]:
    refs = sorted({s for t in tensors.values() for s, *_ in tensor_ranges(t) if s is not None})
    chunked = any("chunks" in t or "extents" in t for t in tensors.values())
    version = 1
    if chunked:
        version = 3 if any("extents" in t for t in tensors.values()) else 2
    if any(map(has_repeats, trees)):  # a tied weight, stored once
        if version == 2:
            raise ValueError("chunks (format version 2) are read, no longer written")
        version, chunked = ALIAS_VERSION, True  # refs are recorded from version 2 on
    m: dict[str, Any] = {
        **manifest_header(step=step, version=version, metrics=metrics, world_size=world_size),
        "ranks": [{"rank": i, "tree": t} for i, t in enumerate(trees)],
        "files": {k: dict(v) for k, v in files.items()},
        "tensors": {k: dict(v) for k, v in tensors.items()},
    }
    if chunked:
        m["refs"] = refs
    m["digest"] = manifest_digest(m)
    return m


def manifest_header(
    *, step: int, version: int, metrics: Mapping[str, Any] | None, world_size: int
) -> dict[str, Any]:
    """The fields every manifest starts with, a split one's top too: format, version,
    step, time, metrics, versions, host and world size."""
    return {
        "format": FORMAT_NAME,
        "format_version": version,
        "step": int(step),
        "created": time.time(),
        "metrics": json_metrics(metrics or {}),
        "versions": versions(),
        "hostname": socket.gethostname(),
        "world_size": int(world_size),
    }


def json_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        # a tensor means torch is loaded already (or being loaded, by another thread)
        tensor = getattr(sys.modules.get("torch"), "Tensor", None)
        if tensor is not None and isinstance(v, tensor) and v.numel() == 1:
            v = v.item()
        # a NumPy scalar means NumPy is loaded (or being loaded, by another thread)
        generic = getattr(sys.modules.get("numpy"), "generic", None)
        if generic is not None and isinstance(v, generic):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float, str)) or v is None:
            raise UnsupportedStateError(
                f"metric {k!r} must be a number or string, found {type(v).__name__}"
            )
        if isinstance(v, float) and not math.isfinite(v):
            v = repr(v)
        out[str(k)] = v
    return out


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    """One-space indentation, except where tensors have extents (version 3): those
    lists can hold hundreds of thousands of integers, which Python's JSON encoder
    writes one per line, in Python, when indenting; without indentation it writes them
    in C, tens of times faster. Such a manifest is written in the digest's own form
    (keys sorted, no whitespace; `manifest_digest`) with the digest among its keys, so
    that a reader checks the digest on the bytes read (`_digest_ok`) instead of
    encoding the manifest again: for a manifest of 60,000 extent integers, 0.1 ms
    instead of several."""
    if any("extents" in t for t in manifest.get("tensors", {}).values()):
        return json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return json.dumps(manifest, indent=1, allow_nan=False).encode()


def _digest_ok(data: bytes, m: Mapping[str, Any]) -> bool:
    """Whether ``m``, parsed from ``data``, carries its own `manifest_digest`. Where
    ``data`` holds the top-level digest member once, the bytes without it are hashed
    first: if the manifest was written in the digest's form (`encode_manifest`), they
    are the very bytes the digest was computed over, and a match is as good as the
    full check (an accidental XXH3-64 collision aside, which the full check shares).
    Anything else, a match or not, gets the full check: parse, encode, hash."""
    digest = m.get("digest")
    if type(digest) is not str:
        return False
    member = b'"digest":' + json.dumps(digest).encode()
    at = data.find(member)
    if at > 0 and data.find(member, at + 1) < 0:
        end = at + len(member)
        body = None
        if data[at - 1 : at] == b",":
            body = data[: at - 1] + data[end:]
        elif data[at - 1 : at] == b"{" and data[end : end + 1] == b",":
            body = data[:at] + data[end + 1 :]
        if body is not None and checksum(body) == digest:
            return True
    return digest == manifest_digest(m)


def _reject_constant(name: str) -> Any:
    raise CorruptCheckpointError(f"manifest contains non-standard JSON constant {name}")


def decode_manifest(
    data: bytes,
    *,
    where: str,
    files_only: bool = False,
    arrays: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """See `_decode_manifest`; the cyclic garbage collector is paused meanwhile. A JSON
    document makes no reference cycles, and a manifest with thousands of chunk entries
    allocates enough containers to set off full collections, which cost more than the
    parsing (a restore of five 64 KiB-chunked manifests spent 0.15 s of 0.57 in them).

    ``arrays``: filled with the long extents lists the validation made into NumPy
    arrays, ``(n, 3)`` rows of (source, begin, end) by tensor name, so that a reader
    does not make them again (a list of 60,000 integers takes milliseconds)."""
    with no_gc():
        return _decode_manifest(data, where=where, files_only=files_only, arrays=arrays)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused while JSON is parsed (`decode_manifest`)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _decode_manifest(
    data: bytes, *, where: str, files_only: bool, arrays: dict[str, np.ndarray] | None = None
) -> dict[str, Any]:
    """Parse and validate a whole manifest; the one validation every reader runs.

    Checks, in time and memory linear in the manifest (O(n log n) for sorting), and
    before anything is allocated for a tensor: JSON nesting, format, version and
    digest; the type of every field; each tensor entry's dtype, shape and byte range
    against the declared file sizes, with no two ranges of a file overlapping (so the
    tensors hold at most the files' bytes); the pieces of every global tensor tiling it
    exactly; every rank's state tree (`check_tree`). Data files are not read here:
    `reader.CheckpointReader.check_files` checks them against what this accepted.
    Raises `CorruptCheckpointError` naming ``where`` (`NewerFormatError` for a newer,
    intact version); never anything else.

    ``files_only``: stop after the JSON, format, version, digest, step and the file
    entries. That is what a reader uses of an earlier checkpoint whose data files a
    newer one refers to (which file, of what size); the bytes it reads there are checked
    by the newer one's own entries and checksums, and the earlier checkpoint's tensors
    and trees are checked in full when it is itself read.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: manifest of {len(data)} bytes is too large")
    try:
        # Decoded as UTF-8 here: json.loads would take bytes in UTF-16 or -32 as well.
        m = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    except RecursionError:
        raise CorruptCheckpointError(
            f"{where}: manifest is nested too deeply to parse (at most {MAX_JSON_DEPTH} "
            "levels are allowed)"
        ) from None
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a resumable manifest")
    if not _depth_within(m, MAX_JSON_DEPTH):
        raise CorruptCheckpointError(
            f"{where}: manifest is nested more than {MAX_JSON_DEPTH} levels deep"
        )
    version = m.get("format_version")
    digest_ok = _digest_ok(bytes(data), m)
    if type(version) is int and version > FORMAT_VERSION and digest_ok:
        raise NewerFormatError(
            f"{where}: format version {version} is newer than this resumable reads "
            f"(1..{FORMAT_VERSION}); upgrade resumable to read it (restoring an older "
            "checkpoint instead would silently lose progress)"
        )
    if not digest_ok:
        raise CorruptCheckpointError(f"{where}: manifest digest mismatch (edited or corrupt)")
    if type(version) is not int or version < 1 or version > FORMAT_VERSION:
        raise CorruptCheckpointError(f"{where}: format version {version!r} is not valid")
    _check_type(m, "step", int, where)
    _check_type(m, "files", dict, where)
    _check_type(m, "metrics", dict, where)
    for key, value in m["metrics"].items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CorruptCheckpointError(
                f"{where}: metric {key[:100]!r} is {str(value)[:100]}, not a number or string"
            )
    world: Any = m.get("world_size")
    if not _nonneg_int(world) or world < 1:
        raise CorruptCheckpointError(
            f"{where}: world_size must be an integer >= 1, found {str(world)[:100]!r}"
        )
    for fname, info in m["files"].items():
        check_relpath(fname)
        if not isinstance(info, dict) or not _nonneg_int(info.get("size")):
            raise CorruptCheckpointError(f"{where}: bad entry for file {fname!r}")
    if is_split(m):
        # the top manifest of a split one: its parts are checked as they are read
        if "tensors" in m or "ranks" in m:
            raise CorruptCheckpointError(
                f"{where}: a split manifest lists its parts, not tensors or ranks"
            )
        _check_refs(m, version, where)
        if has_segments(m):
            check_segments(m, where)
        return m
    if version >= SEGMENT_VERSION:
        raise CorruptCheckpointError(f"{where}: a manifest of version {version} lists parts")
    if files_only:
        return m
    check_body(m, version, where, arrays)
    return m


def has_segments(m: Mapping[str, Any]) -> bool:
    """Whether a split top manifest (its version checked) lays its files and parts out in
    shared objects: every one of version 6; one of version 7 that has ``objects`` or
    ``segments`` (`check_segments` then requires both)."""
    version = m["format_version"]
    return version == SEGMENT_VERSION or (
        version >= GZIP_PARTS_VERSION and ("objects" in m or "segments" in m)
    )


def check_segments(m: Mapping[str, Any], where: str) -> None:
    """The ``objects`` and ``segments`` of a version 6 (or 7) top manifest: every data file and
    every part lies in exactly one listed object (``segments``: name -> ``{object,
    offset}``, its size the one the file or part declares), inside it, and no two
    segments of one object overlap; object names are safe and name no file or part.
    Raises `CorruptCheckpointError`. (``parts`` are checked by `resumable.parts`.)"""
    objects, segments = m.get("objects"), m.get("segments")
    if not isinstance(objects, dict) or not isinstance(segments, dict):
        raise CorruptCheckpointError(
            f"{where}: a manifest of version {m['format_version']} lists its objects and segments"
        )
    parts = m.get("parts")
    sizes: dict[str, Any] = {f: info["size"] for f, info in m["files"].items()}
    if isinstance(parts, list):
        for p in parts:
            if isinstance(p, dict) and isinstance(p.get("file"), str):
                sizes[p["file"]] = p.get("size")
    for name, info in objects.items():
        check_relpath(name)
        if name in sizes or not isinstance(info, dict) or not _nonneg_int(info.get("size")):
            raise CorruptCheckpointError(f"{where}: bad entry for object {str(name)[:100]!r}")
    if set(segments) != set(sizes):
        missing = sorted(set(sizes) - set(segments))[:3]
        extra = sorted(set(segments) - set(sizes))[:3]
        raise CorruptCheckpointError(
            f"{where}: every data file and part lies in one segment; without one: "
            f"{missing}, not a file or part: {extra}"
        )
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, seg in segments.items():
        obj: Any = seg.get("object") if isinstance(seg, dict) else None
        offset: Any = seg.get("offset") if isinstance(seg, dict) else None
        size: Any = sizes[name]
        if (
            not isinstance(obj, str)
            or obj not in objects
            or not _nonneg_int(offset)
            or not _nonneg_int(size)
        ):
            raise CorruptCheckpointError(
                f"{where}: segment of {name[:100]!r} must be {{object listed, offset >= 0}}, "
                f"found {str(seg)[:200]}"
            )
        if offset + size > objects[obj]["size"]:
            raise CorruptCheckpointError(
                f"{where}: segment of {name[:100]!r} ends at {offset + size}, past the "
                f"{objects[obj]['size']} bytes of {obj!r}"
            )
        spans.setdefault(obj, []).append((offset, offset + size))
    for obj, got in spans.items():
        got.sort()
        for (_, end), (begin, _) in itertools.pairwise(got):
            if begin < end:
                raise CorruptCheckpointError(f"{where}: two segments of {obj!r} overlap")


def is_split(m: Mapping[str, Any]) -> bool:
    """Whether a manifest (its version checked) is the top of a split one (`resumable.parts`):
    every one of version 4; one of version 5 that lists ``parts``."""
    version = m["format_version"]
    return version == SPLIT_VERSION or (version >= ALIAS_VERSION and "parts" in m)


def check_body(
    m: dict[str, Any],
    version: int,
    where: str,
    arrays: dict[str, np.ndarray] | None = None,
    *,
    complete: bool = True,
) -> None:
    """The tensor index and the state trees of a manifest whose header passed
    (`decode_manifest`), or of the parts of a version 4 one merged (`resumable.parts`):
    each entry against the declared file sizes, no byte of a file in two entries, the
    pieces of each global tensor tiling it, every rank's tree. ``complete=False``: the
    parts of some ranks only (a restore at the same world size); the pieces found must
    lie inside their tensor without overlap, and only the trees present are checked."""
    _check_type(m, "ranks", list, where)
    _check_type(m, "tensors", dict, where)
    if len(m["ranks"]) != m["world_size"]:
        raise CorruptCheckpointError(
            f"{where}: manifest lists {len(m['ranks'])} rank(s) for world_size {m['world_size']}"
        )
    for i, r in enumerate(m["ranks"]):
        if not isinstance(r, dict) or "tree" not in r or r.get("rank", i) != i:
            raise CorruptCheckpointError(f"{where}: malformed entry for rank {i}")
    refs = _check_refs(m, version, where)
    made: dict[str, np.ndarray] = {} if arrays is None else arrays
    for name, info in m["tensors"].items():
        a = _check_tensor_entry(name, info, m["files"], where, refs, version)
        if a is not None:
            made[name] = a
    _check_disjoint(m["tensors"], where, made)
    fqns = global_tensors(m["tensors"])
    for fqn, spec in fqns.items():
        check_pieces(fqn, spec, m["tensors"], where, complete=complete)
    for i, r in enumerate(m["ranks"]):
        if complete or r["tree"] is not None:
            check_tree(
                r["tree"],
                m["tensors"],
                fqns,
                f"{where}: rank {i}'s state tree",
                repeats=version >= ALIAS_VERSION,
            )


def _check_refs(m: Mapping[str, Any], version: int, where: str) -> set[int] | None:
    """Versions 2 and 3's ``refs``: the earlier steps whose data files the chunks refer to,
    strictly increasing and each before the manifest's own step (so references never
    form a cycle). None for version 1, which has none."""
    if version == 1:
        if "refs" in m:
            raise CorruptCheckpointError(f"{where}: refs are a format version 2 and 3 feature")
        return None
    refs = m.get("refs")
    if (
        not isinstance(refs, list)
        or not all(_nonneg_int(k) and k < m["step"] for k in refs)
        or any(a >= b for a, b in itertools.pairwise(refs))
    ):
        raise CorruptCheckpointError(
            f"{where}: refs must be increasing steps before step {m['step']}, found "
            f"{str(refs)[:100]}"
        )
    return set(refs)


def _depth_within(doc: Any, limit: int) -> bool:
    """Whether JSON value ``doc`` nests at most ``limit`` arrays and objects (iterative)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return False
        children = value.values() if type(value) is dict else value
        if type(value) is list and _SCALARS.issuperset(map(type, value)):
            continue  # a list of numbers (extents): the types gathered in C, not one by one
        for child in children:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return True


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _nonneg_int(x: Any) -> bool:
    return type(x) is int and x >= 0  # a bool is an int, but not of type int


def _check_type(m: Mapping[str, Any], key: str, typ: type, where: str) -> None:
    if not isinstance(m.get(key), typ) or isinstance(m.get(key), bool):
        raise CorruptCheckpointError(
            f"{where}: manifest field {key!r} missing or not {typ.__name__}"
        )


def _check_tensor_entry(
    name: str,
    info: Any,
    files: Mapping[str, Any],
    where: str,
    refs: set[int] | None,
    version: int = FORMAT_VERSION,
) -> np.ndarray | None:
    """One entry of the tensor index: a whole tensor in one of this checkpoint's files
    (``file``, ``offsets``), or, where the manifest refers (``refs`` not None), its
    bytes in pieces of this checkpoint's files or of the earlier checkpoints it refers
    to: version 2's list of ``chunks``, version 3's ``sources`` and ``extents``.
    Returns a long extents list as the NumPy array its check made (`_check_extents`)."""
    bad = f"{where}: bad tensor index entry {name[:100]!r}"
    if not isinstance(info, dict):
        raise CorruptCheckpointError(bad)
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CorruptCheckpointError(f"{bad}: unknown dtype {str(dtype)[:100]!r}")
    shape: Any = info.get("shape")
    if not shape_ok(shape, ITEMSIZE[dtype]):
        raise CorruptCheckpointError(
            f"{bad}: shape {str(shape)[:100]} is not a list of at most {MAX_NDIM} "
            "non-negative integers whose non-zero product times the element size is "
            "below 2**63"
        )
    if not isinstance(info.get(CHECKSUM), str):
        raise CorruptCheckpointError(f"{bad}: no {CHECKSUM} checksum")
    nbytes = numel(shape) * ITEMSIZE[dtype]
    a: np.ndarray | None = None
    if "chunks" in info:
        if refs is None or version != 2:
            raise CorruptCheckpointError(f"{bad}: chunks are a format version 2 feature")
        _check_chunks(info["chunks"], nbytes, files, refs, bad)
    elif "extents" in info or "sources" in info:
        if refs is None or version < 3:
            raise CorruptCheckpointError(f"{bad}: extents are a format version 3 feature")
        a = _check_extents(info.get("sources"), info.get("extents"), nbytes, files, refs, bad)
    else:
        f = info.get("file")
        if not isinstance(f, str) or f not in files:
            raise CorruptCheckpointError(f"{bad}: file {str(f)[:100]!r} is not listed")
        offsets: Any = info.get("offsets")
        if not int_pair(offsets):
            raise CorruptCheckpointError(bad)
        begin, end = offsets
        if end < begin or end - begin != nbytes or end > files[f]["size"]:
            raise CorruptCheckpointError(
                f"{bad}: byte range [{begin}, {end}) does not match shape {shape} of "
                f"{dtype} or exceeds the file's {files[f]['size']} bytes"
            )
    if "fqn" not in info and "global_shape" not in info and "global_offset" not in info:
        return a  # a whole tensor: its own global tensor
    fqn = info.get("fqn", name)
    gshape = info.get("global_shape", shape)
    goffset = info.get("global_offset", [0] * len(shape))
    if (
        not isinstance(fqn, str)
        or not shape_ok(gshape, ITEMSIZE[dtype])
        or len(gshape) != len(shape)
        or not isinstance(goffset, list)
        or len(goffset) != len(shape)
        or not all(_nonneg_int(o) and o < ARRAY_LIMIT for o in goffset)
    ):
        raise CorruptCheckpointError(
            f"{bad}: piece fields must be a string fqn, a global_shape like its shape "
            f"and a global_offset of {len(shape)} non-negative integers; found fqn "
            f"{str(fqn)[:100]!r}, global_shape {str(gshape)[:100]}, global_offset "
            f"{str(goffset)[:100]}"
        )
    return a


_CHUNK_KEYS = {"file", "offsets", CHUNK_HASH, "step"}
_HASH128 = re.compile(r"^[0-9a-f]{32}$")


def _check_chunks(
    chunks: Any, nbytes: int, files: Mapping[str, Any], refs: set[int], bad: str
) -> None:
    """The chunks of a version 2 entry: each a byte range of one of this checkpoint's
    files (within its declared size) or of a data file, named by its basename, of a
    step in ``refs``; in order they hold exactly the tensor's bytes."""
    if not isinstance(chunks, list) or not chunks:
        raise CorruptCheckpointError(f"{bad}: chunks must be a non-empty list")
    total = 0
    for c in chunks:
        if not isinstance(c, dict) or not set(c) <= _CHUNK_KEYS or not int_pair(c.get("offsets")):
            raise CorruptCheckpointError(f"{bad}: malformed chunk {str(c)[:200]}")
        h = c.get(CHUNK_HASH)
        if not isinstance(h, str) or not _HASH128.fullmatch(h):
            raise CorruptCheckpointError(f"{bad}: chunk without a valid {CHUNK_HASH}")
        begin, end = c["offsets"]
        f = c.get("file")
        if end < begin:
            raise CorruptCheckpointError(f"{bad}: chunk range [{begin}, {end}) is reversed")
        if "step" in c:
            _check_referred_file(c["step"], f, refs, bad)
        elif not isinstance(f, str) or f not in files or end > files[f]["size"]:
            raise CorruptCheckpointError(
                f"{bad}: chunk [{begin}, {end}) of file {str(f)[:100]!r} is not within a "
                "listed file"
            )
        total += end - begin
    if total != nbytes:
        raise CorruptCheckpointError(
            f"{bad}: its chunks hold {total} bytes, its dtype and shape need {nbytes}"
        )


_SOURCE_KEYS = {"file", "step"}
_INT_ONLY = {int}
_NUMPY_FROM = 96  # integers in an extents list from which NumPy checks it (32 extents)


def _check_extents(
    sources: Any, extents: Any, nbytes: int, files: Mapping[str, Any], refs: set[int], bad: str
) -> np.ndarray | None:
    """The pieces of a version 3 entry: ``sources``, the files its bytes lie in (one of
    this checkpoint's by its key, or a data file of a step in ``refs`` by its basename),
    and ``extents``, a flat list of (source index, begin, end) triples; in order they
    hold exactly the tensor's bytes, each inside its file's declared size. Returns the
    ``(n, 3)`` array a long list was checked as (None for a short one)."""
    if not isinstance(sources, list) or not sources:
        raise CorruptCheckpointError(f"{bad}: sources must be a non-empty list")
    limits = []  # the end no extent of a source may pass
    for src in sources:
        if not isinstance(src, dict) or not set(src) <= _SOURCE_KEYS:
            raise CorruptCheckpointError(f"{bad}: malformed source {str(src)[:200]}")
        f = src.get("file")
        if "step" in src:
            _check_referred_file(src["step"], f, refs, bad)
            limits.append(ARRAY_LIMIT - 1)  # the reader checks it against that file
        elif not isinstance(f, str) or f not in files:
            raise CorruptCheckpointError(f"{bad}: source file {str(f)[:100]!r} is not listed")
        else:
            limits.append(min(files[f]["size"], ARRAY_LIMIT - 1))
    if (
        not isinstance(extents, list)
        or not extents
        or len(extents) % 3
        or set(map(type, extents)) != _INT_ONLY  # gathered in C; bool is not int here
    ):
        raise CorruptCheckpointError(
            f"{bad}: extents must be a non-empty flat list of integer triples (source, begin, end)"
        )
    too_big = f"{bad}: an extent's integer exceeds 2**63"
    a = None
    if len(extents) < _NUMPY_FROM:
        if max(extents) >= ARRAY_LIMIT or min(extents) < -ARRAY_LIMIT:
            raise CorruptCheckpointError(too_big)
        total = 0
        for i in range(0, len(extents), 3):
            s, b, e = extents[i : i + 3]
            if not (0 <= s < len(limits) and 0 <= b <= e <= limits[s]):
                raise _bad_extent(bad, i // 3, (s, b, e), len(limits))
            total += e - b
    else:
        try:  # NumPy refuses what does not fit in 64 bits, as the check above does
            a = np.array(extents, dtype=np.int64).reshape(-1, 3)
        except OverflowError:
            raise CorruptCheckpointError(too_big) from None
        ok = (a[:, 0] >= 0) & (a[:, 0] < len(limits)) & (a[:, 1] >= 0) & (a[:, 1] <= a[:, 2])
        if ok.all():
            ok = a[:, 2] <= np.array(limits, dtype=np.int64)[a[:, 0]]
        if not ok.all():
            i = int(np.argmin(ok))
            raise _bad_extent(bad, i, tuple(a[i].tolist()), len(limits))
        total = sum((a[:, 2] - a[:, 1]).tolist())  # Python integers: no overflow
    if total != nbytes:
        raise CorruptCheckpointError(
            f"{bad}: its extents hold {total} bytes, its dtype and shape need {nbytes}"
        )
    return a


def _bad_extent(bad: str, i: int, extent: tuple[int, ...], n: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{bad}: extent {i} {list(extent)} is not [source below {n}, begin, end] with "
        "0 <= begin <= end within that source's file"
    )


def _check_referred_file(step: Any, f: Any, refs: set[int], bad: str) -> None:
    """A piece in an earlier checkpoint: its step among ``refs``, its file a basename."""
    if not _nonneg_int(step) or step not in refs:
        raise CorruptCheckpointError(
            f"{bad}: a chunk refers to step {str(step)[:40]}, which is not among the "
            "manifest's refs"
        )
    if not isinstance(f, str) or "/" in f:
        raise CorruptCheckpointError(
            f"{bad}: a chunk of another checkpoint names its file by basename, "
            f"found {str(f)[:100]!r}"
        )
    check_relpath(f)


def int_pair(x: Any) -> bool:
    """A list of two non-negative integers (not booleans): a byte range's ends."""
    return (
        type(x) is list
        and len(x) == 2
        and type(x[0]) is int
        and type(x[1]) is int
        and x[0] >= 0
        and x[1] >= 0
    )


def tensor_ranges(info: Mapping[str, Any]) -> list[tuple[int | None, str, int, int]]:
    """Where a validated tensor entry's bytes lie, in order: (step or None for this
    checkpoint, file, begin, end); one range for a version 1 entry."""
    if "extents" in info:
        where = [(s.get("step"), s["file"]) for s in info["sources"]]
        ext = info["extents"]
        return [(*where[ext[i]], ext[i + 1], ext[i + 2]) for i in range(0, len(ext), 3)]
    if "chunks" in info:
        return [
            (c.get("step"), c["file"], c["offsets"][0], c["offsets"][1]) for c in info["chunks"]
        ]
    return [(None, info["file"], info["offsets"][0], info["offsets"][1])]


def _check_disjoint(
    tensors: Mapping[str, Mapping[str, Any]],
    where: str,
    arrays: Mapping[str, np.ndarray] | None = None,
) -> None:
    """No two tensors (or chunks) share a byte of a file, this checkpoint's or one it
    refers to, so all tensors together hold at most the files' bytes. Sort and sweep,
    O(n log n): in NumPy where a version 3 entry has a long extents list (thousands of
    extents; ``arrays``: those already made into arrays, by tensor name), else in
    Python, without loading NumPy (a persist worker checks every manifest it
    writes, `retention._files_valid`)."""
    arrays = arrays or {}
    keys: dict[tuple[int, str], int] = {}  # (step, or -1 for this checkpoint; file) -> id
    names = list(tensors)
    small: list[tuple[int, int, int, int]] = []  # (file id, begin, end, tensor)
    parts: list[np.ndarray] = []  # rows of the same, a long extents list at a time
    for i, (name, info) in enumerate(tensors.items()):
        if len(info.get("extents", ())) >= _NUMPY_FROM:
            ids = np.array(
                [
                    keys.setdefault((s.get("step", -1), s["file"]), len(keys))
                    for s in info["sources"]
                ],
                dtype=np.int64,
            )
            a = arrays.get(name)
            if a is None:
                a = np.array(info["extents"], dtype=np.int64).reshape(-1, 3)
            parts.append(np.stack([ids[a[:, 0]], a[:, 1], a[:, 2], np.full(len(a), i)], axis=1))
            continue
        for step, fname, begin, end in tensor_ranges(info):
            key = (-1 if step is None else step, fname)
            small.append((keys.setdefault(key, len(keys)), begin, end, i))
    # Sorted by file and begin, ranges are disjoint iff each begins at or after the
    # end of the one before it in the same file.
    clash: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None = None
    if parts:
        rows = np.concatenate([np.array(small, dtype=np.int64).reshape(-1, 4), *parts])
        rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
        clashes = (rows[1:, 0] == rows[:-1, 0]) & (rows[1:, 1] < rows[:-1, 2])
        if clashes.any():
            j = int(np.argmax(clashes))
            clash = tuple(rows[j].tolist()), tuple(rows[j + 1].tolist())
    else:
        small.sort()  # by file, begin, end, then tensor: the order lexsort gives
        clash = next(
            ((a, b) for a, b in itertools.pairwise(small) if a[0] == b[0] and b[1] < a[2]),
            None,
        )
    if clash is not None:
        (fid, _, _, t1), (_, at, _, t2) = clash
        step, fname = next(k for k, v in keys.items() if v == fid)
        in_file = fname if step < 0 else f"{fname} of step {step}"
        first, second = names[t1], names[t2]
        raise CorruptCheckpointError(
            f"{where}: tensors {first[:100]!r} and {second[:100]!r} overlap in "
            f"{in_file} at byte {at}; each byte of a data file belongs to at "
            "most one tensor"
        )
