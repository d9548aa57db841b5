"""Methods of the library timed where they run, for the benchmarks that say where a
call's time goes (`small_bench.loop_parts`, `dist_worker`'s layers of a background
save): each named method is wrapped, on its class, by a timer, for a ``with`` block."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

Part = tuple[str, type, str]  # (name, class, method)


@contextlib.contextmanager
def timing_parts(into: dict[str, list[float]], parts: Sequence[Part]) -> Iterator[None]:
    """Each method of ``parts`` wrapped, on its class, by a timer that appends its
    seconds to ``into[name]`` at every call; put back on exit (also when the block
    raises, or a method is not found)."""
    saved: list[tuple[type, str, Any]] = []

    def timed(fn: Callable[..., Any], samples: list[float]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - t0)

        return run

    try:
        for name, cls, attr in parts:
            fn = cls.__dict__[attr]
            saved.append((cls, attr, fn))
            setattr(cls, attr, timed(fn, into.setdefault(name, [])))
        yield
    finally:
        for cls, attr, fn in reversed(saved):
            setattr(cls, attr, fn)
