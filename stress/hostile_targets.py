"""The targets of campaign 5 (`stress.hostile`): each parser of checkpoint data, and how
hostile inputs for it are made from a valid checkpoint.

`Sandbox` saves a small training job's checkpoints once into a fresh temporary
directory and keeps the valid files as seeds: the manifest, the safetensors header and
data file, the audit log, the run id, a complete shared-memory snapshot slot, and
command lines of the ``resumable`` CLI. A `Target` splits each execution in two: `make`
(the harness: draws the input from a `random.Random` and puts files in place; not
watched) and `call` (the code under test; the audit hook and the watchdog are on).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlparse

import xxhash

from resumable import _shm as shm
from resumable import cli
from resumable.audit import AuditLog, read_audit
from resumable.capture import decode
from resumable.commit import step_dir
from resumable.errors import CorruptCheckpointError
from resumable.format import checksum, decode_manifest, manifest_digest, parse_safetensors_header
from resumable.pipeline.memory import MemoryTier
from resumable.reader import CheckpointReader
from resumable.report import build_report
from resumable.report_html import render_html
from resumable.runid import RUN_ID_FILE, read_run_id
from resumable.storage import OBJECT_SCHEMES, open_storage
from resumable.storage.local import LocalStorage
from resumable.storage.memory import MemoryStorage
from stress.corruption import DATA, MANIFEST, NEWEST, save_root
from stress.mutate import Mutator

AUDIT_LOG = "audit.jsonl"
SHM_STORAGE = "memory://hostile-shm"
CLI_MEMORY_ROOT = "memory://hostile-root"


@dataclass
class Target:
    """One parser under fuzz. ``make(rng)`` returns the input (files it needs are in
    place when it returns); ``call(input)`` runs the code under test and may raise a
    `CheckpointError` only; ``roots(input)`` are the directories its opens may touch;
    ``after(input)`` undoes what the call changed (unwatched); ``show`` describes an
    input in a failure report."""

    make: Callable[[random.Random], Any]
    call: Callable[[Any], Any]
    roots: Callable[[Any], tuple[str, ...]] = lambda _: ()
    after: Callable[[Any], None] = lambda _: None
    show: Callable[[Any], str] = lambda x: f"{x!r:.300}"
    cwd: str = ""  # relative opens are resolved against it (else: one name, openat)
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    warm: list[Any] = field(default_factory=list)  # inputs run once before, unwatched
    exit_status: bool = False  # call returns an exit status, counted by value


def _resign_manifest(doc: Any) -> None:
    if isinstance(doc, dict):
        with contextlib.suppress(Exception):  # what cannot be signed stays unsigned
            doc["digest"] = manifest_digest(doc)


class Sandbox:
    """The valid checkpoint, the directories the targets work in, and the targets.

    Layout under one temporary directory ``top`` (the root of every watched open):
    ``pristine/`` (the saved root, never touched), ``local/`` (the reader-local root),
    ``a/b/cwd/`` (the CLI's working directory, nested so that ``..`` stays inside),
    holding ``root/`` (a copy of the checkpoint root), ``out/`` and ``shm/`` (the CLI's
    and the memory tier's shared-memory directory)."""

    def __init__(self) -> None:
        self.top = os.path.realpath(tempfile.mkdtemp(prefix="hostile-"))
        self.pristine = os.path.join(self.top, "pristine")
        os.makedirs(self.pristine)
        save_root(self.pristine)
        d = step_dir(NEWEST)
        self.manifest_bytes = self._file(f"{d}/{MANIFEST}")
        self.manifest = json.loads(self.manifest_bytes)
        self.data = self._file(f"{d}/{DATA}")
        n = int.from_bytes(self.data[:8], "little")
        self.header_body = self.data[8 : 8 + n]
        self.header = json.loads(self.header_body)
        self.tensor_bytes = self.data[8 + n :]
        self.audit = self._file(AUDIT_LOG)
        self.run_id = self._file(RUN_ID_FILE)
        self.corpus = [self.manifest_bytes, self.header_body, self.audit, self.run_id]
        self.local = os.path.join(self.top, "local")
        self.cwd = os.path.join(self.top, "a", "b", "cwd")
        self.root = os.path.join(self.cwd, "root")
        self.out = os.path.join(self.cwd, "out")
        self.shm_dir = Path(self.cwd, "shm")
        for p in (self.local, self.out, self.shm_dir):
            os.makedirs(p, exist_ok=True)
        os.makedirs(os.path.join(self.local, d))
        shutil.copytree(self.pristine, self.root)
        self._root_print = self._fingerprint()
        self._fill_memory_root()
        self._make_slot()

    def _file(self, path: str) -> bytes:
        with open(os.path.join(self.pristine, path), "rb") as f:
            return f.read()

    def close(self) -> None:
        shutil.rmtree(self.top, ignore_errors=True)

    # ------------------------------------------------------------------ checkpoint files

    def manifest_doc_bytes(self, m: Mutator, *, resign: bool, data: bytes | None = None) -> bytes:
        """The valid manifest with structural edits; re-signed (and its file table made
        to match ``data``) when ``resign``."""
        doc = m.edit(self.manifest) if m.rng.random() < 0.9 else json.loads(self.manifest_bytes)
        if resign and data is not None and isinstance(doc, dict):
            files = doc.get("files")
            if isinstance(files, dict) and isinstance(files.get(DATA), dict):
                files[DATA]["size"] = len(data)
        if resign:
            _resign_manifest(doc)
        out = m.dumps(doc)
        return m.damage(out, 1) if m.rng.random() < 0.1 else out

    def header_bytes(self, m: Mutator) -> bytes:
        """A safetensors prefix: an edited header behind a length field that may lie,
        or the valid prefix with byte-level damage."""
        r = m.rng
        if r.random() < 0.6:
            body = m.dumps(m.edit(self.header))
            n = len(body) if r.random() < 0.7 else m.integer() % (1 << 64)
            return n.to_bytes(8, "little") + body
        return m.damage(self.data[: 8 + len(self.header_body) + 64])

    def data_file(self, m: Mutator) -> bytes:
        """The data file with its header edited (the length field kept right) or bytes
        overwritten anywhere."""
        r = m.rng
        if r.random() < 0.5:
            body = m.dumps(m.edit(self.header))
            return len(body).to_bytes(8, "little") + body + self.tensor_bytes
        data = bytearray(self.data)
        for _ in range(r.randint(1, 3)):
            p = r.randrange(len(data))
            data[p : p + 8] = r.randbytes(r.randint(1, 8))
        return bytes(data)

    # ------------------------------------------------------------------ targets

    def targets(self) -> dict[str, Target]:
        return {
            "manifest-bytes": self._manifest_bytes(),
            "manifest-edits": self._manifest_edits(),
            "safetensors-header": self._safetensors_header(),
            "reader": self._reader(),
            "reader-local": self._reader_local(),
            "audit-log": self._audit_log(),
            "run-id": self._run_id(),
            "shm-slot": self._shm_slot(),
            "cli": self._cli(),
        }

    def _manifest_bytes(self) -> Target:
        def make(rng: random.Random) -> bytes:
            m = Mutator(rng, self.corpus)
            if rng.random() < 0.03:
                return rng.randbytes(rng.randrange(256))
            return m.damage(self.manifest_bytes)

        return Target(make, lambda data: decode_manifest(data, where="fuzz"))

    def _manifest_edits(self) -> Target:
        def make(rng: random.Random) -> bytes:
            return self.manifest_doc_bytes(Mutator(rng, self.corpus), resign=rng.random() < 0.5)

        return Target(make, lambda data: decode_manifest(data, where="fuzz"))

    def _safetensors_header(self) -> Target:
        def make(rng: random.Random) -> tuple[bytes, int]:
            m = Mutator(rng, self.corpus)
            raw = self.header_bytes(m)
            size = len(self.data) if rng.random() < 0.6 else m.integer() % (1 << 63)
            return raw, size

        return Target(make, lambda a: parse_safetensors_header(*a))

    def _checkpoint(self, rng: random.Random) -> tuple[bytes, bytes]:
        m = Mutator(rng, self.corpus)
        kind = rng.randrange(3)
        data = self.data if kind == 0 else self.data_file(m)
        if kind == 1:
            manifest = json.loads(self.manifest_bytes)
            manifest["files"][DATA]["size"] = len(data)
            _resign_manifest(manifest)
            return json.dumps(manifest).encode(), data
        return self.manifest_doc_bytes(m, resign=True, data=data), data

    def _reader(self) -> Target:
        d = step_dir(NEWEST)

        def make(rng: random.Random) -> MemoryStorage:
            manifest, data = self._checkpoint(rng)
            storage = MemoryStorage("memory://fuzz")
            storage.write(f"{d}/{MANIFEST}", [manifest])
            storage.write(f"{d}/{DATA}", [data])
            return storage

        def show(storage: MemoryStorage) -> str:
            return f"{storage.read_range(f'{d}/{MANIFEST}', 0, 300)!r}"

        return Target(make, lambda s: CheckpointReader(s, NEWEST).verify(), show=show)

    def _reader_local(self) -> Target:
        d = step_dir(NEWEST)
        storage = LocalStorage(self.local)

        def make(rng: random.Random) -> tuple[bytes, bytes]:
            manifest, data = self._checkpoint(rng)
            for name, content in ((MANIFEST, manifest), (DATA, data)):
                with open(os.path.join(self.local, d, name), "wb") as f:
                    f.write(content)
            return manifest, data

        return Target(
            make,
            lambda _: CheckpointReader(storage, NEWEST).verify(),
            roots=lambda _: (self.local,),
        )

    def _audit_log(self) -> Target:
        lines = self.audit.splitlines()
        entries = [json.loads(line) for line in lines]

        def make(rng: random.Random) -> MemoryStorage:
            m = Mutator(rng, self.corpus)
            if rng.random() < 0.5:
                data = m.damage(self.audit)
            else:
                edited = list(lines)
                for _ in range(rng.randint(1, 3)):
                    i = rng.randrange(len(edited))
                    edited[i] = m.dumps(m.edit(entries[i]))
                data = b"\n".join(edited) + b"\n"
            storage = MemoryStorage("memory://fuzz")
            storage.write(AUDIT_LOG, [data])
            return storage

        def call(storage: MemoryStorage) -> None:
            read_audit(storage)
            render_html(build_report(storage))

        def show(storage: MemoryStorage) -> str:
            return f"{storage.read_range(AUDIT_LOG, 0, 300)!r}"

        return Target(make, call, show=show)

    def _run_id(self) -> Target:
        doc = json.loads(self.run_id)

        def make(rng: random.Random) -> MemoryStorage:
            m = Mutator(rng, self.corpus)
            data = m.damage(self.run_id) if rng.random() < 0.6 else m.dumps(m.edit(doc))
            storage = MemoryStorage("memory://fuzz")
            storage.write(RUN_ID_FILE, [data])
            return storage

        return Target(make, read_run_id, show=lambda s: f"{s.read_range(RUN_ID_FILE, 0, 300)!r}")

    # ------------------------------------------------------------------ shared memory

    def _make_slot(self) -> None:
        """A complete snapshot slot of the newest checkpoint's state, as the memory tier
        writes one for ``SHM_STORAGE``, with its per-tensor checksums."""
        from resumable._dtypes import check_dtype_name
        from resumable.format import TensorSlot

        storage = open_storage(SHM_STORAGE)
        directory = shm.own_dir(self.shm_dir)
        assert directory is not None
        self.slot_path = shm.slot_paths(shm.run_key_for(storage.location), 0, directory)[0]
        entries = sorted(
            ((k, v) for k, v in self.header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        slots = [
            TensorSlot(k, check_dtype_name(v["dtype"]), tuple(v["shape"]), *v["data_offsets"])
            for k, v in entries
        ]
        tree = self.manifest["ranks"][0]["tree"]
        meta = {
            "step": NEWEST,
            "tree": tree,
            "metrics": {"loss": 0.5},
            "world_size": 1,
            "created": 1.7e9,
            "layout": shm.layout_meta(slots),
            shm.ROOT_KEY: SHM_STORAGE,
        }
        blob = shm.encode_meta(meta)
        slot = shm.ShmSlot.create(
            self.slot_path,
            meta_cap=len(blob) * 2 + 4096,
            sums_cap=16 * len(slots) + 4096,
            data_cap=len(self.tensor_bytes),
        )
        seq = slot.begin_write()
        slot.data_view(len(self.tensor_bytes))[:] = self.tensor_bytes
        slot.finish_write(step=NEWEST, blob=blob, data_len=len(self.tensor_bytes))
        sums = [checksum(self.tensor_bytes[s.begin : s.end]) for s in slots]
        assert slot.write_checksums(seq, sums)
        slot.close()
        with open(self.slot_path, "rb") as f:
            self.slot = f.read()
        self.slot_meta = meta
        self.slot_blob = blob

    def _shm_slot(self) -> Target:
        size = shm.Control.SIZE
        control = shm.Control.unpack(self.slot)
        fields = list(control.__dict__)

        def make(rng: random.Random) -> bytes:
            m = Mutator(rng, self.corpus)
            c = shm.Control(*control.__dict__.values())
            buf = bytearray(self.slot)
            blob = self.slot_blob
            if rng.random() < 0.7:
                blob = m.dumps(m.edit(self.slot_meta)) if rng.random() < 0.7 else m.damage(blob)
                buf[shm.CONTROL : shm.CONTROL + len(blob)] = blob
                if rng.random() < 0.8:  # re-signed: the checks behind the checksum
                    c.meta_len, c.meta_xxh = len(blob), xxhash.xxh3_64_intdigest(blob)
            if rng.random() < 0.4:
                for name in rng.sample(fields, rng.randint(1, 3)):
                    setattr(c, name, _field_value(m, name))
            if rng.random() < 0.15:  # per-tensor checksums or tensor bytes damaged
                start = shm.CONTROL + c.meta_cap if rng.random() < 0.5 else len(buf) - 64
                start = min(max(start, 0), len(buf))
                buf[start : start + 64] = m.damage(bytes(buf[start : start + 64]))
            with contextlib.suppress(struct.error):
                buf[:size] = c.pack()
            if rng.random() < 0.05:  # cut short, or grown
                cut = rng.choice(
                    (0, 7, size, shm.CONTROL - 1, shm.CONTROL, rng.randrange(len(buf)))
                )
                buf = buf[:cut] if rng.random() < 0.7 else buf + bytes(rng.randrange(1 << 16))
            fd = os.open(self.slot_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, buf)
            finally:
                os.close(fd)
            return bytes(buf[: size + 200]) + bytes(buf[shm.CONTROL : shm.CONTROL + 200])

        def call(_: bytes) -> None:
            storage = MemoryStorage(SHM_STORAGE)  # the slot's key, a fresh audit log
            tier = MemoryTier(
                storage,
                rank=0,
                world_size=1,
                shm_dir=self.shm_dir,
                overlap=False,
                audit=AuditLog(storage),
            )
            try:
                tier.adopt()
                snap = tier.newest
                if snap is not None:
                    content, views = tier.verified(snap)
                    decode(content.meta.tree, views, None, resolve=_no_global)
            finally:
                tier.close(unlink=False)
            list(shm.list_segments(self.shm_dir))

        return Target(make, call, roots=lambda _: (self.top,))

    # ------------------------------------------------------------------ command line

    def _fingerprint(self) -> list[Any]:
        out: list[Any] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            out.append((dirpath, sorted(filenames)))
        out.append(os.path.getsize(os.path.join(self.root, AUDIT_LOG)))
        return out

    def _fill_memory_root(self) -> None:
        storage = open_storage(CLI_MEMORY_ROOT)
        for name in storage.list_dir(""):
            storage.delete(name)
        for dirpath, _, filenames in os.walk(self.pristine):
            for name in filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.pristine)
                with open(full, "rb") as f:
                    storage.write(rel, [f.read()])

    def _cli_seeds(self) -> list[list[str]]:
        r, o, s = "root", self.out, str(self.shm_dir)
        return [
            ["ls", r, "--json", "--shm-dir", s],
            ["ls", self.root, "--verify", "--shm-dir", s],
            ["ls", CLI_MEMORY_ROOT],
            ["show", r, "--step", "4", "--json"],
            ["show", r],
            ["verify", r, "--all", "--json"],
            ["verify", CLI_MEMORY_ROOT, "--step", "3"],
            ["export", r, "--key", "model", "--out", f"{o}/model.safetensors", "--force"],
            ["export", r, "--key", "optim", "--out", "out/optim.safetensors", "--exact"],
            ["prune", r, "--keep-last", "2", "--dry-run"],
            ["prune", r, "--keep-last", "3"],
            ["pin", r, "3"],
            ["unpin", r, "3"],
            ["log", r, "--event", "commit"],
            ["report", r, "--json"],
            ["report", r, "--out", "out/report.html"],
            ["shm", "--shm-dir", s, "--json"],
            ["shm", "--shm-dir", s, "--clean"],
        ]

    def _cli(self) -> Target:
        seeds = self._cli_seeds()
        pool = [
            "root",
            "./root",
            "root/",
            "root/../root",
            "root/" + step_dir(NEWEST),
            "root/nope",
            "..",
            "../..",
            "../../root",
            "/nonexistent/root",
            "/dev/null",
            "",
            "-",
            "--",
            "\x00",
            "root\x00",
            "\udcff",
            "ステップ",
            "x" * 300,
            "y" * 5000,
            "0",
            "-1",
            "4",
            "٤",
            " 4 ",
            "9" * 40,
            str(2**63),
            "1e9",
            "0x4",
            "nan",
            "model",
            "optim",
            "__class__",
            "memory://hostile-root",
            "memory://nope",
            "file://" + self.root,
            "file:///nonexistent",
            "foo://bar",
            "http://[",
            "--step",
            "--all",
            "--json",
            "--verify",
            "--key",
            "--out",
            "--force",
            "--exact",
            "--keep-last",
            "--dry-run",
            "--event",
            "--clean",
            "--shm-dir",
            "--shm",
            "--help",
            "-h",
            "--version",
            "--step=-5",
            "--keep-last=0",
            "ls",
            "show",
            "verify",
            "export",
            "prune",
            "pin",
            "unpin",
            "log",
            "report",
            "shm",
        ]

        def make(rng: random.Random) -> list[str]:
            m = Mutator(rng, [])
            argv = list(rng.choice(seeds))
            for _ in range(rng.randint(1, 3)):
                op = rng.randrange(6)
                i = rng.randrange(len(argv) + 1)
                j = min(i, len(argv) - 1)
                if op == 0 and argv:
                    argv[j] = rng.choice(pool)
                elif op == 1:
                    argv.insert(i, rng.choice(pool))
                elif op == 2 and argv:
                    del argv[j]
                elif op == 3 and len(argv) > 1:
                    k = rng.randrange(len(argv))
                    argv[j], argv[k] = argv[k], argv[j]
                elif op == 4 and argv:
                    raw = os.fsencode(argv[j])
                    argv[j] = os.fsdecode(m.damage(raw, 1))
                else:
                    argv.insert(i, f"{rng.choice(pool)}={rng.choice(pool)}")
            return self._confine(argv)

        def call(argv: list[str]) -> int:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                rc = cli.main(argv)
            if not isinstance(rc, int):
                raise TypeError(f"exit status {rc!r}")
            return rc

        def roots(argv: list[str]) -> tuple[str, ...]:
            """The sandbox, and what the command line itself names (a root outside it)."""
            named = []
            for tok in argv:
                for part in tok.split("=", 1) if tok.startswith("-") else (tok,):
                    path = self._path(part)
                    if path is not None and os.path.exists(path):
                        named.append(path)
            return (self.top, *named)

        def after(argv: list[str]) -> None:
            if self._fingerprint() != self._root_print:
                shutil.rmtree(self.root)
                shutil.copytree(self.pristine, self.root)
            if CLI_MEMORY_ROOT in argv:
                self._fill_memory_root()

        return Target(
            make,
            call,
            roots=roots,
            after=after,
            cwd=self.cwd,
            context=self._cli_context,
            # Output with a tab, other scripts, undecodable bytes: rich loads its table of
            # character widths on first use.
            warm=[
                self._confine(argv)
                for argv in [*seeds, ["report", "root", "--out", "out/r\udcb8\x0e\tステ.html"]]
            ],
            exit_status=True,
        )

    @contextlib.contextmanager
    def _cli_context(self) -> Iterator[None]:
        """The CLI runs in the sandbox's working directory, and its default shared-memory
        directory is the sandbox's: a hostile ``shm --clean`` must not clean the
        machine's real segments."""
        old = os.getcwd()
        os.chdir(self.cwd)
        try:
            with (
                mock.patch.object(shm, "SHM_DIR", self.shm_dir),
                mock.patch.dict(os.environ, {cli.DEBUG_ENV: "0"}),
            ):
                yield
        finally:
            os.chdir(old)

    def _path(self, text: str) -> str | None:
        """``text`` as an absolute normalized path (from the CLI's working directory)."""
        if not text or "\x00" in text:
            return None
        with contextlib.suppress(ValueError):
            parsed = urlparse(text)
            if parsed.scheme == "file":
                text = parsed.path
            elif parsed.scheme:
                return None
        return os.path.normpath(os.path.join(self.cwd, text))

    def _inside(self, text: str) -> bool:
        path = self._path(text)
        return path is not None and (path + os.sep).startswith(self.top + os.sep)

    def _confine(self, argv: list[str]) -> list[str]:
        """What a campaign must not do, taken out of a command line: object-store URLs
        (the network), ``demo`` (trains a model), and ``--out`` or ``--shm-dir`` values
        outside the sandbox (a write or a ``--clean`` there is what was asked for)."""
        out = []
        for tok in argv:
            with contextlib.suppress(ValueError):
                if urlparse(tok.split("=", 1)[-1]).scheme in OBJECT_SCHEMES:
                    tok = CLI_MEMORY_ROOT
            out.append("ls" if tok == "demo" else tok)
        for i, tok in enumerate(out):
            name, eq, value = tok.partition("=")
            if len(name) > 2 and ("--out".startswith(name) or "--shm-dir".startswith(name)):
                if eq and not self._inside(value):
                    out[i] = f"{name}={self.out}"
                elif not eq and i + 1 < len(out) and not self._inside(out[i + 1]):
                    out[i + 1] = self.out
        return out


def _field_value(m: Mutator, name: str) -> Any:
    r = m.rng
    if name == "magic":
        return r.choice((shm.MAGIC, b"\0" * 8, r.randbytes(8)))
    if name in ("created", "updated"):
        return r.choice((0.0, -1.0, 1e300, float("nan"), float("inf")))
    bits = 32 if name in ("version", "state", "owner_pid", "worker_pid") else 64
    return m.integer() % (1 << bits)


def _no_global(fqn: str) -> Any:
    raise CorruptCheckpointError(f"the snapshot has no tensor {fqn!r}")
