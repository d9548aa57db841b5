"""Local roots that would silently mean another directory are refused (issue 44 item 3):
``file://runs/x`` (host ``runs``, path ``/x``) and the empty string (the current
directory). The library and the CLI share the parse (`resumable.storage.open_storage`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import resumable
from resumable.errors import CheckpointError
from resumable.storage import open_storage


@pytest.mark.parametrize("url", ["file://runs/x", "file://host.example/abs/dir", "", "   "])
def test_a_root_that_means_another_directory_is_refused(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"file:///abs/path"):
        resumable.Checkpointer(url, state, persist="sync")
    assert os.listdir(tmp_path) == [], "nothing may be written anywhere"


def test_the_refusal_names_the_plain_path_meant() -> None:
    with pytest.raises(CheckpointError, match=r"host 'runs'.*'runs/x'"):
        open_storage("file://runs/x")


@pytest.mark.parametrize("form", ["file://{}", "file://localhost{}", "{}"])
def test_file_urls_with_an_empty_or_localhost_host_and_plain_paths_work(
    form: str, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    state = {"w": torch.ones(2)}
    with resumable.Checkpointer(form.format(root), state, persist="sync") as ck:
        ck.save(1)
    with resumable.Checkpointer(root, {"w": torch.zeros(2)}, persist="sync") as ck:
        assert ck.steps() == [1]


def test_the_cli_refuses_the_same_roots(capsys: pytest.CaptureFixture[str]) -> None:
    from resumable.cli import main

    code = main(["ls", "file://runs/x"])
    assert code != 0
    assert "file:///abs/path" in capsys.readouterr().err
