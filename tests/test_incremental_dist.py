"""Incremental checkpoints at two ranks (gloo, torchrun): an FSDP2 model with a frozen
backbone; both ranks write version 3 checkpoints that refer to their own earlier
chunks, and a relaunch restores bit for bit.

Run by pytest; the same file is the rank-side job
(``torchrun --nproc-per-node=2 tests/test_incremental_dist.py PHASE OUT``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

WIDTH = 128
STEPS = 4


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Frozen Linear(128, 128) x 2, a trained Linear(128, 4); each layer its own FSDP2
    unit (the frozen ones hold no gradient)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4))
    for p in model[:2].parameters():
        p.requires_grad_(False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optim


def _train(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step * 1009 + dist.get_rank())
    loss = model(torch.randn(8, WIDTH, generator=g)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def _job(phase: str, out: Path) -> None:
    from dist_job import dump
    from resumable import Checkpointer, Incremental, Keep

    model, optim = _build()
    state = {"model": model, "optim": optim}
    report: dict[str, Any] = {}
    if phase == "load":  # nothing of the initial values may survive the restore
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    with Checkpointer(
        out / "root",
        state,
        keep=Keep(last=2),
        incremental=Incremental(min_bytes=0),  # a small model: its frozen part < 1 MiB
        capture_rng=False,
        dist_timeout_s=60,
    ) as ck:
        report["restored"] = ck.restore()
        if phase == "save":
            for step in range(1, STEPS + 1):
                _train(model, optim, step)
                ck.save(step)
                ck.wait()
            dump(out, "saved", model, optim)
        else:
            dump(out, "restored", model, optim)
            _train(model, optim, STEPS + 1)
            ck.save(STEPS + 1)
            ck.wait()
    (out / f"{phase}-rank{dist.get_rank()}.json").write_text(json.dumps(report))


def _early(out: Path) -> None:
    """Phase "early": persists on a thread with `EARLY_MIN_BYTES` lowered, so each rank
    writes its data file while it hashes its frozen shards (`DeltaBase.plan_early`);
    at step 4 rank 1 changes a frozen shard, so its guess fails and it writes its file
    again, while rank 0's early file stands. Then the state is zeroed and restored."""
    import resumable.incremental as inc_mod
    from dist_job import dump
    from resumable import Checkpointer, Incremental, Keep

    inc_mod.EARLY_MIN_BYTES = 16 << 10  # this model's frozen part: 64.5 KiB per rank
    held: list[bool] = []  # per early persist: whether the guess held
    real = inc_mod.DeltaBase.confirm

    def confirm(self: Any, early: Any, data: Any, step: int) -> Any:
        got = real(self, early, data, step)
        held.append(got is None)
        return got

    inc_mod.DeltaBase.confirm = confirm  # type: ignore[method-assign]
    model, optim = _build()
    state = {"model": model, "optim": optim}
    kw: dict[str, Any] = {
        "keep": Keep(last=2),
        "incremental": Incremental(min_bytes=0),
        "capture_rng": False,
        "dist_timeout_s": 60,
        "persist": "thread",
    }
    with Checkpointer(out / "early", state, **kw) as ck:
        for step in range(1, STEPS + 3):
            _train(model, optim, step)
            if step == 4 and dist.get_rank() == 1:
                with torch.no_grad():
                    model[0].weight.to_local().mul_(-1.0)  # frozen, changed all the same
            ck.save(step)
            ck.wait()
    dump(out, "early-saved", model, optim)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with Checkpointer(out / "early", state, **kw) as ck:
        restored = ck.restore()
    dump(out, "early-restored", model, optim)
    report = {"restored": restored, "held": held}
    (out / f"early-rank{dist.get_rank()}.json").write_text(json.dumps(report))


# --------------------------------------------------------------------------- the test side


def _referred_files(tensors: dict[str, Any]) -> set[str]:
    """The basenames of the earlier checkpoints' data files that a manifest's tensor
    index reads bytes of."""
    from resumable.format import tensor_ranges

    return {
        fname.rsplit("/", 1)[-1]
        for info in tensors.values()
        for step, fname, _, _ in tensor_ranges(info)
        if step is not None
    }


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_two_ranks_write_incremental_checkpoints_and_restore_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from conftest import tensor_bytes_equal
    from launch import run, torchrun_cmd
    from resumable.commit import list_committed
    from resumable.reader import CheckpointReader
    from resumable.storage import LocalStorage

    def launch(phase: str) -> None:
        rc, output = run(torchrun_cmd(2, Path(__file__), phase, tmp_path), timeout=240)
        assert rc == 0, output[-6000:]

    launch("save")
    storage = LocalStorage(tmp_path / "root")
    committed = list_committed(storage)
    for s in committed:
        CheckpointReader(storage, s).verify()
    newest = CheckpointReader(storage, STEPS).manifest
    # several ranks: the split manifest (format version 7), its parts' refs in the top
    assert newest["format_version"] == 7 and newest["refs"], newest.get("refs")
    assert set(newest["refs"]) <= set(committed)  # kept though Keep(last=2) alone would not
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= {
        f.rsplit("/", 1)[-1] for f in newest["files"]
    }
    reused = _referred_files(newest["tensors"])
    assert reused == {"rank-00000.safetensors", "rank-00001.safetensors"}  # both ranks refer
    own = sum(f["size"] for f in newest["files"].values())
    whole = sum(
        f["size"] for f in CheckpointReader(storage, min(committed)).manifest["files"].values()
    )
    assert own < whole / 4

    launch("load")
    reports = [json.loads((tmp_path / f"load-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["restored"] for r in reports] == [STEPS, STEPS]
    want, got = (
        load_file(str(tmp_path / "saved.safetensors")),
        load_file(str(tmp_path / "restored.safetensors")),
    )
    assert sorted(got) == sorted(want)
    assert [k for k in want if not tensor_bytes_equal(got[k], want[k])] == []
    # the first persist after a restart is whole: the writer remembers nothing across launches
    after = CheckpointReader(storage, STEPS + 1).manifest
    assert after["refs"] == [] and not any("extents" in t for t in after["tensors"].values())


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_two_ranks_write_their_files_while_hashing_their_frozen_shards(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from conftest import tensor_bytes_equal
    from launch import run, torchrun_cmd
    from resumable.commit import list_committed
    from resumable.reader import CheckpointReader
    from resumable.storage import LocalStorage

    rc, output = run(torchrun_cmd(2, Path(__file__), "early", tmp_path), timeout=240)
    assert rc == 0, output[-6000:]
    reports = [json.loads((tmp_path / f"early-rank{r}.json").read_text()) for r in (0, 1)]
    # persists 3 to 6 went the early way on both ranks (1: whole, 2: nothing known yet);
    # rank 1's guess failed at step 4, where it changed a frozen shard
    assert reports[0]["held"] == [True, True, True, True], reports
    assert reports[1]["held"] == [True, False, True, True], reports
    assert [r["restored"] for r in reports] == [STEPS + 2, STEPS + 2]
    storage = LocalStorage(tmp_path / "early")
    for s in list_committed(storage):
        CheckpointReader(storage, s).verify()
    assert CheckpointReader(storage, STEPS + 2).manifest["refs"]
    want = load_file(str(tmp_path / "early-saved.safetensors"))
    got = load_file(str(tmp_path / "early-restored.safetensors"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not tensor_bytes_equal(got[k], want[k])] == []


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        _early(out) if phase == "early" else _job(phase, out)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    from dist_job import leave

    dist.barrier()
    dist.destroy_process_group()
    leave()  # exits 0


if __name__ == "__main__":
    main()
