"""Campaign 5, hostile inputs: fuzz every parser of checkpoint data.

A deterministic mutational fuzzer (`stress.mutate`) makes hostile variants of a valid
checkpoint's files (`stress.hostile_targets`) and feeds them to each parser:

- ``manifest-bytes``: `decode_manifest` on the valid manifest with byte-level damage;
- ``manifest-edits``: `decode_manifest` on the valid manifest with structural edits
  (values of other types, removed or added keys, duplicate keys, deep nesting, NaN),
  re-signed half of the time so that the checks behind the digest are reached;
- ``safetensors-header``: `parse_safetensors_header` on an edited header behind a length
  field that may lie, or damaged bytes, under a declared file size that may lie;
- ``reader`` and ``reader-local``: a whole checkpoint (an edited, re-signed manifest
  beside a data file with an edited header or overwritten bytes) through
  `CheckpointReader.verify`, in a `MemoryStorage` and on a local root;
- ``audit-log``: `read_audit`, then the report (`build_report`, `render_html`) that
  ``resumable report`` writes from it; ``run-id``: `read_run_id`;
- ``shm-slot``: a shared-memory snapshot slot with its control block and metadata
  edited (re-signed most of the time), adopted by a `MemoryTier` as a restore does,
  checked (`MemoryTier.verified`), its tree decoded, and listed as ``resumable shm``
  lists it;
- ``cli``: ``resumable`` command lines (`cli.main`) on a checkpoint root, with tokens
  replaced, inserted, dropped, swapped or damaged: paths with ``..``, outside the root,
  too long, with NUL bytes or undecodable; huge and negative numbers; options in the
  wrong places.

Each execution may raise a `CheckpointError` and nothing else (the CLI: return an exit
status; its own error handling is what is under test). Around each call, and only
there, an audit hook (`sys.addaudithook`) counts any event that runs code or loads a
module (pickle, exec, compile, import, process creation, ctypes) and any file opened
outside the target's roots; a watchdog (``SIGALRM``) interrupts a call after
`WATCHDOG_S`, and any execution slower than `HANG_S` counts as a hang.

Execution ``i`` of a target draws everything from ``random.Random(seed of (target, i))``,
so a failure is reproduced from its number alone (`reproduce`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from types import FrameType
from typing import Any

from resumable.errors import CheckpointError
from stress.hostile_targets import Sandbox, Target

# Events that mean code could run or a module was loaded (as tests/test_hostile.py).
FORBIDDEN = (
    "pickle.find_class",
    "exec",
    "compile",
    "code.__new__",
    "function.__new__",
    "marshal.loads",
    "import",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "subprocess.Popen",
    "ctypes.dlopen",
)
SIZES = {
    # `make test`'s: a smoke run of every target (`make stress` runs "full")
    "small": {
        "manifest-bytes": 1000,
        "manifest-edits": 250,
        "safetensors-header": 1000,
        "reader": 250,
        "reader-local": 150,
        "audit-log": 250,
        "run-id": 1000,
        "shm-slot": 250,
        "cli": 150,
    },
    # Weighted by cost (executions a second on two cores, in docs/reliability.md): the
    # byte-level targets take microseconds, a whole checkpoint or a command line a few
    # milliseconds.
    "full": {
        "manifest-bytes": 300_000,
        "manifest-edits": 100_000,
        "safetensors-header": 250_000,
        "reader": 100_000,
        "reader-local": 40_000,
        "audit-log": 50_000,
        "run-id": 100_000,
        "shm-slot": 50_000,
        "cli": 30_000,
    },
}
HANG_S = 2.0
"""An execution slower than this counts as a hang."""
WATCHDOG_S = 30.0
"""An execution still running after this is interrupted (and counted as a hang)."""
SEED = 5
WARM_UP = 50
"""Executions per target before the counted ones, unwatched: modules that the code under
test imports on first use (rich's emoji table, codecs) are loaded there, not counted as
imports of hostile input."""


class Hang(BaseException):
    """Raised by the watchdog inside a call that ran past `WATCHDOG_S` (a BaseException,
    so that no ``except Exception`` in the code under test swallows it)."""


class _Watch:
    """One process-wide audit hook (hooks cannot be removed), recording only while
    `watching` is on."""

    installed: _Watch | None = None

    def __init__(self) -> None:
        self.on = False
        self.roots: tuple[str, ...] = ()
        self.cwd = ""
        self.events: list[str] = []

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.on:
            return
        if any(event == n or event.startswith(n + ".") for n in FORBIDDEN):
            self.events.append(event)
        elif event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if not os.path.isabs(path):
                if self.cwd:
                    path = os.path.join(self.cwd, path)
                elif not self.roots or "/" in path or path in (".", ".."):
                    # Relative to a directory descriptor (``openat``; the event does not
                    # carry it): LocalStorage opens one name at a time from the root's.
                    self.events.append(f"open {path} (relative)")
                    return
                else:
                    return
            path = os.path.normpath(path)
            if not any(path == r or path.startswith(r + os.sep) for r in self.roots):
                self.events.append(f"open {path}")

    @classmethod
    def get(cls) -> _Watch:
        if cls.installed is None:
            cls.installed = _Watch()
            sys.addaudithook(cls.installed.hook)
        return cls.installed

    @contextlib.contextmanager
    def watching(self, roots: tuple[str, ...] = (), cwd: str = "") -> Iterator[list[str]]:
        self.events, self.roots, self.cwd, self.on = [], roots, cwd, True
        try:
            yield self.events
        finally:
            self.on = False


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang(f"still running after {WATCHDOG_S} s")


@contextlib.contextmanager
def _watchdog() -> Iterator[bool]:
    """The SIGALRM handler, while fuzzing (main thread only; elsewhere no watchdog and
    only the `HANG_S` measure)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _rng(name: str, i: int) -> random.Random:
    return random.Random((SEED << 64) ^ (zlib.crc32(name.encode()) << 32) ^ i)


def fuzz(name: str, target: Target, executions: int, *, start: int = 0) -> dict[str, Any]:
    """Run executions ``start .. start + executions`` of ``target``."""
    watch = _Watch.get()
    bad: list[str] = []
    kinds: dict[str, int] = {}
    slowest, slowest_i = 0.0, -1
    spent = 0.0
    with target.context(), _watchdog() as alarm:
        for i in range(start, start + executions):
            arg = target.make(_rng(name, i))
            roots = target.roots(arg)
            outcome, detail = "ok", ""
            events: list[str] = []
            t = time.perf_counter()
            try:
                if alarm:
                    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
                with watch.watching(roots, target.cwd) as events:
                    try:
                        said = target.call(arg)
                        if target.exit_status:
                            outcome = f"exit {said}"
                    except CheckpointError as exc:
                        outcome = type(exc).__name__
                    except Exception as exc:
                        outcome, detail = f"unclean {type(exc).__name__}", f"{exc}"[:300]
            except Hang as exc:
                outcome, detail = "hang", str(exc)
            finally:
                if alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            dt = time.perf_counter() - t
            spent += dt
            target.after(arg)
            if dt > slowest:
                slowest, slowest_i = dt, i
            if dt > HANG_S and outcome != "hang":
                outcome, detail = "hang", f"{dt:.1f} s"
            if events:
                outcome, detail = "audit events", f"{sorted(set(events))[:5]}"
            kinds[outcome] = kinds.get(outcome, 0) + 1
            if (outcome.startswith("unclean") or outcome in ("hang", "audit events")) and len(
                bad
            ) < 5:
                bad.append(f"{name} #{i}: {outcome}: {detail} for {target.show(arg)}")
    failures = sum(
        v for k, v in kinds.items() if k.startswith("unclean") or k in ("hang", "audit events")
    )
    return {
        "executions": executions,
        "failures": failures,
        "outcomes": dict(sorted(kinds.items())),
        "examples": bad,
        "slowest_s": round(slowest, 4),
        "slowest_execution": slowest_i,
        "call_seconds": round(spent, 1),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    logger = logging.getLogger("resumable")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def run(size: str, only: tuple[str, ...] = ()) -> dict[str, Any]:
    t0 = time.perf_counter()
    cfg = SIZES[size]
    out = {}
    with _quiet():
        box = Sandbox()
        try:
            targets = box.targets()
            _Watch.get()
            for name, target in targets.items():  # warm up: lazy imports happen here
                with target.context():
                    for i in range(WARM_UP):
                        arg = target.make(_rng(name, -1 - i))
                        with contextlib.suppress(Exception):
                            target.call(arg)
                        target.after(arg)
                    for arg in target.warm:
                        with contextlib.suppress(Exception):
                            target.call(arg)
                        target.after(arg)
            for name, target in targets.items():
                if only and name not in only:
                    continue
                t = time.perf_counter()
                r = fuzz(name, target, cfg[name])
                took = time.perf_counter() - t
                r["seconds"] = round(took, 1)
                r["executions_per_s"] = round(r["executions"] / took)
                out[name] = r
                logging.getLogger(__name__).info("%s: %s", name, r)
        finally:
            box.close()
    return {
        "trials": sum(r["executions"] for r in out.values()),
        "failures": sum(r["failures"] for r in out.values()),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "engine": "stress.mutate (seeded mutations of a valid checkpoint's files)",
            "seed": SEED,
            "hang_s": HANG_S,
            "watchdog_s": WATCHDOG_S,
            "targets": out,
            "forbidden_audit_events": list(FORBIDDEN),
        },
    }


def reproduce(name: str, i: int) -> Any:
    """Run execution ``i`` of target ``name`` again, unwatched; returns what it returned
    or raises what it raised."""
    with _quiet():
        box = Sandbox()
        try:
            target = box.targets()[name]
            with target.context():
                arg = target.make(_rng(name, i))
                print(target.show(arg), file=sys.stderr)
                return target.call(arg)
        finally:
            box.close()


def able_to_fail(executions: int = 300) -> dict[str, dict[str, int]]:
    """The checks on two broken parsers: a manifest reader that falls back to Python
    literals (``ast.literal_eval``: compiles what it reads) and the safetensors dtype
    check as it was before the fix (a dict or list as dtype raised TypeError)."""
    import ast
    import json

    from resumable.format import decode_manifest

    out = {}
    with _quiet():
        box = Sandbox()
        try:
            targets = box.targets()
            edits, header = targets["manifest-edits"], targets["safetensors-header"]

            def lenient(data: bytes) -> None:
                try:
                    decode_manifest(data, where="fuzz")
                except CheckpointError:
                    with contextlib.suppress(Exception):
                        ast.literal_eval(data.decode())
                    raise

            def old_dtype_check(arg: tuple[bytes, int]) -> None:
                raw, _ = arg
                n = int.from_bytes(raw[:8], "little")
                with contextlib.suppress(ValueError, RecursionError):
                    doc = json.loads(raw[8 : 8 + n])
                    for entry in doc.values() if isinstance(doc, dict) else ():
                        if isinstance(entry, dict):
                            _ = entry.get("dtype") in {"F32": 4}
                header.call(arg)

            for label, name, target in (
                (
                    "manifest parser that evaluates literals",
                    "manifest-edits",
                    Target(edits.make, lenient),
                ),
                (
                    "dtype checked before its type",
                    "safetensors-header",
                    Target(header.make, old_dtype_check),
                ),
            ):
                r = fuzz(name, target, executions)
                out[label] = {"trials": r["executions"], "failures": r["failures"]}
        finally:
            box.close()
    return out
