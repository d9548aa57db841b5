"""DDP gradient averaging whose bits do not depend on DDP's bucket layout.

DDP all-reduces gradients bucket by bucket. The first step of a launch uses buckets in
parameter order; after it, DDP rebuilds them once, in the order gradients became ready.
A ring all-reduce sums an element in an order set by its place in its bucket. So a run
resumed at step K reduces step K+1 in another layout than an uninterrupted run. From
three ranks on, the two drift apart by a few ulps.

`reduce_per_parameter` registers a comm hook that all-reduces each parameter's gradient
as its own tensor. Every launch then computes the same bits at every step, resumed or
not. The trade-off: one collective per parameter tensor instead of one per bucket. The
bytes are the same, but many small tensors add latency. And the model's one comm hook
slot is taken. So it is opt-in. ``find_unused_parameters=True`` needs no hook (DDP then
never rebuilds its buckets), at the cost of an autograd-graph traversal every step.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at
# registration against the real types, not strings.
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import UnsupportedStateError

logger = logging.getLogger(__name__)

__all__ = ["per_parameter_allreduce", "reduce_per_parameter"]


def per_parameter_allreduce(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket``'s gradients across ``group``, one all-reduce per
    parameter, so each element's result is independent of the bucket layout.

    Called by DDP's reducer (on the backward thread) once per bucket, buckets in the
    same order on every rank. Divides by the group's size first, as DDP's own reduction
    does, then sums; the returned future holds the bucket's buffer, reduced in place. A
    failed collective fails the future, and DDP raises it at the end of the backward.
    Register it with ``model.register_comm_hook(model.process_group,
    per_parameter_allreduce)``, or through `reduce_per_parameter`.

    Args:
        group: the process group to average over; None for the default group.
        bucket: the bucket DDP hands the hook.

    Returns:
        A future of the bucket's buffer, averaged in place.
    """
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    works = [
        dist.all_reduce(grad, group=group, async_op=True)
        for grad in bucket.gradients()  # views into ``buffer``, in the bucket's order
    ]
    futures: list[torch.futures.Future[Any]] = [
        work.get_future()
        for work in works
        if work is not None  # async_op=True always returns a work
    ]

    def reduced(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
        for future in done.value():
            future.value()  # raises the collective's error, if any
        return buffer

    return torch.futures.collect_all(futures).then(reduced)


def reduce_per_parameter(model: nn.Module) -> nn.Module:
    """Make ``model`` average gradients one parameter at a time, so a resumed run is
    bit-identical to an uninterrupted one (see the module docstring).

    Call it on every launch, right after wrapping and before the first forward, the
    same on every rank, in fresh and resumed runs alike (the numbers differ from plain
    DDP's by rounding, so all launches of one run must use it).

    Args:
        model: a ``DistributedDataParallel``.

    Returns:
        ``model``, with the comm hook registered.

    Raises:
        UnsupportedStateError: ``model`` is not a ``DistributedDataParallel``, or it
            already has a comm hook.
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise UnsupportedStateError(
            "reduce_per_parameter expects a torch.nn.parallel.DistributedDataParallel, "
            f"found {type(model).__name__}; wrap the model first: "
            "model = reduce_per_parameter(DistributedDataParallel(model))"
        )
    try:
        model.register_comm_hook(model.process_group, per_parameter_allreduce)
    except RuntimeError as exc:
        raise UnsupportedStateError(
            "reduce_per_parameter registers a DDP comm hook, but this model has one "
            f"already ({exc}); DDP allows one hook: use either yours or this one, or "
            "call yours per parameter as resumable.ddp.per_parameter_allreduce does"
        ) from exc
    logger.debug("DDP gradients are all-reduced per parameter (layout-independent)")
    return model
