"""Build the golden checkpoint of format version 6 (one object per node) in
``tests/golden/v6-nodes/``.

    .venv/bin/python tests/golden/make_nodes.py [--out DIR] [--force]

Version 6 is what several ranks write with a `resumable.nodes.NodeObjects` each: the
ranks of a node write their data files and parts into one object of the node
(``node-<leader>.bin``), and the top manifest maps every file and part to its
``{object, offset}``. This fixture is four ranks on two simulated nodes of two ranks,
each rank a thread of this process running the real `write_distributed`: a module whose
tensors are replicated (each written by one rank, the others' parts name it in their
``holders``) and a tensor of each rank's own. ``expected.json`` beside it holds every
value. ``tests/test_golden_v6.py`` reads it with the current code and never imports
this script. A committed fixture is never regenerated: it stands for checkpoints that
already exist.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from resumable.capture import capture
from resumable.commit import committer_for
from resumable.nodes import NodeObjects
from resumable.pieces import owned_tensors
from resumable.pipeline.write import WriteRequest, replicated_holders, write_distributed
from resumable.snapshot import Arena
from resumable.storage import open_storage

WORLD = 4
PER_NODE = 2
STEP = 11
METRICS = {"loss": 0.125, "tokens": 4096}


class _Threads:
    """`write_distributed`'s exchanges between ranks that are threads of this process
    (each object through JSON, as through the coordination store)."""

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

    def gather_to(self, obj: Any, name: str, leader: int, members: list[int]) -> list[Any]:
        self._shared[(name, self.rank)] = json.dumps(obj)
        self._meet.wait()
        if self.rank != leader:
            return []
        return [json.loads(self._shared[(name, r)]) for r in members]

    def abandon(self, reason: str) -> None:
        pass


def model() -> torch.nn.Module:
    torch.manual_seed(61)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def mine(rank: int) -> torch.Tensor:
    """Rank ``rank``'s own tensor."""
    return torch.arange(3, dtype=torch.int64) + 10 * rank


def nodes_of(rank: int, staging: Path) -> NodeObjects:
    leader = rank - rank % PER_NODE
    return NodeObjects(leader, PER_NODE, f"group-{leader}", str(staging))


def write_ranks(
    root: Path,
    state_of: Callable[[int], dict[str, Any]],
    metrics: dict[str, Any],
    step: int,
    staging: Path,
) -> None:
    """Commit ``step`` of ``WORLD`` ranks, ``PER_NODE`` to a node, into ``root``, each
    rank a thread of this process running the real `write_distributed` on its state
    ``state_of(rank)``. Raises the first rank's error."""
    storage = open_storage(str(root))
    committer = committer_for(storage)
    shared: dict[Any, Any] = {}
    meet = threading.Barrier(WORLD, timeout=60)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
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
            write_distributed(
                _Threads(r, shared, meet), storage, committer, request, nodes=nodes_of(r, staging)
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


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
    out = fresh_out("v6-nodes")
    models = [model() for _ in range(WORLD)]
    with tempfile.TemporaryDirectory() as staging:
        write_ranks(
            out,
            lambda r: {"model": models[r], "extra": {"mine": mine(r)}},
            METRICS,
            STEP,
            Path(staging),
        )
    step = out / f"step-{STEP:012d}"
    names = sorted(p.name for p in step.iterdir())
    if names != ["manifest.json", "node-00000.bin", "node-00002.bin"]:
        raise SystemExit(f"{step} holds {names}, not a manifest and one object per node")
    expected = {
        "step": STEP,
        "world_size": WORLD,
        "per_node": PER_NODE,
        "metrics": METRICS,
        "model": {k: v.tolist() for k, v in models[0].state_dict().items()},
        "mine": [mine(r).tolist() for r in range(WORLD)],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
