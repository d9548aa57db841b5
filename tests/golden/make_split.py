"""Build the golden split checkpoint (format version 4) in ``tests/golden/v4-ranks/``.

    .venv/bin/python tests/golden/make_split.py [--out DIR] [--force]

Version 4 is what several ranks write, so this fixture is two ranks' checkpoint, each
rank a thread of this process running the real `write_distributed`: a module whose
tensors are replicated (each written by one rank, the other's part names it in its
``holders``) and a tensor of each rank's own. ``expected.json`` beside it holds every
value. ``tests/test_split_manifest.py`` reads it with the current code and never imports
this script. A committed fixture is never regenerated: it stands for checkpoints that
already exist.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from resumable.capture import capture
from resumable.commit import committer_for
from resumable.pieces import owned_tensors
from resumable.pipeline.write import WriteRequest, replicated_holders, write_distributed
from resumable.snapshot import Arena
from resumable.storage import open_storage

WORLD = 2
STEP = 7


class _Threads:
    def __init__(self, rank: int, shared: dict[Any, Any], meet: threading.Barrier) -> None:
        self.rank, self.world_size = rank, WORLD
        self._shared, self._meet = shared, meet

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any, name: str) -> Any:
        if self.coordinator:
            self._shared[name] = json.dumps(obj)
        self._meet.wait()
        return json.loads(self._shared[name])

    def gather(self, obj: Any, name: str) -> list[Any]:
        self._shared[(name, self.rank)] = json.dumps(obj)
        self._meet.wait()
        if not self.coordinator:
            return []
        return [json.loads(self._shared[(name, r)]) for r in range(WORLD)]

    def abandon(self, reason: str) -> None:
        pass


def model() -> torch.nn.Module:
    torch.manual_seed(47)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def write_ranks(
    root: Path, state_of: Callable[[int], dict[str, Any]], metrics: dict[str, Any], step: int
) -> None:
    """Commit ``step`` of ``WORLD`` ranks into ``root``, each rank a thread of this process
    running the real `write_distributed` on its state ``state_of(rank)``."""
    storage = open_storage(str(root))
    committer = committer_for(storage)
    shared: dict[Any, Any] = {}
    meet = threading.Barrier(WORLD, timeout=60)

    def rank(r: int) -> None:
        cap = capture(state_of(r), include_rng=False, rank=r, world_size=WORLD)
        sizes = {n: t.numel() * t.element_size() for n, t in cap.tensors.items()}
        request = WriteRequest(
            step,
            Arena().snapshot(owned_tensors(cap.tensors, cap.replicated, r, WORLD)),
            cap.tree,
            metrics,
            cap.pieces,
            replicated_holders(sizes, cap.replicated, r, WORLD),
        )
        write_distributed(_Threads(r, shared, meet), storage, committer, request)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def fresh_out(name: str) -> Path:
    """The fixture's directory (``--out``; ``name`` beside this script), which must not
    exist unless ``--force`` (then it is emptied)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / name)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    if args.out.exists():
        if not args.force:
            raise SystemExit(f"{args.out} exists; a committed fixture is never regenerated")
        shutil.rmtree(args.out)
    return Path(args.out)


def main() -> None:
    out = fresh_out("v4-ranks")
    models = [model() for _ in range(WORLD)]
    write_ranks(
        out,
        lambda r: {"model": models[r], "extra": {"mine": torch.arange(3, dtype=torch.int64) + r}},
        {"loss": 0.5},
        STEP,
    )
    expected = {
        "step": STEP,
        "world_size": WORLD,
        "model": {k: v.tolist() for k, v in models[0].state_dict().items()},
        "mine": [(torch.arange(3) + r).tolist() for r in range(WORLD)],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
