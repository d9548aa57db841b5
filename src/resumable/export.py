"""Export one state key of a checkpoint as a plain safetensors state dict.

`export_state_dict` writes the tensors under one top-level key (``model``) to one
``.safetensors`` file that `safetensors.torch.load_file` reads without this library.
Keys are the original state-dict keys. A tensor sharded over several ranks is
assembled from its pieces. One tensor is in memory at a time, so a model larger than
the host's memory still exports. Every tensor's checksum is checked as it is read.

The file is written atomically (`write_atomic`): a temporary sibling, fsynced, then
renamed over the target. A failed export leaves an existing file as it was.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from resumable._dtypes import dtype_from_name, dtype_name
from resumable.capture import CLASSES_KEY, iter_refs, subtree
from resumable.commit import step_dir
from resumable.errors import CheckpointError
from resumable.format import TensorSlot, byte_view, safetensors_header
from resumable.reader import CheckpointReader
from resumable.reshard import GlobalLoader
from resumable.storage import Storage
from resumable.storage.writeback import write_all

__all__ = ["ExportProgress", "export_state_dict", "has_tensors", "state_dict_names", "write_atomic"]


class ExportProgress(Protocol):
    """What `export_state_dict` reports as it writes.

    Call order: `start` once, when the file's size is known (after its checks and
    before the first tensor is read), then `advance` once per tensor written.
    """

    def start(self, total: int) -> None:
        """The export will write ``total`` bytes of tensor data.

        Args:
            total: the bytes of tensor data the file will hold.
        """

    def advance(self, nbytes: int) -> None:
        """One more tensor was written.

        Args:
            nbytes: that tensor's bytes.
        """


def has_tensors(node: Any) -> bool:
    """Whether an encoded state tree (or subtree) refers to any tensor.

    Args:
        node: an encoded state tree, or a subtree of one.

    Returns:
        True if it refers to at least one tensor.
    """
    return next(iter_refs(node), None) is not None


def _top_keys(tree: Any) -> list[str]:
    """The state keys of an encoded tree, without the internal ``__classes__`` record."""
    pairs = tree.get("dict", []) if isinstance(tree, dict) else []
    return [str(p[0]) for p in pairs if isinstance(p, list) and len(p) == 2 and p[0] != CLASSES_KEY]


def state_dict_names(tree: Any, key: str, where: str) -> dict[str, tuple[str, str]]:
    """The original state-dict keys under top-level ``key`` of an encoded tree, mapped
    to ``(tag, name)`` of their tensors (``global`` tensors of several ranks are named
    by fqn).

    Args:
        tree: one rank's encoded state tree (``CheckpointReader.tree``).
        key: the top-level state key, such as ``model``.
        where: what the tree is, for error messages (``checkpoint step-000000000400``).

    Returns:
        Each state-dict key, mapped to its tensor's ``(tag, name)`` in the tree.

    Raises:
        CheckpointError: ``key`` is not a state key, holds no tensors, or two of its
            tensors map to one state-dict key.
    """
    try:
        if key == CLASSES_KEY:
            raise KeyError(key)  # the classes record describes the state; it is not state
        node = subtree(tree, key)
    except (KeyError, AttributeError, TypeError, ValueError):
        keys = _top_keys(tree)
        raise CheckpointError(
            f"{where} has no state key {key!r}; available keys: {', '.join(keys) or 'none'}"
        ) from None
    names: dict[str, tuple[str, str]] = {}
    for path, tag, name in iter_refs(node):
        sd_key = ".".join(str(p) for p in path) or key
        if sd_key in names:
            raise CheckpointError(
                f"{where}: two tensors under {key!r} map to the state-dict key {sd_key!r}; "
                "cannot export them to one flat file"
            )
        names[sd_key] = (tag, name)
    if not names:
        with_tensors = [k for k in _top_keys(tree) if has_tensors(subtree(tree, k))]
        raise CheckpointError(
            f"{where}: state key {key!r} holds no tensors; keys with tensors: "
            f"{', '.join(with_tensors) or 'none'}"
        )
    return names


def export_state_dict(
    storage: Storage,
    step: int,
    key: str,
    out: Path,
    progress: ExportProgress | None = None,
) -> tuple[int, int]:
    """Write the tensors under ``key`` of checkpoint ``step`` to ``out`` as one
    safetensors file, one tensor in memory at a time.

    Args:
        storage: the checkpoint root.
        step: a committed step of it.
        key: the top-level state key to export, such as ``model``.
        out: the file to write (replaced atomically if it exists).
        progress: told the total bytes, then each tensor written.

    Returns:
        The number of tensors and of tensor bytes written.

    Raises:
        CheckpointError: ``key`` is not exportable (see `state_dict_names`).
        CorruptCheckpointError: a file is missing or a checksum does not match;
            ``out`` is left as it was.
        OSError: writing ``out`` failed; ``out`` is left as it was.
    """
    reader = CheckpointReader(storage, step)
    names = state_dict_names(reader.tree, key, f"checkpoint {step_dir(step)}")
    reader.check_files()
    index = reader.manifest["tensors"]
    loader = GlobalLoader(reader, {})
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for sd_key, (tag, name) in names.items():
        if tag == "global":
            shape, dtype_text = loader.spec(name)
        else:
            shape, dtype_text = tuple(index[name]["shape"]), index[name]["dtype"]
        specs[sd_key] = (dtype_from_name(dtype_text), shape)

    def element_size(k: str) -> int:
        return torch.empty(0, dtype=specs[k][0]).element_size()

    slots, offset = [], 0
    for sd_key in sorted(specs, key=lambda k: -element_size(k)):  # aligned, as the data files
        dtype, shape = specs[sd_key]
        n = math.prod(shape) * element_size(sd_key)
        slots.append(TensorSlot(sd_key, dtype_name(dtype), shape, offset, offset + n))
        offset += n
    metadata = {"format": "pt", "producer": "resumable", "step": str(step), "key": key}

    def chunks() -> Iterator[Any]:
        yield safetensors_header(slots, metadata)
        if progress is not None:
            progress.start(offset)
        for slot in slots:
            tag, name = names[slot.name]
            if tag == "global":
                t = loader.assemble(name)
            else:
                t = reader.tensors([name], verify=True)[name]
            yield byte_view(t.contiguous().reshape(-1).view(torch.uint8))
            if progress is not None:
                progress.advance(slot.nbytes)

    write_atomic(chunks(), out)
    return len(slots), offset


def write_atomic(chunks: Iterable[Any], out: Path) -> None:
    """Write ``chunks`` to local file ``out`` all or nothing: a temporary sibling,
    fsynced, renamed over ``out``, and the directory fsynced.

    Args:
        chunks: bytes-like objects, written in order.
        out: the file to write or replace.

    Raises:
        OSError: the write failed. The temporary file is removed and ``out`` is left
            as it was (also on any other error, which propagates).
    """
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, chunks)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
