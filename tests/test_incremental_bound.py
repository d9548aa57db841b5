"""What an incremental root keeps on disk stays bounded.

A table whose rows change a few at a time makes every checkpoint refer to the one
before it for the chunks that have not changed since; retention keeps a referred
checkpoint, and what it refers to, while a kept one needs it. Without a bound the root
grows by one checkpoint per save (found by the incremental benchmark: 30 checkpoints,
5.7 GiB, under ``Keep(last=2)``). ``Incremental.max_overhead`` writes a checkpoint whole
once its chain would hold more unused data than that many times the state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resumable import Checkpointer, Incremental, Keep
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

pytestmark = pytest.mark.usefixtures("sync_persist")

CHUNK = 4096
ROWS, DIM = 512, 64  # 128 KiB of float32: 32 chunks of 16 rows


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def manifests(root: Path) -> dict[int, dict]:
    return {
        int(d.name[5:]): json.loads((d / "manifest.json").read_text())
        for d in root.glob("step-*")
        if (d / "manifest.json").exists()
    }


@pytest.mark.parametrize("max_overhead", [0.5, 1.0])
def test_a_slowly_changing_table_keeps_a_bounded_root(tmp_path: Path, max_overhead: float) -> None:
    torch.manual_seed(0)
    table = torch.randn(ROWS, DIM)
    whole = table.numel() * 4
    gen = torch.Generator().manual_seed(1)
    inc = Incremental(
        chunk_bytes=CHUNK,
        min_saving=0.0,
        min_live=0.0,
        max_overhead=max_overhead,
        min_bytes=0,
        whole_every=0,
    )
    root = tmp_path / "ck"
    saved: dict[int, torch.Tensor] = {}
    most = 0
    with Checkpointer(
        root, {"t": {"table": table}}, keep=Keep(last=2), capture_rng=False, incremental=inc
    ) as ckpt:
        for step in range(1, 61):
            rows = torch.randint(0, ROWS // 16, (2,), generator=gen) * 16  # 2 chunks change
            table[rows] += 1.0
            ckpt.save(step)
            ckpt.wait()
            saved[step] = table.clone()
            most = max(most, disk_bytes(root))
            kept = manifests(root)
            for s, m in kept.items():  # every listed checkpoint refers to listed ones
                assert set(m.get("refs", [])) <= set(kept), (step, s, m.get("refs"))
    ms = manifests(root)
    assert any(m["format_version"] == 3 for m in ms.values())  # it did write incrementally
    # Two kept checkpoints, each with at most (1 + max_overhead) x the state behind it,
    # plus the delta written last and a whole one the bound started anew with.
    assert most <= (2 * (1 + max_overhead) + 2) * whole, (most, whole)
    storage = open_storage(root)
    for s in ms:
        got = CheckpointReader(storage, s).tensors()["t/table"]
        assert torch.equal(got, saved[s]), s


def test_without_the_bound_the_chain_would_grow(tmp_path: Path) -> None:
    """The same job with a bound too large to matter keeps every checkpoint: the
    behaviour the bound exists to stop (and proof the test above can fail)."""
    torch.manual_seed(0)
    table = torch.randn(ROWS, DIM)
    gen = torch.Generator().manual_seed(1)
    inc = Incremental(
        chunk_bytes=CHUNK,
        min_saving=0.0,
        min_live=0.0,
        max_overhead=1e6,
        min_bytes=0,
        whole_every=0,
    )
    root = tmp_path / "ck"
    with Checkpointer(
        root, {"t": {"table": table}}, keep=Keep(last=2), capture_rng=False, incremental=inc
    ) as ckpt:
        for step in range(1, 31):
            rows = torch.randint(0, ROWS // 16, (2,), generator=gen) * 16
            table[rows] += 1.0
            ckpt.save(step)
            ckpt.wait()
    assert len(manifests(root)) > 10


def versions_of(root: Path) -> dict[int, int]:
    return {s: m["format_version"] for s, m in manifests(root).items()}


def test_whole_every_writes_every_nth_persist_whole(tmp_path: Path) -> None:
    """At most ``whole_every`` checkpoints depend on one data file: persists 1, 4, 7
    ... are written whole, the others refer to the last whole one."""
    frozen = torch.randn(256, 64)  # never changes
    live = torch.zeros(16)
    inc = Incremental(chunk_bytes=CHUNK, min_bytes=0, whole_every=3)
    root = tmp_path / "ck"
    with Checkpointer(
        root, {"t": {"frozen": frozen, "live": live}}, keep=None, capture_rng=False, incremental=inc
    ) as ckpt:
        for step in range(1, 9):
            live += 1
            ckpt.save(step)
            ckpt.wait()
    ms = manifests(root)
    assert {s: m["format_version"] for s, m in ms.items()} == {
        1: 1,
        2: 3,
        3: 3,
        4: 1,
        5: 3,
        6: 3,
        7: 1,
        8: 3,
    }
    assert {s: m.get("refs") for s, m in ms.items() if "refs" in m} == {
        2: [1],
        3: [1],
        5: [4],
        6: [4],
        8: [7],
    }


def test_a_small_state_keeps_writing_whole_checkpoints_by_default(tmp_path: Path) -> None:
    """min_bytes: the default Incremental() gains nothing worth a reference on a state
    of a few hundred KiB, however much of it is unchanged; with min_bytes=0 the same job
    writes incrementally (so the first assertion can fail)."""
    for name, inc, want in (
        ("default", Incremental(), {1}),
        ("min_bytes=0", Incremental(min_bytes=0), {1, 3}),
    ):
        frozen = torch.randn(1024, 64)  # 256 KiB, never changes
        live = torch.zeros(16)
        root = tmp_path / name
        with Checkpointer(
            root, {"t": {"frozen": frozen, "live": live}}, keep=None, incremental=inc
        ) as ckpt:
            for step in range(1, 5):
                live += 1
                ckpt.save(step)
                ckpt.wait()
        assert set(versions_of(root).values()) == want, name
