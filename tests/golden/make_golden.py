"""Build the golden checkpoints of a format version in ``tests/golden/vN/``.

    .venv/bin/python tests/golden/make_golden.py [--version N] [--out DIR] [--force]

The fixture is what a user of format version 1 has on disk: ``tests/test_golden.py``
restores it with the current code and checks every value against ``expected.json``,
which this script writes beside the checkpoints (tensor bytes as sha256, every other
value in a typed JSON description, and the random draws that must follow a restore).
The test never imports this script.

A committed fixture is never regenerated: it stands for checkpoints that already exist.
When the format changes, bump ``FORMAT_VERSION``, run this script with ``--out
tests/golden/vN`` and keep every older directory. Everything is seeded, so a rerun
gives the same tensors and values; only ``versions`` (and so the digest) in the
manifests differ.

The state covers every node type of the tree vocabulary (see ``docs/format.md``): a
module, an optimizer after two steps, a scheduler, a GradScaler, and an ``extra`` dict
of scalars, non-finite floats, bytes, tuples, ``torch.Size``, dtypes, devices, NumPy
arrays, scalars and generators, a torch generator, and tensors of every common dtype
including a 0-dim, an empty and a non-contiguous one.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

import resumable
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

HERE = Path(__file__).resolve().parent
CREATED = 1767225600.0  # 2026-01-01T00:00:00Z, so the manifests do not depend on when this ran
HOSTNAME = "golden-fixture"


def build_state() -> dict[str, Any]:
    """The training state, seeded; model/optimizer not stepped yet."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    np_gen = np.random.default_rng(1234)
    np_gen.random(5)
    torch_gen = torch.Generator().manual_seed(4321)
    torch.rand(5, generator=torch_gen)
    f32 = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5
    extra: dict[str, Any] = {
        "int": 7,
        "negint": -3,
        "bigint": 2**70 + 1,
        "float": 0.1,
        "tiny": 1e-05,
        "huge": 1e16,
        "nan": float("nan"),
        "inf": float("inf"),
        "neginf": float("-inf"),
        "true": True,
        "false": False,
        "none": None,
        "str": 'héllo ✓ "quoted"\n',
        "empty_str": "",
        "bytes": b"\x00\x01\xfe\xffresumable",
        "tuple": (1, "two", 3.0, None),
        "list": [1, [2, 3], {"k": "v"}, ()],
        "int_keys": {1: "one", 2: "two"},
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "ndarray": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ndarray_u32": np.array([0, 1, 2**32 - 1], dtype=np.uint32),
        "npscalar_f32": np.float32(1.5),
        "npscalar_i64": np.int64(-9),
        "np_gen": np_gen,
        "torch_gen": torch_gen,
        "f32": f32,
        "f64": torch.tensor([1.5, -2.25, 1e-300], dtype=torch.float64),
        "f16": torch.tensor([0.5, -1.0, 65504.0], dtype=torch.float16),
        "bf16": torch.tensor([1.0, -3.5, 1e30]).to(torch.bfloat16),
        "i64": torch.tensor([-(2**62), 0, 2**62 + 1], dtype=torch.int64),
        "i32": torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 128, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar0d": torch.tensor(3.25),
        "empty": torch.empty(0, 3),
        "transposed": f32.t(),
        "step": 0,
    }
    return {"model": model, "optim": optim, "sched": sched, "scaler": scaler, "extra": extra}


def train_step(state: dict[str, Any], step: int) -> float:
    model, optim = state["model"], state["optim"]
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 4, generator=gen)
    y = torch.randn(8, 3, generator=gen)
    optim.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    state["sched"].step()
    state["extra"]["step"] = step
    return float(loss.item())


# --------------------------------------------------------------------------- description
# tests/test_golden.py has its own copy of `describe`; keep the two in agreement.


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def describe(v: Any) -> Any:
    """A typed JSON description of a Python value (tensors by dtype, shape and sha256)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if np.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.Tensor):
        return {
            "tensor": str(v.dtype),
            "shape": list(v.shape),
            "sha256": tensor_sha256(v),
        }
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


def describe_state(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": describe(state["model"].state_dict()),
        "optim": describe(state["optim"].state_dict()),
        "sched": describe(state["sched"].state_dict()),
        "scaler": describe(state["scaler"].state_dict()),
        "extra": describe(state["extra"]),
    }


def draws(state: dict[str, Any]) -> dict[str, list[float]]:
    """The next random numbers of every stream; consumes them."""
    return {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.random(3).tolist(),
        "torch": torch.rand(3).tolist(),
        "np_gen": state["extra"]["np_gen"].random(3).tolist(),
        "torch_gen": torch.rand(3, generator=state["extra"]["torch_gen"]).tolist(),
    }


# --------------------------------------------------------------------------- main


def make(out: Path, version: int = 1) -> dict[str, Any]:
    """Version 1: two checkpoints written whole. Version 3 (and version 2, written by
    resumable 0.1.0 until version 3 replaced it): the second refers to the first for every tensor
    that did not change (incremental, whatever it saves)."""
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    state = build_state()
    expected: dict[str, Any] = {"format_version": version, "steps": {}}
    incremental = (
        resumable.Incremental(chunk_bytes=4096, min_saving=0.0, min_live=0.0, min_bytes=0)
        if version >= 2
        else False
    )
    with (
        mock.patch("socket.gethostname", return_value=HOSTNAME),
        mock.patch("time.time", return_value=CREATED),
        resumable.Checkpointer(
            out, state, keep=None, persist="sync", incremental=incremental
        ) as ckpt,
    ):
        for step in (1, 2):
            loss = train_step(state, step)
            ckpt.save(step, metrics={"loss": loss, "lr": state["sched"].get_last_lr()[0]})
            expected["steps"][str(step)] = {"state": describe_state(state)}
            expected["steps"][str(step)]["draws"] = draws(state)
    storage = open_storage(out)
    for step in (1, 2):
        reader = CheckpointReader(storage, step)
        reader.verify()
        entry = expected["steps"][str(step)]
        entry["metrics"] = reader.manifest["metrics"]
        entry["tensors"] = {
            name: {
                "dtype": reader.manifest["tensors"][name]["dtype"],
                "shape": list(t.shape),
                "sha256": tensor_sha256(t),
            }
            for name, t in reader.tensors().items()
        }
    written = CheckpointReader(storage, 2).manifest["format_version"]
    if written != version:
        raise SystemExit(f"asked for format version {version}, step 2 was written as {written}")
    (out / "audit.jsonl").unlink(missing_ok=True)
    for name in (".resumable-lock", ".resumable-run"):  # the root's lock and run id
        (out / name).unlink(missing_ok=True)
    text = json.dumps(expected, indent=1, ensure_ascii=True, allow_nan=False) + "\n"
    (out / "expected.json").write_text(text)
    return expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "v1")
    parser.add_argument("--version", type=int, default=1, choices=(1, 3))
    parser.add_argument("--force", action="store_true", help="replace an existing fixture")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        if not args.force:
            print(
                f"{args.out} exists; committed golden fixtures must not change. "
                "Pass --force only if you know this one was never released.",
                file=sys.stderr,
            )
            return 1
        shutil.rmtree(args.out)
    make(args.out, args.version)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
