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

Every save of a `ResumableTrainer` launch is timed too (`time_saves`): the wall time of
each `Checkpointer.save` call, however the Trainer reaches it (*blocking*: what the
training loop waits for), and the seconds the library reports for that save's snapshot
(`Checkpointer.last_snapshot_s`, read right after the call). A save that blocks much
longer than its own snapshot waited for something else: for the persist worker, still
starting, to take the previous save's persist (issue 48's complaint: the second save of
every launch). `summarise_saves` keeps every save, per save index (1st, 2nd, 3rd of the
launch) and per launch. What the goal judges (`goals.py`): every save *after the first*
of every launch, the longest time one blocked beyond its own snapshot, ÷ the median
snapshot of those saves: no save blocks for longer than a snapshot on top of its own.
A save that waited for the worker's start blocks for that start (seconds, the stall
the issue measured), many times a snapshot; a save's fixed cost (the checks before
it, the hand-off of the persist, about a millisecond here) is not a stall, but on this
small state it is a large share of the smallest snapshots (a launch's third save
copies into a slot already touched: a few ms), so a ratio of each save to its own
snapshot would judge that fixed cost, not the wait; both ratios are reported beside
it. The first save is reported beside it but not judged: it starts the persist worker
and allocates the shared memory, a cost of the launch that no later save pays (the
train time ratio includes it).

As a phase of ``make bench`` (`run_phase`, ``results["hf_short"]``): the plain Trainer
and ``resumable`` only (the torch-importing worker is a past design, measured by this
script alone), 60 steps, a save every 20, 2 layers, ``--hf-rounds`` rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("plain", "resumable", "resumable-torch-worker")
PHASE_VARIANTS = ("plain", "resumable")
"""What `run_phase` launches (``make bench``)."""
PHASE_SETTINGS = {"steps": 60, "save_steps": 20, "layers": 2}
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


def time_saves(saves: list[dict[str, Any]]) -> Callable[[], None]:
    """Time every `Checkpointer.save` of this process from now on, appending
    ``{"step", "blocking_s", "snapshot_s"}`` to ``saves`` as each returns: the call's wall
    time (`time.perf_counter`) and `Checkpointer.last_snapshot_s` right after it. A save
    made inside another (none is today) is part of the outer one's time, not a save of
    its own. Patches the class, so the `Checkpointer` that `ResumableTrainer` opens in
    ``train()`` is timed; only for the launch's own process (``--one``). Returns the undo."""
    from resumable.manager import Checkpointer

    plain = Checkpointer.save
    depth = 0

    @functools.wraps(plain)
    def save(self: Checkpointer, step: int, metrics: Any = None) -> bool:
        nonlocal depth
        depth += 1
        t0 = time.perf_counter()
        try:
            started = plain(self, step, metrics)
        finally:
            depth -= 1
        blocking = time.perf_counter() - t0
        if depth == 0:
            saves.append({"step": step, "blocking_s": blocking, "snapshot_s": self.last_snapshot_s})
        return started

    Checkpointer.save = save  # type: ignore[method-assign]

    def undo() -> None:
        Checkpointer.save = plain  # type: ignore[method-assign]

    return undo


def one_launch(variant: str, out: Path, *, steps: int, save_steps: int, layers: int) -> dict:
    """Train once in this process; returns the train time, what was saved and, for the
    `ResumableTrainer` variants, every save (`time_saves`)."""
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
    saves: list[dict[str, Any]] = []
    undo = time_saves(saves) if variant != "plain" else None
    try:
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    finally:
        if undo is not None:
            undo()
    saved = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    params = sum(p.numel() for p in trainer.model.parameters())
    # The CPU seconds of this launch's child processes that ended by now: the persist
    # worker, which `ResumableTrainer` stops at the end of ``train()`` (its imports and
    # its persists: time the trainer's threads could not use on the cores they share).
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    got: dict[str, Any] = {
        "train_s": train_s,
        "bytes_saved": saved,
        "parameters": params,
        "worker_cpu_s": children.ru_utime + children.ru_stime,
    }
    if variant != "plain":
        got["saves"] = saves
    return got


def _ratio(save: dict[str, Any]) -> float | None:
    """A save's blocking ÷ its own snapshot (None without a snapshot time)."""
    snap = save.get("snapshot_s")
    return save["blocking_s"] / snap if snap else None


def _excess(save: dict[str, Any]) -> float | None:
    """Seconds a save blocked beyond its own snapshot (None without a snapshot time)."""
    snap = save.get("snapshot_s")
    return None if snap is None else save["blocking_s"] - snap


def _worst(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise_saves(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """The saves of one variant's launches (each launch's ``saves``, in order):

    - ``by_index``: per save index (1 = the launch's first save), over the launches: the
      steps it was taken at, the median blocking and snapshot seconds and the median
      seconds it blocked beyond its snapshot, the median and the worst blocking ÷ snapshot;
    - ``worst_ratio``: the worst over launches of a launch's longest save ÷ its own
      snapshot, every save counted; ``worst_ratio_after_first``: the same, the first
      save of each launch left out (what the goal judges, module docstring), and
      ``worst_ratio_first``: the first saves alone;
    - ``per_launch``: each launch's worst ratio after its first save, and with its first;
    - ``after_first``: the median blocking and snapshot over every save after the first,
      and the median and worst seconds such a save blocked beyond its own snapshot (its
      fixed cost: the checks before it, the hand-off of the persist), and that worst ÷
      the median snapshot (what the goal judges, module docstring).
    """
    by_index: list[dict[str, Any]] = []
    count = max((len(g.get("saves") or []) for g in launches), default=0)
    for i in range(count):
        nth = [g["saves"][i] for g in launches if len(g.get("saves") or []) > i]
        by_index.append(
            {
                "index": i + 1,
                "steps": sorted({s["step"] for s in nth}),
                "launches": len(nth),
                "median_blocking_s": _median([s["blocking_s"] for s in nth]),
                "median_snapshot_s": _median([s["snapshot_s"] for s in nth]),
                "median_excess_s": _median([_excess(s) for s in nth]),
                "median_ratio": _median([_ratio(s) for s in nth]),
                "worst_ratio": _worst([_ratio(s) for s in nth]),
            }
        )
    per_launch = [
        {
            "saves": len(g.get("saves") or []),
            "worst_ratio": _worst([_ratio(s) for s in g.get("saves") or []]),
            "worst_ratio_after_first": _worst([_ratio(s) for s in (g.get("saves") or [])[1:]]),
        }
        for g in launches
    ]
    later = [s for g in launches for s in (g.get("saves") or [])[1:]]
    return {
        "by_index": by_index,
        "worst_ratio": _worst([p["worst_ratio"] for p in per_launch]),
        "worst_ratio_after_first": _worst([p["worst_ratio_after_first"] for p in per_launch]),
        "worst_ratio_first": by_index[0]["worst_ratio"] if by_index else None,
        "per_launch": per_launch,
        "after_first": {
            "saves": len(later),
            "median_blocking_s": _median([s["blocking_s"] for s in later]),
            "median_snapshot_s": _median([s["snapshot_s"] for s in later]),
            "median_excess_s": _median([_excess(s) for s in later]),
            "worst_excess_s": _worst([_excess(s) for s in later]),
            "worst_excess_over_median_snapshot": _div(
                _worst([_excess(s) for s in later]), _median([s["snapshot_s"] for s in later])
            ),
        },
    }


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


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
    # The launches import this checkout's library, whatever is installed.
    path = os.environ.get("PYTHONPATH")
    src = str(HERE.parent / "src")
    env = dict(os.environ, PYTHONPATH=src + (os.pathsep + path if path else ""))
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
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
                if done.returncode != 0:
                    raise RuntimeError(f"{variant} launch failed:\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                launches[variant].append(got)
                shutil.rmtree(out, ignore_errors=True)
                saves = "".join(
                    f"; save at {s['step']}: {s['blocking_s'] * 1000:.1f} ms "
                    f"(snapshot {(s['snapshot_s'] or 0) * 1000:.1f} ms)"
                    for s in got.get("saves") or []
                )
                cpu = f"; persist worker CPU {got['worker_cpu_s']:.3f} s" if saves else ""
                log(f"  round {r} {variant}: train {got['train_s']:.2f} s{cpu}{saves}")
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
        "median_worker_cpu_s": {
            v: _median([g.get("worker_cpu_s") for g in launches[v]]) for v in variants
        },
        "ratio": medians["resumable"] / medians["plain"],
        "launches": launches,
        "saves": {v: summarise_saves(launches[v]) for v in variants if v != "plain"},
    }
    if "resumable-torch-worker" in medians:
        result["ratio_torch_worker"] = medians["resumable-torch-worker"] / medians["plain"]
    return result


def run_phase(rounds: int, log: Any = print) -> dict[str, Any]:
    """The phase of ``make bench`` (`benchmarks/run.py`, ``results["hf_short"]``):
    `PHASE_VARIANTS` at `PHASE_SETTINGS`, ``rounds`` rounds; with the load average
    before and after and the phase's wall time."""
    started = time.perf_counter()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    s = PHASE_SETTINGS
    out = run(
        rounds,
        steps=s["steps"],
        save_steps=s["save_steps"],
        layers=s["layers"],
        variants=PHASE_VARIANTS,
        log=log,
    )
    out["loadavg_start"] = load
    out["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out


def describe_saves(out: dict[str, Any], variant: str = "resumable") -> list[str]:
    """Lines on ``variant``'s saves in ``out`` (a result of `run`), for the terminal."""
    s = (out.get("saves") or {}).get(variant)
    if not s:
        return []

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1000:.1f} ms"

    def x(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}x"

    lines = [
        f"  save {i['index']} (step {'/'.join(map(str, i['steps']))}): blocking "
        f"{ms(i['median_blocking_s'])}, snapshot {ms(i['median_snapshot_s'])}, beyond it "
        f"{ms(i.get('median_excess_s'))} (medians; blocking ÷ snapshot median "
        f"{x(i['median_ratio'])}, worst {x(i['worst_ratio'])})"
        for i in s["by_index"]
    ]
    lines.append(
        f"  longest save ÷ its own snapshot, worst launch: after the first save "
        f"{x(s['worst_ratio_after_first'])}; the first save {x(s['worst_ratio_first'])}"
    )
    return [f"{variant} saves:", *lines]


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
    for variant in VARIANTS[1:]:
        for line in describe_saves(out, variant):
            print(line)
    if args.out:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = HERE / "results" / f"hf-short-{stamp}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
