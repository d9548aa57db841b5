"""A short Hugging Face Trainer run, the plain `Trainer` against `ResumableTrainer`: what
checkpointing costs a launch that saves a few times and ends (issue 48's row "short
runs", first seen with ``run_clm.py``).

    python benchmarks/hf_short_run.py --out        # ~4 min on 2 cores
    python benchmarks/hf_short_run.py --quick      # ~1 min

Each launch is a fresh process (imports, the persist worker's start, everything a user's
launch pays): a GPT-2 built from a config (``--layers`` layers, 128 wide, 4 heads,
vocabulary 2,048, sequences of 64; nothing downloaded) trained on generated tokens for
``--steps`` steps (60) in batches of 8 on the CPU, ``save_strategy="steps"`` every
``--save-steps`` (20), the same `TrainingArguments` for both. Timed inside the launch:
``trainer.train()`` from its call to its return (the Trainer's own saves, or
`ResumableTrainer`'s snapshots and persists, and its flush at the end). A third variant,
*resumable-torch-worker*, is `ResumableTrainer` with a persist worker that imports torch
as it starts, as every worker did before it stopped needing torch. Launches take turns,
the order reversed every other round. Reported: the median train time of each, their
ratios to the plain Trainer's, and each launch's figures. With ``--out``, written to
``benchmarks/results/hf-short-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("plain", "resumable", "resumable-torch-worker")
_TORCH_IMPORT = (
    "from resumable.pipeline._worker import",
    "import torch\nfrom resumable.pipeline._worker import",
)


def torch_importing_boot(boot: str | None = None) -> str:
    """``boot`` (by default the persist worker's boot code as the library has it), importing
    torch first; fails if the line it goes before is gone (the variant would silently be
    *resumable* again)."""
    if boot is None:
        from resumable.pipeline import _worker_process

        boot = _worker_process._WORKER_BOOT
    patched = boot.replace(*_TORCH_IMPORT)
    if patched == boot:
        raise RuntimeError(f"{_TORCH_IMPORT[0]!r} not found in the worker's boot code")
    return patched


def one_launch(variant: str, out: Path, *, steps: int, save_steps: int, layers: int) -> dict:
    """Train once in this process; returns the train time and what was saved."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from resumable.integrations.transformers import ResumableTrainer

    vocab, seq = 2048, 64

    class Tokens(Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, vocab, (n, seq), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=128, n_layer=layers, n_head=4,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-4,
        save_strategy="steps",
        save_steps=save_steps,
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    if variant == "resumable-torch-worker":  # the worker as it was: importing torch first
        from resumable.pipeline import _worker_process as wp

        wp._WORKER_BOOT = torch_importing_boot(wp._WORKER_BOOT)
    cls = Trainer if variant == "plain" else ResumableTrainer
    trainer = cls(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(8 * steps))
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    saved = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"train_s": train_s, "bytes_saved": saved, "parameters": params}


def run(
    rounds: int,
    *,
    steps: int,
    save_steps: int,
    layers: int,
    variants: tuple[str, ...] = VARIANTS,
    log: Any = print,
) -> dict:
    """``rounds`` launches of each of ``variants`` (a subset of `VARIANTS` holding
    ``"plain"`` and ``"resumable"``: the smoke test runs those two only)."""
    if not {"plain", "resumable"} <= set(variants) <= set(VARIANTS):
        raise ValueError(f"variants {variants}: want plain, resumable and any of {VARIANTS}")
    work = Path(tempfile.mkdtemp(prefix="hf-short-"))
    launches: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]  # ABC CBA
            for variant in order:
                out = work / f"{variant}-{r}"
                cmd = [
                    sys.executable, __file__, "--one", variant, "--dir", str(out),
                    "--steps", str(steps), "--save-steps", str(save_steps),
                    "--layers", str(layers),
                ]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
                if done.returncode != 0:
                    raise RuntimeError(f"{variant} launch failed:\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                launches[variant].append(got)
                shutil.rmtree(out, ignore_errors=True)
                log(f"  round {r} {variant}: train {got['train_s']:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {v: statistics.median(g["train_s"] for g in launches[v]) for v in variants}
    import torch

    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "torch": torch.__version__,
        "settings": {
            "rounds": rounds,
            "steps": steps,
            "save_steps": save_steps,
            "layers": layers,
            "parameters": launches["plain"][0]["parameters"],
        },
        "median_train_s": medians,
        "ratio": medians["resumable"] / medians["plain"],
        "launches": launches,
    }
    if "resumable-torch-worker" in medians:
        result["ratio_torch_worker"] = medians["resumable-torch-worker"] / medians["plain"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", action="store_true", help="write benchmarks/results/hf-short-*.json")
    args = ap.parse_args(argv)
    if args.one:
        got = one_launch(
            args.one, args.dir, steps=args.steps, save_steps=args.save_steps, layers=args.layers
        )
        print(json.dumps(got))
        return 0
    rounds = args.rounds or (2 if args.quick else 6)
    out = run(rounds, steps=args.steps, save_steps=args.save_steps, layers=args.layers)
    m = out["median_train_s"]
    print(
        f"train time, median of {rounds}: plain Trainer {m['plain']:.2f} s, "
        f"ResumableTrainer {m['resumable']:.2f} s ({out['ratio']:.3f}x); with a worker "
        f"importing torch {m['resumable-torch-worker']:.2f} s ({out['ratio_torch_worker']:.3f}x)"
    )
    if args.out:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = HERE / "results" / f"hf-short-{stamp}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
