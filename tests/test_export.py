"""`resumable.export` on its own: a state key to one safetensors file, without the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import resumable
from resumable.errors import CheckpointError, CorruptCheckpointError
from resumable.export import export_state_dict, has_tensors, state_dict_names, write_atomic
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

pytestmark = pytest.mark.usefixtures("sync_persist")


class Recorder:
    """An `ExportProgress` that records its calls in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, total: int) -> None:
        self.calls.append(("start", total))

    def advance(self, nbytes: int) -> None:
        self.calls.append(("advance", nbytes))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2).to(torch.float16))
    ck = resumable.Checkpointer(tmp_path / "ck", {"model": model, "extra": {"lr": 0.1}}, keep=None)
    ck.save(7)
    ck.close()
    return tmp_path / "ck", {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def root(saved: tuple[Path, dict[str, torch.Tensor]]) -> Path:
    return saved[0]


def test_exports_the_state_dict_and_reports_progress_in_order(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, expected = saved
    storage = open_storage(str(root))
    out = tmp_path / "model.safetensors"
    progress = Recorder()
    count, nbytes = export_state_dict(storage, 7, "model", out, progress)
    loaded = load_file(str(out))
    assert count == len(expected) == len(loaded)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)
    assert progress.calls[0] == ("start", nbytes)
    assert [kind for kind, _ in progress.calls[1:]] == ["advance"] * count
    assert sum(n for _, n in progress.calls[1:]) == nbytes
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_names_and_refusals(root: Path, tmp_path: Path) -> None:
    tree = CheckpointReader(open_storage(str(root)), 7).tree
    assert set(state_dict_names(tree, "model", "here")) == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    }
    assert has_tensors(tree) and not has_tensors({"dict": []})
    with pytest.raises(CheckpointError, match="no state key 'modle'; available keys: model"):
        state_dict_names(tree, "modle", "here")
    with pytest.raises(CheckpointError, match="'extra' holds no tensors"):
        state_dict_names(tree, "extra", "here")
    with pytest.raises(CheckpointError, match="no state key '__classes__'"):
        state_dict_names(tree, "__classes__", "here")


def test_a_corrupt_tensor_leaves_the_old_file(root: Path, tmp_path: Path) -> None:
    storage = open_storage(str(root))
    step = root / "step-000000000007"
    begin, _ = json.loads((step / "manifest.json").read_text())["tensors"]["model/1.bias"][
        "offsets"
    ]
    data = step / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[begin] ^= 0x01  # the last tensor of the model written
    data.write_bytes(bytes(raw))
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        export_state_dict(storage, 7, "model", out)
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model.safetensors"]


def test_write_atomic_all_or_nothing(tmp_path: Path) -> None:
    out = tmp_path / "f"
    write_atomic([b"ab", memoryview(b"cd")], out)
    assert out.read_bytes() == b"abcd"

    def failing() -> Iterator[bytes]:
        yield b"xy"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(failing(), out)
    assert out.read_bytes() == b"abcd"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
