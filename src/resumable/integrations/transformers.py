"""Hugging Face Transformers: a ``Trainer`` that checkpoints through `resumable`.

One change to a script: ``Trainer(...)`` becomes ``ResumableTrainer(...)``. ``train()``
then restores the newest *valid* checkpoint by itself (a torn or corrupt one is skipped
with a WARNING). Every save the ``TrainingArguments`` ask for becomes an atomic
`Checkpointer.save`, and retention (``save_total_limit``, the best checkpoint) runs only
after a commit. SIGTERM leads to an emergency checkpoint and exit code 75 without being
asked (`default_preemption`). The `Checkpointer`'s other options are keyword arguments.

A callback cannot move the point where the Trainer restarts, so the subclass overrides
the methods through which the Trainer loads and saves a checkpoint (transformers 5.x).
The trade-off: the restore reads everything at once, before the optimizer and scheduler
exist, so their states wait in `StagedState` slots until the Trainer's own load point.
The data position follows from ``global_step``, as in the Trainer. Which method does
what, the import of a plain ``checkpoint-N``, DeepSpeed, and why: docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers import trainer as hf_trainer
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    HubStrategy,
    SaveStrategy,
    compare_trainer_and_checkpoint_args,
)

from resumable.capture import rng_state, set_rng_state
from resumable.commit import step_dir
from resumable.errors import CheckpointError, OptionError
from resumable.integrations.staging import StagedState
from resumable.manager import Checkpointer
from resumable.options import CheckpointOptions
from resumable.policy import Every, Keep
from resumable.preemption import Preemption

__all__ = ["ResumableTrainer", "StagedState", "default_preemption", "keep_for"]

log = logging.getLogger(__name__)

FRAMEWORK_DRIVEN = Every(steps=2**62)
"""``persist_every`` of a Checkpointer whose persists the framework schedules: the
Trainer calls `Checkpointer.save` when its ``save_strategy`` says so, and
`Checkpointer.maybe_save` at every step only for memory snapshots and preemption."""


HUB_STAGING = "_resumable-hub"
"""The folder in ``output_dir`` where a save that ``push_to_hub`` pushes (``hub_strategy``
other than ``"end"``) is written the plain Trainer's way, as ``checkpoint-N``, for the
Trainer's own ``_push_from_checkpoint``. The leading ``_`` keeps it out of the Trainer's
uploads of ``output_dir`` (its ignore patterns are ``_*`` and ``checkpoint-*``), and
``get_last_checkpoint`` never sees it. Emptied once its pushes are done."""


def local_root(root: str) -> str | None:
    """The directory of a local checkpoint root (``file://`` stripped); None for a URL."""
    if root.startswith("file://"):
        return root[len("file://") :]
    return None if "://" in root else root


def below(path: str, folder: str) -> str | None:
    """``path`` relative to ``folder`` when it lies inside it (``"."`` for the folder)."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(folder))
    return None if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


class UploadsWithoutRoot:
    """The Trainer's ``HfApi`` with the checkpoint root added to the ignore patterns of
    every ``upload_folder`` of a folder that holds it; everything else is the ``HfApi``'s.

    The Trainer passes fixed patterns (``_*``, ``checkpoint-*``) to ``upload_folder`` in
    ``push_to_hub`` and ``_push_from_checkpoint``; a default root ``<output_dir>/resumable``
    (every checkpoint with optimizer state, ``audit.jsonl``, ``.resumable-lock``) would be
    uploaded with the model. The patterns are arguments of the call, so an upload that runs
    in the background (``run_as_future``) keeps them."""

    def __init__(self, api: Any, root: str) -> None:
        self._api = api
        self._root = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def upload_folder(self, **kwargs: Any) -> Any:
        rel = below(self._root, os.fspath(kwargs["folder_path"]))
        if rel is not None:
            ignore = kwargs.get("ignore_patterns") or []
            ignore = [ignore] if isinstance(ignore, str) else list(ignore)
            kwargs["ignore_patterns"] = [*ignore, f"{rel.replace(os.sep, '/')}/*"]
        return self._api.upload_folder(**kwargs)


def default_preemption() -> Preemption | None:
    """The preemption a `ResumableTrainer` handles unless told otherwise: SIGTERM (what
    Kubernetes, Slurm at the end of a job's time, torchrun and ``docker stop`` send) leads
    to an emergency checkpoint and exit code 75, where the plain Trainer dies at once.
    None when ``train()`` runs outside the main thread (Python allows handlers only
    there) or SIGTERM already has a handler (the script's own, or a framework's): those
    are left alone. SIGUSR1 (Slurm's ``--signal``) only when asked,
    ``preemption=resumable.Preemption()``: tools use it for other things (faulthandler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return Preemption(signals=("SIGTERM",))


def plain_checkpoints(output_dir: str | None) -> list[tuple[int, str]]:
    """The plain Trainer's ``checkpoint-N`` directories in ``output_dir``, newest first."""
    if not output_dir or not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        head, _, n = name.partition("-")
        path = os.path.join(output_dir, name)
        if head == PREFIX_CHECKPOINT_DIR and n.isdigit() and os.path.isdir(path):
            found.append((int(n), path))
    return sorted(found, reverse=True)


def keep_for(args: Any) -> Keep | None:
    """The retention the ``TrainingArguments`` ask for: ``save_total_limit`` newest
    checkpoints (all when unset), plus the best by ``metric_for_best_model`` when
    ``load_best_model_at_end`` (kept besides the newest, as the Trainer does)."""
    limit = args.save_total_limit
    if limit is None or limit <= 0:
        return None
    best = None
    metric = best_metric_key(args)
    if args.load_best_model_at_end and metric is not None:
        best = (metric, "max" if args.greater_is_better else "min", 1)
    return Keep(last=limit, best=best)


def best_metric_key(args: Any) -> str | None:
    """The evaluation metric the Trainer compares (``eval_`` prefixed, as it does)."""
    metric = args.metric_for_best_model
    if metric is None:
        return None
    return metric if metric.startswith("eval_") else f"eval_{metric}"


class ResumableTrainer(Trainer):
    """A ``transformers.Trainer`` that checkpoints through `resumable.Checkpointer` and
    resumes by itself on ``train()``.

    Keyword arguments besides the Trainer's (all optional):
        checkpoint_dir: the checkpoint root: a directory or ``s3://bucket/prefix``
            (default ``<output_dir>/resumable``).
        keep: retention; default `keep_for` the ``TrainingArguments``.
        memory_every: cadence of memory snapshots (e.g. ``Every(steps=1)``), taken at
            step boundaries besides the saves ``save_strategy`` asks for.
        preemption: on its signals (or a cloud notice) an emergency checkpoint at the
            next step boundary, then an exit with `resumable.REQUEUE_EXIT_CODE`. By default
            `default_preemption`: SIGTERM, unless something else already handles it;
            ``None`` leaves every signal alone.
        persist, on_busy, mirror, mirror_keep, storage_options, replicas: as for `Checkpointer`.
            ``on_busy`` defaults to ``"wait"``: every save the Trainer asks for commits.

    The keywords are checked here, by `resumable.CheckpointOptions.from_kwargs` as the
    `Checkpointer`'s are (a bad one raises `resumable.OptionError`), and kept as
    ``options``, which every `Checkpointer` this opens is given.

    With DeepSpeed (any ZeRO stage) the engine's whole state is checkpointed through
    `resumable.integrations.deepspeed.DeepSpeedState`. Not supported: FSDP through
    accelerate and SageMaker model parallelism; constructing with FSDP raises
    `CheckpointError` (use FSDP2 with a `Checkpointer` directly, ``docs/distributed.md``).
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep: Keep | str | None = "from_args",
        memory_every: Every | None = None,
        preemption: Preemption | str | None = "default",
        persist: str = "auto",
        on_busy: str = "wait",
        mirror: str | None = None,
        mirror_keep: Keep | None = None,
        storage_options: Mapping[str, Any] | None = None,
        replicas: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled:
            raise CheckpointError(
                "ResumableTrainer does not checkpoint accelerate's FSDP wrapper; use the plain "
                "Trainer there, or FSDP2 with a resumable.Checkpointer (docs/distributed.md)"
            )
        root = (
            checkpoint_dir
            if checkpoint_dir is not None
            else os.path.join(self.args.output_dir or ".", "resumable")
        )
        self.checkpoint_dir = os.fspath(root)
        local = local_root(self.checkpoint_dir)
        if (
            self.args.push_to_hub
            and local is not None
            and below(local, self.args.output_dir or ".") == os.curdir
        ):
            raise CheckpointError(
                f"checkpoint_dir is output_dir ({self.args.output_dir}), which push_to_hub "
                "uploads: the checkpoints would go to the Hub. Leave checkpoint_dir unset "
                "(<output_dir>/resumable, never uploaded) or pick another directory"
            )
        if isinstance(preemption, str) and preemption != "default":
            raise OptionError(
                f"preemption must be a resumable.Preemption, None or 'default', got {preemption!r}"
            )
        if keep == "from_args":
            keep = keep_for(self.args)
        # "default" is resolved when training starts: it looks at the signal handlers then.
        self._default_preemption = preemption == "default"
        self.options = CheckpointOptions.from_kwargs(
            persist_every=FRAMEWORK_DRIVEN,
            keep=keep,  # type: ignore[arg-type]  # another str is refused there
            memory_every=memory_every,
            preemption=None if isinstance(preemption, str) else preemption,
            persist=persist,
            on_busy=on_busy,
            mirror=mirror,
            mirror_keep=mirror_keep,
            storage_options=storage_options,
            replicas=replicas,
            capture_rng=False,  # the "rng" slot holds them, applied where the Trainer does
            save_on_close=False,  # the Trainer's save_strategy decides every save
        )
        self.checkpointer: Checkpointer | None = None
        self._marker = f"resumable:{self.checkpoint_dir}"
        self._eval_metrics: dict[str, float] = {}
        self._boundary: int | None = None
        self._importing: str | None = None  # the plain checkpoint being imported
        self._slots = {
            "trainer": StagedState(self._trainer_state, lambda _: None),
            "optimizer": StagedState(self._optimizer_state, self._load_optimizer),
            "scheduler": StagedState(self._scheduler_state, self._load_scheduler),
            "scaler": StagedState(self._scaler_state, self._load_scaler_state),
            "rng": StagedState(rng_state, set_rng_state),
        }
        if self.is_deepspeed_enabled:
            # The engine holds model and optimizer (and a scheduler DeepSpeed's config
            # names); it exists only once training starts, so its state is staged too.
            from resumable.integrations.deepspeed import DeepSpeedState

            del self._slots["optimizer"]
            engine = StagedState(self._engine_state, self._load_engine)
            engine.resumable_per_rank = True  # type: ignore[attr-defined]
            engine.resumable_world_size_hint = (  # type: ignore[attr-defined]
                DeepSpeedState.resumable_world_size_hint
            )
            self._slots = {"engine": engine, **self._slots}

    # ------------------------------------------------------------------ state slots

    def _trainer_state(self) -> dict[str, Any]:
        return {"json": json.dumps(dataclasses.asdict(self.state), sort_keys=True)}

    def _optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict() if self.optimizer is not None else {}

    def _load_optimizer(self, sd: dict[str, Any]) -> None:
        if self.optimizer is None:
            raise CheckpointError("the Trainer has no optimizer to load the checkpoint into")
        self.optimizer.load_state_dict(sd)

    def _engine(self) -> Any:
        """The DeepSpeed engine, once ``deepspeed.initialize`` made it (else None)."""
        import deepspeed

        engine = self.model_wrapped
        return engine if isinstance(engine, deepspeed.DeepSpeedEngine) else None

    def _engine_state(self) -> dict[str, Any]:
        from resumable.integrations.deepspeed import DeepSpeedState

        engine = self._engine()
        return DeepSpeedState(engine).state_dict() if engine is not None else {}

    def _load_engine(self, sd: dict[str, Any]) -> None:
        from resumable.integrations.deepspeed import DeepSpeedState

        engine = self._engine()
        if engine is None:
            raise CheckpointError("the Trainer has no DeepSpeed engine to load the checkpoint into")
        DeepSpeedState(engine).load_state_dict(sd)

    def _engine_owns_scheduler(self) -> bool:
        """Whether DeepSpeed's config made the scheduler (then the engine's state has it)."""
        return self.is_deepspeed_enabled and type(self.lr_scheduler).__name__ in (
            "DeepSpeedSchedulerWrapper",
            "DummyScheduler",
        )

    def _scheduler_state(self) -> dict[str, Any]:
        if self.lr_scheduler is None or self._engine_owns_scheduler():
            return {}
        return self.lr_scheduler.state_dict()

    def _load_scheduler(self, sd: dict[str, Any]) -> None:
        if not sd and self._engine_owns_scheduler():
            return
        if self.lr_scheduler is None:
            raise CheckpointError("the Trainer has no LR scheduler to load the checkpoint into")
        self.lr_scheduler.load_state_dict(sd)

    def _scaler(self) -> Any:
        return getattr(self.accelerator, "scaler", None)

    def _scaler_state(self) -> dict[str, Any]:
        scaler = self._scaler()
        return dict(scaler.state_dict()) if scaler is not None else {}

    def _load_scaler_state(self, sd: dict[str, Any]) -> None:
        scaler = self._scaler()
        if scaler is not None and sd:
            scaler.load_state_dict(sd)

    def _state(self) -> dict[str, Any]:
        if self.is_deepspeed_enabled:  # the engine slot holds the model
            return dict(self._slots)
        return {"model": self.model, **self._slots}

    # ------------------------------------------------------------------ the run

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Train, resuming from the newest valid checkpoint in `checkpoint_dir` if there
        is one. ``resume_from_checkpoint`` may be None or a bool (it resumes anyway), or
        the newest ``checkpoint-N`` in ``output_dir`` (what ``get_last_checkpoint`` finds,
        which scripts pass by themselves); any other path is refused."""
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.fspath(resume_from_checkpoint)
            plain = plain_checkpoints(self.args.output_dir)
            if not (plain and os.path.realpath(path) == os.path.realpath(plain[0][1])):
                raise ValueError(
                    f"ResumableTrainer resumes by itself from {self.checkpoint_dir} (the first "
                    "time from the plain Trainer's newest checkpoint-N in output_dir); it does "
                    f"not resume from a directory it is given ({path!r}). Call train() without "
                    "resume_from_checkpoint, and drop --resume_from_checkpoint from the command "
                    "line (scripts such as run_clm.py pass TrainingArguments."
                    "resume_from_checkpoint to train())"
                )
            # What get_last_checkpoint(output_dir) finds, which many scripts pass by
            # themselves: the same as resuming by itself.
            log.info("resume_from_checkpoint=%s: resuming by itself", path)
        return super().train(
            resume_from_checkpoint=None, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def _inner_training_loop(
        self,
        batch_size: int | None = None,
        args: Any = None,
        resume_from_checkpoint: str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        options = self.options
        if self._default_preemption:
            options = dataclasses.replace(options, preemption=default_preemption())
        self.checkpointer = Checkpointer(self.checkpoint_dir, state=self._state(), options=options)
        with self.checkpointer:
            for slot in self._slots.values():
                slot.discard()
            step = self.checkpointer.restore()
            self._boundary = step if step > 0 else None
            resume: str | None = self._marker if step > 0 else None
            plain = plain_checkpoints(self.args.output_dir)
            if step > 0:
                log.info("resuming from step %d of %s", step, self.checkpointer.url)
                if plain and plain[0][0] > step:
                    log.warning(
                        "%s holds the plain Trainer's %s, newer than the step %d resumed "
                        "from %s; it is not used",
                        self.args.output_dir,
                        os.path.basename(plain[0][1]),
                        step,
                        self.checkpointer.url,
                    )
            elif plain:
                resume = self._import_plain(plain)
            output = super()._inner_training_loop(
                batch_size, args, resume, trial, ignore_keys_for_eval
            )
        # The Trainer waited for its pushes at the end of training.
        self._drop_pushed(os.path.join(self.args.output_dir or ".", HUB_STAGING))
        return output

    def _import_plain(self, plain: list[tuple[int, str]]) -> str:
        """A job switched over from the plain Trainer: no checkpoint of ours yet, but
        ``checkpoint-N`` directories in ``output_dir``. Resume from the newest complete one
        through the Trainer's own resume path (model here, as ``Trainer.train`` does before
        ``accelerator.prepare``; the ``TrainerState``, optimizer, scheduler, scaler and
        random streams where the Trainer loads them), and save it as our first checkpoint
        once all of it is loaded (`_load_rng_state`). Returns the directory, which the
        Trainer's loop gets as its ``resume_from_checkpoint``."""
        for n, path in plain:
            if not os.path.isfile(os.path.join(path, hf_trainer.TRAINER_STATE_NAME)):
                log.warning(
                    "skipping the plain Trainer's %s: it has no %s (killed while saving?)",
                    path,
                    hf_trainer.TRAINER_STATE_NAME,
                )
                continue
            optimizers = (hf_trainer.OPTIMIZER_NAME, hf_trainer.OPTIMIZER_NAME_BIN)
            if not self.is_deepspeed_enabled and not any(
                os.path.isfile(os.path.join(path, name)) for name in optimizers
            ):
                raise CheckpointError(
                    f"{path} holds no optimizer state (saved with save_only_model?): "
                    "ResumableTrainer would import it with a fresh optimizer. Resume it with "
                    "the plain Trainer (train(resume_from_checkpoint=...)), or move the "
                    f"checkpoint-* directories out of {self.args.output_dir} to start over"
                )
            log.warning(
                "no checkpoint in %s yet: importing the plain Trainer's %s and continuing "
                "at step %d",
                self.checkpoint_dir,
                path,
                n,
            )
            if not self.is_deepspeed_enabled:  # DeepSpeed loads it in _prepare_for_training
                self._load_from_checkpoint(path)
            self._importing = path
            return path
        raise CheckpointError(
            f"{self.args.output_dir} holds the plain Trainer's "
            f"{', '.join(os.path.basename(p) for _, p in plain)}, none of them complete "
            f"(no {hf_trainer.TRAINER_STATE_NAME}), and no checkpoint in "
            f"{self.checkpoint_dir}. Move the checkpoint-* directories out of "
            f"{self.args.output_dir} to start over"
        )

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        if resume_from_checkpoint != self._marker:  # None, or a plain checkpoint imported
            return super()._init_training_state(
                max_steps,
                num_update_steps_per_epoch,
                num_train_epochs,
                resume_from_checkpoint,
                trial,
            )
        saved = self._slots["trainer"].pending
        self._slots["trainer"].discard()
        if saved is None or not isinstance(saved.get("json"), str):
            raise CheckpointError(
                f"the checkpoint restored from {self.checkpoint_dir} holds no TrainerState; "
                "it was not written by ResumableTrainer. Use another checkpoint_dir"
            )
        super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial
        )
        self.state = TrainerState(**json.loads(saved["json"]))
        best = self.state.best_global_step
        if (
            self.state.best_model_checkpoint is not None
            and not self._best_is_plain()
            and (best is None or self.checkpointer is None or best not in self.checkpointer.steps())
        ):
            log.warning(
                "the best checkpoint %s recorded in the resumed state is gone; ignoring it",
                self.state.best_model_checkpoint,
            )
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()
        epochs_trained = self.state.global_step // num_update_steps_per_epoch
        steps_in_epoch = 0
        if not self.args.ignore_data_skip:
            steps_in_epoch = self.state.global_step % num_update_steps_per_epoch
            steps_in_epoch *= self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        if self.state.global_step >= max_steps:
            # The run had finished (or was killed after its last step, before it exited):
            # the Trainer would still start an epoch and take one more step before its
            # flow callback stops it. Run no epoch; train() goes straight to its end.
            log.info(
                "the checkpoint of step %d is at max_steps=%d: nothing left to train",
                self.state.global_step,
                max_steps,
            )
            return num_train_epochs, 0
        return epochs_trained, steps_in_epoch

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> Any:
        if not (self.is_deepspeed_enabled and resume_from_checkpoint == self._marker):
            return super()._prepare_for_training(
                max_steps, train_dataloader, resume_from_checkpoint
            )
        # With DeepSpeed the Trainer loads its checkpoint right after the engine exists
        # (deepspeed_load_checkpoint), then the scheduler and scaler: the same, here.
        prepared = super()._prepare_for_training(max_steps, train_dataloader, None)
        self._slots["engine"].apply()
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self._load_scaler(resume_from_checkpoint)
        return prepared

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if resume_from_checkpoint != self._marker:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the model was restored in place by Checkpointer.restore

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint != self._marker:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if "optimizer" in self._slots:  # with DeepSpeed, the engine slot holds it
            self._slots["optimizer"].apply()
        self._slots["scheduler"].apply()

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint != self._marker:
            super()._load_scaler(checkpoint)
            return
        self._slots["scaler"].apply()

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint != self._marker:
            super()._load_rng_state(checkpoint)
            if checkpoint is not None and checkpoint == self._importing:
                # Everything of the plain checkpoint is loaded now: our first checkpoint.
                self._importing = None
                if self.checkpointer is not None:
                    self.checkpointer.save(self.state.global_step)
                    self._boundary = self.state.global_step
            return
        self._slots["rng"].apply()

    # ------------------------------------------------------------------ saving

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        self._eval_metrics = {"step": self.state.global_step, **metrics}
        return super()._determine_best_metric(metrics, trial)

    def _metrics_now(self) -> dict[str, float]:
        """This step's evaluation metrics (for ``Keep(best=...)``), if it evaluated."""
        m = self._eval_metrics
        if m.get("step") != self.state.global_step:
            return {}
        return {
            k: float(v)
            for k, v in m.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, as one atomic `Checkpointer.save` of the whole state."""
        ckpt = self.checkpointer
        if ckpt is None:
            raise CheckpointError("ResumableTrainer saves only inside train()")
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = self.state.global_step
        best = self.state.best_global_step
        if (
            self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
            and best
            and (best == step or best in ckpt.steps())
        ):
            self.state.best_model_checkpoint = self.step_location(best)
        stateful: Any = self.state.stateful_callbacks or {}
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(stateful[name], list):
                    stateful[name].append(cb.state())
                else:
                    stateful[name] = cb.state()
        ckpt.save(step, metrics=self._metrics_now())
        self._boundary = step
        if self.args.push_to_hub and self.args.hub_strategy != HubStrategy.END:
            self._push_save()

    # ------------------------------------------------------------------ the Hub

    @contextlib.contextmanager
    def _uploads_without_root(self) -> Iterator[None]:
        """While the Trainer uploads: its ``hf_api()`` leaves the checkpoint root out
        (`UploadsWithoutRoot`). Training thread only."""
        local = local_root(self.checkpoint_dir)
        original = getattr(hf_trainer, "hf_api", None)
        if local is None:  # an object-store root is never in a folder the Trainer uploads
            yield
            return
        if original is None:
            raise CheckpointError(
                "this transformers version does not upload through transformers.trainer."
                "hf_api, so ResumableTrainer cannot keep the checkpoints out of push_to_hub; "
                f"put checkpoint_dir outside output_dir ({self.args.output_dir})"
            )
        setattr(hf_trainer, "hf_api", lambda: UploadsWithoutRoot(original(), local))  # noqa: B010
        try:
            yield
        finally:
            setattr(hf_trainer, "hf_api", original)  # noqa: B010

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``push_to_hub``, without the checkpoint root."""
        with self._uploads_without_root():
            return super().push_to_hub(*args, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        with self._uploads_without_root():
            super()._push_from_checkpoint(checkpoint_folder)

    def _push_save(self) -> None:
        """What the plain Trainer pushes at a save (``hub_strategy``): the model files
        (``"every_save"``), and with ``"checkpoint"``/``"all_checkpoints"`` a whole
        ``checkpoint-N`` folder the plain Trainer can resume from. Written into
        `HUB_STAGING` with the Trainer's own save methods, then pushed by its
        ``_push_from_checkpoint``. Every rank calls it (``save_model`` gathers under
        DeepSpeed); only the first process pushes."""
        staging = os.path.join(self.args.output_dir or ".", HUB_STAGING)
        self._drop_pushed(staging)
        folder = os.path.join(staging, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_model(folder, _internal_call=True)
        whole = self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
        if whole and not self.args.save_only_model:
            self._save_optimizer_and_scheduler(folder)
            self._save_scaler(folder)
            self._save_rng_state(folder)
            if self.args.should_save:
                self.state.save_to_json(os.path.join(folder, hf_trainer.TRAINER_STATE_NAME))
        self._push_from_checkpoint(folder)

    def _drop_pushed(self, staging: str) -> None:
        """Empty `HUB_STAGING` once no push from it is in progress (first process)."""
        push = getattr(self, "push_in_progress", None)
        if self.args.should_save and (push is None or push.is_done()):
            shutil.rmtree(staging, ignore_errors=True)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        step = self.state.global_step
        if self.checkpointer is not None and step != self._boundary:
            self._boundary = step
            self.checkpointer.maybe_save(step, metrics=self._metrics_now())

    def step_location(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (recorded as ``best_model_checkpoint``)."""
        return f"{self.checkpoint_dir.rstrip('/')}/{step_dir(step)}"

    def _best_is_plain(self) -> bool:
        """Whether the best checkpoint is a plain Trainer's ``checkpoint-N`` that is still
        there (recorded before the job was switched over, `_import_plain`)."""
        path = self.state.best_model_checkpoint
        return (
            path is not None
            and os.path.basename(path).startswith(f"{PREFIX_CHECKPOINT_DIR}-")
            and os.path.isdir(path)
        )

    def _load_best_model(self) -> None:
        ckpt = self.checkpointer
        best = self.state.best_global_step
        if ckpt is None or not best:
            return
        if best not in ckpt.steps() and self._best_is_plain():
            super()._load_best_model()  # the Trainer loads it from the plain directory
            return
        ckpt.wait()
        log.info("loading the model of the best step %d (score %s)", best, self.state.best_metric)
        with torch.no_grad():
            ckpt.restore(step=best)  # the model in place; the staged slots are dropped
        if "engine" in self._slots:  # DeepSpeed: the best step's whole engine state
            self._slots["engine"].apply()
        for slot in self._slots.values():
            slot.discard()
