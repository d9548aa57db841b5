"""Training stall per checkpoint: each integration against its framework's own
checkpointing, on the same model, in one run.

For Lightning (``ModelCheckpoint`` vs `ResumableCheckpoint`) and Keras 3 on the torch
backend (``ModelCheckpoint`` vs `ResumableCallback`), it trains an MLP of about
4 * ``--width``**2 parameters (Adam: three times that in state) for ``--steps`` steps
with a checkpoint every ``--every`` steps, timing every step from one batch end to the
next. For Hugging Face Transformers (the ``Trainer``'s own ``save_steps`` checkpoints vs
`ResumableTrainer`) it trains a GPT-2 built from a ``GPT2Config`` (``--gpt2-embd`` wide,
4 layers, a 512-token vocabulary; nothing downloaded) the same way. The stall per
checkpoint is the time of the steps that checkpointed (mean, and
median: the first one also starts the persist worker) minus the median time of the steps
that did not. Prints one line per configuration.

    KERAS_BACKEND=torch python examples/integrations/measure_stall.py --dir /tmp/stall
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import re
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import keras
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import TrainerCallback

import resumable
from resumable.data import ResumableDataLoader
from resumable.integrations.keras import ResumableCallback
from resumable.integrations.lightning import ResumableCheckpoint


def timed(obj: Any, name: str, out: list[float]) -> None:
    """Record the duration of every call of ``obj.name`` (an instance attribute
    shadowing the method: the frameworks look their hooks up on the instance)."""
    fn = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            out.append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def stall(times: list[float], every: int) -> tuple[float, float, float]:
    """(median step time without a checkpoint, mean and median extra time of a checkpoint
    step); ``times[j]`` runs from the end of step j + 1 to the end of step j + 2."""
    plain = [t for j, t in enumerate(times, 1) if j % every]
    saving = [t for j, t in enumerate(times, 1) if j % every == 0]
    base = statistics.median(plain)
    return base, statistics.mean(saving) - base, statistics.median(saving) - base


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last: float | None = None

    def on_train_batch_end(self, *args: Any) -> None:
        # Runs before the checkpoint callbacks (Lightning orders those last): the interval
        # ending at step i + 1 includes the checkpoint taken at the end of step i.
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


class MLP(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def lightning_run(
    root: Path, width: int, steps: int, every: int, kind: str
) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(steps * 8, width)), batch_size=8)
    timer = StepTimes()
    callbacks: list[L.Callback] = [timer]
    if kind == "ModelCheckpoint":
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(root, every_n_train_steps=every, save_top_k=-1)
        )
    elif kind == "ResumableCheckpoint":
        callbacks.append(ResumableCheckpoint(root, persist_every=resumable.Every(steps=every)))
    hooks: list[float] = []
    for cb in callbacks[1:]:
        timed(cb, "on_train_batch_end", hooks)
    trainer = L.Trainer(
        max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=kind != "none",
        accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(MLP(width), data)
    return timer.times, hooks


class KerasTimes(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.last: float | None = None

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def keras_run(
    root: Path, width: int, steps: int, every: int, kind: str
) -> tuple[list[float], list[float]]:
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(width) for _ in range(4)]
    model = keras.Sequential([keras.Input((width,)), *layers])
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    x = torch.randn(steps * 8, width).numpy()
    timer = KerasTimes()  # first: the time of step i includes the checkpoint of step i - 1
    callbacks: list[keras.callbacks.Callback] = [timer]
    data: dict[str, Any] = {"x": x, "y": x, "batch_size": 8, "shuffle": False}
    if kind == "ModelCheckpoint":
        path = str(root / "ckpt-{epoch}-{batch}.keras")
        callbacks.append(keras.callbacks.ModelCheckpoint(path, save_freq=every))
    elif kind == "ResumableCallback":
        loader = ResumableDataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(x)), 8)
        callbacks.append(ResumableCallback(root, loader=loader, save_freq=every))
        data = {"x": loader}
    hooks: list[float] = []
    for cb in callbacks[1:]:
        timed(cb, "on_train_batch_end", hooks)
    model.fit(**data, epochs=1, callbacks=callbacks, verbose=0)
    return timer.times, hooks


class HFTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last: float | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer saves after on_step_end: the interval ending at step i + 1 includes
        # the checkpoint of step i.
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, vocab: int, seq: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def transformers_run(
    root: Path, embd: int, steps: int, every: int, kind: str
) -> tuple[list[float], list[float]]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from resumable.integrations.transformers import ResumableTrainer

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_positions=64, n_embd=embd, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(root), max_steps=steps, per_device_train_batch_size=8,
        save_strategy="no" if kind == "none" else "steps", save_steps=every,
        save_total_limit=None, logging_strategy="no", report_to="none", seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    timer = HFTimes()
    cls = ResumableTrainer if kind == "ResumableTrainer" else Trainer
    trainer = cls(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(steps * 8, 512, 64),
        callbacks=[timer],
    )
    hooks: list[float] = []
    if kind != "none":  # where the Trainer saves (and ResumableTrainer takes its snapshots)
        timed(trainer, "_maybe_log_save_evaluate", hooks)
    trainer.train()
    return timer.times, hooks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="scratch directory (deleted between runs)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--gpt2-embd", type=int, default=256, help="GPT-2 width (256)")
    p.add_argument("--only", choices=["lightning", "keras", "transformers"], action="append")
    p.add_argument(
        "--docs",
        type=Path,
        metavar="MD",
        help="rewrite the <!-- measure_stall:begin/end --> block of this page with the table",
    )
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    mb = 4 * a.width * a.width * 4 * 3 / 2**20
    print(f"model {4 * a.width * a.width / 1e6:.1f} M parameters, ~{mb:.0f} MiB with Adam state; "
          f"{a.steps} steps, a checkpoint every {a.every}")  # fmt: skip
    runs = [
        ("lightning", lightning_run, "none"),
        ("lightning", lightning_run, "ModelCheckpoint"),
        ("lightning", lightning_run, "ResumableCheckpoint"),
        ("keras", keras_run, "ModelCheckpoint"),
        ("keras", keras_run, "ResumableCallback"),
        ("transformers", transformers_run, "none"),
        ("transformers", transformers_run, "Trainer(save_steps)"),
        ("transformers", transformers_run, "ResumableTrainer"),
    ]
    gpt2 = 4 * 12 * a.gpt2_embd**2 + (512 + 64) * a.gpt2_embd
    print(f"GPT-2: {gpt2 / 1e6:.1f} M parameters, ~{gpt2 * 12 / 2**20:.0f} MiB with AdamW state")
    rows: list[tuple[str, str, float, float, float, float]] = []
    load_before = os.getloadavg()[0]
    for framework, run, kind in runs:
        if a.only and framework not in a.only:
            continue
        size = a.gpt2_embd if framework == "transformers" else a.width
        root = Path(a.dir) / f"{framework}-{kind}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        times, hooks = run(root, size, a.steps, a.every, kind)
        base, mean, median = (
            stall(times, a.every) if kind != "none" else (statistics.median(times), 0.0, 0.0)
        )
        blocked = sum(hooks) / (a.steps // a.every)
        print(f"{framework:10s} {kind:20s} step {base * 1e3:6.1f} ms  blocked per checkpoint "
              f"{blocked * 1e3:6.1f} ms  stall per checkpoint: mean {mean * 1e3:6.1f} ms, "
              f"median {median * 1e3:6.1f} ms", flush=True)  # fmt: skip
        rows.append((framework, kind, base, blocked, mean, median))
        shutil.rmtree(root, ignore_errors=True)
    if a.docs is not None:
        text = a.docs.read_text()
        block = docs_block(a, rows, load_before, os.getloadavg()[0], argv)
        begin, end = "<!-- measure_stall:begin -->", "<!-- measure_stall:end -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"{a.docs} has no {begin} ... {end} block")
        a.docs.write_text(pattern.sub(lambda _: f"{begin}\n{block}\n{end}", text))
        print(f"rewrote the measure_stall block of {a.docs}")


LABELS = {
    ("lightning", "ModelCheckpoint"): "`ModelCheckpoint(every_n_train_steps={every})`",
    ("lightning", "ResumableCheckpoint"): (
        "`ResumableCheckpoint(persist_every=Every(steps={every}))`"
    ),
    ("keras", "ModelCheckpoint"): "`ModelCheckpoint(save_freq={every})` (`.keras` file)",
    ("keras", "ResumableCallback"): "`ResumableCallback(save_freq={every})`",
    ("transformers", "Trainer(save_steps)"): "`Trainer` (`save_steps={every}`, safetensors)",
    ("transformers", "ResumableTrainer"): "`ResumableTrainer` (`save_steps={every}`)",
}
NAMES = {"lightning": "Lightning", "keras": "Keras", "transformers": "Transformers"}


def docs_block(
    a: argparse.Namespace,
    rows: list[tuple[str, str, float, float, float, float]],
    load_before: float,
    load_after: float,
    argv: list[str] | None,
) -> str:
    """The generated part of the page: how it was run, then one row per configuration."""
    import transformers

    args = " ".join(sys.argv[1:] if argv is None else argv)
    mib = 4 * a.width * a.width * 4 * 3 / 2**20
    gpt2 = 4 * 12 * a.gpt2_embd**2 + (512 + 64) * a.gpt2_embd
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Written by `python examples/integrations/measure_stall.py {args}` on {when}: "
        f"{os.cpu_count()} CPUs ({platform.machine()}), load average {load_before:.1f} before "
        f"and {load_after:.1f} after; torch {torch.__version__}, lightning {L.__version__}, "
        f"keras {keras.__version__}, transformers {transformers.__version__}. MLP "
        f"{4 * a.width * a.width / 1e6:.1f} M parameters (~{mib:.0f} MiB with Adam state), "
        f"GPT-2 {gpt2 / 1e6:.1f} M parameters (~{gpt2 * 12 / 2**20:.0f} MiB with AdamW "
        f"state); {a.steps} steps, a checkpoint every {a.every}. One run per row, not a "
        "benchmark with repeats.",
        "",
        "| Framework | Checkpointing | Step (median) | Blocked in the hook, per checkpoint "
        "| Stall per checkpoint, mean | median |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for framework, kind, base, blocked, mean, median in rows:
        label = LABELS.get((framework, kind), kind).format(every=a.every)
        stall_cells = (
            "— | — | —"
            if kind == "none"
            else f"{blocked * 1e3:.1f} ms | {mean * 1e3:.1f} ms | {median * 1e3:.1f} ms"
        )
        lines.append(f"| {NAMES[framework]} | {label} | {base * 1e3:.1f} ms | {stall_cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
