"""`resumable.settings`: every ``RESUMABLE_*`` variable is read through one table, and
docs/environment.md lists exactly that table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from resumable import settings, watchers
from resumable.pipeline import _worker as worker
from resumable.storage.local import LocalStorage

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "resumable"


def _table() -> str:
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for k in settings.KNOBS:
        default = f"`{k.default}`" if k.default else "(unset)"
        rows.append(f"| `{k.name}` | {default} | {k.doc} |")
    return "\n".join(rows)


def test_the_docs_list_exactly_the_knobs() -> None:
    text = (ROOT / "docs" / "environment.md").read_text()
    block = re.search(r"<!-- knobs -->\n(.*?)\n<!-- /knobs -->", text, re.S)
    assert block is not None
    assert block.group(1) == _table()
    defined = [k for k in vars(settings).values() if isinstance(k, settings.Knob)]
    assert sorted(k.name for k in defined) == sorted(k.name for k in settings.KNOBS)


def _variable_names(tree: ast.AST) -> dict[str, str]:
    """Module-level names bound to a variable's name: ``X = "RESUMABLE_..."`` or
    ``X = settings.KNOB.name``."""
    knobs = {name: k.name for name, k in vars(settings).items() if isinstance(k, settings.Knob)}
    found = {}
    for stmt in getattr(tree, "body", []):
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        target, value = stmt.targets[0], stmt.value
        if not isinstance(target, ast.Name):
            continue
        if isinstance(value, ast.Constant) and str(value.value).startswith("RESUMABLE_"):
            found[target.id] = str(value.value)
        text = ast.unparse(value)
        for name, variable in knobs.items():
            if text in (f"settings.{name}.name", f"{name}.name"):
                found[target.id] = variable
    return found


def _environ_reads(tree: ast.AST) -> list[str]:
    """The RESUMABLE_ variables passed to os.environ.get/[]/getenv: as a string, or as a
    module-level name bound to one (`_variable_names`)."""
    aliases = _variable_names(tree)
    found = []
    for node in ast.walk(tree):
        args: list[ast.expr] = []
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("os.environ.get", "os.getenv", "environ.get", "env.get"):
                args = node.args[:1]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            args = [node.slice]
        for arg in args:
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("RESUMABLE_"):
                found.append(str(arg.value))
            elif isinstance(arg, ast.Name) and arg.id in aliases:
                found.append(aliases[arg.id])
    return found


def test_no_module_reads_a_resumable_variable_of_its_own() -> None:
    names = {k.name for k in settings.KNOBS}
    for path in SRC.rglob("*.py"):
        if path.name == "settings.py":
            continue
        text = path.read_text()
        assert _environ_reads(ast.parse(text)) == [], path
        for name in re.findall(r"RESUMABLE_[A-Z_]+[A-Z]", text):
            assert name in names, f"{path}: {name} is not in resumable.settings.KNOBS"


def test_the_scan_sees_a_direct_read() -> None:
    tree = ast.parse("import os\nos.environ.get('RESUMABLE_X')\nos.environ['RESUMABLE_Y']")
    assert _environ_reads(tree) == ["RESUMABLE_X", "RESUMABLE_Y"]


def test_the_scan_sees_a_read_through_a_name() -> None:
    source = (
        "import os\nfrom resumable import settings\nA = 'RESUMABLE_A'\n"
        "B = settings.WATCH.name\nos.environ.get(A)\nos.getenv(B)\nos.environ.get(C)\n"
    )
    assert _environ_reads(ast.parse(source)) == ["RESUMABLE_A", "RESUMABLE_WATCH"]


def test_every_knob_is_read_somewhere() -> None:
    """No option that nothing reads: each knob's ``read`` is called outside settings.py."""
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "settings.py")
    unread = [
        name
        for name, k in vars(settings).items()
        if isinstance(k, settings.Knob) and f"settings.{name}.read(" not in text
    ]
    assert unread == []


def test_knobs_reach_the_modules_that_use_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(settings.WORKER_NICE.name, "3")
    assert worker.worker_nice() == 3
    monkeypatch.setenv(settings.DIRECT_IO.name, "0")
    assert LocalStorage(tmp_path).direct_io is False
    assert watchers.watchers_from_env({settings.WATCH.name: "aws"})[0].name == "aws-spot"
    with pytest.raises(ValueError, match="RESUMABLE_WATCH names an unknown watcher"):
        watchers.watchers_from_env({settings.WATCH.name: "nope"})
