"""Build the golden split checkpoint of format version 7 (gzip'd parts) in
``tests/golden/v7-parts/``.

    .venv/bin/python tests/golden/make_gzip_parts.py [--out DIR] [--force]

Version 7 is what several ranks write from resumable 0.x of 2026-12-05 on: version 4's
split manifest with each part stored as gzip'd JSON. This fixture is two ranks'
checkpoint, each rank a thread of this process running the real `write_distributed`
(`make_split.write_ranks`): a module replicated on both ranks whose output layer is tied
to its embedding (a tree names one stored tensor twice, which version 7 allows as
version 5 does) and a tensor of each rank's own. ``expected.json`` beside it holds every
value. ``tests/test_golden_v7.py`` reads it with the current code and never imports this
script. A committed fixture is never regenerated: it stands for checkpoints that already
exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_split import WORLD, fresh_out, write_ranks
from make_tied import Tied

STEP = 13


def main() -> None:
    out = fresh_out("v7-parts")
    models = [Tied() for _ in range(WORLD)]  # seeded alike: one replicated module
    write_ranks(
        out,
        lambda r: {"model": models[r], "extra": {"mine": torch.arange(3, dtype=torch.int64) + r}},
        {"loss": 0.125},
        STEP,
    )
    expected = {
        "step": STEP,
        "world_size": WORLD,
        "metrics": {"loss": 0.125},
        "weight": models[0].wte.weight.tolist(),
        "mine": [(torch.arange(3) + r).tolist() for r in range(WORLD)],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
