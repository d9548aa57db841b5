"""Build the API reference (HTML, with pdoc) from the docstrings, and fail if it rotted.

    python docs/build_api.py [--out build/api]

`make test` runs this, so the reference cannot drift from the code. It fails (exit
status 1, one line per problem) when:

- a documented module does not import, or pdoc warns while reading it (every warning
  is an error here);
- a docstring names something in single backquotes (`Checkpointer.restore`, the
  project's cross-reference convention) that does not exist: a renamed or removed
  function, class, method or attribute. Names are looked up from the object's own
  module, its class, the ``resumable`` package, importable module paths and builtins.
  Double backquotes (``code``) are literal text and are not checked.

The modules documented are the public ones: the facade (``resumable``), the data loader,
the storage interface users implement or configure, and the distributed helpers.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pdoc
import pdoc.doc

MODULES = (
    "resumable",
    "resumable.options",
    "resumable.data",
    "resumable.storage",
    "resumable.group",
    "resumable.pieces",
    "resumable.reshard",
    "resumable.ddp",
    "resumable.export",
)
REFERENCE = re.compile(r"(?<![`\w])`([A-Za-z_][\w.]*)`(?![`\w])")
_MISSING = object()


def _lookup(start: Any, parts: list[str]) -> Any:
    """``start.a.b...`` attribute by attribute, importing submodules of packages."""
    obj = start
    for part in parts:
        if isinstance(obj, dict):
            obj = obj.get(part, _MISSING)
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                return _MISSING
        else:
            return _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


def _resolves(name: str, scopes: Iterable[Any], members: set[str]) -> bool:
    parts = name.split(".")
    if parts[0] in members:
        return True
    for scope in scopes:
        if _lookup(scope, parts) is not _MISSING:
            return True
    for i in range(len(parts), 0, -1):  # a module path: resumable.storage.s3.S3Storage
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _lookup(module, parts[i:]) is not _MISSING
    return False


def _scopes(d: pdoc.doc.Doc[Any], package: ModuleType) -> tuple[list[Any], set[str]]:
    """Where names in ``d``'s docstring are looked up, and the member names of its class
    (pdoc also knows instance attributes assigned in ``__init__``)."""
    scopes: list[Any] = []
    members: set[str] = set()
    owner = d if isinstance(d, pdoc.doc.Class) else None
    if owner is None and "." in d.qualname:
        parent = d.qualname.rsplit(".", 1)[0]
        owner_obj = _lookup(importlib.import_module(d.modulename), parent.split("."))
        if owner_obj is not _MISSING and inspect.isclass(owner_obj):
            owner = pdoc.doc.Class(d.modulename, parent, owner_obj, d.taken_from)
    if owner is not None:
        scopes.append(owner.obj)
        members = set(owner.members)
    defined_in = getattr(d.obj, "__module__", None)
    for name in (defined_in, d.modulename):
        if isinstance(name, str) and name in sys.modules:
            scopes.append(sys.modules[name])
    scopes += [package, importlib.import_module("builtins")]
    return scopes, members


def _documented(module: pdoc.doc.Module) -> Iterator[pdoc.doc.Doc[Any]]:
    """The module and everything pdoc shows of it, class members included."""
    todo: list[pdoc.doc.Doc[Any]] = [module]
    while todo:
        d = todo.pop()
        yield d
        if isinstance(d, pdoc.doc.Namespace):
            todo += d.own_members


def broken_references(modules: Iterable[str] = MODULES) -> list[str]:
    """``module.member: `name``` for every single-backquoted name that resolves nowhere."""
    package = importlib.import_module("resumable")
    problems = []
    for name in modules:
        module = pdoc.doc.Module(importlib.import_module(name))
        for d in _documented(module):
            scopes, members = _scopes(d, package)
            for match in REFERENCE.finditer(d.docstring or ""):
                if not _resolves(match.group(1), scopes, members):
                    problems.append(f"{d.fullname}: `{match.group(1)}` names nothing")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/api"), help="output directory")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            pdoc.pdoc(*MODULES, output_directory=args.out)
            problems = broken_references()
        except Exception as exc:  # an import error, or a warning pdoc raised
            print(f"build_api: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    for line in problems:
        print(f"build_api: broken reference: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"API reference of {', '.join(MODULES)} in {args.out}/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
