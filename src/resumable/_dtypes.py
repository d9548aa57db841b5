"""The dtypes and shapes a checkpoint stores, known by their safetensors names.

Slots, data file headers and manifests carry a dtype as its safetensors name
(``"F32"``), with its element size here; torch's dtype is looked up only where a
tensor is made or described (`dtype_from_name`, `dtype_name`). So the persist worker,
which writes bytes and checks names, runs without importing torch. A shape is
accepted only where NumPy and torch can lay it out (`shape_ok`). The names and limits
are those of ``docs/format.md``; `resumable.format` checks manifests and headers with
them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from resumable.errors import CorruptCheckpointError, UnsupportedStateError

if TYPE_CHECKING:
    import torch

MAX_NDIM = 64
ARRAY_LIMIT = 2**63  # numpy and torch strides: bytes of an array, zero dimensions as 1

ITEMSIZE: dict[str, int] = {  # safetensors name -> bytes per element
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_TORCH_NAMES = {  # safetensors name -> torch attribute
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


@functools.cache
def _torch_dtypes() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    import torch

    to_torch = {k: getattr(torch, v) for k, v in _TORCH_NAMES.items()}
    return {v: k for k, v in to_torch.items()}, to_torch


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; `UnsupportedStateError` for one a
    checkpoint cannot store."""
    try:
        return _torch_dtypes()[0][dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensors of dtype {dtype} cannot be stored in safetensors; "
            f"supported: {', '.join(str(d) for d in _torch_dtypes()[0])}"
        ) from None


def check_dtype_name(name: Any) -> str:
    """``name`` if it is the safetensors name of a dtype a checkpoint stores, else
    `CorruptCheckpointError` (no torch needed)."""
    if not isinstance(name, str) or name not in ITEMSIZE:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint")
    return name


def dtype_from_name(name: Any) -> torch.dtype:
    """The torch dtype of a safetensors name found in a checkpoint (validated here)."""
    return _torch_dtypes()[1][check_dtype_name(name)]


def itemsize(name: str) -> int:
    """Bytes per element of a dtype known by its safetensors name (validated before)."""
    return ITEMSIZE[name]


def numel(shape: Iterable[int]) -> int:
    """The number of elements of a shape (checked before: `shape_ok`)."""
    n = 1
    for d in shape:
        n *= d
    return n


def shape_ok(shape: Any, element_size: int) -> bool:
    """A list of at most `MAX_NDIM` non-negative integers that numpy and torch can lay
    out: the product of its non-zero dimensions times ``element_size`` stays below 2**63
    (an empty tensor may not claim a dimension that overflows a stride). A loop, not
    generators: a safetensors header may have thousands of entries."""
    if type(shape) is not list or len(shape) > MAX_NDIM:
        return False
    n = element_size
    for d in shape:
        if type(d) is not int or d < 0 or d >= ARRAY_LIMIT:
            return False
        if d:
            n *= d
            if n >= ARRAY_LIMIT:
                return False
    return True
