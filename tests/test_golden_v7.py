"""The golden checkpoint of format version 7 (``tests/golden/v7-parts/``, made once by
``tests/golden/make_gzip_parts.py``) stays loadable: two ranks' split manifest whose
parts are gzip'd JSON, a tied module replicated on both, read whole, as each rank
restoring, by ``resumable verify``, restored into one process, and copied elsewhere as
one manifest of the lowest version that holds it. Each test works on a copy in
``tmp_path``."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

import resumable
from resumable.capture import global_refs
from resumable.cli import main
from resumable.parts import PART_FORMAT
from resumable.reader import CheckpointReader
from resumable.reshard import GlobalLoader
from resumable.storage import open_storage
from state_checks import Tied, check_mine, golden_split_reader

GOLDEN = Path(__file__).resolve().parent / "golden" / "v7-parts"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
STEP = EXPECTED["step"]
WORLD = EXPECTED["world_size"]


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    shutil.copytree(GOLDEN, tmp_path / "v7")
    return tmp_path / "v7"


def _step(root: Path) -> Path:
    return root / f"step-{STEP:012d}"


def test_the_fixture_is_version_7_with_gzipped_parts(golden: Path) -> None:
    top = json.loads((_step(golden) / "manifest.json").read_text())
    assert top["format_version"] == 7 and top["world_size"] == WORLD
    assert "objects" not in top and "segments" not in top
    for r, entry in enumerate(top["parts"]):
        assert entry["file"] == f"part-{r:05d}.json.gz"
        blob = (_step(golden) / entry["file"]).read_bytes()
        assert len(blob) == entry["size"] < entry["json_size"]
        part = json.loads(gzip.decompress(blob))
        assert part["format"] == PART_FORMAT and part["rank"] == r
        names = list(global_refs(part["tree"]))  # the module is replicated: global refs
        assert names.count("model/wte.weight") == 2  # the tie: one stored tensor, twice


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_the_golden_checkpoint_reads(golden: Path, rank: int | None) -> None:
    """Read whole (and verified), and as each rank restoring at its world size."""
    reader = golden_split_reader(golden, STEP, 7, rank)
    assert reader.manifest["metrics"] == EXPECTED["metrics"]
    loader = GlobalLoader(reader, {})
    assert loader.value("model/wte.weight").tolist() == EXPECTED["weight"]
    check_mine(reader, EXPECTED["mine"], rank)


def test_the_cli_verifies_shows_and_exports_it(
    golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    assert main(["verify", str(golden), "--all"]) == 0
    assert main(["show", str(golden)]) == 0
    assert "v7" in capsys.readouterr().out
    out = tmp_path / "model.safetensors"
    assert main(["export", str(golden), "--key", "model", "--out", str(out)]) == 0
    got = load_file(str(out))
    assert got["wte.weight"].tolist() == EXPECTED["weight"]


def test_one_process_restores_the_tied_module(golden: Path) -> None:
    """At another world size (a reshard: every part read): the module's values, tied as
    saved; the per-rank tensor is left as it was."""
    model = Tied()
    extra = {"mine": torch.zeros(3, dtype=torch.int64)}
    with resumable.Checkpointer(golden, {"model": model, "extra": extra}, keep=None) as ckpt:
        assert ckpt.restore(reset_per_rank_state=True) == STEP
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.tolist() == EXPECTED["weight"]
    assert extra["mine"].tolist() == [0, 0, 0]


def test_a_copy_elsewhere_is_one_manifest_of_version_5(tmp_path: Path, golden: Path) -> None:
    """The mirror's copy: every part merged into one manifest; the tie keeps it at
    version 5, the lowest that holds a tree naming a stored tensor twice."""
    from resumable.pipeline.mirror import upload_checkpoint

    dst = open_storage(str(tmp_path / "remote"))
    assert upload_checkpoint(open_storage(str(golden)), dst, STEP) > 0
    copy = CheckpointReader(dst, STEP)
    assert copy.top["format_version"] == 5 and "parts" not in copy.top
    assert copy.verify() == CheckpointReader(open_storage(str(golden)), STEP).verify()
