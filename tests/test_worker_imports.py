"""The persist worker does its work without loading torch or NumPy (`resumable._lazy`):
it starts sooner (a launch's first saves waited for its torch import, issue 48), holds
less memory and takes less CPU from the trainer beside it (NumPy's import and its BLAS
threads: about half of the worker's CPU in a short Trainer run). Checked on a live
worker of a real Checkpointer through ``/proc``: after full and incremental persists
and retention, no torch or NumPy library is mapped in it, its manifests record the
trainer's versions of both, and what it wrote restores bit for bit. (A mirror's upload
verifies the checkpoint in full, random streams tried on generators, and loads torch in
the worker when it first runs.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from resumable import Checkpointer, Every, Keep
from resumable.reader import CheckpointReader
from resumable.storage.local import LocalStorage
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")


def _torch_mapped(pid: int) -> list[str]:
    return _mapped(pid, "libtorch")


def _mapped(pid: int, part: str) -> list[str]:
    """The files mapped in ``pid`` whose path holds ``part``."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f if part in line})


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt}


def _train(state: dict[str, object], step: int) -> None:
    model, opt = state["model"], state["optim"]
    assert isinstance(model, torch.nn.Module) and isinstance(opt, torch.optim.Optimizer)
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(16, 64, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_the_worker_persists_without_torch(tmp_path: Path, shm_dir: Path) -> None:
    state = _state()
    ckpt = Checkpointer(
        tmp_path / "root",
        state,
        persist="process",
        on_busy="wait",
        shm_dir=shm_dir,
        keep=Keep(last=2),
        persist_every=Every(steps=1),
    )
    try:
        ckpt.restore()
        for step in range(1, 6):
            _train(state, step)
            assert ckpt.save(step)
        ckpt.wait()
        pid = ckpt.worker_pid
        assert pid is not None
        steps = ckpt.steps()  # incremental persists, then retention
        assert steps[-2:] == [4, 5] and 2 not in steps and 3 not in steps
        assert _torch_mapped(pid) == [], "the persist worker loaded torch"
        assert _mapped(pid, "_multiarray_umath") == [], "the persist worker loaded NumPy"
        versions = CheckpointReader(LocalStorage(tmp_path / "root"), 5).manifest["versions"]
        assert (versions["torch"], versions["numpy"]) == (torch.__version__, np.__version__)
    finally:
        ckpt.close()
    want = {k: v.clone() for k, v in state["model"].state_dict().items()}  # type: ignore[attr-defined]
    fresh = _state()
    with Checkpointer(tmp_path / "root", fresh, persist="thread", shm_dir=shm_dir) as again:
        assert again.restore() == 5
    got = fresh["model"].state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_worker_modules_do_not_import_torch() -> None:
    """The modules the worker loads (its boot skips ``resumable/__init__``), imported the
    same way in a fresh interpreter, leave torch and NumPy unloaded; a tensor path still
    loads torch at first use."""
    code = (
        "import resumable.pipeline._worker, resumable.pipeline.mirror, resumable.retention\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'numpy' not in sys.modules, 'numpy was imported'\n"
        "from resumable._dtypes import dtype_from_name\n"
        "assert 'torch' not in sys.modules\n"
        "print(dtype_from_name('BF16'))\n"
        "assert 'torch' in sys.modules\n"
    )
    out = _booted(code)
    assert out.stdout.strip() == "torch.bfloat16"


def test_a_manifest_is_built_while_another_thread_imports_torch() -> None:
    """The worker's early import of torch (several ranks, a mirror) runs beside its
    persists: building a manifest meanwhile reads torch's version and checks metrics
    for tensors without touching the half-imported module (a persist once failed with
    "partially initialized module 'torch' has no attribute '__version__'")."""
    code = (
        "import importlib, threading, time\n"
        "from resumable import _lazy, format\n"
        "t = threading.Thread(target=importlib.import_module, args=('torch',))\n"
        "t.start()\n"
        "n = 0\n"
        "while t.is_alive() or n == 0:\n"
        "    format.versions(); format.json_metrics({'loss': 1.5}); _lazy.torch_module()\n"
        "    n += 1\n"
        "    time.sleep(0.002)\n"
        "t.join()\n"
        "assert format.versions()['torch'] == sys.modules['torch'].__version__\n"
        "assert _lazy.torch_module() is sys.modules['torch']\n"
        "print(n)\n"
    )
    out = _booted(code)
    assert int(out.stdout) > 1  # built many times while torch was being imported


def _booted(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter after the package is loaded as the worker's
    boot loads it (without ``resumable/__init__``); it must exit 0."""
    src = Path(__file__).resolve().parents[1] / "src"
    boot = (
        "import importlib.machinery, importlib.util, sys\n"
        f"spec = importlib.machinery.PathFinder.find_spec('resumable', [{str(src)!r}])\n"
        "sys.modules['resumable'] = importlib.util.module_from_spec(spec)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", boot + code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out
