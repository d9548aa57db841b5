"""Torch and NumPy, imported at their first use by the modules the persist worker shares.

The persist worker writes bytes from shared memory to storage: it needs no tensor, and
importing torch cost it about 1.3 s of CPU at every launch, which a launch's first saves
waited for (issue 48). The modules it shares with the trainer (the format, the reader,
the snapshot arena, the pieces) name ``torch`` through `torch_module`: in a process
that has imported torch already (every trainer) it is torch itself; elsewhere it is a
stand-in that imports torch at its first attribute, so a path that needs a tensor still
gets one. ``tests/test_worker_imports.py`` checks that a worker persists, mirrors and
exits without loading torch.

NumPy likewise (`numpy_module`): its import, and the BLAS threads it starts, were the
largest part of the worker's start-up CPU once torch was gone, taken from training on
the cores they share; the worker uses it only to check a manifest with long extents
lists or to write with ``O_DIRECT``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _OnFirstUse(types.ModuleType):
    """A module's stand-in that imports it at its first attribute."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self.__name__), attr)


def torch_module() -> Any:
    """``torch`` if loaded, else a stand-in that loads it when first used (also while
    another thread is still importing it: the stand-in's import waits for that one)."""
    loaded = sys.modules.get("torch")
    if loaded is not None and not getattr(loaded.__spec__, "_initializing", False):
        return loaded
    return _OnFirstUse("torch")


def numpy_module() -> Any:
    """``numpy`` if loaded, else a stand-in that loads it when first used (`torch_module`)."""
    loaded = sys.modules.get("numpy")
    if loaded is not None and not getattr(loaded.__spec__, "_initializing", False):
        return loaded
    return _OnFirstUse("numpy")
