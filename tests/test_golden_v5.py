"""The golden checkpoints of format version 5 (``tests/golden/v5-tied/``, made once by
``tests/golden/make_tied.py``) stay loadable: a tied module and a tensor given twice,
written by one process and by two ranks. Each test works on a copy in ``tmp_path``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable
from resumable.capture import decode, global_refs, iter_tensor_refs
from resumable.reader import CheckpointReader
from resumable.storage import open_storage
from state_checks import Tied

GOLDEN = Path(__file__).resolve().parent / "golden" / "v5-tied"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
STEP = EXPECTED["step"]


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    shutil.copytree(GOLDEN, tmp_path / "v5")
    return tmp_path / "v5"


def test_the_fixture_is_version_5_and_names_a_tensor_twice(golden: Path) -> None:
    for root in ("one", "ranks"):
        m = json.loads((golden / root / f"step-{STEP:012d}" / "manifest.json").read_text())
        assert m["format_version"] == 5
        assert ("parts" in m) == (root == "ranks")
    reader = CheckpointReader(open_storage(golden / "one"), STEP)
    assert "model/lm_head.weight" not in reader.manifest["tensors"]
    names = [n for _, n in iter_tensor_refs(reader.manifest["ranks"][0]["tree"])]
    assert names.count("model/wte.weight") == 2 and names.count("extra/a") == 3


def test_one_process_restores_tied_and_shared(golden: Path) -> None:
    model = Tied()
    state: dict[str, Any] = {"model": model, "extra": {}}
    with resumable.Checkpointer(golden / "one", state, keep=None, persist="sync") as ck:
        assert ck.restore() == STEP
    weight = torch.tensor(EXPECTED["weight"])
    assert model.lm_head.weight is model.wte.weight and torch.equal(model.wte.weight, weight)
    extra = state["extra"]
    assert extra["a"] is extra["b"] and extra["c"][0] is extra["a"]
    assert torch.equal(extra["a"], torch.tensor(EXPECTED["twice"]))
    assert CheckpointReader(open_storage(golden / "one"), STEP).verify() > 0


def test_two_ranks_decode_their_trees(golden: Path) -> None:
    reader = CheckpointReader(open_storage(golden / "ranks"), STEP)
    assert reader.verify() > 0
    weight = torch.tensor(EXPECTED["weight"])
    for r, rank in enumerate(reader.manifest["ranks"]):
        tree = rank["tree"]
        names = [n for _, n in iter_tensor_refs(tree)] + list(global_refs(tree))
        got = reader.tensors(list(dict.fromkeys(names)), verify=True)
        values = decode(tree, got, "cpu", resolve=got.__getitem__)
        module = values["model"]
        assert module["lm_head.weight"] is module["wte.weight"]
        assert torch.equal(module["wte.weight"], weight)
        assert values["extra"]["mine"].tolist() == EXPECTED["mine"][r]


def test_the_two_rank_checkpoint_restores_into_one_process(golden: Path) -> None:
    """At another world size (a reshard): the tied weight, a global tensor named from both
    places, is read once and the module stays tied."""
    model = Tied()
    state = {"model": model, "extra": {"mine": torch.zeros(3, dtype=torch.int64)}}
    with resumable.Checkpointer(golden / "ranks", state, keep=None, persist="sync") as ck:
        assert ck.restore(reset_per_rank_state=True) == STEP
    assert model.lm_head.weight is model.wte.weight
    assert torch.equal(model.wte.weight, torch.tensor(EXPECTED["weight"]))
    assert state["extra"]["mine"].tolist() == [0, 0, 0]  # per-rank: left as it was
