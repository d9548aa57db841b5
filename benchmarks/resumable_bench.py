"""`resumable` on the benchmark state, through its public API only.

The API is probed, not assumed: with the two-tier API (``memory_every`` in
``Checkpointer.__init__``) it measures memory snapshots, ``save()`` (snapshot + persist
in the background) and restores from either tier; with the older synchronous API it
measures ``save()`` (blocking == total) and ``restore()`` only, and says so in the
results. Everything API-dependent lives in `ResumableMethod`.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

from peers import SaveMethod

import resumable


def api_info() -> dict[str, Any]:
    params = inspect.signature(resumable.Checkpointer.__init__).parameters
    return {
        "version": getattr(resumable, "__version__", None),
        "tiers": "memory_every" in params and hasattr(resumable.Checkpointer, "snapshot"),
        "init_params": [p for p in params if p not in ("self", "url", "state")],
    }


class ResumableMethod(SaveMethod):
    name = "resumable"
    label = "resumable"

    def __init__(self, root: Path, tree: Any, *, persist: str | None = None) -> None:
        super().__init__(root, tree)
        api = api_info()
        self.tiers: bool = api["tiers"]
        params = set(api["init_params"])
        kwargs: dict[str, Any] = {
            "persist_every": resumable.Every(steps=50),
            "keep": resumable.Keep(last=2),
        }
        if self.tiers:
            kwargs["memory_every"] = resumable.Every(steps=1)
        if "capture_rng" in params:
            kwargs["capture_rng"] = False  # the peers save tensors only
        if persist is not None and "persist" in params:
            kwargs["persist"] = persist
        self.ck = resumable.Checkpointer(
            str(self.root), state={"model": tree["model"], "optim": tree["optim"]}, **kwargs
        )
        self.mode = str(getattr(self.ck, "persist_mode", "sync"))
        self.step = 0
        self.saved_step = 0
        self.is_async = self.tiers and self.mode != "sync"
        self.label = f"resumable save() [{self.mode}]"
        self.notes = (
            "Checkpointer(state={'model': ..., 'optim': ...}, memory_every=Every(steps=1), "
            "keep=Keep(last=2), capture_rng=False): save() blocking, then wait()"
            if self.tiers
            else "synchronous API (no memory tier yet): save() returns after the commit"
        )

    def info(self) -> dict[str, Any]:
        return {**super().info(), "tiers": self.tiers, "persist_mode": self.mode}

    # -- saving

    def snapshot(self) -> float:
        """One memory snapshot (two-tier API only); returns its blocking seconds."""
        self.step += 1
        t0 = time.perf_counter()
        self.ck.snapshot(self.step)
        return time.perf_counter() - t0

    def save(self, i: int) -> dict[str, float]:
        self.step += 1
        t0 = time.perf_counter()
        started = self.ck.save(self.step)
        blocking = time.perf_counter() - t0
        self.ck.wait()
        total = time.perf_counter() - t0
        if started is False:
            raise RuntimeError(f"save({self.step}) was deferred although nothing was running")
        self.saved_step = self.step
        rec = {"blocking": blocking, "total": total}
        snap_s = getattr(self.ck, "last_snapshot_s", None)
        if self.is_async:
            rec["persist"] = total - blocking
            if isinstance(snap_s, (int, float)):
                rec["snapshot_part"] = snap_s  # the capture and copy inside the blocking
        elif isinstance(snap_s, (int, float)):
            rec["persist"] = total - snap_s
            rec["snapshot_part"] = snap_s
        else:
            rec["persist"] = total
        return rec

    def cleanup(self, i: int) -> None:
        pass  # retention (Keep(last=2)) removes old checkpoints; it is part of the cost

    # -- restoring

    def restore(self) -> dict[str, float]:
        t0 = time.perf_counter()
        got = self.ck.restore(tier="storage") if self.tiers else self.ck.restore()
        dt = time.perf_counter() - t0
        if got != self.saved_step:
            raise RuntimeError(f"restore() returned step {got}, expected {self.saved_step}")
        return {"total": dt}

    def restore_memory(self) -> dict[str, float]:
        t0 = time.perf_counter()
        got = self.ck.restore(tier="memory")
        dt = time.perf_counter() - t0
        if got != self.step:
            raise RuntimeError(f"restore(tier='memory') returned step {got}, expected {self.step}")
        return {"total": dt}

    def close(self) -> None:
        self.ck.close()
