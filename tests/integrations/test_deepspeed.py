"""`DeepSpeedState`: DeepSpeed engines (ZeRO 0-3, fp32 and bf16) checkpointed by `resumable`.

The jobs run ``examples/integrations/deepspeed_gpt2.py`` under ``torchrun`` with two ranks
on CPU (gloo), as a user would; its last line hashes every rank's whole engine state.
A run is judged by that line, not by torchrun's exit code alone. Each launch takes
5-9 s here; `make test` runs a kill at ZeRO 3 (fp32) and ZeRO 1 (bf16), the memory
tier (ZeRO 2), a world-size change, and the export to DeepSpeed's layout and back (ZeRO
2). Each uninterrupted reference run is launched once per session and shared; the
world-size change is tried on the ZeRO 2 reference's own checkpoint (it must leave it
as it was), not on one launched for it. The slow marker (`make campaign`) adds the
kill at ZeRO 0, 1, 2 (fp32) and 3 (bf16), the export at ZeRO 3, the universal-checkpoint
path and random kills for every stage and precision.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from launch import run, torchrun_cmd
from resumable.errors import CorruptCheckpointError
from resumable.integrations.deepspeed import (
    TAG_KEY,
    export_deepspeed,
    from_tree,
    to_tree,
)

pytestmark = pytest.mark.usefixtures("deepspeed_shm_op_built")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "deepspeed_gpt2.py"
TIMEOUT_S = 300.0
FINAL = re.compile(r"final step=(\d+) params_sha256=([0-9a-f]{64})")
RESUMED = re.compile(r"rank (\d) attempt (\d+): resumed from step (\d+)")


def launch(
    out: Path,
    *args: Any,
    nproc: int = 2,
    restarts: int = 0,
    env: dict[str, str] | None = None,
) -> str:
    """The example on ``nproc`` ranks; its output (stdout and stderr), whatever its exit
    code (the result line judges)."""
    cmd = torchrun_cmd(nproc, EXAMPLE, "--dir", out, *args, restarts=restarts)
    return run(cmd, env={"HF_HUB_OFFLINE": "1", **(env or {})}, timeout=TIMEOUT_S)[1]


def final(output: str) -> tuple[int, str]:
    """The result marker of a run that must have finished."""
    found = FINAL.findall(output)
    assert found, f"no result line:\n{output[-5000:]}"
    step, digest = found[-1]
    return int(step), digest


def resumed_from(output: str) -> dict[int, set[int]]:
    """attempt -> the steps its ranks resumed from."""
    seen: dict[int, set[int]] = {}
    for _rank, attempt, step in RESUMED.findall(output):
        seen.setdefault(int(attempt), set()).add(int(step))
    return seen


# `make test` runs one of the cases (about 30 s here, alone): ZeRO-3 in bf16, the
# partitioned parameters and the low-precision masters at once; stage 2 in fp32 is the
# memory-tier and export tests' below. The others are in `make campaign` with the random
# kills below.
CASES = [
    pytest.param(0, False, id="zero0-fp32", marks=pytest.mark.slow),
    pytest.param(1, False, id="zero1-fp32", marks=pytest.mark.slow),
    pytest.param(2, False, id="zero2-fp32", marks=pytest.mark.slow),
    pytest.param(3, False, id="zero3-fp32", marks=pytest.mark.slow),
    pytest.param(1, True, id="zero1-bf16", marks=pytest.mark.slow),
    pytest.param(3, True, id="zero3-bf16"),
]
STEPS = 20


def flags(stage: int, bf16: bool) -> list[str]:
    return ["--stage", str(stage), *(["--bf16"] if bf16 else []), "--steps", str(STEPS)]


_REFERENCE: dict[tuple[int, bool], tuple[str, Path]] = {}


def reference_run(
    tmp_path_factory: pytest.TempPathFactory, stage: int, bf16: bool
) -> tuple[str, Path]:
    """An uninterrupted run (one per case and test session): its result digest and its
    checkpoint root (which no test may change)."""
    if (stage, bf16) not in _REFERENCE:
        root = tmp_path_factory.mktemp(f"ref-{stage}-{int(bf16)}") / "ckpt"
        _REFERENCE[stage, bf16] = final(launch(root, *flags(stage, bf16)))[1], root
    return _REFERENCE[stage, bf16]


def reference(tmp_path_factory: pytest.TempPathFactory, stage: int, bf16: bool) -> str:
    """The result of an uninterrupted run (one per case and test session)."""
    return reference_run(tmp_path_factory, stage, bf16)[0]


@pytest.mark.parametrize("stage,bf16", CASES)
def test_a_rank_sigkilled_and_restarted_ends_bit_identical(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stage: int, bf16: bool
) -> None:
    """A rank SIGKILLs itself right after a random step's maybe_save, once a persist
    committed; torchrun restarts the group, which resumes from the last commit and
    ends with the same state as a run never killed."""
    rng = random.Random(f"{stage}-{bf16}")
    kill_at, kill_rank = rng.randint(6, 17), rng.randint(0, 1)
    output = launch(
        tmp_path / "ckpt",
        *flags(stage, bf16),
        restarts=1,
        env={"KILL_AT_STEP": str(kill_at), "KILL_RANK": str(kill_rank), "KILL_AFTER_COMMIT": "1"},
    )
    assert f"rank {kill_rank}: killing myself after step {kill_at}" in output, output[-4000:]
    resumed = resumed_from(output)
    assert resumed.get(1), f"no restart:\n{output[-4000:]}"
    (step,) = resumed[1]  # both ranks from the same step
    # Every 5 steps, or later when the worker was still busy (on_busy="skip" defers a
    # persist to the first step the worker is free).
    assert 0 < step <= kill_at
    assert final(output) == (STEPS, reference(tmp_path_factory, stage, bf16))


def test_the_memory_tier_resumes_from_the_step_of_the_kill(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With a snapshot at every step, the restarted group resumes from the killed step
    (from shared memory on both ranks), not from the last persist."""
    output = launch(
        tmp_path / "ckpt",
        *flags(2, False),
        "--memory-every",
        restarts=1,
        env={"KILL_AT_STEP": "13", "KILL_RANK": "1"},
    )
    assert resumed_from(output).get(1) == {13}, output[-4000:]
    assert final(output) == (STEPS, reference(tmp_path_factory, 2, False))


def test_a_world_size_change_is_refused_even_with_reset(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """ZeRO partitions cannot be reset to fresh values silently: one rank restoring a
    two-rank checkpoint fails, naming the way to reshard (DeepSpeed's universal
    checkpoint), and the checkpoint is left as it was. The checkpoint is the ZeRO 2
    reference run's (shared with the memory tier and export tests: one launch fewer)."""
    root = reference_run(tmp_path_factory, 2, False)[1]
    before = sorted(p.name for p in root.iterdir())
    output = launch(root, *flags(2, False), nproc=1)
    assert "StateMismatchError" in output and "ds_to_universal" in output, output[-4000:]
    assert "saved by 2 rank(s); this job has 1" in output
    assert FINAL.search(output) is None
    assert sorted(p.name for p in root.iterdir()) == before


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_export_to_deepspeeds_layout_and_back(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stage: int
) -> None:
    """A resumable checkpoint exported with export_deepspeed loads with DeepSpeed's own
    engine.load_checkpoint (the import path of the example), and training continued
    from it ends as an uninterrupted run does; zero_to_fp32 reads the export."""
    root = tmp_path / "ckpt"
    final(launch(root, "--stage", stage, "--steps", 12))
    out = tmp_path / "ds"
    tag_dir = Path(export_deepspeed(root, out))
    assert tag_dir == out / "global_step12"
    assert (out / "latest").read_text() == "global_step12"
    names = sorted(p.name for p in tag_dir.iterdir())
    want_zero = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    if stage == 3:
        assert names == sorted(
            want_zero + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
        )
    else:
        assert names == sorted([*want_zero, "mp_rank_00_model_states.pt"])
    # DeepSpeed's own reader takes it: continue to step 20 in a fresh root.
    output = launch(tmp_path / "again", *flags(stage, False), "--import-deepspeed", out)
    assert resumed_from(output)[0] == {12}  # imported at step 12
    assert final(output) == (STEPS, reference(tmp_path_factory, stage, False))
    # And zero_to_fp32, the recovery script DeepSpeed copies next to its checkpoints.
    fp32 = tmp_path / "fp32"
    proc = subprocess.run(
        [sys.executable, str(out / "zero_to_fp32.py"), str(out), str(fp32)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Its default output (--safe_serialization refuses GPT-2's tied embedding); read
    # here, in a test, with torch's weights-only loader.
    weights = torch.load(fp32 / "pytorch_model.bin", weights_only=True)
    assert weights["transformer.wte.weight"].shape == (128, 32)
    if stage < 3:  # the module's own weights at step 12 are the fp32 masters (fp32 training)
        module = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        assert set(weights) <= set(module)
        for name, w in weights.items():
            assert torch.equal(w, module[name]), name


# ------------------------------------------------------------------ in-process units


def test_the_codec_round_trips_deepspeeds_objects() -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    scaler = DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=500,
        min_scale=1.0,
        delayed_shift=2,
        consecutive_hysteresis=False,
    )
    scaler.cur_iter = 17
    value = {
        "zero_stage": ZeroStageEnum.gradients,
        "map": {"w": fragment_address(numel=12, start=4)},
        "loss_scaler": scaler,
        "static": LossScaler(scale=1.0),
        "shape": torch.Size([3, 4]),
        "betas": (0.9, 0.999),
        "state": {0: {"exp_avg": torch.ones(3)}},
    }
    tree = to_tree(value)
    assert tree["zero_stage"] == {TAG_KEY: "enum", "class": "ZeroStageEnum", "value": 2}
    back = from_tree(tree)
    assert back["zero_stage"] is ZeroStageEnum.gradients
    assert back["map"]["w"] == fragment_address(numel=12, start=4)
    assert isinstance(back["loss_scaler"], DynamicLossScaler)
    assert vars(back["loss_scaler"]) == vars(scaler)
    assert isinstance(back["static"], LossScaler) and back["static"].cur_scale == 1.0
    assert back["betas"] == (0.9, 0.999)
    assert type(back["shape"]) is torch.Size and back["shape"].numel() == 12
    assert torch.equal(back["state"][0]["exp_avg"], torch.ones(3))


@pytest.mark.parametrize(
    "node",
    [
        {TAG_KEY: "pickle", "class": "os.system"},
        {TAG_KEY: "enum", "class": "Popen", "value": 1},
        {TAG_KEY: "enum", "class": "ZeroStageEnum", "value": 9},
        {TAG_KEY: "loss_scaler", "class": "Popen", "attrs": {}},
        {TAG_KEY: "loss_scaler", "class": "LossScaler", "attrs": {"cur_scale": [1, 2]}},
        {TAG_KEY: "loss_scaler", "class": "LossScaler", "attrs": "cur_scale"},
        {TAG_KEY: "fragment_address", "numel": "x"},
        {TAG_KEY: "size", "dims": [3, -1]},
        {TAG_KEY: "size", "dims": "34"},
    ],
)
def test_a_hostile_tagged_node_is_corrupt_not_executed(node: dict[str, Any]) -> None:
    with pytest.raises(CorruptCheckpointError, match="DeepSpeedState tree"):
        from_tree({"a": [node]})


def _one_process_job(code: str, *args: str) -> str:
    """The stdout of ``code`` run by a fresh interpreter as a world of one (a free port
    first in its arguments, then ``args``), this checkout's library on its path; fails
    the test if it fails."""
    from s3server import free_ports

    (port,) = free_ports(1)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(port), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


UNIT_JOB = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import deepspeed, torch, resumable
from resumable.errors import UnsupportedStateError
from resumable.integrations.deepspeed import DeepSpeedState
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(4, 2)
engine, optim, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
    config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
for state in ({"model": engine}, {"model": engine.module, "optim": engine.optimizer}):
    try:
        resumable.Checkpointer(sys.argv[2], state, persist="sync").save(1)
    except UnsupportedStateError as exc:
        print("refused:", exc)
try:
    DeepSpeedState(engine.module)
except UnsupportedStateError as exc:
    print("refused:", exc)
"""


def test_an_engine_or_zero_optimizer_given_directly_is_refused(tmp_path: Path) -> None:
    """engine.state_dict() is the module's alone (ZeRO-3: placeholders), and a ZeRO
    optimizer's load_state_dict takes every rank's dicts: without the wrapper a
    checkpoint would look whole and restore wrong, so the Checkpointer refuses."""
    out = _one_process_job(UNIT_JOB, str(tmp_path / "ckpt"))
    refused = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refused) == 3, out
    assert "DeepSpeedEngine" in refused[0] and "DeepSpeedState(engine)" in refused[0]
    assert "DeepSpeedZeroOptimizer" in refused[1]
    assert "takes the engine deepspeed.initialize returned" in refused[2]
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step-*"))


OWNS_JOB = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import deepspeed, torch
from resumable._restore import _Own
from resumable.integrations.deepspeed import DeepSpeedState
deepspeed.init_distributed(dist_backend="gloo")

def engine(stage, steps, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}})
    for _ in range(steps):
        eng.backward(eng(torch.randn(2, 8)).square().sum())
        eng.step()
    return eng

def storages(value, out, depth=0):
    if isinstance(value, torch.Tensor):
        if value.numel():
            out.add(value.untyped_storage().data_ptr())
    elif isinstance(value, dict) and depth < 6:
        for v in value.values():
            storages(v, out, depth + 1)
    elif isinstance(value, (list, tuple)) and depth < 6:
        for v in value:
            storages(v, out, depth + 1)
    return out

def held(eng):
    out, opt, seen = set(), eng.optimizer, set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        storages(getattr(opt, "state", {}), out)
        storages(dict(vars(opt)), out)
        opt = getattr(opt, "optimizer", None)
    for t in [*eng.module.parameters(), *eng.module.buffers()]:
        storages([t, getattr(t, "ds_tensor", None)], out)
    return out

for stage in (0, 1, 3):
    source = DeepSpeedState(engine(stage, 2, 0)).state_dict()
    for target, steps in (("trained", 1), ("fresh", 0)):
        eng = engine(stage, steps, 1)
        given = _Own(frozenset())(source)  # the values as a restore hands them
        lent = storages(given, set())
        DeepSpeedState(eng).load_state_dict(given)
        kept = held(eng)
        moments = storages(getattr(eng.optimizer, "optimizer", eng.optimizer).state, set())
        print("stage", stage, target, "moments", len(moments), "shared", len(kept & lent))
"""


def test_the_engine_keeps_no_tensor_it_is_given() -> None:
    """`DeepSpeedState` sets ``resumable_copies_on_load``: a restore hands it the values
    it read (views of a shared-memory slot or of a mapped file, which later snapshots
    reuse) without copying them first, so every tensor the engine keeps after the load
    must be its own: the moments copied into the tensors that held them (an engine that
    trained) or cloned (a fresh one), at ZeRO 0, 1 and 3."""
    out = _one_process_job(OWNS_JOB)
    lines = [line.split() for line in out.splitlines() if line.startswith("stage ")]
    assert len(lines) == 6, out
    for words in lines:
        assert int(words[4]) > 0, words  # the moments were restored: the check means something
        assert words[5:] == ["shared", "0"], words


# ------------------------------------------------------------------ campaign


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16", [(s, b) for s in range(4) for b in (False, True)])
def test_random_sigkills_at_every_stage_and_precision_end_bit_identical(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stage: int, bf16: bool
) -> None:
    """Three kills per case, each of a random rank at a random step, each followed by a
    relaunch (a fresh torchrun), with and without the memory tier."""
    rng = random.Random(f"campaign-{stage}-{bf16}")
    root = tmp_path / "ckpt"
    memory = ["--memory-every"] if rng.random() < 0.5 else []
    for _ in range(3):
        kill_at, kill_rank = rng.randint(1, STEPS - 1), rng.randint(0, 1)
        output = launch(
            root,
            *flags(stage, bf16),
            *memory,
            env={"KILL_AT_STEP": str(kill_at), "KILL_RANK": str(kill_rank)},
        )
        if FINAL.search(output):  # resumed past the kill step: ran to the end
            break
    output = launch(root, *flags(stage, bf16), *memory)
    assert final(output) == (STEPS, reference(tmp_path_factory, stage, bf16))


UNIVERSAL_JOB = """
import os, sys, importlib.util, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
spec = importlib.util.spec_from_file_location("example", sys.argv[2])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
import deepspeed
from transformers import GPT2Config, GPT2LMHeadModel
deepspeed.init_distributed(dist_backend="gloo")
config = example.ds_config(2, False, 4)
config["checkpoint"] = {"load_universal": True}
torch.manual_seed(1)  # other initial values than the saving run's
model = GPT2LMHeadModel(GPT2Config(vocab_size=example.VOCAB, n_positions=example.SEQ,
    n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
engine, *_ = deepspeed.initialize(model=model, config=config,
                                  model_parameters=model.parameters())
engine.load_checkpoint(sys.argv[3], tag=sys.argv[4])
saved = torch.load(sys.argv[5], weights_only=False)["module"]
live = engine.module.state_dict()
differ = [k for k in saved if not torch.equal(saved[k], live[k])]
print("steps", engine.global_steps, "differ", differ)
"""


@pytest.mark.slow
def test_a_world_size_change_through_deepspeeds_universal_checkpoint(tmp_path: Path) -> None:
    """The way docs/deepspeed.md gives to change the world size: a two-rank checkpoint
    exported, converted by ds_to_universal and loaded by one rank with load_universal
    has the saved module weights."""
    from s3server import free_ports

    root = tmp_path / "ckpt"
    final(launch(root, "--stage", "2", "--steps", "6"))
    tag_dir = Path(export_deepspeed(root, tmp_path / "ds"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    convert = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(tag_dir), "--output_folder", str(tmp_path / "universal"), "--inject_missing_state"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=env,
    )  # fmt: skip
    assert convert.returncode == 0, convert.stderr[-3000:]
    (port,) = free_ports(1)
    load = subprocess.run(
        [sys.executable, "-c", UNIVERSAL_JOB, str(port), str(EXAMPLE), str(tmp_path),
         "universal", str(tag_dir / "mp_rank_00_model_states.pt")],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=env,
    )  # fmt: skip
    assert load.returncode == 0, load.stderr[-3000:]
    assert load.stdout.splitlines()[-1] == "steps 6 differ []", load.stdout[-2000:]
