"""Every module that logs makes its logger with ``logging.getLogger(__name__)``: the
logger is then a child of ``resumable``, so the handlers and levels a user sets on
``logging.getLogger("resumable")`` reach it, and a record names the module it came from.
Configuring the package logger itself (the command line does) is not making one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "resumable"
PACKAGE = "resumable"

# Modules left out of the scan (none: every module is checked).
NOT_YET_CHECKED: set[str] = set()


def _is_get_logger(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in (
        "logging.getLogger",
        "getLogger",
    )


def logger_problems(source: str) -> list[str]:
    """What in ``source`` makes a logger otherwise than with ``__name__``: a module-level
    ``getLogger`` assignment with another argument, or a ``getLogger`` call anywhere
    with a literal name inside the package (``"resumable.x"``)."""
    tree = ast.parse(source)
    problems = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not _is_get_logger(node):
            continue
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and str(first.value).startswith(f"{PACKAGE}."):
            problems[node.lineno] = ast.unparse(node)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _is_get_logger(stmt.value):
            assert isinstance(stmt.value, ast.Call)
            if [ast.unparse(a) for a in stmt.value.args] != ["__name__"]:
                problems[stmt.lineno] = ast.unparse(stmt)
    return [f"line {n}: {text}" for n, text in sorted(problems.items())]


def test_every_module_logger_is_named_after_its_module() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if name in NOT_YET_CHECKED:
            continue
        problems = logger_problems(path.read_text())
        if problems:
            found[name] = problems
    assert found == {}, "use logging.getLogger(__name__): " + repr(found)


def test_the_exceptions_name_existing_files() -> None:
    assert {name for name in NOT_YET_CHECKED if not (SRC / name).is_file()} == set()


def test_the_scan_sees_a_literal_name() -> None:
    assert logger_problems("import logging\nlog = logging.getLogger('resumable.x')\n") == [
        "line 2: log = logging.getLogger('resumable.x')"
    ]
    assert logger_problems("import logging\nlog = logging.getLogger('mine')\n") == [
        "line 2: log = logging.getLogger('mine')"
    ]
    inner = "import logging\ndef f():\n    return logging.getLogger('resumable.y')\n"
    assert logger_problems(inner) == ["line 3: logging.getLogger('resumable.y')"]
    assert logger_problems("import logging\nlog = logging.getLogger(__name__)\n") == []
    assert logger_problems("import logging\nlogging.getLogger('resumable').setLevel(10)\n") == []
