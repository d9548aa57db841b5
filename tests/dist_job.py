"""Worker of `test_distributed`: one phase of checks, run on every rank by ``torchrun``.

``python -m torch.distributed.run --standalone --nproc-per-node=N tests/dist_job.py PHASE OUT``
(``PHASE`` may be several joined by ``+``, run in turn by the same ranks; ``hang`` last)

Each rank writes what it saw to ``OUT/PHASE-rank{r}.json`` (outcome of each check: the
step restored, or the error type and message), and rank 0 writes the full gathered
model and optimizer state of each case to ``OUT/<case>.safetensors`` (plus the param
groups to ``OUT/<case>.json``); the pytest side compares those tensor by tensor. The
phases share the checkpoint roots under ``OUT``:

- ``save2`` (world 2): FSDP2 and DDP checkpoints ``fsdp2``/``ddp2`` with their
  references ``ref-fsdp2``/``ref-ddp2``; ``fail2``: step 1 commits, then rank 1's
  storage refuses the data file of step 2.
- ``world4`` (world 4): FSDP2 checkpoint ``fsdp4`` (``ref-fsdp4``); ``fsdp2`` loaded at
  4 (``got-fsdp2to4``), first without ``reset_per_rank_state``.
- ``load2`` (world 2): same-world restores (``got-fsdp2``, ``got-ddp2``), 4->2 and 1->2
  (``plain1`` is saved by a plain process), and the next start of ``fail2``.
- ``hang`` (world 2): rank 1's data-file write of step 2 sleeps past ``dist_timeout_s``.
- ``agree`` (world 2): background persists agreed without a collective (`phase_agree`).

The helpers (`build`, `train`, `full_state`, `dump`) are imported by the pytest side
for its single-process cases, so the model and data are the same everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resumable import Checkpointer, Every, Keep
from resumable._shm import run_key_for
from resumable.commit import step_dir
from resumable.errors import StorageError
from resumable.storage import LocalStorage
from resumable.storage.base import Buffer, ForwardingStorage, Storage

SEED = 0
HANG_S = 8.0
DIST_TIMEOUT_S = 5.0
# The background hang case: long enough that the next persist, which starts a new worker
# process on rank 1, never meets it on a loaded machine.
BG_TIMEOUT_S = 20.0
# The agree phase's timeout case: rank 0 waits half of it for its worker, then rank 1's
# worker, waiting up to all of it, must hear from rank 0 first.
AGREE_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- shared helpers


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The test model (odd sizes: at world 4 some shards are uneven or empty) wrapped by
    ``kind`` (``fsdp``, ``ddp`` or ``plain``), and its AdamW, with the same initial
    values on every rank."""
    torch.manual_seed(SEED)
    model: nn.Module = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind != "plain":
        raise ValueError(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: Iterable[int]) -> None:
    """Train on batches derived from (seed, step, rank) only."""
    for step in steps:
        g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank())
        x = torch.randn(8, 6, generator=g)
        loss = model(x).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def full_state(
    model: nn.Module, optim: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The full (gathered) model and optimizer state under canonical names, the same for
    FSDP2, DDP and a plain module; collective with several ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    out = {f"model/{k}": v.detach().clone().contiguous() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = v.detach().clone().contiguous()
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
        for g in osd["param_groups"]
    ]
    return out, groups


def dump(out: Path, name: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Write the full state to ``out/name.safetensors`` (+ param groups, ``.json``) on
    rank 0; every rank must call it."""
    from safetensors.torch import save_file

    tensors, groups = full_state(model, optim)
    if rank() == 0:
        save_file(tensors, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps(groups, default=str))


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"value": ...}`` or ``{"error": type name, "message": ...}``, and the seconds."""
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "bases": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "seconds": time.monotonic() - t0,
        }
    return {"value": value, "seconds": time.monotonic() - t0}


def open_ck(
    root: Path | Storage, model: nn.Module, optim: torch.optim.Optimizer, **kw: Any
) -> Checkpointer:
    return Checkpointer(root, {"model": model, "optim": optim}, persist="sync", keep=None, **kw)


def restore_into(
    out: Path, root: str, kind: str, case: str, report: dict[str, Any], *, reset: bool
) -> None:
    """Restore ``out/root`` into a fresh ``kind`` model; on success dump it as ``case``."""
    model, optim = build(kind)
    with open_ck(out / root, model, optim) as ck:
        report[case] = outcome(lambda: ck.restore(reset_per_rank_state=reset))
    if "value" in report[case]:
        dump(out, case, model, optim)


class RefusingStorage(ForwardingStorage):
    """Fails (``StorageError``) or stalls the write of any file under ``step-N``'s
    staging directory; everything else goes through."""

    def __init__(self, inner: Storage, step: int, *, stall_s: float = 0.0) -> None:
        super().__init__(inner)
        self.step = step
        self.stall_s = stall_s

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if step_dir(self.step) in path:
            if not self.stall_s:
                raise StorageError(f"injected: rank {rank()} cannot write {path}")
            time.sleep(self.stall_s)
        return self.inner.write(path, chunks)


def refusing_on_rank1(root: Path, **kw: Any) -> Path | Storage:
    """``root``, seen by rank 1 through a `RefusingStorage` of step 2 (see there)."""
    return RefusingStorage(LocalStorage(root), 2, **kw) if rank() == 1 else root


def listing(root: Path) -> list[str]:
    return sorted(os.listdir(root)) if root.exists() else []


# --------------------------------------------------------------------------- phases


def phase_save2(out: Path, report: dict[str, Any]) -> None:
    for kind in ("fsdp", "ddp"):
        model, optim = build(kind)
        train(model, optim, range(1, 4))
        with open_ck(out / f"{kind}2", model, optim) as ck:
            ck.save(3)
        dump(out, f"ref-{kind}2", model, optim)

    model, optim = build("fsdp")
    train(model, optim, [1])
    ck = open_ck(refusing_on_rank1(out / "fail2"), model, optim)
    ck.save(1)
    train(model, optim, [2])
    report["fail_save2"] = outcome(lambda: ck.save(2))
    report["fail_listing"] = listing(out / "fail2")
    report["fail_steps"] = ck.steps()
    ck.close()

    with counted_ck(out, Counted(rank() + 1.0)) as ck:
        ck.save(3)

    # The per-rank memory tier: every rank keeps step 3 in shared memory ...
    report["mem_steps"] = save_in_memory(out, "mem2").steps()
    # A state of per-rank values only (no module or optimizer: nothing global), in
    # shared memory alone at step 3, as a DeepSpeed engine's is.
    values = {"x": torch.zeros(4)}
    ck = per_rank_ck(out, values)
    ck.restore()
    for step in (1, 2, 3):
        values["x"].fill_(rank() * 10 + step)
        ck.maybe_save(step)
    ck.wait()
    # ... and here rank 1 loses its snapshot (its host rebooted, say).
    save_in_memory(out, "memlost2")
    if rank() == 1:
        for path in (out / "shm").rglob("resumable-*"):
            if f"-r{rank()}-" in path.name and run_key_for(str(out / "memlost2")) in path.name:
                path.unlink()


def memory_ck(out: Path, root: str, model: nn.Module, optim: torch.optim.Optimizer) -> Checkpointer:
    """A checkpointer with the per-rank memory tier: a snapshot every step, a persist
    every second step; snapshots under ``out/shm`` rather than /dev/shm."""
    (out / "shm").mkdir(exist_ok=True)
    return Checkpointer(
        out / root,
        {"model": model, "optim": optim},
        memory_every=Every(steps=1),
        persist_every=Every(steps=2),
        keep=None,
        shm_dir=out / "shm",
    )


class Counted:
    """A stateful object of per-rank tensors (as a DeepSpeed engine's state is) that
    counts its ``state_dict`` calls: on a DeepSpeed ZeRO 3 engine each one gathers."""

    def __init__(self, value: float) -> None:
        self.calls = 0
        self.sd = {"w": torch.full((8,), value), "m": torch.full((3,), -value)}

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def counted_ck(out: Path, obj: Counted) -> Checkpointer:
    return Checkpointer(out / "counted2", {"obj": obj}, persist="sync", keep=None)


def per_rank_ck(out: Path, values: dict[str, torch.Tensor]) -> Checkpointer:
    (out / "shm").mkdir(exist_ok=True)
    return Checkpointer(
        out / "perrank2",
        {"values": values},
        memory_every=Every(steps=1),
        persist_every=Every(steps=2),
        keep=None,
        shm_dir=out / "shm",
    )


def save_in_memory(out: Path, root: str) -> Checkpointer:
    """Steps 1-3: step 2 committed, step 3 only in each rank's shared memory. The
    checkpointer is left open, as by a job killed before it could close."""
    model, optim = build("fsdp")
    ck = memory_ck(out, root, model, optim)
    ck.restore()
    for step in (1, 2, 3):
        train(model, optim, [step])
        ck.maybe_save(step)
    ck.wait()  # step 2's persist runs in the background: let it commit
    dump(out, f"ref-{root}", model, optim)
    return ck


def phase_world4(out: Path, report: dict[str, Any]) -> None:
    from resumable.group import current_group

    group = current_group()
    assert group is not None
    rank = group.rank
    # A save's reports reach rank 0 alone (`Group.gather`, O(N) messages), of any length;
    # the decisions every rank takes see every rank's answer (`Group.all_gather`).
    report["gathered"] = group.gather({"rank": rank, "pad": "x" * (300 * rank)}, "reports")
    report["all_gathered"] = group.all_gather(rank * 10)
    model, optim = build("fsdp")
    train(model, optim, range(1, 4))
    with open_ck(out / "fsdp4", model, optim) as ck:
        ck.save(3)
    dump(out, "ref-fsdp4", model, optim)

    restore_into(out, "fsdp2", "fsdp", "no-reset-fsdp2to4", report, reset=False)
    restore_into(out, "fsdp2", "fsdp", "got-fsdp2to4", report, reset=True)


def phase_load2(out: Path, report: dict[str, Any]) -> None:
    restore_into(out, "fsdp2", "fsdp", "got-fsdp2", report, reset=False)
    restore_into(out, "ddp2", "ddp", "got-ddp2", report, reset=False)
    restore_into(out, "fsdp4", "fsdp", "no-reset-fsdp4to2", report, reset=False)
    restore_into(out, "fsdp4", "fsdp", "got-fsdp4to2", report, reset=True)
    restore_into(out, "plain1", "fsdp", "no-reset-plain1to2", report, reset=False)
    restore_into(out, "plain1", "fsdp", "got-plain1to2", report, reset=True)

    # Every rank has step 3 in shared memory: restored from there, then committed.
    model, optim = build("fsdp")
    with memory_ck(out, "mem2", model, optim) as ck:
        report["mem_restore"] = outcome(ck.restore)
        ck.wait()  # the recovered step is committed in the background
        report["mem_steps_after"] = ck.steps()
    dump(out, "got-mem2", model, optim)
    # A restore from storage of a state without global tensors asks the live objects
    # for nothing: their state dicts are not needed to place what it reads.
    counted = Counted(0.0)
    with counted_ck(out, counted) as ck:
        report["counted_restore"] = outcome(lambda: ck.restore(tier="storage"))
        report["counted_calls"] = counted.calls
        report["counted_sd"] = {k: v.tolist() for k, v in counted.sd.items()}
    values = {"x": torch.zeros(4)}
    with per_rank_ck(out, values) as ck:
        report["perrank_restore"] = outcome(ck.restore)
        report["perrank_x"] = values["x"].tolist()
    # One rank lost its snapshot: every rank falls back to the newest checkpoint, step 2.
    model, optim = build("fsdp")
    with memory_ck(out, "memlost2", model, optim) as ck:
        report["memlost_restore"] = outcome(ck.restore)

    # The restored FSDP2 model trains on at this world size.
    model, optim = build("fsdp")
    with open_ck(out / "fsdp2", model, optim) as ck:
        ck.restore()
    train(model, optim, [4])
    dump(out, "trained-fsdp2", model, optim)

    # The next start after the failed save of step 2.
    model, optim = build("fsdp")
    with open_ck(out / "fail2", model, optim) as ck:
        report["fail_listing_at_start"] = listing(out / "fail2")
        report["fail_restore"] = outcome(ck.restore)
        train(model, optim, [2, 3])
        report["fail_save3"] = outcome(lambda: ck.save(3))
        report["fail_steps_after"] = ck.steps()


def phase_hang(out: Path, report: dict[str, Any]) -> None:
    model, optim = build("fsdp")
    train(model, optim, [1])
    hang = refusing_on_rank1(out / "hang", stall_s=HANG_S)
    ck = open_ck(hang, model, optim, dist_timeout_s=DIST_TIMEOUT_S)
    ck.save(1)
    train(model, optim, [2])
    report["hang_save2"] = outcome(lambda: ck.save(2))
    report["hang_listing"] = listing(out / "hang")


def phase_solo(out: Path, report: dict[str, Any]) -> None:
    """FSDP2 on a one-rank mesh: the single-process path, with DTensors, in the
    synchronous and the background persist modes."""
    for persist in ("sync", "process"):
        model, optim = build("fsdp")
        train(model, optim, range(1, 4))
        root = out / f"solo-{persist}"
        with Checkpointer(root, {"model": model, "optim": optim}, persist=persist) as ck:
            ck.save(3)
        dump(out, f"ref-solo-{persist}", model, optim)
        model, optim = build("fsdp")
        with Checkpointer(root, {"model": model, "optim": optim}, persist=persist) as ck:
            report[f"solo_{persist}"] = outcome(ck.restore)
        dump(out, f"got-solo-{persist}", model, optim)


def worker_pids() -> list[int]:
    """This trainer's persist worker processes (its children running the worker)."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"worker_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                continue
    return pids


def background_run(
    out: Path, root: str, report: dict[str, Any], **kw: Any
) -> tuple[Checkpointer, nn.Module, torch.optim.Optimizer]:
    """An FSDP2 checkpointer persisting in the background, step 1 committed, step 2
    trained; snapshots under ``out/shm``."""
    (out / "shm").mkdir(exist_ok=True)
    model, optim = build("fsdp")
    train(model, optim, [1])
    url = kw.pop("storage", out / root)
    ck = Checkpointer(url, {"model": model, "optim": optim}, keep=None, shm_dir=out / "shm", **kw)
    report[f"{root}_mode"] = ck.persist_mode
    ck.save(1)
    ck.wait()
    train(model, optim, [2])
    return ck, model, optim


def then_step_3(ck: Checkpointer, model: nn.Module, optim: Any, root: str, report: Any) -> None:
    """After a failed persist, the next one commits on every rank."""
    report[f"{root}_steps"] = ck.steps()
    train(model, optim, [3])
    report[f"{root}_save3"] = outcome(lambda: (ck.save(3), ck.wait())[0])
    report[f"{root}_steps_after"] = ck.steps()


def phase_background(out: Path, report: dict[str, Any]) -> None:
    """Several ranks persisting in the background: failures on one rank."""
    # Rank 1's write of step 2 fails (a thread worker, so it writes through this storage).
    storage: Storage = LocalStorage(out / "bgfail")
    if rank() == 1:
        storage = RefusingStorage(storage, 2)
    ck, model, optim = background_run(out, "bgfail", report, storage=storage, persist="thread")
    report["bgfail_save2"] = outcome(lambda: ck.save(2))  # returns after the snapshot
    report["bgfail_wait2"] = outcome(ck.wait)
    report["bgfail_listing"] = listing(out / "bgfail")
    then_step_3(ck, model, optim, "bgfail", report)
    ck.close()

    # Rank 1's file of step 3 has a byte flipped: rank 1 cannot read step 3, and both
    # ranks restore step 1 together, their verdicts told through the coordination store.
    dist.barrier()
    if rank() == 0:
        (data,) = (out / "bgfail" / step_dir(3)).glob("rank-00001*")
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    model, optim = build("fsdp")
    state = {"model": model, "optim": optim}
    with Checkpointer(
        out / "bgfail", state, keep=None, persist="thread", shm_dir=out / "shm"
    ) as ck:
        report["bgrestore_mode"] = ck.persist_mode
        report["bgrestore"] = outcome(ck.restore)

    # Rank 1's worker process is SIGKILLed with step 2 in its queue.
    ck, model, optim = background_run(out, "bgkill", report)
    stopped = worker_pids() if rank() == 1 else []
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    report["bgkill_save2"] = outcome(lambda: ck.save(2))
    for pid in stopped:
        os.kill(pid, signal.SIGKILL)
    report["bgkill_workers"] = len(stopped)
    report["bgkill_wait2"] = outcome(ck.wait)
    report["bgkill_listing"] = listing(out / "bgkill")
    then_step_3(ck, model, optim, "bgkill", report)
    ck.close()

    # Rank 1's worker hangs (stopped) past the timeout: rank 0 gives up and says why.
    ck, model, optim = background_run(out, "bghang", report, dist_timeout_s=BG_TIMEOUT_S)
    stopped = worker_pids() if rank() == 1 else []
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    ck.save(2)
    if rank() == 0:
        report["bghang_wait2"] = outcome(ck.wait)
        report["bghang_listing"] = listing(out / "bghang")
    dist.barrier()
    for pid in stopped:
        os.kill(pid, signal.SIGKILL)
    if rank() == 1:
        report["bghang_wait2"] = outcome(ck.wait)
    then_step_3(ck, model, optim, "bghang", report)
    ck.close()


def phase_mirror(out: Path, report: dict[str, Any]) -> None:
    """Several ranks with a mirror: each checkpoint uploaded once (by rank 0's worker);
    then the local root is lost and every rank restores from the mirror."""
    model, optim = build("fsdp")
    state = {"model": model, "optim": optim}
    kw: dict[str, Any] = {"mirror": str(out / "remote"), "shm_dir": out / "shm"}
    (out / "shm").mkdir(exist_ok=True)
    with Checkpointer(
        out / "local", state, persist_every=Every(steps=2), keep=Keep(last=1), **kw
    ) as ck:
        report["mirror_mode"] = ck.persist_mode
        for step in range(1, 5):
            train(model, optim, [step])
            ck.maybe_save(step)
            ck.wait()  # each due persist commits and is uploaded (none deferred)
        report["mirror_steps"] = ck.steps()
    dump(out, "ref-mirror", model, optim)
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(out / "local")  # the node's disk is lost
    dist.barrier()
    model, optim = build("fsdp")
    with Checkpointer(out / "local", {"model": model, "optim": optim}, **kw) as ck:
        report["mirror_restore"] = outcome(ck.restore)
    dump(out, "got-mirror", model, optim)


def phase_overlap(out: Path, report: dict[str, Any]) -> None:
    """Several ranks in overlap mode: the snapshot of step 5 is still being copied
    while step 6 trains; the copy ends before the optimizer changes the shards."""
    model, optim = build("fsdp")
    (out / "shm").mkdir(exist_ok=True)
    ck = Checkpointer(
        out / "overlap",
        {"model": model, "optim": optim},
        overlap=True,
        memory_every=Every(steps=1),
        persist_every=Every(steps=1000),
        keep=None,
        shm_dir=out / "shm",
    )
    for step in range(1, 6):
        train(model, optim, [step])
        ck.maybe_save(step)
    report["overlapped"] = ck.stats["last_snapshot_overlapped_bytes"]
    report["state_bytes"] = sum(
        t.to_local().numel() * 4
        for t in [
            *model.parameters(),
            *(v for st in optim.state.values() for k, v in st.items() if k != "step"),
        ]
    )
    dump(out, "ref-overlap", model, optim)  # the state of step 5
    train(model, optim, [6])  # optimizer.step() waits for the copy
    ck.save(5)  # persists the snapshot of step 5 (not the state of step 6)
    ck.wait()
    ck.close()
    model, optim = build("fsdp")
    with Checkpointer(out / "overlap", {"model": model, "optim": optim}, shm_dir=out / "shm") as ck:
        report["overlap_restore"] = outcome(lambda: ck.restore(tier="storage"))
    dump(out, "got-overlap", model, optim)


class HeldCommitAudit(ForwardingStorage):
    """Holds the audit entry of the commit of each step in ``steps`` until the file
    ``release<step>`` exists in ``out``: rank 0's (thread) worker records it after the
    commit's outcome is posted, so the other ranks' workers are free while this one is
    still busy with the persist."""

    def __init__(self, inner: Storage, out: Path, steps: Iterable[int]) -> None:
        super().__init__(inner)
        self.out, self.steps = out, set(steps)

    def append(self, path: str, data: bytes) -> None:
        for step in self.steps:
            if b'"event": "commit"' in data and f'"step": {step},'.encode() in data:
                await_mark(self.out, f"release{step}")
        self.inner.append(path, data)


def mark(out: Path, name: str) -> None:
    (out / name).write_text("1")


def await_mark(out: Path, name: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (out / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank()}: {name} never appeared")
        time.sleep(0.01)


COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_object",
    "gather_object",
    "barrier",
)


def without_collectives(fn: Callable[[], Any], seen: list[str]) -> Any:
    """``fn()``, noting in ``seen`` each ``torch.distributed`` collective it calls."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def noting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            seen.append(name)
            return saved[name](*args, **kw)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, noting(name))
    try:
        return fn()
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)


def phase_agree(out: Path, report: dict[str, Any]) -> None:
    """Two ranks persisting in the background agree on each due persist without a
    collective: a rank's save never waits for another rank's save. Rank 0's worker is
    held busy after the commits of steps 2 and 4 (`HeldCommitAudit`)."""
    (out / "shm").mkdir(exist_ok=True)
    model, optim = build("fsdp")

    def held_ck(root: str, held: list[int], timeout_s: float) -> Checkpointer:
        """Persisting on threads into ``out/root``; rank 0's worker held after the
        commits of ``held``."""
        storage: Storage = LocalStorage(out / root)
        if rank() == 0:
            storage = HeldCommitAudit(storage, out, held)
        return Checkpointer(
            storage,
            {"model": model, "optim": optim},
            persist="thread",
            keep=None,
            shm_dir=out / "shm",
            dist_timeout_s=timeout_s,
        )

    ck = held_ck("agree", [2, 4], BG_TIMEOUT_S)
    seen: list[str] = []

    def save(step: int) -> Any:
        return outcome(lambda: without_collectives(lambda: ck.save(step), seen))

    # Rank 1 saves step 1 only once rank 0's save returned.
    train(model, optim, [1])
    if rank() == 1:
        await_mark(out, "saved1")
    report["save1"] = save(1)
    if rank() == 0:
        mark(out, "saved1")
    ck.wait()

    # Rank 1, its worker free, decides step 3 first: rank 0, whose worker still holds
    # step 2's persist, is told to persist too, waits for its worker and does.
    train(model, optim, [2])
    report["save2"] = save(2)
    train(model, optim, [3])
    if rank() == 1:
        ck.wait()
        report["save3"] = save(3)
        mark(out, "saved3")
    else:
        await_mark(out, "saved3")
        stats = ck.stats
        report["pending3"] = stats["persists_started"] - stats["commits"]
        timer = threading.Timer(1.0, mark, (out, "release2"))
        timer.start()
        report["save3"] = save(3)
        timer.join()
    ck.wait()
    report["steps3"] = ck.steps()

    # Rank 0, its worker holding step 4's persist, decides step 5 first: both skip it.
    train(model, optim, [4])
    report["save4"] = save(4)
    train(model, optim, [5])
    if rank() == 0:
        stats = ck.stats
        report["pending5"] = stats["persists_started"] - stats["commits"]
        report["save5"] = save(5)
        mark(out, "saved5")
        mark(out, "release4")
    else:
        ck.wait()
        await_mark(out, "saved5")
        report["save5"] = save(5)
    ck.wait()
    report["steps5"] = ck.steps()
    report["skips"] = ck.stats["skips"]
    report["collectives"] = seen
    ck.close()

    # Rank 1 decides step 13 first; rank 0's worker never finishes step 12 within the
    # timeout: rank 0 forgoes its part of step 13 and raises; rank 1's worker learns it
    # from rank 0's report, not at its own timeout; step 14 commits on both ranks.
    ck = held_ck("agree-timeout", [12], AGREE_TIMEOUT_S)
    ck.save(11)
    ck.wait()
    ck.save(12)
    if rank() == 1:
        ck.wait()
        ck.save(13)
        mark(out, "saved13")
        report["wait13"] = outcome(ck.wait)
    else:
        await_mark(out, "saved13")
        report["save13"] = outcome(lambda: ck.save(13))
        mark(out, "release12")
    train(model, optim, [14])
    report["save14"] = outcome(lambda: (ck.save(14), ck.wait())[0])
    report["steps14"] = ck.steps()
    ck.close()


class Held:
    """A stateful object whose ``state_dict`` on rank 0, once ``hold`` names a mark,
    writes ``copying`` and waits for that mark: rank 0's snapshot stays inside its
    capture, after its own `save` asked whether to persist, until the mark appears."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.hold: str | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.hold is not None and rank() == 0:
            # the question went out on a thread of its own before the capture: a second
            # leaves it room to reach the store however loaded the machine is
            time.sleep(1.0)
            mark(self.out, "copying")
            await_mark(self.out, self.hold)
            self.hold = None
        return {"n": torch.zeros(1)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def phase_agree_early(out: Path, report: dict[str, Any]) -> None:
    """A save asks whether to persist before its snapshot copy, not after it. Rank 0's
    worker is held after step 6's commit (busy); at step 7 rank 0's save stays inside
    its capture until rank 1's save of step 7 returned. Rank 1, its worker free, gets
    rank 0's answer (busy: both skip), because rank 0 asked first, before its copy.
    A save asking after its copy would have let rank 1 decide "persist", and rank 0,
    told to persist with its worker held, would have raised."""
    (out / "shm").mkdir(exist_ok=True)
    model, optim = build("fsdp")
    held = Held(out)
    storage: Storage = LocalStorage(out / "agree-early")
    if rank() == 0:
        storage = HeldCommitAudit(storage, out, [6])
    ck = Checkpointer(
        storage,
        {"model": model, "optim": optim, "held": held},
        persist="thread",
        keep=None,
        shm_dir=out / "shm",
        dist_timeout_s=AGREE_TIMEOUT_S,
    )
    train(model, optim, [6])
    report["save6"] = outcome(lambda: ck.save(6))
    train(model, optim, [7])
    if rank() == 0:
        held.hold = "saved7"
        report["save7"] = outcome(lambda: ck.save(7))
        mark(out, "release6")
    else:
        ck.wait()  # its part of step 6 is done: this rank's worker is free
        await_mark(out, "copying")
        report["save7"] = outcome(lambda: ck.save(7))
        mark(out, "saved7")
    report["wait7"] = outcome(ck.wait)
    train(model, optim, [8])
    report["save8"] = outcome(lambda: (ck.save(8), ck.wait())[0])
    report["steps"] = ck.steps()
    report["skips"] = ck.stats["skips"]
    ck.close()


PHASES = {
    "agree": phase_agree,
    "agree_early": phase_agree_early,
    "overlap": phase_overlap,
    "mirror": phase_mirror,
    "background": phase_background,
    "solo": phase_solo,
    "save2": phase_save2,
    "world4": phase_world4,
    "load2": phase_load2,
    "hang": phase_hang,
}


def main() -> None:
    phases, out = sys.argv[1].split("+"), Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for phase in phases:
        report: dict[str, Any] = {"rank": rank(), "world": dist.get_world_size()}
        try:
            PHASES[phase](out, report)
        except Exception:
            report["crash"] = traceback.format_exc()
        (out / f"{phase}-rank{rank()}.json").write_text(json.dumps(report, indent=1, default=str))
        if phase == "hang":
            # The group is broken by the timeout: leave without its teardown collectives.
            sys.stdout.flush()
            os._exit(0)
    dist.destroy_process_group()
    leave()


def leave() -> None:
    """End the rank without interpreter finalization. FSDP2's DTensor caches keep the
    default gloo group alive past `destroy_process_group`, so its worker threads still
    run at exit; one that drops the last reference to a finished all-gather after
    finalization began aborts the process ("terminate called without an active
    exception", SIGABRT or SIGSEGV; pytorch/pytorch#190489). 2 runs in 15 of the
    overlap phase did so on this 2-core machine. Everything was written and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
