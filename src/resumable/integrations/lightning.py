"""PyTorch Lightning: a ``Trainer`` callback that checkpoints through `resumable`.

One change to a script: `ResumableCheckpoint` in ``Trainer(callbacks=[...])``, in place of
``ModelCheckpoint``, and ``trainer.fit(model, ..., ckpt_path="last")``. ``fit`` then
resumes from the newest *valid* checkpoint (a torn or corrupt one is skipped with a
WARNING), bit-identical mid-epoch. The state is all of Lightning's checkpoint dictionary,
the data position of stateful loaders, and every random stream, which Lightning leaves out.

It hooks in through Lightning's own extension points (lightning 2.6). The callback is an
``OnExceptionCheckpoint`` whose ``ckpt_path`` is a marker that exists only after a
restore. `ResumableCheckpointIO` hands Lightning the restored dictionary for it. The
random streams wait in a `StagedState` slot until ``on_train_start``. The trade-off: the
checkpoint holds Lightning's dictionary as safetensors and JSON, not a ``.ckpt`` pickle,
so what is not plain data is refused at the first save. How each hook works, and why:
docs/integrations.md, "PyTorch Lightning".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from resumable.capture import rng_state, set_rng_state
from resumable.commit import list_committed
from resumable.data import ResumableDataLoader, ResumableSampler
from resumable.errors import CheckpointError
from resumable.integrations.staging import StagedState
from resumable.manager import Checkpointer
from resumable.options import CheckpointOptions
from resumable.policy import Every, Keep
from resumable.preemption import Preemption
from resumable.storage import Storage, open_storage, options_for

__all__ = ["ResumableCheckpoint", "ResumableCheckpointIO"]

log = logging.getLogger(__name__)

HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
"""Lightning's keys for ``save_hyperparameters()`` values: arbitrary Python objects,
stored as JSON text (with ``str`` for what JSON lacks)."""
HPARAMS_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")
"""Lightning's keys holding a class (OmegaConf containers): not stored."""


class ResumableCheckpointIO(CheckpointIO):
    """The strategy's ``CheckpointIO`` while a `ResumableCheckpoint` is attached.

    ``load_checkpoint`` of the callback's marker path hands back what the callback's
    `Checkpointer` restored; every other call and path goes to ``wrapped`` (Lightning's
    own ``TorchCheckpointIO`` by default), so nothing it could do is lost.
    """

    def __init__(self, owner: ResumableCheckpoint, wrapped: CheckpointIO) -> None:
        self.owner = owner
        self.wrapped = wrapped

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if os.fspath(path) == self.owner.marker:
            raise CheckpointError(
                f"{path} is where ResumableCheckpoint resumes from, not a file to write; "
                "save to another path (trainer.save_checkpoint) or let the callback save"
            )
        self.wrapped.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if os.fspath(path) == self.owner.marker:
            return self.owner.restored_checkpoint()
        return self.wrapped.load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        if os.fspath(path) != self.owner.marker:
            self.wrapped.remove_checkpoint(path)

    def teardown(self) -> None:
        self.wrapped.teardown()


class ResumableCheckpoint(OnExceptionCheckpoint):
    """Checkpoints a Lightning ``Trainer`` through `resumable.Checkpointer`; with
    ``trainer.fit(..., ckpt_path="last")`` it resumes from the newest valid checkpoint.

    Args:
        dirpath: the checkpoint root: a directory or ``s3://bucket/prefix``.
        persist_every: cadence of persisted checkpoints, in optimizer steps (Lightning's
            ``global_step``) or time (default ``Every(steps=100)``).
        memory_every: cadence of memory snapshots (e.g. ``Every(steps=1)``), which a
            relaunch after ``kill -9`` restores from.
        monitor, mode, save_top_k: as ``ModelCheckpoint``'s: with ``monitor`` set, a
            checkpoint is also saved at each validation end with ``trainer.callback_metrics``,
            and the ``save_top_k`` best by ``monitor`` are kept besides the ``keep_last``
            newest (``Keep(last=keep_last, best=(monitor, mode, save_top_k))``).
        keep_last: how many of the newest checkpoints retention keeps (default 3).
        keep: a `resumable.Keep` replacing the retention above (``None``: keep all).
        preemption: on SIGTERM/SIGUSR1 (or a cloud notice) an emergency checkpoint at the
            next step boundary, then an exit with `resumable.REQUEUE_EXIT_CODE`.
        persist, on_busy, mirror, mirror_keep, storage_options, replicas: as for `Checkpointer`
            (``on_busy`` defaults to ``"wait"``: every due persist commits).

    The keywords are checked here, by `resumable.CheckpointOptions.from_kwargs` as the
    `Checkpointer`'s are (a bad one raises `resumable.OptionError`), and kept as
    ``options``, which every `Checkpointer` this opens is given.

    Call order (Lightning's, on the training thread): ``ckpt_path`` (while ``fit``
    resolves ``"last"``: opens the `Checkpointer` and restores), ``setup`` (installs
    `ResumableCheckpointIO`), Lightning's restore through it, ``on_train_start`` (random
    streams), ``on_train_batch_end`` / ``on_validation_end`` (saves), ``on_train_end``
    (final save), ``teardown`` (waits for the persists and closes).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        persist_every: Every | None = None,
        memory_every: Every | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        keep_last: int = 3,
        keep: Keep | str | None = "default",
        preemption: Preemption | None = None,
        persist: str = "auto",
        on_busy: str = "wait",
        mirror: str | None = None,
        mirror_keep: Keep | None = None,
        storage_options: Mapping[str, Any] | None = None,
        replicas: int = 1,
    ) -> None:
        root = os.fspath(dirpath)
        super().__init__(dirpath=root, filename="last")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if keep == "default":
            best = (monitor, mode, save_top_k) if monitor is not None and save_top_k > 0 else None
            keep = Keep(last=keep_last, best=best)
        self.options = CheckpointOptions.from_kwargs(
            persist_every=persist_every,
            memory_every=memory_every,
            keep=keep,  # type: ignore[arg-type]  # another str is refused there
            preemption=preemption,
            persist=persist,
            on_busy=on_busy,
            mirror=mirror,
            mirror_keep=mirror_keep,
            storage_options=storage_options,
            replicas=replicas,
            capture_rng=False,  # the "rng" slot holds them, applied in on_train_start
            save_on_close=False,  # on_train_end saves the final state, as Lightning decides
        )
        self.root = root
        self.monitor = monitor
        digest = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:16]
        self._marker = f"memory://resumable-lightning/{digest}-{id(self):x}/last.ckpt"
        self._trainer: Trainer | None = None
        self.checkpointer: Checkpointer | None = None
        self.restored_step = 0
        self._deferred: bool | None = None  # several ranks: did ckpt_path find a checkpoint?
        self._boundary: int | None = None
        self._lightning = StagedState(self._dump, lambda _: None)
        self._rng = StagedState(rng_state, set_rng_state)

    # ------------------------------------------------------------------ resume

    @property
    def ckpt_path(self) -> str:
        """The marker Lightning resolves ``ckpt_path="last"`` to. Reading it opens the
        `Checkpointer` and restores (once per ``fit``); the marker exists only if that
        restored something.

        Several ranks: Lightning reads this before it creates the process group, which
        the `Checkpointer` needs. When ``WORLD_SIZE`` (set by ``torchrun`` and by
        Lightning's own launcher) says several processes and no group exists yet, the
        marker exists if a committed checkpoint does (root or mirror, listed without
        opening anything), and ``setup`` opens and restores, on every rank together."""
        if self.checkpointer is None and _group_pending():
            self._deferred = _any_committed(
                self.root, self.options.root.mirror, self.options.root.storage_options
            )
            fs = fsspec.filesystem("memory")
            if self._deferred:
                fs.pipe(self._marker, b"")
            elif fs.exists(self._marker):
                fs.rm(self._marker)
        else:
            self._open()
        return self._marker

    @property
    def marker(self) -> str:
        """The marker path itself, without opening anything."""
        return self._marker

    def _open(self) -> Checkpointer:
        if self.checkpointer is not None:
            return self.checkpointer
        state = {"lightning": self._lightning, "rng": self._rng}
        ckpt = Checkpointer(self.root, state=state, options=self.options)
        self.checkpointer = ckpt
        self._lightning.discard()
        self._rng.discard()
        deferred, self._deferred = self._deferred, None
        # Deferred with no committed checkpoint, Lightning already chose a fresh start: a
        # memory snapshot alone (a launch killed before its first persist) is not resumed.
        self.restored_step = ckpt.restore(tier="storage" if deferred is False else "auto")
        self._boundary = self.restored_step or None
        fs = fsspec.filesystem("memory")
        if self.restored_step > 0:
            log.info("resuming from step %d of %s", self.restored_step, ckpt.url)
            fs.pipe(self._marker, b"")
        elif fs.exists(self._marker):
            fs.rm(self._marker)
        return ckpt

    def restored_checkpoint(self) -> dict[str, Any]:
        """The Lightning checkpoint dictionary restored by the `Checkpointer` (called by
        `ResumableCheckpointIO` when Lightning loads the marker)."""
        saved = self._lightning.pending
        self._lightning.discard()
        if not saved or "pytorch-lightning_version" not in saved:
            raise CheckpointError(
                f"the checkpoint restored from {self.root} holds no Lightning state; it was "
                "not written by ResumableCheckpoint. Use another dirpath"
            )
        checkpoint = dict(saved)
        for key in HPARAMS_KEYS:
            if isinstance(checkpoint.get(key), str):
                checkpoint[key] = json.loads(checkpoint[key])
        return checkpoint

    # ------------------------------------------------------------------ hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        ckpt = self._open()
        if ckpt.world_size != trainer.world_size:
            raise CheckpointError(
                f"the Checkpointer of {self.root} runs on {ckpt.world_size} process(es) but "
                f"the Trainer on {trainer.world_size}: it was opened before the process group "
                "existed. Launch with torchrun or Lightning's own launcher (they set "
                "WORLD_SIZE), or create the process group before fit()"
            )
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, ResumableCheckpointIO):
            trainer.strategy.checkpoint_io = ResumableCheckpointIO(self, io)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for loader in _resumable_loaders(trainer.train_dataloader):
            sampler = loader.sampler
            if isinstance(sampler, ResumableSampler) and sampler.num_replicas != trainer.world_size:
                raise CheckpointError(
                    f"a ResumableDataLoader shards over {sampler.num_replicas} rank(s) but the "
                    f"Trainer runs {trainer.world_size}: it was created before the process "
                    "group existed. Create it in the LightningModule's or LightningDataModule's "
                    "train_dataloader() (Lightning calls it after), with "
                    "Trainer(use_distributed_sampler=False), or pass num_replicas= and rank="
                )
        self._rng.apply()
        if self.checkpointer is not None:
            # Lightning installed its SIGTERM handler after the Checkpointer's: its flag
            # would end fit (SIGTERMException, exit code 0) at the step boundary before
            # ours, with no emergency checkpoint of that step and no requeue exit code.
            self.checkpointer.reclaim_signals()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        for loader in _resumable_loaders(trainer.train_dataloader):
            _close_finished_epoch(loader)
        step = trainer.global_step
        ckpt = self.checkpointer
        if ckpt is None or step == self._boundary or step == 0:
            return  # mid gradient accumulation, or nothing trained yet
        self._boundary = step
        ckpt.maybe_save(step, metrics=_metrics(trainer))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = _metrics(trainer)
        if self.monitor not in metrics:
            return
        self._save_now(trainer.global_step, metrics)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The final state (loops finished), so a relaunch of a finished run trains no
        further."""
        if trainer.global_step > 0:
            self._save_now(trainer.global_step, _metrics(trainer))

    def _save_now(self, step: int, metrics: dict[str, float]) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            raise CheckpointError("ResumableCheckpoint saves only inside fit()")
        if self.options.memory_tier:
            ckpt.snapshot(step, metrics)  # fresh: a snapshot of this step may predate it
        ckpt.save(step, metrics)
        self._boundary = step

    def on_exception(self, trainer: Trainer, *_: Any, **__: Any) -> None:
        """Training raised (or a preemption exits): persist the newest memory snapshot,
        never masking the error."""
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception as close_exc:
                log.error(
                    "after training raised, persisting the last snapshot failed: %s", close_exc
                )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        self._lightning.discard()
        self._rng.discard()
        fs = fsspec.filesystem("memory")
        if fs.exists(self._marker):
            fs.rm(self._marker)
        if ckpt is not None:
            ckpt.close()

    # ------------------------------------------------------------------ capture

    def _dump(self) -> dict[str, Any]:
        """What ``trainer.save_checkpoint`` would write, as plain data (read at capture)."""
        trainer = self._trainer
        if trainer is None:
            return {}
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in HPARAMS_TYPE_KEYS:
            checkpoint.pop(key, None)
        for key in HPARAMS_KEYS:
            if key in checkpoint:
                checkpoint[key] = json.dumps(dict(checkpoint[key]), default=str, sort_keys=True)
        return checkpoint


def _group_pending() -> bool:
    """Several processes are launched (``WORLD_SIZE`` > 1) but their process group does
    not exist yet (Lightning creates it after resolving ``ckpt_path``)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not initialized and int(os.environ.get("WORLD_SIZE", "1") or "1") > 1


def _any_committed(
    root: str, mirror: str | os.PathLike[str] | Storage | None, storage_options: Any
) -> bool:
    """Whether ``root`` or ``mirror`` holds a committed checkpoint (read-only listing)."""
    for url in (root, mirror):
        if url is not None and list_committed(open_storage(url, options_for(url, storage_options))):
            return True
    return False


def _metrics(trainer: Trainer) -> dict[str, float]:
    """``trainer.callback_metrics`` as floats (what ``Keep(best=...)`` compares)."""
    out: dict[str, float] = {}
    for k, v in trainer.callback_metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = float(v.item())
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def _resumable_loaders(loaders: Any) -> Iterator[ResumableDataLoader]:
    if isinstance(loaders, ResumableDataLoader):
        yield loaders
    elif isinstance(loaders, Mapping):
        for v in loaders.values():
            yield from _resumable_loaders(v)
    elif isinstance(loaders, (list, tuple)):
        for v in loaders:
            yield from _resumable_loaders(v)


def _close_finished_epoch(loader: ResumableDataLoader) -> None:
    """Move a `ResumableDataLoader` whose epoch was handed out whole to the next epoch.

    The loader starts its next epoch when its iterator raises ``StopIteration``; Lightning
    knows the length and never asks past the last batch, so its next ``iter()`` would cover
    the (empty) rest of the finished epoch: an empty Lightning epoch, and every later
    epoch one loader epoch behind (or, resumed, ahead). Closing the epoch here, before the
    checkpoint of this batch is captured, keeps both runs on the loader's epochs.
    """
    if not isinstance(loader.sampler, ResumableSampler):
        return  # a user's sampler: its position counts differently; left as it is
    if loader.batches < len(loader):
        return
    state = loader.state_dict()
    loader.load_state_dict({**state, "epoch": state["epoch"] + 1, "position": 0})
