"""Integrations with the trainers people already use.

Each submodule imports its framework, so ``import resumable`` never does. Install the
extra named after the module first (from a clone: ``pip install '.[transformers]'``).

- `resumable.integrations.transformers`: `ResumableTrainer`, a Hugging Face ``Trainer``.
- `resumable.integrations.lightning`: `ResumableCheckpoint`, a Lightning callback.
- `resumable.integrations.keras`: `ResumableCallback`, a Keras 3 callback.
- `resumable.integrations.deepspeed`: `DeepSpeedState`, a whole ``DeepSpeedEngine``.
- `resumable.integrations.megatron`: `MegatronModel`, `MegatronOptimizer` and
  `save_checkpoint_if_needed`, Megatron-Core with tensor-parallel resharding.
- `resumable.integrations.staging`: `StagedState`, restored state held until a
  framework's own load point (shared by the integrations).

Each submodule's docstring says what it hooks into. Tested versions: docs/integrations.md.
"""
