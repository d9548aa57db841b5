"""The Lightning job of `lightning_job` under ``strategy="ddp"`` on CPU (gloo), one rank of
``torchrun --nproc-per-node=2``: ``python -m torch.distributed.run --standalone
--nproc-per-node=2 lightning_ddp_job.py ROOT OUT [CRASH_AT]``.

The `ResumableDataLoader` is created in ``train_dataloader()``, which Lightning calls once
the process group exists, so it shards over the ranks itself
(``use_distributed_sampler=False`` keeps Lightning from re-creating it around a
``DistributedSampler``). Each rank writes ``OUT/rank<r>.json``: the samples it read per
step, the restored step and the sha256 of its parameters and optimizer state.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integrations.lightning_job import MLP, Crash, data, digest

import resumable
from resumable.data import ResumableDataLoader
from resumable.integrations.lightning import ResumableCheckpoint

STEPS = 18  # 6 batches per rank and epoch: three epochs


class DDPMLP(MLP):
    def train_dataloader(self) -> Any:
        return ResumableDataLoader(data(), batch_size=4, shuffle=True, seed=0)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # ``PREEMPT_AT``: rank 0 alone is sent SIGTERM after every callback's hook of that
        # step (ours included), where Lightning's own SIGTERM flag used to end fit first
        if self.trainer.global_rank == 0 and self.trainer.global_step == PREEMPT_AT:
            os.kill(os.getpid(), signal.SIGTERM)


PREEMPT_AT = int(os.environ.get("PREEMPT_AT", "0"))


def main(root: str, out: str, crash_at: int | None) -> None:
    torch.manual_seed(0)
    model = DDPMLP()
    preemption = resumable.Preemption(grace_seconds=60) if PREEMPT_AT else None
    every = 1000 if PREEMPT_AT else 1  # preempted: the emergency checkpoint is the only one
    callback = ResumableCheckpoint(
        root, persist="sync", persist_every=resumable.Every(steps=every), preemption=preemption
    )
    callbacks: list[L.Callback] = [callback] + ([Crash(crash_at)] if crash_at else [])
    trainer = L.Trainer(
        max_steps=STEPS,
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        use_distributed_sampler=False,
        callbacks=callbacks,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    error = None
    exit_code = None
    try:
        trainer.fit(model, ckpt_path="last")
    except RuntimeError as exc:
        error = str(exc)
    except SystemExit as exc:  # the preemption's requeue exit
        exit_code = exc.code
    result = {
        "exit_code": exit_code,
        "rank": trainer.global_rank,
        "error": error,
        "restored_step": callback.restored_step,
        "global_step": trainer.global_step,
        "seen": model.seen,
        "digest": digest(trainer, model) if error is None and exit_code is None else None,
    }
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if exit_code is not None:
        sys.exit(exit_code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
