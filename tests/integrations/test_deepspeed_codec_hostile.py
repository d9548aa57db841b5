"""A hostile `DeepSpeedState` tree is a corrupt checkpoint: refused with a clear message,
never built into the engine, and skipped by restore for the older checkpoint.

The tagged nodes (``fragment_address``, loss scalers, ``torch.Size``, the ZeRO stage
enum) are allowed classes, but their values come from the checkpoint: an infinite or
huge element count, a negative offset, a loss-scaler attribute that would replace a
method, or a tree of the wrong shape must end as `CorruptCheckpointError` (which
restore treats like a bad checksum: WARNING, ``skip`` audit entry, older checkpoint),
not as a raw ``OverflowError`` or a scaler whose ``backward`` is an int.

The end-to-end tests rewrite the newest checkpoint's manifest (re-signed with
`manifest_digest`, as `tests/test_hostile.py` does, so that the digest check passes
and the codec's own checks are what is exercised): in one process (six hostile trees,
one DeepSpeed engine), and on two ranks under ``torchrun`` with only rank 1's tree
hostile, where both ranks must fall back together instead of one waiting for the
other until the timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

from launch import run, torchrun_cmd
from resumable.audit import read_audit
from resumable.commit import step_dir
from resumable.errors import CorruptCheckpointError, UnsupportedStateError
from resumable.integrations.deepspeed import (
    TAG_KEY,
    _checked,
    from_tree,
    to_tree,
)
from resumable.storage import open_storage
from state_checks import edit_rank_tree

pytestmark = pytest.mark.usefixtures("deepspeed_shm_op_built")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "deepspeed_gpt2.py"
TIMEOUT_S = 300.0

INF = float("inf")


def fragment(numel: Any = 12, start: Any = 4) -> dict[str, Any]:
    return {TAG_KEY: "fragment_address", "numel": numel, "start": start}


def scaler(cls: str = "LossScaler", **attrs: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"cur_scale": 1.0, "dynamic": cls == "DynamicLossScaler"}
    if cls == "DynamicLossScaler":
        base.update(
            cur_iter=3,
            last_overflow_iter=-1,
            scale_factor=2.0,
            scale_window=1000,
            min_scale=1.0,
            delayed_shift=2,
            cur_hysteresis=2,
            consecutive_hysteresis=False,
            raise_error_at_min_scale=True,
            dtype=torch.float16,
        )
    return {TAG_KEY: "loss_scaler", "class": cls, "attrs": {**base, **attrs}}


# ------------------------------------------------------------------ the codec


@pytest.mark.parametrize(
    "node,message",
    [
        (fragment(numel=INF), r"numel should be an integer .* found float inf"),
        (fragment(numel=-INF), r"numel should be an integer"),
        (fragment(numel=2**70), r"numel should be an integer in \[0, 9223372036854775807\]"),
        (fragment(numel=-3), r"numel should be an integer in \[0,"),
        (fragment(numel=2.5), r"numel should be an integer .* found float 2.5"),
        (fragment(numel=True), r"numel should be an integer .* found bool"),
        (fragment(start=-4), r"start should be an integer in \[0,"),
        (
            fragment(numel=2**62, start=2**62),
            r"start should be an integer in \[0, 4611686018427387903\]",
        ),
        ({TAG_KEY: "fragment_address", "numel": 3}, r"expected the fields \['numel', 'start'\]"),
        ({**fragment(), "extra": 1}, r"expected the fields"),
        (scaler(backward=1), r"LossScaler has no attribute\(s\) \['backward'\]"),
        (scaler(__class__=1), r"no attribute\(s\) \['__class__'\]"),
        (scaler("DynamicLossScaler", update_scale=0), r"no attribute\(s\) \['update_scale'\]"),
        (scaler(cur_scale="big"), r"LossScaler.cur_scale should be a finite number"),
        (scaler(cur_scale=INF), r"cur_scale should be a finite number .* found float inf"),
        (scaler(cur_scale=0.0), r"must be positive"),
        (scaler(dynamic=1), r"LossScaler.dynamic should be true or false, found int"),
        (scaler(dynamic=True), r"a LossScaler has dynamic=False"),
        (scaler("DynamicLossScaler", scale_window=0), r"scale_window should be an integer in \[1,"),
        (scaler("DynamicLossScaler", cur_iter=1.0), r"cur_iter should be an integer"),
        (scaler("DynamicLossScaler", dtype=torch.int64), r"dtype should be one of"),
        (scaler("DynamicLossScaler", dtype="float16"), r"dtype should be one of"),
        ({TAG_KEY: "loss_scaler", "class": "LossScaler", "attrs": {}}, r"cur_scale is missing"),
        ({TAG_KEY: "loss_scaler", "class": "LossScalerBase", "attrs": {}}, r"class should be"),
        ({TAG_KEY: "enum", "class": "ZeroStageEnum", "value": True}, r"value should be one of"),
        ({TAG_KEY: "enum", "class": "ZeroStageEnum", "value": 2.0}, r"value should be one of"),
        ({TAG_KEY: "size", "dims": [2**40, 2**40]}, r"more than 2\*\*63 - 1 elements"),
        ({TAG_KEY: "size", "dims": [3, INF]}, r"a dimension should be an integer"),
        ({TAG_KEY: "size", "dims": [1] * 65}, r"at most 64 sizes"),
        ({TAG_KEY: ["fragment_address"], "numel": 1, "start": 0}, r"unknown tagged node"),
    ],
)
def test_a_hostile_value_in_an_allowed_node_is_corrupt(node: dict[str, Any], message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match="DeepSpeedState tree: ") as info:
        from_tree({"optimizer_state_dict": {"param_slice_mappings": [{"w": node}]}})
    assert re.search(message, str(info.value)), str(info.value)


def test_the_allow_list_holds_every_attribute_of_deepspeeds_scalers() -> None:
    """What this DeepSpeed's scalers hold round-trips; one it does not know is refused
    at the save, not written to be refused (or dropped) at the restore."""
    static = LossScaler(scale=1)
    dynamic = DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=500,
        min_scale=1.0,
        delayed_shift=2,
        consecutive_hysteresis=True,
    )
    for obj in (static, dynamic):
        back = from_tree(to_tree(obj))
        assert type(back) is type(obj) and vars(back) == vars(obj)
        assert callable(back.backward) and callable(back.update_scale)
    dynamic.new_knob = 3
    with pytest.raises(UnsupportedStateError, match=r"attribute\(s\) \['new_knob'\]"):
        to_tree({"loss_scaler": dynamic})


def test_a_scaler_from_an_older_tree_gets_the_defaults_of_the_newer_attributes() -> None:
    node = scaler("DynamicLossScaler")
    del node["attrs"]["dtype"], node["attrs"]["raise_error_at_min_scale"]
    back = from_tree(node)
    assert back.dtype is torch.float16 and back.raise_error_at_min_scale is True


def valid_tree() -> dict[str, Any]:
    return {
        "format": 1,
        "deepspeed": "0.19.8",
        "zero_stage": 2,
        "bf16": False,
        "fp16": False,
        "dp_rank": 0,
        "dp_world_size": 2,
        "model_file": "mp_rank_00_model_states.pt",
        "model_states": {
            "module": {"w": torch.ones(2)},
            "global_steps": 5,
            "global_samples": 40,
            "skipped_steps": 0,
            "dp_world_size": 2,
            "mp_world_size": 1,
            "lr_scheduler": None,
            "optimizer": None,
        },
        "zero_file": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero": {"optimizer_state_dict": {"loss_scaler": scaler()}},
    }


def edited(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    tree = valid_tree()
    node: Any = tree
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return tree


@pytest.mark.parametrize(
    "tree,message",
    [
        (["format", 1], r"a DeepSpeedState tree \(a dict\) of format 1, found a list"),
        (edited(("format",), True), r"found format True"),
        (edited(("zero_stage",), 4), r"'zero_stage' should be an integer in \[0, 3\]"),
        (edited(("dp_rank",), 2), r"'dp_rank' should be an integer in \[0, 1\]"),
        (edited(("dp_world_size",), 0), r"'dp_world_size' should be an integer in \[1,"),
        (edited(("bf16",), 0), r"'bf16' should be true or false"),
        (edited(("model_file",), "../../etc/x.pt"), r"'model_file' should be a plain file name"),
        (edited(("model_file",), ".."), r"'model_file' should be a plain file name"),
        (edited(("zero_file",), None), r"'zero_file' should be a plain file name"),
        (edited(("model_states",), [1, 2]), r"'model_states' should be a dict, found list"),
        (edited(("model_states", "module"), None), r"model_states: 'module' should be a dict"),
        (edited(("model_states", "global_steps"), INF), r"'global_steps' should be an integer"),
        (edited(("model_states", "global_steps"), KeyError), r"'global_steps' is missing"),
        (edited(("model_states", "skipped_steps"), -1), r"'skipped_steps' should be an integer"),
        (edited(("model_states", "global_samples"), "40"), r"'global_samples' should be an"),
        (edited(("model_states", "mp_world_size"), 2**40), r"'mp_world_size' should be an"),
        (edited(("model_states", "lr_scheduler"), [1]), r"'lr_scheduler' should be a dict or None"),
        (edited(("zero",), [1]), r"'zero' should be None or a dict"),
        (edited(("zero", "optimizer_state_dict"), None), r"'zero' should be None or a dict"),
    ],
)
def test_a_malformed_tree_is_corrupt(tree: Any, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        _checked(tree)


def test_a_valid_tree_passes_the_checks() -> None:
    assert _checked(valid_tree())["dp_rank"] == 0


# ------------------------------------------------------ end to end, in one process

JOB = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import deepspeed, torch, resumable
from resumable.integrations.deepspeed import DeepSpeedState, state_sha256
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
    config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}})
mode, roots = sys.argv[2], sys.argv[3:]
if mode == "save":
    with resumable.Checkpointer(roots[0], {"engine": DeepSpeedState(engine)}, persist="sync",
                                keep=None) as ck:
        for step in (1, 2):
            x = torch.randn(1, 4, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).pow(2).sum())
            engine.step()
            ck.save(step)
            print(f"saved {step} {state_sha256(engine)}", flush=True)
for root in roots if mode == "restore" else ():
    with resumable.Checkpointer(root, {"engine": DeepSpeedState(engine)}, persist="sync",
                                keep=None) as ck:
        try:
            step = ck.restore()
        except BaseException as exc:
            print(f"restore {os.path.basename(root)}: raised {type(exc).__name__}: {exc}",
                  flush=True)
            continue
        print(f"restore {os.path.basename(root)}: step {step} {state_sha256(engine)}",
              flush=True)
"""


def run_job(*args: Any) -> str:
    from s3server import free_ports

    (port,) = free_ports(1)
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(port), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def dict_nodes(node: Any) -> Iterator[list[list[Any]]]:
    """Every ``{"dict": [[key, value], ...]}`` node's pair list in a manifest's tree."""
    if isinstance(node, dict):
        if isinstance(node.get("dict"), list):
            yield node["dict"]
        for value in node.values():
            yield from dict_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from dict_nodes(value)


def tagged(tree: Any, tag: str) -> list[list[Any]]:
    """The first dict node tagged ``tag`` by the DeepSpeed codec (its pair list)."""
    for pairs in dict_nodes(tree):
        if [TAG_KEY, tag] in pairs:
            return pairs
    raise AssertionError(f"no {tag!r} node in the tree")


def keyed(tree: Any, key: str) -> list[Any]:
    """The first ``[key, value]`` pair in the tree."""
    for pairs in dict_nodes(tree):
        for pair in pairs:
            if pair[0] == key:
                return pair  # type: ignore[no-any-return]
    raise AssertionError(f"no {key!r} entry in the tree")


def entry(pairs: list[list[Any]], key: str) -> Any:
    """The value of ``key`` in a dict node's pair list."""
    (value,) = [v for k, v in pairs if k == key]
    return value


def set_pair(pairs: list[list[Any]], key: str, value: Any) -> None:
    for pair in pairs:
        if pair[0] == key:
            pair[1] = value
            return
    pairs.append([key, value])


# Each: how the tree of the newest checkpoint is made hostile, and the words the skip
# must give as its reason.
HOSTILE: dict[str, tuple[Callable[[Any], None], str]] = {
    "inf-numel": (
        lambda t: set_pair(tagged(t, "fragment_address"), "numel", {"float": "inf"}),
        "numel should be an integer",
    ),
    "huge-numel": (
        lambda t: set_pair(tagged(t, "fragment_address"), "numel", 2**40),
        "does not lie in that group's fp32 partition",
    ),
    "negative-fragment-address": (
        lambda t: set_pair(tagged(t, "fragment_address"), "start", -16),
        "start should be an integer",
    ),
    "scaler-method-replaced": (
        lambda t: set_pair(entry(tagged(t, "loss_scaler"), "attrs")["dict"], "backward", 1),
        "no attribute(s) ['backward']",
    ),
    "scaler-attribute-of-wrong-type": (
        lambda t: set_pair(entry(tagged(t, "loss_scaler"), "attrs")["dict"], "cur_scale", "x"),
        "cur_scale should be a finite number",
    ),
    "malformed-structure": (
        lambda t: set_pair(keyed(t, "model_states")[1]["dict"], "global_steps", {"list": [2]}),
        "'global_steps' should be an integer",
    ),
}


def make_hostile(root: Path, step: int, rank: int, edit: Callable[[Any], None]) -> None:
    """Edit rank ``rank``'s tree in the checkpoint of ``step`` and re-sign it."""
    edit_rank_tree(root / step_dir(step), rank, edit)


@pytest.mark.timeout(900)
def test_a_hostile_newest_tree_falls_back_to_the_older_checkpoint(tmp_path: Path) -> None:
    """Two checkpoints; the newer one's tree made hostile six ways. Each restore skips
    it (an audit ``skip`` naming what was wrong) and loads step 1 exactly, where the
    code before the fix raised OverflowError or StateMismatchError, or built a loss
    scaler whose ``backward`` is an int."""
    saved = tmp_path / "saved"
    out = run_job("save", saved)
    digests = dict(re.findall(r"^saved (\d) ([0-9a-f]{64})$", out, re.M))
    assert set(digests) == {"1", "2"} and digests["1"] != digests["2"], out
    roots = []
    for name, (edit, _) in HOSTILE.items():
        shutil.copytree(saved, tmp_path / name)
        make_hostile(tmp_path / name, 2, 0, edit)
        roots.append(tmp_path / name)
    out = run_job("restore", *roots)
    for name, (_, reason) in HOSTILE.items():
        assert f"restore {name}: step 1 {digests['1']}" in out, out
        skips = [e for e in read_audit(open_storage(tmp_path / name)) if e["event"] == "skip"]
        assert [e["step"] for e in skips] == [2], (name, skips)
        assert "DeepSpeedState tree" in skips[0]["reason"], (name, skips)
        assert reason in skips[0]["reason"], (name, skips)


# ------------------------------------------------------------- two ranks, torchrun


@pytest.mark.timeout(900)  # two launches of about 10 s each alone; minutes under load
def test_one_ranks_hostile_tree_makes_both_ranks_fall_back_together(tmp_path: Path) -> None:
    """Rank 1's tree of the newest commit holds an infinite ``numel``; rank 0's is
    valid. Both ranks must skip that step together and resume from the older one (no
    rank left waiting for the other until the process group's timeout)."""
    ckpt = tmp_path / "ckpt"
    base = ["--stage", "1", "--save-every", "3", "--timeout", "120"]
    env = {"HF_HUB_OFFLINE": "1"}
    first = run(
        torchrun_cmd(2, EXAMPLE, "--dir", ckpt, *base, "--steps", "6"), env=env, timeout=TIMEOUT_S
    )[1]
    assert "final step=6" in first, first[-4000:]
    make_hostile(ckpt, 6, 1, HOSTILE["inf-numel"][0])
    # --steps 3: nothing to train after the restore; the run ends at once.
    second = run(
        torchrun_cmd(2, EXAMPLE, "--dir", ckpt, *base, "--steps", "3"), env=env, timeout=TIMEOUT_S
    )[1]
    resumed = set(re.findall(r"rank (\d) attempt 0: resumed from step (\d+)", second))
    assert resumed == {("0", "3"), ("1", "3")}, second[-4000:]
    assert "final step=3" in second, second[-4000:]
    # Rank 1 says why (the audit log is rank 0's, which had nothing to skip: as for a
    # bad checksum in one rank's file).
    warned = re.findall(r"skipping corrupt checkpoint step-0*6 in .*", second)
    assert warned and "numel should be an integer" in warned[0], second[-4000:]
