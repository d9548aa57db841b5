"""Golden checkpoints of every format version stay loadable.

``tests/golden/v1/`` holds checkpoints written by format version 1 (made once by
``tests/golden/make_golden.py``) and ``expected.json``, the values they must restore
to. Each test works on a copy in ``tmp_path``: the fixture itself is never written. The
generator is not imported; `describe` below is an independent copy of its description
of values, so a change in how the current code restores shows up as a mismatch here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

import resumable
from resumable.errors import CorruptCheckpointError
from resumable.format import MANIFEST, decode_manifest
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

pytestmark = pytest.mark.usefixtures("sync_persist")

GOLDEN = Path(__file__).resolve().parent / "golden"
V1 = GOLDEN / "v1"
VERSIONS = ("v1", "v2", "v3")  # v2, v3: step 2 refers to step 1 for what did not change
EXPECTED_OF = {v: json.loads((GOLDEN / v / "expected.json").read_text()) for v in VERSIONS}
EXPECTED = EXPECTED_OF["v1"]
STEPS = sorted(int(s) for s in EXPECTED["steps"])
TORCH_OBJECTS = ("model", "optim", "sched", "scaler")


@pytest.fixture(params=VERSIONS)
def golden(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A private copy of a version's fixture (its directory keeps the version's name)."""
    dst = tmp_path / request.param
    shutil.copytree(GOLDEN / request.param, dst)
    return dst


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """Restoring a checkpoint sets the global RNG streams; give other tests theirs back."""
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(pt)


def fresh_state() -> dict[str, Any]:
    """A state of the same shape as the one the fixture was saved from, other values."""
    torch.manual_seed(99)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.1)
    scaler = torch.amp.GradScaler("cpu")
    extra: dict[str, Any] = {
        "np_gen": np.random.default_rng(0),
        "torch_gen": torch.Generator().manual_seed(0),
        "f32": torch.zeros(2, 3),
        "f64": torch.zeros(3, dtype=torch.float64),
        "f16": torch.zeros(3, dtype=torch.float16),
        "bf16": torch.zeros(3, dtype=torch.bfloat16),
        "i64": torch.zeros(3, dtype=torch.int64),
        "i32": torch.zeros(3, dtype=torch.int32),
        "i8": torch.zeros(3, dtype=torch.int8),
        "u8": torch.zeros(3, dtype=torch.uint8),
        "bool": torch.zeros(3, dtype=torch.bool),
        "scalar0d": torch.tensor(0.0),
        "empty": torch.empty(0, 3),
        "transposed": torch.zeros(3, 2),
        "int": None,
        "list": [],
        "stale_key": "must disappear: the checkpoint has no such key",
    }
    return {"model": model, "optim": optim, "sched": sched, "scaler": scaler, "extra": extra}


# --------------------------------------------------------------------------- description
# An independent copy of make_golden.describe.


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def describe(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if np.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype), "shape": list(v.shape), "sha256": tensor_sha256(v)}
    if isinstance(v, np.ndarray):
        return {
            "ndarray": v.dtype.str,
            "shape": list(v.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(),
        }
    if isinstance(v, np.generic):
        return {"npscalar": v.dtype.str, "v": describe(v.item())}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v)}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, bytes):
        return {"bytes": base64.b64encode(v).decode("ascii")}
    if isinstance(v, torch.Generator):
        return {"torch_generator": tensor_sha256(v.get_state())}
    if isinstance(v, np.random.Generator):
        return {"np_generator": describe(v.bit_generator.state)}
    if isinstance(v, dict):
        return {"dict": [[k, describe(x)] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {"tuple": [describe(x) for x in v]}
    if isinstance(v, list):
        return [describe(x) for x in v]
    raise TypeError(f"cannot describe {type(v)!r}")


def assert_matches(expected: Any, actual: Any, path: str, *, loose: bool) -> None:
    """Deep equality of two descriptions, types included (1 != 1.0 != True). With
    ``loose``, ``actual`` dicts may hold keys ``expected`` lacks: a newer torch may add
    fields to an optimizer's state dict when it loads an old one."""
    if isinstance(expected, dict) and set(expected) == {"dict"}:
        assert isinstance(actual, dict) and set(actual) == {"dict"}, f"{path}: {actual!r}"
        exp = {k: v for k, v in expected["dict"]}
        act = {k: v for k, v in actual["dict"]}
        missing = [k for k in exp if k not in act]
        assert not missing, f"{path}: keys {missing} missing after restore"
        if not loose:
            extra = [k for k in act if k not in exp]
            assert not extra, f"{path}: unexpected keys {extra} after restore"
        for k, v in exp.items():
            assert_matches(v, act[k], f"{path}[{k!r}]", loose=loose)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{path}: {actual!r}"
        for k in expected:
            assert_matches(expected[k], actual[k], f"{path}.{k}", loose=loose)
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_matches(e, a, f"{path}[{i}]", loose=loose)
    else:
        assert type(actual) is type(expected) and actual == expected, (
            f"{path}: expected {expected!r}, restored {actual!r}"
        )


def draws(state: dict[str, Any]) -> dict[str, list[float]]:
    return {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.random(3).tolist(),
        "torch": torch.rand(3).tolist(),
        "np_gen": state["extra"]["np_gen"].random(3).tolist(),
        "torch_gen": torch.rand(3, generator=state["extra"]["torch_gen"]).tolist(),
    }


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("version", VERSIONS)
def test_fixture_is_present_and_small(version: str) -> None:
    here = GOLDEN / version
    files = sorted(p.relative_to(here).as_posix() for p in here.rglob("*") if p.is_file())
    step_files = [
        f"step-{s:012d}/{name}" for s in STEPS for name in (MANIFEST, "rank-00000.safetensors")
    ]
    assert files == sorted(["expected.json", *step_files])
    assert EXPECTED_OF[version]["format_version"] == int(version[1:])
    assert sorted(int(s) for s in EXPECTED_OF[version]["steps"]) == [1, 2]
    assert sum((here / f).stat().st_size for f in files) < 200_000
    newest = json.loads((here / f"step-{2:012d}" / MANIFEST).read_text())
    assert newest["format_version"] == int(version[1:])
    if version != "v1":  # the incremental one refers to step 1 for tensors and chunks
        assert newest["refs"] == [1]
        key = "chunks" if version == "v2" else "sources"
        pieces = [c for t in newest["tensors"].values() for c in t[key]]
        assert any("step" in c for c in pieces) and any("step" not in c for c in pieces)


@pytest.mark.parametrize("step", STEPS)
def test_restore_gives_every_saved_value(golden: Path, step: int) -> None:
    expected = EXPECTED_OF[golden.name]["steps"][str(step)]
    state = fresh_state()
    kept = {k: v for k, v in state["extra"].items() if isinstance(v, torch.Tensor)}
    np_gen, torch_gen = state["extra"]["np_gen"], state["extra"]["torch_gen"]
    with resumable.Checkpointer(golden, state, keep=None) as ckpt:
        assert ckpt.steps() == STEPS
        assert ckpt.restore(step=step) == step
    for key in TORCH_OBJECTS:
        actual = describe(state[key].state_dict())
        assert_matches(expected["state"][key], actual, f"state[{key!r}]", loose=True)
    assert_matches(expected["state"]["extra"], describe(state["extra"]), "extra", loose=False)
    # In-place restore: the same tensor and generator objects now hold the saved values.
    for name, t in kept.items():
        assert state["extra"][name] is t, name
    assert state["extra"]["np_gen"] is np_gen and state["extra"]["torch_gen"] is torch_gen
    assert state["optim"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**step)
    # The random streams continue exactly where the saving process left them.
    assert draws(state) == expected["draws"]


def test_restore_without_step_takes_the_newest(golden: Path) -> None:
    state = fresh_state()
    with resumable.Checkpointer(golden, state, keep=None) as ckpt:
        assert ckpt.restore() == max(STEPS)
    assert state["extra"]["step"] == max(STEPS)


@pytest.mark.parametrize("step", STEPS)
def test_reader_verifies_and_tensor_bytes_match(golden: Path, step: int) -> None:
    expected = EXPECTED_OF[golden.name]["steps"][str(step)]
    reader = CheckpointReader(open_storage(golden), step)
    data_file = golden / f"step-{step:012d}" / "rank-00000.safetensors"
    assert reader.verify() == data_file.stat().st_size
    m = reader.manifest
    assert m["format"] == "resumable-checkpoint"
    assert m["format_version"] == (int(golden.name[1:]) if step == 2 else 1)
    assert m["step"] == step
    assert m["world_size"] == 1
    assert m["metrics"] == expected["metrics"]
    assert list(m["files"]) == ["rank-00000.safetensors"]
    tensors = reader.tensors()
    assert sorted(tensors) == sorted(expected["tensors"])
    for name, t in tensors.items():
        want = expected["tensors"][name]
        assert m["tensors"][name]["dtype"] == want["dtype"], name
        assert list(t.shape) == want["shape"], name
        assert tensor_sha256(t) == want["sha256"], name


@pytest.mark.parametrize("step", STEPS)
def test_data_files_stay_plain_safetensors(golden: Path, step: int) -> None:
    expected = EXPECTED_OF[golden.name]["steps"][str(step)]["tensors"]
    path = golden / f"step-{step:012d}" / "rank-00000.safetensors"
    loaded = safetensors.torch.load_file(path)
    if golden.name != "v1" and step == 2:
        # Only what changed: tensors written whole, and changed chunks (``name#chunkI``, bytes)
        whole = {n: t for n, t in loaded.items() if "#" not in n}
        assert 0 < len(whole) < len(expected) and set(whole) <= set(expected)
        assert {n.split("#")[0] for n in loaded} <= set(expected)
        assert all(t.dtype == torch.uint8 for n, t in loaded.items() if "#" in n)
        loaded = whole
    else:
        assert sorted(loaded) == sorted(expected)
    for name, t in loaded.items():
        assert tensor_sha256(t) == expected[name]["sha256"], name
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata()["producer"] == "resumable"
        assert f.metadata()["step"] == str(step)


def test_manifest_digest_is_checked_on_the_golden(golden: Path) -> None:
    path = golden / f"step-{max(STEPS):012d}" / MANIFEST
    raw = path.read_bytes()
    assert decode_manifest(raw, where="golden")["step"] == max(STEPS)
    edited = raw.replace(b'"world_size": 1', b'"world_size": 2')
    assert edited != raw
    with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
        decode_manifest(edited, where="golden")


def test_flipped_byte_in_the_golden_is_detected(golden: Path) -> None:
    step = max(STEPS)
    path = golden / f"step-{step:012d}" / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte belongs to a tensor, not the header
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        CheckpointReader(open_storage(golden), step).verify()
    # Restore skips the damaged newest checkpoint and falls back to the older one.
    state = fresh_state()
    with resumable.Checkpointer(golden, state, keep=None) as ckpt:
        assert ckpt.restore() == min(STEPS)
    assert state["extra"]["step"] == min(STEPS)
