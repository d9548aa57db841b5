"""`export_deepspeed` with ``storage_options`` (an object-store root), and where nothing
is committed: `NoCheckpointError`, the error `resumable.errors` gives that meaning.

A stand-in for `DeepSpeedState` (a stateful object whose tree has the same shape) is
saved, so that no DeepSpeed engine is needed: the export reads the tree from the
checkpoint, not from an engine. The exports of real engines are tested in
``test_deepspeed.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from resumable import Checkpointer
from resumable.errors import CheckpointError, NoCheckpointError
from resumable.integrations.deepspeed import TAG_KEY, export_deepspeed

pytestmark = pytest.mark.usefixtures("deepspeed_shm_op_built")


class StandIn:
    """What `DeepSpeedState` saves, from a fixed tree (no engine)."""

    resumable_per_rank = True

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree

    def state_dict(self) -> dict[str, Any]:
        return self.tree

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tree = dict(state_dict)


def engine_tree(step: int) -> dict[str, Any]:
    return {
        "format": 1,
        "deepspeed": "0.19.8",
        "zero_stage": 1,
        "bf16": False,
        "fp16": False,
        "dp_rank": 0,
        "dp_world_size": 1,
        "model_file": "mp_rank_00_model_states.pt",
        "model_states": {
            "module": {"w": torch.arange(6.0) + step},
            "global_steps": step,
            "global_samples": 4 * step,
            "skipped_steps": 0,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "lr_scheduler": None,
            "optimizer": None,
        },
        "zero_file": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero": {
            "optimizer_state_dict": {
                "loss_scaler": {
                    TAG_KEY: "loss_scaler",
                    "class": "LossScaler",
                    "attrs": {"cur_scale": 1, "dynamic": False},
                },
                "single_partition_of_fp32_groups": [torch.arange(6.0) + step],
                "param_slice_mappings": [
                    {"w": {TAG_KEY: "fragment_address", "numel": 6, "start": 0}}
                ],
            }
        },
    }


def s3_options(server: Any) -> dict[str, Any]:
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "max_attempts": 3,
    }


def test_storage_options_reach_an_s3_root(seaweedfs: Any, tmp_path: Path) -> None:
    """The options the Checkpointer was given open the same root for the export (no AWS
    environment here: without them the client could not find the server)."""
    url = f"s3://{seaweedfs.new_bucket('dsx')}/run"
    opts = s3_options(seaweedfs)
    with pytest.raises(NoCheckpointError, match="no committed checkpoint in s3://"):
        export_deepspeed(url, tmp_path / "none", storage_options=opts)
    state = {"engine": StandIn(engine_tree(3))}
    with Checkpointer(url, state, persist="sync", storage_options=opts) as ck:
        ck.save(3)
        state["engine"].tree = engine_tree(7)
        ck.save(7)
    out = Path(export_deepspeed(url, tmp_path / "ds", storage_options=opts))
    assert out == tmp_path / "ds" / "global_step7"
    assert (tmp_path / "ds" / "latest").read_text() == "global_step7"
    model = torch.load(out / "mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(model["module"]["w"], torch.arange(6.0) + 7)
    assert model["global_steps"] == 7
    older = Path(export_deepspeed(url, tmp_path / "ds3", step=3, storage_options=opts))
    assert older.name == "global_step3"
    zero = torch.load(older / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    fp32 = zero["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    assert torch.equal(fp32, torch.arange(6.0) + 3)
    with pytest.raises(NoCheckpointError, match=r"step 5 .* committed steps: \[3, 7\]"):
        export_deepspeed(url, tmp_path / "ds5", step=5, storage_options=opts)


def test_nothing_committed_is_no_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpointError, match="no committed checkpoint in") as info:
        export_deepspeed(tmp_path / "empty", tmp_path / "out")
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "out").exists()
    with Checkpointer(tmp_path / "run", {"engine": StandIn(engine_tree(2))}, persist="sync") as ck:
        ck.save(2)
    with pytest.raises(NoCheckpointError, match=r"step 4 .* committed steps: \[2\]"):
        export_deepspeed(tmp_path / "run", tmp_path / "out", step=4)
    assert Path(export_deepspeed(tmp_path / "run", tmp_path / "out")).name == "global_step2"


def test_storage_options_for_a_local_root_are_a_clear_error_not_a_type_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointError, match="apply to object storage URLs only"):
        export_deepspeed(tmp_path, tmp_path / "out", storage_options={"part_size": 8 << 20})
