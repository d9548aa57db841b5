"""Integrations with the trainers people already use.

Each submodule imports its framework at import time, so ``import resumable`` never does:
import the one you use, after installing its extra.

- `resumable.integrations.transformers`: `ResumableTrainer`, a Hugging Face
  ``transformers.Trainer`` that checkpoints through `resumable.Checkpointer`
  (``pip install 'resumable-training[transformers]'``).
"""
