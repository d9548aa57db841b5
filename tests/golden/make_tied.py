"""Build the golden checkpoints of format version 5 (tied weights) in ``tests/golden/v5-tied/``.

    .venv/bin/python tests/golden/make_tied.py [--out DIR] [--force]

Version 5 is what a state holding one tensor at several places makes: a module whose
output layer shares its embedding's weight, and a dict holding one tensor twice. Two
checkpoints: ``one/`` (one process, the manifest of versions 1 and 3's layout) and
``ranks/`` (two ranks, each a thread of this process running the real
`write_distributed`: the split manifest of version 4's layout, the tied weight a
replicated tensor named from both places). ``expected.json`` beside them holds every
value. ``tests/test_golden_v5.py`` reads them with the current code and never imports
this script. A committed fixture is never regenerated: it stands for checkpoints that
already exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import resumable

sys.path.insert(0, str(Path(__file__).parent))
from make_split import WORLD, fresh_out, write_ranks

STEP = 5


class Tied(torch.nn.Module):
    """An embedding and an output layer that share one weight, as GPT-2's do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(55)
        self.wte = torch.nn.Embedding(6, 4)
        self.lm_head = torch.nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.wte.weight


def state() -> dict[str, Any]:
    model = Tied()
    twice = torch.arange(5, dtype=torch.float32)
    return {"model": model, "extra": {"a": twice, "b": twice, "c": [twice]}}


def main() -> None:
    out = fresh_out("v5-tied")
    out.mkdir(parents=True)
    one = state()
    with resumable.Checkpointer(out / "one", one, persist="sync", keep=None) as ck:
        ck.save(STEP, metrics={"loss": 0.25})

    write_ranks(
        out / "ranks",
        lambda r: {"model": Tied(), "extra": {"mine": torch.arange(3, dtype=torch.int64) + r}},
        {"loss": 0.5},
        STEP,
    )
    expected = {
        "step": STEP,
        "world_size": WORLD,
        "weight": one["model"].wte.weight.tolist(),
        "twice": one["extra"]["a"].tolist(),
        "mine": [(torch.arange(3) + r).tolist() for r in range(WORLD)],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
