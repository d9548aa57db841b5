"""This process's place in a job of several ranks, and the collectives checkpointing uses.

`Group` holds the rank, the world size and a side gloo group with a bounded timeout,
used only by checkpointing, so its collectives never interleave with training's. It
offers the three collectives a coordinated commit and a coordinated restore need. A
failed collective raises `PersistError` on every rank.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch

from resumable.errors import PersistError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class Group:
    """This process's place in the job, and the collectives checkpointing uses.

    Each collective is called by every rank, in the same order. With one rank it returns
    at once, without a process group.

    Args:
        rank: this process's rank.
        world_size: the number of ranks.
        pg: the side process group the collectives run on (None with one rank).
    """

    def __init__(self, rank: int, world_size: int, pg: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pg = pg

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any, name: str = "") -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank: ``all_gather_object``,
        2(N - 1) messages per rank, 2N(N - 1) in all. What a decision every rank takes
        from every rank's answer needs (a restore's offers and verdicts, a close's
        offers, the replicas' placement), once per restore or launch; a save's reports
        go to rank 0 alone (`gather`).

        Args:
            obj: this rank's contribution (picklable by ``torch.distributed``).
            name: unused here; `resumable.coordination`'s interface names its exchanges.

        Returns:
            The ``obj`` of every rank, in rank order.

        Raises:
            PersistError: the collective failed (a rank died, hung past the timeout, or
                the group broke).
        """
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except RuntimeError as exc:  # a rank died, hung past the timeout, or the group broke
            raise self._gather_failed(exc) from exc
        return out

    def gather(self, obj: Any, name: str = "") -> list[Any]:
        """Every rank's ``obj``, in rank order, on rank 0 (an empty list elsewhere):
        what a coordinated save's reports need
        (`resumable.pipeline.write.write_distributed`). O(N) messages in all, not an
        all-gather's N²: each rank sends rank 0 its length, rank 0 broadcasts the
        longest, and each rank sends its bytes padded to it (three gloo collectives,
        ``gather``, ``broadcast``, ``gather``).

        Args:
            obj: this rank's contribution: a JSON value (a report).
            name: unused here; `resumable.coordination`'s interface names its exchanges.

        Returns:
            On rank 0 the ``obj`` of every rank, in rank order; elsewhere an empty list.

        Raises:
            PersistError: the collective failed.
        """
        if self.world_size == 1:
            return [obj]
        import json

        import torch.distributed as dist

        data = json.dumps(obj).encode()
        root = self.rank == 0
        try:
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.gather(size, sizes if root else None, dst=0, group=self.pg)
            longest = torch.tensor([max(int(t) for t in sizes) if root else 0])
            dist.broadcast(longest, src=0, group=self.pg)
            mine = torch.zeros(int(longest), dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bufs = [torch.empty_like(mine) for _ in range(self.world_size)] if root else None
            dist.gather(mine, bufs, dst=0, group=self.pg)
        except RuntimeError as exc:
            raise self._gather_failed(exc) from exc
        if not root:
            return []
        assert bufs is not None
        return [json.loads(bytes(b[: int(n)].numpy())) for b, n in zip(bufs, sizes, strict=True)]

    def broadcast(self, obj: Any, name: str = "") -> Any:
        """Rank 0's ``obj`` on every rank.

        Args:
            obj: what rank 0 sends; ignored on the other ranks.
            name: unused here; `resumable.coordination`'s interface names its exchanges.

        Returns:
            Rank 0's ``obj``.

        Raises:
            PersistError: the collective failed.
        """
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.pg)
        except RuntimeError as exc:
            raise PersistError(
                f"rank {self.rank}: checkpoint coordination with rank 0 failed "
                f"({str(exc).splitlines()[0][:300]})"
            ) from exc
        return box[0]

    def gather_to(self, obj: Any, name: str, leader: int, members: list[int]) -> list[Any]:
        """Every one of ``members``' ``obj`` on ``leader`` (an empty list elsewhere).
        Called by every rank: an all-gather over the side group, of which the leader
        keeps its members' (a node's exchange, on the training threads of
        ``persist="sync"``; the persist workers use `resumable.coordination`'s store).

        Args:
            obj: this rank's contribution.
            name: unused here.
            leader: the rank that keeps the members' contributions.
            members: the ranks whose contributions it keeps, in order.

        Returns:
            On ``leader``, the ``obj`` of each of ``members``; elsewhere an empty list.

        Raises:
            PersistError: the collective failed.
        """
        got = self.all_gather(obj, name)
        return [got[r] for r in members] if self.rank == leader else []

    def abandon(self, reason: str) -> None:
        """Nothing to tell: when a collective fails, it fails on every rank.

        Args:
            reason: why this rank gives up; unused here (a store's coordination posts it).
        """

    def close(self) -> None:
        """Destroy the side group while the interpreter is fully alive: gloo's worker
        threads otherwise outlive it and can abort the process at exit (SIGABRT,
        "terminate called without an active exception")."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group(pg)
            except Exception as exc:  # already destroyed with the default group
                log.debug("destroying the checkpoint process group: %s", exc)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a one-integer all-reduce).

        Args:
            flag: this rank's flag.

        Returns:
            True if any rank passed True.

        Raises:
            PersistError: the collective failed.
        """
        if self.world_size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        return bool(t.item())

    def _gather_failed(self, exc: BaseException) -> PersistError:
        return PersistError(
            f"rank {self.rank}: checkpoint coordination with the other ranks failed "
            f"({str(exc).splitlines()[0][:300]}); nothing was committed by this step"
        )

    def _failed(self, exc: BaseException) -> PersistError:
        return PersistError(
            f"rank {self.rank}: checkpoint coordination with the other ranks failed "
            f"({str(exc).splitlines()[0][:300]})"
        )


def current_group(timeout_s: float | None = None) -> Group | None:
    """The job's `Group`, if ``torch.distributed`` is initialised with several ranks.

    Collective: every rank calls it once, at the same point. It creates a side gloo group.

    Args:
        timeout_s: the collectives' timeout in seconds; default 600.

    Returns:
        The `Group`, or None for a single process (which keeps the single-process path).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    # A side group: checkpoint collectives never interleave with training's. Gloo, so
    # small host-side messages need no GPU; created collectively, once, at construction.
    pg = dist.new_group(backend="gloo", timeout=timeout)
    return Group(dist.get_rank(), dist.get_world_size(), pg)
