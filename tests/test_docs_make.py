"""``make docs`` builds the API reference the README points to, installing only what that
needs: the library with its ``docs`` extra (pdoc), torch pinned as every target pins it;
not the development toolchain (test servers, ruff, mypy, Azurite, Chromium). Checked
with ``make -n`` (print the commands, run none) against a scratch virtual environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_dry_run(venv: Path, target: str) -> str:
    done = subprocess.run(
        ["make", "-n", "-C", str(REPO), f"VENV={venv}", target],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def pip_installs(commands: str) -> list[str]:
    return [line for line in commands.splitlines() if "pip install" in line]


def test_make_docs_installs_the_library_with_the_docs_extra_only(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    commands = make_dry_run(venv, "docs").replace(str(venv), "VENV")
    installs = pip_installs(commands)
    assert installs, commands
    torch_pin = re.search(r"^TORCH_PIN \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert torch_pin is not None
    assert any(torch_pin.group(1) in line for line in installs)  # the pinned CPU torch
    editable = [line for line in installs if " -e " in line]
    assert len(editable) == 1 and '-e ".[docs]"' in editable[0], editable
    for dev_only in ("npm", "chromium", "azurite", "test,", "ruff", "mypy", "pytest"):
        assert dev_only not in commands.lower(), f"make docs runs {dev_only}: {commands}"
    assert "docs/build_api.py --out build/api" in commands


def test_make_docs_installs_nothing_into_a_development_venv(tmp_path: Path) -> None:
    """A development install (``make install``) already holds the docs extra: it marks
    the docs stamp too, so ``make docs`` then only builds."""
    venv = tmp_path / "venv"
    install = make_dry_run(venv, "install")
    assert re.search(rf"touch .*{re.escape(str(venv))}/\.installed-docs", install), install

    venv.mkdir()
    later = time.time() + 60  # newer than the Makefile and pyproject.toml
    for stamp in (".installed-dev", ".installed-demo", ".installed-docs"):
        (venv / stamp).touch()
        os.utime(venv / stamp, (later, later))
    commands = make_dry_run(venv, "docs")
    assert pip_installs(commands) == [], commands
    assert "docs/build_api.py --out build/api" in commands


def test_the_readme_points_to_where_make_docs_writes_the_reference() -> None:
    readme = (REPO / "README.md").read_text()
    assert "build/api/index.html" in readme
    for paragraph in readme.split("\n\n"):
        if "build/api/index.html" in paragraph:
            assert "make docs" in paragraph, paragraph
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe is not None
    assert "--out build/api" in recipe.group(1)
    # pdoc writes its index page (index.html) into the directory it is given.
    build_api = (REPO / "docs" / "build_api.py").read_text()
    assert "pdoc.pdoc(*MODULES, output_directory=args.out)" in build_api
