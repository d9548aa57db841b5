"""The options of a `resumable.Checkpointer`: one small frozen dataclass per part.

`CheckpointOptions` composes them. Each part checks its own fields when it is built,
and `CheckpointOptions` checks the rules that span parts, so an invalid combination
cannot exist. `CheckpointOptions.from_kwargs` maps the flat keywords of `Checkpointer`
(and of the integrations) onto the parts: every caller goes through it.

The persist mode is resolved against ``RESUMABLE_PERSIST`` when the options are built.
``"auto"`` stays ``"auto"`` until the `Checkpointer` sees the storage: a thread for an
in-process store (``memory://``), a process otherwise.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from resumable import settings
from resumable.errors import OptionError
from resumable.group import DEFAULT_TIMEOUT_S
from resumable.incremental import Incremental
from resumable.monitor import AlertCallback
from resumable.policy import Every, Keep
from resumable.preemption import Preemption
from resumable.storage import Storage, options_for

__all__ = [
    "DEFAULT_KEEP",
    "OVERLAP_MIN_BYTES",
    "PERSIST_MODES",
    "CaptureOptions",
    "CheckpointOptions",
    "DistributedOptions",
    "MemoryOptions",
    "MonitorOptions",
    "Overlap",
    "PersistMode",
    "PersistOptions",
    "RetentionOptions",
    "RootOptions",
    "ScheduleOptions",
    "resolve_options",
]

DEFAULT_KEEP = Keep(last=3)
DEFAULT_PERSIST_EVERY = Every(steps=100)
PersistMode = Literal["auto", "process", "thread", "sync"]
PERSIST_MODES: tuple[PersistMode, ...] = ("auto", "process", "thread", "sync")
OnBusy = Literal["skip", "wait"]
Overlap = bool | Literal["auto"]
# With overlap="auto", what the background copy must hold at least: below, a second
# thread costs the step more than the copy (docs/decisions.md, "Overlap by size").
OVERLAP_MIN_BYTES = 4 << 20
Url = str | os.PathLike[str] | Storage


def _refuse(option: str, expected: str, found: Any, fix: str = "") -> OptionError:
    message = f"{option} must be {expected}, got {found!r}"
    return OptionError(f"{message}; {fix}" if fix else message)


@dataclass(frozen=True)
class ScheduleOptions:
    """When `Checkpointer.maybe_save` snapshots and persists, and what a due persist
    does while the previous one still runs (``on_busy``: ``"skip"`` or ``"wait"``)."""

    persist_every: Every = DEFAULT_PERSIST_EVERY
    memory_every: Every | None = None
    on_busy: OnBusy = "skip"

    def __post_init__(self) -> None:
        if not isinstance(self.persist_every, Every):
            raise _refuse("persist_every", "an Every(...)", self.persist_every)
        if self.memory_every is not None and not isinstance(self.memory_every, Every):
            raise _refuse("memory_every", "an Every(...) or None", self.memory_every)
        if self.on_busy not in ("skip", "wait"):
            raise _refuse("on_busy", "'skip' or 'wait'", self.on_busy)


@dataclass(frozen=True)
class RetentionOptions:
    """Which commits survive: ``keep`` in the root, ``mirror_keep`` in the mirror
    (``None`` keeps all)."""

    keep: Keep | None = DEFAULT_KEEP
    mirror_keep: Keep | None = None

    def __post_init__(self) -> None:
        for name in ("keep", "mirror_keep"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Keep):
                raise _refuse(name, "a resumable.Keep or None", value)


@dataclass(frozen=True)
class RootOptions:
    """Where checkpoints go besides the root itself: ``mirror``, a second root every
    commit is uploaded to, and ``storage_options`` for object-storage roots."""

    storage_options: Mapping[str, Any] | None = None
    mirror: Url | None = None

    def __post_init__(self) -> None:
        options = self.storage_options
        if options is not None and not isinstance(options, Mapping):
            raise _refuse("storage_options", "a mapping or None", options)
        object.__setattr__(self, "storage_options", dict(options) if options else None)
        if self.mirror is not None and not isinstance(self.mirror, (str, os.PathLike, Storage)):
            raise _refuse("mirror", "a URL, a path or a Storage", self.mirror)

    def for_url(self, url: Url) -> dict[str, Any] | None:
        """The storage options that apply to one root.

        Args:
            url: a checkpoint root.

        Returns:
            ``storage_options`` if ``url`` is an object-storage root (s3://, gs://,
            az://), else None: they mean nothing to a local or in-memory root.
        """
        return options_for(url, self.storage_options)


@dataclass(frozen=True)
class PersistOptions:
    """How persists run: ``mode`` (``"auto"``, ``"process"``, ``"thread"``, ``"sync"``;
    ``"auto"`` is replaced by ``RESUMABLE_PERSIST`` when that is set), ``incremental``
    (an `Incremental`; True for the defaults, False or None to write every checkpoint
    whole), and whether `Checkpointer.close` checkpoints the final state."""

    mode: PersistMode = "auto"
    incremental: Incremental | bool | None = True
    save_on_close: bool = True

    def __post_init__(self) -> None:
        if self.mode not in PERSIST_MODES:
            raise _refuse("persist", f"one of {PERSIST_MODES}", self.mode)
        if self.mode == "auto":
            value = settings.PERSIST.read() or "auto"
            if value not in PERSIST_MODES:
                raise _refuse(settings.PERSIST.name, f"one of {PERSIST_MODES}", value)
            object.__setattr__(self, "mode", value)
        incremental = self.incremental
        if incremental is True:
            incremental = Incremental()
        elif incremental is False:
            incremental = None
        elif incremental is not None and not isinstance(incremental, Incremental):
            raise _refuse("incremental", "an Incremental(...), True or False", incremental)
        object.__setattr__(self, "incremental", incremental)
        if not isinstance(self.save_on_close, bool):
            raise _refuse("save_on_close", "True or False", self.save_on_close)

    @property
    def writer(self) -> Incremental | None:
        """The incremental writer's settings, or None (every checkpoint whole)."""
        return cast("Incremental | None", self.incremental)


@dataclass(frozen=True)
class MemoryOptions:
    """The memory tier: the shared-memory directory (``shm_dir``, default ``/dev/shm``),
    whether copies ``overlap`` the next forward/backward (True, False, or ``"auto"``: by
    the size of what would be overlapped), and how many nodes hold each node's newest
    snapshot (``replicas``, its own included)."""

    shm_dir: Path | None = None
    overlap: Overlap = False
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.shm_dir is not None:
            if not isinstance(self.shm_dir, (str, os.PathLike)):
                raise _refuse("shm_dir", "a path or None", self.shm_dir)
            object.__setattr__(self, "shm_dir", Path(self.shm_dir))
        if not isinstance(self.overlap, bool) and self.overlap != "auto":
            raise _refuse("overlap", 'True, False or "auto"', self.overlap)
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise _refuse(
                "replicas",
                "an integer >= 1 (copies of each node's memory snapshot, its own included; "
                "1: none on other nodes)",
                replicas,
            )


@dataclass(frozen=True)
class CaptureOptions:
    """What a capture takes and where a restore puts what it rebuilds: the random
    streams (``capture_rng``) and ``map_location`` (a device, or a callable mapping a
    recorded device string to one)."""

    capture_rng: bool = True
    map_location: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.capture_rng, bool):
            raise _refuse("capture_rng", "True or False", self.capture_rng)


@dataclass(frozen=True)
class MonitorOptions:
    """Who hears of trouble: ``alert(kind, message, details)``, the age of the newest
    commit that raises one (``max_commit_age_s``), and a ``prometheus_registry``."""

    alert: AlertCallback | None = None
    max_commit_age_s: float | None = None
    prometheus_registry: Any = None

    def __post_init__(self) -> None:
        if self.alert is not None and not callable(self.alert):
            raise _refuse("alert", "a callable(kind, message, details) or None", self.alert)
        age = self.max_commit_age_s
        if age is not None and (isinstance(age, bool) or not isinstance(age, (int, float))):
            raise _refuse("max_commit_age_s", "a number of seconds or None", age)
        if age is not None and not age > 0:
            raise _refuse("max_commit_age_s", "a number of seconds > 0 or None", age)


@dataclass(frozen=True)
class DistributedOptions:
    """With several ranks: how long a rank waits for the others during a coordinated
    save or restore (``timeout_s``; None for the default), and whether the ranks of a
    node write one object together (``node_objects``: `resumable.nodes`)."""

    timeout_s: float | None = None
    node_objects: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.node_objects, bool):
            raise _refuse("node_objects", "True or False", self.node_objects)
        value = self.timeout_s
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise _refuse("dist_timeout_s", "a number of seconds > 0 or None", value)

    @property
    def seconds(self) -> float:
        """``timeout_s``, or `resumable.group.DEFAULT_TIMEOUT_S` when unset."""
        return self.timeout_s or DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class CheckpointOptions:
    """Every option of a `resumable.Checkpointer`, one part per concern.

    Build it with `from_kwargs` (the keywords of `Checkpointer`), or from the parts;
    pass it as ``Checkpointer(url, state, options=...)``. Invalid values raise
    `OptionError` (a ``ValueError``) naming the option.
    """

    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    retention: RetentionOptions = field(default_factory=RetentionOptions)
    root: RootOptions = field(default_factory=RootOptions)
    persist: PersistOptions = field(default_factory=PersistOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    monitor: MonitorOptions = field(default_factory=MonitorOptions)
    distributed: DistributedOptions = field(default_factory=DistributedOptions)
    preemption: Preemption | None = None

    def __post_init__(self) -> None:
        if self.preemption is not None and not isinstance(self.preemption, Preemption):
            raise _refuse("preemption", "a resumable.Preemption or None", self.preemption)
        if self.memory_tier:
            return
        if self.memory.replicas > 1:
            raise OptionError(
                f"replicas={self.memory.replicas} copies memory snapshots to other nodes: it "
                "needs the memory tier (memory_every=..., or a persist mode other than 'sync')"
            )
        if self.memory.overlap:
            raise OptionError(
                f"overlap={self.memory.overlap!r} needs the memory tier (not persist='sync' alone)"
            )

    @property
    def memory_tier(self) -> bool:
        """Whether the `Checkpointer` keeps snapshots in shared memory: in every persist
        mode but ``"sync"``, and in ``"sync"`` when ``memory_every`` is given."""
        return self.persist.mode != "sync" or self.schedule.memory_every is not None

    @classmethod
    def from_kwargs(
        cls,
        *,
        memory_every: Every | None = None,
        persist_every: Every | None = None,
        keep: Keep | None = DEFAULT_KEEP,
        map_location: Any = None,
        capture_rng: bool = True,
        persist: str = "auto",
        on_busy: str = "skip",
        shm_dir: str | os.PathLike[str] | None = None,
        overlap: Overlap = False,
        preemption: Preemption | None = None,
        alert: AlertCallback | None = None,
        max_commit_age_s: float | None = None,
        prometheus_registry: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        mirror: Url | None = None,
        mirror_keep: Keep | None = None,
        dist_timeout_s: float | None = None,
        incremental: Incremental | bool = True,
        save_on_close: bool = True,
        replicas: int = 1,
        node_objects: bool = False,
    ) -> CheckpointOptions:
        """The options the keywords of `resumable.Checkpointer` give (the same names and
        defaults; the Checkpointer takes either these keywords or the result).

        Args:
            memory_every: cadence of memory snapshots taken by `Checkpointer.maybe_save`
                (default none).
            persist_every: cadence of persists taken by `Checkpointer.maybe_save` (default
                every 100 steps).
            keep: retention applied after each commit (default the 3 newest); ``None``
                keeps all.
            map_location: device (or callable mapping a recorded device string to one) for
                tensors that are rebuilt rather than copied into existing ones.
            capture_rng: also capture Python, NumPy, torch CPU and CUDA random streams.
            persist: ``"auto"``, ``"process"``, ``"thread"`` or ``"sync"`` (see
                `PersistOptions` and `resumable.manager`).
            on_busy: when a persist is due while the previous one still runs: ``"skip"``
                (default; logged, and the persist is taken as soon as the worker is free)
                or ``"wait"`` (every due persist commits: one queues behind the running
                one, and a save waits while one is queued already).
            shm_dir: the shared-memory directory (default ``/dev/shm``); slots live in
                this user's private ``resumable-<uid>`` directory inside it.
            overlap: copy parameters and optimizer state in the background during the
                next forward/backward; an optimizer step pre-hook waits for the copy
                before the optimizer changes them. Until ``optimizer.step()`` runs, nothing else may
                change parameters or optimizer state in place. ``"auto"``: only where
                they hold at least `OVERLAP_MIN_BYTES` (below, a second thread costs the
                step more than their copy does); else copied at once.
            preemption: signals and cloud notices that trigger an emergency checkpoint
                at the next `Checkpointer.maybe_save`, then ``Checkpointer.should_stop``
                (and by default an exit with `REQUEUE_EXIT_CODE`); see
                `resumable.preemption`.
            alert: ``callback(kind, message, details)`` called (besides a WARNING log)
                when a save fails, when nothing committed for ``max_commit_age_s``, and when
                persists are deferred repeatedly.
            prometheus_registry: a ``prometheus_client`` registry to export counters to.
            storage_options: options for the ``s3://`` root(s): ``endpoint_url``,
                credentials, ``part_size``, ``max_concurrency``, timeouts, ``max_attempts``
                (see `resumable.storage.s3.S3Storage`); unset ones come from the standard
                AWS configuration.
            mirror: a second, usually remote, root (``s3://...``): every checkpoint
                committed in the root is uploaded there in the background, local retention
                keeps what is not mirrored yet, and restore takes the newest valid
                checkpoint of either root (see `resumable.pipeline.mirror`).
            mirror_keep: retention in ``mirror`` (default: keep all).
            dist_timeout_s: with several ranks (``torch.distributed`` initialised), how
                long a rank waits for the others during a coordinated save or restore
                before it gives up with `PersistError` (default 600 s); see
                `resumable.group`.
            incremental: write only what changed since the writer's last checkpoint
                (an `Incremental`; the default writes incrementally when that avoids at
                least a quarter of the bytes, and every checkpoint whole otherwise);
                ``False`` writes every checkpoint whole. See ``docs/incremental.md``.
            save_on_close: whether `Checkpointer.close` checkpoints the final state
                (default True). The integrations pass False: their framework decides
                every save, the last one included (Transformers' ``save_strategy="no"``
                saves nothing).
            replicas: copies of each node's newest memory snapshot, its own included,
                kept in the memory of that many distinct nodes (default 1: none
                elsewhere). With 2, a replaced node's ranks fetch their snapshots from
                a peer and lose no steps; each node then holds one snapshot's worth of
                its peers' (two while a newer one arrives) and keeps one more of its
                own. Needs the memory tier and as many nodes (torchrun ``GROUP_RANK``);
                see ``docs/replicas.md``.
            node_objects: with several ranks, the ranks of each node write their files
                into one object of the checkpoint (format version 6) instead of two
                objects each: an object store then deletes, lists and counts one object
                per node, not two per rank. Each rank stages its files on its node's
                local disk (``RESUMABLE_NODE_STAGING``) for the node's lowest rank to
                upload; checkpoints are written whole (not incrementally). Default
                False. See ``docs/scale.md``.

        Returns:
            The options, each part checked.

        Raises:
            OptionError: a value of the wrong type or range, or a combination that
                cannot work (``replicas`` or ``overlap`` without the memory tier).
        """
        return cls(
            schedule=ScheduleOptions(
                persist_every=persist_every if persist_every is not None else DEFAULT_PERSIST_EVERY,
                memory_every=memory_every,
                on_busy=cast(OnBusy, on_busy),
            ),
            retention=RetentionOptions(keep=keep, mirror_keep=mirror_keep),
            root=RootOptions(storage_options=storage_options, mirror=mirror),
            persist=PersistOptions(
                mode=cast(PersistMode, persist),
                incremental=incremental,
                save_on_close=save_on_close,
            ),
            memory=MemoryOptions(
                shm_dir=cast("Path | None", shm_dir), overlap=overlap, replicas=replicas
            ),
            capture=CaptureOptions(capture_rng=capture_rng, map_location=map_location),
            monitor=MonitorOptions(
                alert=alert,
                max_commit_age_s=max_commit_age_s,
                prometheus_registry=prometheus_registry,
            ),
            distributed=DistributedOptions(timeout_s=dist_timeout_s, node_objects=node_objects),
            preemption=preemption,
        )


def resolve_options(
    options: CheckpointOptions | None, given: Mapping[str, Any]
) -> CheckpointOptions:
    """The options of a constructor that takes both `CheckpointOptions.from_kwargs`'s
    keywords and ``options=``.

    Args:
        options: what the caller passed as ``options=``, or None.
        given: the constructor's local names, its keywords among them.

    Returns:
        ``options``, or the options built from the keywords.

    Raises:
        OptionError: ``options`` is not a `CheckpointOptions`, or it comes with keywords
            of its own (a keyword at its default cannot be told apart and is ignored).
    """
    defaults = _keyword_defaults()
    kwargs = {name: given[name] for name in defaults}
    if options is None:
        return CheckpointOptions.from_kwargs(**kwargs)
    if not isinstance(options, CheckpointOptions):
        raise _refuse("options", "a resumable.CheckpointOptions or None", options)
    both = sorted(name for name, value in kwargs.items() if value is not defaults[name])
    if both:
        raise OptionError(
            f"options= was given together with {', '.join(f'{n}=' for n in both)}: pass every "
            "option through one of them (CheckpointOptions.from_kwargs takes the same keywords)"
        )
    return options


def _keyword_defaults() -> dict[str, Any]:
    """The keywords of `CheckpointOptions.from_kwargs`, with their defaults."""
    parameters = inspect.signature(CheckpointOptions.from_kwargs).parameters
    return {name: p.default for name, p in parameters.items()}
