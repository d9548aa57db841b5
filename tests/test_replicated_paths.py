"""A per-rank stateful object's ``resumable_replicated`` paths: what every rank holds alike
is written once per job, and every rank's tree still decodes to its own values
(`DeepSpeedState`'s module at ZeRO 0-2 is the user; tested end to end in
tests/integrations/test_deepspeed.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable.capture import capture, decode, global_refs, iter_tensor_refs
from resumable.commit import committer_for
from resumable.errors import UnsupportedStateError
from resumable.pipeline.write import (
    WriteRequest,
    owned_tensors,
    replicated_holders,
    write_distributed,
)
from resumable.reader import CheckpointReader
from resumable.snapshot import Arena
from resumable.storage import open_storage
from state_checks import ThreadRanks


class Engine:
    """A per-rank object whose ``module`` every rank holds alike, with a tied weight."""

    resumable_per_rank = True

    def __init__(self, rank: int, replicated: bool) -> None:
        w = torch.arange(4096, dtype=torch.float32)  # the same on every rank
        self.sd = {
            "own": torch.full((1000,), float(rank)),  # this rank's alone
            "module": {"wte": w, "lm_head": w, "bias": torch.ones(3)},
        }
        self.resumable_replicated = (("module",),) if replicated else ()

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.sd = sd


def _save(root: Path, replicated: bool, world: int = 2) -> list[Any]:
    storage = open_storage(str(root))
    committer = committer_for(storage)
    shared: dict[Any, Any] = {}
    meet = threading.Barrier(world, timeout=60)
    caps: list[Any] = [None] * world

    def rank(r: int) -> None:
        cap = capture(
            {"engine": Engine(r, replicated)}, include_rng=False, rank=r, world_size=world
        )
        caps[r] = cap
        sizes = {n: t.numel() * t.element_size() for n, t in cap.tensors.items()}
        write_distributed(
            ThreadRanks(r, world, shared, meet),
            storage,
            committer,
            WriteRequest(
                1,
                Arena().snapshot(owned_tensors(cap.tensors, cap.replicated, r, world)),
                cap.tree,
                {},
                cap.pieces,
                replicated_holders(sizes, cap.replicated, r, world),
            ),
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return caps


def _values(root: Path) -> list[dict[str, Any]]:
    """Every rank's tree decoded, global nodes resolved from the tensors stored under
    their names (checksums verified)."""
    reader = CheckpointReader(open_storage(str(root)), 1)
    out = []
    for r in reader.manifest["ranks"]:
        tree = r["tree"]
        names = [n for _, n in iter_tensor_refs(tree)] + list(global_refs(tree))
        got = reader.tensors(list(dict.fromkeys(names)), verify=True)
        out.append(decode(tree, got, "cpu", resolve=got.__getitem__)["engine"])
    return out


def _data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def test_replicated_paths_are_written_once_and_every_rank_decodes_its_own(tmp_path: Path) -> None:
    caps = _save(tmp_path / "once", replicated=True)
    _save(tmp_path / "each", replicated=False)
    for r, cap in enumerate(caps):
        # the module's tensors are global; "own" is this rank's
        # the tied weight is one global tensor, named from both places (format version 5)
        module = {"engine/module/wte", "engine/module/bias"}
        assert cap.replicated == module and set(global_refs(cap.tree)) == module
        assert list(global_refs(cap.tree)).count("engine/module/wte") == 2
        assert any(n == f"rank{r}/engine/own" for _, n in iter_tensor_refs(cap.tree))
    # every rank wrote the module (one 16 KiB tensor, tied) before; now one rank writes it
    saved = _data_bytes(tmp_path / "each") - _data_bytes(tmp_path / "once")
    assert saved >= 4096 * 4, saved
    assert _data_bytes(tmp_path / "once") < 2 * 4096 * 4 + 2 * 1000 * 4 + 4096  # wte once
    for root in ("once", "each"):
        CheckpointReader(open_storage(str(tmp_path / root)), 1).verify()
        for r, values in enumerate(_values(tmp_path / root)):
            assert torch.equal(values["own"], torch.full((1000,), float(r)))
            module = values["module"]
            assert torch.equal(module["wte"], torch.arange(4096, dtype=torch.float32))
            assert module["lm_head"] is module["wte"]  # one tensor at both places, as saved
            assert torch.equal(module["bias"], torch.ones(3))


def test_one_process_keeps_replicated_paths_as_plain_tensors() -> None:
    cap = capture({"engine": Engine(0, True)}, include_rng=False)
    assert not cap.replicated and not list(global_refs(cap.tree))
    assert {n for _, n in iter_tensor_refs(cap.tree)} >= {"engine/module/wte", "engine/own"}


@pytest.mark.parametrize("bad", ["module", (["module"],), ((),), (("module", 1.5),)])
def test_malformed_replicated_paths_are_refused_at_save(bad: Any) -> None:
    engine = Engine(0, True)
    engine.resumable_replicated = bad  # type: ignore[assignment]
    with pytest.raises(UnsupportedStateError, match="resumable_replicated should hold tuples"):
        capture({"engine": engine}, include_rng=False, rank=0, world_size=2)
