"""The API reference build (`docs/build_api.py`, run by `make test`) fails on what would
make the reference rot: a docstring naming something that does not exist, a module
that does not import. Needs pdoc (the ``docs`` extra, which `make test` installs)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("pdoc")

BUILD_API = Path(__file__).resolve().parents[1] / "docs" / "build_api.py"


@pytest.fixture(scope="module")
def build_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_api", BUILD_API)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_module(tmp_path: Path) -> Iterator[str]:
    """An importable module whose docstrings hold good and broken references."""
    (tmp_path / "rotted_api.py").write_text(
        textwrap.dedent(
            '''
            """Uses `Worker.run`, `resumable.Checkpointer.restore` and `helper`."""

            def helper() -> None:
                """Calls `Worker.run`; formerly `Worker.start`, which is gone."""

            class Worker:
                """Its `run` and its `pace` (set in ``__init__``); ``literal.text`` is fine."""

                def __init__(self) -> None:
                    self.pace = 1.0

                def run(self) -> None:
                    """See `resumable.Checkpointer.reload` and `helper`."""
            '''
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield "rotted_api"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("rotted_api", None)


def test_broken_docstring_references_are_found(build_api: ModuleType, fake_module: str) -> None:
    problems = build_api.broken_references([fake_module])
    assert sorted(problems) == [
        "rotted_api.Worker.run: `resumable.Checkpointer.reload` names nothing",
        "rotted_api.helper: `Worker.start` names nothing",
    ]


def test_the_projects_reference_builds_clean(build_api: ModuleType, tmp_path: Path) -> None:
    assert build_api.main(["--out", str(tmp_path / "api")]) == 0
    html = (tmp_path / "api" / "resumable.html").read_text()
    assert "Checkpointer" in html and "maybe_save" in html
    assert (tmp_path / "api" / "resumable" / "data.html").exists()


def test_a_module_that_does_not_import_fails_the_build(
    build_api: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(build_api, "MODULES", ("resumable", "resumable.no_such_module"))
    assert build_api.main(["--out", str(tmp_path / "api")]) == 1
    assert "no_such_module" in capsys.readouterr().err
