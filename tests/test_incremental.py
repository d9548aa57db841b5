"""Incremental checkpoints (format version 3): correct, verifiable and safe to load.

A job whose model has a frozen part (an embedding and a gate that no optimizer step
changes) beside a trainable head trained by AdamW, and a buffer whose rows change one
at a time, saves many checkpoints. Every checkpoint written while the writer remembers
an earlier one refers to the chunks that did not change instead of writing them again.
These tests check, with real training loops in one process:

- every checkpoint that retention keeps restores bit for bit to the state saved at its
  step, later checkpoints are v3 with ``refs``, and no committed checkpoint refers to a
  step that is not committed (retention keeps what a kept checkpoint refers to);
- a flipped byte in a chunk that later checkpoints share fails every checkpoint that
  refers to it, in ``verify`` and in restore, which falls back past all of them;
- ``resumable export`` of an incremental checkpoint equals that of a whole one;
- hand-edited (re-signed) v3 manifests are refused with `CorruptCheckpointError`, and
  no file outside the root is opened;
- ``min_saving``/``min_live``/``incremental=False`` write whole (v1) checkpoints, and
  changes of structure (resized, reshaped, retyped or new tensors, new optimizer state)
  are written and restored exactly.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import safetensors.torch
import torch
import xxhash
from torch import nn
from torch.nn import functional as F

from resumable import Checkpointer, CorruptCheckpointError, Incremental, Keep, StorageError
from resumable._dtypes import dtype_from_name
from resumable.audit import read_audit
from resumable.cli import main as cli
from resumable.commit import list_committed
from resumable.format import checksum, manifest_digest, tensor_ranges
from resumable.policy import Entry
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, Storage, open_storage
from resumable.storage.base import Buffer, ForwardingStorage

pytestmark = pytest.mark.usefixtures("sync_persist")

LOGGER = "resumable"
DATA = "rank-00000.safetensors"
MANIFEST = "manifest.json"
VOCAB, DIM, OUT = 1024, 64, 8  # the frozen embedding: 256 KiB of float32
BANK_ROWS, BANK_COLS = 64, 256  # a buffer of 64 KiB, one row rewritten per step
CHUNK = 16 << 10  # 16 chunks of embedding, 4 of bank
# This state is small: the defaults (min_bytes=1 MiB, whole_every=10) would write it
# whole; these tests are about what is written when it is written incrementally.
ALWAYS = {"min_bytes": 0, "whole_every": 0}
SMALL_CHUNKS = Incremental(chunk_bytes=CHUNK, **ALWAYS)
EMBEDDING = "model/base.weight"


def dir_name(step: int) -> str:
    return f"step-{step:012d}"


# --------------------------------------------------------------------------- the job


class Net(nn.Module):
    """Frozen embedding and gate, a trainable head, and a buffer updated row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Embedding(VOCAB, DIM)
        self.base.weight.requires_grad_(False)
        self.gate = nn.Linear(DIM, DIM)
        self.gate.requires_grad_(False)
        self.head = nn.Linear(DIM, OUT)
        self.register_buffer("bank", torch.zeros(BANK_ROWS, BANK_COLS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.base(tokens).mean(1)
        return self.head(h + self.gate(h))


class Job:
    """A deterministic training job; ``state`` is what it hands to the Checkpointer.
    Every parameter is in the optimizer; the frozen ones get no gradient, so AdamW
    neither changes them nor keeps state for them."""

    def __init__(self, seed: int = 0, *, frozen: bool = True) -> None:
        self.frozen = frozen
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = Net()
        if not frozen:
            self.model.requires_grad_(True)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.batches = torch.Generator().manual_seed(1000 + seed)
        self.extra: dict[str, Any] = {
            "buf": torch.zeros(16),
            "counter": 0,
            "empty": torch.empty(0, 3),
            "flag": torch.tensor(False),
            "half": torch.zeros(8192, dtype=torch.bfloat16),  # one 16 KiB chunk
            "wide": torch.zeros(4096, dtype=torch.float64),  # two chunks, one changes
        }
        self.state: dict[str, Any] = {
            "model": self.model,
            "optim": self.optim,
            "batches": self.batches,
            "extra": self.extra,
        }

    def train(self, step: int) -> float:
        tokens = torch.randint(0, VOCAB, (16, 4), generator=self.batches)
        target = torch.randn(16, OUT, generator=self.batches)
        loss = F.mse_loss(self.model(tokens), target)
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        with torch.no_grad():
            row = torch.arange(BANK_COLS, dtype=torch.float32) / BANK_COLS
            self.model.bank[step % BANK_ROWS] = row + step
            self.extra["wide"][step % 2048] = step
            if not self.frozen:  # every tensor changes
                self.model.bank.add_(1.0)
                if "buf" in self.extra:
                    self.extra["buf"].add_(1.0)
                self.extra["flag"].logical_not_()
                self.extra["half"].fill_(step % 200)
                self.extra["wide"].add_(1.0)
        self.extra["counter"] = step
        return float(loss.item())

    def record(self) -> dict[str, Any]:
        """Copies of everything a restore must reproduce."""
        out: dict[str, Any] = {
            f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()
        }
        sd = self.optim.state_dict()
        for i, st in sd["state"].items():
            for k, v in st.items():
                out[f"optim/{i}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        out["optim/param_groups"] = copy.deepcopy(sd["param_groups"])
        out["batches"] = self.batches.get_state().clone()
        for k, v in self.extra.items():
            out[f"extra/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        return out

    def mismatches(self, expected: dict[str, Any]) -> list[str]:
        actual = self.record()
        bad = []
        for name in sorted(set(actual) | set(expected)):
            a, e = actual.get(name), expected.get(name)
            if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
                same = a.dtype == e.dtype and a.shape == e.shape and _bytes(a) == _bytes(e)
            else:
                same = name in actual and name in expected and a == e
            if not same:
                bad.append(name)
        return bad


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """Restoring sets the global random streams; give other tests theirs back."""
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(pt)


def run(
    root: Path | str,
    job: Job,
    steps: Iterable[int],
    *,
    keep: Keep | None = None,
    incremental: Any = SMALL_CHUNKS,
    persist: str = "sync",
    restore: int | None = None,
    metrics: Callable[[int, float], float] = lambda step, loss: loss,
    after_save: Callable[[Checkpointer, int], None] | None = None,
    before_train: Callable[[Job, int], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Train and save one step at a time in one Checkpointer (one process's writer);
    returns the state recorded at each save. ``restore``: a step to restore first (a
    relaunch)."""
    expected: dict[int, dict[str, Any]] = {}
    with Checkpointer(root, job.state, keep=keep, persist=persist, incremental=incremental) as ckpt:
        if restore is not None:
            assert ckpt.restore(restore) == restore
        for step in steps:
            if before_train is not None:
                before_train(job, step)
            loss = job.train(step)
            ckpt.save(step, metrics={"loss": metrics(step, loss)})
            ckpt.wait()
            expected[step] = job.record()
            if after_save is not None:
                after_save(ckpt, step)
    return expected


def restored(root: Path | str, step: int, *, seed: int = 99) -> Job:
    """A fresh job (other weights) after restoring ``step`` of ``root``."""
    job = Job(seed=seed)
    with Checkpointer(root, job.state, keep=None, persist="sync") as ckpt:
        assert ckpt.restore(step) == step
    return job


# --------------------------------------------------------------------------- manifests


def manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / dir_name(step) / MANIFEST).read_bytes())


def write_manifest(root: Path, step: int, m: dict[str, Any]) -> None:
    """Write an edited manifest re-signed, as a forger would."""
    m["digest"] = manifest_digest(m)
    (root / dir_name(step) / MANIFEST).write_text(json.dumps(m, indent=1))


def committed(root: Path) -> list[int]:
    return list_committed(open_storage(root))


def chunk_steps(m: dict[str, Any]) -> set[int]:
    return {s for t in m["tensors"].values() for s, *_ in tensor_ranges(t) if s is not None}


def own_bytes(m: dict[str, Any]) -> int:
    return sum(f["size"] for f in m["files"].values())


def check_references(root: Path) -> None:
    """Every committed v3 checkpoint refers only to earlier committed checkpoints, by
    data files they hold and byte ranges inside them; its extents tile each tensor,
    each source used, and no two extents in a row lie back to back in one source (the
    writer merges those)."""
    steps = set(committed(root))
    for s in sorted(steps):
        m = manifest(root, s)
        if m["format_version"] == 1:
            assert "refs" not in m
            assert all("sources" not in t and "extents" not in t for t in m["tensors"].values())
            continue
        assert m["format_version"] == 3, (s, m["format_version"])
        refs = m["refs"]
        assert refs == sorted(set(refs)) and all(r < s for r in refs), (s, refs)
        assert set(refs) <= steps, f"{dir_name(s)} refers to {set(refs) - steps}: not committed"
        assert chunk_steps(m) <= set(refs), (s, chunk_steps(m), refs)
        for name, t in m["tensors"].items():
            assert "file" not in t and "offsets" not in t and "chunks" not in t, (s, name)
            assert len(t["extents"]) % 3 == 0, (s, name)
            used = set(t["extents"][::3])
            assert used == set(range(len(t["sources"]))), (s, name, t["sources"], used)
            ranges = tensor_ranges(t)
            for a, b in itertools.pairwise(ranges):
                assert not (a[:2] == b[:2] and a[3] == b[2]), (s, name, "unmerged", a, b)
            total = 0
            for step, fname, begin, end in ranges:
                holder = m if step is None else manifest(root, step)
                assert fname in holder["files"], (s, name, step, fname)
                assert 0 <= begin <= end <= holder["files"][fname]["size"], (s, name, begin, end)
                total += end - begin
            numel = int(np.prod(t["shape"])) if t["shape"] else 1
            assert (
                total == numel * torch.empty((), dtype=dtype_from_name(t["dtype"])).element_size()
            )


def closure(root: Path, steps: Iterable[int]) -> set[int]:
    """``steps`` and every step they refer to."""
    out, todo = set(), list(steps)
    while todo:
        s = todo.pop()
        if s not in out:
            out.add(s)
            todo.extend(manifest(root, s).get("refs", []))
    return out


def audit(root: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in read_audit(open_storage(root)) if e.get("event") == event]


# --------------------------------------------------------------------------- 1. long run


def test_long_run_with_retention_restores_every_kept_checkpoint_exactly(tmp_path: Path) -> None:
    """120 saves with Keep(last=2, every_steps=25, best by loss) and two pins (one by
    the API, one by the CLI). After every save no committed checkpoint refers to a
    missing one; at the end exactly the kept steps and what they refer to remain,
    each restores bit for bit, and the v3 ones wrote a fraction of a whole one."""
    root = tmp_path / "ckpt"
    keep = Keep(last=2, every_steps=25, best=("loss", "min", 1))
    best_step, api_pin, cli_pin, total = 42, 37, 61, 120

    def after_save(ckpt: Checkpointer, step: int) -> None:
        if step == api_pin:
            ckpt.pin(step)
        if step == cli_pin:
            assert cli(["pin", str(root), str(step)]) == 0
        check_references(root)

    expected = run(
        root,
        Job(),
        range(1, total + 1),
        keep=keep,
        metrics=lambda step, loss: 0.0 if step == best_step else loss + 1.0,
        after_save=after_save,
    )

    steps = committed(root)
    entries = [Entry(s, manifest(root, s)["metrics"]) for s in steps]
    retained = keep.retained(entries, {api_pin, cli_pin})
    assert retained == {total - 1, total, 25, 50, 75, 100, best_step, api_pin, cli_pin}
    assert set(steps) == closure(root, retained), "retention kept too little or too much"
    assert len(audit(root, "delete")) == total - len(steps) > 90

    whole = manifest(root, 1)
    assert 1 in steps and whole["format_version"] == 1  # the first persist is whole
    for s in steps[1:]:
        m = manifest(root, s)
        assert m["format_version"] == 3 and 1 in m["refs"], (s, m.get("refs"))
        # frozen, written whole at step 1: one extent there
        assert [r[0] for r in tensor_ranges(m["tensors"][EMBEDDING])] == [1], s
        assert own_bytes(m) < own_bytes(whole) // 4, (s, own_bytes(m), own_bytes(whole))
    commits = {e["step"]: e for e in audit(root, "commit")}
    for s in steps:
        blob = (root / dir_name(s) / MANIFEST).stat().st_size
        assert commits[s]["bytes"] == own_bytes(manifest(root, s)) + blob, s

    storage = open_storage(root)
    for s in steps:
        CheckpointReader(storage, s).verify()
        assert restored(root, s).mismatches(expected[s]) == [], s
        # what retention checks without NumPy (in a persist worker) is what a restore reads
        bounds = CheckpointReader(storage, s)._referred_bounds()
        assert bounds == CheckpointReader(storage, s)._file_plan().bounds, s
        assert bool(bounds) == (s != 1), s
    check_references(root)


def test_worker_process_writes_incrementally_and_a_relaunch_writes_whole(tmp_path: Path) -> None:
    """The persist worker process remembers the last index too; a relaunch's first
    persist is whole, and its later ones refer only to what it wrote itself."""
    root = tmp_path / "ckpt"
    job = Job()
    expected = run(root, job, range(1, 9), keep=Keep(last=2), persist="process")
    check_references(root)
    assert committed(root) == [1, 7, 8]
    assert [manifest(root, s)["format_version"] for s in (1, 7, 8)] == [1, 3, 3]
    expected |= run(root, job, range(9, 13), keep=None, persist="process", restore=8)
    check_references(root)
    assert manifest(root, 9)["format_version"] == 1
    for s in (10, 11, 12):
        assert manifest(root, s)["format_version"] == 3
        assert min(manifest(root, s)["refs"]) >= 9, manifest(root, s)["refs"]
    for s in committed(root):
        assert restored(root, s).mismatches(expected[s]) == [], s


# --------------------------------------------------------------------------- 2. damage


def locate(m: dict[str, Any], name: str, at: int) -> tuple[int | None, int]:
    """Where byte ``at`` of tensor ``name`` lies: (the step holding it, None for the
    manifest's own; the offset in that step's data file)."""
    pos = 0
    for step, _, begin, end in tensor_ranges(m["tensors"][name]):
        if pos <= at < pos + end - begin:
            return step, begin + at - pos
        pos += end - begin
    raise AssertionError(f"{name} has only {pos} bytes, not {at + 1}")


def refers_to(m: dict[str, Any], step: int, own: int, offset: int) -> bool:
    """Whether the checkpoint of manifest ``m`` (of step ``own``) reads byte ``offset``
    of step ``step``'s data file."""
    return any(
        (own if s is None else s) == step and begin <= offset < end
        for t in m["tensors"].values()
        for s, _, begin, end in tensor_ranges(t)
    )


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """Steps 1-5 by one launch (1 whole, 2-5 refer to it), 6-10 by a relaunch (6 whole,
    7-10 refer to 6); keep=None."""
    root = tmp_path_factory.mktemp("two") / "ckpt"
    job = Job()
    expected = run(root, job, range(1, 6))
    expected |= run(root, job, range(6, 11), restore=5)
    check_references(root)
    assert [manifest(root, s)["format_version"] for s in range(1, 11)] == [1, 3, 3, 3, 3] * 2
    for s in range(7, 11):
        assert min(manifest(root, s)["refs"]) == 6
    return root, expected


def _copy(src: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(src, root)
    return root


def _verify_all(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[int, bool]:
    capsys.readouterr()
    rc = cli(["verify", str(root), "--all", "--json"])
    results = {r["step"]: r["ok"] for r in json.loads(capsys.readouterr().out)}
    assert rc == (0 if all(results.values()) else 1)
    return results


def test_damaged_shared_chunk_fails_every_checkpoint_referring_to_it(
    two_launches: tuple[Path, dict[int, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    src, expected = two_launches
    root = _copy(src, tmp_path)
    holder, offset = locate(manifest(root, 8), EMBEDDING, 5 * CHUNK + CHUNK // 2)  # chunk 5
    assert holder == 6
    flip(root / dir_name(6) / DATA, offset)
    referring = {s for s in range(1, 11) if refers_to(manifest(root, s), 6, s, offset)}
    assert referring == set(range(6, 11))

    storage = open_storage(root)
    for s in range(1, 11):
        if s in referring:
            with pytest.raises(CorruptCheckpointError):
                CheckpointReader(storage, s).verify()
        else:
            CheckpointReader(storage, s).verify()
    assert _verify_all(root, capsys) == {s: s not in referring for s in range(1, 11)}

    job = Job(seed=99)
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        Checkpointer(root, job.state, keep=None) as ckpt,
    ):
        assert ckpt.restore() == 5
    assert job.mismatches(expected[5]) == []
    assert [e["step"] for e in audit(root, "skip")] == [10, 9, 8, 7, 6]
    for s in referring:
        assert any(dir_name(s) in r.getMessage() for r in caplog.records), s

    out = tmp_path / "model.safetensors"
    assert cli(["export", str(root), "--step", "8", "--key", "model", "--out", str(out)]) == 2
    assert not out.exists()
    assert cli(["export", str(root), "--key", "model", "--out", str(out)]) == 0
    assert safetensors.torch.load_file(out)["base.weight"].equal(expected[5][EMBEDDING])


BANK = "model/bank"


def falls_back(root: Path, *, damaged: int, to: int, expected: dict[str, Any]) -> None:
    """Restoring step ``damaged`` fails and leaves a fresh job's state as it was; a
    restore of the newest then gives back step ``to`` exactly."""
    job = Job(seed=99)
    before = job.record()
    with Checkpointer(root, job.state, keep=None) as ckpt, pytest.raises(CorruptCheckpointError):
        ckpt.restore(damaged)
    assert job.mismatches(before) == []
    with Checkpointer(root, job.state, keep=None) as ckpt:
        assert ckpt.restore() == to
    assert job.mismatches(expected) == []


def test_a_partly_changed_tensor_is_assembled_in_its_destination_once_verified(
    two_launches: tuple[Path, dict[int, Any]], tmp_path: Path
) -> None:
    """The bank of step 10: its first chunk is step 10's own, the rest step 6's (one
    extent, merged). Given a
    destination, the reader checks the checksum over the chunks where they lie and
    returns the destination untouched; `fill` then copies the chunks in. A flipped
    byte in step 6's part fails the read before anything is copied."""
    src, expected = two_launches
    root = _copy(src, tmp_path)
    m = manifest(root, 10)
    assert [r[0] for r in tensor_ranges(m["tensors"][BANK])] == [None, 6]
    assert [locate(m, BANK, i * CHUNK)[0] for i in range(4)] == [None, 6, 6, 6]
    dest = torch.full((BANK_ROWS, BANK_COLS), -1.0)
    reader = CheckpointReader(open_storage(root), 10)
    reader.check_files()
    got = reader.tensors([BANK, "extra/wide"], into={BANK: dest})
    assert got[BANK] is dest
    assert bool((dest == -1.0).all())  # nothing copied yet
    assert got["extra/wide"].equal(expected[10]["extra/wide"])  # no destination: a buffer
    reader.fill()
    assert dest.equal(expected[10][BANK])

    # A restore hands the reader the live bank (a module's buffer) as its destination.
    filled: list[torch.Tensor] = []
    fill = CheckpointReader.fill

    def spy(self: CheckpointReader) -> None:
        filled.extend(d for d, _ in self._fills)
        fill(self)

    job = Job(seed=99)
    with (
        mock.patch.object(CheckpointReader, "fill", spy),
        Checkpointer(root, job.state, keep=None) as ckpt,
    ):
        assert ckpt.restore() == 10
    # (with an older checkpoint to fall back to, plain containers' tensors are
    # destinations too: checked while copied, `tests/test_storage_fused.py`)
    assert job.model.bank.data_ptr() in [d.data_ptr() for d in filled]
    assert job.mismatches(expected[10]) == []

    holder, offset = locate(m, BANK, 2 * CHUNK + CHUNK // 2)  # the middle of chunk 2
    assert holder == 6
    flip(root / dir_name(6) / DATA, offset)
    dest.fill_(-1.0)
    reader = CheckpointReader(open_storage(root), 10)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'model/bank'"):
        reader.tensors([BANK], into={BANK: dest})
    reader.fill()
    assert bool((dest == -1.0).all())

    # A restore: every checkpoint that reads the damaged chunk fails before the live
    # state changes; the newest one that does not is restored exactly.
    falls_back(root, damaged=10, to=5, expected=expected[5])


@pytest.mark.parametrize("threads", [1, 3])
def test_pieces_of_every_size_are_copied_exactly(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 6 MiB table cut into 4 KiB chunks, a few rows changed per save: its pieces are
    changed runs of a chunk or two and unchanged runs of up to megabytes, in four
    files. Assembled in a buffer and in a destination (large pieces shared among
    ``threads`` threads, small ones a piece at a time), the bytes are the saved ones,
    and a flipped byte in a large piece fails the checksum."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rows, cols = 6 * 1024, 256  # 1 KiB rows
    table = torch.zeros(rows, cols)
    state = {"table": table}
    gen = torch.Generator().manual_seed(7)
    inc = Incremental(chunk_bytes=4096, **ALWAYS)
    with Checkpointer(tmp_path, state, persist="sync", keep=None, incremental=inc) as ckpt:
        for step in range(1, 5):
            picked = torch.randint(0, rows, (3 + step,), generator=gen)
            table[picked] += torch.rand(len(picked), cols, generator=gen)
            if step == 4:
                table[rows // 2 : rows // 2 + 2048] += 1.0  # a 2 MiB run of step 4's own
            ckpt.save(step)
    m = manifest(tmp_path, 4)
    lengths = [end - begin for _, _, begin, end in tensor_ranges(m["tensors"]["table"])]
    assert max(lengths) >= 2 << 20 and min(lengths) <= 8192
    assert len({step for step, *_ in tensor_ranges(m["tensors"]["table"])}) == 4
    reader = CheckpointReader(open_storage(tmp_path), 4)
    reader.check_files()
    assert reader.tensors(["table"])["table"].equal(table)  # assembled in a buffer
    dest = torch.full_like(table, -1.0)
    assert reader.tensors(["table"], into={"table": dest})["table"] is dest
    reader.fill()
    assert dest.equal(table)

    holder, offset = locate(m, "table", rows // 2 * cols * 4 + 4096)  # in the 2 MiB run
    assert holder is None
    flip(tmp_path / dir_name(4) / DATA, offset)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'table'"):
        CheckpointReader(open_storage(tmp_path), 4).tensors(["table"], into={"table": dest})


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_pieces_copied_on_threads_land_where_they_belong(threads: int) -> None:
    """`MappedPieces.copy_into` with pieces from 3 bytes to 300 KiB in three sources, in an
    order that jumps between them: every byte lands at its place, whether a piece is
    copied by the calling thread, whole by one of ``threads`` threads, or cut between
    two of them."""
    from resumable._mapped_pieces import SPLIT, MappedPieces

    rng = np.random.default_rng(threads)
    sources = {
        k: memoryview(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()) for k in (0, 2, 5)
    }
    rows, sizes = [], [3, 4096, SPLIT - 1, SPLIT, SPLIT + 5, 300 << 10, 17]
    for n in sizes * 4:
        k = int(rng.choice([0, 2, 5]))
        b = int(rng.integers(0, (1 << 20) - n))
        rows.append((k, b, b + n))
    want = b"".join(bytes(sources[k][b:e]) for k, b, e in rows)
    dest = torch.full((len(want),), 7, dtype=torch.uint8)
    with mock.patch.object(torch, "get_num_threads", return_value=threads):
        MappedPieces(sources, np.array(rows, dtype=np.int64)).copy_into(dest)
    assert bytes(dest.numpy()) == want


@pytest.mark.parametrize("threads", [1, 2])
def test_pieces_in_place_in_a_file_are_copied_as_one_range_then_overwritten(threads: int) -> None:
    """A tensor that one file held whole (at byte 100), of which 300 scattered chunks
    (1 KiB to 80 KiB, some back to back) lie in two other files: `MappedPieces` copies the
    whole range from the first file, then every other piece over it, and the result
    is the tensor's bytes, not the first file's."""
    from resumable._mapped_pieces import MappedPieces, in_place

    rng = np.random.default_rng(threads)
    n = 8 << 20
    held = rng.integers(0, 256, n + 200, dtype=np.uint8)
    newer = {k: rng.integers(0, 256, 8 << 20, dtype=np.uint8) for k in (1, 2)}
    want = held[100 : 100 + n].copy()
    rows, at, free = [], 0, {1: 0, 2: 0}
    for pos in sorted(rng.choice(n // 1024 - 100, 300, replace=False).tolist()):
        pos *= 1024
        if pos < at:
            continue
        size = int(rng.choice([1024, 4096, 80 << 10], p=[0.6, 0.35, 0.05]))
        if pos > at:
            rows.append((0, 100 + at, 100 + pos))  # in place in the first file
        k = int(rng.integers(1, 3))
        rows.append((k, free[k], free[k] + size))
        want[pos : pos + size] = newer[k][free[k] : free[k] + size]
        free[k] += size
        at = pos + size
    rows.append((0, 100 + at, 100 + n))
    a = np.array(rows, dtype=np.int64)
    lengths = a[:, 2] - a[:, 1]
    assert in_place(a, np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) is not None
    sources = {
        0: memoryview(held.tobytes()),
        **{k: memoryview(v.tobytes()) for k, v in newer.items()},
    }
    dest = torch.zeros(n, dtype=torch.uint8)
    with mock.patch.object(torch, "get_num_threads", return_value=threads):
        MappedPieces(sources, a).copy_into(dest)
    assert np.array_equal(dest.numpy(), want)


@pytest.mark.parametrize(
    "row, dest_bytes",
    [
        ((0, (1 << 20) - 10, (1 << 20) + 100_000), 10 + 100_010),  # past its file's end
        ((0, -5, 100_000), 10 + 100_005),  # before its start
        ((0, 1000, 900), 0),  # ends before it begins
        ((0, 0, 100_000), 10 + 99_999),  # one byte more than the destination holds
    ],
)
def test_pieces_out_of_bounds_are_refused_before_any_copy(
    row: tuple[int, int, int], dest_bytes: int
) -> None:
    """The raw copies trust no caller: a piece outside its file, a negative one, or
    pieces that do not add up to the destination raise `CorruptCheckpointError`, and
    the destination is untouched."""
    from resumable._mapped_pieces import MappedPieces

    sources = {0: memoryview(bytes(1 << 20))}
    dest = torch.full((max(dest_bytes, 1),), 7, dtype=torch.uint8)[:dest_bytes]
    with pytest.raises(CorruptCheckpointError, match="do not fit"):
        MappedPieces(sources, np.array([(0, 0, 10), row], dtype=np.int64)).copy_into(dest)
    assert bool((dest == 7).all())


def test_damage_no_later_checkpoint_refers_to_fails_only_its_holder(
    two_launches: tuple[Path, dict[int, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The head of step 6 changed at step 7: damage there is step 6's alone."""
    src, expected = two_launches
    root = _copy(src, tmp_path)
    begin, end = manifest(root, 6)["tensors"]["model/head.weight"]["offsets"]
    offset = (begin + end) // 2
    assert not any(refers_to(manifest(root, s), 6, s, offset) for s in range(7, 11))
    flip(root / dir_name(6) / DATA, offset)
    assert _verify_all(root, capsys) == {s: s != 6 for s in range(1, 11)}
    assert restored(root, 10).mismatches(expected[10]) == []
    falls_back(root, damaged=6, to=10, expected=expected[10])


def test_damaged_first_whole_checkpoint_leaves_nothing_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every checkpoint of one launch refers to its first: a flipped byte of the frozen
    embedding there fails them all, and restore refuses to start over (as with full
    checkpoints that are all corrupt). The newest, with older ones to fall back to, was
    checked while it was copied into the live state: the error says the state holds
    part of it. A step asked for is checked before anything is copied: the state is
    left untouched."""
    root = tmp_path / "ckpt"
    run(root, Job(), range(1, 5))
    holder, offset = locate(manifest(root, 4), EMBEDDING, 3)
    assert holder == 1
    flip(root / dir_name(1) / DATA, offset)
    assert _verify_all(root, capsys) == {1: False, 2: False, 3: False, 4: False}
    job = Job(seed=99)
    before = job.record()
    with (
        Checkpointer(root, job.state, keep=None) as ckpt,
        pytest.raises(CorruptCheckpointError, match="none is valid") as info,
    ):
        ckpt.restore()
    assert f"The live state holds part of {dir_name(2)}" in str(info.value)  # the last copied
    job = Job(seed=99)
    with (
        Checkpointer(root, job.state, keep=None) as ckpt,
        pytest.raises(CorruptCheckpointError, match="checksum mismatch"),
    ):
        ckpt.restore(4)
    assert job.mismatches(before) == []


# --------------------------------------------------------------------------- 3. export


@pytest.mark.parametrize(
    "incremental", [SMALL_CHUNKS, Incremental(**ALWAYS)], ids=["16KiB", "default"]
)
@pytest.mark.parametrize("key", ["model", "optim", "extra"])
def test_export_of_incremental_equals_export_of_whole(
    incremental: Incremental, key: str, tmp_path: Path
) -> None:
    inc, whole = tmp_path / "inc", tmp_path / "whole"
    expected = run(inc, Job(), range(1, 7), incremental=incremental)
    assert run(whole, Job(), range(1, 7), incremental=False).keys() == expected.keys()
    assert manifest(inc, 6)["format_version"] == 3
    assert manifest(whole, 6)["format_version"] == 1
    outs = []
    for root in (inc, whole):
        out = tmp_path / f"{root.name}-{key}.safetensors"
        assert cli(["export", str(root), "--step", "6", "--key", key, "--out", str(out)]) == 0
        outs.append(safetensors.torch.load_file(out))
    a, b = outs
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert _bytes(a[name]) == _bytes(b[name]), name
    if key == "model":
        for name, t in a.items():
            assert _bytes(t) == _bytes(expected[6][f"model/{name}"]), name


# --------------------------------------------------------------------------- 4. hostile


@pytest.fixture(scope="module")
def hostile_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """Steps 1-3 by one launch (1 whole; 2 and 3 refer to 1), 4 by a relaunch (whole:
    the same frozen bytes as step 1, in its own file)."""
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    job = Job()
    expected = run(root, job, range(1, 4))
    expected |= run(root, job, [4], restore=3)
    assert [manifest(root, s)["format_version"] for s in (1, 2, 3, 4)] == [1, 3, 3, 1]
    return root, expected


def _data(root: Path, step: int, begin: int, end: int, fname: str = DATA) -> bytes:
    return (root / dir_name(step) / fname).read_bytes()[begin:end]


Range = tuple[int | None, str, int, int]  # (step or None for the manifest's own, file, begin, end)


def _rehash(root: Path, m: dict[str, Any], name: str) -> None:
    """Recompute a tensor's checksum from the bytes its (edited) extents name, so that
    only the structural checks can catch the edit."""
    whole = b"".join(
        _data(root, m["step"] if step is None else step, begin, end, fname=fname)
        for step, fname, begin, end in tensor_ranges(m["tensors"][name])
    )
    m["tensors"][name]["xxh3_64"] = checksum(whole)


def _set_ranges(t: dict[str, Any], ranges: Iterable[Range]) -> None:
    """Write ``ranges`` (as `tensor_ranges` gives them) into entry ``t`` as its sources
    and extents, one extent each (none merged)."""
    sources: dict[tuple[int | None, str], int] = {}
    extents: list[int] = []
    for step, fname, begin, end in ranges:
        extents += (sources.setdefault((step, fname), len(sources)), begin, end)
    t["sources"] = [{"file": f} if s is None else {"step": s, "file": f} for s, f in sources]
    t["extents"] = extents


def _chunked(t: dict[str, Any]) -> list[Range]:
    """``t``'s ranges cut at every `CHUNK` bytes of the tensor: the chunks the writer
    compared, one by one (as version 2 listed them), which version 3 merges."""
    out: list[Range] = []
    pos = 0  # the tensor's bytes before the range
    for step, fname, begin, end in tensor_ranges(t):
        while begin < end:
            cut = min(end, begin + CHUNK - pos % CHUNK)
            out.append((step, fname, begin, cut))
            pos += cut - begin
            begin = cut
    return out


def _unmerged(m: dict[str, Any], name: str) -> dict[str, Any]:
    """Tensor ``name``'s entry with an extent per chunk: an edit of chunk i edits the
    i-th extent, and the rest stays valid (as `test_unedited_template_is_valid` checks)."""
    t: dict[str, Any] = m["tensors"][name]
    _set_ranges(t, _chunked(t))
    return t


def _own_tensor(m: dict[str, Any], prefix: str) -> str:
    """A tensor of step 3 lying in its own file, one extent."""
    return next(
        n
        for n, t in m["tensors"].items()
        if n.startswith(prefix) and [r[0] for r in tensor_ranges(t)] == [None]
    )


def _emb_source(m: dict[str, Any]) -> dict[str, Any]:
    """The embedding's one source: step 1's data file (it was written whole there)."""
    sources: list[dict[str, Any]] = m["tensors"][EMBEDDING]["sources"]
    assert sources == [{"step": 1, "file": DATA}], sources
    return sources[0]


def h_own_step(root: Path, m: dict[str, Any]) -> None:
    _emb_source(m)["step"] = 3
    m["refs"] = sorted(set(m["refs"]) | {3})


def h_later_step(root: Path, m: dict[str, Any]) -> None:
    """Step 4 holds the very same embedding bytes: only "a chunk's step is earlier than
    its own" refuses this one."""
    b4, _ = manifest(root, 4)["tensors"][EMBEDDING]["offsets"]
    t = m["tensors"][EMBEDDING]
    ranges = tensor_ranges(t)
    assert all(r[:2] == (1, DATA) for r in ranges), ranges
    b1 = ranges[0][2]
    _set_ranges(t, [(4, f, begin - b1 + b4, end - b1 + b4) for _, f, begin, end in ranges])
    _rehash(root, m, EMBEDDING)
    m["refs"] = sorted(set(m["refs"]) | {4})


def h_not_in_refs(root: Path, m: dict[str, Any]) -> None:
    m["refs"] = [r for r in m["refs"] if r != 1]


def _chunk_to_step(m: dict[str, Any], index: int, step: int) -> None:
    """The embedding's chunk ``index`` read from the same range of step ``step``."""
    t = _unmerged(m, EMBEDDING)
    ranges = tensor_ranges(t)
    ranges[index] = (step, *ranges[index][1:])
    _set_ranges(t, ranges)
    m["refs"] = sorted(set(m["refs"]) | {step})


def h_ref_missing(root: Path, m: dict[str, Any]) -> None:
    _chunk_to_step(m, 2, 2)  # step 2 holds no embedding


def h_ref_absent_step(root: Path, m: dict[str, Any]) -> None:
    _chunk_to_step(m, 1, 0)


def h_holder_uncommitted(root: Path, m: dict[str, Any]) -> None:
    """Step 1's manifest is gone (its data file stays): step 1 is not committed."""
    (root / dir_name(1) / MANIFEST).unlink()


def h_manifest_as_data(root: Path, m: dict[str, Any]) -> None:
    """A small tensor read from step 1's manifest.json, checksums forged to match."""
    name = _own_tensor(m, "model/head.bias")
    [(_, _, begin, end)] = tensor_ranges(m["tensors"][name])
    _set_ranges(m["tensors"][name], [(1, MANIFEST, 0, end - begin)])
    _rehash(root, m, name)


def h_other_rank_file(root: Path, m: dict[str, Any]) -> None:
    shutil.copy(root / dir_name(1) / DATA, root / dir_name(1) / "rank-00001.safetensors")
    _emb_source(m)["file"] = "rank-00001.safetensors"


def h_own_file_unlisted(root: Path, m: dict[str, Any]) -> None:
    name = _own_tensor(m, "model/head.bias")
    [(_, _, begin, end)] = tensor_ranges(m["tensors"][name])
    _set_ranges(m["tensors"][name], [(None, MANIFEST, 0, end - begin)])
    _rehash(root, m, name)


def h_overlap_in_tensor(root: Path, m: dict[str, Any]) -> None:
    t = _unmerged(m, EMBEDDING)
    t["extents"][4:6] = [o - 8 for o in t["extents"][4:6]]  # chunk 1: 8 bytes of chunk 0
    _rehash(root, m, EMBEDDING)


def h_overlap_across_tensors(root: Path, m: dict[str, Any]) -> None:
    """exp_avg_sq read from exp_avg's bytes (same shape): checksums all agree."""
    a = next(n for n in m["tensors"] if n.endswith("/exp_avg"))
    b = a.replace("exp_avg", "exp_avg_sq")
    for key in ("sources", "extents", "xxh3_64"):
        m["tensors"][b][key] = copy.deepcopy(m["tensors"][a][key])


def h_chunks_short(root: Path, m: dict[str, Any]) -> None:
    t = _unmerged(m, EMBEDDING)
    del t["extents"][-3:]  # the last chunk
    _rehash(root, m, EMBEDDING)


def h_chunk_shortened(root: Path, m: dict[str, Any]) -> None:
    m["tensors"][EMBEDDING]["extents"][-1] -= 4
    _rehash(root, m, EMBEDDING)


def h_chunk_longer(root: Path, m: dict[str, Any]) -> None:
    m["tensors"][EMBEDDING]["extents"][2] += 4


def h_past_end(root: Path, m: dict[str, Any]) -> None:
    size = (root / dir_name(1) / DATA).stat().st_size
    t = _unmerged(m, EMBEDDING)
    n = t["extents"][-1] - t["extents"][-2]
    t["extents"][-2:] = [size, size + n]  # no byte inside the file: no overlap to catch


def h_own_run_split(root: Path, m: dict[str, Any]) -> None:
    """The bank's changed chunk, written to step 3's own file as one U8 entry, listed as
    two extents: the same bytes, so the same checksum, and still tiling the tensor; but
    no entry of that file holds either half."""
    t = m["tensors"][BANK]
    ext = t["extents"]
    own = [i for i, src in enumerate(t["sources"]) if "step" not in src]
    at = next(i for i in range(0, len(ext), 3) if ext[i] in own)
    s, b, e = ext[at : at + 3]
    ext[at : at + 3] = [s, b, (b + e) // 2, s, (b + e) // 2, e]


def h_reversed_range(root: Path, m: dict[str, Any]) -> None:
    t = _unmerged(m, EMBEDDING)
    t["extents"][10:12] = t["extents"][10:12][::-1]  # chunk 3's begin and end


def h_dotdot_outside(root: Path, m: dict[str, Any]) -> None:
    """The file outside the root is a copy of step 1's data: it would checksum fine."""
    _emb_source(m)["file"] = "../../outside.safetensors"


def h_dotdot_sibling(root: Path, m: dict[str, Any]) -> None:
    source = _emb_source(m)
    source["file"] = f"../{dir_name(1)}/{DATA}"
    del source["step"]


def h_path_not_basename(root: Path, m: dict[str, Any]) -> None:
    _emb_source(m)["file"] = f"{dir_name(1)}/{DATA}"


def h_holder_file_symlink(root: Path, m: dict[str, Any]) -> None:
    """Step 1's data file is a link to a copy of itself outside the root: the bytes
    would checksum fine, but nothing outside the root may be read."""
    (root / dir_name(1) / DATA).unlink()
    (root / dir_name(1) / DATA).symlink_to(root.parent / "outside.safetensors")


def h_step_bool(root: Path, m: dict[str, Any]) -> None:
    _emb_source(m)["step"] = True  # == 1 in Python


def h_extent_bool(root: Path, m: dict[str, Any]) -> None:
    m["tensors"][EMBEDDING]["extents"][0] = False  # == 0 in Python: source 0


def h_refs_not_list(root: Path, m: dict[str, Any]) -> None:
    m["refs"] = 1


def h_refs_missing(root: Path, m: dict[str, Any]) -> None:
    del m["refs"]


def h_v1_with_extents(root: Path, m: dict[str, Any]) -> None:
    m["format_version"] = 1
    del m["refs"]  # (a version 1 manifest has none; with them it fails for them)


def h_v2_with_extents(root: Path, m: dict[str, Any]) -> None:
    m["format_version"] = 2


def h_v3_with_chunks(root: Path, m: dict[str, Any]) -> None:
    """The embedding as version 2 wrote it (a well-formed chunk list) in a v3 manifest."""
    t = m["tensors"][EMBEDDING]
    t["chunks"] = [
        {
            "file": f,
            "offsets": [begin, end],
            "xxh3_128": xxhash.xxh3_128_hexdigest(_data(root, s, begin, end, f)),
            "step": s,
        }
        for s, f, begin, end in _chunked(t)
    ]
    del t["sources"], t["extents"]


def h_sources_not_list(root: Path, m: dict[str, Any]) -> None:
    t = m["tensors"][EMBEDDING]
    t["sources"] = {"0": t["sources"][0]}


def h_source_unknown_key(root: Path, m: dict[str, Any]) -> None:
    """A key a source does not have: version 2's chunk hash (of the right bytes)."""
    [(s, f, begin, end)] = tensor_ranges(m["tensors"][EMBEDDING])
    _emb_source(m)["xxh3_128"] = xxhash.xxh3_128_hexdigest(_data(root, s, begin, end, f))


def h_extents_not_flat(root: Path, m: dict[str, Any]) -> None:
    t = _unmerged(m, EMBEDDING)
    t["extents"] = [t["extents"][i : i + 3] for i in range(0, len(t["extents"]), 3)]


def h_extents_not_triples(root: Path, m: dict[str, Any]) -> None:
    t = _unmerged(m, EMBEDDING)
    t["extents"].pop()  # the last chunk's end


def h_extent_source_out_of_range(root: Path, m: dict[str, Any]) -> None:
    t = _unmerged(m, EMBEDDING)
    t["extents"][6] = len(t["sources"])  # chunk 2 in a source the entry does not list


# name: (edit, the step a plain restore falls back to once step 4 is removed, or None
# where the edit needs step 4 (0: nothing valid is left), what the refusal says)
HOSTILE: dict[str, tuple[Callable[[Path, dict[str, Any]], None], int | None, str]] = {
    "chunk-step-is-own": (h_own_step, 2, "refs must be increasing steps before step 3"),
    "chunk-step-is-later": (h_later_step, None, "refs must be increasing steps before step 3"),
    "chunk-step-not-in-refs": (h_not_in_refs, 2, "refers to step 1, which is not among"),
    "chunk-in-step-without-that-file-range": (h_ref_missing, 2, "lies outside the data of"),
    "ref-to-absent-step": (h_ref_absent_step, 2, "refers to step 0, which cannot be read"),
    "ref-to-uncommitted-step": (
        h_holder_uncommitted,
        0,
        "step 1, which cannot be read.*manifest is missing",
    ),
    "basename-is-manifest": (h_manifest_as_data, 2, "a file 'manifest.json' .* has no such file"),
    "basename-not-listed": (
        h_other_rank_file,
        2,
        "a file 'rank-00001.safetensors' .* has no such file",
    ),
    "own-file-not-listed": (h_own_file_unlisted, 2, "source file 'manifest.json' is not listed"),
    "overlapping-chunks": (h_overlap_in_tensor, 2, "overlap in"),
    "overlapping-tensors": (h_overlap_across_tensors, 2, "overlap in"),
    "chunks-short-of-size": (h_chunks_short, 2, "its extents hold"),
    "chunk-shortened": (h_chunk_shortened, 2, "its extents hold"),
    "chunk-longer": (h_chunk_longer, 2, "its extents hold"),
    "chunk-past-file-end": (h_past_end, 2, "lies outside the data of"),
    "chunk-range-reversed": (h_reversed_range, 2, r"extent 3 \[0, \d+, \d+\] is not"),
    "own-run-split-in-two": (h_own_run_split, 2, "disagrees with the manifest about a chunk at"),
    "dotdot-outside-root": (h_dotdot_outside, 2, "names its file by basename"),
    "dotdot-inside-root": (h_dotdot_sibling, 2, "is not listed"),
    "path-not-basename": (h_path_not_basename, 2, "names its file by basename"),
    "holder-data-file-is-a-symlink-out": (
        h_holder_file_symlink,
        0,
        "is a symbolic link inside the checkpoint root",
    ),
    "step-is-bool": (h_step_bool, 2, "refers to step True"),
    "extent-is-bool": (h_extent_bool, 2, "flat list of integer triples"),
    "refs-not-list": (h_refs_not_list, 2, "refs must be increasing steps"),
    "refs-missing": (h_refs_missing, 2, "refs must be increasing steps"),
    "version-1-with-extents": (h_v1_with_extents, 2, "extents are a format version 3 feature"),
    "version-2-with-extents": (h_v2_with_extents, 2, "extents are a format version 3 feature"),
    "version-3-with-chunks": (h_v3_with_chunks, 2, "chunks are a format version 2 feature"),
    "sources-not-list": (h_sources_not_list, 2, "sources must be a non-empty list"),
    "source-with-unknown-key": (h_source_unknown_key, 2, "malformed source"),
    "extents-not-flat": (h_extents_not_flat, 2, "flat list of integer triples"),
    "extents-not-triples": (h_extents_not_triples, 2, "flat list of integer triples"),
    "extent-source-out-of-range": (h_extent_source_out_of_range, 2, r"extent 2 \[1, "),
}


@contextlib.contextmanager
def opened_paths() -> Iterator[list[str]]:
    """Normalised absolute paths of every ``os.open`` inside (``dir_fd`` resolved)."""
    real_open = os.open
    seen: list[str] = []

    def recording_open(
        path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
    ) -> int:
        base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
        seen.append(os.path.normpath(os.path.join(base, os.fsdecode(path))))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    with mock.patch.object(os, "open", recording_open):
        yield seen


def _outside(tmp_path: Path, root: Path, paths: list[str]) -> list[str]:
    base, inner = os.path.realpath(tmp_path), os.path.realpath(root)
    return [
        p
        for p in paths
        if os.path.realpath(p).startswith(base + os.sep)
        and not (os.path.realpath(p) + os.sep).startswith(inner + os.sep)
    ]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_v3_manifest_is_refused(
    case: str,
    hostile_template: tuple[Path, dict[int, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, expected = hostile_template
    root = _copy(src, tmp_path)
    shutil.copy(root / dir_name(1) / DATA, tmp_path / "outside.safetensors")
    edit, fallback, reason = HOSTILE[case]
    m = manifest(root, 3)
    edit(root, m)
    write_manifest(root, 3, m)
    storage = open_storage(root)

    with opened_paths() as seen, pytest.raises(CorruptCheckpointError, match=reason):
        CheckpointReader(storage, 3).verify()
    assert _outside(tmp_path, root, seen) == []
    capsys.readouterr()
    assert cli(["verify", str(root), "--step", "3", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["ok"] is False
    out = tmp_path / "model.safetensors"
    with opened_paths() as seen:
        rc = cli(["export", str(root), "--step", "3", "--key", "model", "--out", str(out)])
    assert rc == 2 and not out.exists()
    assert [p for p in _outside(tmp_path, root, seen) if "model.safetensors" not in p] == []

    job = Job(seed=99)
    before = job.record()
    with Checkpointer(root, job.state, keep=None) as ckpt, pytest.raises(CorruptCheckpointError):
        ckpt.restore(3)
    assert job.mismatches(before) == []

    if fallback is None:
        return
    shutil.rmtree(root / dir_name(4))
    with opened_paths() as seen, Checkpointer(root, job.state, keep=None) as ckpt:
        if fallback == 0:
            with pytest.raises(CorruptCheckpointError, match="none is valid"):
                ckpt.restore()
        else:
            assert ckpt.restore() == fallback
    assert _outside(tmp_path, root, seen) == []
    if fallback == 0:
        assert job.mismatches(before) == []
    else:
        assert job.mismatches(expected[fallback]) == []
        assert 3 in [e["step"] for e in audit(root, "skip")]


def test_unedited_template_is_valid(
    hostile_template: tuple[Path, dict[int, Any]], tmp_path: Path
) -> None:
    """The hostile cases start from valid checkpoints: each fails only by its edit. The
    embedding of step 3 is one extent, all of step 1's copy; cut into an extent per
    chunk (as the edits of one chunk cut it), step 3 still verifies and restores."""
    src, expected = hostile_template
    storage = open_storage(src)
    for s in (1, 2, 3, 4):
        CheckpointReader(storage, s).verify()
    m = manifest(src, 3)
    assert m["refs"] == [1] or m["refs"] == [1, 2]
    begin, end = manifest(src, 1)["tensors"][EMBEDDING]["offsets"]
    assert tensor_ranges(m["tensors"][EMBEDDING]) == [(1, DATA, begin, end)]
    assert restored(src, 3).mismatches(expected[3]) == []

    root = _copy(src, tmp_path)
    for name in (EMBEDDING, BANK):
        before = tensor_ranges(m["tensors"][name])
        t = _unmerged(m, name)
        assert len(t["extents"]) // 3 == -(-(np.prod(t["shape"]) * 4) // CHUNK) > len(before)
        assert _chunked(t) == tensor_ranges(t)
    assert len(m["tensors"][EMBEDDING]["extents"]) // 3 == VOCAB * DIM * 4 // CHUNK
    write_manifest(root, 3, m)
    CheckpointReader(open_storage(root), 3).verify()
    assert restored(root, 3).mismatches(expected[3]) == []


# --------------------------------------------------------------------------- 5. whole


def _versions(root: Path) -> list[int]:
    return [manifest(root, s)["format_version"] for s in committed(root)]


def test_job_whose_every_tensor_changes_writes_only_v1(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    expected = run(root, Job(frozen=False), range(1, 7))
    assert _versions(root) == [1] * 6
    for s in (2, 6):
        assert restored_unfrozen(root, s).mismatches(expected[s]) == []


def restored_unfrozen(root: Path, step: int) -> Job:
    job = Job(seed=99, frozen=False)
    with Checkpointer(root, job.state, keep=None) as ckpt:
        assert ckpt.restore(step) == step
    return job


@pytest.mark.parametrize(
    "incremental",
    [
        False,
        Incremental(chunk_bytes=CHUNK, min_saving=0.99, **ALWAYS),
        Incremental(min_live=1.0, **ALWAYS),
    ],
    ids=["off", "min_saving", "min_live"],
)
def test_whole_checkpoints_when_incremental_is_off_or_not_worth_it(
    incremental: Any, tmp_path: Path
) -> None:
    """incremental=False; a saving below min_saving (the frozen part is ~90% of the
    bytes); min_live=1.0 (every earlier checkpoint also holds bytes that changed)."""
    root = tmp_path / "ckpt"
    expected = run(root, Job(), range(1, 6), incremental=incremental)
    assert _versions(root) == [1] * 5
    sizes = {own_bytes(manifest(root, s)) for s in committed(root)}
    assert len(sizes) == 1  # all whole, of the same size
    assert restored(root, 5).mismatches(expected[5]) == []


def test_reused_part_is_large_enough_for_min_saving(tmp_path: Path) -> None:
    """The counterpart of the min_saving case above: at 0.5 the same job writes v3."""
    root = tmp_path / "ckpt"
    run(
        root,
        Job(),
        range(1, 4),
        incremental=Incremental(chunk_bytes=CHUNK, min_saving=0.5, **ALWAYS),
    )
    assert _versions(root) == [1, 3, 3]


def _change_structure(job: Job, step: int) -> None:
    """Before training step ``step``: change the shape of the state."""
    if step == 3:
        job.extra["buf"] = torch.arange(48, dtype=torch.float32)  # resized
    if step == 4:
        job.extra["buf"] = job.extra["buf"].reshape(6, 8).clone()  # same bytes, new shape
    if step == 5:
        job.extra["buf"] = job.extra["buf"].view(torch.int32).clone()  # same bytes, new dtype
    if step == 6:
        job.model.gate.requires_grad_(True)  # AdamW gets state for the gate
    if step == 7:
        job.extra["new"] = torch.full((3,), 7.0, dtype=torch.float64)
    if step == 8:
        del job.extra["buf"]


def test_structure_changes_are_written_and_restored_exactly(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    job = Job()
    expected = run(root, job, range(1, 10), before_train=_change_structure)
    check_references(root)
    assert _versions(root) == [1] + [3] * 8
    buf = {s: manifest(root, s)["tensors"].get("extra/buf") for s in range(1, 10)}
    assert [buf[s]["shape"] for s in (2, 3, 4, 5)] == [[16], [48], [6, 8], [6, 8]]
    assert [buf[s]["dtype"] for s in (4, 5)] == ["F32", "I32"]
    assert buf[8] is None
    opt = {s: len(manifest(root, s)["tensors"]) for s in (5, 6)}
    assert opt[6] == opt[5] + 6  # exp_avg, exp_avg_sq, step of gate.weight and gate.bias
    storage = open_storage(root)
    for s in range(1, 10):
        CheckpointReader(storage, s).verify()
        assert restored(root, s).mismatches(expected[s]) == [], s
    # and in the opposite order, into one state that keeps changing shape
    job = Job(seed=99)
    with Checkpointer(root, job.state, keep=None) as ckpt:
        for s in range(9, 0, -1):
            assert ckpt.restore(s) == s
            assert job.mismatches(expected[s]) == [], s


# --------------------------------------------------------------------------- retention, CLI


def test_prune_keeps_what_the_kept_checkpoint_refers_to(
    two_launches: tuple[Path, dict[int, Any]], tmp_path: Path
) -> None:
    """``resumable prune --keep-last 1``: step 10 stays, and step 6, which holds most of
    its bytes; everything else goes. Both still verify, and step 10 restores exactly."""
    src, expected = two_launches
    root = _copy(src, tmp_path)
    assert cli(["prune", str(root), "--keep-last", "1"]) == 0
    assert committed(root) == sorted(closure(root, [10])) == [6, 10]
    check_references(root)
    storage = open_storage(root)
    for s in (6, 10):
        CheckpointReader(storage, s).verify()
    assert restored(root, 10).mismatches(expected[10]) == []


def test_cli_lists_shows_and_verifies_incremental_checkpoints(
    two_launches: tuple[Path, dict[int, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = two_launches
    assert cli(["ls", str(root), "--verify"]) == 0
    assert cli(["show", str(root), "--step", "8"]) == 0
    assert cli(["verify", str(root), "--all"]) == 0
    assert "CORRUPT" not in capsys.readouterr().out


def test_min_live_releases_an_old_checkpoint(tmp_path: Path) -> None:
    """Step 1 holds a (128 KiB), b (64 KiB) and z (320 KiB). z leaves the state at step
    3, a changes at step 5: reusing b then would save a third of step 5's bytes (above
    min_saving), but b is only an eighth of step 1's bytes (below min_live), so step 5
    writes b again instead of referring to step 1, and once nothing kept refers to
    step 1 retention deletes it. min_saving = min_live = 0.25 (the defaults); a high
    max_overhead, so that it is min_live, not the bound on a chain, that releases it."""
    root = tmp_path / "ckpt"
    state: dict[str, Any] = {
        "a": torch.arange(32 << 10, dtype=torch.float32),
        "b": torch.arange(16 << 10, dtype=torch.float32) * -1.0,
        "c": torch.zeros(4),
        "z": torch.ones(80 << 10),
    }
    expected: dict[int, dict[str, torch.Tensor]] = {}
    inc = Incremental(max_overhead=100.0, **ALWAYS)
    with Checkpointer(root, state, keep=Keep(last=2), persist="sync", incremental=inc) as ckpt:
        for step in range(1, 9):
            state["c"] += 1.0
            if step == 3:
                del state["z"]
            if step == 5:
                state["a"] += 1.0
            ckpt.save(step)
            expected[step] = {k: v.clone() for k, v in state.items()}
            if step == 4:
                assert committed(root) == [1, 3, 4]
                assert manifest(root, 4)["refs"] == [1]
    check_references(root)
    assert 1 not in manifest(root, 5).get("refs", [])
    assert 1 not in closure(root, [8])
    assert committed(root) == sorted(closure(root, [7, 8]))
    assert 1 not in committed(root)
    for s in committed(root):
        fresh: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items()}
        with Checkpointer(root, fresh, keep=None, persist="sync") as ckpt:
            assert ckpt.restore(s) == s
        assert fresh.keys() == expected[s].keys()
        assert all(_bytes(fresh[k]) == _bytes(v) for k, v in expected[s].items()), s


def test_mirror_holds_every_checkpoint_its_checkpoints_refer_to(tmp_path: Path) -> None:
    """A local mirror with its own retention: every checkpoint committed there refers
    only to checkpoints committed there, a v3 upload is its own files and manifest,
    and the mirror alone (the local root gone) restores every step it kept exactly."""
    root, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    job = Job()
    expected: dict[int, dict[str, Any]] = {}
    with Checkpointer(
        root,
        job.state,
        keep=Keep(last=2),
        mirror=str(mirror),
        mirror_keep=Keep(last=3),
        persist="sync",
        incremental=SMALL_CHUNKS,
    ) as ckpt:
        for step in range(1, 13):
            job.train(step)
            ckpt.save(step)
            ckpt.wait()
            expected[step] = job.record()
            check_references(mirror)
            check_references(root)
    assert committed(mirror) == sorted(closure(mirror, [10, 11, 12]))
    assert 1 in committed(mirror) and manifest(mirror, 12)["format_version"] == 3
    uploads = {e["step"]: e["bytes"] for e in audit(mirror, "commit")}
    for s in committed(mirror):
        if manifest(mirror, s)["format_version"] == 3:
            blob = (mirror / dir_name(s) / MANIFEST).stat().st_size
            assert uploads[s] == own_bytes(manifest(mirror, s)) + blob, s
    shutil.rmtree(root)
    storage = open_storage(mirror)
    for s in committed(mirror):
        CheckpointReader(storage, s).verify()
        assert restored(mirror, s).mismatches(expected[s]) == [], s


# --------------------------------------------------------------------------- the writer's memory


class CrashingStorage(ForwardingStorage):
    """A local root whose ``crash_in``-th next write/rename_dir/sync_dir (from 0) fails
    once with a full-disk `StorageError`, leaving a torn file if it was a write."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.crash_in: int | None = None

    def _crashes(self) -> bool:
        if self.crash_in is None:
            return False
        if self.crash_in == 0:
            self.crash_in = None
            return True
        self.crash_in -= 1
        return False

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if self._crashes():
            data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
            self.inner.write(path, [data[: len(data) // 2]])
            raise StorageError(errno.ENOSPC, f"injected crash writing {path}")
        return self.inner.write(path, chunks)

    def rename_dir(self, src: str, dst: str) -> None:
        if self._crashes():
            raise StorageError(errno.ENOSPC, f"injected crash renaming {src}")
        self.inner.rename_dir(src, dst)

    def sync_dir(self, path: str = "") -> None:
        if self._crashes():
            raise StorageError(errno.ENOSPC, f"injected crash syncing {path}")
        self.inner.sync_dir(path)


@pytest.mark.parametrize("crash_in", [0, 1, 2, 3])
def test_a_failed_persist_is_never_referred_to(crash_in: int, tmp_path: Path) -> None:
    """Step 3's persist fails before its commit (in the data write, the manifest write,
    a sync or the rename): steps 4 and 5 refer only to committed checkpoints."""
    root = tmp_path / "ckpt"
    storage = CrashingStorage(LocalStorage(root))
    job = Job()
    expected: dict[int, dict[str, Any]] = {}
    with Checkpointer(
        storage, job.state, keep=None, persist="sync", incremental=SMALL_CHUNKS
    ) as ckpt:
        for step in range(1, 6):
            job.train(step)
            if step == 3:
                storage.crash_in = crash_in
                with pytest.raises(StorageError, match="injected crash"):
                    ckpt.save(step)
                assert storage.crash_in is None
                continue
            ckpt.save(step)
            expected[step] = job.record()
    assert committed(root) == [1, 2, 4, 5]
    check_references(root)
    assert [manifest(root, s)["format_version"] for s in (4, 5)] == [3, 3]
    for s in (1, 2, 4, 5):
        CheckpointReader(open_storage(root), s).verify()
        assert restored(root, s).mismatches(expected[s]) == [], s


def test_saving_a_step_again_replaces_it_with_a_valid_checkpoint(tmp_path: Path) -> None:
    """save(3) twice (the state changed in between): the second one replaces the first,
    and neither it nor step 4 refers to the replaced files."""
    root = tmp_path / "ckpt"
    job = Job()
    expected: dict[int, dict[str, Any]] = {}
    with Checkpointer(root, job.state, keep=None, persist="sync", incremental=SMALL_CHUNKS) as ckpt:
        for step in (1, 2, 3, 3, 4):
            job.train(step)
            ckpt.save(step)
            expected[step] = job.record()
            check_references(root)
            CheckpointReader(open_storage(root), step).verify()
    assert committed(root) == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        CheckpointReader(open_storage(root), s).verify()
        assert restored(root, s).mismatches(expected[s]) == [], s


def test_resuming_from_an_older_step_never_loads_a_mixed_state(tmp_path: Path) -> None:
    """Steps 1-6, where a tensor added at step 5 is unchanged at 6 (step 6 refers to
    step 5 for it). A relaunch restores step 3 and saves 4 and 5 again with another
    value there: the new 4 and 5 are valid; the old step 6 either still verifies and
    restores to exactly its own state, or is refused as corrupt - and a plain restore
    gives one of the two states, never a mixture."""
    root = tmp_path / "ckpt"

    def late(value: float) -> Callable[[Job, int], None]:
        def hook(job: Job, step: int) -> None:
            if step == 5:
                job.extra["late"] = torch.full((16 << 10,), value)  # most of step 5's own bytes

        return hook

    old = run(root, Job(), range(1, 7), before_train=late(1.0))
    assert 5 in manifest(root, 6)["refs"]
    new = run(root, Job(seed=99), (4, 5), before_train=late(2.0), restore=3)
    storage = open_storage(root)
    for s in (4, 5):
        CheckpointReader(storage, s).verify()
        assert restored(root, s).mismatches(new[s]) == [], s
    try:
        CheckpointReader(storage, 6).verify()
    except CorruptCheckpointError:
        six_valid = False
    else:
        six_valid = True
        assert restored(root, 6).mismatches(old[6]) == []
    fresh = Job(seed=99)
    with Checkpointer(root, fresh.state, keep=None) as ckpt:
        got = ckpt.restore()
    assert got == (6 if six_valid else 5)
    assert fresh.mismatches(old[6] if six_valid else new[5]) == []


@pytest.mark.parametrize(
    "names", [["w#0"], ["w#chunk0"], ["w#chunk0", "w#chunk0.1", "w#chunk0.2"]], ids=str
)
def test_a_tensor_named_like_a_chunk_entry_does_not_stop_saves(
    names: list[str], tmp_path: Path
) -> None:
    """A partly changed tensor's own chunks are extra entries of the data file, named
    after the tensor; a state that has tensors of such names (dict keys ``"w#chunk0"``)
    must still save and restore exactly, under the default options."""
    root = tmp_path / "ckpt"
    state: dict[str, Any] = {
        "w": torch.zeros(4096),  # four chunks of 4 KiB
        "frozen": torch.ones(1 << 16),
    }
    for i, name in enumerate(names):
        state[name] = torch.full((4,), float(i))
    expected: dict[int, dict[str, torch.Tensor]] = {}
    inc = Incremental(chunk_bytes=4096, **ALWAYS)
    with Checkpointer(root, state, keep=None, persist="sync", incremental=inc) as ckpt:
        for step in range(1, 4):
            state["w"][:10] += 1.0  # only the first chunk of w changes
            ckpt.save(step)
            expected[step] = {k: v.clone() for k, v in state.items()}
    assert committed(root) == [1, 2, 3]
    check_references(root)
    w = tensor_ranges(manifest(root, 3)["tensors"]["w"])  # the first chunk written, the rest not
    assert [(s, end - begin) for s, _, begin, end in w] == [(None, 4096), (1, 3 * 4096)]
    for s in (1, 2, 3):
        fresh: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items()}
        with Checkpointer(root, fresh, keep=None, persist="sync") as ckpt:
            assert ckpt.restore(s) == s
        assert all(_bytes(fresh[k]) == _bytes(v) for k, v in expected[s].items()), s


def test_mirror_after_resuming_from_an_older_step_stays_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A relaunch resumes from step 1 of a mirrored run and replays steps 2-3 exactly
    (same content, but now step 2 is written whole where the first launch wrote it
    incrementally), then goes on to steps 4-5. The mirror already holds steps 2-3 of
    the same content: a new checkpoint that refers to the local step 2's byte ranges
    must not be committed there against the other layout of the mirror's step 2.
    Every checkpoint committed in the mirror verifies, and the mirror alone restores
    the relaunch's steps exactly."""
    root, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    options: dict[str, Any] = {"keep": None, "mirror": str(mirror), "persist": "sync"}
    job = Job()
    with Checkpointer(root, job.state, incremental=SMALL_CHUNKS, **options) as ckpt:
        for step in (1, 2, 3):
            job.train(step)
            ckpt.save(step)
            ckpt.wait()
    assert [manifest(mirror, s)["format_version"] for s in (1, 2, 3)] == [1, 3, 3]
    job = Job(seed=5)
    expected: dict[int, dict[str, Any]] = {}
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        Checkpointer(root, job.state, incremental=SMALL_CHUNKS, **options) as ckpt,
    ):
        assert ckpt.restore(1) == 1
        for step in (2, 3, 4, 5):
            job.train(step)
            ckpt.save(step)
            ckpt.wait()
            expected[step] = job.record()
    assert manifest(root, 2)["format_version"] == 1  # the relaunch's first persist
    assert 2 in manifest(root, 4)["refs"]
    assert "mirroring step" not in caplog.text
    storage = open_storage(mirror)
    assert committed(mirror) == [1, 2, 3, 4, 5]
    for s in committed(mirror):
        CheckpointReader(storage, s).verify()
    shutil.rmtree(root)
    for s in (2, 3, 4, 5):
        assert restored(mirror, s).mismatches(expected[s]) == [], s


# --------------------------------------------------------------------------- object storage


def stored_manifest(storage: Storage, step: int) -> dict[str, Any]:
    return json.loads(storage.read(f"{dir_name(step)}/{MANIFEST}"))


def check_stored_references(storage: Storage) -> None:
    """`check_references` for any storage: every reference is to a committed earlier
    step, by the basename of one of its data files, inside that file's size."""
    steps = set(list_committed(storage))
    for s in sorted(steps):
        m = stored_manifest(storage, s)
        refs = m.get("refs", [])
        assert set(refs) <= steps and all(r < s for r in refs), (s, refs, steps)
        for t in m["tensors"].values():
            for step, fname, begin, end in tensor_ranges(t):
                if step is not None:
                    files = stored_manifest(storage, step)["files"]
                    sizes = {k.rsplit("/", 1)[-1]: v["size"] for k, v in files.items()}
                    assert step in refs and end <= sizes[fname], (s, step, fname, begin, end)


def test_incremental_checkpoints_on_object_storage(s3_env: Any, tmp_path: Path) -> None:
    """On S3 (marker commits: data files under per-attempt keys), incremental
    checkpoints refer to earlier ones by basename, retention keeps what they refer to,
    and a relaunch that resumes from an older step writes valid checkpoints again."""
    url = f"s3://{s3_env.new_bucket('inc')}/exp"
    job = Job()
    expected = run(url, job, range(1, 7), keep=Keep(last=2))
    storage = open_storage(url)
    check_stored_references(storage)
    assert list_committed(storage) == [1, 5, 6]
    assert stored_manifest(storage, 6)["format_version"] == 3
    new = run(url, Job(seed=5), (6, 7), keep=None, restore=5)
    check_stored_references(storage)
    for s in list_committed(storage):
        CheckpointReader(storage, s).verify()
    for s, want in ((5, expected[5]), (6, new[6]), (7, new[7])):
        assert restored(url, s).mismatches(want) == [], s


def test_mirror_on_object_storage_after_resuming_from_an_older_step(
    s3_env: Any, tmp_path: Path
) -> None:
    """The mirror case above with an S3 mirror: a good copy (under other keys) counts as
    mirrored, a copy laid out otherwise is uploaded again, and every checkpoint
    committed in the mirror verifies."""
    root, mirror = tmp_path / "ckpt", f"s3://{s3_env.new_bucket('mir')}/exp"
    options: dict[str, Any] = {"keep": None, "mirror": mirror, "persist": "sync"}
    job = Job()
    with Checkpointer(root, job.state, incremental=SMALL_CHUNKS, **options) as ckpt:
        for step in (1, 2, 3):
            job.train(step)
            ckpt.save(step)
            ckpt.wait()
    job = Job(seed=5)
    expected: dict[int, dict[str, Any]] = {}
    with Checkpointer(root, job.state, incremental=SMALL_CHUNKS, **options) as ckpt:
        assert ckpt.restore(1) == 1
        for step in (2, 3, 4):
            job.train(step)
            ckpt.save(step)
            ckpt.wait()
            expected[step] = job.record()
    remote = open_storage(mirror)
    uploads = [(e["step"], e["bytes"]) for e in audit(root, "mirror_commit")]
    sent = [s for s, b in uploads if b > 0]
    assert sorted(sent) == [1, 2, 2, 3, 3, 4], uploads  # 2 and 3 again: laid out otherwise
    assert list_committed(remote) == [1, 2, 3, 4]
    check_stored_references(remote)
    for s in (1, 2, 3, 4):
        CheckpointReader(remote, s).verify()
    shutil.rmtree(root)
    for s in (2, 3, 4):
        assert restored(mirror, s).mismatches(expected[s]) == [], s
    # a relaunch finds its newest step mirrored already: nothing is sent again
    job = Job(seed=7)
    with Checkpointer(tmp_path / "other", job.state, **options) as ckpt:
        assert ckpt.restore() == 4


def test_a_checkpoint_deleted_by_someone_else_is_not_referred_to(tmp_path: Path) -> None:
    """A person deletes step 1 (which steps 2 and 3 refer to) while the job runs: the
    next persist does not refer to it, so step 4 is committed valid (written whole)
    and step 5 refers to step 4."""
    root = tmp_path / "ckpt"

    def after_save(ckpt: Checkpointer, step: int) -> None:
        if step == 3:
            shutil.rmtree(root / dir_name(1))

    expected = run(root, Job(), range(1, 6), after_save=after_save)
    assert committed(root) == [2, 3, 4, 5]
    assert manifest(root, 4)["format_version"] == 1
    assert manifest(root, 5)["refs"] == [4]
    storage = open_storage(root)
    for s in (4, 5):
        CheckpointReader(storage, s).verify()
        assert restored(root, s).mismatches(expected[s]) == [], s


def test_a_mirror_added_later_receives_what_the_newest_step_refers_to(tmp_path: Path) -> None:
    """A run without a mirror saved steps 1-4 (2-4 refer to 1); a relaunch with a mirror
    uploads its newest step at start, and step 1 before it: the mirror alone restores
    step 4 exactly."""
    root, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    expected = run(root, Job(), range(1, 5))
    assert manifest(root, 4)["refs"] == [1]
    job = Job(seed=5)
    with Checkpointer(root, job.state, keep=None, mirror=str(mirror), persist="sync") as ckpt:
        assert ckpt.restore() == 4
        ckpt.wait()
    assert committed(mirror) == [1, 4]
    storage = open_storage(mirror)
    for s in (1, 4):
        CheckpointReader(storage, s).verify()
    shutil.rmtree(root)
    assert restored(mirror, 4).mismatches(expected[4]) == []


def test_worker_process_with_a_mirror_keeps_both_roots_consistent(tmp_path: Path) -> None:
    """persist="process", retention in both roots, the mirror thread's local retention
    beside the worker's persists: at the end both roots hold only checkpoints whose
    references are committed beside them, and the mirror alone restores its newest
    step exactly."""
    root, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    job = Job()
    expected: dict[int, dict[str, Any]] = {}
    with Checkpointer(
        root,
        job.state,
        keep=Keep(last=2),
        mirror=str(mirror),
        mirror_keep=Keep(last=2),
        persist="process",
        incremental=SMALL_CHUNKS,
    ) as ckpt:
        for step in range(1, 16):
            job.train(step)
            ckpt.save(step)
            expected[step] = job.record()
            if step % 5 == 0:
                ckpt.wait()
        ckpt.wait()
    for where in (root, mirror):
        check_references(where)
        storage = open_storage(where)
        for s in committed(where):
            CheckpointReader(storage, s).verify()
        assert committed(where)[-1] == 15
    shutil.rmtree(root)
    assert restored(mirror, 15).mismatches(expected[15]) == []


# ------------------------------------------------- chunk hashes on several threads


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_chunk_hashes_on_threads_are_each_chunks_own_in_order(threads: int) -> None:
    """`chunk_hashes` gives every range its own XXH3-128, in the order asked, however
    the large chunks are shared among threads and the small ones hashed beside them."""
    from resumable import incremental

    rng = np.random.default_rng(threads)
    data = memoryview(rng.integers(0, 256, size=80 << 20, dtype=np.uint8).tobytes())
    ranges, pos = [], 0
    for size in [4 << 20] * 9 + [7, 3 << 20, 4096, 0, (1 << 20) - 1, 1 << 20] + [5 << 20] * 5:
        ranges.append((pos, pos + size))
        pos += size
    ranges += [(0, 4 << 20), (17, (2 << 20) + 17)]  # out of order, overlapping, unaligned
    assert pos <= len(data)
    want = [xxhash.xxh3_128_hexdigest(data[b:e]) for b, e in ranges]
    assert incremental.chunk_hashes(data, ranges, threads) == want


def test_chunk_hashes_raise_a_threads_error_after_every_thread_ended() -> None:
    """A hash failing on one of the threads is raised to the caller, once no thread
    reads the data any more (the other threads hash their runs to the end first)."""
    from resumable import incremental

    raw = bytearray(64 << 20)
    raw[0 :: 1 << 20] = bytes(range(1, 65))  # each chunk's first byte: its number + 1
    data = memoryview(bytes(raw))
    ranges = [(i << 20, (i + 1) << 20) for i in range(64)]
    real = xxhash.xxh3_128_hexdigest
    seen: list[int] = []

    def failing(buf: Any) -> str:
        seen.append(buf[0])
        if buf[0] == 1:  # the first chunk: the calling thread's, before the others end
            raise MemoryError("hash failed")
        time.sleep(0.002)
        return real(buf)

    with mock.patch.object(incremental.xxhash, "xxh3_128_hexdigest", failing):
        with pytest.raises(MemoryError, match="hash failed"):
            incremental.chunk_hashes(data, ranges, 3)
        ended = len(seen)
        time.sleep(0.3)
        assert len(seen) == ended  # no thread hashed on after the raise


def test_chunk_hash_threads_are_made_again_in_a_forked_process() -> None:
    """The pool belongs to the process that made it: a process forked after the threads
    started (which has none of them) makes its own instead of queueing to none."""
    from resumable import incremental

    data = memoryview(bytes(64 << 20))
    ranges = [(i << 20, (i + 1) << 20) for i in range(64)]
    incremental.chunk_hashes(data, ranges, 2)
    first = incremental._hash_pool(1)
    pid = os.fork()
    if pid == 0:  # the child: hashes on threads of its own, and says so by its status
        ok = incremental.chunk_hashes(data, ranges, 2) == [
            xxhash.xxh3_128_hexdigest(data[b:e]) for b, e in ranges
        ]
        os._exit(0 if ok and incremental._hash_pool(1) is not first else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert incremental._hash_pool(1) is first  # the parent's is still its own
