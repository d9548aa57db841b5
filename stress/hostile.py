"""Campaign 5, hostile inputs: fuzz every parser of checkpoint data with hypothesis.

Targets, each fed by hypothesis (``derandomize``d: every run draws the same examples):

- ``manifest-bytes``: `decode_manifest` on arbitrary bytes;
- ``manifest-edits``: `decode_manifest` on a valid manifest with one to three values
  replaced by arbitrary JSON (or removed), re-signed half of the time so that the
  checks behind the digest (types, sizes, byte ranges, tiling, the state tree) are
  reached;
- ``safetensors-header``: `parse_safetensors_header` on arbitrary bytes, and on a valid
  header with values replaced, under a declared file size that may lie;
- ``reader``: a whole checkpoint (a re-signed, edited manifest beside a data file with
  bytes overwritten) in a `MemoryStorage`, through `CheckpointReader.verify`: what a
  restore runs before it touches the live state (files, headers, checksums, tree
  decoding, random-stream states);
- ``reader-local``: the same on a local root (every read goes through the file system,
  so opens can be watched: an absolute path must lie in the root, a relative one must be
  one name, opened relative to a directory descriptor as LocalStorage does);
- ``audit-log`` and ``run-id``: `read_audit` and `read_run_id` on arbitrary bytes.

Each execution may raise a `CheckpointError` and nothing else. An audit hook
(`sys.addaudithook`) is active around each call (not around hypothesis's own work): any
event that would run code or load a module (pickle, exec, compile, import, process
creation, ctypes) and any file opened outside the checkpoint root count as failures.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from resumable.audit import read_audit
from resumable.commit import step_dir
from resumable.errors import CheckpointError
from resumable.format import decode_manifest, manifest_digest, parse_safetensors_header
from resumable.reader import CheckpointReader
from resumable.runid import RUN_ID_FILE, read_run_id
from resumable.storage.local import LocalStorage
from resumable.storage.memory import MemoryStorage
from stress.corruption import DATA, MANIFEST, NEWEST, saved_files

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
    "small": {
        "manifest-bytes": 100,
        "manifest-edits": 100,
        "safetensors-header": 150,
        "reader": 60,
        "reader-local": 30,
        "audit-log": 100,
        "run-id": 100,
    },
    "full": {
        "manifest-bytes": 100_000,
        "manifest-edits": 300_000,
        "safetensors-header": 300_000,
        "reader": 160_000,
        "reader-local": 40_000,
        "audit-log": 50_000,
        "run-id": 50_000,
    },
}
DELETE = object()


class _Watch:
    """One process-wide audit hook (hooks cannot be removed), recording only while
    `watching` is on."""

    installed: _Watch | None = None

    def __init__(self) -> None:
        self.on = False
        self.root = ""
        self.events: list[str] = []

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.on:
            return
        if any(event == n or event.startswith(n + ".") for n in FORBIDDEN):
            self.events.append(event)
        elif event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if not os.path.isabs(path):
                # Relative to a directory descriptor (``openat``; the event does not
                # carry it): LocalStorage opens one name at a time from the root's.
                if not self.root or "/" in path or path in (".", ".."):
                    self.events.append(f"open {path} (relative)")
            elif not self.root or not (path == self.root or path.startswith(self.root + os.sep)):
                self.events.append(f"open {path}")

    @classmethod
    def get(cls) -> _Watch:
        if cls.installed is None:
            cls.installed = _Watch()
            sys.addaudithook(cls.installed.hook)
        return cls.installed

    @contextlib.contextmanager
    def watching(self, root: str = "") -> Iterator[list[str]]:
        self.events, self.root, self.on = [], root, True
        try:
            yield self.events
        finally:
            self.on = False


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_edits = st.lists(
    st.tuples(st.integers(0, 1 << 30), _json | st.just(DELETE)), min_size=1, max_size=3
)


def _paths(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*path, i))
    return out


def edit(doc: Any, edits: list[tuple[int, Any]]) -> Any:
    """``doc`` with each edit applied: the value at path number ``i`` (of the paths of
    the document as it is then) replaced, or removed for `DELETE`."""
    for i, value in edits:
        paths = _paths(doc)
        if not paths:
            return doc
        path = paths[i % len(paths)]
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if value is DELETE:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    return doc


class Fuzz:
    """The valid checkpoint the structured targets start from, and the targets."""

    def __init__(self) -> None:
        files = saved_files()
        d = step_dir(NEWEST)
        self.manifest = json.loads(files[f"{d}/{MANIFEST}"])
        self.data = files[f"{d}/{DATA}"]
        n = int.from_bytes(self.data[:8], "little")
        self.header = json.loads(self.data[8 : 8 + n])
        self.tmp = tempfile.mkdtemp(prefix="hostile-")

    def _manifest_bytes(self, edits: list[tuple[int, Any]], resign: bool) -> bytes:
        doc = edit(json.loads(json.dumps(self.manifest)), edits)
        if resign and isinstance(doc, dict):
            with contextlib.suppress(Exception):  # what cannot be signed stays unsigned
                doc["digest"] = manifest_digest(doc)
        return json.dumps(doc).encode()

    def _data(self, writes: list[tuple[int, bytes]]) -> bytes:
        data = bytearray(self.data)
        for pos, chunk in writes:
            p = pos % len(data)
            data[p : p + len(chunk)] = chunk
        return bytes(data)

    def targets(self) -> dict[str, tuple[Any, Callable[..., Any], str]]:
        """name -> (strategy of the arguments, the call, the root its opens may touch)."""
        d = step_dir(NEWEST)
        local_root = os.path.join(self.tmp, "root")

        def manifest_bytes(data: bytes) -> None:
            decode_manifest(data, where="fuzz")

        def manifest_edits(edits: list[tuple[int, Any]], resign: bool) -> None:
            decode_manifest(self._manifest_bytes(edits, resign), where="fuzz")

        def header(raw: bytes | None, edits: list[tuple[int, Any]], size: int) -> None:
            if raw is None:
                body = json.dumps(edit(json.loads(json.dumps(self.header)), edits)).encode()
                raw = len(body).to_bytes(8, "little") + body
            parse_safetensors_header(raw, size)

        def reader_in(storage: Any, edits: list[tuple[int, Any]], writes: list[Any]) -> None:
            storage.write(f"{d}/{MANIFEST}", [self._manifest_bytes(edits, True)])
            storage.write(f"{d}/{DATA}", [self._data(writes)])
            CheckpointReader(storage, NEWEST).verify()

        def reader(edits: list[tuple[int, Any]], writes: list[Any]) -> None:
            reader_in(MemoryStorage("memory://fuzz"), edits, writes)

        def reader_local(edits: list[tuple[int, Any]], writes: list[Any]) -> None:
            reader_in(LocalStorage(local_root), edits, writes)

        def audit_log(data: bytes) -> None:
            storage = MemoryStorage("memory://fuzz")
            storage.write("audit.jsonl", [data])
            read_audit(storage)

        def run_id(data: bytes) -> None:
            storage = MemoryStorage("memory://fuzz")
            storage.write(RUN_ID_FILE, [data])
            read_run_id(storage)

        writes = st.lists(
            st.tuples(st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)), max_size=3
        )
        structured_edits = st.lists(
            st.tuples(st.integers(0, 1 << 30), _json | st.just(DELETE)), max_size=2
        )
        return {
            "manifest-bytes": (st.tuples(st.binary(max_size=4096)), manifest_bytes, ""),
            "manifest-edits": (st.tuples(_edits, st.booleans()), manifest_edits, ""),
            "safetensors-header": (
                st.tuples(
                    st.none() | st.binary(max_size=512),
                    _edits,
                    st.just(len(self.data)) | st.integers(0, 1 << 62),
                ),
                header,
                "",
            ),
            "reader": (st.tuples(structured_edits, writes), reader, ""),
            "reader-local": (st.tuples(structured_edits, writes), reader_local, local_root),
            "audit-log": (st.tuples(st.binary(max_size=2048)), audit_log, ""),
            "run-id": (st.tuples(st.binary(max_size=256)), run_id, ""),
        }


def fuzz(
    name: str,
    strategy: Any,
    call: Callable[..., Any],
    root: str,
    examples: int,
) -> dict[str, Any]:
    watch = _Watch.get()
    runs = [0]
    bad: list[str] = []
    kinds: dict[str, int] = {}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(args: tuple[Any, ...]) -> None:
        runs[0] += 1
        raised = "ok"
        with watch.watching(root) as events:
            try:
                call(*args)
            except CheckpointError as exc:
                raised = type(exc).__name__
            except Exception as exc:
                raised = f"unclean {type(exc).__name__}"
                if len(bad) < 5:
                    bad.append(f"{name}: {type(exc).__name__}: {exc} for {args!r:.300}")
        if events and len(bad) < 5:
            bad.append(f"{name}: audit events {events[:5]} for {args!r:.300}")
        key = "audit events" if events else raised
        kinds[key] = kinds.get(key, 0) + 1

    one()
    failures = sum(v for k, v in kinds.items() if k.startswith("unclean") or k == "audit events")
    return {"executions": runs[0], "failures": failures, "outcomes": kinds, "examples": bad}


def _unwatched(call: Callable[..., Any]) -> Callable[..., Any]:
    def unwatched(*args: Any) -> None:
        watch = _Watch.get()
        watch.on = False
        call(*args)

    return unwatched


def run(size: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    cfg = SIZES[size]
    logger = logging.getLogger("resumable")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        f = Fuzz()
        targets = f.targets()
        for name, (strategy, call, _root) in targets.items():
            fuzz(name, strategy, _unwatched(call), "", 5)  # warm up: lazy imports happen here
        out = {}
        for name, (strategy, call, root) in targets.items():
            t = time.perf_counter()
            out[name] = fuzz(name, strategy, call, root, cfg[name])
            out[name]["seconds"] = round(time.perf_counter() - t, 1)
    finally:
        logger.setLevel(level)
    return {
        "trials": sum(r["executions"] for r in out.values()),
        "failures": sum(r["failures"] for r in out.values()),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {"targets": out, "forbidden_audit_events": list(FORBIDDEN)},
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks on two broken parsers: a manifest reader that falls back to Python
    literals (``ast.literal_eval``: compiles what it reads) and the safetensors dtype
    check as it was before the fix (a dict as dtype raised TypeError)."""
    import ast

    f = Fuzz()
    targets = f.targets()

    def lenient(edits: list[tuple[int, Any]], resign: bool) -> None:
        data = f._manifest_bytes(edits, resign)
        try:
            decode_manifest(data, where="fuzz")
        except CheckpointError:
            with contextlib.suppress(Exception):
                ast.literal_eval(data.decode())
            raise

    header_strategy, header_call, _ = targets["safetensors-header"]

    def old_dtype_check(raw: bytes | None, edits: list[tuple[int, Any]], size: int) -> None:
        doc = edit(json.loads(json.dumps(f.header)), edits)
        if isinstance(doc, dict):
            for entry in doc.values():
                if isinstance(entry, dict):
                    _ = entry.get("dtype") in {"F32": 4}
        header_call(raw, edits, size)

    out = {}
    for name, strategy, call in (
        ("manifest parser that evaluates literals", targets["manifest-edits"][0], lenient),
        ("dtype checked before its type", header_strategy, old_dtype_check),
    ):
        r = fuzz(name, strategy, call, "", 150)
        out[name] = {"trials": r["executions"], "failures": r["failures"]}
    return out
