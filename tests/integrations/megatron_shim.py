"""TEST-ONLY: run Megatron-Core on CPU processes (gloo), for this repository's tests.

Megatron-Core is written for GPUs: a few calls reach for CUDA even when every tensor is
on the CPU (``torch.cuda.current_device()`` as an allocation device,
``torch.cuda.synchronize()``), and its tensor-parallel RNG tracker
(``megatron.core.tensor_parallel.random``) keeps CUDA generator states. This module
patches exactly those so that a tiny ``GPTModel`` trains on CPU under ``torchrun`` with
gloo, as the tests need on a machine without a GPU.

It is not part of `resumable` and real training must not use it: on GPUs Megatron runs
unchanged, and `resumable.integrations.megatron` needs nothing from here. `install`
changes process-wide state (``torch.cuda`` functions, Megatron's tracker global) and is
meant for a test job's process only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class CPURNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` interface over torch's CPU generator.

    ``fork(name)`` swaps the process's CPU random state for the named one for the
    duration of the block, as the CUDA tracker does with the device's generator.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self.use_cudagraphable_rng = False

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def install() -> CPURNGStatesTracker:
    """Patch ``torch.cuda`` and Megatron's RNG tracker for CPU; returns the tracker.

    Call once per process, before building the model."""
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    tracker = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def initialize_rng_tracker(*args: Any, **kwargs: Any) -> None:
        mrandom._CUDA_RNG_STATE_TRACKER = tracker

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    return tracker


def manual_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` for CPU: seeds torch's CPU generator (the
    data-parallel stream) and the tracker's model-parallel stream (seed + 2718 + TP
    rank), as Megatron does on GPUs."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state

    torch.manual_seed(seed)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + parallel_state.get_tensor_model_parallel_rank(),
    )
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
