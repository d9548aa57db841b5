"""Keras 3: a callback that checkpoints ``fit()`` through `resumable` and resumes it.

One change to a script: `ResumableCallback(dirpath, ...)` in ``model.fit(callbacks=...)``,
in place of ``ModelCheckpoint`` and ``BackupAndRestore``. In ``on_train_begin`` it
restores the newest *valid* checkpoint (a torn or corrupt one is skipped with a WARNING)
and sets the epoch ``fit`` continues from. It saves at epoch ends (or every ``save_freq``
batches) as atomic, background commits, and keeps the best by ``monitor`` as
``ModelCheckpoint(save_best_only=True)`` does.

What is saved: ``model.get_state_tree()``, the epoch, the random streams, and the position
of a `resumable.data.ResumableDataLoader` passed as ``loader=`` (and as ``fit``'s ``x``).
Keras cannot start ``fit`` inside an epoch. The trade-off: with ``x=loader`` a resumed
epoch reads only its remaining batches, so a mid-epoch checkpoint resumes exactly. Keras
then warns once that the input "ran out of data". Without ``loader=`` checkpoints are
taken at epoch ends only. Tested on the torch and TensorFlow backends; how the resume
lands on each, and why: docs/integrations.md, "Keras 3".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from resumable.data import ResumableDataLoader, ResumableSampler
from resumable.errors import CheckpointError
from resumable.manager import Checkpointer
from resumable.options import CheckpointOptions
from resumable.policy import Every, Keep
from resumable.preemption import Preemption

__all__ = ["ResumableCallback"]

log = logging.getLogger(__name__)

FRAMEWORK_DRIVEN = Every(steps=2**62)
"""``persist_every`` of the `Checkpointer`: the callback decides when to persist
(``save_freq``); `Checkpointer.maybe_save` runs only for memory snapshots and preemption."""


class ModelState:
    """``model.get_state_tree()`` as a `resumable.Stateful` (read at capture time).

    On the torch backend the tree holds the variables' torch tensors, saved as they are;
    on another backend (TensorFlow, JAX) it is read as NumPy arrays (a copy), which the
    `Checkpointer` stores as tensors and gives back as arrays, and ``set_state_tree``
    assigns back into the variables.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        if keras.backend.backend() == "torch":
            return dict(self.model.get_state_tree())
        return dict(self.model.get_state_tree(value_format="numpy_array"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self.model.set_state_tree(state_dict)


class TrainedPosition:
    """The position of a `ResumableDataLoader` as the batches Keras *trained on* in the
    current epoch, for backends whose input pipeline reads ahead.

    On the TensorFlow backend ``fit`` reads a torch ``DataLoader`` through
    ``tf.data.Dataset.from_generator``, which pulls batches before they are trained on (a
    varying number), so the loader's own count is ahead of training. This state is the
    loader's, with ``epoch`` and ``position`` taken at the start of the epoch's pass
    (`begin`, from ``on_epoch_begin``) plus ``batch_size`` samples per trained batch
    (`trained`, from ``on_train_batch_end``). It needs the loader's own order on one process
    (a position in samples); other loaders are refused for mid-epoch checkpoints there.

    A pass that starts inside the epoch (a resume) is shorter than the ``len(loader)``
    batches Keras expects, so Keras calls its train step once more on an exhausted input;
    `exhausted` says when the trained batches have reached that point.
    """

    def __init__(self, loader: ResumableDataLoader) -> None:
        if not isinstance(loader.sampler, ResumableSampler) or loader.sampler.num_replicas != 1:
            raise ValueError(
                f"on the {keras.backend.backend()} backend, fit() reads its input ahead of "
                "training, so a mid-epoch position is counted from the trained batches: that "
                "needs a ResumableDataLoader with its own order (no sampler=) on one process. "
                "Use save_freq='epoch' and no memory_every, or the torch backend"
            )
        self.loader = loader
        self.epoch = loader.epoch
        self.start = loader.position
        self.batches = 0

    def begin(self) -> None:
        """The loader's position before this epoch's pass reads anything."""
        self.epoch, self.start, self.batches = self.loader.epoch, self.loader.position, 0

    def trained(self, batches: int) -> None:
        self.batches = batches

    def exhausted(self) -> bool:
        """Whether this pass started inside the epoch and has no batch left to give: Keras,
        which counts ``len(loader)`` batches, runs one more step and finds the input empty."""
        if self.start == 0:
            return False
        size, batch_size = len(self.loader.sampler), self.loader.batch_size or 1  # type: ignore[arg-type]
        left = size - self.start - self.batches * batch_size
        return left <= 0 or (self.loader.drop_last and left < batch_size)

    def state_dict(self) -> dict[str, Any]:
        size = len(self.loader.sampler)  # type: ignore[arg-type]
        position = min(self.start + self.batches * (self.loader.batch_size or 1), size)
        return {**self.loader.state_dict(), "epoch": self.epoch, "position": position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
        self.begin()


class ResumableCallback(keras.callbacks.Callback):
    """Checkpoints ``model.fit`` through `resumable.Checkpointer`; the next ``fit`` with
    the same callback arguments resumes from the newest valid checkpoint.

    Args:
        dirpath: the checkpoint root: a directory or ``s3://bucket/prefix``.
        loader: the `ResumableDataLoader` given to ``fit`` as ``x``: its position is saved,
            which makes mid-epoch checkpoints exact.
        save_freq: ``"epoch"`` (default) or a number of batches (needs ``loader``).
        monitor, mode: with ``monitor`` (a key of the epoch logs, e.g. ``"val_loss"``), the
            best epoch-end checkpoint by it is kept besides the ``keep_last`` newest
            (``mode="auto"``: ``max`` for names with "acc"/"auc", else ``min``).
        keep_last: how many of the newest checkpoints retention keeps (default 2).
        keep: a `resumable.Keep` replacing the retention above (``None``: keep all).
        memory_every: memory snapshots at batch ends (needs ``loader``), e.g.
            ``Every(steps=1)``: a relaunch after ``kill -9`` restores from the newest.
        preemption: on SIGTERM/SIGUSR1 (or a cloud notice) an emergency checkpoint at the
            next batch end (epoch end without ``loader``), then an exit with
            `resumable.REQUEUE_EXIT_CODE`.
        persist, on_busy, mirror, mirror_keep, storage_options: as for `Checkpointer`
            (``on_busy`` defaults to ``"wait"``).

    The keywords are checked here, by `resumable.CheckpointOptions.from_kwargs` as the
    `Checkpointer`'s are (a bad one raises `resumable.OptionError`), and kept as
    ``options``, which every `Checkpointer` this opens is given.

    Steps are the optimizer's ``iterations`` (batches trained, over all epochs).
    Call order (Keras', on the training thread): ``on_train_begin`` (open, restore, set
    the initial epoch), ``on_train_batch_end`` / ``on_epoch_end`` (saves; after a resumed
    epoch's extra step, ``on_test_begin`` or ``on_epoch_end`` puts the variables back),
    ``on_train_end`` (final save, wait, close).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        loader: ResumableDataLoader | None = None,
        save_freq: str | int = "epoch",
        monitor: str | None = None,
        mode: str = "auto",
        keep_last: int = 2,
        keep: Keep | str | None = "default",
        memory_every: Every | None = None,
        preemption: Preemption | None = None,
        persist: str = "auto",
        on_busy: str = "wait",
        mirror: str | None = None,
        mirror_keep: Keep | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}")
        if loader is None and (save_freq != "epoch" or memory_every is not None):
            raise ValueError(
                "checkpoints inside an epoch need the data position: pass the "
                "ResumableDataLoader you give fit() as loader=..., or use save_freq='epoch' "
                "and no memory_every"
            )
        if loader is not None and not isinstance(loader, ResumableDataLoader):
            raise TypeError(
                f"loader must be a resumable.data.ResumableDataLoader, got {type(loader)!r}"
            )
        if mode == "auto":
            mode = (
                "max" if monitor is not None and ("acc" in monitor or "auc" in monitor) else "min"
            )
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if keep == "default":
            keep = Keep(last=keep_last, best=(monitor, mode, 1) if monitor else None)
        self.options = CheckpointOptions.from_kwargs(
            persist_every=FRAMEWORK_DRIVEN,
            keep=keep,  # type: ignore[arg-type]  # another str is refused there
            memory_every=memory_every,
            preemption=preemption,
            persist=persist,
            on_busy=on_busy,
            mirror=mirror,
            mirror_keep=mirror_keep,
            storage_options=storage_options,
            save_on_close=False,  # on_train_end saves the final state
        )
        self.dirpath = os.fspath(dirpath)
        self.loader = loader
        self.save_freq = save_freq
        self.monitor = monitor
        self.checkpointer: Checkpointer | None = None
        self.restored_step = 0
        self.restored_epoch = 0
        self._epoch: dict[str, int] = {"epoch": 0}
        self._since_save = 0
        self._trained: TrainedPosition | None = None  # backends that read ahead (TF)
        self._held: list[tuple[Any, np.ndarray]] | None = None  # see _hold_variables

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    # ------------------------------------------------------------------ hooks

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if self.checkpointer is not None:  # a previous fit() raised before its end
            self._close()
        state: dict[str, Any] = {"model": ModelState(self.model), "fit": self._epoch}
        self._trained = None
        if self.loader is not None:
            reads_ahead = keras.backend.backend() != "torch"
            self._trained = TrainedPosition(self.loader) if reads_ahead else None
            state["data"] = self._trained or self.loader
        ckpt = Checkpointer(self.dirpath, state=state, options=self.options)
        self.checkpointer = ckpt
        self.restored_step = ckpt.restore()
        self.restored_epoch = self._epoch["epoch"]
        self._since_save = 0
        loader = self.loader
        if self.restored_step == 0 and loader is not None and loader.batches > 0:
            # fit() builds the model and its compiled metrics from one batch it reads from
            # x before any callback runs; on a fresh run that batch is read again.
            state = loader.state_dict()
            loader.load_state_dict({**state, "position": 0})
        if self.restored_step > 0:
            log.info(
                "resuming from step %d (epoch %d) of %s",
                self.restored_step,
                self.restored_epoch,
                ckpt.url,
            )
            self.model._initial_epoch = self.restored_epoch  # as BackupAndRestore sets it

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch["epoch"] = epoch
        self._held = None
        if self._trained is not None:
            self._trained.begin()
            self._hold_variables()  # a resume at the very end of an epoch's batches

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        ckpt = self.checkpointer
        if ckpt is None or self.loader is None:
            return
        step = self._step()
        if self._trained is not None:
            self._trained.trained(batch + 1)
            self._hold_variables()
        self._since_save += 1
        if isinstance(self.save_freq, int) and self._since_save >= self.save_freq:
            self._save_now(step, _scalars(logs))
        else:
            ckpt.maybe_save(step, metrics=_scalars(logs))

    def on_test_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        self._release_variables()  # before fit's validation reads the weights

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        self._release_variables()  # fit without validation data
        loader = self.loader
        if loader is not None and loader.batches >= len(loader):
            # Keras stops at the loader's length without asking past it; start the
            # loader's next epoch as its StopIteration would have.
            state = loader.state_dict()
            loader.load_state_dict({**state, "epoch": state["epoch"] + 1, "position": 0})
        if self._trained is not None:
            self._trained.begin()  # the read-ahead pass ended the loader's epoch already
        self._epoch["epoch"] = epoch + 1
        metrics = _scalars(logs)
        if self.save_freq == "epoch" or (self.monitor is not None and self.monitor in metrics):
            self._save_now(self._step(), metrics)
        if self.loader is None:  # without a loader, preemption is answered at epoch ends
            ckpt.maybe_save(self._step(), metrics=metrics)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        """The final state, so a relaunch of a finished ``fit`` trains no further."""
        if self.checkpointer is not None and self._step() > 0:
            self._save_now(self._step(), _scalars(logs))
        self._close()

    def _hold_variables(self) -> None:
        """Copy the model's and optimizer's variables when the resumed epoch's input is spent.

        Keras then calls its train step once more, expecting ``len(loader)`` batches, and on
        TensorFlow that call, although its ``iterator.get_next()`` raises
        ``OutOfRangeError``, still runs the ops of the step that do not read the batch
        (``tf.function`` does not order them after the failed op): the optimizer's
        ``iterations += 1``, weight decay (``variable -= variable * wd * lr``, AdamW's
        default ``weight_decay=0.004``), the dropout `SeedGenerator`'s state ``+= [0, 1]``.
        An uninterrupted run never makes that call. `_release_variables` puts the copy back
        once the call is over (before validation or at the epoch end). Once per resumed
        epoch, on the training thread; costs one host copy of the variables.
        """
        if self._held is None and self._trained is not None and self._trained.exhausted():
            variables = {id(v): v for v in [*self.model.variables, *self.model.optimizer.variables]}
            self._held = [
                (v, np.array(keras.ops.convert_to_numpy(v.value), copy=True))
                for v in variables.values()
            ]

    def _release_variables(self) -> None:
        held, self._held = self._held, None
        for variable, value in held or ():
            variable.assign(value)

    def _save_now(self, step: int, metrics: dict[str, float]) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            raise CheckpointError("ResumableCallback saves only inside fit()")
        if self.options.memory_tier:
            ckpt.snapshot(step, metrics)  # fresh: a snapshot of this step may predate it
        ckpt.save(step, metrics)
        self._since_save = 0

    def _close(self) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.close()


def _scalars(logs: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (logs or {}).items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out
