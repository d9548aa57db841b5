"""The golden checkpoint of format version 6 (``tests/golden/v6-nodes/``, made once by
``tests/golden/make_nodes.py``) stays loadable: four ranks on two nodes of two ranks,
each node's data files and parts in one object, read whole, as each rank restoring, by
``resumable verify``, restored into one process and exported. Each test works on a
copy in ``tmp_path``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import resumable
from resumable.cli import main
from resumable.reshard import GlobalLoader
from state_checks import check_mine, golden_split_reader

GOLDEN = Path(__file__).resolve().parent / "golden" / "v6-nodes"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
STEP = EXPECTED["step"]
WORLD = EXPECTED["world_size"]
FILES = ["manifest.json", "node-00000.bin", "node-00002.bin"]


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    shutil.copytree(GOLDEN, tmp_path / "v6")
    return tmp_path / "v6"


def _step(root: Path) -> Path:
    return root / f"step-{STEP:012d}"


def _model() -> torch.nn.Module:
    """The fixture's module, with other values than its own."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_the_fixture_is_version_6_with_one_object_per_node(golden: Path) -> None:
    assert sorted(p.name for p in _step(golden).iterdir()) == FILES
    top = json.loads((_step(golden) / "manifest.json").read_text())
    assert top["format_version"] == 6 and top["world_size"] == WORLD
    assert top["metrics"] == EXPECTED["metrics"]
    assert sorted(top["objects"]) == FILES[1:]
    for name, info in top["objects"].items():
        assert (_step(golden) / name).stat().st_size == info["size"]
    assert set(top["segments"]) == set(top["files"]) | {p["file"] for p in top["parts"]}
    per_node = EXPECTED["per_node"]
    for r in range(WORLD):
        node = f"node-{r - r % per_node:05d}.bin"
        assert top["segments"][f"rank-{r:05d}.safetensors"]["object"] == node
        assert top["segments"][f"part-{r:05d}.json"]["object"] == node


@pytest.mark.parametrize("rank", [None, 0, 1, 2, 3])
def test_the_golden_node_checkpoint_reads(golden: Path, rank: int | None) -> None:
    """Read whole (and verified), and as each rank restoring at its world size."""
    reader = golden_split_reader(golden, STEP, 6, rank)
    assert reader.manifest["metrics"] == EXPECTED["metrics"]
    loader = GlobalLoader(reader, {})
    for k, v in EXPECTED["model"].items():
        assert loader.value(f"model/{k}").tolist() == v
    check_mine(reader, EXPECTED["mine"], rank)
    assert sorted(p.name for p in _step(golden).iterdir()) == FILES


def test_the_cli_verifies_and_exports_it(
    golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    assert main(["verify", str(golden), "--all"]) == 0
    assert main(["show", str(golden)]) == 0
    out = tmp_path / "model.safetensors"
    assert main(["export", str(golden), "--key", "model", "--out", str(out)]) == 0
    got = load_file(str(out))
    assert sorted(got) == sorted(EXPECTED["model"])
    for k, v in EXPECTED["model"].items():
        assert got[k].tolist() == v
    assert sorted(p.name for p in _step(golden).iterdir()) == FILES


def test_the_four_rank_checkpoint_restores_into_one_process(golden: Path) -> None:
    """At another world size (a reshard): the module's values, each read from the node
    object of the rank that wrote it; the per-rank tensor is left as it was."""
    model = _model()
    extra = {"mine": torch.zeros(3, dtype=torch.int64)}
    state = {"model": model, "extra": extra}
    with resumable.Checkpointer(golden, state, keep=None) as ckpt:
        assert ckpt.restore(reset_per_rank_state=True) == STEP
    for k, v in EXPECTED["model"].items():
        assert model.state_dict()[k].tolist() == v
    assert extra["mine"].tolist() == [0, 0, 0]
