"""One checkpoint given as the root (``runs/x/step-000000000400``, as users of Transformers
and Lightning point at a checkpoint) is recognised (`resumable.commit.checkpoint_as_root`)
and refused by every command that reads a root, naming the parent to pass; ``show``
lists the classes a checkpoint recorded apart from its state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from resumable.cli import main
from resumable.commit import checkpoint_as_root, refuse_checkpoint_as_root
from resumable.errors import CheckpointError
from resumable.storage import LocalStorage, MemoryStorage


def test_a_step_directory_is_recognised(saved_root: Any) -> None:
    step_dir = saved_root.step_dir(2)
    assert checkpoint_as_root(LocalStorage(step_dir)) == (str(saved_root.path), 2)
    assert checkpoint_as_root(LocalStorage(saved_root.path)) is None
    with pytest.raises(CheckpointError, match=r"is a checkpoint.*pass its parent directory"):
        refuse_checkpoint_as_root(LocalStorage(step_dir))
    refuse_checkpoint_as_root(LocalStorage(saved_root.path))


def test_a_renamed_checkpoint_is_recognised_by_its_manifest(saved_root: Any) -> None:
    renamed = saved_root.path.parent / "best"
    saved_root.step_dir(3).rename(renamed)
    assert checkpoint_as_root(LocalStorage(renamed)) == (str(saved_root.path.parent), None)


def test_uncommitted_or_empty_directories_are_not_checkpoints(
    saved_root: Any, tmp_path: Path
) -> None:
    saved_root.manifest_file(1).unlink()
    assert checkpoint_as_root(LocalStorage(saved_root.step_dir(1))) is None
    assert checkpoint_as_root(LocalStorage(tmp_path / "missing")) is None
    store = MemoryStorage("memory://bucket/run/step-000000000005")
    store.write("manifest.json", [b"{}"])
    assert checkpoint_as_root(store) == ("memory://bucket/run", 5)


@pytest.mark.parametrize(
    "argv",
    [
        ["ls"],
        ["ls", "--json"],
        ["show"],
        ["verify"],
        ["export", "--key", "model", "--out", "OUT"],
        ["prune", "--keep-last", "1"],
        ["pin", "1"],
        ["log"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_commands_refuse_a_checkpoint_as_root(
    saved_root: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    step_dir = saved_root.step_dir(3)
    before = sorted(p.name for p in step_dir.iterdir())
    args = [a.replace("OUT", str(tmp_path / "out.safetensors")) for a in argv]
    assert main([args[0], str(step_dir), *args[1:]]) != 0
    err = capsys.readouterr().err
    assert "is a checkpoint" in err and "pass its parent directory" in err
    assert str(saved_root.path) in err
    assert sorted(p.name for p in step_dir.iterdir()) == before  # nothing written in it
    assert main(["ls", str(saved_root.path)]) == 0


def test_show_lists_recorded_classes_apart(
    saved_root: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", str(saved_root.path)]) == 0
    out = capsys.readouterr().out
    assert "__classes__" not in out
    assert "optim: torch.optim.adamw.AdamW" in out
    assert "sched: torch.optim.lr_scheduler.StepLR" in out
