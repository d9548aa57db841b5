"""A tiny Hugging Face Trainer job for the integration tests: a GPT-2 built from a
config and generated token data (nothing downloaded), trained in this process."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from resumable.integrations.transformers import ResumableTrainer

VOCAB = 64
SEQ = 16


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences counting up from a seeded random start (a learnable pattern)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def make_trainer(
    out: Path, *, steps: int, evaluate: bool = False, plain: bool = False, **kwargs: Any
) -> Any:
    """A `ResumableTrainer` over 32 samples in batches of 4 (8 steps an epoch); with
    ``plain``, the Trainer it derives from, with the same arguments."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in TRAINER_OPTIONS}
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        save_strategy=kwargs.pop("save_strategy", "steps"),
        save_steps=kwargs.pop("save_steps", 3),
        eval_strategy="steps" if evaluate else "no",
        eval_steps=kwargs.pop("eval_steps", 3) if evaluate else None,
        load_best_model_at_end=evaluate,
        metric_for_best_model="loss" if evaluate else None,
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=3,
        **kwargs,
    )
    cls = Trainer if plain else ResumableTrainer
    return cls(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(32, seed=1),
        eval_dataset=Tokens(8, seed=2) if evaluate else None,
        **options,
    )


TRAINER_OPTIONS = ("checkpoint_dir", "keep", "memory_every", "preemption", "persist", "on_busy")


def digest(trainer: Trainer) -> str:
    """sha256 over the model's and the optimizer's tensors."""
    h = hashlib.sha256()
    for name, t in sorted(trainer.model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().numpy().tobytes())
    assert trainer.optimizer is not None
    for idx, st in sorted(trainer.optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode() + v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
