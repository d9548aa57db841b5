"""``storage_options`` that no root can use are refused, not dropped
(`resumable.storage.options`): a local path, ``file://``, ``memory://`` or an
already-built `Storage` has no object-store client to take them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import resumable
from resumable.errors import CheckpointError
from resumable.storage import (
    LocalStorage,
    MemoryStorage,
    check_storage_options,
    open_storage,
    options_for,
)
from resumable.storage.options import is_object_root

OPTIONS = {"endpoint_url": "http://127.0.0.1:9", "part_size": 8 << 20}


@pytest.mark.parametrize("form", ["{}", "file://{}"])
def test_open_storage_refuses_options_for_a_local_root(form: str, tmp_path: Path) -> None:
    root = tmp_path / "run"
    with pytest.raises(CheckpointError) as caught:
        open_storage(form.format(root), OPTIONS)
    message = str(caught.value)
    assert "['endpoint_url', 'part_size']" in message
    assert "apply to object storage URLs only" in message
    assert str(root) in message
    assert "drop storage_options" in message
    assert not root.exists(), "nothing may be created for a refused root"


def test_open_storage_refuses_options_for_a_memory_root() -> None:
    with pytest.raises(CheckpointError, match=r"\['part_size'\].*'memory://opts'"):
        open_storage("memory://opts", {"part_size": 8 << 20})


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_open_storage_refuses_options_for_a_built_storage(kind: str, tmp_path: Path) -> None:
    built = LocalStorage(tmp_path) if kind == "local" else MemoryStorage("memory://built")
    with pytest.raises(CheckpointError, match="pass them to its constructor"):
        open_storage(built, OPTIONS)
    assert open_storage(built) is built


@pytest.mark.parametrize("options", [None, {}])
def test_no_options_open_a_local_root(options: dict[str, int] | None, tmp_path: Path) -> None:
    assert isinstance(open_storage(tmp_path / "run", options), LocalStorage)


def test_a_local_root_with_an_object_store_mirror_takes_the_options() -> None:
    check_storage_options("runs/x", OPTIONS, mirror="s3://bucket/x")
    check_storage_options("s3://bucket/x", OPTIONS, mirror="runs/x")
    assert options_for("runs/x", OPTIONS) is None
    assert options_for("s3://bucket/x", OPTIONS) == OPTIONS


def test_options_neither_root_takes_are_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"not 'runs/x' or 'memory://m'"):
        check_storage_options("runs/x", OPTIONS, mirror="memory://m")


def test_options_for_returns_a_copy_and_none_without_options() -> None:
    got = options_for("gs://bucket/x", OPTIONS)
    assert got == OPTIONS and got is not OPTIONS
    assert options_for("gs://bucket/x", None) is None
    assert options_for("gs://bucket/x", {}) is None


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("s3://b/p", True),
        ("S3://b/p", True),
        ("gs://b/p", True),
        ("gcs://b/p", True),
        ("az://c/p", True),
        ("abfs://c/p", True),
        ("abfss://c/p", True),
        ("bucket/p", False),
        ("runs/s3://b", False),
        ("file:///abs", False),
        ("memory://m", False),
        (Path("runs/x"), False),
        (None, False),
    ],
)
def test_which_roots_are_object_stores(root: str | os.PathLike[str] | None, expected: bool) -> None:
    assert is_object_root(root) is expected


def test_the_checkpointer_refuses_options_for_a_local_root(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="drop storage_options"):
        resumable.Checkpointer(
            tmp_path / "run", state, persist="sync", storage_options={"part_size": 8 << 20}
        ).close()
