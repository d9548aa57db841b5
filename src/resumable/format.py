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
arena keeps a persist at one pass over memory. Tensors are ordered by element size,
largest first, so every tensor starts at an offset aligned to its element size and can
be viewed in place. Files stay readable by ``safetensors.safe_open`` (tested).

Reading is defensive: every name, size, offset and checksum in a manifest is validated
against the files before a byte is used, and nothing in a checkpoint can name code.
"""

from __future__ import annotations

import json
import platform
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from resumable.errors import CorruptCheckpointError, NewerFormatError, UnsupportedStateError

FORMAT_NAME = "resumable-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
MAX_SAFETENSORS_HEADER = 100 << 20
MAX_NDIM = 64
CHECKSUM = "xxh3_64"

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9._-]{0,199}$")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensors of dtype {dtype} cannot be stored in safetensors; "
            f"supported: {', '.join(str(d) for d in _DTYPES)}"
        ) from None


def dtype_from_name(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _FROM_NAME:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint")
    return _FROM_NAME[name]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor as a flat memoryview, without a copy."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def checksum(data: Any) -> str:
    """xxh3-64 of a buffer, as 16 hex digits (releases the GIL on large buffers)."""
    return xxhash.xxh3_64_hexdigest(data)


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
    """Where one tensor's bytes live in a data file's data region."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def plan_layout(tensors: Mapping[str, torch.Tensor]) -> list[TensorSlot]:
    """Pack tensors back to back, largest element size first, so each slot is aligned to
    its element size. The same layout serves the snapshot arena and the file."""
    order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    slots, offset = [], 0
    for name, t in order:
        dtype_name(t.dtype)
        n = t.numel() * t.element_size()
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, offset + n))
        offset += n
    return slots


def safetensors_header(slots: Iterable[TensorSlot], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length prefix plus the JSON header, padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for s in slots:
        header[s.name] = {
            "dtype": dtype_name(s.dtype),
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.end],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def parse_safetensors_header(prefix: bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    """Parse a safetensors header from the first bytes of a file; returns (data_start,
    header). ``prefix`` must hold at least ``8 + header length`` bytes."""
    if len(prefix) < 8:
        raise CorruptCheckpointError("data file shorter than a safetensors header")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_SAFETENSORS_HEADER or 8 + n > file_size or len(prefix) < 8 + n:
        raise CorruptCheckpointError(f"safetensors header length {n} is out of bounds")
    try:
        header = json.loads(prefix[8 : 8 + n])
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError("safetensors header is not a JSON object")
    return 8 + n, header


# --------------------------------------------------------------------------- manifest


def versions() -> dict[str, str]:
    from resumable import __version__

    return {
        "resumable": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


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
    m: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "created": time.time(),
        "metrics": _json_metrics(metrics or {}),
        "versions": versions(),
        "hostname": socket.gethostname(),
        "world_size": int(world_size),
        "ranks": [{"rank": i, "tree": t} for i, t in enumerate(trees)],
        "files": {k: dict(v) for k, v in files.items()},
        "tensors": {k: dict(v) for k, v in tensors.items()},
    }
    m["digest"] = manifest_digest(m)
    return m


def _json_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float, str)) or v is None:
            raise UnsupportedStateError(
                f"metric {k!r} must be a number or string, found {type(v).__name__}"
            )
        if isinstance(v, float) and not np.isfinite(v):
            v = repr(v)
        out[str(k)] = v
    return out


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, allow_nan=False).encode()


def _reject_constant(name: str) -> Any:
    raise CorruptCheckpointError(f"manifest contains non-standard JSON constant {name}")


def decode_manifest(data: bytes, *, where: str) -> dict[str, Any]:
    """Parse and validate a manifest's structure, names, sizes and digest.

    Does not read data files; `validate_against_files` checks the byte ranges against
    the real file sizes. Raises `CorruptCheckpointError` naming ``where``.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: manifest of {len(data)} bytes is too large")
    try:
        m = json.loads(data, parse_constant=_reject_constant)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a resumable manifest")
    version = m.get("format_version")
    digest_ok = m.get("digest") == manifest_digest(m)
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
    _check_type(m, "ranks", list, where)
    _check_type(m, "files", dict, where)
    _check_type(m, "tensors", dict, where)
    _check_type(m, "metrics", dict, where)
    for fname, info in m["files"].items():
        check_relpath(fname)
        if not isinstance(info, dict) or not _nonneg_int(info.get("size")):
            raise CorruptCheckpointError(f"{where}: bad entry for file {fname!r}")
    for name, info in m["tensors"].items():
        _check_tensor_entry(name, info, m["files"], where)
    if not m["ranks"]:
        raise CorruptCheckpointError(f"{where}: manifest lists no rank")
    for r in m["ranks"]:
        if not isinstance(r, dict) or "tree" not in r:
            raise CorruptCheckpointError(f"{where}: malformed rank entry")
    return m


def _nonneg_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_type(m: Mapping[str, Any], key: str, typ: type, where: str) -> None:
    if not isinstance(m.get(key), typ) or isinstance(m.get(key), bool):
        raise CorruptCheckpointError(
            f"{where}: manifest field {key!r} missing or not {typ.__name__}"
        )


def _check_tensor_entry(name: str, info: Any, files: Mapping[str, Any], where: str) -> None:
    bad = f"{where}: bad tensor index entry {name[:100]!r}"
    if not isinstance(info, dict):
        raise CorruptCheckpointError(bad)
    f = info.get("file")
    if not isinstance(f, str) or f not in files:
        raise CorruptCheckpointError(f"{bad}: file {str(f)[:100]!r} is not listed")
    dtype = dtype_from_name(info.get("dtype"))
    shape, offsets = info.get("shape"), info.get("offsets")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_nonneg_int(d) for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_nonneg_int(o) for o in offsets)
        or not isinstance(info.get(CHECKSUM), str)
    ):
        raise CorruptCheckpointError(bad)
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if end < begin or end - begin != numel * itemsize or end > files[f]["size"]:
        raise CorruptCheckpointError(
            f"{bad}: byte range [{begin}, {end}) does not match shape {shape} of "
            f"{info.get('dtype')} or exceeds the file's {files[f]['size']} bytes"
        )
