"""Hostile checkpoints are refused: nothing executed, nothing outside the root touched.

Each test plants a hand-crafted checkpoint at step 9, newer than the valid steps 1-3 of
a `saved_root`. Manifests are re-signed with `manifest_digest`, as an attacker would, so
that the digest check passes and the *other* defences are exercised. Restore must skip
the planted checkpoint (WARNING + ``skip`` audit event) and load step 3, or raise a
project error; an audit hook (`sys.addaudithook`) watches for code execution and for
files opened outside the root while it runs, and the files outside the root are
compared before and after.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import resumable
from resumable import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    Keep,
    StateMismatchError,
)
from resumable.audit import read_audit
from resumable.format import manifest_digest
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, MemoryStorage, open_storage

pytestmark = pytest.mark.usefixtures("sync_persist")

HOSTILE, VALID = 9, 3
DATA = "rank-00000.safetensors"
LOGGER = "resumable"
# Audit events that mean code from the checkpoint could run (or a module got loaded).
FORBIDDEN_EVENTS = (
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


def dir_name(step: int) -> str:
    return f"step-{step:012d}"


class _SystemPayload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _ExecPayload:
    """Unpickling this executes Python source that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def safetensors_blob(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A valid safetensors file: ``{name: (dtype, shape, raw bytes)}``."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data, offset = b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body + data


def files_outside(tmp_path: Path, root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``tmp_path`` but outside ``root``: size and sha256 (symlinks
    are recorded by target, not followed)."""
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        here = Path(dirpath)
        if here == root or root in here.parents:
            dirnames[:] = []
            continue
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            p = here / name
            if p.is_symlink():
                out[str(p)] = (-1, os.readlink(p))
            else:
                out[str(p)] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@contextlib.contextmanager
def resolved_opens() -> Iterator[list[str]]:
    """The absolute path of every ``os.open`` made inside, ``dir_fd``-relative names
    resolved through ``/proc/self/fd`` (an ``open`` audit event carries no ``dir_fd``,
    and the local backend opens everything relative to directory descriptors)."""
    real_open = os.open
    seen: list[str] = []

    def recording_open(
        path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
    ) -> int:
        base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
        seen.append(os.path.join(base, os.fsdecode(path)))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    with mock.patch.object(os, "open", recording_open):
        yield seen


# --------------------------------------------------------------------------- the planter


class Planter:
    """Plants hostile checkpoints into a saved root and restores with guards."""

    def __init__(
        self,
        saved: Any,
        tmp_path: Path,
        make_state: Callable[..., Any],
        recorder: Any,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        self.saved = saved
        self.root: Path = saved.path
        self.tmp_path = tmp_path
        self.make_state = make_state
        self.recorder = recorder
        self.caplog = caplog
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        self.marker = tmp_path / "pwned-marker"
        self.valid_data = saved.data_file(VALID).read_bytes()
        # Decoys: a perfectly valid data file and manifest outside the root, so that a
        # loader following a hostile path would "succeed" and the test would see it.
        shutil.copy(saved.data_file(VALID), tmp_path / "outside.safetensors")
        shutil.copy(saved.data_file(VALID), self.outside / DATA)

    @property
    def dir(self) -> Path:
        return self.root / dir_name(HOSTILE)

    def manifest(self) -> dict[str, Any]:
        """The valid manifest of step 3, renumbered to the hostile step and re-signed."""
        m = json.loads(self.saved.manifest_file(VALID).read_bytes())
        m["step"] = HOSTILE
        return self.sign(m)

    @staticmethod
    def sign(m: dict[str, Any]) -> dict[str, Any]:
        m["digest"] = manifest_digest(m)
        return m

    def plant(
        self,
        manifest: dict[str, Any] | bytes,
        files: dict[str, bytes] | None = None,
        *,
        resign: bool = True,
    ) -> None:
        """Write ``files`` (default: a valid data file) and the manifest into step 9."""
        self.dir.mkdir(exist_ok=True)
        for name, content in (files if files is not None else {DATA: self.valid_data}).items():
            (self.dir / name).write_bytes(content)
        if isinstance(manifest, dict):
            if resign:
                self.sign(manifest)
            manifest = json.dumps(manifest).encode()
        (self.dir / "manifest.json").write_bytes(manifest)

    def set_tree_entry(self, m: dict[str, Any], key: str, node: Any) -> dict[str, Any]:
        for pair in m["ranks"][0]["tree"]["dict"]:
            if pair[0] == key:
                pair[1] = node
        return self.sign(m)

    def verify_refuses(self) -> None:
        with pytest.raises(CorruptCheckpointError):
            CheckpointReader(open_storage(self.root), HOSTILE).verify()

    def restore(self, storage: Any = None) -> tuple[int | BaseException, Any]:
        """Restore into a fresh state while recording audit events; returns the restored
        step (or the project error raised) and the state. Asserts the guards."""
        ts = self.make_state(seed=7, steps=0)
        before = files_outside(self.tmp_path, self.root)
        outcome: int | BaseException
        with (
            self.caplog.at_level(logging.WARNING, logger=LOGGER),
            Checkpointer(storage or self.root, ts.state, keep=None, persist="sync") as ckpt,
            self.recorder.recording(),
            resolved_opens() as fd_opens,
        ):
            try:
                outcome = ckpt.restore()
            except CheckpointError as exc:
                outcome = exc
        assert self.recorder.named(*FORBIDDEN_EVENTS) == []
        real_root = os.path.realpath(self.root)
        audited = [
            os.fsdecode(a[0])
            for _, a in self.recorder.named("open")
            if a and isinstance(a[0], (str, bytes, os.PathLike)) and os.path.isabs(a[0])
        ]
        outside_opens = [
            p for p in audited + fd_opens if p != real_root and not p.startswith(real_root + os.sep)
        ]
        assert outside_opens == []
        assert not self.marker.exists()
        assert files_outside(self.tmp_path, self.root) == before
        return outcome, ts

    def restore_falls_back(self, storage: Any = None) -> None:
        """The planted checkpoint is skipped, loudly, and step 3 is loaded."""
        logged = len(read_audit(open_storage(self.root)))
        outcome, ts = self.restore(storage)
        assert outcome == VALID, outcome
        assert ts.mismatches(self.saved.expected[VALID]) == []
        assert any(
            dir_name(HOSTILE) in r.getMessage()
            for r in self.caplog.records
            if r.name.partition(".")[0] == LOGGER and r.levelno == logging.WARNING
        ), self.caplog.text
        new = read_audit(open_storage(self.root))[logged:]
        skips = [e["step"] for e in new if e["event"] == "skip"]
        assert skips == [HOSTILE]


@pytest.fixture(scope="module", autouse=True)
def warm_up(
    tmp_path_factory: pytest.TempPathFactory,
    make_saved_root: Callable[..., Any],
    small_training_state: Callable[..., Any],
) -> None:
    """One ordinary restore and verify first, so lazy imports of torch and the library
    happen before any test records audit events."""
    saved = make_saved_root(tmp_path_factory.mktemp("warm") / "ckpt", steps=(1,))
    ts = small_training_state(seed=7, steps=0)
    with Checkpointer(saved.path, ts.state, keep=None, persist="sync") as ckpt:
        assert ckpt.restore() == 1
    CheckpointReader(open_storage(saved.path), 1).verify()


@pytest.fixture
def planter(
    saved_root: Any,
    tmp_path: Path,
    small_training_state: Callable[..., Any],
    audit_events: Any,
    caplog: pytest.LogCaptureFixture,
) -> Iterator[Planter]:
    yield Planter(saved_root, tmp_path, small_training_state, audit_events, caplog)


# --------------------------------------------------------------------------- (a) pickle


def _pickle_blob(marker: Path) -> bytes:
    return pickle.dumps({"weight": _SystemPayload(marker), "bias": _ExecPayload(marker)})


def _torch_save_blob(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"weight": _SystemPayload(marker)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("fname", [DATA, "model.pt", "data.pkl"])
@pytest.mark.parametrize("make_blob", [_pickle_blob, _torch_save_blob], ids=["pickle", "torch"])
def test_pickle_data_file_is_refused_unread(
    planter: Planter, fname: str, make_blob: Callable[[Path], bytes]
) -> None:
    """A data file holding a pickle (with a matching size and checksum in the manifest)
    is not a safetensors file: refused before any byte is interpreted."""
    from resumable.format import checksum

    blob = make_blob(planter.marker)
    m = planter.manifest()
    m["files"] = {fname: {"size": len(blob), "rank": 0}}
    m["tensors"] = {
        "model/0.weight": {
            "file": fname,
            "dtype": "U8",
            "shape": [len(blob)],
            "offsets": [0, len(blob)],
            "xxh3_64": checksum(blob),
        }
    }
    m["ranks"][0]["tree"] = {"dict": [["model", {"stateful": {"tensor": "model/0.weight"}}]]}
    planter.plant(m, {fname: blob})
    planter.verify_refuses()
    planter.restore_falls_back()


HOSTILE_NODES: dict[str, Any] = {
    "class-in-stateful": {"stateful": {"__class__": "os.system", "args": ["touch x"]}},
    "pickle-node": {"pickle": "gASVIAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAV0b3VjaJSFlFKULg=="},
    "reduce-node": {"reduce": ["os", "system", ["touch x"]]},
    "class-node": {"class": "subprocess.Popen", "args": [["touch", "x"]]},
    "object-npscalar": {"npscalar": "O", "v": "os.system"},
    "void-npscalar": {"npscalar": "V", "v": 10**11},
    "bytes-npscalar-from-int": {"npscalar": "S", "v": 10**11},
    "overflowing-npscalar": {"npscalar": "<i4", "v": 10**30},
    "lazy-module-as-dtype": {"dtype": "_inductor"},
    "function-as-dtype": {"dtype": "load"},
    "deprecated-attr-as-dtype": {"dtype": "has_cuda"},
    "dunder-as-dtype": {"dtype": "__builtins__"},
    "garbage-size": {"size": ["__import__('os').system('x')"]},
    "bool-size": {"size": [True]},
    "unknown-tag": {"callable": "builtins.eval"},
    "too-many-keys": {"dict": [], "list": [], "tuple": [], "x": 1},
    "dangling-tensor": {"tensor": "not/in/the/index"},
}
_deep: Any = {"callable": "builtins.eval"}
for _ in range(300):
    _deep = {"list": [{"stateful": _deep}]}
HOSTILE_NODES["deep-nesting"] = _deep


@pytest.mark.parametrize("node", list(HOSTILE_NODES))
def test_hostile_tree_node_is_refused(planter: Planter, node: str) -> None:
    m = planter.set_tree_entry(planter.manifest(), "model", HOSTILE_NODES[node])
    planter.plant(m)
    planter.verify_refuses()
    planter.restore_falls_back()


@pytest.mark.parametrize(
    "node",
    [
        {"stateful": {"dict": [["__reduce__", "os.system"], ["__class__", "subprocess.Popen"]]}},
        {"stateful": {"bytes": base64.b64encode(b"\x80\x04cos\nsystem\n.").decode()}},
        {"stateful": {"dict": [["0.weight", {"bytes": "Y29zCnN5c3RlbQou"}]]}},
    ],
    ids=["class-names-as-keys", "pickle-as-bytes", "pickle-bytes-as-weight"],
)
def test_well_formed_but_unfitting_tree_is_a_state_mismatch(
    planter: Planter, node: dict[str, Any]
) -> None:
    """Names of classes or pickle bytes are only data: they reach ``load_state_dict`` as
    strings and bytes, which refuses them; nothing is executed."""
    planter.plant(planter.set_tree_entry(planter.manifest(), "model", node))
    outcome, _ = planter.restore()
    assert isinstance(outcome, StateMismatchError), outcome


def test_pickle_bytes_in_a_tensor_stay_inert_data(
    tmp_path: Path, audit_events: Any, small_training_state: Callable[..., Any]
) -> None:
    """A valid checkpoint whose tensor holds pickle bytes loads those bytes, as bytes."""
    marker = tmp_path / "pwned-marker"
    blob = _pickle_blob(marker) + _torch_save_blob(marker)
    root = tmp_path / "ckpt"
    with Checkpointer(
        root, {"blob": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}, persist="sync"
    ) as ckpt:
        ckpt.save(1)
    live = {"blob": torch.zeros(len(blob), dtype=torch.uint8)}
    with Checkpointer(root, live, persist="sync") as ckpt, audit_events.recording():
        assert ckpt.restore() == 1
    assert bytes(live["blob"].numpy()) == blob
    assert audit_events.named(*FORBIDDEN_EVENTS) == []
    assert not marker.exists()


def test_tree_names_never_reach_torch_attributes(
    planter: Planter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.has_cuda`` (a deprecated attribute) calls a function when looked up: a
    ``dtype`` node naming it must be refused without the lookup."""
    deprecated = getattr(torch, "_deprecated_attrs", None)
    if not isinstance(deprecated, dict) or "has_cuda" not in deprecated:
        pytest.skip("this torch has no deprecated attribute that runs code on lookup")
    called: list[str] = []
    monkeypatch.setitem(deprecated, "has_cuda", lambda: called.append("has_cuda"))
    planter.plant(planter.set_tree_entry(planter.manifest(), "model", {"dtype": "has_cuda"}))
    planter.verify_refuses()
    planter.restore_falls_back()
    assert called == []


# --------------------------------------------------------------------------- (b) paths

BAD_NAMES = [
    "../../outside.safetensors",
    "../step-000000000003/rank-00000.safetensors",
    "/etc/passwd",
    "<ABSOLUTE-DECOY>",
    "a\\b",
    "..\\..\\outside.safetensors",
    "step/../../x",
    "./rank-00000.safetensors",
    "rank-00000.safetensors/",
    "rank-00000.safetensors\n",
    "",
    ".",
    "..",
    "~/outside.safetensors",
    "file:///etc/passwd",
    "C:\\Windows\\win.ini",
    "rank-00000.safetensors\x00.txt",
    "\u2024\u2024/outside.safetensors",  # one-dot leaders that look like ".."
    "x" * 5000,
    "a/" * 600 + "b",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:40] for n in BAD_NAMES])
def test_file_names_escaping_the_root_are_refused(planter: Planter, name: str) -> None:
    if name == "<ABSOLUTE-DECOY>":
        name = str(planter.tmp_path / "outside.safetensors")
    m = planter.manifest()
    (entry,) = m["files"].values()
    m["files"] = {name: entry}
    for info in m["tensors"].values():
        info["file"] = name
    planter.plant(m)
    planter.verify_refuses()
    planter.restore_falls_back()


def test_tensor_naming_an_unlisted_file_is_refused(planter: Planter) -> None:
    m = planter.manifest()
    next(iter(m["tensors"].values()))["file"] = "../../outside.safetensors"
    planter.plant(m)
    planter.verify_refuses()
    planter.restore_falls_back()


# --------------------------------------------------------------------------- (c) symlinks


def test_symlinked_data_file_pointing_outside_is_refused(planter: Planter) -> None:
    planter.plant(planter.manifest(), {})
    (planter.dir / DATA).symlink_to(planter.outside / DATA)
    planter.verify_refuses()
    planter.restore_falls_back()


def test_symlinked_manifest_pointing_outside_is_refused(planter: Planter) -> None:
    (planter.outside / "manifest.json").write_text(json.dumps(planter.manifest()))
    planter.plant(planter.manifest())
    (planter.dir / "manifest.json").unlink()
    (planter.dir / "manifest.json").symlink_to(planter.outside / "manifest.json")
    planter.verify_refuses()
    planter.restore_falls_back()


def test_symlinked_step_directory_pointing_outside_is_refused(planter: Planter) -> None:
    """A complete, valid checkpoint outside the root, linked in as the newest step."""
    (planter.outside / "manifest.json").write_text(json.dumps(planter.manifest()))
    planter.dir.symlink_to(planter.outside, target_is_directory=True)
    planter.verify_refuses()
    planter.restore_falls_back()


def test_symlinked_audit_log_is_not_written_through(
    planter: Planter, small_training_state: Callable[..., Any]
) -> None:
    outside_log = planter.outside / "victim.txt"
    outside_log.write_text("keep me\n")
    (planter.root / "audit.jsonl").unlink()
    (planter.root / "audit.jsonl").symlink_to(outside_log)
    outcome, ts = planter.restore()  # files outside the root compared inside
    assert outcome == VALID
    assert ts.mismatches(planter.saved.expected[VALID]) == []
    assert outside_log.read_text() == "keep me\n"


# --------------------------------------------------------------------------- (d) sizes


class RecordingStorage(LocalStorage):
    """Local storage that remembers the length of every read it was asked for."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int]] = []

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.reads.append((path, length))
        return super().read_range(path, offset, length)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.reads.append((path, len(out)))
        super().read_into(path, offset, out)


def _first(m: dict[str, Any]) -> dict[str, Any]:
    return m["tensors"]["model/0.weight"]  # F32 [8, 4]


def _huge_shape(m: dict[str, Any]) -> None:
    t = _first(m)
    t["shape"] = [10**6, 10**6]
    t["dtype"] = "U8"
    t["offsets"] = [t["offsets"][0], t["offsets"][0] + 10**12]
    for f in m["files"].values():
        f["size"] = 2 * 10**12


def _huge_shape_small_file(m: dict[str, Any]) -> None:
    t = _first(m)
    t["shape"] = [10**6, 10**6]
    t["offsets"] = [t["offsets"][0], t["offsets"][0] + 4 * 10**12]


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: _first(m).__setitem__(key, value)


def _file_size(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        for f in m["files"].values():
            f["size"] = value

    return edit


ABSURD: dict[str, Callable[[dict[str, Any]], None]] = {
    "shape-1e12-elements": _huge_shape,
    "shape-1e12-elements-small-file": _huge_shape_small_file,
    "shape-googol": _set("shape", [10**100, 0]),
    "shape-negative": _set("shape", [-8, -4]),
    "shape-65-dims": _set("shape", [1] * 65),
    "shape-float": _set("shape", [8.0, 4]),
    "shape-not-a-list": _set("shape", "8x4"),
    "offsets-beyond-file": lambda m: _first(m).__setitem__(
        "offsets", [o + 10**9 for o in _first(m)["offsets"]]
    ),
    "offsets-negative": lambda m: _first(m).__setitem__("offsets", [-128, 0]),
    "offsets-reversed": lambda m: _first(m).__setitem__("offsets", _first(m)["offsets"][::-1]),
    "offsets-three": lambda m: _first(m).__setitem__("offsets", [*_first(m)["offsets"], 0]),
    "offsets-huge": _set("offsets", [2**64, 2**64 + 128]),
    "file-size-2**80": _file_size(2**80),
    "file-size-negative": _file_size(-1),
    "file-size-string": _file_size("9704"),
    "world-of-tensors": lambda m: m["tensors"].update(
        {f"t{i}": dict(_first(m), offsets=[10**12, 10**12 + 128]) for i in range(1000)}
    ),
}


@pytest.mark.parametrize("edit", list(ABSURD))
def test_absurd_sizes_and_offsets_are_refused(planter: Planter, edit: str) -> None:
    m = planter.manifest()
    ABSURD[edit](m)
    planter.plant(m)
    planter.verify_refuses()
    storage = RecordingStorage(planter.root)
    planter.restore_falls_back(storage)
    assert max(n for _, n in storage.reads) < 1 << 20


@pytest.mark.parametrize("prefix", [2**63, 2**64 - 1, 2**32, 0, 7, 9])
def test_absurd_safetensors_header_length_is_refused(planter: Planter, prefix: int) -> None:
    data = prefix.to_bytes(8, "little") + planter.valid_data[8:]
    planter.plant(planter.manifest(), {DATA: data})
    planter.verify_refuses()
    storage = RecordingStorage(planter.root)
    planter.restore_falls_back(storage)
    assert max(n for _, n in storage.reads) < 1 << 20


def _rewrite_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body + data[8 + n :]


def _header_entry(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h["model/0.weight"].__setitem__(key, value)


HEADER_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "offsets-int": _header_entry("data_offsets", 5),
    "offsets-string": _header_entry("data_offsets", "ab"),
    "offsets-nulls": _header_entry("data_offsets", [None, None]),
    "offsets-floats": _header_entry("data_offsets", [0.0, 128.0]),
    "offsets-one": _header_entry("data_offsets", [0]),
    "offsets-missing": lambda h: h["model/0.weight"].pop("data_offsets"),
    "entry-not-a-dict": lambda h: h.__setitem__("model/0.weight", [1, 2]),
    "entry-missing": lambda h: h.pop("model/0.weight"),
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS))
def test_malformed_safetensors_header_is_refused(planter: Planter, edit: str) -> None:
    data = _rewrite_header(planter.valid_data, HEADER_EDITS[edit])
    m = planter.manifest()
    shift = len(data) - len(planter.valid_data)
    for f in m["files"].values():
        f["size"] = len(data)
    for t in m["tensors"].values():
        t["offsets"] = [o + shift for o in t["offsets"]]
    planter.plant(m, {DATA: data})
    planter.verify_refuses()
    planter.restore_falls_back()


@pytest.mark.parametrize("body", [b"[]", b'"x"', b"null", b"1", b"{", b"\xff\xfe"])
def test_safetensors_header_that_is_not_an_object_is_refused(planter: Planter, body: bytes) -> None:
    body += b" " * (-len(body) % 8)
    data = len(body).to_bytes(8, "little") + body + planter.valid_data
    m = planter.manifest()
    for f in m["files"].values():
        f["size"] = len(data)
    planter.plant(m, {DATA: data})
    planter.verify_refuses()
    planter.restore_falls_back()


def test_huge_safetensors_header_is_refused_before_reading_it(planter: Planter) -> None:
    """A 200 MB (sparse) data file claiming a 150 MB header: refused from the length
    prefix alone, without reading (or allocating) the claimed header."""
    size = 200 << 20
    header_len = 150 << 20
    m = planter.manifest()
    for f in m["files"].values():
        f["size"] = size
    planter.plant(m, {})
    with open(planter.dir / DATA, "wb") as f:
        f.write(header_len.to_bytes(8, "little") + b"{")
        f.truncate(size)
    planter.verify_refuses()
    storage = RecordingStorage(planter.root)
    planter.restore_falls_back(storage)
    assert max(n for _, n in storage.reads) < 1 << 20


def test_huge_manifest_is_refused_before_reading_it(planter: Planter) -> None:
    """A 300 MB (sparse) manifest: refused from its size, without reading it."""
    planter.plant(b"{")
    with open(planter.dir / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)
    planter.verify_refuses()
    storage = RecordingStorage(planter.root)
    planter.restore_falls_back(storage)
    assert max(n for _, n in storage.reads) < 1 << 20


# --------------------------------------------------------------------------- (e) types

BAD_DTYPES: list[Any] = [
    "F128",
    "float32",
    "f4",
    "<f4",
    "O",
    "f32",
    "F32 ",
    "",
    None,
    5,
    True,
    ["F32"],
    {"F32": 1},
    "__class__",
    "C64",
]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=[repr(d) for d in BAD_DTYPES])
def test_unknown_tensor_dtype_is_refused(planter: Planter, dtype: Any) -> None:
    m = planter.manifest()
    _first(m)["dtype"] = dtype
    planter.plant(m)
    planter.verify_refuses()
    planter.restore_falls_back()


def test_header_dtype_disagreeing_with_manifest_is_refused(planter: Planter) -> None:
    """Same byte count, other dtype (F32 -> I32) in both manifest and checksum: only the
    safetensors header still says F32."""
    m = planter.manifest()
    _first(m)["dtype"] = "I32"
    planter.plant(m)
    planter.verify_refuses()
    planter.restore_falls_back()


BAD_KEYS: list[Any] = [1.5, None, True, False, ["a"], {"a": 1}]


@pytest.mark.parametrize("key", BAD_KEYS, ids=[repr(k) for k in BAD_KEYS])
def test_non_string_tree_keys_are_refused(planter: Planter, key: Any) -> None:
    node = {"stateful": {"dict": [[key, {"tensor": "model/0.weight", "device": "cpu"}]]}}
    planter.plant(planter.set_tree_entry(planter.manifest(), "model", node))
    planter.verify_refuses()
    planter.restore_falls_back()


BOOL_CONFUSION: dict[str, Callable[[dict[str, Any]], None]] = {
    "format_version-true": lambda m: m.__setitem__("format_version", True),
    "format_version-float": lambda m: m.__setitem__("format_version", 1.0),
    "step-float": lambda m: m.__setitem__("step", float(HOSTILE)),
    "file-size-true": _file_size(True),
    "shape-bools": _set("shape", [True, 32]),
    "offsets-bools": lambda m: _first(m).__setitem__("offsets", [False, True]),
    "ranks-not-a-list": lambda m: m.__setitem__("ranks", {"0": m["ranks"][0]}),
    "ranks-empty": lambda m: m.__setitem__("ranks", []),
    "files-a-list": lambda m: m.__setitem__("files", [DATA]),
    "tensors-a-list": lambda m: m.__setitem__("tensors", list(m["tensors"].values())),
    "metrics-a-list": lambda m: m.__setitem__("metrics", [1, 2]),
    "tree-an-int": lambda m: m["ranks"][0].__setitem__("tree", 5),
    "tree-a-list-node": lambda m: m["ranks"][0].__setitem__("tree", {"list": []}),
}


@pytest.mark.parametrize("edit", list(BOOL_CONFUSION))
def test_wrong_json_types_are_refused(planter: Planter, edit: str) -> None:
    m = planter.manifest()
    BOOL_CONFUSION[edit](m)
    planter.plant(m)
    planter.verify_refuses()
    planter.restore_falls_back()


def test_step_true_is_not_step_one(saved_root: Any, small_training_state: Callable[..., Any]):
    """``true == 1`` in Python: a manifest of step-000000000001 saying ``"step": true``
    must still be refused."""
    m = json.loads(saved_root.manifest_file(1).read_bytes())
    m["step"] = True
    m["digest"] = manifest_digest(m)
    saved_root.manifest_file(1).write_text(json.dumps(m))
    ts = small_training_state(seed=7, steps=0)
    with (
        Checkpointer(saved_root.path, ts.state, keep=None, persist="sync") as ckpt,
        pytest.raises(CorruptCheckpointError),
    ):
        ckpt.restore(step=1)


def test_hostile_rng_entry_is_refused_before_touching_state(planter: Planter) -> None:
    """A malformed random-generator entry is found before any live object is loaded,
    and the process's random streams stay as they were."""
    node = {"dict": [["python", {"tuple": [3, {"tuple": [1, 2]}, None]}]]}
    planter.plant(planter.set_tree_entry(planter.manifest(), "__rng__", node))
    ts = planter.make_state(seed=7, steps=1)
    before = ts.tensors()
    py_rng, torch_rng = random.getstate(), torch.get_rng_state()
    with (
        Checkpointer(planter.root, ts.state, keep=None, persist="sync") as ckpt,
        pytest.raises(CorruptCheckpointError, match="RNG"),
    ):
        ckpt.restore(step=HOSTILE)
    assert ts.mismatches(before) == []
    assert random.getstate() == py_rng
    assert torch.equal(torch.get_rng_state(), torch_rng)
    planter.restore_falls_back()


# --------------------------------------------------------------------------- (f) writes


def _victim_dir(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "precious.txt").write_text("precious")
    (victim / "sub" / "more.txt").write_text("more")
    return victim


@pytest.mark.parametrize("kind", ["tmp", "trash"])
def test_stale_symlink_to_outside_is_not_followed_by_cleanup(
    saved_root: Any,
    tmp_path: Path,
    small_training_state: Callable[..., Any],
    dead_pid: int,
    kind: str,
) -> None:
    victim = _victim_dir(tmp_path)
    (saved_root.path / f".{kind}-{dir_name(HOSTILE)}.{dead_pid}.0badc0de").symlink_to(victim)
    before = files_outside(tmp_path, saved_root.path)
    ts = small_training_state(seed=7, steps=0)
    with Checkpointer(saved_root.path, ts.state, keep=None, persist="sync") as ckpt:
        assert ckpt.restore() == VALID
    assert files_outside(tmp_path, saved_root.path) == before


def test_stale_directory_holding_symlinks_out_is_removed_without_following_them(
    saved_root: Any, tmp_path: Path, small_training_state: Callable[..., Any], dead_pid: int
) -> None:
    victim = _victim_dir(tmp_path)
    stale = saved_root.path / f".tmp-{dir_name(HOSTILE)}.{dead_pid}.0badc0de"
    stale.mkdir()
    (stale / DATA).symlink_to(victim / "precious.txt")
    (stale / "sub").symlink_to(victim / "sub", target_is_directory=True)
    before = files_outside(tmp_path, saved_root.path)
    ts = small_training_state(seed=7, steps=0)
    with Checkpointer(saved_root.path, ts.state, keep=None, persist="sync"):
        pass
    assert not os.path.lexists(stale)
    assert files_outside(tmp_path, saved_root.path) == before


def test_retention_never_deletes_through_a_symlinked_step(
    saved_root: Any, tmp_path: Path, small_training_state: Callable[..., Any]
) -> None:
    """Retention keeping only the newest checkpoint must not delete a linked-in step
    directory's target outside the root."""
    victim = _victim_dir(tmp_path)
    shutil.copy(saved_root.manifest_file(1), victim / "manifest.json")
    shutil.copy(saved_root.data_file(1), victim / DATA)
    (saved_root.path / dir_name(0)).symlink_to(victim, target_is_directory=True)
    before = files_outside(tmp_path, saved_root.path)
    ts = small_training_state(seed=7, steps=1)
    with Checkpointer(saved_root.path, ts.state, keep=Keep(last=1), persist="sync") as ckpt:
        ckpt.save(10)
        ckpt.wait()
    assert files_outside(tmp_path, saved_root.path) == before
    assert (saved_root.path / dir_name(10) / "manifest.json").exists()
    assert not saved_root.step_dir(1).exists()  # retention did run


# --------------------------------------------------------------------------- (g) malformed


def _sched_entry(m: dict[str, Any], key: str, node: Any) -> None:
    """Add ``key: node`` to the scheduler's state dict: ``StepLR.load_state_dict`` takes
    any key, so whatever decodes there reaches the live state."""
    for pair in m["ranks"][0]["tree"]["dict"]:
        if pair[0] == "sched":
            pair[1]["stateful"]["dict"].append([key, node])


def _rng_entry(m: dict[str, Any], key: str, node: Any) -> None:
    for pair in m["ranks"][0]["tree"]["dict"]:
        if pair[0] == "__rng__":
            pair[1]["dict"] = [p for p in pair[1]["dict"] if p[0] != key] + [[key, node]]


def add_tensors(
    planter: Planter, m: dict[str, Any], entries: dict[str, dict[str, Any]], extra: bytes = b""
) -> bytes:
    """The valid data file with ``extra`` appended to its data region and a header entry
    for each of ``entries`` (``{"dtype", "shape", "at": (begin, end) in extra}``, plus
    index fields such as ``fqn``). ``m`` gets matching index entries, checksummed, and
    its other offsets shifted: the file agrees with the manifest in every byte."""
    from resumable.format import checksum

    data = planter.valid_data
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    region = data[8 + n :]
    for name, e in entries.items():
        b, end = e["at"]
        header[name] = {
            "dtype": e["dtype"],
            "shape": e["shape"],
            "data_offsets": [len(region) + b, len(region) + end],
        }
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    start = 8 + len(body)
    for t in m["tensors"].values():
        t["offsets"] = [o - (8 + n) + start for o in t["offsets"]]
    for name, e in entries.items():
        b, end = e["at"]
        m["tensors"][name] = {
            "file": DATA,
            "dtype": e["dtype"],
            "shape": e["shape"],
            "offsets": [start + len(region) + b, start + len(region) + end],
            "xxh3_64": checksum(extra[b:end]),
            **{k: v for k, v in e.items() if k not in ("dtype", "shape", "at")},
        }
    out = len(body).to_bytes(8, "little") + body + region + extra
    for f in m["files"].values():
        f["size"] = len(out)
    return out


def _plant_deep(planter: Planter, m: dict[str, Any]) -> None:
    """Sign and write a manifest too deep for Python's json at the default recursion
    limit (an attacker need not use Python to write one)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        planter.sign(m)
        body = json.dumps(m).encode()
    finally:
        sys.setrecursionlimit(old)
    planter.plant(body)


def _rng(key: str, node: Any) -> Callable[[Planter], None]:
    def build(planter: Planter) -> None:
        m = planter.manifest()
        _rng_entry(m, key, node)
        planter.plant(m)

    return build


def _rng_not_a_dict(planter: Planter) -> None:
    planter.plant(planter.set_tree_entry(planter.manifest(), "__rng__", {"list": [1, 2]}))


def _piece_field(key: str, value: Any, *, referenced: bool) -> Callable[[Planter], None]:
    """A piece field of ``model/0.weight`` set to ``value``; ``referenced``: the model's
    tensors are ``global`` nodes (as a DTensor model writes them), so restore uses it."""

    def build(planter: Planter) -> None:
        m = planter.manifest()
        _first(m)[key] = value
        if referenced:
            for pair in m["ranks"][0]["tree"]["dict"]:
                if pair[0] == "model":
                    for item in pair[1]["stateful"]["dict"]:
                        item[1] = {"global": item[1]["tensor"], "device": "cpu"}
        planter.plant(m)

    return build


def _nested(depth: int) -> Callable[[Planter], None]:
    def build(planter: Planter) -> None:
        node: Any = 1
        for _ in range(depth):
            node = {"stateful": node}
        m = planter.manifest()
        _sched_entry(m, "deep", node)
        _plant_deep(planter, m)

    return build


def _empty_with_huge_dim(tag: str) -> Callable[[Planter], None]:
    def build(planter: Planter) -> None:
        m = planter.manifest()
        data = add_tensors(planter, m, {"e": {"dtype": "F32", "shape": [0, 2**62], "at": (0, 0)}})
        node = {"tensor": "e", "device": "cpu"} if tag == "tensor" else {tag: "e"}
        _sched_entry(m, "e", node)
        planter.plant(m, {DATA: data})

    return build


BIG = 64 << 10  # bytes of the tensor that the costly cases multiply


def _referenced_many_times(planter: Planter) -> None:
    """One 64 KiB tensor referenced 10,000 times: 640 MB if each reference is a copy."""
    m = planter.manifest()
    data = add_tensors(
        planter, m, {"big": {"dtype": "U8", "shape": [BIG], "at": (0, BIG)}}, bytes(BIG)
    )
    _sched_entry(m, "x", {"list": [{"tensor": "big", "device": "cpu"}] * 10_000})
    planter.plant(m, {DATA: data})


def _overlapping_bytes(planter: Planter) -> None:
    """Two tensors of the index over the same bytes (the file is no valid safetensors)."""
    m = planter.manifest()
    entries = {n: {"dtype": "U8", "shape": [BIG], "at": (0, BIG)} for n in ("a", "b")}
    data = add_tensors(planter, m, entries, bytes(BIG))
    _sched_entry(m, "a", {"tensor": "a", "device": "cpu"})
    _sched_entry(m, "b", {"tensor": "b", "device": "cpu"})
    planter.plant(m, {DATA: data})


def _pieces_over_the_same_bytes(planter: Planter) -> None:
    """A 1 MiB data region read as 256 pieces of a 256 MiB global tensor: each piece
    lies elsewhere in the tensor (they tile it), but all over the same bytes."""
    mib, count = 1 << 20, 256
    m = planter.manifest()
    entries = {
        f"w@{i * mib}": {
            "dtype": "U8",
            "shape": [mib],
            "at": (0, mib),
            "fqn": "w",
            "global_shape": [count * mib],
            "global_offset": [i * mib],
        }
        for i in range(count)
    }
    data = add_tensors(planter, m, entries, bytes(mib))
    _sched_entry(m, "w", {"global": "w", "device": "cpu"})
    planter.plant(m, {DATA: data})


def _ramp(count: int) -> bytes:
    return bytes(i % 256 for i in range(count))


def _one_byte_pieces(count: int, *, overlap: bool) -> Callable[[Planter], None]:
    """A global tensor of ``count`` bytes in ``count`` one-byte pieces. With ``overlap``
    the first byte is left out and the last one covered twice, so the element count
    still adds up and only the overlap test finds it (last among all pairs)."""

    def build(planter: Planter) -> None:
        m = planter.manifest()
        offsets = list(range(count))
        if overlap:
            offsets = [*range(1, count), count - 1]  # byte 0 uncovered, byte count-1 twice
        entries = {
            f"w@{i}": {
                "dtype": "U8",
                "shape": [1],
                "at": (i, i + 1),
                "fqn": "w",
                "global_shape": [count],
                "global_offset": [o],
            }
            for i, o in enumerate(offsets)
        }
        data = add_tensors(planter, m, entries, _ramp(count))
        _sched_entry(m, "w", {"global": "w", "device": "cpu"})
        planter.plant(m, {DATA: data})

    return build


def _trailing_bytes(planter: Planter) -> None:
    """Bytes after the last tensor, in no header entry: not a valid safetensors file."""
    m = planter.manifest()
    planter.plant(m, {DATA: add_tensors(planter, m, {}, bytes(64))})


def _manifest_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[Planter], None]:
    def build(planter: Planter) -> None:
        m = planter.manifest()
        edit(m)
        planter.plant(m)

    return build


# name -> (how to plant it, what `resumable verify` must name)
MALFORMED: dict[str, tuple[Callable[[Planter], None], str]] = {
    "rng-torch-cpu-an-int": (_rng("torch_cpu", 5), "RNG"),
    "rng-numpy-an-int": (_rng("numpy", 5), "RNG"),
    "rng-numpy-a-list": (_rng("numpy", {"list": [1, 2]}), "RNG"),
    "rng-python-a-string": (_rng("python", "abc"), "RNG"),
    "rng-python-short-tuple": (_rng("python", {"tuple": [3, {"tuple": [1, 2]}, None]}), "RNG"),
    "rng-torch-cuda-an-int": (_rng("torch_cuda", 5), "RNG"),
    "rng-not-a-dict": (_rng_not_a_dict, "RNG"),
    "global-offset-float": (_piece_field("global_offset", [0.0, 0], referenced=True), "piece"),
    "global-offset-float-unused": (
        _piece_field("global_offset", [0.0, 0], referenced=False),
        "piece",
    ),
    "global-shape-an-int": (_piece_field("global_shape", 5, referenced=True), "piece"),
    "global-shape-an-int-unused": (_piece_field("global_shape", 5, referenced=False), "piece"),
    "fqn-a-list": (_piece_field("fqn", ["w"], referenced=False), "piece"),
    "tree-nested-65": (_nested(65), "deep"),
    "tree-nested-900": (_nested(900), "deep"),
    "tree-nested-1000": (_nested(1000), "deep"),
    "empty-tensor-dim-2**62": (_empty_with_huge_dim("tensor"), "shape"),
    "empty-ndarray-dim-2**62": (_empty_with_huge_dim("ndarray"), "shape"),
    "tensor-referenced-10000-times": (_referenced_many_times, "more than once"),
    "tensors-over-the-same-bytes": (_overlapping_bytes, "overlap"),
    "pieces-over-the-same-bytes": (_pieces_over_the_same_bytes, "overlap"),
    "6000-one-byte-pieces-overlapping": (_one_byte_pieces(6000, overlap=True), "overlap"),
    "world-size-a-string": (_manifest_edit(lambda m: m.__setitem__("world_size", "1")), "world"),
    "world-size-2-with-1-rank": (_manifest_edit(lambda m: m.__setitem__("world_size", 2)), "rank"),
    "metric-a-dict": (_manifest_edit(lambda m: m["metrics"].__setitem__("loss", {})), "metric"),
    "data-file-with-unindexed-bytes": (_trailing_bytes, "safetensors"),
}


def verify_cli(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``resumable verify --step 9 --json``: exit status and the error it reports."""
    from resumable.cli import main

    capsys.readouterr()
    code = main(["verify", str(root), "--step", str(HOSTILE), "--json"])
    out = capsys.readouterr().out
    (result,) = json.loads(out)
    return code, str(result["error"])


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_refused_alike_by_verify_and_restore(
    planter: Planter, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Validation is total: whatever is malformed is `CorruptCheckpointError`, found
    before anything is allocated for it; ``resumable verify`` names the problem and
    exits 1, and restore skips the checkpoint with a WARNING for the older valid one."""
    build, problem = MALFORMED[case]
    build(planter)
    code, error = verify_cli(planter.root, capsys)
    assert code == 1, error
    assert re.search(problem, error, re.IGNORECASE), error
    planter.verify_refuses()
    planter.restore_falls_back()


RSS_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from conftest import build_training_state
from resumable import Checkpointer

def status(field):
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

ts = build_training_state(seed=7, steps=0)
with Checkpointer({root!r}, ts.state, keep=None, persist="sync") as ckpt:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the present size: earlier peaks don't count
    before = status("VmRSS")
    step = ckpt.restore()
    peak = status("VmHWM")
print(step, peak - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="measures memory via /proc")
@pytest.mark.parametrize("case", ["tensor-referenced-10000-times", "pieces-over-the-same-bytes"])
def test_small_hostile_checkpoint_costs_no_memory(planter: Planter, case: str) -> None:
    """A checkpoint of a few hundred KiB to 1 MiB that used to make restore allocate
    640 MiB (a copy per reference) or 512 MiB (a 256 MiB tensor from overlapping
    pieces, and its copy): the peak memory of a restore, measured in its own process,
    stays far below that."""
    MALFORMED[case][0](planter)
    script = RSS_SCRIPT.format(tests=str(Path(__file__).parent), root=str(planter.root))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    ).stdout
    step, grown = (int(x) for x in out.split()[-2:])
    assert grown < 128 << 20, f"restore grew the process by {grown >> 20} MiB"
    assert step == VALID


def test_thousands_of_pieces_tile_in_near_linear_time(
    planter: Planter, capsys: pytest.CaptureFixture[str]
) -> None:
    """A valid global tensor in 6,000 one-byte pieces verifies and restores; the tiling
    check is O(n log n) (it was quadratic: 20 s to verify, 25 s to restore)."""
    # Loading a global tensor imports DCP's planner: before the audit hook records.
    import torch.distributed.checkpoint.planner_helpers  # noqa: F401

    _one_byte_pieces(6000, overlap=False)(planter)
    code, error = verify_cli(planter.root, capsys)
    assert code == 0, error
    outcome, ts = planter.restore()
    assert outcome == HOSTILE
    assert bytes(ts.sched.w.numpy()) == _ramp(6000)


class _ObjectStore(MemoryStorage):
    """Memory without rename: committed with `MarkerCommit`, as on ``s3://``, whose
    constructor scans every step's manifest for stale attempts."""

    supports_rename = False


@pytest.mark.parametrize(
    "body",
    [b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[" * 900 + b"]" * 900],
    ids=["too-deep-to-parse", "deep"],
)
def test_deeply_nested_manifest_on_an_object_store_does_not_stop_construction(
    small_training_state: Callable[..., Any], body: bytes
) -> None:
    storage = _ObjectStore("memory://objects")
    ts = small_training_state(seed=0, steps=1)
    with Checkpointer(storage, ts.state, keep=None, persist="sync") as ckpt:
        ckpt.save(1)
    storage.write(f"{dir_name(HOSTILE)}/att-0000000000001-1-0badc0de/{DATA}", [b"x"])
    storage.write(f"{dir_name(HOSTILE)}/manifest.json", [body])
    fresh = small_training_state(seed=7, steps=0)
    with Checkpointer(storage, fresh.state, keep=None, persist="sync") as ckpt:
        assert ckpt.restore() == 1


def _nested_dict(levels: int) -> dict[str, Any]:
    """``levels`` dicts, each inside the previous one."""
    d: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        d = {"k": d}
    return d


def test_the_deepest_state_a_save_accepts_restores(tmp_path: Path) -> None:
    """Readers refuse trees deeper than `MAX_TREE_DEPTH`, so a save refuses such a
    state (naming its path) and never writes a checkpoint no restore would take; one
    level less saves and restores."""
    from resumable.errors import UnsupportedStateError
    from resumable.tree import MAX_TREE_DEPTH

    deepest = MAX_TREE_DEPTH - 1  # the root node is one level; its entries start at two
    with Checkpointer(tmp_path / "ok", {"cfg": _nested_dict(deepest)}, persist="sync") as ckpt:
        ckpt.save(1)
    live = {"cfg": {}}
    with Checkpointer(tmp_path / "ok", live, persist="sync") as ckpt:
        assert ckpt.restore() == 1
    assert live["cfg"] == _nested_dict(deepest)
    with (
        Checkpointer(tmp_path / "deep", {"cfg": _nested_dict(deepest + 1)}, persist="sync") as ck,
        pytest.raises(UnsupportedStateError, match=f"more than {MAX_TREE_DEPTH} levels"),
    ):
        ck.save(1)


def _index(pieces: list[tuple[list[int], list[int]]], gshape: list[int]) -> dict[str, Any]:
    return {
        f"w@{i}": {
            "file": DATA,
            "dtype": "U8",
            "shape": shape,
            "offsets": [0, 0],
            "xxh3_64": "",
            "fqn": "w",
            "global_shape": gshape,
            "global_offset": offset,
        }
        for i, (shape, offset) in enumerate(pieces)
    }


TILINGS: dict[str, tuple[list[tuple[list[int], list[int]]], str | None]] = {
    "grid-2x2": ([([2, 2], [0, 0]), ([2, 2], [0, 2]), ([2, 2], [2, 0]), ([2, 2], [2, 2])], None),
    "not-a-grid": ([([2, 4], [0, 0]), ([2, 1], [2, 0]), ([2, 3], [2, 1])], None),
    "empty-pieces-ignored": ([([4, 4], [0, 0]), ([0, 4], [4, 0])], None),
    "overlap-same-count": ([([2, 4], [0, 0]), ([2, 4], [1, 0]), ([1, 4], [3, 0])], "overlap"),
    "hole": ([([2, 4], [0, 0]), ([1, 4], [2, 0])], "cover 12 of its 16"),
    "outside": ([([4, 4], [0, 0]), ([1, 1], [4, 4])], "outside"),
}


@pytest.mark.parametrize("case", list(TILINGS))
def test_pieces_must_tile_their_global_tensor(case: str) -> None:
    from resumable.pieces import check_pieces, global_tensors

    pieces, problem = TILINGS[case]
    index = _index(pieces, [4, 4])
    (spec,) = global_tensors(index).values()
    if problem is None:
        check_pieces("w", spec, index, "here")
    else:
        with pytest.raises(CorruptCheckpointError, match=problem):
            check_pieces("w", spec, index, "here")


def test_a_tiling_more_fragmented_than_any_sharding_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A staircase (row i from column i on, column i below row i) tiles an n-by-n tensor
    with 2n - 1 pieces but cuts it into n² cells: refused once the cells pass the
    bound, so the check stays O(n log n + bound)."""
    import resumable.pieces as pieces

    n = 16
    rows = [([1, n - i], [i, i]) for i in range(n)]
    columns = [([n - i - 1, 1], [i + 1, i]) for i in range(n - 1)]
    index = _index(rows + columns, [n, n])
    (spec,) = pieces.global_tensors(index).values()
    pieces.check_pieces("w", spec, index, "here")  # n² = 256 cells: within the bound
    monkeypatch.setattr(pieces, "MAX_TILING_CELLS", 64)
    (spec,) = pieces.global_tensors(index).values()
    with pytest.raises(CorruptCheckpointError, match="fragmented"):
        pieces.check_pieces("w", spec, index, "here")


# --------------------------------------------------------------------------- (h) special files


def _bounded(call: Callable[[], Any], fifos: list[Path], timeout: float = 30.0) -> Any:
    """``call()``'s result (or the exception it raised), run in a thread; fails instead
    of hanging when it is still running after ``timeout`` s (and then gives the FIFOs a
    peer, so the stuck thread can finish)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:
            box["result"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if not thread.is_alive():
        return box["result"]
    for _ in range(50):
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        thread.join(0.1)
    pytest.fail(f"blocked on a FIFO for more than {timeout} s: {[str(f) for f in fifos]}")


def _plant_fifos(saved_root: Any, where: str) -> list[Path]:
    """Replace files of the saved root by FIFOs nobody opens; returns them."""
    targets = {
        "manifest": [saved_root.manifest_file(3)],
        "data": [saved_root.data_file(3)],
        "audit": [saved_root.path / "audit.jsonl"],
        "every-manifest": [saved_root.manifest_file(s) for s in saved_root.steps],
    }[where]
    for path in targets:
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    return targets


@pytest.mark.parametrize("where", ["manifest", "data", "audit", "every-manifest"])
def test_fifo_in_the_root_never_blocks_restore(
    saved_root: Any,
    small_training_state: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """A FIFO where a manifest, a data file or the audit log belongs: refused at once,
    so restore falls back (or says no checkpoint is valid) instead of waiting forever."""
    fifos = _plant_fifos(saved_root, where)
    ts = small_training_state(seed=7, steps=0)
    ckpt = Checkpointer(saved_root.path, ts.state, keep=None, persist="sync")
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            outcome = _bounded(ckpt.restore, fifos)
    finally:
        assert _bounded(ckpt.close, fifos) is None
    if where == "every-manifest":
        assert isinstance(outcome, CorruptCheckpointError), outcome
        assert "FIFO" in str(outcome)
        return
    step = VALID if where == "audit" else VALID - 1
    assert outcome == step, outcome
    assert ts.mismatches(saved_root.expected[step]) == []
    if where != "audit":
        assert "FIFO (named pipe), not a regular file" in caplog.text
    assert all(stat.S_ISFIFO(os.lstat(f).st_mode) for f in fifos)


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["verify", "--all"], 1),
        (["ls", "--verify"], 0),
        (["show"], 2),
        (["show", "--step", "2"], 0),
    ],
    ids=["verify", "ls", "show-newest", "show-step-2"],
)
def test_fifo_in_the_root_never_blocks_the_cli(
    saved_root: Any, args: list[str], status: int
) -> None:
    """The command, in a process of its own, ends in bounded time with a clear message
    (a FIFO manifest at step 3, a FIFO data file at step 2, a FIFO audit log)."""
    _plant_fifos(saved_root, "manifest")
    _plant_fifos(saved_root, "audit")
    saved_root.data_file(2).unlink()
    os.mkfifo(saved_root.data_file(2))
    src = str(Path(resumable.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "resumable.cli", args[0], str(saved_root.path), *args[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"resumable {' '.join(args)} blocked on a FIFO for 120 s")
    assert proc.returncode == status, proc.stdout + proc.stderr
    if args != ["show", "--step", "2"]:
        assert "FIFO (named pipe), not a regular file" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- found by fuzzing
# Each case below was found by campaign 5 (stress/hostile.py).


def test_audit_line_nested_too_deeply_is_skipped() -> None:
    """A line of ``[`` a hundred thousand deep made `read_audit` raise RecursionError
    (so ``resumable log``, ``report`` and ``ls`` crashed); it is skipped like any
    line that is not a JSON object."""
    storage = MemoryStorage("memory://deep-audit")
    good = json.dumps({"time": 1.0, "event": "commit", "step": 1}).encode()
    storage.write("audit.jsonl", [good + b"\n" + b"[" * 100_000 + b"\n" + good + b"\n"])
    skipped: list[str] = []
    assert [e["event"] for e in read_audit(storage, skipped)] == ["commit", "commit"]
    assert len(skipped) == 1 and "line 2" in skipped[0]


def test_run_id_file_nested_too_deeply_gets_a_derived_id() -> None:
    """A run-id file of nested arrays (within its 4 KiB) made `read_run_id` raise
    RecursionError, so no Checkpointer could open the root; it is treated like any
    other file that is not a run id: an id derived from its bytes, with a WARNING."""
    from resumable.runid import RUN_ID_FILE, read_run_id

    storage = MemoryStorage("memory://deep-run-id")
    storage.write(RUN_ID_FILE, [b'{"run_id": ' + b"[" * 4000])
    run_id = read_run_id(storage)
    assert run_id is not None and re.fullmatch("[0-9a-f]{32}", run_id)


def test_integers_beyond_float_range_are_not_numbers_to_readers() -> None:
    """JSON integers have no size limit; ``math.isfinite(10**400)`` raises OverflowError.
    An audit entry with such a ``time`` crashed `read_audit`'s merge and the report, and
    a (re-signed) manifest metric of that size crashed retention by best metric."""
    from resumable.policy import Entry
    from resumable.report import build_report

    storage = MemoryStorage("memory://huge-time")
    lines = [{"time": 10**400, "event": "launch"}, {"time": 2.0, "event": "commit", "step": 1}]
    storage.write("audit/1795730904000-w1-000001.jsonl", [json.dumps(lines[0]).encode() + b"\n"])
    storage.write("audit.jsonl", [json.dumps(lines[1]).encode() + b"\n"])
    assert len(read_audit(storage)) == 2
    build_report(storage)  # the entry without a usable time is left out
    entries = [Entry(1, {"loss": 10**400}), Entry(2, {"loss": 0.5}), Entry(3, {"loss": 9.0})]
    assert Keep(last=1, best=("loss", "min", 1)).retained(entries) == {2, 3}


def _layout_entry(**change: Any) -> dict[str, Any]:
    return {"name": "w", "dtype": "F32", "shape": [4], "begin": 0, "end": 16, **change}


@pytest.mark.parametrize(
    "blob",
    [
        b'{"tree": {}, "layout": ' + b"[" * 100_000,
        json.dumps({"tree": {}, "layout": [_layout_entry(end=1e400)]}).encode(),
        json.dumps({"tree": {}, "layout": [_layout_entry(begin=0, end=0)]}).encode(),
        json.dumps({"tree": {}, "layout": [_layout_entry(shape=[4.0])]}).encode(),
        json.dumps({"tree": {}, "layout": [_layout_entry(name={"w": 1})]}).encode(),
        json.dumps({"tree": {}, "layout": [_layout_entry(begin=2, end=18)]}).encode(),
        json.dumps({"tree": {}, "layout": [_layout_entry(), _layout_entry()]}).encode(),
        json.dumps({"tree": {}, "layout": [_layout_entry(shape=[1 << 40])]}).encode(),
        json.dumps({"layout": [_layout_entry()]}).encode(),
        json.dumps([{"layout": []}]).encode(),
    ],
    ids=[
        "nested",
        "end-inf",
        "short",
        "float-dim",
        "dict-name",
        "misaligned",
        "same-name",
        "past-region",
        "no-tree",
        "not-object",
    ],
)
def test_snapshot_slot_with_unfitting_metadata_is_not_used(tmp_path: Path, blob: bytes) -> None:
    """Slot metadata whose checksum holds but that `layout_meta` could not have written
    (nested too deeply, offsets of infinity or the wrong length, a dict as name, ...)
    made `ShmSlot.read` raise RecursionError, OverflowError or TypeError, or the tensor
    views raise RuntimeError, so a restore crashed; the slot is now not used (read
    returns None), as one cut short is."""
    from resumable import _shm as shm

    slot = shm.ShmSlot.create(tmp_path / "slot", meta_cap=1 << 20, sums_cap=4096, data_cap=64)
    try:
        slot.begin_write()
        good = json.dumps({"tree": {}, "layout": [_layout_entry()]}).encode()
        slot.finish_write(step=1, blob=good, data_len=16)
        assert slot.read() is not None
        slot.begin_write()
        slot.finish_write(step=2, blob=blob, data_len=16)
        assert slot.read() is None
    finally:
        slot.close()


def test_report_of_numbers_at_the_edge_of_floats(planter: Planter) -> None:
    """Audit times of +-1e308 (their difference is infinite), steps of 10**30, a save of
    44565 bytes in 1e-320 s (an infinite rate), and a
    (re-signed) manifest whose ``created`` is 10**400 or 1e400 made `build_report` raise
    OverflowError or `render_html` ValueError (``resumable report`` printed a traceback
    or no page); numbers beyond any a run writes are left out of the report."""
    from resumable.report import build_report
    from resumable.report_html import render_html

    entries = [
        {"time": -1e308, "event": "launch", "persist": "sync"},
        {"time": -1e308, "event": "progress", "step": 1},
        {"time": 1e308, "event": "progress", "step": 10**30},
        {"time": 1e308, "event": "save_start", "step": 10**30},
        {"time": 1e308, "event": "commit", "step": 10**30, "duration_s": 1e308},
        {"time": 2.0, "event": "save_start", "step": 2},
        {"time": 3.0, "event": "commit", "step": 2, "bytes": 44565, "duration_s": 1e-320},
    ]
    with open(planter.root / "audit.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    m = planter.manifest()
    m["created"] = 10**400
    planter.plant(m)
    render_html(build_report(LocalStorage(planter.root)))
    m["created"] = float("inf")
    planter.plant(json.dumps(planter.sign(m)).replace("Infinity", "1e400").encode())
    assert "Infinity" not in json.dumps(build_report(LocalStorage(planter.root)).to_json())
    render_html(build_report(LocalStorage(planter.root)))
