"""Integrations with the trainers people already use.

Each submodule imports its framework at import time, so ``import resumable`` never does:
import the one you use, after installing its extra (in a clone of this repository,
``pip install '.[transformers]'``; the distribution is installed from a clone).

- `resumable.integrations.transformers`: `ResumableTrainer`, a Hugging Face
  ``transformers.Trainer`` that checkpoints through `resumable.Checkpointer`
  (``[transformers]``).
- `resumable.integrations.lightning`: `ResumableCheckpoint`, a PyTorch Lightning callback
  resumed by ``trainer.fit(..., ckpt_path="last")`` (``[lightning]``).
- `resumable.integrations.keras`: `ResumableCallback`, a Keras 3 callback replacing
  ``ModelCheckpoint`` and ``BackupAndRestore`` (``[keras]``; tested with
  ``KERAS_BACKEND=torch``).
- `resumable.integrations.megatron`: `MegatronModel`, `MegatronOptimizer` and
  `save_checkpoint_if_needed`, Megatron-Core models with tensor-parallel resharding
  (``[megatron]``).
- `resumable.integrations.staging`: `StagedState`, restored state held until a
  framework's own load point (shared by the integrations).
"""
