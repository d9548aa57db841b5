"""The peers, measured on the same state in the same run: ``torch.save``,
``torch.distributed.checkpoint`` (sync and ``async_save`` in several stagings) and,
through a subprocess in its own virtual environment, DLRover Flash Checkpoint.

Every save method follows one small protocol so that `run.py` can interleave them
round-robin (rep 0 of every method, then rep 1, ...), which spreads the noise of a
shared machine evenly across methods:

- ``save(i)`` saves the state as checkpoint ``i`` and returns only once it is complete
  (durable where the method makes it so), with ``{"blocking": s, "total": s}``:
  *blocking* is how long the caller could not touch its tensors, *total* until the
  checkpoint is complete. For synchronous methods they are equal.
- ``cleanup(i)`` removes checkpoint ``i`` (the newest one stays for the restore).
- ``restore()`` loads the newest checkpoint back into the live tensors (a restore ends
  with the bytes in the trainer's tensors, so a loader that returns new tensors pays for
  the copy into the live ones, like ``load_state_dict`` does) and returns
  ``{"total": s}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import state as state_mod
import torch


class SaveMethod:
    name = ""
    label = ""
    notes = ""
    is_async = False

    def __init__(self, root: Path, tree: Any) -> None:
        self.root = root / self.name
        self.root.mkdir(parents=True, exist_ok=True)
        self.tree = tree
        self.last: Path | None = None

    def path(self, i: int) -> Path:
        return self.root / f"ckpt-{i}"

    def save(self, i: int) -> dict[str, float]:
        raise NotImplementedError

    def cleanup(self, i: int) -> None:
        p = self.path(i)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def restore(self) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def info(self) -> dict[str, Any]:
        return {"label": self.label, "notes": self.notes, "async": self.is_async}


class TorchSave(SaveMethod):
    name = "torch_save"
    label = "torch.save + fsync"
    notes = "torch.save(state, f); f.flush(); os.fsync(f.fileno()) — synchronous, pickle-based"

    def path(self, i: int) -> Path:
        return self.root / f"ckpt-{i}.pt"

    def save(self, i: int) -> dict[str, float]:
        path = self.path(i)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.tree, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        self.last = path
        return {"blocking": dt, "total": dt}

    def restore(self) -> dict[str, float]:
        assert self.last is not None
        t0 = time.perf_counter()
        loaded = torch.load(self.last, weights_only=True)
        state_mod.copy_into(self.tree, loaded)
        return {"total": time.perf_counter() - t0}


class DcpSave(SaveMethod):
    name = "dcp_save"
    label = "dcp.save"
    notes = "torch.distributed.checkpoint.save(state, checkpoint_id=DIR, no_dist=True)"

    def save(self, i: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(self.tree, checkpoint_id=self.path(i), no_dist=True)
        dt = time.perf_counter() - t0
        self.last = self.path(i)
        return {"blocking": dt, "total": dt}

    def restore(self) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        assert self.last is not None
        t0 = time.perf_counter()
        dcp.load(self.tree, checkpoint_id=self.last, no_dist=True)
        return {"total": time.perf_counter() - t0}


class DcpAsyncSave(DcpSave):
    """``dcp.async_save``: *blocking* is the call itself (plus, with asynchronous
    staging, the wait for ``staging_completion``, before which the caller must not touch
    its tensors); *total* is ``.result()`` (``upload_completion`` with async staging)."""

    name = "dcp_async_default"
    label = "dcp.async_save (defaults)"
    notes = "thread executor, DefaultStager with every option off (what async_save builds)"
    is_async = True

    def __init__(self, root: Path, tree: Any) -> None:
        super().__init__(root, tree)
        self.stager: Any = None

    def kwargs(self) -> dict[str, Any]:
        return {"no_dist": True}

    def save(self, i: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        r = dcp.async_save(self.tree, checkpoint_id=self.path(i), **self.kwargs())
        call = time.perf_counter() - t0
        if hasattr(r, "staging_completion"):
            r.staging_completion.result()
            blocking = time.perf_counter() - t0
            r.upload_completion.result()
        else:
            blocking = call
            r.result()
        total = time.perf_counter() - t0
        self.last = self.path(i)
        return {"call": call, "blocking": blocking, "total": total}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class DcpAsyncSharedStager(DcpAsyncSave):
    name = "dcp_async_shm"
    label = "dcp.async_save (shm stager)"
    notes = (
        "thread executor, one reused DefaultStager(StagingOptions(use_pinned_memory=<cuda>, "
        "use_shared_memory=True, use_async_staging=False)) — staging buffers are cached "
        "across saves"
    )

    def kwargs(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.stager is None:
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(cuda, True, False, cuda))
        return {"no_dist": True, "async_stager": self.stager}


class DcpAsyncProcess(DcpAsyncSharedStager):
    name = "dcp_async_process"
    label = "dcp.async_save (process, shm stager)"
    notes = (
        "async_checkpointer_type=PROCESS (a background process writes; needs a process "
        "group: a world-1 gloo group is initialised for it) with the reused shm stager"
    )

    def kwargs(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kw = super().kwargs()
        kw.pop("no_dist")
        kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        return kw


def init_world_one_group(directory: Path) -> str | None:
    """A single-process gloo group (for the PROCESS executor); the reason if impossible."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available"
    if dist.is_initialized():
        return None
    try:
        store = dist.FileStore(str(directory / "pg-store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    except Exception as exc:  # pragma: no cover - environment dependent
        return f"could not start a gloo group: {exc!r}"
    return None


def destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def quiet_warnings() -> None:
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")


# ---------------------------------------------------------------------------- DLRover


def run_dlrover(
    python_dir: Path, size_mb: float, reps: int, bench_dir: Path, timeout_s: float
) -> dict[str, Any]:
    """Run ``peer_dlrover.py`` under ``torchrun`` from the ``.venv-peers`` environment;
    returns its JSON, or ``{"error": reason}`` when it is not installed or fails."""
    torchrun = python_dir / "bin" / "torchrun"
    if not torchrun.exists():
        return {
            "error": f"{torchrun} not found: run `make bench-peers-env` to create .venv-peers "
            "with torch==2.13.0, dlrover and grpcio"
        }
    probe = subprocess.run(
        [str(python_dir / "bin" / "python"), "-c", "import dlrover, grpc"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return {"error": "dlrover is not importable in .venv-peers: " + probe.stderr[-400:]}
    out = bench_dir / "dlrover-result.json"
    ckdir = bench_dir / "dlrover"
    shm_before = _shm_names()
    script = Path(__file__).with_name("peer_dlrover.py")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node=1",
        str(script),
        "--size-mb",
        str(size_mb),
        "--reps",
        str(reps),
        "--dir",
        str(ckdir),
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(torch.get_num_threads()))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "command": " ".join(cmd)}
    finally:
        _remove_new_shm(shm_before)
        shutil.rmtree(ckdir, ignore_errors=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(
            line for line in (proc.stdout + proc.stderr).splitlines() if "INFO" not in line
        )[-1500:]
        return {"error": f"exit code {proc.returncode}", "output_tail": tail}
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = wall
    result["command"] = "torchrun --standalone --nproc_per_node=1 benchmarks/peer_dlrover.py ..."
    return result


def _shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _remove_new_shm(before: set[str]) -> None:
    """DLRover leaves its shared-memory segment behind; remove the ones this run made."""
    for name in _shm_names() - before:
        if "_ckpt_shm_" in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def peers_python_dir(repo: Path) -> Path:
    return repo / ".venv-peers"


__all__ = [
    "DcpAsyncProcess",
    "DcpAsyncSave",
    "DcpAsyncSharedStager",
    "DcpSave",
    "SaveMethod",
    "TorchSave",
    "destroy_group",
    "init_world_one_group",
    "peers_python_dir",
    "quiet_warnings",
    "run_dlrover",
]
