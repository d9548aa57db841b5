"""Optional storage capabilities (`read_into`, `map_file`) are part of the `Storage`
interface with fallbacks, so a backend without them still works and a wrapper
(`ForwardingStorage`) never drops the inner backend's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumable import Checkpointer
from resumable.errors import CorruptCheckpointError
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, MemoryStorage
from resumable.storage.base import ForwardingStorage


def test_a_wrapper_keeps_the_zero_copy_read_of_its_backend(tmp_path: Path) -> None:
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    with Checkpointer(tmp_path, state, persist="sync", keep=None) as ck:
        ck.save(1)
    reader = CheckpointReader(ForwardingStorage(LocalStorage(tmp_path)), 1)
    tensors = reader.tensors(verify=True)
    assert reader.mapped  # the file was mapped through the wrapper, not copied
    assert torch.equal(next(iter(tensors.values())), state["w"])


def test_a_backend_without_them_reads_through_the_fallbacks() -> None:
    storage = MemoryStorage("memory://capabilities")
    storage.write("f", [bytes(range(100))])
    assert storage.map_file("f") is None
    out = bytearray(10)
    storage.read_into("f", 20, memoryview(out))
    assert bytes(out) == bytes(range(20, 30))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        storage.read_into("f", 95, memoryview(bytearray(10)))
