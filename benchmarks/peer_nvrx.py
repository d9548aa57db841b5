"""NVIDIA Resiliency Extension (NVRx) local checkpoints with peer replication, on CPU/gloo.

A peer for ``replicas=2`` (docs/replicas.md): NVRx's ``LocalCheckpointManager`` with a
``CliqueReplicationStrategy`` of replication factor 2 keeps each rank's checkpoint in its
own local directory *and* in its peer's, and a rank that lost its own file loads it from
the peer over the process group.

Setup (a separate venv; torch first, so that pip takes the CPU build already on disk)::

    python3.11 -m venv /work/nvrx-venv
    /work/nvrx-venv/bin/pip install torch==2.13.0
    /work/nvrx-venv/bin/pip install nvidia-resiliency-ext numpy   # 0.4.1 for cp311

Run (the script starts ``torchrun --standalone --nproc-per-node=2`` on itself)::

    /work/nvrx-venv/bin/python benchmarks/peer_nvrx.py                 # 8 MiB params + Adam
    /work/nvrx-venv/bin/python benchmarks/peer_nvrx.py --param-mib 1 --repeats 1

Each rank holds the MLP of ``benchmarks/replicas_worker.py`` (``--param-mib`` MiB of fp32
parameters, 512 x 512 layers) and its Adam state after one step, so ~3x that many bytes.
Per repeat, after one unmeasured warm-up round:

- ``save``: ``mgr.save(state, iteration)`` (synchronous; ``is_async=True`` needs CUDA,
  see below), between barriers. It replicates (all-gathers every tensor in the clique,
  gloo broadcasts), ``torch.save``s the rank's own and its peer's checkpoint under
  ``--root`` (``/dev/shm`` by default, like our memory tier), barriers and agrees on the
  newest complete iteration. The figure is the slowest rank's time.
- ``load``: rank 1's own file of that iteration is deleted (a replaced node), then on
  every rank a new manager (a restarted process) runs ``find_latest()`` + ``load()``:
  rank 0 reads its own file and rank 1's replica and sends the replica to rank 1.
  ``load`` is the slowest rank; ``load_apply`` adds ``model.load_state_dict`` and
  ``opt.load_state_dict``; the parameters are zeroed before the load and
  checked equal to the saved ones after it.

Medians over ``--repeats``; one JSON line on stdout (every sample is in it).

NVRx 0.4.1 assumes CUDA in four places; this script shims them without changing what is
measured (on CPU there is no device copy to time either way):

1. ``basic_state_dict.py:89`` ``assert state_dict_value.is_cuda`` and
   ``basic_state_dict.py:185`` ``x.to("cuda")`` in ``restore_tensor_device`` (run by
   ``BaseCheckpointManager._load_fn``, ``base_manager.py:141``): ``CpuStateDict`` below
   subclasses ``BasicTensorAwareStateDict`` (``TensorAwareStateDict`` is NVRx's documented
   user extension point) without the assert and with a no-op restore (tensors stay on CPU).
2. ``group_utils.py:394`` ``ten = ten.cuda()`` before ``dist.send`` (the sender of a
   replica on load) and ``group_utils.py:444`` ``torch.empty_like(ten, device='cuda')`` for
   ``dist.recv`` (the receiver): a hop through the GPU for NCCL, which only moves CUDA
   tensors. On a CPU build: ``AssertionError: Torch not compiled with CUDA enabled``. The
   shim replaces ``GroupWrapper.isend_state_dict``/``irecv_state_dict`` with the same code
   minus that hop: the same pickled hollow state dict, then one ``dist.send``/``recv`` per
   tensor, on gloo.

Not shimmed, so not measured: ``save(..., is_async=True)`` (``base_manager.py:309`` calls
``torch.cuda.synchronize()``; and with CPU tensors nothing would be copied before the
background write). ``replication_jump`` defaults to ``torch.cuda.device_count()`` (0 on
CPU); this script passes 1. NVRx loads with ``torch.load(weights_only=False)`` (pickle).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WIDTH = 512  # as benchmarks/replicas_worker.py
SESSION = "bench"

warnings.filterwarnings("ignore", message=".*pynvml.*")
warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
warnings.filterwarnings("ignore", message=".*Multiple backends are registered.*")


def build(param_mib: float) -> torch.nn.Sequential:
    """The MLP of replicas_worker.py: ``param_mib`` MiB of fp32 in 512 x 512 layers."""
    per_layer = (WIDTH * WIDTH + WIDTH) * 4
    mods: list[torch.nn.Module] = []
    for _ in range(max(1, round(param_mib * 2**20 / per_layer))):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _tree(x: Any) -> Any:
    """A copy of the dict/list structure with the same leaves: NVRx replaces tensors in
    place (``pop_tensors``), and ``opt.state_dict()`` holds the optimizer's own dicts."""
    if isinstance(x, dict):
        return {k: _tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_tree(v) for v in x]
    return x


def _install_shims() -> type:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
        BasicTensorAwareStateDict,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication import group_utils

    class CpuStateDict(BasicTensorAwareStateDict):  # type: ignore[misc]
        """BasicTensorAwareStateDict for CPU tensors (no is_cuda assert, no move to cuda)."""

        def __init__(self, state_dict: dict[str, Any]) -> None:
            self.state_dict = state_dict
            self._is_hollow = False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:
            assert not self.is_hollow

    # torch.load must find the class by name in the process that loads it.
    CpuStateDict.__module__ = __name__
    CpuStateDict.__qualname__ = "CpuStateDict"
    globals()["CpuStateDict"] = CpuStateDict

    def isend_state_dict(self: Any, state_dict: Any, dst: int) -> dict[str, float]:
        tensor_data = state_dict.pop_tensors()
        log_data = {"data_sent": sum(t.nbytes for t in tensor_data)}
        self.send_object(state_dict, dst)
        for t in tensor_data:
            dist.send(t, dst, group=self.group)
        state_dict.insert_tensors(tensor_data)
        return log_data

    def irecv_state_dict(self: Any, src: int) -> tuple[Any, dict[str, float]]:
        hollow = self.recv_object(src)
        hollow.init_tensors()
        for t in hollow.tensors:
            dist.recv(t, src, group=self.group)
        return hollow, {"data_recv": sum(t.nbytes for t in hollow.tensors)}

    group_utils.GroupWrapper.isend_state_dict = isend_state_dict
    group_utils.GroupWrapper.irecv_state_dict = irecv_state_dict
    return CpuStateDict


def _leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, list):
        return [t for v in x for t in _leaves(v)]
    return [x] if isinstance(x, torch.Tensor) else []


def worker(args: argparse.Namespace) -> None:
    from importlib.metadata import version

    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    state_cls = _install_shims()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = build(args.param_mib)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(32, WIDTH)).square().mean().backward()
    opt.step()
    state_bytes = sum(t.nbytes for t in _leaves({"m": model.state_dict(), "o": opt.state_dict()}))

    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    root = Path(args.root)
    samples: dict[str, list[float]] = {"save": [], "load": [], "load_apply": []}
    for it in range(1, args.warmup + args.repeats + 1):
        mgr = LocalCheckpointManager(root, session_id=SESSION, repl_strategy=repl)
        expect = [t.clone() for t in _leaves(model.state_dict())]
        dist.barrier()
        t0 = time.perf_counter()
        sd = state_cls(_tree({"model": model.state_dict(), "optim": opt.state_dict()}))
        mgr.save(sd, it)
        t_save = time.perf_counter() - t0
        dist.barrier()
        if rank == 1:
            (root / SESSION / "1" / f"iter_{it:07d}_1_local.pt").unlink()
        with torch.no_grad():  # so that only a real load passes the check below
            for p in model.parameters():
                p.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        fresh = LocalCheckpointManager(root, session_id=SESSION, repl_strategy=repl)
        got = fresh.find_latest()
        loaded, ckpt_id = fresh.load()
        t_load = time.perf_counter() - t0
        model.load_state_dict(loaded.state_dict["model"])
        opt.load_state_dict(loaded.state_dict["optim"])
        t_apply = time.perf_counter() - t0
        if got != it or ckpt_id[:2] != (it, rank):
            raise RuntimeError(f"rank {rank}: loaded {ckpt_id}, latest {got}, expected {it}")
        if not all(map(torch.equal, expect, _leaves(model.state_dict()))):
            raise RuntimeError(f"rank {rank}: loaded parameters differ from the saved ones")
        if it > args.warmup:
            samples["save"].append(t_save)
            samples["load"].append(t_load)
            samples["load_apply"].append(t_apply)

    every = [None] * world
    dist.all_gather_object(every, samples)
    if rank == 0:
        slowest = {k: [max(s[k][i] for s in every) for i in range(args.repeats)] for k in samples}
        out = {
            "bench": "peer_nvrx",
            "nvidia_resiliency_ext": version("nvidia-resiliency-ext"),
            "torch": torch.__version__,
            "backend": "gloo",
            "ranks": world,
            "replication_factor": 2,
            "param_mib": args.param_mib,
            "state_bytes_per_rank": state_bytes,
            "root": str(root),
            "repeats": args.repeats,
            "median_s": {k: statistics.median(v) for k, v in slowest.items()},
            "slowest_rank_s": slowest,
            "per_rank_s": every,
        }
        Path(args.out).write_text(json.dumps(out) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--param-mib", type=float, default=8.0, help="MiB of fp32 parameters/rank")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--root", help="checkpoint root (default: a new directory in /dev/shm)")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        args.out = args.worker_out
        worker(args)
        return 0

    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    own_root = args.root is None
    root = Path(args.root or tempfile.mkdtemp(prefix="nvrx-bench-", dir=base))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", __file__,
            "--param-mib", str(args.param_mib), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--root", str(root), "--worker-out", str(result),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env
            )
        finally:
            if own_root:
                shutil.rmtree(root, ignore_errors=True)
        if proc.returncode != 0 or not result.exists():
            sys.stderr.write((proc.stdout + proc.stderr)[-8000:])
            return proc.returncode or 1
        line = result.read_text()
    sys.stdout.write(line)
    if args.out:
        Path(args.out).write_text(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
