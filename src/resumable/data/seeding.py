"""Per-sample random streams in worker processes (``reseed_per_sample=True``).

A worker's global RNGs (torch, Python, NumPy) advance with every sample it loads, so a
random augmentation depends on which worker loaded a sample and what it loaded before; a
run resumed mid-epoch hands batches to other workers and draws other values. With this
option each worker reseeds its three global RNGs before every sample from a pure function
of the epoch's worker base seed (itself a function of the loader's ``(seed, epoch)``) and the
sample index: a sample's randomness no longer depends on the worker or on what came before,
so a resume at any batch is exact.

Trade-off: it replaces the workers' streams (two runs with and without it differ), costs
three reseeds per sample, and cannot work with persistent workers, which keep the base seed
of the epoch they started in (the loader refuses that combination). In the main process
(``num_workers=0``) nothing is reseeded: there the global RNGs are the training loop's, which
a checkpoint restores.
"""

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from resumable.data.order import derive_seed

__all__ = ["PerSampleSeeding"]

SAMPLE_STREAM = 3


class PerSampleSeeding:
    """A ``worker_init_fn`` (picklable, run in each worker after the user's own) that makes
    the worker's dataset reseed the global RNGs before loading each sample."""

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        if self.user_init is not None:
            self.user_init(worker_id)
        info = get_worker_info()
        assert info is not None, "worker_init_fn runs in a worker"
        dataset = info.dataset
        base = info.seed - info.id  # the same in every worker of a pass
        getitem = type(dataset).__getitem__

        def load(indices: list[Any]) -> list[Any]:
            out = []
            for index in indices:
                seed = derive_seed(base, int(index), SAMPLE_STREAM)
                torch.manual_seed(seed)
                random.seed(seed)
                np.random.seed(seed & 0xFFFFFFFF)
                out.append(getitem(dataset, index))
            return out

        # The fetcher calls ``dataset.__getitems__(batch)`` when there is one.
        dataset.__getitems__ = load  # type: ignore[attr-defined]
