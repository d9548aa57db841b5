"""DLRover Flash Checkpoint on the benchmark state; run by `peers.run_dlrover`.

Runs inside ``.venv-peers`` (torch 2.13 CPU + dlrover + grpcio) under
``torchrun --standalone --nproc_per_node=1``, because `DdpCheckpointer` needs a process
group (gloo on CPU). It writes one JSON object to ``--out``:

- ``copy_floor``: ``dst.copy_(src)`` of the same state in this process;
- ``memory_first`` / ``memory``: blocking time of ``save_checkpoint(...,
  StorageType.MEMORY)`` — the first one allocates the shared memory;
- ``persist_blocking`` / ``persist_total``: ``save_checkpoint(..., StorageType.DISK)``
  returns after its memory copy (blocking); the saver process then writes the file, and
  the step appears in ``dlrover_latest.txt`` (total, polled every 2 ms);
- ``restore_memory``: ``load_checkpoint()`` (from shared memory) + copy into the live
  tensors; ``restore_storage_cold``/``_warm``: loading the newest file (torch.load) +
  copy into the live tensors, after dropping the page cache (when permitted) or not.

DLRover's saver writes the data file with ``torch.save`` and does not fsync it (only the
tracker file is fsynced), so its *total* is not a durable commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import state as state_mod
import torch
import torch.distributed as dist

TRACKER = "dlrover_latest.txt"


def _drop_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def _wait_tracker(directory: Path, step: int, timeout_s: float = 600.0) -> None:
    tracker = directory / TRACKER
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if tracker.read_text().strip() == str(step):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.002)
    raise TimeoutError(f"DLRover did not persist step {step} within {timeout_s} s")


def measure(size_mb: float, reps: int, directory: Path) -> dict[str, Any]:
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    tree = state_mod.build_state(size_mb)
    live = state_mod.empty_like_tree(tree)
    out: dict[str, Any] = {"bytes": state_mod.nbytes(tree)}
    try:
        import dlrover

        out["dlrover_version"] = getattr(dlrover, "__version__", None)
    except Exception:
        out["dlrover_version"] = None
    if out["dlrover_version"] is None:
        from importlib.metadata import version

        out["dlrover_version"] = version("dlrover")
    out["torch_version"] = torch.__version__

    dst = state_mod.empty_like_tree(tree)
    copies = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        state_mod.copy_into(dst, tree)
        copies.append(time.perf_counter() - t0)
    out["copy_floor"] = copies[1:]
    del dst

    directory.mkdir(parents=True, exist_ok=True)
    ck = DdpCheckpointer(str(directory))
    step = 0

    mem = []
    for _ in range(reps * 3 + 1):
        step += 1
        t0 = time.perf_counter()
        ck.save_checkpoint(step, tree, storage_type=StorageType.MEMORY)
        mem.append(time.perf_counter() - t0)
    out["memory_first"] = mem[0]
    out["memory"] = mem[1:]

    blocking, total = [], []
    for i in range(reps + 1):
        step += 1
        path = directory / str(step) / "rank_0.pt"
        t0 = time.perf_counter()
        ck.save_checkpoint(step, tree, str(path), storage_type=StorageType.DISK)
        blocking.append(time.perf_counter() - t0)
        _wait_tracker(directory, step)
        total.append(time.perf_counter() - t0)
        if i > 0:
            prev = directory / str(step - 1)
            for f in prev.glob("*"):
                f.unlink()
            prev.rmdir()
    out["persist_first"] = {"blocking": blocking[0], "total": total[0]}
    out["persist_blocking"] = blocking[1:]
    out["persist_total"] = total[1:]

    rmem = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loaded = ck.load_checkpoint()
        state_mod.copy_into(live, loaded)
        rmem.append(time.perf_counter() - t0)
    out["restore_memory"] = rmem

    engine: Any = ck._engine
    for cold in (True, False):
        samples = []
        cache = "warm"
        for _ in range(reps):
            if cold:
                cache = "cold" if _drop_cache() else "warm (drop_caches not permitted)"
            t0 = time.perf_counter()
            loaded = engine._load_from_storage()
            state_mod.copy_into(live, loaded)
            samples.append(time.perf_counter() - t0)
        out["restore_storage_cold" if cold else "restore_storage_warm"] = samples
        out["page_cache_cold" if cold else "page_cache_warm"] = cache
    ok = all(
        torch.equal(a, b) for (_, a), (_, b) in zip(*map(state_mod.iter_tensors, (live, tree)))
    )
    out["restored_equal"] = ok
    out["notes"] = [
        "the saver writes the data file with torch.save and does not fsync it",
        "a memory snapshot is skipped while the saver is persisting",
    ]
    try:
        engine.close()
    except Exception:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    try:
        result = measure(args.size_mb, args.reps, args.dir)
    finally:
        dist.destroy_process_group()
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
