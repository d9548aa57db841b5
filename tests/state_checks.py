"""Helpers for tests that snapshot a changing state and restore every step: a snapshot
and persist per stage, restores into fresh objects, and exact comparison of the results
(dtypes, shapes, Python types and bit-identical values)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import resumable


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    d = Path("/dev/shm") / f"resumable-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    shutil.rmtree(d)


def snapshot_each(
    root: Path,
    shm_dir: Path,
    state: dict[str, Any],
    stages: list[Callable[[], None]],
    mode: str = "thread",
) -> list[dict[str, Any]]:
    """Run each stage (a change of ``state``), snapshot and persist it as step 1, 2, ...;
    returns a deep copy of the state's plain parts at each step."""
    expected = []
    ck = resumable.Checkpointer(
        root,
        state,
        persist=mode,  # type: ignore[arg-type]
        memory_every=resumable.Every(steps=1),
        persist_every=resumable.Every(steps=10**9),
        shm_dir=shm_dir,
        capture_rng=False,
        keep=None,
    )
    for step, stage in enumerate(stages, start=1):
        stage()
        ck.snapshot(step)
        assert ck.save(step), step  # persists the slot just written
        ck.wait()
        expected.append(plain(state))
    ck.close()
    return expected


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """The state as plain values (module and optimizer state dicts), deep-copied."""
    out = {}
    for key, value in state.items():
        out[key] = copy.deepcopy(value.state_dict() if hasattr(value, "state_dict") else value)
    return out


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def restored(root: Path, step: int, fresh: dict[str, Any]) -> dict[str, Any]:
    ck = resumable.Checkpointer(root, fresh, persist="sync", save_on_close=False)
    assert ck.restore(step, tier="storage") == step
    ck.close()
    return plain(fresh)


def like(values: dict[str, Any]) -> dict[str, Any]:
    """Fresh plain containers of the same structure, with other values."""
    return {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else like(v))
        if isinstance(v, (torch.Tensor, dict))
        else v
        for k, v in values.items()
    }


def edit_rank_tree(checkpoint: Path, rank: int, edit: Callable[[Any], None]) -> None:
    """Change rank ``rank``'s state tree in a committed checkpoint directory with ``edit``
    and sign it again (what a buggy writer, not damage, would leave): in the manifest of
    format versions 1 to 3, or in the rank's part and the top of versions 4 to 7 (the
    part gzip'd from version 7, as it was)."""
    import gzip
    import json

    from resumable.format import CHECKSUM, checksum, manifest_digest

    path = checkpoint / "manifest.json"
    top = json.loads(path.read_bytes())
    if "parts" in top:
        entry = top["parts"][rank]
        part_path = checkpoint / entry["file"]
        gz = "json_size" in entry
        blob = part_path.read_bytes()
        part = json.loads(gzip.decompress(blob) if gz else blob)
        edit(part["tree"])
        blob = json.dumps(part, sort_keys=True, separators=(",", ":")).encode()
        if gz:
            entry["json_size"] = len(blob)
            blob = gzip.compress(blob)
        part_path.write_bytes(blob)
        entry.update(size=len(blob), **{CHECKSUM: checksum(blob)})
    else:
        edit(top["ranks"][rank]["tree"])
    top.pop("digest", None)
    top["digest"] = manifest_digest(top)
    path.write_text(json.dumps(top))


class ThreadRanks:
    """`write_distributed`'s exchanges between ranks that are threads of this process
    (each object through JSON, as through the coordination store)."""

    def __init__(self, rank: int, world_size: int, shared: dict[Any, Any], meet: Any) -> None:
        self.rank, self.world_size = rank, world_size
        self._shared, self._meet = shared, meet

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any, name: str) -> Any:
        if self.coordinator:
            self._shared[name] = json.dumps(obj)
        self._meet.wait()
        return json.loads(self._shared[name])

    def gather(self, obj: Any, name: str) -> list[Any]:
        self._shared[(name, self.rank)] = json.dumps(obj)
        self._meet.wait()
        if not self.coordinator:
            return []
        return [json.loads(self._shared[(name, r)]) for r in range(self.world_size)]

    def gather_to(self, obj: Any, name: str, leader: int, members: list[int]) -> list[Any]:
        self._shared[(name, self.rank)] = json.dumps(obj)
        self._meet.wait()
        if self.rank != leader:
            return []
        return [json.loads(self._shared[(name, r)]) for r in members]

    def abandon(self, reason: str) -> None:
        pass


def save_thread_ranks(
    storage: Any,
    step: int,
    states: list[dict[str, Any]],
    *,
    nodes: Callable[[int], Any] | None = None,
    storage_of: Callable[[int], Any] | None = None,
) -> None:
    """Commit ``step`` of ``len(states)`` ranks into ``storage``, each rank a thread of
    this process running the real `write_distributed` on its state (metrics ``loss``
    1/step): its replicated tensors shared out as `owned_tensors` does, with their
    holders. ``nodes``: each rank's `NodeObjects` (one object per node); ``storage_of``:
    the storage a rank writes through. Raises the first rank's error."""
    import threading

    from resumable.capture import capture
    from resumable.commit import committer_for
    from resumable.pieces import owned_tensors
    from resumable.pipeline.write import WriteRequest, replicated_holders, write_distributed
    from resumable.snapshot import Arena

    world = len(states)
    shared: dict[Any, Any] = {}
    meet = threading.Barrier(world, timeout=60)
    committer = committer_for(storage)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            cap = capture(states[r], include_rng=False, rank=r, world_size=world)
            sizes = {n: t.numel() * t.element_size() for n, t in cap.tensors.items()}
            own = owned_tensors(cap.tensors, cap.replicated, r, world)
            request = WriteRequest(
                step,
                Arena().snapshot(own),
                cap.tree,
                {"loss": 1.0 / step},
                cap.pieces,
                replicated_holders(sizes, cap.replicated, r, world),
            )
            write_distributed(
                ThreadRanks(r, world, shared, meet),
                storage_of(r) if storage_of is not None else storage,
                committer,
                request,
                nodes=nodes(r) if nodes is not None else None,
            )
        except BaseException as exc:
            errors.append(exc)
            meet.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as GPT-2's do (the golden
    fixtures of format versions 5 and 7)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(6, 4)
        self.lm_head = torch.nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.wte.weight


def golden_split_reader(root: Path, step: int, version: int, rank: int | None) -> Any:
    """A reader of the golden split checkpoint in ``root``, which must be of format
    ``version``: read whole and verified (sizes too) where ``rank`` is None, else as
    that rank restoring at its world size."""
    from resumable.reader import CheckpointReader
    from resumable.storage import open_storage

    reader = CheckpointReader(open_storage(str(root)), step)
    assert reader.top["format_version"] == version
    if rank is None:
        assert reader.verify() > 0
        reader.check_sizes()
    else:
        reader.only_rank(rank)
    return reader


def check_mine(reader: Any, mine: list[list[int]], rank: int | None) -> None:
    """Each rank's own ``rank{r}/extra/mine`` (every rank's where ``rank`` is None), read
    and verified, is the int64 tensor ``mine[r]``."""
    for r in range(len(mine)) if rank is None else [rank]:
        (got,) = reader.tensors([f"rank{r}/extra/mine"], verify=True).values()
        assert got.dtype == torch.int64 and got.tolist() == mine[r]
