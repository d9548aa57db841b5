"""A coordinated persist whose request is made only once rank 0 opened the attempt
(`resumable.pipeline.write.LateRequest`): a persist worker reads its snapshot's
metadata then, not while other ranks still take their snapshots. Checked on ranks as
threads with the real `write_distributed`, local storage and committer: what is made
late is what is written; ``make`` runs after the attempt is open; an error in it fails
every rank with that rank's reason and commits nothing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable.capture import capture, decode, global_refs, iter_tensor_refs
from resumable.commit import committer_for, list_committed
from resumable.errors import PersistError
from resumable.pipeline.write import (
    LateRequest,
    WriteRequest,
    owned_tensors,
    replicated_holders,
    write_distributed,
)
from resumable.reader import CheckpointReader
from resumable.snapshot import Arena
from resumable.storage import open_storage
from state_checks import ThreadRanks

WORLD = 2


def _state(rank: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((64,), float(rank)), "b": torch.arange(8.0) + rank}}


def _request(rank: int, step: int) -> WriteRequest:
    cap = capture(_state(rank), include_rng=False, rank=rank, world_size=WORLD)
    sizes = {n: t.numel() * t.element_size() for n, t in cap.tensors.items()}
    return WriteRequest(
        step,
        Arena().snapshot(owned_tensors(cap.tensors, cap.replicated, rank, WORLD)),
        cap.tree,
        {"loss": 0.5},
        cap.pieces,
        replicated_holders(sizes, cap.replicated, rank, WORLD),
    )


class _Opened:
    """A committer that notes when rank 0 opened the attempt."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.opened = threading.Event()

    def begin(self, step: int) -> Any:
        got = self._inner.begin(step)
        self.opened.set()
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _run(root: Path, step: int, make: Any) -> tuple[_Opened, list[Any]]:
    storage = open_storage(str(root))
    committer = _Opened(committer_for(storage))
    shared: dict[Any, Any] = {}
    meet = threading.Barrier(WORLD, timeout=60)
    out: list[Any] = [None] * WORLD

    def rank(r: int) -> None:
        try:
            out[r] = write_distributed(
                ThreadRanks(r, WORLD, shared, meet),
                storage,
                committer,
                LateRequest(step, lambda: make(r, committer)),
            )
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return committer, out


def test_a_late_request_is_made_once_the_attempt_is_open_and_written(tmp_path: Path) -> None:
    def make(r: int, committer: _Opened) -> WriteRequest:
        assert committer.opened.is_set(), "made before rank 0 opened the attempt"
        return _request(r, 3)

    _, out = _run(tmp_path, 3, make)
    assert not [o for o in out if isinstance(o, Exception)], out
    assert out[0].manifest is not None and out[0].manifest["metrics"] == {"loss": 0.5}
    assert list_committed(open_storage(str(tmp_path))) == [3]

    reader = CheckpointReader(open_storage(str(tmp_path)), 3)
    for r, entry in enumerate(reader.manifest["ranks"]):
        tree = entry["tree"]
        names = [n for _, n in iter_tensor_refs(tree)] + list(global_refs(tree))
        got = reader.tensors(list(dict.fromkeys(names)), verify=True)
        model = decode(tree, got, "cpu", resolve=got.__getitem__)["model"]
        want = _state(r)["model"]
        assert set(model) == set(want)
        assert all(torch.equal(model[k], want[k]) for k in want)


def test_an_error_in_one_rank_s_late_request_fails_every_rank_and_commits_nothing(
    tmp_path: Path,
) -> None:
    def make(r: int, committer: _Opened) -> WriteRequest:
        if r == 1:
            raise RuntimeError("snapshot of step 4 was overwritten before it was persisted")
        return _request(r, 4)

    _, out = _run(tmp_path, 4, make)
    for o in out:
        assert isinstance(o, PersistError)
        assert "rank 1" in str(o) and "overwritten before it was persisted" in str(o)
    assert list_committed(open_storage(str(tmp_path))) == []
    assert not list(tmp_path.rglob("*.safetensors")), "an aborted attempt left data files"


def test_an_error_in_rank_0_s_late_request_fails_every_rank_too(tmp_path: Path) -> None:
    def make(r: int, committer: _Opened) -> WriteRequest:
        if r == 0:
            raise ValueError("snapshot slot metadata is not JSON")
        return _request(r, 5)

    _, out = _run(tmp_path, 5, make)
    assert all(isinstance(o, PersistError) and "rank 0" in str(o) for o in out), out
    assert list_committed(open_storage(str(tmp_path))) == []


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_late_request_of_another_step_is_never_committed(tmp_path: Path, bad_rank: int) -> None:
    """The ranks' reports name the step each wrote: a request made for another step
    than the attempt's (a slot read after it moved on) mixes no states."""

    def make(r: int, committer: _Opened) -> WriteRequest:
        return _request(r, 7 if r == bad_rank else 6)

    _, out = _run(tmp_path, 6, make)
    assert all(isinstance(o, PersistError) for o in out), out
    assert list_committed(open_storage(str(tmp_path))) == []
